"""Step order, the skip/stale logic, and what happens between steps (docs/operations.md).

A step's fingerprint is the hash of the config sections it depends on (rundir.SECTIONS) plus the
hashes of its inputs' manifests (rundir.step_inputs). Running a step:

- inputs missing      -> MissingInput naming the step that makes them;
- manifest matches    -> skipped (unless force);
- a partial folder from an interrupted run with the same fingerprint -> the step resumes in it;
- otherwise (config or inputs changed, or force) -> the folder is renamed away and deleted, and
  the step runs.

Each step's `main(cfg)` returns a dict of counts (and optional extras); this module writes
`manifest.json` with counts, timings and package versions, or `failed.json` on an error or a
signal. Around that:

- one drafter process per run dir (an flock on RUN_DIR/.lock, released by the kernel on kill -9);
- SIGTERM and SIGHUP unwind a step like Ctrl-C, so servers stop and folders stay resumable
  (both in drafter/run/lifecycle.py);
- under torchrun only rank 0 touches the folder; the other ranks wait for its decision;
- `run_all`: the generation server lives inside generate; before the next step that loads the
  target on a GPU, GPU memory must be back at its level from before generate (NVML), or the
  error names the PIDs holding it (drafter/run/gpu_release.py). drafter never kills a process
  it did not start. Online, train's graphs compile in a process of their own until train's
  first step (drafter/train/precompile.py, start_ahead), started before generate when generate
  runs in this process (engine drafter), else before tokenize (or vocab, when tokenize is done; the
  GPU back from generate first); it is stopped when the run ends without a train that took it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import time
from typing import Callable

from drafter.core import config as C
from drafter.core.dist import agent_store, rank_world, restart_count
from drafter.core.rundir import (
    NEUTRAL,
    RETIRED,
    SECTIONS,
    SNAPSHOT_HEADER,
    STEPS,
    UNHASHED,
    Damaged,
    DamagedInput,
    ForeignFolder,
    MissingInput,
    Run,
    atomic_json,
    atomic_write,
    dir_bytes,
    holders,
    read_json,
    remove_dir,
    sealed,
    step_inputs,
)
from drafter.run import chunked, gpu_release, lifecycle
from drafter.run.lifecycle import install_signal_handlers, lock_holder, run_lock, signalled
from drafter.run.preflight import preflight
from drafter.train import precompile  # light: torch is imported where a child starts

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
    for dotted in UNHASHED:
        section, key = dotted.split(".")
        parts.get(section, {}).pop(key, None)
    if step == "extract" and cfg.train.method != "eagle3":  # the block drafters' own layers
        parts["train.dspark.target_layers"] = cfg.train.dspark.target_layers
    # chunks of any size store the same features: whether there are chunks, hashed where the
    # budget was before it became the run's (extract.max_disk_gib), so finished steps stay done
    if "extract" in parts and cfg.max_disk_gib is not None:
        parts["extract"]["max_disk_gib"] = True
    for dotted, value in NEUTRAL.items():  # new fields at their neutral value: as if absent
        for d, key in holders(parts, dotted):
            if key in d and d[key] == value:
                del d[key]
    for dotted, (now, before) in RETIRED.items():  # removed fields, renamed values: as before
        for d, key in holders(parts, dotted):
            if d.get(key) == now:
                d[key] = before
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def manifest_hash(run: Run, step: str) -> str | None:
    p = run.manifest(step)
    return hashlib.sha256(p.read_bytes()).hexdigest()[:16] if p.exists() else None


# Steps whose outputs `_lead` hashes in full before skipping them (a shard or a checkpoint is
# GBs: `status` compares sizes and times only).
HASHED = ("extract", "train")


def damage(run: Run, step: str, full: bool = False) -> str | None:
    """Why a step's finished output cannot be trusted, or None: its manifest is torn or fails
    its checksum, a later step found it damaged (damaged.json), or (extract) a shard is missing,
    resized or rewritten since the index (`full`: its sha256 differs), or (train) the last
    checkpoint fails its checksums. Cheap unless `full`."""
    try:
        m = run.read_manifest(step)
    except Damaged as e:
        return str(e)
    if m is None:
        return None
    if run.damaged(step).exists():
        try:
            return str(read_json(run.damaged(step)).get("reason"))
        except (OSError, ValueError):
            return f"{run.damaged(step)} marks it damaged"
    if step == "extract" and m.get("mode") != "online":  # online: nothing stored
        from drafter.features import store

        bad = store.verify_extract(run, full=full, splits=("val",) if m.get("mode") ==
                                   "chunked" else ("train", "val"))  # chunks: val only
        return "; ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "") \
            if bad else None
    if step == "train":
        from drafter.train.checkpoint import verify_checkpoint

        last = run.checkpoints()
        return verify_checkpoint(last[-1], full=full) if last else None
    return None


def fingerprint(cfg, run: Run, step: str) -> dict:
    inputs = {}
    for dep in step_inputs(cfg, step):
        h = manifest_hash(run, dep)
        if h is None:
            raise MissingInput(f"step '{step}' needs the output of '{dep}', which is not in "
                               f"{run.root}: run `drafter {dep} CONFIG` first "
                               f"(or `drafter run CONFIG`)")
        why = damage(run, dep)
        if why is not None:
            raise DamagedInput(f"step '{step}' needs the output of '{dep}', which is damaged "
                               f"({why}): run `drafter {dep} CONFIG` (it redoes what is "
                               f"damaged and keeps the rest), or `drafter run CONFIG`")
        inputs[dep] = h
    return {"config": config_hash(cfg, step), "inputs": inputs}


def state(cfg, run: Run, step: str, _memo: dict | None = None, running: bool = False) -> str:
    """done / stale / pending / failed / interrupted / running (a step is stale when any input
    is not done). `running`: a drafter process holds the run dir's lock now."""
    memo = {} if _memo is None else _memo
    if step in memo:
        return memo[step]
    if run.failed(step).exists():
        try:
            s = "interrupted" if read_json(run.failed(step)).get("interrupted") else "failed"
        except (OSError, ValueError, AttributeError):
            s = "failed"
    elif not run.manifest(step).exists():
        # started.json without a manifest: the step runs now, or its process was killed
        s = ("running" if running else "interrupted") if run.started(step).exists() else "pending"
    elif damage(run, step) is not None:
        s = "damaged"
    else:
        m = run.read_manifest(step) or {}
        try:
            fp = fingerprint(cfg, run, step)
        except MissingInput:
            fp = None
        upstream_stale = any(state(cfg, run, d, memo, running) != "done"
                             for d in step_inputs(cfg, step))
        s = "done" if fp == m.get("fingerprint") and not upstream_stale else "stale"
    memo[step] = s
    return s


