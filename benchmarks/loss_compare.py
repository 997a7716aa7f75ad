"""Losses, noise and the optimizer compared one change at a time at equal data and steps.

    python benchmarks/loss_compare.py benchmarks/losses-cpu.yaml --out /tmp/lossbench
    python benchmarks/loss_compare.py CONFIG --out DIR --variants kl,tv --no-evaluate

Runs prepare..extract once in DIR/base (`drafter run CONFIG --until extract`), then for each
variant copies those step folders (hard links: the same shards byte for byte) into DIR/NAME and
runs train, export and evaluate there with the variant's overrides. Prints one row per variant
(the final validation's simulated τ at each temperature, teacher-forced on the held-out split,
and evaluate's chain τ at each temperature) and writes DIR/results.json. A variant whose
evaluate is done is read back, not run again.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = ("prepare", "generate", "tokenize", "vocab", "extract")

# name -> overrides, each one change against "kl" (today's loss); kl-seed1 measures the noise
VARIANTS = {
    "kl": [],
    "kl-seed1": ["train.seed=1"],
    "tv": ["train.loss=[{kind: tv}]"],
    "nla": ["train.loss=[{kind: nla}]"],
    "lk": ["train.loss=[{kind: lk}]"],
    "ce-tv": ["train.loss=[{kind: ce, weight: 0.1}, {kind: tv, weight: 0.9}]"],
    "dpace": ["train.position_weight=dpace"],
    "ce-tv-dpace": ["train.loss=[{kind: ce, weight: 0.1}, {kind: tv, weight: 0.9}]",
                    "train.position_weight=dpace"],   # the two best changes together
    "noise": ["train.noise=0.05"],
    "muon": ["train.optimizer=muon"],
    # the drafter kinds (benchmarks/kinds-cpu.yaml): eagle3 is "kl" under its own name
    "eagle3": [],
    "dflash": ["train.method=dflash"],
    "dspark": ["train.method=dspark"],
    "dspark-kl": ["train.method=dspark", "train.loss=[{kind: kl}]"],   # the loss, not the kind
}


def drafter(args: list[str], log: Path) -> float:
    t = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    with open(log, "a") as f:
        p = subprocess.run([sys.executable, "-m", "drafter.cli", *args], cwd=REPO, env=env,
                           stdout=f, stderr=subprocess.STDOUT, check=False)
    if p.returncode:
        raise SystemExit(f"drafter {' '.join(args)} failed: see {log}")
    return time.perf_counter() - t


def figures(run: Path) -> dict:
    m = json.loads((run / "train" / "manifest.json").read_text())
    val = m.get("val") or {}
    out = {"val_sim_tau": val.get("sim_tau_t"), "val_accept_0": val.get("acc"),
           "steps": m.get("final_step"), "train_s": m.get("avg_tokens_per_s"),
           "objective": (m.get("objective") or {}).get("describe")}
    ev = run / "evaluate" / "metrics.json"
    if ev.exists():
        e = json.loads(ev.read_text())
        out["tau"] = {f"{r['temperature']:g}": {
            "tau": r["datasets"]["overall"].get("tau"),
            "steps": r["datasets"]["overall"].get("steps"),
            "accepted": r["datasets"]["overall"].get("accepted")}
            for r in e.get("runs", []) if r.get("drafter") == "drafter"
            and r.get("method") == "chain"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-evaluate", action="store_true")
    ap.add_argument("overrides", nargs="*", help="key=value for every run")
    a = ap.parse_intermixed_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / "base"
    secs = drafter(["run", a.config, f"run_dir={base}", *a.overrides, "--until", "extract"],
                   out / "base.log")
    print(f"shared steps: {secs:.0f} s", flush=True)
    results = {}
    rf = out / "results.json"
    if rf.exists():
        results = json.loads(rf.read_text())
    for name in a.variants.split(","):
        run = out / name
        if not (run / "evaluate" / "manifest.json").exists() or a.no_evaluate:
            for step in SHARED:
                if not (run / step).exists():
                    shutil.copytree(base / step, run / step, copy_function=os.link)
            until = ["--until", "train"] if a.no_evaluate else []
            secs = drafter(["run", a.config, f"run_dir={run}", *a.overrides, *VARIANTS[name],
                            *until], out / f"{name}.log")
            print(f"{name}: {secs:.0f} s", flush=True)
        results[name] = {"overrides": VARIANTS[name], **figures(run)}
        rf.write_text(json.dumps(results, indent=1))
    print("| variant | val sim τ T=0 / 0.7 / 1 | chain τ T=0 / 0.7 / 1 (accepted / steps) |")
    print("|---|---|---|")
    for name, r in results.items():
        v = r.get("val_sim_tau") or {}
        t = r.get("tau") or {}
        print(f"| {name} | " + " / ".join(f"{v[k]:.3f}" for k in ("0", "0.7", "1") if k in v)
              + " | " + " / ".join(f"{t[k]['tau']:.3f} ({t[k]['accepted']}/{t[k]['steps']})"
                                   for k in ("0", "0.7", "1") if k in t) + " |")


if __name__ == "__main__":
    main()
