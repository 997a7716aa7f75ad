"""Seconds train's setup spends reading the target's input embeddings (target.target_embeddings)
in a fresh process, the target's config already loaded as train loads it before:

    python benchmarks/embeddings_time.py [CONFIG]     # default configs/quickstart.yaml

Run it a few times: each run is one fresh process. On two CPU cores with the quickstart's
SmolLM2 target (nineteenth session, BENCHMARKS.md): 1.71-2.12 s while the target was built on
the meta device to find the tensor, 0.01 s reading model.embed_tokens.weight by name.
"""
import sys
import time

from drafter import target
from drafter.config import load

cfg = load(sys.argv[1] if len(sys.argv) > 1 else "configs/quickstart.yaml", [])
target.load_config(cfg.target)
t = time.perf_counter()
e = target.target_embeddings(cfg.target)
print(f"target_embeddings {time.perf_counter() - t:.2f} s {tuple(e.shape)} {e.dtype} "
      f"sum|w| {float(e.float().abs().sum()):.2f}")