# ----------------------------------------------------------------------------------- torchrun
# Rank 0 may spend minutes clearing a stale folder of shards before the others may start.
RANK_WAIT_S = 3600


def _rank_key(step: str) -> str:
    return f"drafter/pipeline/{step}/{restart_count()}"


# ------------------------------------------------------------------------------------ one step
def _clear(run: Run, step: str) -> None:
    """Remove a step folder atomically (a kill mid-delete leaves a `.trash-*` folder that the
    next run removes, never a half folder that looks like the step's)."""
    remove_dir(run.step_dir(step), run.trash(step))


def _clean_trash(run: Run) -> None:
    for t in run.trash_dirs():
        shutil.rmtree(t, ignore_errors=True)


def _release_memory() -> None:
    """Give back what a finished step left cached on the GPU (the next step's preflight counts
    free memory, and a server started next needs it)."""
    import gc
    import sys

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.ipc_collect()


def up_to_date(run: Run, step: str, fp: dict, full: bool = False) -> dict | None:
    """The step's manifest when it matches `fp`, the step has not failed since and its output
    is intact (`damage`; `full` hashes every shard), else None."""
    if run.manifest(step).exists() and not run.failed(step).exists():
        try:
            m = run.read_manifest(step)
        except Damaged:
            return None
        if m.get("fingerprint") == fp and damage(run, step, full=full) is None:
            return m
    return None


