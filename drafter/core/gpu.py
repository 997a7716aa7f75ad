"""GPUs through NVML (nvidia-ml-py): devices, free memory, the processes holding memory, and the
preflight that runs before any weights load.

    gpu.devices()            -> [Gpu(index, name, uuid, total, free, used, processes)],
                                [] with no GPU
    gpu.describe()           -> "no GPU" or one line per GPU with its holders
    gpu.preflight(need_bytes, policy="refuse")   before a step loads a model on the GPU

NVML indices are physical; `visible_indices()` maps CUDA's numbering (CUDA_VISIBLE_DEVICES) onto
them. drafter never kills a process it did not start: this module only reads, and its errors name
the PIDs so that the user decides.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from drafter import DrafterError
from drafter.core.dist import torchrun_launched

log = logging.getLogger("drafter")

GiB = 1 << 30


class GpuBusy(DrafterError):
    """Another process holds memory on a GPU this step needs."""


class GpuMemoryShort(DrafterError):
    """A GPU has less free memory than the step's estimated need."""


@dataclass
class GpuProcess:
    pid: int
    name: str
    used_bytes: int | None      # None where NVML cannot tell (containers, MIG)
    gpu: int


@dataclass
class Gpu:
    index: int                  # NVML (physical) index
    name: str
    uuid: str
    total: int
    free: int
    used: int
    processes: list[GpuProcess] = field(default_factory=list)


