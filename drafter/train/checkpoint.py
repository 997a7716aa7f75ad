"""Training checkpoints: train/step_NNNNNN/ (model.safetensors + drafter_config.json,
optimizer.pt, rng.safetensors, state.json, COMPLETE written last) saved, verified, loaded,
found for resume, pruned and ranked by validation sim_tau (format: docs/internals.md).

COMPLETE holds the size and sha256 of every other file of the checkpoint. Resume, export and
`drafter status` skip a checkpoint that fails them (a torn or flipped file) for the last intact
one, with a warning; a checkpoint written before checksums (COMPLETE = "ok") is trusted as
before.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from drafter.core.config import ConfigError
from drafter.core.dist import Dist, barrier
from drafter.core.rundir import (
    Run,
    atomic_dir,
    atomic_json,
    atomic_write,
    read_json,
    remove_dir,
    safe_save_file,
)
from drafter.train.model import save_drafter

log = logging.getLogger("drafter")

FILES = ("model.safetensors", "drafter_config.json", "optimizer.pt", "rng.safetensors",
         "state.json")


def full_state(ttt, opt, fsdp: bool) -> tuple[dict, dict]:
    """Model and optimizer state as full tensors on the CPU (gathered from FSDP shards)."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )
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
            atomic_write(tmp / "COMPLETE", json.dumps({"files": _sums(tmp)}, indent=1) + "\n")
    barrier(d)
    return path


def _sums(d: Path) -> dict:
    from drafter.features.store import file_sha256

    return {f: {"bytes": (d / f).stat().st_size, "sha256": file_sha256(d / f)} for f in FILES}


def verify_checkpoint(path: Path, full: bool = True) -> str | None:
    """Why a checkpoint cannot be resumed from or exported, or None when it is intact: no
    COMPLETE marker, a file missing or of another size than COMPLETE records, or (`full`) a
    sha256 that differs."""
    from drafter.features.store import file_sha256

    path = Path(path)
    try:
        text = (path / "COMPLETE").read_text()
    except (OSError, UnicodeDecodeError):
        return f"{path}: no COMPLETE marker (not a finished checkpoint)"
    if text.strip() == "ok":  # written before checksums: the marker is all there is
        return None
    try:
        files = json.loads(text)["files"]
    except (ValueError, KeyError, TypeError):
        return f"{path}/COMPLETE is unreadable"
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            return f"{f} missing"
        if f.stat().st_size != want["bytes"]:
            return f"{f} is {f.stat().st_size} bytes, {want['bytes']} when saved (truncated?)"
        if full and file_sha256(f) != want["sha256"]:
            return f"{f} fails its sha256"
    return None


def intact(run: Run, full: bool = False) -> list[Path]:
    """The complete checkpoints that verify, oldest first; each damaged one is skipped with a
    warning."""
    out = []
    for p in run.checkpoints():
        why = verify_checkpoint(p, full=full)
        if why is None:
            out.append(p)
        else:
            log.warning("checkpoint %s is damaged (%s): skipped", p.name, why)
    return out


def _state(p: Path) -> dict:
    try:
        s = read_json(p / "state.json")
    except (OSError, ValueError):
        return {}
    return s if isinstance(s, dict) else {}


def _score(p: Path):
    v = _state(p).get("val")
    return v.get("sim_tau") if isinstance(v, dict) else None


def tokens_seen(state: dict, metrics: list[dict]) -> int:
    """Tokens trained on up to a checkpoint: what its state records, else (checkpoints from
    before the count was saved) the train records of metrics.jsonl up to its step."""
    if isinstance(state.get("tokens_seen"), int):
        return state["tokens_seen"]
    return sum(int(r.get("tokens") or 0) for r in metrics
               if r.get("split") == "train" and r.get("step", 0) <= state.get("step", 0))


def checkpoint_step(path: Path) -> int:
    """The step a verified checkpoint was saved at (its state.json): train's data position,
    known before the model is built (the loader starts first)."""
    return int(read_json(path / "state.json")["step"])


def load_checkpoint(path: Path, d: Dist, ttt, opt, sched, fsdp: bool) -> dict:
    from safetensors.torch import load_file

    sd = load_file(str(path / "model.safetensors"))
    msd = {k: sd[k] for k in ttt.state_dict()}
    osd = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )
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
    """The checkpoint to resume from: with resume auto, the newest one that verifies in full
    (a damaged newer one is skipped with a warning); a path must verify."""
    if tc.resume in ("off", False):
        return None
    if tc.resume in ("auto", True):
        for p in reversed(run.checkpoints()):
            why = verify_checkpoint(p)
            if why is None:
                return p
            log.warning("train: checkpoint %s is damaged (%s): resuming from the one before",
                        p.name, why)
        return None
    p = Path(tc.resume)
    why = verify_checkpoint(p)
    if why is not None:
        raise ConfigError(f"train.resume: {p} is not a usable checkpoint ({why})")
    return p


def prune_checkpoints(run: Run, keep: int, transient=frozenset(), also: Path | None = None) -> None:
    """Keep the newest `keep` complete checkpoints but those at `transient` steps (saved at a
    chunk's end only for a resume), the best by validation sim_tau, the newest of all (what a
    resume starts from) and `also` (the one this train resumed from); a damaged one counts as
    none of them, so an intact one is never pruned in its favour."""
    done = [p for p in run.checkpoints() if verify_checkpoint(p, full=False) is None]
    if not done:
        return
    scored = [_score(p) for p in done]
    best = max((s, i) for i, s in enumerate(scored) if s is not None)[1] \
        if any(s is not None for s in scored) else None
    regular = [p for p in done if int(p.name.split("_")[1]) not in transient]
    kept = set(regular[-keep:] if keep > 0 else []) | {done[-1]} | \
        ({done[best]} if best is not None else set())
    for p in done:
        if p not in kept and (also is None or p.resolve() != Path(also).resolve()):
            remove_dir(p)  # never a "complete" checkpoint with files missing after a kill


def best_checkpoint(run: Run) -> Path | None:
    scored = [(s, p) for p in run.checkpoints()
              if (s := _score(p)) is not None and verify_checkpoint(p, full=False) is None]
    return max(scored)[1] if scored else None