def run_step(cfg, step: str, force: bool = False, **kw) -> dict:
    """Run one step unless its manifest is up to date. Returns the manifest. `kw` goes to the
    step's main (train's `produce`: drafter/run/chunked.py).

    Under torchrun every rank calls this: rank 0 alone decides, clears or keeps the folder and
    writes started.json, manifest.json and failed.json; the other ranks wait for its decision
    (through torchrun's store) and then run the step with it."""
    assert step in STEPS, step
    run = Run.of(cfg)
    rank, world = rank_world()
    if rank != 0:
        return _follow(cfg, run, step, force, **kw)
    preflight(cfg, run, step)  # nothing in the run dir is touched before this passes
    with run_lock(run):
        return _lead(cfg, run, step, force, world, **kw)


def run_command(cfg, step: str, force: bool = False) -> dict:
    """`drafter STEP CONFIG`: run_step, and around it what chunks need (run/chunked.py). A
    restarted producer: its step is done, and train holds the run dir's lock meanwhile."""
    if not chunked.produces_after(cfg, [step]):
        with chunked.train_here(cfg, step, cfg.extract.spool is None) as kw:
            return run_step(cfg, step, force, **kw)
    m = None if force or _will_run(cfg, Run.of(cfg), step) else Run.of(cfg).read_manifest(step)
    m = m or run_step(cfg, step, force)
    chunked.produce(cfg)
    return m


def _lead(cfg, run: Run, step: str, force: bool, world: int, **kw) -> dict:
    d = run.step_dir(step)
    fp = fingerprint(cfg, run, step)
    store = agent_store(RANK_WAIT_S) if world > 1 else None
    # extract's shards and train's last checkpoint are hashed in full here: a byte flipped in
    # place (same size and time) is caught before a later step reads it
    full = step in HASHED
    m = None if force else up_to_date(run, step, fp, full=full)
    if m is not None:
        log.info("%s: up to date, skipped (use --force to redo)", step)
        if store is not None:
            store.set(_rank_key(step), "skip")
        return m
    _check_owned(run, step)
    _verify_inputs(cfg, run, step)
    _clean_trash(run)
    # A partial folder belongs to this fingerprint only if started.json says so; else clear it.
    # A finished one whose output is damaged resumes too: the step redoes what fails its
    # checksums and keeps the rest.
    if d.exists():
        same = _started_fingerprint(run, step) == fp
        why = None if force else damage(run, step, full=full)
        if same and why is not None and run.manifest(step).exists():
            log.warning("%s: %s; redoing what is damaged, keeping the rest", step, why)
            run.manifest(step).unlink()
        elif force or not same or run.manifest(step).exists():
            _clear(run, step)
        else:
            log.info("%s: resuming the partial output in %s", step, d)
    d.mkdir(parents=True, exist_ok=True)
    run.failed(step).unlink(missing_ok=True)
    atomic_json(run.started(step), {"fingerprint": fp, "time": time.time(), "pid": os.getpid()})
    atomic_write(run.config_snapshot(), SNAPSHOT_HEADER + C.dump(cfg))
    if store is not None:
        store.set(_rank_key(step), "run")
    install_signal_handlers()
    log.info("%s: running", step)
    t0 = time.time()
    try:
        result = _step_fn(step)(cfg, **kw) or {}
    except BaseException as e:
        if isinstance(e, Damaged) and e.step in STEPS and e.step != step:
            _mark_damaged(run, e)
        _write_failed(run, step, e)
        if isinstance(e, KeyboardInterrupt) or signalled() is not None:  # where a rerun starts
            log.info("%s: stopped; %s", step, lifecycle.resume_point(cfg, run, step))
        raise
    finally:
        _release_memory()
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
    atomic_json(run.manifest(step), sealed(manifest))
    run.failed(step).unlink(missing_ok=True)
    run.damaged(step).unlink(missing_ok=True)
    log.info("%s: done in %.1fs %s", step, seconds, json.dumps(manifest["counts"]))
    return manifest


