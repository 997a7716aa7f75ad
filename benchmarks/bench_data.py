"""Data steps at scale: prepare -> tokenize -> vocab on N synthetic multi-turn conversations.

    python benchmarks/bench_data.py --tiny                  # 2,000 conversations, seconds
    python benchmarks/bench_data.py --n 500000 --workers 0  # the large end (workers 0 = auto)
    python benchmarks/bench_data.py --n 50000 --target Qwen/Qwen3-8B --workers 1 8

Conversations are generated here (deterministic, 1-3 turns, answers of 100-600 words), so the
benchmark needs no dataset. Prints one row per tokenize worker count: seconds per step,
conversations/s, tokens/s, and the peak resident memory of the process (and its workers), which
should stay flat as N grows (nothing is held in memory whole).
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the of and to in is that for it as with was on be by this are or from at an which "
         "function value return list data model token layer code test error file step train "
         "vocab draft target python import class def self loop index array string number").split()


def synth(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)

    def text(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    with open(path, "w") as f:
        for i in range(n):
            msgs = []
            for t in range(rng.randint(1, 3)):
                msgs.append({"role": "user", "content": f"[{i}.{t}] " + text(10, 80)})
                msgs.append({"role": "assistant", "content": text(100, 600)})
            f.write(json.dumps({"messages": msgs}) + "\n")


def rss_mib() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return own, kids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=20000, help="conversations")
    ap.add_argument("--tiny", action="store_true", help="2,000 conversations")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 0],
                    help="tokenize.workers values to compare (0 = auto)")
    ap.add_argument("--target", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--keep", action="store_true", help="keep the run directory")
    args = ap.parse_args()
    n = 2000 if args.tiny else args.n
    logging.basicConfig(level=logging.WARNING)

    from drafter.core import config as C
    from drafter.steps import prepare, tokenize, vocab

    work = Path(tempfile.mkdtemp(prefix="bench-data-"))
    src = work / "synthetic.jsonl"
    t = time.time()
    synth(src, n)
    print(f"synthesised {n} conversations ({src.stat().st_size / 2**20:.0f} MiB) in "
          f"{time.time() - t:.1f}s", file=sys.stderr)
    rows = []
    try:
        for w in args.workers:
            cfg = C.load(None, [f"run_dir={work / f'run-w{w}'}", f"target.model={args.target}",
                                f"prepare.sources=[{{path: {src}}}]", "generate.enabled=false",
                                f"tokenize.max_length={args.max_length}", f"tokenize.workers={w}"])
            t0 = time.time()
            p = prepare.main(cfg)
            t1 = time.time()
            tk = tokenize.main(cfg)
            t2 = time.time()
            v = vocab.main(cfg)
            t3 = time.time()
            own, kids = rss_mib()
            c = tk["counts"]
            rows.append((w, n, t1 - t0, t2 - t1, t3 - t2, c["train"] + c["val"], c["tokens"],
                         v["coverage"], own, kids, p["counts"]["kept"]))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\ntarget {args.target}, {n} conversations, max_length {args.max_length}")
    print(f"{'workers':>7} {'prepare s':>9} {'tokenize s':>10} {'vocab s':>7} {'conv/s':>8} "
          f"{'Mtok/s':>7} {'tokens':>12} {'coverage':>8} {'RSS MiB':>8} {'workers RSS':>11}")
    for w, n, tp, tt, tv, conv, tok, cov, own, kids, _ in rows:
        print(f"{w if w else 'auto':>7} {tp:9.1f} {tt:10.1f} {tv:7.1f} {conv / tt:8.0f} "
              f"{tok / tt / 1e6:7.2f} {tok:12,d} {cov:8.4f} {own:8.0f} {kids:11.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
