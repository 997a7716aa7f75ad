"""The training batches: the samples of one split in id order (offline shards or online capture),
packed first-fit into rows, grouped into micro-batches, collated, aligned (the shift between
drafter positions and their targets, written once: `align`), embedded on the host, moved to the
device with the teacher in the form the loss takes, and built ahead on a thread (`Prefetch`).
drafter/steps/train.py decides which micro-batch each rank and step takes.
"""
from __future__ import annotations

import collections
import contextlib
import math
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from drafter.features import store
from drafter.train.dspark_objective import anchor_seed, block_align


class Source:
    """The samples of one split in id order: `lengths[i]`, `load([i, ...])` -> per-sample dicts
    (docs/internals.md). Offline from store.Reader; online through the target (capture)."""

    def __init__(self, ids: list[str], lengths: list[int], load):
        order = sorted(range(len(ids)), key=ids.__getitem__)
        self.ids = [ids[j] for j in order]
        self.lengths = [lengths[j] for j in order]
        self._order, self._load = order, load

    def __len__(self) -> int:
        return len(self.ids)

    def load(self, idx: list[int]) -> list[dict]:
        return self._load([self._order[i] for i in idx])

    @classmethod
    def offline(cls, reader) -> "Source":
        """Samples as stored (store.Reader.stored: fp8 aux with its scales, narrow teacher
        dtypes): collate keeps those dtypes and device_batch widens them on the device."""
        return cls(reader.ids, reader.lengths, lambda idx: [reader.stored(j) for j in idx])

    @classmethod
    def online(cls, path: Path, cap) -> "Source":
        import pyarrow.parquet as pq

        table = pq.read_table(str(path), columns=["id", "input_ids", "loss_mask", "num_tokens"])
        return cls(table.column("id").to_pylist(), table.column("num_tokens").to_pylist(),
                   lambda idx: cap(table.take(idx).select(["input_ids", "loss_mask"]).to_pylist()))

    @classmethod
    def memory(cls, samples: list[dict]) -> "Source":
        """Per-sample dicts already in memory (tests, benchmarks); ids are their positions."""
        return cls([f"{i:09d}" for i in range(len(samples))],
                   [len(s["input_ids"]) for s in samples], lambda idx: [samples[j] for j in idx])


def pack(lengths: list[int], T: int, seed: int, window: int = 16) -> list[list[int]]:
    """Sample indices -> rows of at most T tokens: seeded shuffle, then first-fit over the last
    `window` open rows (O(n·window); about 95% full when samples are much shorter than T)."""
    g = torch.Generator().manual_seed(seed)
    rows, open_rows = [], []                                          # open: [free tokens, items]
    for i in torch.randperm(len(lengths), generator=g).tolist():
        n = min(lengths[i], T)
        for r in open_rows:
            if r[0] >= n:
                r[0] -= n
                r[1].append(i)
                break
        else:
            if len(open_rows) == window:
                rows.append(open_rows.pop(0)[1])
            open_rows.append([T - n, [i]])
    return rows + [r[1] for r in open_rows]


def epoch_micro_batches(rows: list[list[int]], B: int, seed: int, epoch: int) -> list[list]:
    """The epoch's micro-batches: rows shuffled with (seed, epoch), B at a time."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch + 1)
    order = torch.randperm(len(rows), generator=g).tolist()
    return [[rows[j] for j in order[a:a + B]] for a in range(0, len(order), B)]


@dataclass
class DataPlan:
    """Which micro-batch every optimizer step takes, a pure function of the samples' lengths
    (in id order), the train config and the world size: train's loop and its chunk plan
    (drafter/train/chunks.py) read the same one. Step s, accumulation a, rank r takes micro-batch
    (k·grad_accum + a)·world + r of epoch s // steps_per_epoch (k = s % steps_per_epoch);
    micro-batches that do not fill a last step are dropped."""
    rows: list[list[int]]          # sample indices packed into rows of max_length tokens
    B: int                         # rows per micro-batch
    world: int
    grad_accum: int
    seed: int
    n_micro: int                   # micro-batches per epoch
    steps_per_epoch: int
    total: int                     # optimizer steps of the run (train.max_steps, else epochs)
    _epoch: tuple = (None, None)   # the last epoch's micro-batches

    def micro_batch(self, s: int, a: int, r: int) -> list[list[int]]:
        epoch, k = divmod(s, self.steps_per_epoch)
        if self._epoch[0] != epoch:
            self._epoch = (epoch, epoch_micro_batches(self.rows, self.B, self.seed, epoch))
        return self._epoch[1][(k * self.grad_accum + a) * self.world + r]

    def step_samples(self, s: int) -> list[int]:
        """The samples step s trains on, every rank's, in the order the ranks take them."""
        return [i for a in range(self.grad_accum) for r in range(self.world)
                for row in self.micro_batch(s, a, r) for i in row]


