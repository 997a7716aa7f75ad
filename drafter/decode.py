"""Static-KV-cache decoding: plain decoding of the target, and speculative decoding with a drafter.

    dec = Decoder(model, max_batch=8)                                  # any HF causal LM
    plain = dec.generate(prompts, 128, stop_ids=[2])                   # list[Output]
    spec = dec.generate(prompts, 128, stop_ids=[2], proposer=EagleDraft(drafter),
                        tree=TreeSpec.chain(5))                        # or TreeSpec(6, 8, 48)
    gen = LocalGenerator(cfg.target, batch_size=256)                   # generate step, engine=local
    gen.generate([[1, 2, 3]], max_new_tokens=64, temperature=0.7, top_p=0.9, seed=0)

Shapes: B rows, T new tokens of a forward, S attention span (static cache slots read), V target
vocab, Vd draft vocab, A aux layers, Ht target hidden, H drafter hidden, D tree depth (chain: K),
k children per node (chain: 1), N draft nodes verified per step, E expanded nodes (1 + (D-1)·k).

The cache. Every row owns slots [0, Smax) of one static buffer per layer ([Bmax, heads, Smax, dim],
`SlotCache`). Prompts are left-padded: row b's prompt sits in slots [start_b, Tp); slot s holds
position s - start_b. Each forward writes its T tokens at per-row slots [B, T] and attends over the
first S slots under a per-row boolean visibility mask, so rows advance independently (speculation
accepts a different count per row) while every shape stays fixed: the step can be captured in a
CUDA graph (one graph per (batch, span bucket)), which is what makes small-model decoding fast
(launch overhead dominates otherwise: ../shared/docs/REFERENCES.md).

One speculative step (greedy or sampling; the chain is the tree with k = 1):
  1. draft: from the drafter's distribution after the last committed token (`root`), EAGLE-2's
     dynamic tree: the root's top-k children; at each depth the k best frontier nodes (cumulative
     log-prob) are scored by the drafter in one forward, each proposing k children; the N best of
     all candidates form the tree (ancestor-closed since log-probs only fall along a path).
  2. verify: one target forward over [pending token, N nodes] with the tree's ancestor mask.
     Greedy: a node is accepted when its parent is and it equals the target's argmax at its parent.
     Sampling: recursive rejection sampling (each child in turn accepted with min(1, p/q), else
     p <- norm(max(p - q, 0)) and the child's q mass removed), which reduces to the standard
     rejection sampling of Leviathan et al. for the chain; the bonus token comes from the last p.
  3. commit: the accepted path's KV entries move to contiguous slots; the drafter re-reads the
     accepted tokens with the target's true aux hidden states (`observe`), giving the next root.

Sampling stays lossless with the tree because a child is sampled without replacement from q
(Gumbel top-k) and ranked by the r-th largest log-prob of its parent (`build_tree`), not by its own:
which nodes enter the tree then never depends on the identity of a node still to be verified.

The drafter is an interface (`DraftModel`: observe/score), so that tests plug in oracle and
always-wrong drafters; `EagleDraft` wraps drafter.model.Drafter with its own static cache. The
drafting half (tree building, verification, `DraftModel`, `EagleDraft`) lives in drafter.tree.
"""
from __future__ import annotations

import inspect
import logging
import time
from contextlib import nullcontext as _nullcontext
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

# the drafting half of speculative decoding; EagleDraft and the tree helpers are re-exported here
from .tree import (DecodeError, DraftModel, EagleDraft, TreeSpec, _additive,  # noqa: F401
                   ancestors, build_tree, pick, verify_greedy, verify_sample)

log = logging.getLogger("drafter")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ------------------------------------------------------------------------------- the static cache
def _slot_cache_class():
    from transformers.cache_utils import Cache

    class SlotCache(Cache):
        """Static per-layer buffers [Bmax, heads, Smax, dim] written at per-row slots.

        Before each forward the caller sets `slots` [B, T] (where each new token goes) and `span`
        (how many leading slots attention reads). Buffers are allocated on the first write, from
        the shapes the model hands in, so MLA latents (DeepSeek) and any head layout work."""

        def __init__(self, max_batch: int, max_slots: int):
            super().__init__(layers=[])
            self.max_batch, self.max_slots = max_batch, max_slots
            self.k: dict[int, Tensor] = {}
            self.v: dict[int, Tensor] = {}
            self.slots: Tensor | None = None
            self.rows: Tensor | None = None   # set: the batch is these cache rows (a refill)
            self.span = max_slots

        def _buf(self, store: dict, i: int, x: Tensor) -> Tensor:
            if i not in store:
                store[i] = torch.zeros(self.max_batch, x.shape[1], self.max_slots, x.shape[3],
                                       dtype=x.dtype, device=x.device)  # zeros: no NaN garbage
            return store[i]

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            B, T = self.slots.shape
            out = []
            for store, x in ((self.k, key_states), (self.v, value_states)):
                buf = self._buf(store, layer_idx, x)
                idx = self.slots[:, None, :, None].expand(B, x.shape[1], T, x.shape[3])
                if self.rows is not None:                             # eager refills only
                    sub = buf.index_select(0, self.rows).scatter_(2, idx, x.to(buf.dtype))
                    buf.index_copy_(0, self.rows, sub)
                    out.append(sub[:, :, : self.span])
                    continue
                buf[:B].scatter_(2, idx, x.to(buf.dtype))
                out.append(buf[:B, :, : self.span])                   # [B, heads, S, dim]
            return out[0], out[1]

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0  # positions are always given explicitly

        def copy_slots(self, src: Tensor, dst: Tensor) -> None:
            """Move each row's entries at slots src [B, n] to slots dst [B, n] (all layers)."""
            B, n = src.shape
            for store in (self.k, self.v):
                for buf in store.values():
                    shape = (B, buf.shape[1], n, buf.shape[3])
                    vals = buf[:B].gather(2, src[:, None, :, None].expand(shape))
                    buf[:B].scatter_(2, dst[:, None, :, None].expand(shape), vals)

        def nbytes(self) -> int:
            return sum(b.numel() * b.element_size() for s in (self.k, self.v) for b in s.values())

    return SlotCache


