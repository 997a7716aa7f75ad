"""The kept requests: a share of the served requests (learn.sample_rate), each its prompt's and
answer's token ids, one file a request under RUN_DIR/learn/traffic/, for the learner to train
and judge drafters on; bounded by count and age (learn.max_samples, learn.max_age_hours).

    path = keep(run, prompt_ids, output_ids, temperature, top_p, finish, holdout=0.25)
    prune(run, cfg.learn)                # the oldest beyond max_samples, any beyond max_age_hours
    records = kept(run)                  # oldest first: {"id", "time", "split", ...}
    write_tokens(records, path)          # a token file train's online source reads

Each file is written under a temp name and renamed (a kill leaves whole files only), readable by
this user only (mode 0600 in a 0700 folder), and named by its time, so that the name order is
the arrival order. A request is held out (split "holdout") or trained on ("train") by its id,
once, when it is kept: a held-out request never reaches a round's training. The files hold
token ids, never text, and no log line of drafter's names their content.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from pathlib import Path

from drafter.core.rundir import Run, atomic_json

SUFFIX = ".json"


def folder(run: Run) -> Path:
    d = run.learn("traffic")
    if not d.exists():
        d.mkdir(parents=True, mode=0o700, exist_ok=True)
    return d


def split_of(rid: str, holdout: float) -> str:
    """'holdout' for a share `holdout` of ids (by their hash), else 'train'."""
    h = int.from_bytes(hashlib.sha256(rid.encode()).digest()[:8], "big") / 2 ** 64
    return "holdout" if h < holdout else "train"


def keep(run: Run, prompt_ids: list[int], output_ids: list[int], temperature: float,
         top_p: float, finish: str | None, holdout: float) -> Path:
    """One served request into the traffic folder. Returns its file."""
    now = time.time()
    rid = f"{time.time_ns():020d}-{secrets.token_hex(4)}"
    rec = {"id": rid, "time": now, "split": split_of(rid, holdout),
           "temperature": float(temperature), "top_p": float(top_p), "finish": finish,
           "prompt_ids": [int(t) for t in prompt_ids], "output_ids": [int(t) for t in output_ids]}
    path = folder(run) / f"{rid}{SUFFIX}"
    atomic_json(path, rec)   # mkstemp's file: mode 0600
    return path


def files(run: Run) -> list[Path]:
    """The kept requests' files, oldest first (temp files of a write in progress left out)."""
    d = run.learn("traffic")
    return sorted(p for p in d.glob(f"*{SUFFIX}") if not p.name.startswith(".")) \
        if d.exists() else []


def prune(run: Run, lc, now: float | None = None) -> int:
    """Delete kept requests past the retention limits and leftover temp files of a killed write.
    Returns how many went."""
    now = time.time() if now is None else now
    fs = files(run)
    cutoff_ns = int((now - lc.max_age_hours * 3600) * 1e9)
    old = [p for p in fs if int(p.name.split("-")[0]) < cutoff_ns]
    rest = [p for p in fs if p not in set(old)]
    gone = old + rest[:max(0, len(rest) - lc.max_samples)]
    for p in gone:
        p.unlink(missing_ok=True)
    d = run.learn("traffic")
    for p in d.glob(".tmp-*") if d.exists() else ():
        if now - p.stat().st_mtime > 60:   # a write older than a minute is dead
            p.unlink(missing_ok=True)
    return len(gone)


def kept(run: Run, lc=None) -> list[dict]:
    """Every kept request, oldest first (within the age limit when `lc` is given); a file
    that vanished meanwhile (pruned) or cannot be read is skipped."""
    cutoff_ns = int((time.time() - lc.max_age_hours * 3600) * 1e9) if lc is not None else 0
    out = []
    for p in files(run):
        if int(p.name.split("-")[0]) < cutoff_ns:
            continue
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return out


def write_tokens(records: list[dict], path: Path) -> int:
    """A token file (drafter/data/tokens.py's schema) of the records: the prompt unmasked, the
    answer the target produced in the loss. Written whole under a temp name. Returns its rows."""
    from drafter.data.tokens import TokenWriter

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}.{os.getpid()}")
    w = TokenWriter(tmp)
    n = 0
    for r in records:
        if not r["output_ids"]:
            continue
        w.write(r["id"], r["prompt_ids"] + r["output_ids"],
                [0] * len(r["prompt_ids"]) + [1] * len(r["output_ids"]))
        n += 1
    w.close()
    os.replace(tmp, path)
    return n