def data_plan(lengths: list[int], tc, world: int) -> DataPlan:
    """The run's DataPlan (train.max_length, batch_tokens, seed, grad_accum, epochs, max_steps)."""
    from drafter import DrafterError

    T, B = tc.max_length, tc.batch_tokens // tc.max_length
    rows = pack(lengths, T, tc.seed)
    n_micro = math.ceil(len(rows) / B)
    per_step = world * tc.grad_accum
    steps_per_epoch = n_micro // per_step
    if steps_per_epoch == 0:
        raise DrafterError(f"train: {len(lengths)} samples make {n_micro} micro-batches of "
                           f"{B} rows × {T} tokens, fewer than world size × grad_accum = "
                           f"{per_step}: lower train.batch_tokens or train.max_length")
    return DataPlan(rows, B, world, tc.grad_accum, tc.seed, n_micro, steps_per_epoch,
                    tc.max_steps or tc.epochs * steps_per_epoch)


# the token fields: built on the host (pinned when a GPU is there), from the samples' token ids
HOST_KEYS = ("input_ids", "loss_mask", "seq_id", "position_ids")


def collate(rows: list[list[dict]], B: int, T: int) -> dict:
    """Samples packed into B rows of T tokens (row b holds rows[b] in order; missing rows are
    padding): input_ids, loss_mask, seq_id (-1 = padding), position_ids [B, T] int64 on the host;
    in_vocab [B, T], aux [B, T, L, Ht] and teacher_hidden [B, T, Ht] or teacher_topk_ids/_logp
    [B, T, k] where the samples' features are (the GPU when online: capture's outputs), in the
    samples' dtypes: decoded ones (capture, store.Reader[i]) or stored ones (Source.offline: fp8
    aux with aux_scale [B, T, L], int16/int32 ids, float16 log-probs), which `widen` decodes."""
    first = rows[0][0]
    dev = first["aux"].device
    cuda = torch.cuda.is_available()

    def new(shape, dtype, fill=0, device=None):
        device = device or torch.device("cpu")
        return torch.full(shape, fill, dtype=dtype, device=device,
                          pin_memory=cuda and device.type == "cpu")

    out = {"input_ids": new((B, T), torch.long), "loss_mask": new((B, T), torch.long),
           "seq_id": new((B, T), torch.long, -1), "position_ids": new((B, T), torch.long),
           "in_vocab": new((B, T), torch.bool, device=dev),
           "aux": new((B, T, *first["aux"].shape[1:]), first["aux"].dtype, device=dev)}
    if "aux_scale" in first:
        out["aux_scale"] = new((B, T, *first["aux_scale"].shape[1:]), first["aux_scale"].dtype,
                               device=dev)
    teacher = [k for k in ("teacher_hidden", "teacher_topk_ids", "teacher_topk_logp") if k in first]
    for k in teacher:
        fill = -math.inf if k == "teacher_topk_logp" else 0
        out[k] = new((B, T, first[k].shape[-1]), first[k].dtype, fill, device=dev)
    keys = ("input_ids", "loss_mask", "in_vocab", "aux", *teacher,
            *(("aux_scale",) if "aux_scale" in out else ()))
    for b, row in enumerate(rows):
        o = 0
        for j, s in enumerate(row):
            n = min(len(s["input_ids"]), T - o)
            for k in keys:
                out[k][b, o:o + n] = s[k][:n]
            out["seq_id"][b, o:o + n] = j
            out["position_ids"][b, o:o + n] = torch.arange(n)
            o += n
    return out


