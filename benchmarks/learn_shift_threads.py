"""The learner's judge decoding at 1 and 2 intra-op threads, on requests a `drafter learn` run
kept (docs/learn.md, "On a CPU"): why the learner runs one thread on a CPU.

    python benchmarks/learn_shift_threads.py runs/learn-shift-learn-t0 [--requests 2]
        [--max-new 16] [--threads 1,2] [--repeat 2]

The run's own config and serving drafter; the held-out requests it kept, each decoded by the
judge (drafter/learn/judge.py) at each thread count in turns, `--repeat` times. Meant to run
beside what shares the machine with a learner (a vLLM serving, other jobs). Prints the seconds
of each decode, then all of them as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    import torch

    from drafter.core import config as C
    from drafter.core.rundir import Run
    from drafter.learn import judge, learner, traffic, versions

    cfg = C.load(str(Path(args.run_dir) / "learn/config.yaml"), [f"run_dir={args.run_dir}"])
    run = Run.of(cfg)
    models = learner.Models(cfg, run)
    hold = [r for r in traffic.kept(run) if r["split"] == "holdout"][:args.requests]
    dr = models.load(versions.serving(run)["version"])
    k = cfg.export.speculative_tokens
    out: dict[int, list[float]] = {}
    for _ in range(args.repeat):
        for n in [int(x) for x in args.threads.split(",")]:
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            judge.acceptance(models.decoder, dr, hold, k, args.max_new, models.stop, 0)
            out.setdefault(n, []).append(round(time.perf_counter() - t0, 2))
            print(f"threads {n}: {out[n][-1]} s ({len(hold)} requests, {args.max_new} new "
                  "tokens each)", flush=True)
    print(json.dumps({"requests": len(hold), "max_new": args.max_new, "seconds": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
