"""The spool: where stored features pass a chunk at a time from extract to train, when the disk
cannot hold them all (max_disk_gib). Its files, what each side may do with them, and the
waits of both sides.

    SPOOL/  (rundir.Run.spool(): extract.spool, else RUN_DIR/chunks)
      plan.json        train's chunk plan (drafter/train/chunks.py): per chunk its optimizer
                       steps [start, end) and sample ids; sealed with a checksum
      progress.json    {"plan", "next", "step", "time"}: the first chunk train still needs
      chunk_NNNNN/     shard_NNNNN.safetensors + index.json (drafter/features/store.py's format),
                       COMPLETE written last: {"plan", "chunk", "samples", "tokens", "bytes"}
      .producer.lock   flock'ed by the one process that fills the spool

Train (the consumer) writes plan.json and progress.json, and deletes a chunk once the checkpoint
at the chunk's last step is COMPLETE. The producer writes chunk folders: `drafter extract` with
extract.spool set (`serve`, usually on another machine), or train itself in one process
(`drafter run`). The producer starts a chunk only when the spool, plus extract's val shards and
head, plus what train's plan holds back for the rest of the run (data, checkpoints, export,
logs: drafter/train/budget.py), plus the chunk's bound (`chunk_bytes`) stays within the budget,
and removes chunks of another plan or beyond the ones train can use next (made again when
needed). Every
shard is written atomically (store.write_shard), so a kill on either side loses at most the
shards being written; a restarted producer keeps every shard that verifies.
"""
from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from pathlib import Path

from drafter import DrafterError
from drafter.core.dist import Dist, all_gather
from drafter.core.rundir import (
    atomic_json,
    atomic_write,
    dir_bytes,
    pid_lock,
    pid_unlock,
    read_json,
    remove_dir,
    seal_ok,
    sealed,
)

log = logging.getLogger("drafter")

GiB = 1 << 30
# seconds between two looks at the spool while waiting (a few stats and a directory listing)
POLL_S = 0.5
# seconds between two progress lines of a wait
SAY_EVERY_S = 60.0
# an upper bound on a chunk's bytes besides its tokens' (store.bytes_per_token): per shard its
# safetensors header (tensor entries, the options and sample ids as escaped JSON) and its index
# entry; per sample an offset, its id in the header and in the index (2 x the id's characters
# + 48), and the chunk's index header and COMPLETE (tests/test_chunks.py checks it against real
# chunks)
SHARD_OVERHEAD, SAMPLE_OVERHEAD, CHUNK_OVERHEAD = 4096, 48, 4096


class SpoolError(DrafterError):
    pass


def chunk_bytes(tokens: int, samples: int, id_chars: int, bytes_per_token: int,
                shard_tokens: int) -> int:
    """At most the bytes of a chunk folder: tokens x bytes_per_token, plus headers and indexes.
    Shards are cut longest sample first, so every shard but the last is more than half full:
    at most 2 x tokens / shard_tokens + 1 of them."""
    shards = 2 * tokens // max(shard_tokens, 1) + 1
    return (tokens * bytes_per_token + shards * SHARD_OVERHEAD + samples * SAMPLE_OVERHEAD
            + 2 * id_chars + CHUNK_OVERHEAD)


def plan_bytes(ids: list[str], steps: int, passes: int) -> int:
    """At most the bytes of the spool's own files: plan.json (compact JSON: every sample id
    once per pass over the data it makes, and a few numbers per chunk, at most one chunk a
    step), progress.json and the lock."""
    return passes * sum(len(i) + 3 for i in ids) + 160 * steps + 8192


def stored_bytes(run) -> int:
    """What extract keeps outside the spool for the whole run: the val shards, their index and
    the head (counted in the budget)."""
    return dir_bytes(run.shards("val")) + (run.extract_head().stat().st_size
                                           if run.extract_head().exists() else 0)


def used_bytes(run) -> int:
    """Bytes in the spool now: chunk folders (whole or being written or being deleted) and its
    own small files."""
    return dir_bytes(run.spool())


# ------------------------------------------------------------------------------------ files
def _read(path: Path) -> dict | None:
    try:
        obj = read_json(path)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) and seal_ok(obj) else None