_GQA_IMPL = "drafter_gqa_sdpa"


def _gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
              is_causal=None, **kwargs):
    """transformers attention function (registered as `drafter_gqa_sdpa`) for the static-cache
    decoder: SDPA over grouped KV heads without copying them. transformers' own SDPA path repeats
    K/V g times whenever a mask is given (it always is here: slots, trees), which made attention
    over long spans memory-bound on that copy: the g query heads of a KV head are folded into
    the query length instead. query [B, nh, T, hd]; key, value [B, nkv, S, hd];
    attention_mask [B, 1, T, S] additive. Returns [B, T, nh, hd]."""
    B, nh, T, hd = query.shape
    nkv, S = key.shape[1], key.shape[2]
    g = nh // nkv
    plain = (g == 1 or attention_mask is None or attention_mask.shape[1] != 1 or dropout
             or kwargs.get("softcap") or kwargs.get("s_aux") is not None
             or getattr(module, "sinks", None) is not None)
    if plain:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    q = query.reshape(B, nkv, g * T, hd)                                 # head h = kv * g + j
    m = attention_mask[:, :, :, :S]
    m = m[:, :, None].expand(B, 1, g, T, S).reshape(B, 1, g * T, S)
    o = F.scaled_dot_product_attention(q, key, value, attn_mask=m, scale=scaling)
    return o.reshape(B, nh, T, hd).transpose(1, 2).contiguous(), None   # [B, T, nh, hd]