def align(seq_id: torch.Tensor, loss_mask: torch.Tensor, in_vocab: torch.Tensor, steps: int,
          decay: float) -> dict:
    """THE alignment (docs/internals.md), written once. Drafter position t at TTT step i embeds
    token t+1+i (src), learns the teacher at t+1+i (the target's distribution over token t+2+i),
    and counts in the loss when token t+2+i is in t's sample, loss_mask[t+2+i] == 1 (an
    assistant token: the first assistant token is trained, by position t = first-2) and
    in_vocab[t+1+i]. Inputs [B, T]. Returns
        src [K, B, T]   the position whose token step i embeds (clamped at the row end: masked)
        rows [N]        flat indices into [K, B, T] of the positions in the loss
        trows [N]       their teacher rows, flat indices into [B, T]
        weights [N]     decay**i;  row_step [N] their step i
        n_valid [K], n_lm [K]  positions in the loss, and with loss_mask alone (the denominator
                        of acc/accept: out-of-vocab teacher argmaxes count as misses)."""
    B, T = seq_id.shape
    dev = seq_id.device
    t = torch.arange(T, device=dev).expand(B, T)
    src, valid, lm = [], [], []
    for i in range(steps):
        s = (t + 1 + i).clamp(max=T - 1)                                  # [B, T]
        nxt = (t + 2 + i).clamp(max=T - 1)
        same = (t + 2 + i < T) & (seq_id.gather(1, nxt) == seq_id) & (seq_id >= 0)
        m = same & loss_mask.gather(1, nxt).bool()
        src.append(s)
        lm.append(m)
        valid.append(m & in_vocab.gather(1, s))
    src, valid, lm = torch.stack(src), torch.stack(valid), torch.stack(lm)  # [K, B, T]
    rows = valid.reshape(-1).nonzero().squeeze(-1)                         # [N]
    row_step = rows // (B * T)
    base = torch.arange(B, device=dev)[:, None] * T
    trows = (src + base).reshape(-1)[rows]
    # decay**i in float64 as Python computes it, made on the device (no host-to-device copy)
    weights = torch.full_like(row_step, decay, dtype=torch.float64).pow_(row_step).float()
    return {"src": src, "rows": rows, "trows": trows, "weights": weights, "row_step": row_step,
            "n_valid": valid.sum((1, 2)), "n_lm": lm.sum((1, 2))}


def host_batches(src: Source, jobs: list[list[list[int]]], B: int, T: int, tc,
                 emb_table) -> list[dict]:
    """Micro-batches (each a list of rows of sample indices), before the device: collated,
    aligned, embedded (the frozen table lives on the CPU, so only [B, T, H] crosses to the
    GPU). Their samples are loaded in one call: online, one capture call, whose forwards group
    the samples of all of them by length (fewer, fuller forwards than one call each).
    Online, the features are on the GPU already: the token fields follow them there (pinned,
    non-blocking) and are aligned there. Nothing here waits on the GPU but align's nonzero
    (pinned): see Capture.run for why."""
    it = iter(src.load([i for rows in jobs for r in rows for i in r]))
    out = []
    for rows in jobs:
        hb = collate([[next(it) for _ in r] for r in rows], B, T)
        real = hb["seq_id"] >= 0
        hb["tokens"] = int(real.sum())
        hb["keys"] = int((hb["position_ids"] + 1)[real].sum())  # Σ causal keys (FLOP counts)
        hb["emb"] = embed(emb_table, hb["input_ids"])                       # [B, T, H]
        dev = hb["in_vocab"].device
        if dev.type == "cuda":
            for k in HOST_KEYS:
                hb[k] = hb[k].to(dev, non_blocking=True)
        if tc.method == "eagle3":
            hb.update(align(hb["seq_id"], hb["loss_mask"], hb["in_vocab"], tc.ttt_steps,
                            tc.ttt_decay))
        else:  # a block drafter's anchors (drafter/train/dspark_objective.py)
            hb.update(block_align(hb["seq_id"], hb["position_ids"], hb["loss_mask"],
                                  hb["in_vocab"], tc.dspark.block_size, tc.dspark.anchors,
                                  tc.ttt_decay, anchor_seed(tc.seed, rows)))
        out.append(hb)
    return out