def read_plan(run) -> dict | None:
    return _read(run.chunk_plan())


def write_plan(run, plan: dict) -> None:
    run.spool().mkdir(parents=True, exist_ok=True)
    atomic_write(run.chunk_plan(), json.dumps(sealed(plan), separators=(",", ":")) + "\n")


def read_progress(run, plan_id: str) -> int:
    """The first chunk train still needs (0 with no progress of this plan)."""
    p = _read(run.chunk_progress())
    return int(p["next"]) if p and p.get("plan") == plan_id else 0


def write_progress(run, plan_id: str, next_chunk: int, step: int) -> None:
    atomic_json(run.chunk_progress(), sealed({"plan": plan_id, "next": next_chunk,
                                              "step": step, "time": time.time()}))


def complete(run, c: int, plan_id: str) -> dict | None:
    """Chunk c's COMPLETE when the chunk is whole and of this plan, else None."""
    m = _read(run.chunk_complete(c))
    return m if m and m.get("plan") == plan_id and m.get("chunk") == c else None


def mark_complete(run, c: int, plan_id: str, index: dict) -> None:
    """Written last, after the shards and the index: the chunk is whole."""
    atomic_json(run.chunk_complete(c), sealed({
        "plan": plan_id, "chunk": c, "samples": index["num_samples"],
        "tokens": index["num_tokens"], "bytes": index["bytes"], "time": time.time()}))


def present(run) -> list[int]:
    """Chunk folders in the spool, whole or not."""
    d = run.spool()
    if not d.is_dir():
        return []
    return sorted(int(p.name.split("_")[1]) for p in d.glob("chunk_[0-9]*") if p.is_dir())


def remove_chunk(run, c: int) -> None:
    """Renamed away, then deleted: a kill mid-delete leaves no half chunk under its name."""
    p = run.chunk(c)
    with contextlib.suppress(FileNotFoundError):  # the other side removed it first
        remove_dir(p)
    for old in run.spool().glob(f".old-{p.name}.*"):  # an earlier kill's
        shutil.rmtree(old, ignore_errors=True)


def clean_trash(run) -> None:
    """Chunks a kill left renamed away, half deleted (remove_chunk), and temp files of train's
    plan.json and progress.json a kill left mid-write: no one reads them. Train calls it, the
    only writer of those two files, between its writes."""
    for old in run.spool().glob(".old-chunk_*"):
        shutil.rmtree(old, ignore_errors=True)
    for name in (run.chunk_plan().name, run.chunk_progress().name):
        for tmp in run.spool().glob(f".tmp-{name}.*"):
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def producer_lock(run):
    """One process fills a spool (flock: released by the kernel when the process dies)."""
    run.spool().mkdir(parents=True, exist_ok=True)
    f, pid = pid_lock(run.spool_lock())
    if f is None:
        raise SpoolError(f"{run.spool()} is being filled by another drafter process (PID "
                         f"{pid}): one producer per spool")
    try:
        yield
    finally:
        pid_unlock(f)


class Wait:
    """A wait that says so: a line when it starts and every SAY_EVERY_S seconds after."""

    def __init__(self, who: str):
        self.who, self.t0, self.said = who, time.monotonic(), None

    def __call__(self, why: str, quiet: bool = False) -> None:
        now = time.monotonic()
        if not quiet and (self.said is None or now - self.said >= SAY_EVERY_S):
            log.info("%s: waiting%s: %s", self.who, f" ({now - self.t0:.0f} s so far)"
                     if self.said is not None else "", why)
            self.said = now
        time.sleep(POLL_S)

    def done(self) -> None:
        self.t0, self.said = time.monotonic(), None


def size(n: float) -> str:
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


