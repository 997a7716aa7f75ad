"""The data engine: batched generation of a target in-process, as fast as one GPU allows, for the
generate step's `engine: drafter` (answers, and the user turns of synthetic prompts).

    eng = Generator(model, max_batch=1024)                        # any HF causal LM it supports
    res = eng.generate(prompts, max_new=512, stop_ids=[2])     # list[Result], prompt order
    (drafter.generation.local.LocalGenerator: one Generator per visible GPU, the generate step's)
    feed = gen.start(on_result, max_len=8192, max_new=512)    # an open stream, decoding now
    feed.put(prompts, 512, 0.0, tags); ...; feed.join()       # on_result(tag, token_ids, finish)

Shapes: B rows (max_batch), V target vocab, P tokens per page, W pages per row (table width).

How it works:
  - KV cache: drafter.generation.paged, pages of P tokens. A request is admitted when the pages
    for its prompt plus its max_new tokens are free, so a batch never runs out of memory
    mid-answer and each row holds only its own length (the static cache held every row at the
    longest prompt's length).
  - Memory plan (`plan`): pages = the free GPU memory times `memory_fraction`, less what a prefill
    chunk and the decode step need (measured on a dry run), capped at what the requests can use.
    A request that can never fit (prompt + max_new over the pool or the model's positions) is
    returned as finish "too_long" instead of failing the batch.
  - Continuous batching: every `sync_every` steps the host reads which rows finished (one sync),
    and once `refill_fraction` of the rows are free prefills the next prompts into them. A long
    answer never holds the others back. The GPU does not wait on the host's bookkeeping: inputs
    go up from pinned buffers without a sync (drafter.decoding.static.Uploads), and the finished
    rows' tokens are copied out at once but read only after the next prefill and decode round
    are queued.
  - Prefill: an admission's prompts packed one after another into chunks of at most
    `prefill_tokens` tokens, each one forward [1, N] in which a token attends only within its
    own prompt (drafter.generation.paged.packed_attention): no padding, however mixed the lengths.
    On CUDA a chunk is padded up to a bucket (PREFILL_BUCKETS: 512, 768, 1024, ... tokens) and
    replays that bucket's CUDA graph; an eager forward of a new shape is all kernel launches.
    Logits only at each prompt's last token.
  - The decode step (B rows, one token each) is one CUDA graph per batch bucket (B, B/2, ... 8):
    rows without a request write to the sink page and attend to nothing. When the queue is empty
    the live rows are compacted into the lowest rows (their page tables move, their pages do not)
    and the smallest bucket that holds them runs, so the tail of long answers runs small.
  - Sampling per row: greedy at temperature 0, else Gumbel-max over logits / temperature, in one
    read of the logits (drafter.generation.sampling; with nucleus top_p < 1 for all rows: torch's
    sort), one seeded stream per call (per feed).
  - Streaming (`Stream`, `LocalGenerator.start`): requests may be put while the generators decode;
    an idle generator waits on the open stream, and ends once it is closed, empty and no row is
    live. The plan is then sized from the caller's bound (max prompt + max_new tokens) instead
    of the requests. `generate` is one closed stream (put all, close).

Models with sliding windows, softcapping or scaled logits (drafter.generation.paged.unsupported)
run on the static decoder instead (drafter.decoding.decode.Decoder: static batches, same results,
slower).
"""
from __future__ import annotations

import inspect
import itertools
import logging
import math
import time
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from drafter.core.gpu import triton_available
from drafter.decoding.static import (
    Graphs,
    Uploads,
    capturable_experts,
    eager_attention,
    syncing_experts,
)
from drafter.decoding.tree import DecodeError
from drafter.generation.paged import PagedCache, paged_context, unsupported, use_paged_attention
from drafter.generation.sampling import sample_rows
from drafter.generation.stream import Request, Result, Stream, requests  # noqa: F401 (the API)

log = logging.getLogger("drafter")

MIN_BUCKET = 8
# An open stream's pool takes this share of memory_fraction of the free memory (a closed call's
# is sized by its requests). At the whole share the first prefills ran out of memory when a
# prefill group was padded to its longest prompt, which an open stream's mixed admissions made
# large. A packed chunk holds at most prefill_tokens tokens, the size the activation reserve
# measures; the share stays until a run at 0.9 shows that it fits.
OPEN_POOL_SHARE = 0.4
# A graphed prefill chunk of N tokens runs the smallest bucket that holds it (padding: sink
# writes, attending to nothing); steps of about 1.5x keep a third of it at most.
PREFILL_BUCKETS = tuple(b for k in range(9, 20) for b in (1 << k, 3 << (k - 1)))


