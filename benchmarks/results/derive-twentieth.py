"""The twentieth session's train figures, derived from the raw files beside this script:
    python3 benchmarks/results/derive-twentieth.py
Lane g20: ten 200-step trains t1..t10 in run order after one cold extract, all on this tree's
loader-first train (its "o" trains ran this tree too: see speed_session.sh lane_g20). Lane h20,
when its files are here: n1..n4 this tree, o1..o4 the tree before it (076190b), alternating, n1
first. Columns: derive_train.row (derive_train.load as derive-nineteenth.py); setup in parts (setup_parts_s: the
tree before it has none) and the first step's batch and forward (warmup_first_step_s)."""
import glob
import os

from derive_train import row, summary

HERE = os.path.dirname(os.path.abspath(__file__))


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