# --------------------------------------------------------------------------------- producer
def serve(run, make, budget: int, d: Dist, waited: Wait | None = None) -> dict:
    """Fill the spool for a train elsewhere, until it has every chunk: read train's plan and
    progress, make the first chunk train needs that is not whole (`make(chunk, plan_id)`, every
    rank), waiting while there is no plan yet, while every chunk train can use next is made, or
    while the budget has no room for the next one. Rank 0 decides; all ranks make. Returns
    {"made": chunk indices, "removed": chunk indices, "waited_s"}."""
    wait = waited or Wait("extract")
    out = {"made": [], "removed": [], "waited_s": 0.0}
    while True:
        t = time.monotonic()
        job = _next_job(run, budget, out) if d.rank == 0 else None
        if d.world > 1:
            job = all_gather(d, job)[0]
        if job[0] == "done":
            return out
        if job[0] == "wait":
            if d.rank == 0:
                wait(job[1])
            else:
                time.sleep(POLL_S)
            out["waited_s"] += time.monotonic() - t
            continue
        wait.done()
        _, chunk, plan_id = job
        make(chunk, plan_id)
        out["made"].append(chunk["index"])


def _next_job(run, budget: int, out: dict) -> tuple:
    """("done",) | ("wait", why) | ("make", chunk, plan id), rank 0's look at the spool."""
    plan = read_plan(run)
    if plan is None:
        return ("wait", f"no chunk plan in {run.spool()} yet: `drafter train CONFIG` writes it "
                        f"where the drafter trains")
    if plan["budget"] != budget:
        raise SpoolError(f"{run.chunk_plan()}: train planned its chunks for a budget of "
                         f"{size(plan['budget'])}, this extract has {size(budget)} "
                         f"(max_disk_gib): give both the same config")
    pid, chunks = plan["id"], plan["chunks"]
    nxt = read_progress(run, pid)
    if nxt >= len(chunks):
        return ("done",)
    window = range(nxt, min(nxt + plan["window"], len(chunks)))
    for c in present(run):
        whole = run.chunk_complete(c).exists()
        # chunks train has passed are train's to delete; another plan's and those beyond what
        # train can use next go (made again when train needs them)
        if (c >= nxt and c not in window) or (whole and complete(run, c, pid) is None):
            log.info("extract: removing %s (%s)", run.chunk(c), "another plan" if whole and
                     c in window else "beyond the chunks train uses next")
            remove_chunk(run, c)
            out["removed"].append(c)
    todo = next((c for c in window if complete(run, c, pid) is None), None)
    if todo is None:
        made = f"chunks {window.start}-{window.stop - 1}" if len(window) > 1 \
            else f"chunk {window.start}"
        return ("wait", f"{made} of {len(chunks)} made; train is at chunk {nxt} (step "
                        f"{_step_of(run)})")
    chunk = chunks[todo]
    # the rest of the run (data, checkpoints, export, logs) as train's plan bounds it
    used, stored, held = used_bytes(run), stored_bytes(run), plan.get("held", {}).get("total", 0)
    need = max(0, chunk["bytes"] - dir_bytes(run.chunk(todo)))  # a partial one is kept
    if used + stored + held + need > budget:
        return ("wait", f"chunk {todo} needs {size(need)}, the spool holds {size(used)} + "
                        f"val and head {size(stored)} + the rest of the run {size(held)} of "
                        f"{size(budget)}: train frees a chunk once its checkpoint covers it")
    return ("make", chunk, pid)


def _step_of(run) -> str:
    p = _read(run.chunk_progress())
    return str(p.get("step")) if p else "?"


def status(run, budget_gib: float | None) -> dict | None:
    """The spool for `drafter status`: chunks made, trained and present, bytes used (`used`:
    the run dir and the spool, what the budget holds)."""
    plan = read_plan(run)
    if plan is None and not run.spool().exists():
        return None
    inside = run.root.resolve() in run.spool().resolve().parents
    out = {"spool": str(run.spool()), "bytes": used_bytes(run) if run.spool().exists() else 0,
           "stored_bytes": stored_bytes(run), "budget": int(budget_gib * GiB)
           if budget_gib else None, "present": present(run)}
    out["used"] = dir_bytes(run.root) + (0 if inside else out["bytes"])  # what the budget holds
    if plan is not None:
        out.update(chunks=len(plan["chunks"]), next=read_progress(run, plan["id"]),
                   complete=[c for c in out["present"] if complete(run, c, plan["id"])],
                   window=plan["window"], total_steps=plan["total"])
    return out
