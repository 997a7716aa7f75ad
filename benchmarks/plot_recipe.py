"""Evaluated τ against training tokens, one line per recipe (issue 15), from evaluate's metrics:

    python benchmarks/plot_recipe.py --out benchmarks/results/recipe-tau-vs-tokens.png \
        --line "loops cut (max_loop_tokens 64), lr 6e-4" \
            trim60:recipe-trim60 trim:recipe-trim main:recipe-main \
        --line "loops kept, lr 6e-4" keep:recipe-keep 16.4e6:scale-smollm2-step1020 \
            21.1e6:scale-smollm2-step1308 \
        --points "one change at 4M tokens (loops cut)" lr12:recipe-lr12 fcnorm:recipe-fcnorm \
            vocab16k:recipe-vocab16k t08:recipe-t08 \
        --points "mid-schedule checkpoints" 15.17e6:recipe-main-epoch1 \
        --points "reference (issue 10)" 15.1e6:reference-smollm2

Each point is X:NAME, read from benchmarks/results/NAME-metrics.json (the primary run: chain
K=5, T=0 over MT-bench + HumanEval + GSM8K-200). X is the tokens trained on, or a run name whose
benchmarks/results/recipe-X-train-manifest.json gives them (counts.tokens_seen); the label of a
--points marker is X when X is a name. Lines join their points in order of tokens.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def tau(name: str) -> float:
    m = json.loads((RESULTS / f"{name}-metrics.json").read_text())
    return m["runs"][0]["datasets"]["overall"]["tau"]


def tokens(x: str) -> tuple[float, str | None]:
    try:
        return float(x), None
    except ValueError:
        man = json.loads((RESULTS / f"recipe-{x}-train-manifest.json").read_text())
        return float(man["counts"]["tokens_seen"]), x


def points(specs: list[str]) -> list[tuple[float, float, str | None]]:
    out = []
    for spec in specs:
        x, _, name = spec.partition(":")
        t, label = tokens(x)
        out.append((t / 1e6, tau(name), label))
    return sorted(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--line", nargs="+", action="append", default=[], metavar="LABEL X:NAME")
    ap.add_argument("--points", nargs="+", action="append", default=[], metavar="LABEL X:NAME")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, *specs in a.line:
        pts = points(specs)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        for x, y, _ in pts:
            ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(4, -11),
                        fontsize=8)
    for (label, *specs), marker in zip(a.points, "s^Dv*P"):
        pts = points(specs)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, linestyle="none", label=label)
        for i, (x, y, name) in enumerate(sorted(pts, key=lambda p: p[1])):  # labels fanned out
            ax.annotate(f"{name + ' ' if name else ''}{y:.2f}", (x, y), textcoords="offset points",
                        xytext=(-62, 10 * i - 4) if len(pts) > 1 else (5, 3), fontsize=7,
                        arrowprops={"arrowstyle": "-", "lw": 0.4} if len(pts) > 1 else None)
    ax.set_xscale("log")
    ax.set_xlabel("tokens trained on (millions; passes counted)")
    ax.set_ylabel("τ, chain K=5, T=0 (evaluate)")
    ax.set_title("SmolLM2-135M-Instruct drafters on one H200: τ against training tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
