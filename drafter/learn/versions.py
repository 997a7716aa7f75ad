"""Which drafter is served, every drafter that was, and the records between the learner, the
server and the user: RUN_DIR/learn/versions/vNNNN/ (v0000 the first one, vN the candidate of
round N), serving.json, swaps.jsonl, proposal.json and rollback.json.

    write_version(run, n, drafter, target, meta)   # vNNNN/: native layout, no embed_tokens
    serving(run) -> {"version", "dir", ...} | None
    set_serving(run, version, record)              # serving.json, then a line in swaps.jsonl
    propose(run, record) / proposal(run) / clear(run, "proposal")
    request_rollback(run, to) / rollback_request(run)
    rollback_target(run, to=None) -> version       # the one served before the current one

serving.json changes only after the engine serves the new drafter, so that a restart of any
part starts vLLM on the drafter it served last. swaps.jsonl is the history, one JSON line per
change: {"time", "kind": "start" | "swap" | "rollback", "from", "to", "how", "seconds",
"figures"}; `figures` are the judged figures that justified a swap (drafter/learn/judge.py).
"""
from __future__ import annotations

import time
from pathlib import Path

from drafter import DrafterError
from drafter.core.rundir import JsonlAppender, Run, atomic_dir, atomic_json, read_json, read_jsonl

META = "learn.json"


class VersionError(DrafterError):
    pass


def name(n: int) -> str:
    return f"v{n:04d}"


def number(version: str) -> int:
    if not (version.startswith("v") and version[1:].isdigit()):
        raise VersionError(f"{version!r} is not a drafter version (v0000, v0001, ...)")
    return int(version[1:])


def write_version(run: Run, n: int, drafter, target, dtype, meta: dict) -> Path:
    """vNNNN/ from a drafter.train.model.Drafter: the native layout vLLM loads, without
    embed_tokens (vLLM gives the draft the target's own table, which the drafter trains frozen;
    shipping it would let a weight update write the target's: drafter/core/vllm_weights.py),
    and learn.json (what made it, the weights' sha256). Built under a temp name."""
    from drafter.export import engines as E
    from drafter.features.store import file_sha256

    path = run.learn_version(n)
    embed = drafter.cfg.hidden_size != drafter.cfg.target_hidden_size  # engines need it then
    with atomic_dir(path) as tmp:
        E.write_dir(drafter, tmp, E.NATIVE, target=target, dtype=dtype, embed_tokens=embed,
                    meta={"learn_version": name(n)})
        atomic_json(tmp / META, {**meta, "version": name(n),
                                 "sha256": file_sha256(tmp / "model.safetensors")})
    return path


def version_meta(run: Run, version: str) -> dict:
    p = run.learn_version(number(version)) / META
    if not p.exists():
        raise VersionError(f"{run.learn_version(number(version))}: no such drafter version")
    return read_json(p)


def versions(run: Run) -> list[str]:
    d = run.learn("versions")
    return sorted(p.name for p in d.glob("v[0-9]*") if (p / META).exists()) if d.exists() else []


# -------------------------------------------------------------------------------- the served one
def serving(run: Run) -> dict | None:
    p = run.learn("serving.json")
    return read_json(p) if p.exists() else None


def set_serving(run: Run, version: str, record: dict) -> None:
    """The engine serves `version` now: serving.json, then the history line."""
    now = time.time()
    atomic_json(run.learn("serving.json"), {"version": version,
                                            "dir": str(run.learn_version(number(version))),
                                            "since": now})
    with JsonlAppender(run.learn("swaps.jsonl")) as f:
        f.write({"time": now, "to": version, **record})


def history(run: Run) -> list[dict]:
    p = run.learn("swaps.jsonl")
    return read_jsonl(p, repair=True) if p.exists() else []


def rollback_target(run: Run, to: str | None = None) -> str:
    """The version a rollback serves: `to`, or the one served before the current one."""
    if to is not None:
        version_meta(run, to)   # it exists
        return to
    cur = serving(run)
    if cur is None:
        raise VersionError(f"{run.learn()}: nothing served yet, nothing to roll back")
    served = [h["to"] for h in history(run) if h.get("kind") in ("start", "swap", "rollback")]
    while served and served[-1] == cur["version"]:
        served.pop()
    if not served:
        raise VersionError(f"{cur['version']} is the first drafter served here: no earlier "
                           "one to roll back to")
    return served[-1]


# ------------------------------------------------------------------------- learner -> server
def propose(run: Run, record: dict) -> None:
    """A candidate judged better than the drafter it was trained from ("based_on")."""
    atomic_json(run.learn("proposal.json"), record)


def proposal(run: Run) -> dict | None:
    p = run.learn("proposal.json")
    try:
        return read_json(p) if p.exists() else None
    except (OSError, ValueError):
        return None


def clear(run: Run, what: str) -> None:
    run.learn(f"{what}.json").unlink(missing_ok=True)


# ---------------------------------------------------------------------------- user -> server
def request_rollback(run: Run, to: str) -> None:
    atomic_json(run.learn("rollback.json"), {"to": to, "time": time.time()})


def rollback_request(run: Run) -> dict | None:
    p = run.learn("rollback.json")
    try:
        return read_json(p) if p.exists() else None
    except (OSError, ValueError):
        return None


def prune(run: Run, keep: int = 2) -> list[str]:
    """Delete candidates that were never served, but the newest `keep` of them and the one a
    proposal names: every drafter ever served stays (the rollback chain). Returns the gone."""
    from drafter.core.rundir import remove_dir

    served = {h.get("to") for h in history(run)} | {(serving(run) or {}).get("version")}
    pending = (proposal(run) or {}).get("version")
    aside = [v for v in versions(run) if v not in served and v != pending]
    gone = aside[:max(0, len(aside) - keep)]
    for v in gone:
        remove_dir(path_of(run, v))
    return gone


def path_of(run: Run, version: str) -> Path:
    return Path(run.learn_version(number(version)))
