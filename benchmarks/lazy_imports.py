"""What a process's first torch.compile'd call imports, and what it costs with and without bytecode
(issue 18: the lent GPU machine's venv holds no bytecode, so torch.compile's lazy imports are
compiled from source inside train's first step). A three-op function, forward and backward;
run it twice in one TORCHINDUCTOR_CACHE_DIR (the second run is the warm one), then once without
bytecode:

    python benchmarks/lazy_imports.py; python benchmarks/lazy_imports.py
    PYTHONDONTWRITEBYTECODE=1 PYTHONPYCACHEPREFIX=$(mktemp -d) python benchmarks/lazy_imports.py
"""
import sys
import time

import torch
import torch._dynamo  # noqa: F401 - imported before the timer, as train's set-up does
import torch._inductor.config  # noqa: F401

f = torch.compile(lambda x: (x * 2).sin().sum(), dynamic=False)
before = set(sys.modules)
t = time.perf_counter()
f(torch.randn(8, requires_grad=True)).backward()
new = set(sys.modules) - before
print(f"first call {time.perf_counter() - t:.2f} s; modules imported in it: {len(new)}, "
      f"of which torch.*: {sum(m.startswith('torch') for m in new)}")