def embed(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table[ids] [..., H], gathered straight into pinned memory when a GPU is there (the copy
    to the GPU then does not block the building thread, and no second copy pins it)."""
    out = torch.empty((ids.numel(), table.shape[1]), dtype=table.dtype,
                      pin_memory=torch.cuda.is_available())
    torch.index_select(table, 0, ids.reshape(-1), out=out)
    return out.view(*ids.shape, table.shape[1])


def widen(d: dict) -> dict:
    """A batch's features in the contract's dtypes (docs/internals.md), in place, where the
    batch is: store.decode_features, on the device after the copy for offline batches, which
    carry the stored dtypes (half the bytes cross, and the building thread skips the
    conversions that were most of its time). Capture's batches are in them already."""
    d.update(store.decode_features(d))
    d.pop("aux_scale", None)
    return d


def host_batch(src: Source, rows: list[list[int]], B: int, T: int, tc, emb_table) -> dict:
    """One micro-batch (host_batches of one)."""
    return host_batches(src, [rows], B, T, tc, emb_table)[0]


def grouped(jobs, size: int, start: int = 0):
    """Consecutive jobs in lists of at most `size`, cut where a job's index in the whole run
    (start + its place here) is a multiple of `size`: a run resumed at any job groups its
    jobs, and so captures their samples, as the uninterrupted run did."""
    group: list = []
    for j, job in enumerate(jobs, start):
        if group and j % size == 0:
            yield group
            group = []
        group.append(job)
    if group:
        yield group


def device_batch(hb: dict, device, head, fused: bool) -> dict:
    """Model inputs on the device; the teacher as the loss wants it: dense log-probs from
    store.teacher_logprobs, or (fused loss) top-k as stored, never densified."""
    d = widen({k: v.to(device, non_blocking=True) for k, v in hb.items() if torch.is_tensor(v)})
    B, T = d["seq_id"].shape
    with torch.no_grad():
        if "teacher_hidden" in d:
            t = {"logp": store.teacher_logprobs({"teacher_hidden": d["teacher_hidden"]
                                                 .reshape(B * T, -1)}, head)}
        elif fused:
            t = {"ids": d["teacher_topk_ids"].reshape(B * T, -1),
                 "logp": d["teacher_topk_logp"].reshape(B * T, -1)}
        else:
            t = {"logp": store.teacher_logprobs(
                {"teacher_topk_ids": d["teacher_topk_ids"].reshape(B * T, -1),
                 "teacher_topk_logp": d["teacher_topk_logp"].reshape(B * T, -1)},
                head.weight.shape[0])}
    d["teacher"] = t
    d["tokens_t"] = hb["tokens"]
    return d


def model_inputs(d: dict) -> dict:
    """The training forward's arguments: TTT's, or with anchors a block drafter's."""
    keys = ("input_ids", "anchors") if "anchors" in d else ("src",)
    return {k: d[k] for k in ("aux", "emb", "position_ids", "seq_id", *keys, "rows", "trows",
                              "weights", "teacher")}


class Prefetch:
    """Builds batches on a thread, in order; errors surface in next(). `make(job)` returns a
    list of batches (several micro-batches from one capture call online: host_batches), queued
    one by one, at most `depth` waiting.

    With `device` a CUDA device (online training: `make` runs the target), the thread issues its
    GPU work on a stream of its own, so the target's forward for the next micro-batch overlaps
    the drafter's step instead of waiting for it; next() makes the caller's stream wait for the
    batch and marks its tensors as in use there (the allocator then keeps them until that
    stream is done). Without, `threads` threads build host batches (pinned) for the main thread,
    each a job at a time, handed over in the jobs' order (offline training: one thread fell
    behind a fast GPU's step), their torch ops on `intra_op` intra-op threads each (0: torch's
    default, one per core): a building thread's ops otherwise start a team of threads per core,
    which take the cores the training step's own host work needs; one intra-op thread each
    builds as fast and leaves the step's host work its cores (BENCHMARKS.md, Figures behind
    design choices)."""

    def __init__(self, make, jobs, depth: int = 2, device=None, threads: int = 1,
                 intra_op: int = 1):
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.stop, self.device = False, device
        stream = torch.cuda.Stream(device) if device is not None and device.type == "cuda" \
            else None
        if stream is not None and threads != 1:
            raise ValueError("Prefetch: one thread runs the target (online)")

        def own_threads():  # this thread's count; threads running keep theirs (a thread
            # started later takes the count set last, by any thread)
            if stream is None and intra_op:
                torch.set_num_threads(intra_op)

        def build(job):
            if stream is None:
                return make(job), None
            with torch.cuda.stream(stream):
                items = make(job)
                done = torch.cuda.Event()
                done.record(stream)
            return items, done

        def built():  # (items, done) of each job, in order; up to `threads` being built
            if threads == 1:
                yield from map(build, jobs)
                return
            pool = ThreadPoolExecutor(threads, thread_name_prefix="train-build",
                                      initializer=own_threads)
            try:
                pending: collections.deque = collections.deque()
                for job in jobs:
                    pending.append(pool.submit(build, job))
                    if len(pending) == threads:
                        yield pending.popleft().result()
                while pending:
                    yield pending.popleft().result()
            finally:
                pool.shutdown(wait=False, cancel_futures=True)

        def loop():
            if stream is not None:
                torch.cuda.set_device(device)
            own_threads()  # the one that builds when threads == 1
            try:
                for items, done in built():
                    for item in items:
                        if self.stop:
                            return
                        self.q.put((item, done, None))
                    if self.stop:
                        return
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                self.q.put((None, None, e))
        self.thread = threading.Thread(target=loop, name="train-prefetch", daemon=True)
        self.thread.start()

    def next(self):
        item, done, err = self.q.get()
        if err is not None:
            raise err
        if done is not None:
            here = torch.cuda.current_stream(self.device)
            here.wait_event(done)
            for v in item.values():
                if torch.is_tensor(v) and v.is_cuda:
                    v.record_stream(here)
        return item

    def close(self):
        self.stop = True
        with contextlib.suppress(queue.Empty):
            while True:
                self.q.get_nowait()
