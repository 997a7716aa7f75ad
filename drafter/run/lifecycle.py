"""A drafter process's life in a run dir: one process per run dir at a time (an flock on
RUN_DIR/.lock, released by the kernel even on kill -9), and SIGTERM and SIGHUP unwinding a step
like Ctrl-C, so that servers stop and the step's folder stays resumable, and what a rerun of a
stopped step resumes from (`resume_point`, the stop's log line). drafter/run/pipeline.py takes
the lock around its steps and installs the handlers before each step runs.
"""
from __future__ import annotations

import contextlib
import fcntl
import signal

from drafter import DrafterError
from drafter.core.rundir import Run, pid_lock, pid_unlock


# ------------------------------------------------------------------------------------ signals
class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C so that every `finally` runs (servers stop, temp
    files go, failed.json is written); `signum` gives the exit status 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


_SIGNALLED: list[int] = []   # the signals this process received, in order


def signalled() -> int | None:
    """The signal that stopped this process, if any. Raised inside C code (a safetensors read,
    say), the KeyboardInterrupt can surface as another exception: this says what it was."""
    return _SIGNALLED[-1] if _SIGNALLED else None


def install_signal_handlers() -> None:
    """SIGINT (Ctrl-C), SIGTERM (kill, schedulers, torchrun) and SIGHUP (a closed terminal):
    steps unwind and leave their folder consistent for a rerun to resume. A second signal while
    unwinding is not caught again (the default: the process ends; the folder stays resumable)."""
    _SIGNALLED.clear()

    def handler(signum, frame):
        _SIGNALLED.append(signum)
        signal.signal(signum, signal.SIG_DFL)
        raise Interrupted(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            signal.signal(sig, handler)
        except ValueError:  # not the main thread (tests calling steps from threads)
            pass


def resume_point(cfg, run: Run, step: str) -> str:
    """What a rerun of a stopped step starts from, for the log line of the stop: train's
    checkpoint, the answers, shards or decoding passes the step keeps, else that it redoes."""
    if step == "train":
        from drafter.train.checkpoint import checkpoint_step, verify_checkpoint

        tc = cfg.train
        if tc.resume in ("off", False):
            return "train.resume is off: the rerun starts train over"
        if tc.resume not in ("auto", True):
            return f"the rerun resumes from train.resume ({tc.resume})"
        ckpt = next((p for p in reversed(run.checkpoints())  # sizes only: the stop is no time
                     if verify_checkpoint(p, full=False) is None), None)  # to hash GBs
        return f"the rerun resumes from checkpoint {ckpt} (step {checkpoint_step(ckpt)})" \
            if ckpt is not None else "no checkpoint yet: the rerun starts train over"
    if step == "generate":
        p = run.conversations("generate")
        n = p.read_bytes().count(b"\n") if p.exists() else 0
        return f"the rerun keeps {_n(n, 'conversation')} answered in {p}, answers the rest"
    if step == "extract":
        n = sum(1 for split in ("train", "val") if run.shards(split).is_dir()
                for _ in run.shards(split).glob("shard_*.safetensors"))
        return f"the rerun keeps {_n(n, 'shard')} written in {run.step_dir(step)} (those that " \
               f"verify), extracts the rest"
    if step == "evaluate":
        n = len(list(run.eval_passes().glob("*.json"))) if run.eval_passes().is_dir() else 0
        return f"the rerun keeps {_n(n, 'decoding pass')} finished in {run.eval_passes()}, " \
               f"decodes the rest"
    return "the rerun redoes it"


def _n(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "es" if what.endswith("s") else "s")


# ------------------------------------------------------------------------------------ locking
_LOCKS: dict[str, list] = {}   # run dir -> [open lock file, depth]: reentrant within a process


@contextlib.contextmanager
def run_lock(run: Run):
    """One drafter process at a time in a run directory (flock: released by the kernel when the
    process dies, even by kill -9). Raises RunBusy naming the holder's PID."""
    key = str(run.root.resolve())
    held = _LOCKS.get(key)
    if held is not None:
        held[1] += 1
        try:
            yield
        finally:
            held[1] -= 1
        return
    run.root.mkdir(parents=True, exist_ok=True)
    f, pid = pid_lock(run.lock())
    if f is None:
        raise RunBusy(f"{run.root} is in use by another drafter process (PID {pid}); wait for "
                      f"it or stop it (`drafter status {run.root}` shows its progress)")
    _LOCKS[key] = [f, 1]
    try:
        yield
    finally:
        del _LOCKS[key]
        pid_unlock(f)


def lock_holder(run: Run) -> int | None:
    """PID of the drafter process working in `run` now, or None."""
    p = run.lock()
    if not p.exists():
        return None
    with open(p) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            text = f.read().strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


class RunBusy(DrafterError):
    pass