def _started_fingerprint(run: Run, step: str) -> dict | None:
    try:
        return read_json(run.started(step)).get("fingerprint")
    except (OSError, ValueError, AttributeError):  # absent or torn: not this fingerprint's
        return None


def _check_owned(run: Run, step: str) -> None:
    """Refuse to clear or write into what drafter did not write: a step folder of the user's
    (no started.json, manifest.json or failed.json in it), or a config.yaml of theirs."""
    names = run.foreign(step)
    if names:
        shown = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
        raise ForeignFolder(
            f"{run.step_dir(step)} holds files drafter did not write ({shown}); drafter keeps "
            f"the {step} step's output there and would replace them. Move them away or choose "
            f"another run_dir; nothing was changed.")
    if not run.snapshot_is_ours():
        raise ForeignFolder(
            f"{run.config_snapshot()} was not written by drafter; drafter keeps the resolved "
            f"config of each command there. Move it away or choose another run_dir; nothing "
            f"was changed.")


def _mark_damaged(run: Run, e: Damaged) -> None:
    """A step found an earlier step's output damaged: record it in that step's folder, so that
    `status` shows it and the next run redoes it (keeping what verifies)."""
    try:
        atomic_json(run.damaged(e.step), {"reason": str(e), "path": e.path, "time": time.time()})
    except OSError as err:
        log.warning("could not write %s: %s", run.damaged(e.step), err)


def _verify_inputs(cfg, run: Run, step: str) -> None:
    """Offline train reads every shard: hash them all before the train folder is touched, so
    that a corrupt shard is redone by extract, never trained on."""
    if step != "train" or cfg.train.online:
        return
    m = None  # chunks: the train split is checked a chunk at a time
    with contextlib.suppress(Damaged):
        m = run.read_manifest("extract")
        if m is None or m.get("mode") == "online":  # nothing stored: train says what to run
            return
    from drafter.features import store

    bad = store.verify_extract(run, full=True, splits=("val",) if (m or {}).get("mode") ==
                               "chunked" else ("train", "val"))
    if bad:
        e = Damaged(f"{'; '.join(bad[:3])}", "extract", run.step_dir("extract"))
        _mark_damaged(run, e)
        raise DamagedInput(f"train needs the output of extract, which is damaged ({e}): run "
                           f"`drafter extract CONFIG` (it redoes only the damaged shards), or "
                           f"`drafter run CONFIG`")


def _follow(cfg, run: Run, step: str, force: bool, **kw) -> dict:
    """A torchrun rank > 0: wait for rank 0's decision on the folder, then do the same."""
    store = agent_store(RANK_WAIT_S)
    if store is not None:
        decision = store.get(_rank_key(step)).decode()
    else:  # launched by hand with RANK/WORLD_SIZE: rank 0 cannot be waited for; trust the files
        fp = fingerprint(cfg, run, step)
        decision = "run" if force or up_to_date(run, step, fp) is None else "skip"
    if decision == "skip":
        return run.read_manifest(step)
    install_signal_handlers()
    try:
        result = _step_fn(step)(cfg, **kw) or {}
    except BaseException as e:
        if isinstance(e, Damaged) and e.step in STEPS and e.step != step:
            _mark_damaged(run, e)
        if not run.failed(step).exists():  # rank 0's own error, if any, says more
            _write_failed(run, step, e)
        raise
    finally:
        _release_memory()
    return {"step": step, "counts": result.pop("counts", {}), **result}


