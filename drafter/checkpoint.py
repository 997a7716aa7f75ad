"""Training checkpoints: train/step_NNNNNN/ (model.safetensors + drafter_config.json,
optimizer.pt, rng.safetensors, state.json, COMPLETE written last) saved, loaded, found for
resume, pruned and ranked by validation sim_tau (format: docs/internals.md).
"""
from __future__ import annotations

from pathlib import Path

import torch

from .config import ConfigError
from .dist import Dist, barrier
from .model import save_drafter
from .rundir import Run, atomic_dir, atomic_json, read_json, remove_dir, safe_save_file


def full_state(ttt, opt, fsdp: bool) -> tuple[dict, dict]:
    """Model and optimizer state as full tensors on the CPU (gathered from FSDP shards)."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, \
            get_model_state_dict, get_optimizer_state_dict
        o = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(ttt, options=o), get_optimizer_state_dict(ttt, opt, options=o)
    return ttt.state_dict(), opt.state_dict()


def save_checkpoint(run: Run, d: Dist, step: int, drafter, ttt, opt, fsdp: bool,
                    state: dict) -> Path | None:
    """train/step_NNNNNN/, built under a temp name with COMPLETE written last, then renamed."""
    msd, osd = full_state(ttt, opt, fsdp)
    path = run.checkpoint(step)
    if d.main:
        with atomic_dir(path) as tmp:
            save_drafter(drafter, tmp, state_dict=msd)
            torch.save(osd, tmp / "optimizer.pt")
            rng = {"cpu": torch.get_rng_state()}
            if torch.cuda.is_available():
                rng["cuda"] = torch.cuda.get_rng_state(d.device)
            safe_save_file(rng, tmp / "rng.safetensors")
            atomic_json(tmp / "state.json", state)
            (tmp / "COMPLETE").write_text("ok\n")
    barrier(d)
    return path


def load_checkpoint(path: Path, d: Dist, ttt, opt, sched, fsdp: bool) -> dict:
    from safetensors.torch import load_file

    sd = load_file(str(path / "model.safetensors"))
    msd = {k: sd[k] for k in ttt.state_dict()}
    osd = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, \
            set_model_state_dict, set_optimizer_state_dict
        o = StateDictOptions(full_state_dict=True)
        set_model_state_dict(ttt, msd, options=o)
        set_optimizer_state_dict(ttt, opt, osd, options=o)
    else:
        ttt.load_state_dict(msd)
        opt.load_state_dict(osd)
    state = read_json(path / "state.json")
    sched.load_state_dict(state["scheduler"])
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"], d.device)
    return state


def resume_from(run: Run, tc) -> Path | None:
    if tc.resume in ("off", False):
        return None
    if tc.resume in ("auto", True):
        done = run.checkpoints()
        return done[-1] if done else None
    p = Path(tc.resume)
    if not (p / "COMPLETE").exists():
        raise ConfigError(f"train.resume: {p} is not a complete checkpoint (no COMPLETE marker)")
    return p


def prune_checkpoints(run: Run, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints and the best by validation sim_tau."""
    done = run.checkpoints()
    scored = [(read_json(p / "state.json").get("val") or {}).get("sim_tau") for p in done]
    best = max((s, i) for i, s in enumerate(scored) if s is not None)[1] \
        if any(s is not None for s in scored) else None
    for i, p in enumerate(done[:-keep] if keep > 0 else done):
        if i != best:
            remove_dir(p)  # never a "complete" checkpoint with files missing after a kill


def best_checkpoint(run: Run) -> Path | None:
    scored = [(s, p) for p in run.checkpoints()
              if (s := (read_json(p / "state.json").get("val") or {}).get("sim_tau")) is not None]
    return max(scored)[1] if scored else None
