"""The twenty-first session's train figures, derived from the raw files beside this script:
    python3 benchmarks/results/derive-twenty-first.py
Lane j21 (speed_session.sh start-j21, at 9c10e70): three cold extracts, two 200-step trains
after each, in run order: op1, then o1, o2 on the tree before (5fa95f6, its extract's precompile
child too); p2, then n1, n2, and p3, then n3, n4 on this tree (the merge's Triton kernels
compiled into Inductor's Triton cache in every process: precompile.share_triton_cache). Columns:
derive_train.row. Lane k21 (start-k21, at 9b025b5): five cold extracts with one 200-step train
after each (u1..u5), this tree."""
import os

from derive_train import row, summary

HERE = os.path.dirname(os.path.abspath(__file__))
r = {t: row(t, f"{HERE}/speed-tc-{t}-twenty-first-train-manifest.json")
     for t in ("o1", "o2", "n1", "n2", "n3", "n4")}
summary("lane j21 the tree before", [r["o1"], r["o2"]])
summary("lane j21 this tree", [v for t, v in r.items() if t[0] == "n"])
summary("lane j21 this tree, first after an extract", [r["n1"], r["n3"]])
# lane k21 (start-k21, at 9b025b5): five cold extracts, one 200-step train after each (u1..u5)
u = [row(f"u{i}", f"{HERE}/speed-uc-u{i}-twenty-first-train-manifest.json") for i in range(1, 6)]
summary("lane k21 (this tree, each the first after an extract)", u)
summary("this tree in both lanes", [v for t, v in r.items() if t[0] == "n"] + u)
