"""Train's side of features stored in chunks (extract.max_disk_gib): the chunk plan, and every
step's samples read from the chunk that step belongs to.

The plan (`make_plan`). Train's data order is a pure function of the token files, the config and
the world size (batches.DataPlan), so it is known before any feature exists. A chunk is a run of
consecutive optimizer steps; its samples are those its steps train on, each stored once in the
chunk. A sample that two epochs train on inside one chunk is extracted once, in two chunks
twice: with E epochs the train split is extracted about E times (the disk could not keep it
between epochs: that is why there are chunks). Chunks are cut greedily, step by step, as large as
the budget allows: extract.max_disk_gib less extract's val shards and head (spool.stored_bytes),
all of it when train makes each chunk itself (`window` 1: one process, a chunk at a time), half
of it when another process fills the spool (`window` 2: the next chunk is written while this one
trains). The learning-rate schedule and the step count come from the whole plan: a chunked run
trains the same batches in the same order as one with every shard stored.

Reading (`Chunks`). The loop's jobs name sample i of chunk c as c·N + i (`tag`), so the loader
reads each step's samples from that step's chunk: a sample in two chunks is read from the right
one, and a chunk being deleted is never read. The loader waits for a chunk's COMPLETE; rank 0
hashes its shards against its index before the first read (the next chunk's in the background
while this one trains; a chunk this process made was hashed as it was written). At a chunk's
last step the loop saves a checkpoint; then `finished` records the next chunk in progress.json
and deletes the chunk (rank 0, after every rank's save), and in one process makes the next
chunk (`produce`: drafter/steps/extract.py's ChunkProducer.make, handed over by drafter/run/).
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from drafter import DrafterError
from drafter.core.dist import Dist, all_gather, barrier
from drafter.features import spool, store
from drafter.train.batches import DataPlan

log = logging.getLogger("drafter")


def make_plan(ids: list[str], lengths: list[int], dp: DataPlan, budget: int, stored: int,
              bytes_per_token: int, shard_tokens: int, window: int) -> dict:
    """The chunks of the run (`ids`, `lengths`: the train samples in id order, as train's
    Source has them): {"id", "budget", "stored", "window", "limit", "bytes_per_token",
    "total", "world", "grad_accum", "chunks": [{"index", "start", "end", "ids" (first use
    first), "tokens", "bytes" (spool.chunk_bytes, a bound)}]}."""
    limit = (budget - stored) // window
    chunks: list[dict] = []
    cur: dict[int, None] = {}
    tok = chars = 0

    def bound(t, n, ch):
        return spool.chunk_bytes(t, n, ch, bytes_per_token, shard_tokens)

    def close(end: int) -> None:
        start = chunks[-1]["end"] if chunks else 0
        chunks.append({"index": len(chunks), "start": start, "end": end,
                       "ids": [ids[i] for i in cur], "tokens": tok,
                       "bytes": bound(tok, len(cur), chars)})

    for s in range(dp.total):
        step = list(dict.fromkeys(dp.step_samples(s)))
        new = [i for i in step if i not in cur]
        t = tok + sum(lengths[i] for i in new)
        ch = chars + sum(len(ids[i]) for i in new)
        if cur and bound(t, len(cur) + len(new), ch) > limit:
            close(s)
            cur, tok, chars = {}, 0, 0
            new = step
            t, ch = sum(lengths[i] for i in new), sum(len(ids[i]) for i in new)
        if bound(t, len(new), ch) > limit and not cur:
            half = " halved (a chunk trains while the next is made)" if window > 1 else ""
            raise DrafterError(
                f"extract.max_disk_gib: {spool.size(budget)} less extract's val shards and "
                f"head ({spool.size(stored)}){half} leaves {spool.size(max(limit, 0))} for a "
                f"chunk; optimizer step {s} alone needs {spool.size(bound(t, len(new), ch))}: "
                f"raise the budget, or lower train.batch_tokens or prepare.val_fraction")
        cur.update(dict.fromkeys(new))
        tok, chars = t, ch
    if dp.total:
        close(dp.total)
    plan = {"budget": budget, "stored": stored, "window": window, "limit": limit,
            "bytes_per_token": bytes_per_token, "total": dp.total, "world": dp.world,
            "grad_accum": dp.grad_accum, "chunks": chunks}
    plan["id"] = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]
    return plan


class ChunkSource:
    """batches.Source for a chunked run: `lengths` and `ids` of every train sample (id order,
    for the data plan); `load` takes tagged indices (c·N + i) and reads each sample from chunk
    c, as stored (store.Reader.stored)."""

    def __init__(self, chunks: "Chunks", ids: list[str], lengths: list[int]):
        self.ids, self.lengths, self._chunks = ids, lengths, chunks

    def __len__(self) -> int:
        return len(self.ids)

    def load(self, idx: list[int]) -> list[dict]:
        n = len(self.ids)
        out = []
        for x in idx:
            c, i = divmod(x, n)
            reader, pos = self._chunks.reader(c)
            j = pos.get(self.ids[i])
            if j is None:
                raise DrafterError(f"{self._chunks.run.chunk(c)} lacks sample {self.ids[i]} "
                                   f"that its steps train on: the chunk is not this plan's")
            out.append(reader.stored(j))
        return out


class Chunks:
    """The chunks of one train (module docstring): `source` for fit, `tag` for its jobs, `ends`
    (the chunks' last steps), `begin` before the loop, `finished` after a chunk's checkpoint.
    produce: make chunk c in this process (`produce(chunk, plan_id)` on every rank), else a
    producer elsewhere fills the spool and the loader waits for it."""

    def __init__(self, run, plan: dict, ids: list[str], lengths: list[int], d: Dist,
                 info: dict, produce=None):
        self.run, self.plan, self.d, self.info, self.produce = run, plan, d, info, produce
        self.n = len(plan["chunks"])
        self.starts = [c["start"] for c in plan["chunks"]]
        self.ends = {c["end"]: c["index"] for c in plan["chunks"]}
        self.source = ChunkSource(self, ids, lengths)
        self.made: set[int] = set()       # chunks this process wrote (hashed as written)
        self.closed = False
        self._open: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="chunk-open")

    @property
    def pid(self) -> str:
        return self.plan["id"]

    def chunk_of(self, step: int) -> int:
        return bisect.bisect_right(self.starts, step) - 1

    def tag(self, step: int, mb: list[list[int]]) -> list[list[int]]:
        base = self.chunk_of(step) * len(self.source)
        return [[base + i for i in row] for row in mb]

    # ------------------------------------------------------------------------- the loop's side
    def begin(self, step: int, total: int) -> None:
        """Before the loop: the chunk of `step` (the step a resume starts at) is the first one
        needed; record it, remove the chunks before it (trained, a kill before their delete),
        and in one process make it."""
        if total != self.plan["total"]:
            raise DrafterError(f"train: {total} steps, the chunk plan has {self.plan['total']}")
        c = self.chunk_of(step) if step < total else self.n
        if self.d.main:
            spool.write_progress(self.run, self.pid, c, step)
            for x in spool.present(self.run):
                # one process: a chunk left by an earlier run beyond this one is remade later
                if x < c or (self.produce is not None and x != c):
                    spool.remove_chunk(self.run, x)
        barrier(self.d)
        if c < self.n:
            log.info("train: %d chunks of at most %s in %s; starting with chunk %d (steps "
                     "%d-%d)", self.n, spool.size(self.plan["limit"]), self.run.spool(), c,
                     self.plan["chunks"][c]["start"], self.plan["chunks"][c]["end"] - 1)
            self._make(c)

    def finished(self, step: int) -> None:
        """After the checkpoint at chunk c's last step (every rank has saved it): the next chunk
        is the one needed, chunk c goes, and in one process the next one is made."""
        c = self.ends[step]
        with self._lock:
            self._open.pop(c, None)
        if self.d.main:
            spool.write_progress(self.run, self.pid, c + 1, step)
            spool.remove_chunk(self.run, c)
            log.info("train: chunk %d of %d trained (steps %d-%d) and deleted", c, self.n,
                     self.plan["chunks"][c]["start"], step - 1)
        if c + 1 < self.n:
            self._make(c + 1)

    def _make(self, c: int) -> None:
        if self.produce is None:
            return
        whole = spool.complete(self.run, c, self.pid) is not None
        if self.d.world > 1:
            whole = all_gather(self.d, whole)[0]
        if not whole:
            self.produce(self.plan["chunks"][c], self.pid)
            self.made.add(c)
        barrier(self.d)

    def close(self) -> None:
        self.closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------------- the loader's side
    def reader(self, c: int):
        """(store.Reader of chunk c, {sample id: its position}), waited for and checked once;
        chunk c+1 is then opened in the background."""
        with self._lock:
            fut = self._open.get(c)
            if fut is None:
                fut = self._open[c] = self._pool.submit(self._ready, c)
            if c + 1 < self.n and c + 1 not in self._open:
                self._open[c + 1] = self._pool.submit(self._ready, c + 1)
        return fut.result()

    def _ready(self, c: int):
        run, wait = self.run, spool.Wait("train")
        while spool.complete(run, c, self.pid) is None:
            if self.closed:
                raise DrafterError("train: stopped while waiting for a chunk")
            wait(f"chunk {c} of {self.n} is not in {run.spool()} yet (made by `drafter extract "
                 f"CONFIG` where the target runs, with the same extract.spool)",
                 quiet=self.produce is not None)
        reader = store.Reader(run, "train", chunk=c)
        keep = ("layer_ids", "hidden_size", "teacher", "topk", "aux_dtype", "draft_vocab_size")
        if {k: reader.info.get(k) for k in keep} != {k: self.info.get(k) for k in keep}:
            raise DrafterError(f"{run.chunk(c)} holds features of other extract options than "
                               f"extract/val ({reader.info} vs {self.info})")
        if set(reader.ids) != set(self.plan["chunks"][c]["ids"]):
            raise DrafterError(f"{run.chunk(c)} holds other samples than chunk {c} of the plan")
        self._verify(c, reader)
        return reader, {sid: j for j, sid in enumerate(reader.ids)}

    def _verify(self, c: int, reader) -> None:
        """Rank 0 hashes a chunk another process wrote (every rank checks sizes); a shard
        that fails goes, with the chunk's COMPLETE, so the producer makes it again, and train
        stops with an error naming it (its rerun resumes and waits for the chunk)."""
        t = time.monotonic()
        entries = reader.index["shards"]
        bad = [p for p, e in zip(reader.paths, entries)
               if not p.is_file() or p.stat().st_size != e["bytes"]]
        todo = [(p, p.stat(), e["sha256"]) for p, e in zip(reader.paths, entries)] \
            if not bad else []
        if not bad and self.d.main and c not in self.made:
            bad = store.failing_sha256(todo)
            log.info("train: chunk %d verified (%d shards, %s) in %.1f s", c, len(todo),
                     spool.size(sum(st.st_size for _, st, _ in todo)), time.monotonic() - t)
        if bad:
            for p in bad:
                p.unlink(missing_ok=True)
            self.run.chunk_complete(c).unlink(missing_ok=True)
            # not extract's Damaged: the chunk is no part of extract's own output
            raise DrafterError(
                f"{', '.join(map(str, bad))}: missing, or not the size or sha256 that "
                f"{self.run.chunk_index(c)} records: removed, with the chunk's COMPLETE, for the "
                f"producer to make again; rerun train to resume")
