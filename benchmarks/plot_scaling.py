"""τ against training tokens (issue 15), from a run's own files:

    python benchmarks/plot_scaling.py --metrics benchmarks/results/scale-smollm2-train-metrics.jsonl \
        --manifest benchmarks/results/scale-smollm2-train-manifest.json \
        --eval 1020=benchmarks/results/scale-smollm2-step1020-metrics.json \
        --eval 1308=benchmarks/results/scale-smollm2-step1308-metrics.json \
        --reference 15.1e6:1.99:1.69 --out benchmarks/results/scale-smollm2-tau-vs-tokens.png

Lines: the training's own validation estimate (simulated chain τ over the TTT steps, at every
validation pass) against tokens trained on (step x the run's tokens per step), and the evaluated
τ (chain K=5, greedy, MT-bench + HumanEval + GSM8K-200, `drafter evaluate` on the checkpoint).
--reference TOKENS:SIM:EVAL adds an earlier run as points (its validation and evaluated τ).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--metrics", type=Path, required=True)
    ap.add_argument("--manifest", type=Path, required=True)
    ap.add_argument("--eval", action="append", default=[], help="STEP=metrics.json")
    ap.add_argument("--reference", help="TOKENS:SIM_TAU:EVAL_TAU of an earlier run")
    ap.add_argument("--label", default="one pass over 21.1M tokens, lr 6e-4 cosine, online")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    man = json.loads(a.manifest.read_text())
    per_step = man["counts"]["tokens_seen"] / man["final_step"]
    rows = [json.loads(x) for x in a.metrics.read_text().splitlines() if x.strip()]
    val = [(r["step"] * per_step / 1e6, r["sim_tau"]) for r in rows if r.get("split") == "val"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(*zip(*val), marker=".", label=f"validation, simulated τ ({a.label})")
    ev = []
    for spec in a.eval:
        step, path = spec.split("=", 1)
        m = json.loads(Path(path).read_text())
        ev.append((int(step) * per_step / 1e6, m["datasets"]["overall"]["tau"]))
    if ev:
        ax.plot(*zip(*sorted(ev)), marker="o", linestyle="--",
                label="evaluated τ, chain K=5, T=0 (524 prompts)")
    if a.reference:
        tok, sim, evt = (float(x) for x in a.reference.split(":"))
        ax.scatter([tok / 1e6], [sim], marker="s", color="C0", alpha=0.5,
                   label="reference run: 5.0M tokens x 3 epochs, validation")
        ax.scatter([tok / 1e6], [evt], marker="s", color="C1", alpha=0.5,
                   label="reference run, evaluated")
    ax.set_xlabel("tokens trained on (millions)")
    ax.set_ylabel("τ (tokens per target forward)")
    ax.set_title("SmolLM2-135M-Instruct drafter: τ against training tokens (H200)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}: {len(val)} validation points, {len(ev)} evaluated")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
