"""Step order, the skip/stale logic, and what happens between steps.

A step's fingerprint is the hash of the config sections it depends on (rundir.SECTIONS) plus the
hashes of its inputs' manifests (rundir.INPUTS). Running a step:

- inputs missing      -> MissingInput naming the step that makes them;
- manifest matches    -> skipped (unless force);
- a partial folder from an interrupted run with the same fingerprint -> the step resumes in it;
- otherwise (config or inputs changed, or force) -> the folder is cleared and the step runs.

Each step's `main(cfg)` returns a dict of counts (and optional extras); this module writes
`manifest.json` with counts, timings and package versions, or `failed.json` on an error.
"""
from __future__ import annotations

import hashlib
import json
import logging
import platform
import shutil
import signal
import time
from typing import Callable

from . import config as C
from .rundir import INPUTS, SECTIONS, STEPS, MissingInput, Run, atomic_json, atomic_write, \
    dir_bytes, read_json

log = logging.getLogger("drafter")


def _step_fn(name: str) -> Callable:
    """The step's main(cfg). Imported lazily so that `drafter status` stays fast."""
    import importlib

    return importlib.import_module(f"drafter.steps.{name}").main


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("drafter", "torch", "transformers", "safetensors", "pyarrow"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def _section_value(cfg, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def config_hash(cfg, step: str) -> str:
    parts = {s: C.to_dict(_section_value(cfg, s)) for s in SECTIONS[step]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def manifest_hash(run: Run, step: str) -> str | None:
    p = run.manifest(step)
    return hashlib.sha256(p.read_bytes()).hexdigest()[:16] if p.exists() else None


def fingerprint(cfg, run: Run, step: str) -> dict:
    inputs = {}
    for dep in INPUTS[step]:
        h = manifest_hash(run, dep)
        if h is None:
            raise MissingInput(f"step '{step}' needs the output of '{dep}', which is not in "
                               f"{run.root}: run `drafter {dep} CONFIG` first "
                               f"(or `drafter run CONFIG`)")
        inputs[dep] = h
    return {"config": config_hash(cfg, step), "inputs": inputs}


def state(cfg, run: Run, step: str, _memo: dict | None = None) -> str:
    """done / stale / pending / failed (a step is stale when any input is)."""
    memo = {} if _memo is None else _memo
    if step in memo:
        return memo[step]
    if run.failed(step).exists():
        s = "failed"
    elif not run.manifest(step).exists():
        s = "pending"
    else:
        m = read_json(run.manifest(step))
        try:
            fp = fingerprint(cfg, run, step)
        except MissingInput:
            fp = None
        upstream_stale = any(state(cfg, run, d, memo) in ("stale", "pending", "failed")
                             for d in INPUTS[step])
        s = "done" if fp == m.get("fingerprint") and not upstream_stale else "stale"
    memo[step] = s
    return s


def _raise_on_sigterm():
    """SIGTERM behaves like Ctrl-C: steps unwind (servers stop, files stay consistent)."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        pass


def run_step(cfg, step: str, force: bool = False) -> dict:
    """Run one step unless its manifest is up to date. Returns the manifest."""
    assert step in STEPS, step
    run = Run.of(cfg)
    d = run.step_dir(step)
    fp = fingerprint(cfg, run, step)
    if not force and run.manifest(step).exists() and not run.failed(step).exists():
        m = read_json(run.manifest(step))
        if m.get("fingerprint") == fp:
            log.info("%s: up to date, skipped (use --force to redo)", step)
            return m
    # A partial folder belongs to this fingerprint only if started.json says so; else clear it.
    if d.exists():
        same = run.started(step).exists() and read_json(run.started(step)).get("fingerprint") == fp
        if force or not same or run.manifest(step).exists():
            shutil.rmtree(d)
    d.mkdir(parents=True, exist_ok=True)
    atomic_json(run.started(step), {"fingerprint": fp, "time": time.time()})
    run.root.mkdir(parents=True, exist_ok=True)
    atomic_write(run.config_snapshot(), C.dump(cfg))
    _raise_on_sigterm()
    log.info("%s: running", step)
    t0 = time.time()
    try:
        result = _step_fn(step)(cfg) or {}
    except BaseException as e:
        atomic_json(run.failed(step), {"error": f"{type(e).__name__}: {e}", "time": time.time()})
        raise
    seconds = time.time() - t0
    manifest = {
        "step": step,
        "fingerprint": fp,
        "counts": result.pop("counts", {}),
        **result,
        "started": t0,
        "seconds": round(seconds, 3),
        "versions": versions(),
    }
    atomic_json(run.manifest(step), manifest)
    run.failed(step).unlink(missing_ok=True)
    log.info("%s: done in %.1fs %s", step, seconds, json.dumps(manifest["counts"]))
    return manifest


def run_all(cfg, force: bool = False, steps: list[str] | None = None) -> list[dict]:
    """Run every step in order (each skipped when up to date)."""
    out = []
    for step in steps or STEPS:
        out.append(run_step(cfg, step, force=force))
    return out


def status(run_dir) -> dict:
    """{"steps": [{"name", "state", "dir", "counts", "seconds", "bytes"}]} for `drafter status`."""
    run = Run(run_dir)
    snap = run.config_snapshot()
    if not snap.exists():
        raise FileNotFoundError(f"{run.root} is not a drafter run directory (no config.yaml)")
    cfg = C.load(snap)
    memo: dict = {}
    rows = []
    for step in STEPS:
        m = read_json(run.manifest(step)) if run.manifest(step).exists() else {}
        row = {
            "name": step,
            "state": state(cfg, run, step, memo),
            "dir": str(run.step_dir(step)),
            "counts": m.get("counts", {}),
            "seconds": m.get("seconds"),
            "bytes": dir_bytes(run.step_dir(step)),
        }
        if run.failed(step).exists():
            row["error"] = read_json(run.failed(step)).get("error")
        rows.append(row)
    return {"run_dir": str(run.root), "steps": rows}