def _use_gqa_sdpa(model) -> None:
    """Switch an HF model to `_gqa_sdpa` (registered once with transformers' interfaces)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_GQA_IMPL, _gqa_sdpa)
    AttentionMaskInterface.register(_GQA_IMPL, sdpa_mask)
    model.set_attn_implementation(_GQA_IMPL)


class StaticTarget:
    """An HF causal LM run over a `SlotCache`, with forward pre-hooks capturing the aux hidden
    states HS[k] (DESIGN.md: the residual stream entering layer k) of every token it processes."""

    def __init__(self, model):
        from .capture import decoder_layers
        from .target import text_config

        self.model = model
        tc = text_config(model.config)
        # flash kernels ignore a custom 4D mask (the tree needs one); transformers' SDPA copies
        # grouped K/V heads under a mask: `_gqa_sdpa` does neither. Eager stays (softcapping).
        if str(getattr(model.config, "_attn_implementation", None) or "") != "eager":
            _use_gqa_sdpa(model)
        types = set(getattr(tc, "layer_types", None) or ["full_attention"])
        if types - {"full_attention", "sliding_attention"}:
            raise DecodeError(f"{type(model).__name__}: layer types {sorted(types)} are not "
                              f"supported by the static-cache decoder (full and sliding attention "
                              f"only)")
        self.window = getattr(tc, "sliding_window", None) if "sliding_attention" in types else None
        self.layers = decoder_layers(model)
        self.final_norm = getattr(model.get_decoder(), "norm", None)
        self.num_layers = len(self.layers)
        emb = model.get_input_embeddings().weight
        self.device, self.dtype = emb.device, emb.dtype
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers >= 5.2x
        self._keep_kw = "logits_to_keep" in params
        self.cache = None
        self.aux_ids: tuple[int, ...] = ()
        self._aux: list[Tensor | None] = []
        self._hooks: list = []

    def allocate(self, max_batch: int, max_slots: int) -> None:
        self.cache = _slot_cache_class()(max_batch, max_slots)

    def set_aux(self, ids: Sequence[int] | None) -> None:
        """Capture HS[k] for these layer ids on every forward (None: capture nothing)."""
        ids = tuple(ids or ())
        if ids == self.aux_ids:
            return
        for h in self._hooks:
            h.remove()
        self._hooks, self.aux_ids, self._aux = [], ids, [None] * len(ids)
        for j, k in enumerate(ids):
            if not 0 <= k <= self.num_layers:
                raise DecodeError(f"aux layer id {k} out of range: the target has "
                                  f"{self.num_layers} layers (ids are HS[k], 0..{self.num_layers})")
            mod = self.layers[k] if k < self.num_layers else self.final_norm

            def hook(module, args, kwargs, j=j):
                self._aux[j] = args[0] if args else kwargs["hidden_states"]

            self._hooks.append(mod.register_forward_pre_hook(hook, with_kwargs=True))

    def forward(self, ids: Tensor, pos: Tensor, slots: Tensor, vis: Tensor, start: Tensor,
                logits_to_keep: int = 0) -> tuple[Tensor, Tensor | None]:
        """ids, pos, slots [B, T]; vis [B, T, S] bool (True: query t sees slot s); start [B].
        Returns logits [B, T or logits_to_keep, V] and aux [B, T, A, Ht] (None without ids)."""
        mask = _additive(vis, self.dtype)                                  # [B, 1, T, S]
        attn = mask
        if self.window:  # sliding layers get their window on top (slot s = position s - start)
            kpos = torch.arange(vis.shape[-1], device=vis.device)[None] - start[:, None]  # [B, S]
            near = (pos[:, :, None] - kpos[:, None, :]) < self.window                   # [B, T, S]
            attn = {"full_attention": mask, "sliding_attention": _additive(vis & near, self.dtype)}
        self.cache.slots, self.cache.span = slots, vis.shape[-1]
        kw = {self._cache_kw: self.cache}
        if self._keep_kw:
            kw["logits_to_keep"] = logits_to_keep
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=attn, use_cache=True, **kw)
        logits = out.logits
        if not self._keep_kw and logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        aux = torch.stack(self._aux, dim=2) if self.aux_ids else None      # [B, T, A, Ht]
        return logits, aux



# ------------------------------------------------------------------------------- CUDA graphs
class _Graphs:
    """One captured CUDA graph per key; eager on CPU or when capture fails (logged once).
    A step mutates persistent state in place; warm-up runs it once and restores that state."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and torch.cuda.is_available()
        self.graphs: dict = {}
        self.pool = None
        self.capture_seconds = 0.0

    def clear(self):
        self.graphs.clear()
        self.pool = None

    def run(self, key, fn, state: list[Tensor]) -> None:
        if not self.enabled:
            fn()
            return
        g = self.graphs.get(key)
        if g is None:
            t0 = time.perf_counter()
            g = self._capture(fn, state)
            self.capture_seconds += time.perf_counter() - t0
            if g is None:
                fn()
                return
            self.graphs[key] = g
        g.replay()

    def _capture(self, fn, state):
        saved = [t.clone() for t in state]

        def restore():
            for t, v in zip(state, saved):
                t.copy_(v)

        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()  # warm-up: lazy inits (cuBLAS handles, ...) must not happen under capture
            torch.cuda.current_stream().wait_stream(side)
            restore()
            g = torch.cuda.CUDAGraph()
            # thread_local: LocalGenerator's replicas capture on their GPUs at the same time
            with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
                fn()
            self.pool = g.pool()
            torch.cuda.synchronize()
            return g
        except Exception as e:  # e.g. an op that syncs with the host (data-dependent MoE routing)
            log.warning("CUDA graph capture failed (%s: %s); decoding without graphs",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self.enabled = False
            try:
                torch.cuda.synchronize()
            finally:
                restore()
            return None


# ------------------------------------------------------------------------------- the decoder
@dataclass
class Output:
    tokens: list[int]              # new tokens; the stop token is kept when it ended the text
    finish: str                    # "stop" or "length"
    steps: int                     # target forwards after the prefill
    hist: list[int] | None = None  # speculative: steps by accepted draft tokens (0..D)
    # plain greedy, per token: the NEAR runners-up (top 2.., best first) and top-1 minus each
    gaps: list[list[float]] | None = None
    second: list[list[int]] | None = None


NEAR = 8   # runners-up recorded per token for the lossless check (bf16 logits tie several ways)


class _State:
    """Persistent per-batch tensors (updated in place: captured graphs read them)."""

    def __init__(self, B: int, W: int, D: int, Vd: int, n_stop: int, dev):
        z = dict(dtype=torch.long, device=dev)
        self.B, self.W = B, W
        self.start, self.L = torch.zeros(B, **z), torch.zeros(B, **z)
        self.pending, self.n_out, self.steps = (torch.zeros(B, **z) for _ in range(3))
        self.out, self.second = torch.zeros(B, W, **z), torch.zeros(B, W, NEAR, **z)
        self.gap = torch.zeros(B, W, NEAR, dtype=torch.float32, device=dev)
        self.finished = torch.zeros(B, dtype=torch.bool, device=dev)
        self.hist = torch.zeros(B, D + 1, **z)
        self.max_new = torch.zeros((), **z)
        self.stop = torch.full((n_stop,), -1, **z)
        self.root = torch.zeros(B, max(Vd, 1), dtype=torch.float32, device=dev)

    def tensors(self) -> list[Tensor]:
        return [self.start, self.L, self.pending, self.n_out, self.steps, self.out, self.second,
                self.gap, self.finished, self.hist, self.root]


class Decoder:
    """Batched static-cache decoding of one target, plain or speculative.

    max_batch rows decode together; `span_bucket` rounds the attention span (one graph per
    bucket); `prefill_tokens` bounds B x chunk of the (eager) prefill. `last` holds the timing of
    the latest generate call: seconds (without graph capture), capture_seconds, prefill_seconds."""

    def __init__(self, model, max_batch: int = 1, cuda_graphs: bool = True,
                 span_bucket: int = 256, prefill_tokens: int = 16384):
        self.target = StaticTarget(model)
        self.max_batch = max_batch
        self.graphs = _Graphs(cuda_graphs and self.target.device.type == "cuda")
        self.span_bucket, self.prefill_tokens = span_bucket, prefill_tokens
        self.cap = (0, 0)
        self._states: dict = {}
        self._allocated: dict[int, tuple] = {}   # id -> (proposer, capacity): holds a reference,
        self.last: dict = {}                      # so that an id (a graph key) is never reused

    @property
    def device(self):
        return self.target.device

    # -- capacity
    def _ensure(self, B: int, S: int, proposer) -> None:
        if B > self.cap[0] or S > self.cap[1]:
            cap = (max(B, self.cap[0]), _round_up(max(S, self.cap[1]), self.span_bucket))
            self._reset_graphs()
            self.target.allocate(*cap)
            self.cap, self._allocated = cap, {}
        if proposer is not None and self._allocated.get(id(proposer), (None, None))[1] != self.cap:
            try:
                proposer.allocate(*self.cap, self.device, self.target.dtype)
            except torch.cuda.OutOfMemoryError as e:
                raise DecodeError(f"drafter cache for {self.cap[0]} rows x {self.cap[1]} slots "
                                  f"does not fit: lower the batch size ({e})") from None
            self._allocated[id(proposer)] = (proposer, self.cap)
            self._reset_graphs()

    def _reset_graphs(self):
        self.graphs.clear()

    def _state(self, B, W, D, Vd, n_stop) -> _State:
        key = (B, W, D, Vd, n_stop)
        if key not in self._states:
            self._states[key] = _State(B, W, D, Vd, n_stop, self.device)
        return self._states[key]

    # -- public
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 stop_ids: Sequence[int] = (), temperature: float = 0.0, top_p: float = 1.0,
                 proposer: DraftModel | None = None, tree: TreeSpec | None = None,
                 record_gaps: bool = False, progress=None) -> list[Output]:
        """Decode each prompt (token ids) for up to max_new_tokens new tokens, stopping at a stop
        id. Plain decoding without a proposer; speculative decoding with one (tree: chain K=3 by
        default). `record_gaps` keeps the NEAR runners-up of plain greedy decoding and their
        margins (tie analysis)."""
        if max_new_tokens < 1:
            raise DecodeError("max_new_tokens must be >= 1")
        if any(len(p) == 0 for p in prompts):
            raise DecodeError("empty prompt: every prompt needs at least one token")
        if proposer is not None and tree is None:
            tree = TreeSpec.chain(3)
        self.last = {"seconds": 0.0, "capture_seconds": 0.0, "prefill_seconds": 0.0,
                     "iterations": 0}
        cap0 = self.graphs.capture_seconds
        outs: list[Output] = []
        for b0 in range(0, len(prompts), self.max_batch):
            batch = [list(map(int, p)) for p in prompts[b0:b0 + self.max_batch]]
            t0 = time.perf_counter()
            outs += self._batch(batch, max_new_tokens, list(stop_ids), temperature, top_p,
                                proposer, tree, record_gaps)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.last["seconds"] += time.perf_counter() - t0
            if progress is not None:
                progress.update(len(batch))
        self.last["capture_seconds"] = self.graphs.capture_seconds - cap0
        self.last["seconds"] -= self.last["capture_seconds"]
        return outs

    @torch.no_grad()
    def generate_continuous(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                            stop_ids: Sequence[int] = (), temperature: float = 0.0,
                            top_p: float = 1.0, refill_fraction: float = 0.125,
                            progress=None) -> list[Output]:
        """Plain decoding with continuous batching: a row whose answer has ended takes the next
        prompt (an eager prefill of the refilled rows alone) while the others keep decoding, so
        a long answer no longer holds its whole batch. Rows are refilled once `refill_fraction`
        of them have finished (or all have). Greedy results equal `generate`'s. Returns the
        outputs in prompt order; `last` as for `generate`."""
        if max_new_tokens < 1:
            raise DecodeError("max_new_tokens must be >= 1")
        if any(len(p) == 0 for p in prompts):
            raise DecodeError("empty prompt: every prompt needs at least one token")
        self.last = {"seconds": 0.0, "capture_seconds": 0.0, "prefill_seconds": 0.0,
                     "iterations": 0}
        if not prompts:
            return []
        cap0, t_start = self.graphs.capture_seconds, time.perf_counter()
        queue = [(i, list(map(int, p))) for i, p in enumerate(prompts)]
        queue.sort(key=lambda x: -len(x[1]))          # the longest first: they set the capacity
        B = min(self.max_batch, len(queue))
        self._ensure(B, len(queue[0][1]) + max_new_tokens + 3, None)
        self.target.set_aux(None)
        T, stop_ids = temperature, list(stop_ids)
        st = self._state(B, _round_up(max_new_tokens + 2, 64), 0, 0, max(1, len(stop_ids)))
        for t in st.tensors():
            t.zero_()
        st.max_new.fill_(max_new_tokens)
        st.stop.fill_(-1)
        if stop_ids:
            st.stop.copy_(torch.tensor(stop_ids, device=self.device))
        first, queue = queue[:B], queue[B:]
        owner = [i for i, _ in first]                 # prompt index decoded by each row
        t0 = time.perf_counter()
        self._prefill(st, [p for _, p in first], len(first[0][1]), T, top_p, None, False)
        self.last["prefill_seconds"] += time.perf_counter() - t0
        key = ("plain-continuous", id(st), T, top_p)
        fn = lambda span: self._plain_step(st, span, T, top_p, False)  # noqa: E731
        res: list = [None] * len(prompts)
        need = max(1, int(B * refill_fraction))
        while True:
            *fin, lmax = torch.cat([st.finished.long(), st.L.max()[None]]).tolist()  # one sync
            done = [b for b in range(B) if fin[b] and owner[b] is not None]
            if done and (len(done) >= need or len(done) == sum(o is not None for o in owner)):
                outs = self._collect(st, done, max_new_tokens, stop_ids)
                for b, o in zip(done, outs):
                    res[owner[b]] = o
                    owner[b] = None
                if progress is not None:
                    progress.update(len(done))
                if queue:
                    take, queue = queue[:len(done)], queue[len(done):]
                    rows = done[:len(take)]
                    t0 = time.perf_counter()
                    self._refill(st, rows, [p for _, p in take], T, top_p)
                    self.last["prefill_seconds"] += time.perf_counter() - t0
                    for b, (i, _) in zip(rows, take):
                        owner[b] = i
                    lmax = max(lmax, max(len(p) for _, p in take))
            if all(o is None for o in owner):
                break
            span = min(self.cap[1], _round_up(lmax + 1, self.span_bucket))
            self.graphs.run(key + (span,), lambda: fn(span), st.tensors())
            self.last["iterations"] += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.last["capture_seconds"] = self.graphs.capture_seconds - cap0
        self.last["seconds"] = (time.perf_counter() - t_start - self.last["capture_seconds"])
        return res

    def _refill(self, st, rows, prompts, T, top_p):
        """Prefill `prompts` into cache rows `rows` (the others are not touched) and reset
        those rows' state: left-padded chunks as in `_prefill`, through the refilled rows only."""
        dev, tgt = self.device, self.target
        R, Tq = len(rows), max(len(p) for p in prompts)
        r = torch.tensor(rows, device=dev)
        ids, start = self._padded(prompts, Tq)                                       # [R, Tq]
        tgt.cache.rows = r
        try:
            for c0, c1, pos, slots, vis in self._chunks(ids, start):
                logits, _ = tgt.forward(ids[:, c0:c1], pos, slots, vis, start, logits_to_keep=1)
        finally:
            tgt.cache.rows = None
        first = pick(logits[:, -1].float(), T, top_p)                                # [R]
        z = torch.zeros(R, dtype=torch.long, device=dev)
        for t, v in ((st.start, start), (st.L, z + Tq), (st.pending, first), (st.n_out, z + 1),
                     (st.steps, z)):
            t.index_copy_(0, r, v)
        st.out[r] = 0
        st.out[r, 0] = first
        st.finished.index_copy_(0, r, (first[:, None] == st.stop).any(-1) | (st.max_new <= 1))

    # -- one batch
    def _batch(self, prompts, max_new, stop_ids, T, top_p, proposer, tree, record_gaps):
        B, Tp = len(prompts), max(len(p) for p in prompts)
        dev = self.device
        spec = proposer is not None
        D, k = (tree.depth, tree.topk) if spec else (0, 1)
        N = tree.nodes if spec else 0
        extra = max(N + 1, (D - 1) * k, D + 1) if spec else 1
        self._ensure(B, Tp + max_new + extra + D + 2, proposer)
        self.target.set_aux(proposer.aux_layer_ids if spec else None)
        Vd = proposer.vocab_size if spec else 0
        st = self._state(B, _round_up(max_new + D + 2, 64), D, Vd, max(1, len(stop_ids)))
        for t in st.tensors():
            t.zero_()
        st.max_new.fill_(max_new)
        st.stop.fill_(-1)
        if stop_ids:
            st.stop.copy_(torch.tensor(stop_ids, device=dev))
        t0 = time.perf_counter()
        self._prefill(st, prompts, Tp, T, top_p, proposer, record_gaps)
        self.last["prefill_seconds"] += time.perf_counter() - t0

        key = ("spec" if spec else "plain", id(st), T, top_p, tree, id(proposer),
               self.target.aux_ids, record_gaps)
        state = st.tensors() + (list(getattr(proposer, "state_tensors", list)()) if spec else [])
        if spec:
            fn = lambda span: self._spec_step(st, span, proposer, tree, T)  # noqa: E731
        else:
            fn = lambda span: self._plain_step(st, span, T, top_p, record_gaps)  # noqa: E731
        done, lmax = torch.stack([st.finished.all().long(), st.L.max()]).tolist()
        for _ in range(max_new):
            if done:
                break
            span = min(self.cap[1], _round_up(lmax + extra, self.span_bucket))
            self.graphs.run(key + (span,), lambda: fn(span), state)
            self.last["iterations"] += 1
            done, lmax = torch.stack([st.finished.all().long(), st.L.max()]).tolist()
        return self._collect(st, range(B), max_new, stop_ids, spec, record_gaps)

    @torch.no_grad()
    def time_forwards(self, proposer: DraftModel, tree: TreeSpec, batch: int = 1,
                      context: int = 256, repeats: int | None = None) -> dict:
        """Milliseconds of one target forward over 1 token (a plain step), over N+1 tokens (a
        verification), and of one drafter forward over k frontier tokens (one drafting depth),
        at `batch` rows with `context` tokens in the cache; graph-captured where decoding is."""
        D, k, N = tree.depth, tree.topk, tree.nodes
        extra = max(N + 1, (D - 1) * k, D + 1)
        self._ensure(batch, context + extra + 2, proposer)
        self.target.set_aux(proposer.aux_layer_ids)
        dev, B = self.device, batch
        span = min(self.cap[1], _round_up(context + extra, self.span_bucket))
        s = torch.arange(span, device=dev)
        start = torch.zeros(B, dtype=torch.long, device=dev)

        def inputs(T):
            slots = (context + torch.arange(T, device=dev)).expand(B, T)
            return torch.zeros(B, T, dtype=torch.long, device=dev), slots, \
                s[None, None] <= slots[..., None]

        def target_fn(T):
            ids, slots, vis = inputs(T)
            return lambda: self.target.forward(ids, slots, slots, vis, start)

        ids_d, slots_d, vis_d = inputs(k)
        fns = {"target_ms": target_fn(1), "verify_ms": target_fn(N + 1),
               "draft_ms": lambda: proposer.score(1, ids_d, torch.zeros_like(ids_d), slots_d,
                                                  slots_d, vis_d)}
        return {name: _time_ms(fn, self.graphs.enabled, repeats) for name, fn in fns.items()}

    def _collect(self, st, rows, max_new, stop_ids, spec=False, record_gaps=False
                 ) -> list[Output]:
        """The outputs of state rows `rows` (a range for a whole batch): the tokens up to the
        first stop token (kept), at most max_new."""
        idx = torch.as_tensor(list(rows), device=self.device)
        n_out, out, steps = (t[idx].tolist() for t in (st.n_out, st.out, st.steps))
        hist = st.hist[idx].tolist() if spec else None
        gaps, second = (st.gap[idx].tolist(), st.second[idx].tolist()) if record_gaps else \
            (None, None)
        stops = set(stop_ids)
        res = []
        for j in range(len(idx)):
            toks = out[j][: min(n_out[j], max_new)]
            cut = next((i for i, t in enumerate(toks) if t in stops), None)
            toks = toks if cut is None else toks[: cut + 1]
            n = len(toks)
            res.append(Output(toks, "stop" if cut is not None else "length", steps[j],
                              hist[j] if spec else None, gaps[j][:n] if record_gaps else None,
                              second[j][:n] if record_gaps else None))
        return res

    def _padded(self, prompts, Tp) -> tuple[Tensor, Tensor]:
        """Prompts left-padded to Tp: ids [B, Tp] and each row's first slot, start [B]."""
        ids = torch.tensor([[0] * (Tp - len(p)) + p for p in prompts]).to(self.device)
        return ids, torch.tensor([Tp - len(p) for p in prompts]).to(self.device)

    def _chunks(self, ids, start):
        """The prefill of left-padded ids [B, Tp] in chunks of about prefill_tokens / B tokens:
        yields (c0, c1, pos, slots [B, C], vis [B, C, c1]); pad queries see their own slot."""
        B, Tp = ids.shape
        s = torch.arange(Tp, device=ids.device)
        chunk = max(1, self.prefill_tokens // B)
        for c0 in range(0, Tp, chunk):
            c1 = min(Tp, c0 + chunk)
            slots = torch.arange(c0, c1, device=ids.device).expand(B, -1)            # [B, C]
            pos = (slots - start[:, None]).clamp(min=0)
            sk = s[None, None, :c1]
            vis = ((sk >= start[:, None, None]) & (sk <= slots[..., None])) \
                | (sk == slots[..., None])
            yield c0, c1, pos, slots, vis

    def _prefill(self, st, prompts, Tp, T, top_p, proposer, record_gaps):
        """Left-padded chunks through the target (eager: the shapes vary); the first new token;
        the drafter reads the prompt too (position t: aux[t] and token t+1)."""
        B, dev, tgt = len(prompts), self.device, self.target
        ids, start = self._padded(prompts, Tp)                                       # [B, Tp]
        st.start.copy_(start)
        st.L.fill_(Tp)
        s = torch.arange(Tp, device=dev)
        last_aux = logits = None
        for c0, c1, pos, slots, vis in self._chunks(ids, start):
            logits, aux = tgt.forward(ids[:, c0:c1], pos, slots, vis, start, logits_to_keep=1)
            if proposer is not None:
                e = min(c1, Tp - 1) - c0  # the last prompt position waits for the first new token
                if e > 0:
                    proposer.observe(ids[:, c0 + 1:c0 + 1 + e], None if aux is None else aux[:, :e],
                                     pos[:, :e], slots[:, :e], vis[:, :e], None)
                last_aux = None if aux is None else aux[:, -1:]
        lg = logits[:, -1].float()                                                  # [B, V]
        first = pick(lg, T, top_p)
        if record_gaps:
            top = lg.topk(NEAR + 1, dim=-1)
            st.gap[:, 0] = top.values[:, :1] - top.values[:, 1:]
            st.second[:, 0] = top.indices[:, 1:]
        st.pending.copy_(first)
        st.out[:, 0] = first
        st.n_out.fill_(1)
        st.finished.copy_((first[:, None] == st.stop).any(-1) | (st.max_new <= 1))
        if proposer is not None:
            slots = torch.full((B, 1), Tp - 1, device=dev)
            vis = ((s >= start[:, None]) | (s == Tp - 1))[:, None, :]                # [B, 1, Tp]
            root = proposer.observe(first[:, None], last_aux, slots - start[:, None], slots, vis,
                                    torch.zeros(B, dtype=torch.long, device=dev))
            st.root.copy_(root.float())

    def _commit(self, st, emitted, n_acc, bonus, root=None):
        """Shared tail of both steps: emitted [B, J] tokens of which n_acc + 1 are new."""
        B, J = emitted.shape
        active = ~st.finished
        j = torch.arange(J, device=emitted.device)
        new = j[None] <= n_acc[:, None]
        stop = (emitted[..., None] == st.stop).any(-1) & new                       # [B, J]
        has_stop = stop.any(1)
        n_emit = torch.where(has_stop, stop.int().argmax(1), n_acc) + 1
        col = st.n_out[:, None] + j
        col = torch.where((j[None] < n_emit[:, None]) & active[:, None], col, st.W - 1)
        st.out.scatter_(1, col, emitted)
        st.hist.scatter_add_(1, n_acc.clamp(max=st.hist.shape[1] - 1)[:, None],
                             active.long()[:, None])
        st.steps.add_(active.long())
        st.n_out.add_(n_emit * active)
        st.L.add_((n_acc + 1) * active)
        st.pending.copy_(torch.where(active, bonus, st.pending))
        if root is not None:
            st.root.copy_(torch.where(active[:, None], root.float(), st.root))
        st.finished.copy_(st.finished | (active & (has_stop | (st.n_out >= st.max_new))))

    def _plain_step(self, st, span, T, top_p, record_gaps):
        dev = self.device
        s = torch.arange(span, device=dev)
        L, start = st.L, st.start
        vis = ((s[None] >= start[:, None]) & (s[None] <= L[:, None]))[:, None]      # [B, 1, S]
        logits, _ = self.target.forward(st.pending[:, None], (L - start)[:, None], L[:, None],
                                        vis, start)
        lg = logits[:, -1].float()
        nxt = pick(lg, T, top_p)
        if record_gaps:
            top = lg.topk(NEAR + 1, dim=-1)
            col = torch.where(st.finished, st.W - 1, st.n_out)[:, None, None].expand(-1, 1, NEAR)
            st.gap.scatter_(1, col, (top.values[:, :1] - top.values[:, 1:])[:, None])
            st.second.scatter_(1, col, top.indices[:, None, 1:])
        self._commit(st, nxt[:, None], torch.zeros_like(nxt), nxt)

    def _spec_step(self, st, span, P, tree: TreeSpec, T):
        dev, tgt = self.device, self.target
        B, D, k, N = st.B, tree.depth, tree.topk, tree.nodes
        L, start = st.L, st.start
        s = torch.arange(span, device=dev)
        committed = (s[None] >= start[:, None]) & (s[None] < L[:, None])            # [B, S]
        fvis = None

        def scorer(i, ids, parent):  # frontier at depth i: slots L + (i-1)k + r, position L+i-1
            nonlocal fvis
            slots = L[:, None] + (i - 1) * k + torch.arange(k, device=dev)          # [B, k]
            own = s[None, None] == slots[..., None]                                 # [B, k, S]
            fvis = own if i == 1 else own | fvis.gather(1, parent[..., None].expand(B, k, span))
            pos = (L - start)[:, None] + (i - 1)
            return P.score(i, P.to_target(ids), parent, pos.expand(B, k), slots,
                           committed[:, None] | fvis)

        draft = build_tree(st.root, scorer, tree, T)
        toks = P.to_target(draft.tokens)                                            # [B, N]
        parent_full = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), draft.parent], 1)
        depth_full = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), draft.depth], 1)
        anc = ancestors(parent_full, D)                                             # [B, N+1, N+1]
        ids = torch.cat([st.pending[:, None], toks], 1)                             # [B, N+1]
        slots = L[:, None] + torch.arange(N + 1, device=dev)
        rel = s[None] - L[:, None]                                                  # [B, S]
        tree_vis = anc.gather(2, rel.clamp(0, N)[:, None].expand(B, N + 1, span)) \
            & ((rel >= 0) & (rel <= N))[:, None]
        logits, aux = tgt.forward(ids, (L - start)[:, None] + depth_full, slots,
                                  committed[:, None] | tree_vis, start)
        if T > 0:
            Vd, V = draft.logq.shape[-1], logits.shape[-1]
            t_ids = P.to_target(torch.arange(Vd, device=dev))
            q = torch.zeros(B, draft.logq.shape[1], V, device=dev) \
                .scatter_(2, t_ids.expand(B, draft.logq.shape[1], Vd), draft.logq.exp())
            path, n_acc, bonus = verify_sample(toks, parent_full, draft.valid, depth_full, anc,
                                               logits, q, draft.dist, T, D, k)
        else:
            path, n_acc, bonus = verify_greedy(toks, parent_full, draft.valid, depth_full, anc,
                                               logits, D)
        j = torch.arange(D + 1, device=dev)
        if not tree.is_chain:  # a chain's accepted tokens already sit in slots L..L+n_acc
            tgt.cache.copy_slots(L[:, None] + path, L[:, None] + j)
        emitted = torch.cat([ids.gather(1, path)[:, 1:], bonus[:, None]], 1)        # [B, D+1]
        emitted = emitted.scatter(1, n_acc[:, None], bonus[:, None])
        # the drafter reads the committed tokens with the target's own aux states
        slots_o = L[:, None] + j
        vis_o = committed[:, None] | ((s[None, None] >= L[:, None, None])
                                      & (s[None, None] <= slots_o[..., None]))
        a = aux.gather(1, path[:, :, None, None].expand(B, D + 1, *aux.shape[2:])) \
            if aux is not None else None
        root = P.observe(emitted, a, slots_o - start[:, None], slots_o, vis_o, n_acc)
        self._commit(st, emitted, n_acc, bonus, root)