def _write_failed(run: Run, step: str, e: BaseException) -> None:
    sig = signalled()
    interrupted = isinstance(e, KeyboardInterrupt) or sig is not None
    if isinstance(e, KeyboardInterrupt):
        msg = str(e) or "interrupted by SIGINT (Ctrl-C)"
    elif sig is not None:
        msg = f"interrupted by {signal.Signals(sig).name} (it surfaced as {type(e).__name__}: {e})"
    else:
        msg = f"{type(e).__name__}: {e}"
    try:
        atomic_json(run.failed(step), {"error": msg, "interrupted": interrupted,
                                       "time": time.time(), "pid": os.getpid()})
    except OSError as err:  # a full disk must not hide the step's own error
        log.warning("%s: could not write %s: %s", step, run.failed(step), err)


# ------------------------------------------------------------------------- the whole pipeline
# Steps that load the target on a GPU (train online, or making its chunks): before they start,
# the memory that generate's server held must be back.
def loads_target(cfg, step: str) -> bool:
    return step in ("extract", "evaluate") and not (step == "extract" and cfg.train.online) or \
        (step == "train" and (cfg.train.online or chunked.chunked(cfg)))


def starts_server(cfg) -> bool:
    """generate runs the target on this machine (a server drafter starts, or in-process)."""
    return cfg.generate.enabled and cfg.generate.server.engine != "external"


# An online run compiles train's graphs in a child (train/precompile.py, start_ahead) started before
# the first of these steps that runs (either makes train run too). The child outlasts tokenize,
# vocab and train's set-up together (BENCHMARKS.md, Figures behind design choices), so when generate
# runs in this process (engine drafter: its KV pool leaves room for the child) the child starts
# before generate and compiles while it answers; else (a server holds the GPU, or no generate)
# before tokenize or vocab. Not from extract or train: the child would overlap only train's set-up,
# and train would wait for it longer than its first step takes to compile.
AHEAD_OF_TRAIN = ("tokenize", "vocab")


def generates_locally(cfg) -> bool:
    """generate runs the target in this process (engine drafter, the data engine), which leaves
    room on the GPU for train's precompile beside it."""
    return starts_server(cfg) and cfg.generate.server.engine == "drafter"


def starts_precompile(cfg, step: str) -> bool:
    """Whether an online run's precompile starts before `step` when `step` is the first of
    them that runs: generate when it runs in this process, else tokenize or vocab."""
    return step in AHEAD_OF_TRAIN or (step == "generate" and generates_locally(cfg))


def precompiles_ahead(cfg, steps: list[str]) -> bool:
    """Whether this run starts train's precompile ahead of train: an online train among its
    steps, where precompile applies (a GPU, train.compile and extract.precompile on)."""
    from drafter.core import target

    return cfg.train.online and "train" in steps and \
        precompile.applies(cfg, target.pick_device(cfg.target)) is None


def run_all(cfg, force: bool = False, steps: list[str] | None = None) -> list[dict]:
    """Run every step in order (each skipped when up to date). The generation server lives
    only inside generate; before the first later step that loads the target on a GPU, the GPU
    memory must be back at its level from before generate.

    Online (train.online), train's graphs compile in a process of their own until train's
    first step, which waits for it (drafter/train/precompile.py, start_ahead), started before
    the step `starts_precompile` names (AHEAD_OF_TRAIN says why). The release wait counts it as
    this process's own. It is stopped when the run ends without a train that took it."""
    run = Run.of(cfg)
    out = []
    baseline = None
    steps = list(steps or STEPS)
    ahead = precompiles_ahead(cfg, steps)
    for step in steps:  # the whole config, before any step touches the run dir
        preflight(cfg, run, step, upfront=True)
    with run_lock(run):
        try:
            for step in steps:
                will_run = force or _will_run(cfg, run, step)
                starts_ahead = ahead and will_run and starts_precompile(cfg, step)
                if step == "generate" and will_run and starts_server(cfg):
                    # before the child starts (engine drafter): the level generate must give back
                    baseline = gpu_release.gpu_snapshot() or None  # None on a machine without GPU
                elif baseline is not None and will_run and (loads_target(cfg, step) or
                                                            starts_ahead):
                    _wait_gpu_released(cfg, baseline, step)
                    baseline = None
                if starts_ahead:
                    precompile.start_ahead(cfg, before=step)
                    ahead = False
                with chunked.train_here(cfg, step, will_run) as kw:  # chunk by chunk
                    out.append(run_step(cfg, step, force=force, **kw))
        finally:  # one that no train took: the run failed, or stopped before train
            precompile.stop_ahead()
    if chunked.produces_after(cfg, steps):  # a train elsewhere takes the chunks
        chunked.produce(cfg)
    return out