class _Rows:
    """Persistent per-row decode state (updated in place: the captured step reads it)."""

    def __init__(self, B: int, W: int, out_width: int, n_stop: int, device):
        z = dict(dtype=torch.long, device=device)
        self.tok, self.ctx, self.n_out, self.max_new, self.write = (torch.zeros(B, **z)
                                                                     for _ in range(5))
        self.temp = torch.zeros(B, dtype=torch.float32, device=device)
        self.active = torch.zeros(B, dtype=torch.bool, device=device)
        self.out = torch.zeros(B, out_width, **z)
        self.table = torch.zeros(B, W, dtype=torch.int32, device=device)
        self.lens = torch.zeros(B, dtype=torch.int32, device=device)
        self.stop = torch.full((max(1, n_stop),), -1, **z)

    def tensors(self) -> list[Tensor]:
        return [self.tok, self.ctx, self.n_out, self.max_new, self.write, self.temp, self.active,
                self.out, self.table, self.lens]


class GeneratorUnsupported(DecodeError):
    pass


class Generator:
    """Batched generation of one target on its device (module docstring). `last` holds the
    figures of the latest call: seconds (prefill_, decode_, wait_, capture_seconds; the GPU
    timeline's prefill_ and decode_gpu_seconds), steps, sampling_steps, tokens, requests,
    admissions, prefill_groups, prefill_tokens, prefill_padded_tokens, pages, page_bytes,
    peak_bytes, batch."""

    def __init__(self, model, max_batch: int = 256, page_size: int = 64,
                 prefill_tokens: int = 32768, memory_fraction: float = 0.9,
                 cuda_graphs: bool = True, sync_every: int = 8, refill_fraction: float = 1 / 16):
        why = unsupported(model)
        if why:
            raise GeneratorUnsupported(f"{type(model).__name__}: {why}")
        use_paged_attention(model)
        from drafter.features.capture import output_head, text_decoder

        # a multimodal wrapper's get_decoder() is its whole language model: follow it down
        self.model, self.decoder = model, text_decoder(model)
        self.head = output_head(model)
        emb = model.get_input_embeddings().weight
        self.device, self.dtype = emb.device, emb.dtype
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5.2x
        from drafter.core.target import text_config
        self.max_positions = int(getattr(text_config(model.config), "max_position_embeddings",
                                         0) or 0)
        self.max_batch, self.P = max_batch, page_size
        self.prefill_tokens, self.memory_fraction = prefill_tokens, memory_fraction
        self.sync_every, self.refill_fraction = max(1, sync_every), refill_fraction
        # MoE experts that sync with the host decode as batched_mm in the captured steps, whose
        # memory grows with the tokens: such a target's prefill chunks stay eager (as Decoder's)
        graphed = cuda_graphs and self.device.type == "cuda"
        self.graphs = Graphs(graphed, context=lambda: capturable_experts(model))
        self.prefill_graphs = Graphs(graphed and not syncing_experts(model), "prefilling")
        self._prefill_in: dict[int, dict[str, Tensor]] = {}   # bucket -> its graph's inputs
        self._seed = torch.zeros(1, dtype=torch.long, device=self.device)  # sampling's noise key
        self._upload = Uploads(self.device)
        self.cache = PagedCache()
        self.cache.use_triton = triton_available(self.device)
        with paged_context(self.cache):                        # the probe: head layout per layer
            self.cache.prefill(None)
            self._forward(torch.zeros(1, 1, dtype=torch.long, device=self.device),
                          torch.zeros(1, 1, dtype=torch.long, device=self.device))
        self.page_bytes = self.cache.bytes_per_token(self.dtype) * page_size
        self.pages = 0
        self.rows: _Rows | None = None
        self._reserve: int | None = None
        self.last: dict = {}

    # ------------------------------------------------------------------------ the forwards
    def _forward(self, ids: Tensor, pos: Tensor) -> Tensor:
        """The decoder over ids [R, T] at positions pos [R, T] -> last hidden states [R, T, H]."""
        out = self.decoder(input_ids=ids, position_ids=pos, use_cache=True,
                           **{self._cache_kw: self.cache})
        return out.last_hidden_state

    def _pick(self, logits: Tensor, temp: Tensor, top_p: float, sampling: bool) -> Tensor:
        """Next token per row from logits [R, V]: argmax where temp == 0, else a Gumbel-max
        sample of logits / temp within the top_p nucleus."""
        if not sampling:
            return logits.argmax(-1)
        nxt = sample_rows(logits, temp, self._seed, self.cache.use_triton, top_p)
        self._seed.add_(1)
        return nxt

    def _step(self, b: int, top_p: float, sampling: bool, w: int | None = None) -> None:
        """One decode step of rows [0, b) over the first w page-table columns (all: None):
        captured once per (b, w, sampling, top_p)."""
        r, P = self.rows, self.P
        table = r.table[:b, :w]
        act = r.active[:b]
        ctx = r.ctx[:b]
        page = table.gather(1, (ctx // P).clamp(max=table.shape[1] - 1)[:, None])[:, 0]
        r.write[:b] = torch.where(act, page.long() * P + ctx % P, 0)
        r.lens[:b] = torch.where(act, ctx + 1, 0).int()
        self.cache.decode(r.write[:b], table, r.lens[:b])
        h = self._forward(r.tok[:b, None], ctx[:, None])[:, -1]                    # [b, H]
        nxt = self._pick(self.head(h), r.temp[:b], top_p, sampling)                # [b]
        col = torch.where(act, r.n_out[:b], r.out.shape[1] - 1)
        r.out[:b].scatter_(1, col[:, None], nxt[:, None])
        r.n_out[:b] += act.long()
        r.ctx[:b] += act.long()
        r.tok[:b] = torch.where(act, nxt, r.tok[:b])
        done = (nxt[:, None] == r.stop).any(-1) | (r.n_out[:b] >= r.max_new[:b])
        r.active[:b] = act & ~done

    def _first_logits(self, last: Tensor) -> Tensor:
        """The head over the prompts' last hidden states [R, H] -> [R, V], fed at least
        MIN_BUCKET rows (zeros after the R), as every decode step is: with one row cuBLAS may
        take a matrix-vector kernel whose sums round otherwise, and a prompt's first token would
        then depend on how many prompts shared its admission (BENCHMARKS.md, Data engine: the
        note on greedy answers at small batches)."""
        n = last.shape[0]
        if n >= MIN_BUCKET:
            return self.head(last)
        return self.head(torch.cat([last, last.new_zeros(MIN_BUCKET - n, last.shape[1])]))[:n]

    def _prefill(self, rows: list[int], reqs: list[Request], top_p: float,
                 sampling: bool) -> tuple[int, int]:
        """Prompts into rows (their page tables are set), packed into chunks of at most
        prefill_tokens tokens (one prompt over it: a chunk of its own); each row's first new
        token from its last prompt position. Returns (chunks, tokens): the forwards it ran and
        the tokens they held (a graphed chunk: its bucket). Nothing here waits for the GPU: the
        host prepares a chunk (numpy, one upload) while the GPU runs the one before."""
        r = self.rows
        lens = np.fromiter((len(q.ids) for q in reqs), np.int64, len(reqs))
        i = chunks = ran = 0
        while i < len(reqs):
            j, n_tok = i + 1, int(lens[i])
            while j < len(reqs) and n_tok + lens[j] <= self.prefill_tokens:
                n_tok, j = n_tok + int(lens[j]), j + 1
            last, tokens, meta = self._prefill_chunk(reqs[i:j], rows[i:j], lens[i:j])  # [R, H]
            i = j
            chunks, ran = chunks + 1, ran + tokens
            ridx, n_prompt, max_new, temp = meta[0], meta[1], meta[2], \
                meta[3].view(torch.float64).float()                                 # [R] each
            first = self._pick(self._first_logits(last), temp, top_p, sampling)     # [R]
            r.tok.index_copy_(0, ridx, first)
            r.ctx.index_copy_(0, ridx, n_prompt)
            r.n_out.index_fill_(0, ridx, 1)
            r.max_new.index_copy_(0, ridx, max_new)
            r.temp.index_copy_(0, ridx, temp)
            r.out[ridx, 0] = first
            done = (first[:, None] == r.stop).any(-1) | (max_new <= 1)
            r.active.index_copy_(0, ridx, ~done)
        return chunks, ran

    def _prefill_chunk(self, grp: list[Request], rws: list[int], lens: np.ndarray
                       ) -> tuple[Tensor, int, Tensor]:
        """One packed forward of grp's prompts into rows rws -> (the hidden states at each
        prompt's last token [R, H], the tokens the forward ran, each prompt's row, length,
        max_new and temperature (float64 bits) [4, R]). Graphed per bucket on CUDA with the
        Triton attention; eager (exactly N tokens) elsewhere. Everything travels in one int64
        upload: ids, positions, each token's prompt start, row and whether it is real [5, Nb],
        each prompt's last index [S], then the prompts' [4, R]."""
        n, N = len(grp), int(lens.sum())
        Nb = next((b for b in PREFILL_BUCKETS if b >= N), None) \
            if self.prefill_graphs.enabled and self.cache.use_triton \
            and N <= self.prefill_tokens else None
        S = min(self.max_batch, Nb) if Nb else n
        Nx = Nb or N
        host = np.zeros(5 * Nx + S + 4 * n, np.int64)
        ids, pos, starts, row, real = host[:5 * Nx].reshape(5, Nx)
        begin = np.cumsum(lens) - lens
        ids[:N] = np.fromiter(itertools.chain.from_iterable(q.ids for q in grp), np.int64, N)
        starts[:N] = np.repeat(begin, lens)
        starts[N:] = -1                   # padding: position 0, the sink, attending to nothing
        pos[:N] = np.arange(N) - starts[:N]
        row[:N] = np.repeat(np.asarray(rws, np.int64), lens)
        real[:N] = 1
        host[5 * Nx:5 * Nx + n] = begin + lens - 1
        meta = host[5 * Nx + S:].reshape(4, n)
        meta[0], meta[1] = rws, lens
        meta[2] = [q.max_new for q in grp]
        meta[3] = np.array([q.temperature for q in grp], np.float64).view(np.int64)
        dev = self._upload(host)
        meta_dev = dev[5 * Nx + S:].view(4, n)

        def forward(x: Tensor) -> Tensor:                                 # -> [S, H]
            ids, pos, starts, row, real = x[:5 * Nx].view(5, Nx)
            slot = self.rows.table[row, pos // self.P].long() * self.P + pos % self.P
            self.cache.prefill(torch.where(real > 0, slot, 0), starts.int())
            h = self._forward(ids[None], pos[None])[0]                              # [Nx, H]
            return h.index_select(0, x[5 * Nx:5 * Nx + S])

        if Nb is None:
            with eager_attention():       # SDPA without cuDNN (a plan per new shape) where used
                return forward(dev), N, meta_dev
        x = self._prefill_in.get(Nb)
        if x is None:
            x = self._prefill_in[Nb] = {
                "in": torch.zeros(5 * Nb + S, dtype=torch.long, device=self.device),
                "h": torch.zeros(S, self.head.weight.shape[1], dtype=self.dtype,
                                 device=self.device)}
        x["in"].copy_(dev[:5 * Nb + S])
        self.prefill_graphs.run(("prefill", Nb), lambda: x["h"].copy_(forward(x["in"])), [])
        return x["h"][:n], Nb, meta_dev

    # ------------------------------------------------------------------------ memory
    def _activation_reserve(self, top_p: float) -> int:
        """Bytes a prefill chunk and the decode step need beyond the pools, measured once on a
        dry run (pages: the sink only), plus the decode logits at max_batch."""
        if self._reserve is not None:
            return self._reserve
        if self.device.type != "cuda":
            self._reserve = 0
            return 0
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        T = min(self.prefill_tokens, 2048)
        R = max(1, self.prefill_tokens // T)
        self.cache.allocate(1, self.P, self.dtype, self.device)
        with paged_context(self.cache), torch.no_grad():               # R packed prompts of T
            t = torch.arange(R * T, device=self.device)
            self.cache.prefill(torch.zeros(R * T, dtype=torch.long, device=self.device),
                               (t - t % T).int())
            h = self._forward(torch.zeros(1, R * T, dtype=torch.long, device=self.device),
                              (t % T)[None])
            self.head(h[0, T - 1::T]).float()
            del h
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.cache.allocate(0, self.P, self.dtype, self.device)
        V = self.head.weight.shape[0]
        logits = self.max_batch * V * (4 * 3 + (8 if top_p < 1 else 0))
        self._reserve = int(peak + logits + (512 << 20))  # + the graph pool, cuBLAS workspace
        return self._reserve

    def plan(self, reqs: Sequence[Request], top_p: float = 1.0, max_len: int | None = None
             ) -> int:
        """Pages for the pools: what the largest max_batch requests could hold at once (with
        max_len: max_batch rows of max_len tokens, for requests not known yet), capped on CUDA
        by free memory x memory_fraction less the activation reserve. Raises when not even the
        smallest request fits."""
        P = self.P
        if max_len is not None:
            need = [math.ceil(max_len / P)] * self.max_batch
            need_min = 1
        else:
            need = [math.ceil((len(q.ids) + q.max_new) / P) for q in reqs]
            need_min = min(need)
        want = 1 + sum(sorted(need, reverse=True)[:self.max_batch])
        if self.device.type != "cuda":
            if max_len is not None:   # no free-memory figure: rows of 512 tokens, one of max_len
                want = 1 + max(self.max_batch * math.ceil(min(max_len, 512) / P), need[0])
            return want
        reserve = self._activation_reserve(top_p)
        self.cache.allocate(0, P, self.dtype, self.device)             # free the old pools
        self.pages, self.rows = 0, None
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)
        share = self.memory_fraction * (OPEN_POOL_SHARE if max_len is not None else 1.0)
        budget = int(free * share) - reserve
        fit = budget // self.page_bytes
        if fit < 1 + need_min:
            raise DecodeError(
                f"generate (local): {free / 2**30:.1f} GiB free on {self.device}, the decode step "
                f"and prefill need {reserve / 2**30:.1f} GiB and the shortest request "
                f"{need_min * self.page_bytes / 2**30:.2f} GiB of KV cache: lower "
                f"generate.batch_size (now {self.max_batch}) or generate.max_tokens, or free the "
                f"GPU")
        return int(min(want, fit))

    def _allocate(self, pages: int, out_width: int, W: int, n_stop: int) -> None:
        shape = (self.max_batch, W, out_width, n_stop)
        if pages != self.pages or self.rows is None or self._shape != shape:
            self.graphs.clear()                      # their captures hold the old pools
            self.prefill_graphs.clear()
            self.cache.allocate(pages, self.P, self.dtype, self.device)
            self.rows = _Rows(self.max_batch, W, out_width, n_stop, self.device)
            self.pages, self._shape = pages, shape

    # ------------------------------------------------------------------------ the loop
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new: int | Sequence[int], *,
                 stop_ids: Sequence[int] = (), temperature: float | Sequence[float] = 0.0,
                 top_p: float = 1.0, progress=None) -> list[Result]:
        """Decode each prompt (token ids) for up to max_new new tokens (one value, or one per
        prompt), stopping at a stop id. Results come back in prompt order."""
        reqs = requests(prompts, max_new, temperature)
        results: list[Result | None] = [None] * len(reqs)
        stream = Stream(reqs)
        stream.close()

        def put(q: Request, res: Result) -> None:
            results[q.index] = res
        self.run(stream, put, stop_ids, top_p, progress)
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def run(self, queue: Stream, on_result, stop_ids: Sequence[int], top_p: float,
            progress=None, sampling: bool | None = None) -> None:
        """Drain `queue` (shared with other replicas): on_result(request, Result) as each row
        ends (called on this thread). A closed stream is planned for its own requests; an open
        one for queue.bound, and the loop waits for requests while it is open and empty, until
        it is closed, empty and no row is live. sampling: whether any request may sample (the
        requests' own temperatures decide when None). `last` splits the seconds: prefill,
        decode (the graph replays and reading the rows that ended), wait (no row live, the
        stream empty but open), capture."""
        t_start = time.perf_counter()
        cap0 = self.graphs.capture_seconds
        last = {"seconds": 0.0, "prefill_seconds": 0.0, "decode_seconds": 0.0,
                "wait_seconds": 0.0, "capture_seconds": 0.0, "steps": 0, "tokens": 0,
                "requests": 0, "too_long": 0, "admissions": 0, "prefill_groups": 0,
                "prefill_tokens": 0, "prefill_padded_tokens": 0, "sampling_steps": 0,
                "decode_gpu_seconds": 0.0, "prefill_gpu_seconds": 0.0}
        self.last = last
        with queue.lock:
            known, open_ = queue.reqs[queue.head:], not queue.closed
        if not known and not open_:
            return
        use_paged_attention(self.model)  # a static decoder on the same model may have switched it
        P = self.P
        if open_ and queue.bound is not None:
            max_len, max_out = queue.bound
            if self.max_positions:
                max_len = min(max_len, self.max_positions)
            pages = self.plan((), top_p, max_len=max_len)
            W = max(1, math.ceil(max_len / P))
        else:
            if not known:                      # open without a bound: wait for the first ones
                while not known and queue.wait(1.0):
                    known = queue.pending()
                if not known:
                    return
            fits = [q for q in known if not self.max_positions
                    or len(q.ids) + q.max_new <= self.max_positions]
            pages = self.plan(fits or known[:1], top_p)
            W = max(1, max(math.ceil((len(q.ids) + q.max_new) / P) for q in (fits or known)))
            max_out = max(q.max_new for q in known)
        W = min(W, pages - 1) if pages > 1 else 1
        self._allocate(pages, max_out + 1, W, len(stop_ids))
        r, B = self.rows, self.max_batch
        for t in r.tensors():
            t.zero_()
        r.stop.fill_(-1)
        if stop_ids:
            r.stop[:len(stop_ids)] = torch.tensor(list(stop_ids), device=self.device)
        if sampling is None:
            sampling = any(q.temperature > 0 for q in known)
        stops = set(int(s) for s in stop_ids)
        free_pages = list(range(pages - 1, 0, -1))                 # page 0: the sink
        free_rows = list(range(B - 1, -1, -1))
        live: dict[int, tuple[Request, list[int]]] = {}
        refill_min = max(1, int(B * self.refill_fraction))
        buckets = sorted({B} | {b for b in (B >> i for i in range(1, 12)) if b >= MIN_BUCKET})
        last.update(pages=pages, page_bytes=self.page_bytes, batch=B, table_width=W,
                    triton=self.cache.use_triton)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._seed.fill_(int(torch.randint(0, 2**62, (1,))))     # from the caller's seeded stream
        # the GPU timeline's span of each decode round and each admission (CUDA events, read at
        # the next sync): the wall seconds less these are the GPU waiting on the host between
        timed = self.device.type == "cuda"
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if timed else []
        pending: list = []

        def done(q: Request, res: Result) -> None:
            last["requests"] += 1
            on_result(q, res)
            if progress is not None:
                progress.update(1)

        # the rows that ended: their tokens are copied out at once (their rows and pages go
        # back to the free lists) and read once the next prefill and decode round are queued,
        # so that the GPU does not wait on this bookkeeping
        held: list = []                         # (requests, [n_out, out...] on the host, event)

        def flush() -> None:
            for reqs_, host_, copied in held:
                if copied is not None:
                    copied.synchronize()
                for q, toks in zip(reqs_, host_.tolist()):
                    toks = toks[1:1 + min(toks[0], q.max_new)]
                    cut = next((i for i, t in enumerate(toks) if t in stops), None)
                    toks = toks if cut is None else toks[:cut + 1]
                    last["tokens"] += len(toks)
                    done(q, Result(toks, "stop" if cut is not None else "length"))
            held.clear()

        with paged_context(self.cache):
            while not queue.aborted:
                # admit: once enough rows are free (or none are live), the head of the queue
                if free_rows and (len(free_rows) >= refill_min or not live) and len(queue):
                    adm_rows, adm = [], []
                    while free_rows:
                        q = queue.peek()
                        if q is None:
                            break
                        need = math.ceil((len(q.ids) + q.max_new) / P)
                        if need > W or q.max_new > max_out or (
                                self.max_positions
                                and len(q.ids) + q.max_new > self.max_positions):
                            if queue.take_if(q):
                                last["too_long"] += 1
                                done(q, Result([], "too_long"))
                            continue
                        if need > len(free_pages) or not queue.take_if(q):
                            break
                        sampling = sampling or q.temperature > 0   # a new graph, once
                        row = free_rows.pop()
                        pg = [free_pages.pop() for _ in range(need)]
                        live[row] = (q, pg)
                        adm_rows.append(row)
                        adm.append(q)
                    if adm:
                        t0 = time.perf_counter()
                        tab = np.zeros((len(adm), 1 + W), np.int64)      # one upload: row, pages
                        tab[:, 0] = adm_rows
                        for j, row in enumerate(adm_rows):
                            pg = live[row][1]
                            tab[j, 1:1 + len(pg)] = pg
                        tab = self._upload(tab)
                        r.table.index_copy_(0, tab[:, 0], tab[:, 1:].int())
                        if timed:
                            pev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                            pev[0].record()
                        groups, padded = self._prefill(adm_rows, adm, top_p, sampling)
                        if timed:
                            pev[1].record()
                            pending.append(pev)
                        last["prefill_seconds"] += time.perf_counter() - t0
                        last["admissions"] += 1
                        last["prefill_groups"] += groups
                        last["prefill_tokens"] += sum(len(q.ids) for q in adm)
                        last["prefill_padded_tokens"] += padded
                if not live:
                    flush()
                    t0 = time.perf_counter()
                    more = queue.wait(0.05)
                    last["wait_seconds"] += time.perf_counter() - t0
                    if not more:
                        break
                    continue
                t0 = time.perf_counter()
                c0 = self.graphs.capture_seconds
                if not len(queue):                    # the tail: compact into the low rows
                    self._compact(live, free_rows)
                hi = max(live) + 1
                b = next(x for x in buckets if x >= hi)
                w = None
                if not self.cache.use_triton or self.cache.gather:
                    # this attention reads every column of the table: only as many as the
                    # longest live row holds (a power of two), not the plan's width
                    w = 1 << (max(len(pg) for _, pg in live.values()) - 1).bit_length()
                    w = None if w >= W else w
                key = ("decode", b, w, sampling, top_p)
                if timed:
                    ev[0].record()
                for _ in range(self.sync_every):
                    self.graphs.run(key, lambda: self._step(b, top_p, sampling, w),
                                    r.tensors())
                if timed:
                    ev[1].record()
                flush()
                last["steps"] += self.sync_every
                last["sampling_steps"] += self.sync_every if sampling else 0
                active = r.active.tolist()                                   # one sync
                if timed:
                    last["decode_gpu_seconds"] += ev[0].elapsed_time(ev[1]) / 1000
                    last["prefill_gpu_seconds"] += sum(a.elapsed_time(z) for a, z in pending) / 1000
                    pending.clear()
                ended = [row for row in live if not active[row]]
                if ended:
                    idx = self._upload(np.asarray(ended, np.int64))
                    out = torch.cat([r.n_out[idx, None], r.out[idx]], 1)   # [n, 1 + out width]
                    out = out.to("cpu", non_blocking=timed)         # pinned, copied in order
                    copied = None
                    if timed:
                        copied = torch.cuda.Event()
                        copied.record()
                    reqs_ = []
                    for row in ended:
                        q, pg = live.pop(row)
                        reqs_.append(q)
                        free_pages.extend(pg)
                        free_rows.append(row)
                    held.append((reqs_, out, copied))
                    free_rows.sort(reverse=True)                    # the lowest rows first
                last["decode_seconds"] += (time.perf_counter() - t0
                                           - (self.graphs.capture_seconds - c0))
            flush()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            last["peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
        last["capture_seconds"] = self.graphs.capture_seconds - cap0
        last["seconds"] = time.perf_counter() - t_start - last["capture_seconds"]

    def _compact(self, live: dict, free_rows: list[int]) -> None:
        """Move live rows above the lowest free rows down into them (state and page tables;
        the pages themselves stay), so that a smaller bucket holds every live row."""
        moves = []
        for row in sorted(live, reverse=True):
            if not free_rows or free_rows[-1] > row:
                break
            dst = free_rows.pop()
            moves.append((row, dst))
            live[dst] = live.pop(row)
            free_rows.append(row)
            free_rows.sort(reverse=True)
        if not moves:
            return
        src = torch.tensor([m[0] for m in moves], device=self.device)
        dst = torch.tensor([m[1] for m in moves], device=self.device)
        for t in self.rows.tensors():
            t.index_copy_(0, dst, t.index_select(0, src))
        self.rows.active.index_fill_(0, src, False)
