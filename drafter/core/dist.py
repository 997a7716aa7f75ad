"""torchrun's environment, read in this one place: rank, world size, local rank and this rank's
device (RANK, WORLD_SIZE, LOCAL_RANK), the process group, the few collectives the steps use, and
torchrun's agent store. The same code runs without torchrun: one process, rank 0 of world 1.

    d = dist_env()                  # read_env() + init_dist(d)
    d = read_env(target.pick_device(cfg.target))   # reads only: a GPU preflight may run here,
    init_dist(d)                    # then: pin the GPU, join the process group
    all_sum(t, d), barrier(d), all_gather(d, obj)   # no-ops in one process
    close_dist()

torch is imported lazily, so that the pipeline can ask `rank_world()` without loading it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _cpu():
    import torch
    return torch.device("cpu")


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=_cpu)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def on(self) -> bool:
        return self.world > 1


def rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def torchrun_launched() -> bool:
    """True under torchrun (or another torchelastic launcher), even before a process group."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("LOCAL_WORLD_SIZE"))


def read_env(device: str | None = None) -> Dist:
    """This process in torchrun's terms; reads only. `device` as configured ("cuda", "cpu",
    "cuda:1"; None: cuda when available): a plain "cuda" is this rank's own GPU,
    cuda:LOCAL_RANK."""
    import torch

    rank, world = rank_world()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return Dist(rank, world, local, torch.device(f"cuda:{local}" if kind == "cuda" else kind))


def init_dist(d: Dist) -> None:
    """Pin this rank's GPU (before any collective touches cuda:0) and, under torchrun, join the
    process group: nccl on GPUs, gloo on CPU. Call it after a GPU preflight, which must run
    before this process touches CUDA."""
    import torch
    import torch.distributed as td

    if d.device.type == "cuda":
        torch.cuda.set_device(d.device)
    if d.on and not td.is_initialized():
        td.init_process_group("nccl" if d.device.type == "cuda" else "gloo")


def dist_env(device: str | None = None) -> Dist:
    """read_env, then init_dist: what training does first."""
    d = read_env(device)
    init_dist(d)
    return d


def close_dist() -> None:
    import torch.distributed as td
    if td.is_initialized():
        td.destroy_process_group()


def all_sum(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world > 1:
        import torch.distributed as td
        td.all_reduce(t)
    return t


def barrier(d: Dist) -> None:
    if d.world > 1:
        import torch.distributed as td
        td.barrier()


def all_gather(d: Dist, obj) -> list:
    """Every rank's `obj`, in rank order (pickled)."""
    if not d.on:
        return [obj]
    import torch.distributed as td

    out = [None] * d.world
    td.all_gather_object(out, obj)
    return out


def agent_store(timeout_s: float):
    """torchrun's agent store (a TCPStore client; every rank is a client, so this never takes
    the port that the process group uses), or None outside torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=timedelta(seconds=timeout_s))


def restart_count() -> str:
    """How many times torchrun restarted the workers ("0" the first time, and without it)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
