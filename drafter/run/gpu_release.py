"""Between steps: wait until the GPU memory that generate's server held is back at its level
from before generate (NVML), or fail naming the PIDs that still hold it. A new holder outside the
sessions drafter started is another job's, named in a warning and left alone; drafter never kills
a process it did not start. drafter/run/pipeline.py's run_all takes the baseline before generate
and waits before the next step that loads the target on a GPU; an online run's precompile child,
started before generate when its engine is drafter, is one of its own (`own`, `own_running`).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

from drafter import DrafterError

log = logging.getLogger("drafter")


# GPU memory back "at baseline" allows this much more use than before generate (the driver's own
# bookkeeping, and drafter's CUDA context where NVML cannot attribute it).
GPU_SLACK = 1 << 30


class GpuNotReleased(DrafterError):
    """GPU memory is still held after generate, by processes drafter did not start or cannot
    stop; the message names them."""


def gpu_snapshot():
    from drafter.core import gpu

    return gpu.devices()


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:  # gone, or not ours to ask
        return None


def wait_gpu_released(baseline: list, timeout: float, what: str = "the next step",
                      snapshot: Callable | None = None, poll: float = 1.0,
                      sleep: Callable | None = None, own: set[int] | None = None,
                      started: set[int] | None = None,
                      session: Callable[[int], int | None] | None = None,
                      own_running: Callable[[], bool] | None = None) -> dict:
    """Wait (at most `timeout` s) until every GPU of `baseline` (gpu.devices() taken before
    generate started its server) is back at its used memory (+GPU_SLACK, not counting this
    process's own) and no leftover of a server drafter started holds memory. Returns the last
    check; raises GpuNotReleased naming the PIDs. Never kills anything.

    A process that appeared since the baseline is a leftover when its session is one drafter
    started a server in, or drafter's own (`started`: supervisor.STARTED_SESSIONS and this
    process's session; a server's workers keep its session when it dies first). Another new
    holder is someone else's job (a second run on the same GPU): it is named in a warning and
    its memory is not counted, when NVML says how much it holds and its session can be read;
    otherwise (containers, MIG, another PID namespace) it is waited for like a leftover.

    `own` (default: this process and its torchrun siblings) are ours: neither waited for nor
    their memory counted, when NVML sizes it; the pipeline adds the precompile child it started
    before generate (precompile.ahead_pid). Where NVML cannot size that child's memory it would
    count as extra: while `own_running()` says such a child of ours still runs, polls are not
    timed (the wait goes on until it ends, as train would wait for it anyway)."""
    from drafter.core import gpu
    from drafter.serve.supervisor import STARTED_SESSIONS

    snapshot = snapshot or gpu_snapshot
    sleep = sleep or time.sleep
    own = gpu.related_pids() if own is None else own
    session = session or _session
    # this process's own session counts as started: children it spawned without one of their
    # own (the data engine's workers) are ours too
    started = (STARTED_SESSIONS | {session(os.getpid())}) if started is None else started
    base = {g.index: g for g in baseline}
    base_pids = {p.pid for g in baseline for p in g.processes}
    waited = timed = 0.0  # counted in polls, not wall time: NVML calls are quick
    while True:
        problems, others = [], []
        for g in snapshot():
            b = base.get(g.index)
            if b is None:
                continue
            ours = sum(p.used_bytes or 0 for p in g.processes if p.pid in own)
            new = [p for p in g.processes if p.pid not in base_pids and p.pid not in own]
            theirs = [p for p in new if p.used_bytes is not None
                      and session(p.pid) not in started | {None}]  # None: cannot tell
            new = [p for p in new if p not in theirs]
            others += [(g.index, p) for p in theirs]
            extra = g.used - ours - sum(p.used_bytes for p in theirs) - b.used
            if new or extra > GPU_SLACK:
                problems.append({"gpu": g.index, "extra_bytes": extra, "holders": [
                    {"pid": p.pid, "name": p.name, "bytes": p.used_bytes, "new": p in new}
                    for p in g.processes if p.pid not in own and p not in theirs]})
        if not problems:
            if waited:
                log.info("GPU memory back at its level before generate after %.0fs", waited)
            for i, p in others:
                log.warning("GPU %d: PID %d (%s) started during generate and holds %.1f GiB: not "
                            "a process drafter started; left alone and not counted", i, p.pid,
                            p.name, p.used_bytes / gpu.GiB)
            return {"ok": True, "waited": waited, "others": [p.pid for _, p in others]}
        if timed >= timeout:
            lines = []
            for pr in problems:
                lines.append(f"GPU {pr['gpu']}: {pr['extra_bytes'] / gpu.GiB:+.1f} GiB used "
                             f"compared with before generate")
                for h in pr["holders"]:
                    mem = f"{h['bytes'] / gpu.GiB:.1f} GiB" if h["bytes"] else "memory"
                    since = " (appeared during generate)" if h["new"] else ""
                    lines.append(f"  PID {h['pid']} ({h['name']}) holds {mem}{since}")
            raise GpuNotReleased(
                f"GPU memory is not back at its level before generate after {timeout:.0f}s, so "
                f"{what} would run out of memory:\n  " + "\n  ".join(lines) + "\ndrafter never "
                "kills a process it did not start: stop them yourself, then rerun the same "
                "command (finished steps are kept).")
        if own_running is None or not own_running():
            timed += poll
        sleep(poll)
        waited += poll
