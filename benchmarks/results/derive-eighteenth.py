"""The eighteenth session's train figures, derived from the raw files beside this script:
    python3 benchmarks/results/derive-eighteenth.py
after-warm-up = (tokens - 10 x tokens / steps) / (last elapsed_s - warmup_s) / steady: the
steps after the warm-up against the steady speed; steps51-100/steady: the first whole log
interval after the warm-up against the steady speed (the median of the last half of the
intervals, drafter/train/metrics.py throughput)."""
import glob
import os

import derive_train

HERE = os.path.dirname(os.path.abspath(__file__))
for f in sorted(glob.glob(f"{HERE}/speed-aot-*-eighteenth-train-manifest.json")):
    t = os.path.basename(f).split("-")[2]
    m, rs, el, after = derive_train.load(f)
    n = m["final_step"]
    c = m["warmup_compile"]
    saved = "loaded" if c["saved"] and all(r["result"] == "loaded" for r in c["saved"]) else "jit"
    print(f"{t:3} steps {n} {saved:6} warmup {m['warmup_s']:5.2f} step1 "
          f"{m['warmup_steps_s'][0]:.2f} compile {c['seconds']:.2f} avg "
          f"{m['avg_tokens_per_s']:9.0f} steady {m['steady_tokens_per_s']:9.0f} ratio "
          f"{m['avg_over_steady']:.3f} after-warmup {after:.3f} steps51-100/steady "
          f"{rs[1]['tokens_per_s'] / m['steady_tokens_per_s']:.3f}")