def _wait_gpu_released(cfg, baseline: list, step: str) -> None:
    """gpu_release.wait_gpu_released before `step`, with the precompile child started before
    generate (a new process in this process's session) counted as this process's own."""
    from drafter.core import gpu

    child = precompile.ahead_pid()
    gpu_release.wait_gpu_released(
        baseline, timeout=max(60.0, 2 * cfg.generate.server.stop_timeout),
        what=f"drafter {step}", own=gpu.related_pids() | ({child} if child else set()),
        own_running=precompile.ahead_running)


def _will_run(cfg, run: Run, step: str) -> bool:
    try:
        return up_to_date(run, step, fingerprint(cfg, run, step)) is None
    except MissingInput:
        return True  # an earlier step of this run makes it


def status(run_dir) -> dict:
    """{"run_dir", "running_pid", "bytes", "seconds", "steps": [{"name", "state", "activity",
    "dir", "counts", "seconds", "bytes", "started", "tokens_per_s"?, "error"?}]} for
    `drafter status`; state is done / stale / pending / failed.
    A running step's seconds are the time since it started (this invocation)."""
    snap = Run(run_dir).config_snapshot()
    if not snap.is_file():
        raise FileNotFoundError(f"{run_dir} is not a drafter run directory (no config.yaml)")
    # the ranges are not checked again: a snapshot written by an older drafter still reads
    cfg = C.load(snap, validate=False)
    run = Run(run_dir, cfg.extract.spool)
    pid = lock_holder(run)
    memo: dict = {}
    rows = []
    for step in STEPS:
        try:
            m = run.read_manifest(step) or {}
        except Damaged:
            m = {}
        st = state(cfg, run, step, memo, running=pid is not None)
        # The public state is one of done / stale / pending / failed; `activity` says more:
        # "running" (pending: a drafter process works on it now), "interrupted" (failed: a
        # signal or a kill stopped it; a rerun resumes it) or "damaged" (stale: an output fails
        # its checksum; a rerun redoes what is damaged and keeps the rest).
        activity = st if st in ("running", "interrupted", "damaged") else None
        st = {"running": "pending", "interrupted": "failed", "damaged": "stale"}.get(st, st)
        started = m.get("started")
        if not m and run.started(step).exists():
            with contextlib.suppress(OSError, ValueError, AttributeError):
                started = read_json(run.started(step)).get("time")
        seconds = m.get("seconds")
        if activity == "running" and started:
            seconds = round(time.time() - started, 1)
        row = {"name": step, "state": st, "activity": activity, "dir": str(run.step_dir(step)),
               "counts": m.get("counts", {}), "seconds": seconds,
               "bytes": dir_bytes(run.step_dir(step)), "started": started}
        tps = m.get("tokens_per_s") or (m.get("throughput") or {}).get("completion_tokens_per_s")
        if tps:
            row["tokens_per_s"] = tps
        if run.failed(step).exists():
            with contextlib.suppress(OSError, ValueError, AttributeError):
                row["error"] = read_json(run.failed(step)).get("error")
        elif activity == "damaged":
            row["error"] = damage(run, step)
        rows.append(row)
    return {"run_dir": str(run.root), "running_pid": pid, "bytes": sum(r["bytes"] for r in rows),
            "seconds": round(sum(r["seconds"] or 0 for r in rows), 3), "steps": rows,
            **({"chunks": chunked.spool.status(run, cfg.max_disk_gib)}
               if chunked.chunked(cfg) else {})}