def _time_ms(fn, graphs: bool, repeats: int | None) -> float:
    """Mean milliseconds of fn(): replayed from a CUDA graph when `graphs`."""
    if torch.cuda.is_available() and graphs:
        repeats = repeats or 50
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run = g.replay
        except Exception:  # noqa: BLE001  (timed eagerly instead)
            torch.cuda.synchronize()
            run = fn
        run()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(repeats):
            run()
        t1.record()
        torch.cuda.synchronize()
        return t0.elapsed_time(t1) / repeats
    repeats = repeats or (50 if torch.cuda.is_available() else 1)
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1000 / repeats


def acceptance_stats(hist: Sequence[int]) -> dict:
    """From hist[a] = speculative steps that accepted a draft tokens (a = 0..D): tau (tokens per
    target forward, bonus counted), accepted, per-position acceptance unconditional (P[a >= i])
    and conditional (P[a >= i | a >= i-1]), i = 1..D."""
    steps = int(sum(hist))
    D = len(hist) - 1
    reached = [int(sum(hist[i:])) for i in range(D + 1)]                           # a >= i
    accepted = int(sum(a * n for a, n in enumerate(hist)))
    return {
        "steps": steps,
        "accepted": accepted,
        "tau": (accepted + steps) / steps if steps else None,
        "acceptance": [reached[i] / steps if steps else None for i in range(1, D + 1)],
        "acceptance_conditional": [reached[i] / reached[i - 1] if reached[i - 1] else None
                                   for i in range(1, D + 1)],
    }


