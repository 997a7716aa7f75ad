"""The twentieth session's train figures, derived from the raw files beside this script:
    python3 benchmarks/results/derive-twentieth.py
Lane g20: ten 200-step trains t1..t10 in run order after one cold extract, all on this tree's
loader-first train (its "o" trains ran this tree too: see speed_session.sh lane_g20). Lane h20,
when its files are here: n1..n4 this tree, o1..o4 the tree before it (076190b), alternating, n1
first. Columns as derive-nineteenth.py (derive_train.load); setup in parts (setup_parts_s: the
tree before it has none) and the first step's batch and forward (warmup_first_step_s)."""
import glob
import os

import derive_train

HERE = os.path.dirname(os.path.abspath(__file__))


def row(name: str, f: str) -> float:
    m, rs, el, after = derive_train.load(f)
    parts = m.get("setup_parts_s")
    big = "-" if parts is None else " ".join(f"{k} {v:.2f}" for k, v in parts.items()
                                             if v >= 0.1)
    fs = m["warmup_first_step_s"]
    print(f"{name:4} setup {m['setup_s']:5.2f} ({big}) warmup {m['warmup_s']:5.2f} step1 "
          f"{m['warmup_steps_s'][0]:.2f} (batch {fs['batch']:.2f} forward {fs['forward']:.2f} "
          f"backward {fs['backward']:.2f}) wait {m['warmup_data_wait_s']:.2f} avg "
          f"{m['avg_tokens_per_s']:9.0f} steady {m['steady_tokens_per_s']:9.0f} ratio "
          f"{m['avg_over_steady']:.3f} after-warmup {after:.3f} wall {m['setup_s'] + el:5.1f} "
          f"intervals {' '.join(str(round(r['tokens_per_s'] / 1e3)) for r in rs)}k")
    return m["avg_over_steady"]


def summary(label: str, r: list[float]) -> None:
    r = sorted(r)
    print(f"{label}: {len(r)} runs, avg/steady {r[0]:.3f}-{r[-1]:.3f}, "
          f"{sum(x >= 0.85 for x in r)} at or above 0.85")


g = [row(f"t{i}", f"{HERE}/speed-ld-t{i}-twentieth-train-manifest.json") for i in range(1, 11)]
summary("lane g20 (this tree)", g)
summary("lane g20 after its first train", g[1:])
order = [f"{p}{i}" for i in range(1, 5) for p in "no"]
files = {t: f"{HERE}/speed-ab-{t}-twentieth-train-manifest.json" for t in order}
if all(os.path.exists(f) for f in files.values()):
    ab = {t: row(t, files[t]) for t in order}
    for p, label in (("n", "this tree"), ("o", "the tree before")):
        summary(f"lane h20 {label}", [v for t, v in ab.items() if t[0] == p])
elif glob.glob(f"{HERE}/speed-ab-*-twentieth-*"):
    print("lane h20: files missing")
