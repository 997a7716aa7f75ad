"""Does compact storage cost acceptance? The same drafter trained on each storage option.

    python benchmarks/storage_quality.py CONFIG [key=value ...]      # e.g. a SmolLM2 config
    python benchmarks/storage_quality.py --tiny                     # any machine, minutes on CPU

Runs the config's prepare -> generate -> tokenize -> vocab once, then for each storage option
(extract.aux_dtype x extract.teacher) extract and train in a run dir of its own, with the same
seed and data, and prints the validation accuracy per TTT step and the simulated acceptance length
(sim_tau) of the final drafter, next to bytes/token. Goal: fp8 + topk within 1% of bf16 + hidden.
The run dirs stay under --out (default: the config's run_dir + "-storage").
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter.core import config as C  # noqa: E402
from drafter.core.rundir import Run  # noqa: E402
from drafter.run import pipeline  # noqa: E402

OPTIONS = [("bf16", "hidden"), ("bf16", "topk"), ("fp8", "hidden"), ("fp8", "topk")]
UPSTREAM = ["prepare", "generate", "tokenize", "vocab"]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def tiny_config(out: Path) -> tuple[Path, list[str]]:
    """A tiny random Llama with the SmolLM2 tokenizer on ShareGPT answers (no generation)."""
    from drafter.core.target import resolve
    from tests.tiny import make_tiny

    model = make_tiny("llama", out, tokenizer_dir=Path(resolve("builtin:smollm2-135m-instruct")))
    data = SHARED / "train" / "sharegpt_dummy_conversation.json"
    return None, [f"run_dir={out / 'run'}", f"target.model={model}",
                  f"prepare.sources=[{{path: {data}, max_samples: 120}}]",
                  "generate.enabled=false", "tokenize.max_length=128", "tokenize.workers=1",
                  "vocab.draft_vocab_size=1024", "extract.topk=32", "train.ttt_steps=3",
                  "train.epochs=2", "train.batch_tokens=1024", "train.max_length=128",
                  "train.lr=1e-3", "train.eval_every=0", "train.save_every=100000",
                  "train.log_every=1000"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", help="drafter YAML config")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. extract.topk=32")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--options", default="all", help="comma list like fp8/topk,bf16/hidden")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    options = OPTIONS if a.options == "all" else \
        [tuple(o.split("/")) for o in a.options.split(",")]
    overrides = list(a.overrides)
    config = a.config
    if a.tiny:
        tmp = Path(a.out or tempfile.mkdtemp(prefix="drafter-storage-"))
        config, extra = tiny_config(tmp)
        overrides = extra + overrides
    cfg = C.load(config, overrides)
    out = Path(a.out) if a.out else Path(cfg.run_dir + "-storage")
    base = Run(out / "base")
    cfg_base = C.load(config, overrides + [f"run_dir={base.root}"])
    pipeline.run_all(cfg_base, steps=UPSTREAM)

    rows = []
    for aux_dtype, teacher in options:
        name = f"{aux_dtype}-{teacher}"
        run = Run(out / name)
        for step in UPSTREAM:
            if not run.step_dir(step).exists():
                shutil.copytree(base.step_dir(step), run.step_dir(step))
        c = C.load(config, overrides + [f"run_dir={run.root}", f"extract.aux_dtype={aux_dtype}",
                                        f"extract.teacher={teacher}"])
        ext = pipeline.run_step(c, "extract")
        tr = pipeline.run_step(c, "train")
        val = tr.get("val") or {}
        rows.append({"option": f"{aux_dtype} + {teacher}", "bytes_per_token": ext["bytes_per_token"],
                     "ratio": ext["ratio_to_reference"], "acc": val.get("acc"),
                     "sim_tau": val.get("sim_tau"), "loss": val.get("loss")})
        print(json.dumps(rows[-1]), flush=True)

    ref = rows[0]
    print(f"\n| option | bytes/token | vs 8*Ht+16 | val acc (TTT steps) | sim_tau | "
          f"sim_tau vs {ref['option']} |")
    print("|---|---:|---:|---|---:|---:|")
    for r in rows:
        acc = " ".join(f"{x:.3f}" for x in r["acc"]) if r["acc"] else "-"
        tau = f"{r['sim_tau']:.3f}" if r["sim_tau"] is not None else "-"
        rel = f"{(r['sim_tau'] / ref['sim_tau'] - 1) * 100:+.2f}%" \
            if r["sim_tau"] and ref["sim_tau"] else "-"
        print(f"| {r['option']} | {r['bytes_per_token']:,.0f} | {r['ratio']:.3f} | {acc} | "
              f"{tau} | {rel} |")
    print(f"\nrun dirs under {out}; each train/metrics.jsonl has the curves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
