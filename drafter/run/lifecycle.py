"""A drafter process's life in a run dir: one process per run dir at a time (an flock on
RUN_DIR/.lock, released by the kernel even on kill -9), and SIGTERM and SIGHUP unwinding a step
like Ctrl-C, so that servers stop and the step's folder stays resumable. drafter/run/pipeline.py
takes the lock around its steps and installs the handlers before each step runs.
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
