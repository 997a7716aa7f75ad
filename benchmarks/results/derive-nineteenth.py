"""The nineteenth session's train figures (lane e19), derived from the raw files beside this
script:
    python3 benchmarks/results/derive-nineteenth.py
after-warm-up = (tokens - 10 x tokens / steps) / (last elapsed_s - warmup_s) / steady: the
steps after the warm-up against the steady speed (the median of the last half of the log
intervals, drafter/train/metrics.py throughput). wall = setup_s + the last elapsed_s: the process's
setup before the loop (the store, the target's config and embeddings, the model) and the
loop's train time (validation and checkpoints set aside)."""
import glob
import json
import os

import derive_train

HERE = os.path.dirname(os.path.abspath(__file__))
ORDER = ["w1", "o1", "w2", "o2", "w3", "o3", "w4", "o4", "o5", "w5", "o6", "w6"]
for t in ORDER:
    f = f"{HERE}/speed-pw-{t}-nineteenth-train-manifest.json"
    m, rs, el, after = derive_train.load(f)
    pw = m["prewarm"]
    ahead = "-" if "skipped" in pw else f"{pw['seconds']:.2f}/{pw['waited_s']:.2f}"
    print(f"{t:3} setup {m['setup_s']:5.2f} ahead(s/waited) {ahead:9} warmup "
          f"{m['warmup_s']:5.2f} step1 {m['warmup_steps_s'][0]:.2f} avg "
          f"{m['avg_tokens_per_s']:9.0f} steady {m['steady_tokens_per_s']:9.0f} ratio "
          f"{m['avg_over_steady']:.3f} after-warmup {after:.3f} wall {m['setup_s'] + el:5.1f} "
          f"intervals {' '.join(str(round(r['tokens_per_s'] / 1e3)) for r in rs)}k")
for grp in ("w", "o"):
    ms = [json.load(open(f)) for f in sorted(glob.glob(f"{HERE}/speed-pw-{grp}*-nineteenth-"
                                                         "train-manifest.json"))]
    r = sorted(m["avg_over_steady"] for m in ms)
    print(f"{grp}: {len(r)} runs, avg/steady {r[0]:.3f}-{r[-1]:.3f}, "
          f"{sum(x >= 0.85 for x in r)} at or above 0.85")
