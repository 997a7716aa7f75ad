"""What train's `target_config` setup part is (issue 18: 3.6-4.4 s of a 5.8-7.0 s setup on the
H200): the import of transformers, or reading the config. In a fresh process, after the imports
train has before its setup starts, `target.load_config` of a config's target, timed; then again
(transformers imported by then):

    python benchmarks/config_import.py configs/quickstart.yaml
"""
import collections
import sys
import time

import drafter.cli  # noqa: F401 - the modules train's process has before its setup
import drafter.steps.train  # noqa: F401
from drafter.core import config, target

cfg = config.load(sys.argv[1] if len(sys.argv) > 1 else "configs/quickstart.yaml")
before = set(sys.modules)
for run in ("first", "second"):
    t = time.perf_counter()
    target.load_config(cfg.target)
    dt = time.perf_counter() - t
    top = collections.Counter(m.split(".")[0] for m in set(sys.modules) - before)
    print(f"{run} load_config {dt:.2f} s; modules imported so far: {sum(top.values())} ("
          + ", ".join(f"{k} {n}" for k, n in top.most_common(8)) + ")")