def _nvml():
    """The initialised pynvml module, or None (no library, no driver, no GPU)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVML LibraryNotFound / DriverNotLoaded...: no GPU here
        return None
    return pynvml


def _str(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else str(x)


def process_name(pid: int, nvml=None) -> str:
    if nvml is not None:
        try:
            return _str(nvml.nvmlSystemGetProcessName(pid))
        except Exception:  # noqa: BLE001 - a process gone or not ours: its name stays unknown
            pass
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode() or \
            Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"  # another PID namespace (a container): NVML shows host PIDs


def devices() -> list[Gpu]:
    """Every GPU NVML sees, with memory and holders; [] on a machine without GPU."""
    nvml = _nvml()
    if nvml is None:
        return []
    try:
        out = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            procs: dict[int, GpuProcess] = {}
            for getter in ("nvmlDeviceGetComputeRunningProcesses",
                           "nvmlDeviceGetGraphicsRunningProcesses"):
                try:
                    found = getattr(nvml, getter)(h)
                except Exception:  # noqa: BLE001 - a getter this driver lacks: try the next
                    continue
                for p in found:
                    used = getattr(p, "usedGpuMemory", None)
                    procs.setdefault(p.pid, GpuProcess(p.pid, process_name(p.pid, nvml),
                                                       int(used) if used else None, i))
            out.append(Gpu(i, _str(nvml.nvmlDeviceGetName(h)), _str(nvml.nvmlDeviceGetUUID(h)),
                           int(mem.total), int(mem.free), int(mem.used), list(procs.values())))
        return out
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting NVML down must not fail the caller
            pass


def visible_indices(gpus: list[Gpu] | None = None) -> list[int]:
    """NVML indices of the GPUs this process can use, in CUDA order (CUDA_VISIBLE_DEVICES may
    list indices or UUIDs)."""
    gpus = devices() if gpus is None else gpus
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return [g.index for g in gpus]
    out = []
    for tok in (t.strip() for t in env.split(",")):
        if not tok:
            continue
        if tok.isdigit():
            if int(tok) < len(gpus):
                out.append(int(tok))
            continue
        match = [g.index for g in gpus if g.uuid == tok or g.uuid.startswith(tok)]
        if not match:
            break  # CUDA stops at the first invalid entry
        out.append(match[0])
    return out


def related_pids() -> set[int]:
    """This process and, under torchrun, its sibling ranks (children of the same launcher):
    their memory on *other* GPUs is ours, not a foreign holder."""
    pids = {os.getpid()}
    if torchrun_launched():
        ppid = os.getppid()
        for children in Path(f"/proc/{ppid}/task").glob("*/children"):
            try:
                pids.update(int(x) for x in children.read_text().split())
            except (OSError, ValueError):
                pass
    return pids


def describe(gpus: list[Gpu] | None = None) -> str:
    gpus = devices() if gpus is None else gpus
    if not gpus:
        return "no GPU"
    lines = []
    for g in gpus:
        lines.append(f"GPU {g.index} {g.name}: {g.free / GiB:.1f} GiB free of "
                     f"{g.total / GiB:.1f} GiB")
        for p in g.processes:
            mem = f"{p.used_bytes / GiB:.1f} GiB" if p.used_bytes else "? GiB"
            lines.append(f"  PID {p.pid} {p.name} holds {mem}")
    return "\n".join(lines)


def check(gpus: list[Gpu], use: list[int], need_bytes: int | dict[int, int],
          ignore_pids: set[int] = frozenset()) -> dict:
    """The preflight's decision, from a snapshot: per GPU in `use` (NVML indices) the free
    memory against the need, and the foreign processes holding memory. No side effects."""
    by_index = {g.index: g for g in gpus}
    rows, busy, short = [], [], []
    for i in use:
        g = by_index.get(i)
        if g is None:
            short.append(f"GPU {i} is not present")
            continue
        need = need_bytes.get(i, 0) if isinstance(need_bytes, dict) else need_bytes
        holders = [p for p in g.processes if p.pid not in ignore_pids]
        rows.append({"gpu": i, "name": g.name, "free": g.free, "total": g.total, "need": need,
                     "holders": [{"pid": p.pid, "name": p.name, "bytes": p.used_bytes}
                                 for p in holders]})
        for p in holders:
            mem = f"{p.used_bytes / GiB:.1f} GiB" if p.used_bytes else "memory"
            busy.append(f"GPU {i}: PID {p.pid} ({p.name}) holds {mem}")
        if need > g.free:
            short.append(f"GPU {i}: needs ~{need / GiB:.1f} GiB, {g.free / GiB:.1f} GiB free "
                         f"of {g.total / GiB:.1f} GiB")
    return {"gpus": rows, "busy": busy, "short": short, "ok": not busy and not short}


def preflight(need_bytes: int | dict[int, int], use: list[int] | None = None,
              policy: str = "refuse", ignore_pids: set[int] | None = None,
              what: str = "this step", gpus: list[Gpu] | None = None) -> dict:
    """Run before any weights load. `use`: NVML indices this process will use (default: the
    visible ones). policy refuse: raise GpuBusy when another process holds memory there, and
    GpuMemoryShort when free memory is below the need; warn: log both and go on; off: skip.
    Never kills anything. Returns the check's report ("no GPU" on a machine without one).
    `gpus`: a snapshot from `devices()` (default: taken now)."""
    if policy == "off":
        return {"ok": True, "skipped": True}
    gpus = devices() if gpus is None else gpus
    if not gpus:
        return {"ok": True, "gpus": [], "message": "no GPU"}
    use = visible_indices(gpus) if use is None else use
    rep = check(gpus, use, need_bytes, related_pids() if ignore_pids is None else ignore_pids)
    if rep["busy"]:
        msg = (f"GPU memory is held by other processes, so {what} could run out of memory after "
               f"loading:\n  " + "\n  ".join(rep["busy"]) + "\ndrafter never kills a process it "
               "did not start: stop them yourself (or set extract.preflight=warn to go on).")
        if policy == "refuse":
            raise GpuBusy(msg)
        log.warning(msg)
    if rep["short"]:
        msg = (f"not enough free GPU memory for {what}:\n  " + "\n  ".join(rep["short"])
               + "\nLower extract.batch_tokens, use more GPUs (extract.tp=true under torchrun), "
               "or set extract.preflight=warn to try anyway.")
        if policy == "refuse":
            raise GpuMemoryShort(msg)
        log.warning(msg)
    return rep


@functools.cache
def triton_available(device) -> bool:
    """The kernel runs on CUDA devices where Triton imports (or anywhere under TRITON_INTERPRET=1,
    which the CPU tests set for a subprocess). Cached per device: the paged kernel, the tree's
    expansion and the training merge ask on every call."""
    if getattr(device, "type", str(device)) != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
