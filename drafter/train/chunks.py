"""Train's side of features stored in chunks (max_disk_gib): the chunk plan, and every
step's samples read from the chunk that step belongs to.

The plan (`make_plan`). Train's data order is a pure function of the token files, the config and
the world size (batches.DataPlan), so it is known before any feature exists. A chunk is a run of
consecutive optimizer steps; its samples are those its steps train on, each stored once in the
chunk. A sample that two epochs train on inside one chunk is extracted once, in two chunks
twice: with E epochs the train split is extracted about E times (the disk could not keep it
between epochs: that is why there are chunks). Chunks are cut greedily, step by step, as large as
the budget allows: max_disk_gib less extract's val shards and head (spool.stored_bytes) and
the rest the run keeps (data, checkpoints, export, logs: budget.held), all of it when train
makes each chunk itself (`window` 1: one process, a chunk at a time), half
of it when another process fills the spool (`window` 2: the next chunk is written while this one
trains); a budget whose room holds no single optimizer step is a BudgetError naming the
value that does. The learning-rate schedule and the step count come from the whole plan: a
chunked run trains the same batches in the same order as one with every shard stored.

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
from drafter.train.budget import BudgetError, describe, gib_at_least, held_of

log = logging.getLogger("drafter")


def make_plan(ids: list[str], lengths: list[int], dp: DataPlan, budget: int, stored: int,
              bytes_per_token: int, shard_tokens: int, window: int, held: dict) -> dict:
    """The chunks of the run (`ids`, `lengths`: the train samples in id order, as train's
    Source has them): {"id", "budget", "stored" (extract's val and head), "held" (the rest the
    run keeps: budget.held), "reserve" (the spool's own files), "window", "limit" (bytes a
    chunk may take), "bytes_per_token", "total", "world", "grad_accum", "chunks": [{"index",
    "start", "end", "ids" (first use first), "tokens", "bytes" (spool.chunk_bytes, a bound)}]}.
    BudgetError when one optimizer step's samples do not fit a chunk."""
    reserve = spool.plan_bytes(ids, dp.total, -(-dp.total // dp.steps_per_epoch))
    limit = (budget - stored - held["total"] - reserve) // window
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
            least = stored + held["total"] + reserve + window * largest_step(
                ids, lengths, dp, bytes_per_token, shard_tokens)
            half = ", halved (a chunk trains while the next is made)" if window > 1 else ""
            raise BudgetError(
                f"max_disk_gib: {describe(budget, stored, held, reserve)}{half}, leaving "
                f"{spool.size(max(limit, 0))} for a chunk; optimizer step {s} alone needs "
                f"{spool.size(bound(t, len(new), ch))}: set max_disk_gib="
                f"{gib_at_least(least)} or more (its largest step fits then), or lower "
                f"train.batch_tokens or train.keep_checkpoints")
        cur.update(dict.fromkeys(new))
        tok, chars = t, ch
    if dp.total:
        close(dp.total)
    plan = {"budget": budget, "stored": stored, "held": held, "reserve": reserve,
            "window": window,
            "limit": limit,
            "bytes_per_token": bytes_per_token, "total": dp.total, "world": dp.world,
            "grad_accum": dp.grad_accum, "chunks": chunks}
    plan["id"] = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]
    return plan


def largest_step(ids: list[str], lengths: list[int], dp: DataPlan, bytes_per_token: int,
                 shard_tokens: int) -> int:
    """The bound (spool.chunk_bytes) of the largest chunk of one optimizer step alone."""
    def one(s: int) -> int:
        new = list(dict.fromkeys(dp.step_samples(s)))
        return spool.chunk_bytes(sum(lengths[i] for i in new), len(new),
                                 sum(len(ids[i]) for i in new), bytes_per_token, shard_tokens)
    return max((one(s) for s in range(dp.total)), default=0)


def plan_run(cfg, run, info: dict, world: int, window: int,
             stored: int | None = None) -> tuple[dict, list, list]:
    """(the plan, sample ids, lengths) of this run: the train samples in id order as train's
    Source takes them (extract skips empty ones), its DataPlan for `world` ranks, the budget
    less what extract stores up front (`stored`, else measured: spool.stored_bytes) and what
    the run keeps besides (budget.held), and bytes per token from extract's info (or the
    same keys from the config: layer_ids, hidden_size, aux_dtype, teacher, topk,
    draft_vocab_size)."""
    from drafter.data import tokens
    from drafter.train.batches import data_plan

    ids, lengths = tokens.ids_and_lengths(run.require(run.tokens("train"), "tokenize"))
    pairs = sorted((i, n) for i, n in zip(ids, lengths) if n > 0)
    ids, lengths = [i for i, _ in pairs], [n for _, n in pairs]
    bpt = store.bytes_per_token(info["hidden_size"], len(info["layer_ids"]), info["aux_dtype"],
                                info["teacher"], info["topk"] or 0, info["draft_vocab_size"])
    dp = data_plan(lengths, cfg.train, world)
    h = held_of(cfg, run, dp.total)
    plan = make_plan(ids, lengths, dp, int(cfg.max_disk_gib * spool.GiB),
                     spool.stored_bytes(run) if stored is None else stored, bpt,
                     cfg.extract.shard_tokens, window, h)
    return plan, ids, lengths


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
    (the chunks' last steps), `stop` (the step fit stops at), `begin` before the loop,
    `finished` after a chunk's checkpoint. produce: make chunk c in this process
    (`produce(chunk, plan_id)` on every rank), else a producer elsewhere fills the spool and the
    loader waits for it. only: train that one chunk (a child of `conduct`, whose parent made
    it)."""

    def __init__(self, run, plan: dict, ids: list[str], lengths: list[int], d: Dist,
                 info: dict, produce=None, only: int | None = None):
        self.run, self.plan, self.d, self.info, self.produce = run, plan, d, info, produce
        self.n = len(plan["chunks"])
        self.starts = [c["start"] for c in plan["chunks"]]
        self.ends = {c["end"]: c["index"] for c in plan["chunks"]}
        self.only = only
        self.stop = plan["chunks"][only]["end"] if only is not None else plan["total"]
        self.source = ChunkSource(self, ids, lengths)
        # chunks written by this process or its parent: hashed as they were written
        self.made: set[int] = {only} if only is not None else set()
        self.closed = False
        self._open: dict[int, Future] = {}
        self.current = 0  # the chunk the loop trains (begin, finished): earlier ones are done
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
        if self.only is not None and c != self.only and step < total:
            raise DrafterError(f"train: asked to train chunk {self.only}, but it resumes at "
                               f"step {step}, in chunk {c}")
        self.current = c
        if self.d.main:
            spool.write_progress(self.run, self.pid, c, step)
            spool.clean_trash(self.run)  # chunks an earlier kill left half deleted
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
        self.current = c + 1
        with self._lock:
            self._open.pop(c, None)
        if self.d.main:
            spool.write_progress(self.run, self.pid, c + 1, step)
            spool.remove_chunk(self.run, c)
            log.info("train: chunk %d of %d trained (steps %d-%d) and deleted", c, self.n,
                     self.plan["chunks"][c]["start"], step - 1)
            if c + 1 < self.n and self.produce is None:  # the spool's: said while it waits
                nxt = self.plan["chunks"][c + 1]
                log.info("train: training chunk %d of %d (steps %d-%d)%s", c + 1, self.n,
                         nxt["start"], nxt["end"] - 1, "" if spool.complete(
                             self.run, c + 1, self.pid) else " as soon as the producer makes it")
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
        chunk c+1, when it is whole already, is then opened (hashed) in the background. The
        wait for a chunk not made yet is the calling loader thread's own: the loader asks for
        several chunks at once when chunks are shorter than it runs ahead, and a pool of
        waiters could hold every worker on later chunks while the one train needs first waits
        behind them (the loop then never reaches the step that makes it)."""
        while True:
            with self._lock:
                fut = self._open.get(c)
                mine = fut is None
                if mine:
                    fut = self._open[c] = Future()
                nxt = c + 1
                if nxt < self.n and nxt not in self._open and self.only is None and \
                        spool.complete(self.run, nxt, self.pid) is not None:
                    self._open[nxt] = self._pool.submit(self._ready, nxt, False)
            if mine:
                try:
                    fut.set_result(self._ready(c))
                except BaseException as e:  # noqa: BLE001 - every thread asking for c gets it
                    fut.set_exception(e)
            got = fut.result()
            if got is not None:
                return got
            with self._lock:  # opened ahead, it was not whole after all: wait for it here
                if self._open.get(c) is fut:
                    del self._open[c]

    def _ready(self, c: int, wait: bool = True):
        """Chunk c's reader once it is whole. The wait is logged only where another process
        makes the chunk and once the loop has trained every step before it: the loader opens
        chunks ahead (a few micro-batches, and the next chunk in the background) while the loop
        still trains, which is no wait of train's."""
        run, waits, since = self.run, spool.Wait("train"), None
        while spool.complete(run, c, self.pid) is None:
            if not wait:
                return None
            if self.closed:
                raise DrafterError("train: stopped while waiting for a chunk")
            quiet = self.produce is not None or c > self.current
            if not quiet and since is None:
                since = time.monotonic()
                waits.done()  # its clock from here: the time train waits, not the time ahead
            waits(f"chunk {c} of {self.n} is not in {run.spool()} yet (made by `drafter extract "
                  f"CONFIG` where the target runs, with the same extract.spool)", quiet=quiet)
        if since is not None:
            log.info("train: chunk %d is in the spool after %.0f s of waiting: training its "
                     "steps %d-%d", c, time.monotonic() - since, self.plan["chunks"][c]["start"],
                     self.plan["chunks"][c]["end"] - 1)
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
            log.info("train: chunk %d verified (%d shard(s), %s) in %.1f s", c, len(todo),
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


# ------------------------------------------------- one process with vLLM: a trainer per chunk
def trains_apart(cfg) -> bool:
    """With the target in vLLM in this process, each chunk trains in a child process of its
    own (`conduct`), on every GPU of the machine, while vLLM sleeps (or is closed); with the
    transformers target, the chunks train in this process (under torchrun, on every rank)."""
    return cfg.extract.engine == "vllm"


def conduct(cfg, produce) -> dict:
    """One process for the whole run, the target in vLLM here: for each chunk from the one the
    last checkpoint is in, make it (`produce`: vLLM wakes or loads, extracts, sleeps or closes),
    then train it in a child, `drafter train RUN_DIR/config.yaml --chunk C` (under torchrun
    over every visible GPU when there are several), which resumes from the checkpoint at the
    previous chunk's end and stops at this chunk's, then deletes the chunk. Returns the last
    child's train figures, with the chunks'."""
    import torch

    from drafter.core.rundir import Run
    from drafter.train.checkpoint import checkpoint_step, resume_from

    run = Run.of(cfg)
    world = torch.cuda.device_count() if torch.cuda.is_available() else 1
    plan, _, _ = plan_run(cfg, run, store.Reader(run, "val").info, world, window=1)
    spool.write_plan(run, plan)
    ckpt = resume_from(run, cfg.train)
    step = checkpoint_step(ckpt) if ckpt is not None else 0
    first = bisect.bisect_right([c["start"] for c in plan["chunks"]], step) - 1 \
        if step < plan["total"] else len(plan["chunks"])
    spool.write_progress(run, plan["id"], first, step)
    spool.clean_trash(run)
    for x in spool.present(run):
        if x != first:
            spool.remove_chunk(run, x)
    out, made, last = {}, [], len(plan["chunks"]) - 1
    # every chunk trained already (killed before the manifest): the last child only reports
    for c in range(min(first, last), last + 1):
        chunk = plan["chunks"][c]
        if c >= first and spool.complete(run, c, plan["id"]) is None:
            produce(chunk, plan["id"])
            made.append(c)
        # the checkpoint at the last chunk's end, named: train.resume may be off for the first
        over = [] if c <= first else [f"train.resume={run.checkpoint(chunk['start'])}"]
        out = _child(run, c, world, over)
    out["chunks"] = {"count": len(plan["chunks"]), "plan": plan["id"], "window": 1,
                     "chunk_limit_bytes": plan["limit"], "spool": str(run.spool()),
                     "made_here": made, "trained_in_children": world}
    return out


def _child(run, c: int, world: int, over: list[str]) -> dict:
    """`drafter train --chunk c` of the run dir's resolved config, its output the parent's,
    SIGTERM'd by the kernel if the parent dies; -> its figures."""
    import os
    import socket
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from drafter.serve.supervisor import _die_with

    with tempfile.TemporaryDirectory(prefix="drafter-chunk-") as tmp:
        result = Path(tmp) / "result.json"
        args = ["-m", "drafter.cli", "train", str(run.config_snapshot()), *over, "--chunk",
                str(c), "--result", str(result)]
        if world > 1:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            args = ["-m", "torch.distributed.run", f"--nproc-per-node={world}",
                    "--master-addr=127.0.0.1", f"--master-port={port}", *args]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")
               and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                             "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")}
        log.info("train: chunk %d trains in a child: %s", c, f"torchrun over {world} GPUs"
                 if world > 1 else "one process")
        proc = subprocess.Popen([sys.executable, *args], env=env, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with(os.getpid()))
        try:
            rc = proc.wait()
        except BaseException:  # interrupted: nothing outlives this process
            proc.terminate()
            proc.wait()
            raise
        if rc != 0:
            raise DrafterError(f"train: the child that trains chunk {c} failed (exit {rc}; its "
                               f"output is above): rerun the same command to resume")
        return json.loads(result.read_text())