# ----------------------------------------------------------------------- generate, engine=local
def stop_ids_of(tokenizer, model=None) -> list[int]:
    """End-of-text ids: the tokenizer's eos plus the generation config's eos ids."""
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    for e in ([eos] if isinstance(eos, int) else list(eos or [])):
        ids.add(int(e))
    return sorted(ids)


class LocalGenerator:
    """In-process batched generation for `generate.server.engine: local`: static cache, CUDA
    graphs, `batch_size` rows decoded together with continuous refill (a finished row takes the
    next prompt, longest first: `Decoder.generate_continuous`). With `target.device: auto`
    and several visible GPUs, one replica per GPU decodes every n-th batch (data parallel, one
    thread each: a graph replay per step leaves the GIL free).

        gen = LocalGenerator(cfg.target, batch_size=cfg.generate.batch_size)
        for token_ids, finish_reason in gen.generate(prompts, 512, 0.0, 1.0, seed=0): ...

    token_ids exclude the stop token (as OpenAI-compatible servers return text); finish_reason is
    "stop" or "length"."""

    def __init__(self, target_cfg, batch_size: int = 64, cuda_graphs: bool = True):
        from .target import load_model, load_tokenizer

        n = torch.cuda.device_count() if target_cfg.device == "auto" else 1
        devices = [f"cuda:{i}" for i in range(n)] if n > 1 else [None]
        self.models = [load_model(target_cfg, device=d) for d in devices]
        self.model = self.models[0]
        self.tokenizer = load_tokenizer(target_cfg)
        self.stop_ids = stop_ids_of(self.tokenizer, self.model)
        self.batch_size = batch_size
        self.decoders = [Decoder(m, max_batch=batch_size, cuda_graphs=cuda_graphs)
                         for m in self.models]
        self.decoder = self.decoders[0]
        self.replicas = len(self.decoders)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0) -> list[tuple[list[int], str]]:
        from concurrent.futures import ThreadPoolExecutor

        from tqdm import tqdm

        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        bs, n = self.batch_size, len(self.decoders)
        batches = [order[b:b + bs] for b in range(0, len(order), bs)]
        parts = [[i for bt in batches[r::n] for i in bt] for r in range(n)]   # replica r's rows
        bar = tqdm(total=len(prompts), desc="generate (local)", unit="prompt",
                   disable=len(prompts) <= bs)

        def work(r):
            if not parts[r]:
                return []
            dev = self.decoders[r].device
            with torch.cuda.device(dev) if dev.type == "cuda" else _nullcontext():
                torch.manual_seed(seed + r)
                return self.decoders[r].generate_continuous(
                    [prompts[i] for i in parts[r]], max_new_tokens, stop_ids=self.stop_ids,
                    temperature=temperature, top_p=top_p, progress=bar)
        try:
            if n == 1:
                outs_by = [work(0)]
            else:
                with ThreadPoolExecutor(n) as ex:
                    outs_by = list(ex.map(work, range(n)))
        except torch.cuda.OutOfMemoryError as e:
            raise DecodeError(f"generate (local): out of GPU memory at batch {self.batch_size}: "
                              f"lower generate.batch_size ({e})") from None
        finally:
            bar.close()
        order = [i for p in parts for i in p]
        outs = [o for ob in outs_by for o in ob]
        res: list = [None] * len(prompts)
        for i, o in zip(order, outs):
            toks = o.tokens[:-1] if o.finish == "stop" else o.tokens
            res[i] = (toks, o.finish)
        return res
