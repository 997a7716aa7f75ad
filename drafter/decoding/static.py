"""The static-cache target: an HF causal LM decoding over one static KV buffer per layer, written
at per-row slots, the CUDA graphs that replay its steps, and host arrays uploaded without waiting
for the GPU (`Uploads`, the data engine's).

    tgt = StaticTarget(model)                     # any HF causal LM (dense, MoE, MLA, sliding)
    tgt.allocate(max_batch=8, max_slots=1024)
    tgt.set_aux([2, 15, 27])                      # capture HS[k] of every token it processes
    logits, aux = tgt.forward(ids, pos, slots, vis, start)
    graphs = Graphs(enabled=True); graphs.run(key, step_fn, state_tensors)
    up = Uploads(device); x = up(numpy_array)     # a device tensor, the copy queued

Shapes: B rows, T new tokens of a forward, S attention span (static cache slots read), V target
vocab, A aux layers, Ht target hidden.

The cache. Every row owns slots [0, Smax) of one static buffer per layer ([Bmax, heads, Smax, dim],
`SlotCache`). Prompts are left-padded: row b's prompt sits in slots [start_b, Tp); slot s holds
position s - start_b. Each forward writes its T tokens at per-row slots [B, T] and attends over the
first S slots under a per-row boolean visibility mask, so rows advance independently (speculation
accepts a different count per row) while every shape stays fixed: the step can be captured in a
CUDA graph (one graph per (batch, span bucket)), which is what makes small-model decoding fast
(launch overhead dominates otherwise: ../shared/docs/REFERENCES.md).

Speculative decoding (drafter.decoding.decode) runs on it; plain batched generation at scale has its
own paged cache (drafter.generation.generator).
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from drafter.decoding.tree import DecodeError, _additive

log = logging.getLogger("drafter")


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ------------------------------------------------------------------------------- the static cache
def _slot_cache_class():
    from transformers.cache_utils import Cache

    class SlotCache(Cache):
        """Static per-layer buffers [Bmax, heads, Smax, dim] written at per-row slots.

        Before each forward the caller sets `slots` [B, T] (where each new token goes) and `span`
        (how many leading slots attention reads). Buffers are allocated on the first write, from
        the shapes the model hands in, so MLA latents (DeepSeek) and any head layout work. A
        layer whose keys (values) have the `pooled` (heads, dim) gets slice i of one pool
        [layers, Bmax, heads, Smax, dim] for the keys (values) of all such layers, so that
        copy_slots moves every layer's entries in one gather and one scatter (a tree step
        called it per layer: 4 kernels a layer, 120 at SmolLM2's 30); others get their own."""

        def __init__(self, max_batch: int, max_slots: int, num_layers: int = 0,
                     pooled: tuple[int, int] | None = None):
            super().__init__(layers=[])
            self.max_batch, self.max_slots = max_batch, max_slots
            self.num_layers, self.pooled = num_layers, pooled
            self.k: dict[int, Tensor] = {}
            self.v: dict[int, Tensor] = {}
            self.pools: dict[int, Tensor] = {}  # id of the store -> [layers, Bmax, heads, S, dim]
            self.slots: Tensor | None = None
            self.rows: Tensor | None = None  # set: the batch is these cache rows (a refill; eager)
            self.span = max_slots
            self.fold = False  # set: the forward's T rows of one token are row 0's T new tokens

        def _buf(self, store: dict, i: int, x: Tensor) -> Tensor:
            if i not in store:
                heads, dim = x.shape[1], x.shape[3]
                shape = (self.max_batch, heads, self.max_slots, dim)
                if (heads, dim) == self.pooled and 0 <= i < self.num_layers:
                    if id(store) not in self.pools:
                        self.pools[id(store)] = torch.zeros(self.num_layers, *shape,
                                                            dtype=x.dtype, device=x.device)
                    store[i] = self.pools[id(store)][i]
                else:
                    store[i] = torch.zeros(shape, dtype=x.dtype, device=x.device)  # no NaN
            return store[i]

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            B, T = self.slots.shape
            out = []
            for store, x in ((self.k, key_states), (self.v, value_states)):
                buf = self._buf(store, layer_idx, x)
                if self.fold:  # B rows of one token, all cache row 0's: x [B, heads, 1, dim]
                    xt = x[:, :, 0].transpose(0, 1)                           # [heads, B, dim]
                    buf[0].scatter_(1, self.slots.view(1, B, 1).expand(x.shape[1], B, x.shape[3]),
                                    xt.to(buf.dtype))
                    out.append(buf[:1, :, : self.span].expand(B, -1, -1, -1))  # a view
                    continue
                if self.rows is not None:  # continuous batching's refill: the other rows stay
                    buf[self.rows[:, None], :, self.slots] = x.transpose(1, 2).to(buf.dtype)
                    out.append(buf[:, :, : self.span].index_select(0, self.rows))
                    continue
                idx = self.slots[:, None, :, None].expand(B, x.shape[1], T, x.shape[3])
                buf[:B].scatter_(2, idx, x.to(buf.dtype))
                out.append(buf[:B, :, : self.span])                   # [B, heads, S, dim]
            return out[0], out[1]

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0  # positions are always given explicitly

        def copy_slots(self, src: Tensor, dst: Tensor) -> None:
            """Move each row's entries at slots src [B, n] to slots dst [B, n] (all layers)."""
            B, n = src.shape
            for store in (self.k, self.v):
                pool = self.pools.get(id(store))
                bufs = [b for b in store.values() if pool is None or b._base is not pool]
                if pool is not None:  # all pooled layers at once: [layers, B, heads, n, dim]
                    shape = (pool.shape[0], B, pool.shape[2], n, pool.shape[4])
                    vals = pool[:, :B].gather(3, src[None, :, None, :, None].expand(shape))
                    pool[:, :B].scatter_(3, dst[None, :, None, :, None].expand(shape), vals)
                for buf in bufs:
                    shape = (B, buf.shape[1], n, buf.shape[3])
                    vals = buf[:B].gather(2, src[:, None, :, None].expand(shape))
                    buf[:B].scatter_(2, dst[:, None, :, None].expand(shape), vals)

        def nbytes(self) -> int:
            own = [b for s in (self.k, self.v) for b in s.values() if b._base is None]
            return sum(b.numel() * b.element_size() for b in own + list(self.pools.values()))

    return SlotCache


_GQA_IMPL = "drafter_gqa_sdpa"
FOLD_MAX = 64  # StaticTarget(fold=True): verifications up to this many tokens are folded
# _gqa_sdpa's masks of the forward in progress (rows repeated for the grouped query heads), made
# by its first layer and reused by the others (one per mask: sliding-window models have two); a
# dict only inside StaticTarget.forward. Not the batch-1 fold (StaticTarget.fold).
_gqa_masks = threading.local()


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
    # the mask's rows repeated for the g query heads: a copy when T > 1, made once a forward
    masks = getattr(_gqa_masks, "masks", None)
    hit = masks.get(id(attention_mask)) if masks is not None else None
    if hit is not None and hit[0] is attention_mask:
        m = hit[1]
    else:
        m = attention_mask[:, :, :, :S]
        m = m[:, :, None].expand(B, 1, g, T, S).reshape(B, 1, g * T, S)
        if masks is not None:
            masks[id(attention_mask)] = (attention_mask, m)
    o = F.scaled_dot_product_attention(q, key, value, attn_mask=m, scale=scaling)
    return o.reshape(B, nh, T, hd).transpose(1, 2).contiguous(), None   # [B, T, nh, hd]


def eager_attention():
    """A context for eager forwards of varying shapes (prefills: one shape per prompt length):
    SDPA without its cuDNN backend. cuDNN attention builds an execution plan for every new shape,
    which costs several eager prefills, and evaluate charged it to whichever method prefilled a
    prompt length first. The captured steps keep
    every backend: their shapes are fixed, their plans built once at capture."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH])


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

    def __init__(self, model, fold: bool | None = None):
        from drafter.core.target import text_config
        from drafter.features.capture import decoder_layers, text_decoder

        self.model = model
        tc = text_config(model.config)
        # flash kernels ignore a custom 4D mask (the tree needs one); transformers' SDPA copies
        # grouped K/V heads under a mask: `_gqa_sdpa` does neither. Eager stays (softcapping).
        if str(getattr(model.config, "_attn_implementation", None) or "") != "eager":
            _use_gqa_sdpa(model)
        self._impl = model.config._attn_implementation
        types = set(getattr(tc, "layer_types", None) or ["full_attention"])
        if types - {"full_attention", "sliding_attention"}:
            raise DecodeError(f"{type(model).__name__}: layer types {sorted(types)} are not "
                              f"supported by the static-cache decoder (full and sliding attention "
                              f"only)")
        self.window = getattr(tc, "sliding_window", None) if "sliding_attention" in types else None
        self.layers = decoder_layers(model)
        self.final_norm = getattr(text_decoder(model), "norm", None)  # wrappers: their LM's
        self.num_layers = len(self.layers)
        # (heads, dim) of a standard layer's keys and values: their cache layers share a pool
        self.kv_shape = (getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
                         getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads)
        emb = model.get_input_embeddings().weight
        self.device, self.dtype = emb.device, emb.dtype
        # fold: a batch-1 forward over T > 1 tokens runs as T rows of one token (forward());
        # None: on a GPU only (on the CPU a long verification is slower folded)
        self.fold = self.device.type == "cuda" if fold is None else fold
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers >= 5.2x
        self._keep_kw = "logits_to_keep" in params
        self.cache = None
        self.aux_ids: tuple[int, ...] = ()
        self._aux: list[Tensor | None] = []
        self._hooks: list = []

    def claim(self) -> None:
        """Put back this decoder's attention if another (drafter.generation.generator's)
        switched the shared model to its own since."""
        if self.model.config._attn_implementation != self._impl:
            self.model.set_attn_implementation(self._impl)

    def allocate(self, max_batch: int, max_slots: int) -> None:
        self.cache = _slot_cache_class()(max_batch, max_slots, self.num_layers, self.kv_shape)

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
        Returns logits [B, T or logits_to_keep, V] and aux [B, T, A, Ht] (None without ids).

        With `fold`, a batch-1 forward over 1 < T <= FOLD_MAX tokens (a verification) runs as T
        rows of one token each, reading one cache row. transformers' attention transposes q, k
        and v to [B, heads, T, dim], contiguous only when T = 1: over T > 1 tokens its rotary
        embedding and the cache writes run strided, slower than a 1-token forward at the same
        kernel count. As T rows of one token they take the 1-token path; every row sees row 0's
        cache (written first, one scatter a layer) under its own row of vis. On by default on a
        GPU, where it shortens a batch-1 verification and chain step (a large tree's step is
        unchanged)."""
        B, T = ids.shape
        if self.fold and B == 1 and 1 < T <= FOLD_MAX and not self.window \
                and self.cache.rows is None:
            self.cache.fold = True
            try:
                logits, aux = self.forward(ids.view(T, 1), pos.view(T, 1), slots.view(T, 1),
                                           vis.view(T, 1, vis.shape[-1]), start.expand(T),
                                           logits_to_keep)
            finally:
                self.cache.fold = False
            keep = logits_to_keep or T
            logits = logits.view(1, T, -1)[:, T - keep:]
            return logits, None if aux is None else aux.view(1, T, *aux.shape[2:])
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
        _gqa_masks.masks = {}
        try:
            out = self.model(input_ids=ids, position_ids=pos, attention_mask=attn, use_cache=True,
                             **kw)
        finally:
            _gqa_masks.masks = None
        logits = out.logits
        if not self._keep_kw and logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        aux = torch.stack(self._aux, dim=2) if self.aux_ids else None      # [B, T, A, Ht]
        return logits, aux



# ------------------------------------------------------------------------------- CUDA graphs
def _grouped_mm_on_device(w: Tensor) -> bool:
    """Whether transformers' "grouped_mm" experts run over expert weights `w` without a host
    sync. torch's grouped GEMM (aten `_grouped_mm_cuda`) reads the per-expert offsets on the
    device only on its fast path, bf16 on SM90 or SM100; any other dtype or GPU takes its
    fallback, which copies the offsets to the host (`offs.cpu()`) to loop over the experts, and
    without torch's kernel transformers' own fallback does the same (`offs.tolist()`)."""
    return (w.is_cuda and torch.version.hip is None and hasattr(torch, "_grouped_mm")
            and w.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(w.device)[0] in (9, 10))


def syncing_experts(model) -> list:
    """The configs of `model`'s MoE experts whose kernels sync with the host, which a CUDA graph
    cannot capture. transformers' experts modules (decorated by `use_experts_implementation`,
    which gives them `is_transposed` and `_apply_gate`) dispatch on their own config's
    `_experts_implementation`: "eager" loops over the experts hit (a nonzero, then one matmul
    each), "grouped_mm" syncs where `_grouped_mm_on_device` says so. Empty for a dense model,
    for other implementations (deepgemm, batched_mm) and for quantized experts."""
    out = {}
    for m in model.modules():
        c = getattr(m, "config", None)
        if not (hasattr(m, "is_transposed") and hasattr(type(m), "_apply_gate")
                and hasattr(c, "_experts_implementation")):
            continue
        w = getattr(m, "gate_up_proj", None)
        w = getattr(m, "up_proj", None) if w is None else w
        if not isinstance(w, Tensor) or w.dtype not in (torch.float32, torch.float16,
                                                        torch.bfloat16):
            continue
        impl = c._experts_implementation
        if impl == "eager" or (impl == "grouped_mm" and not _grouped_mm_on_device(w)):
            out[id(c)] = c
    return list(out.values())


def _set_experts(config, impl: str) -> None:
    # the attribute set_experts_implementation writes (transformers 5.0 to 5.19): the public
    # setter would also overwrite the config's sub-configs, which a restore could not undo
    if hasattr(config, "_experts_implementation_internal"):
        config._experts_implementation_internal = impl
    else:
        config._experts_implementation = impl


@contextlib.contextmanager
def capturable_experts(model):
    """Inside: the experts of `syncing_experts(model)` run transformers' "batched_mm" (each
    token's expert weights gathered, then batched matmuls: no host sync, so a graph captures
    them); their implementation is restored on the way out. For a step's warm-up and capture
    only (`Graphs(context=...)`), whose replays then run the kernels recorded: the gathered
    weights take memory in proportion to tokens x top-k x one expert's weights, which the few
    tokens of a decode step afford and a prefill does not, so eager forwards keep theirs."""
    saved = [(c, c._experts_implementation) for c in syncing_experts(model)]
    try:
        for c, _ in saved:
            _set_experts(c, "batched_mm")
        yield
    finally:
        for c, impl in saved:
            _set_experts(c, impl)


class Graphs:
    """One captured CUDA graph per key; eager on CPU or when capture fails (logged once).
    A step mutates persistent state in place; warm-up runs it once and restores that state.
    `context`: a callable giving a context manager entered around each warm-up and capture
    (the static decoder's: `capturable_experts`)."""

    def __init__(self, enabled: bool, what: str = "decoding", context=None):
        self.enabled = enabled and torch.cuda.is_available()
        self.what = what            # named in the warning when capture fails
        self.context = context or contextlib.nullcontext
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
            with self.context():
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()  # warm-up: lazy inits (cuBLAS handles, ...) must not happen in capture
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
            log.warning("CUDA graph capture failed (%s: %s); %s without graphs",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "", self.what)
            self.enabled = False
            try:
                torch.cuda.synchronize()
            finally:
                restore()
            return None


class Uploads:
    """Host arrays to the device without waiting for the GPU. A plain `.to(device)` of host memory
    waits for every queued kernel first, so the GPU would idle while the host prepares each
    prefill chunk; here each array is staged in one of a ring of pinned buffers and copied with
    non_blocking, and a buffer is written again only once its copy has run (its event). Off
    CUDA: a plain copy."""

    def __init__(self, device, slots: int = 4):
        self.device, self.cuda = device, device.type == "cuda"
        self.bufs: list[Tensor | None] = [None] * slots
        self.events: list = [None] * slots
        self.i = 0

    def __call__(self, a: np.ndarray) -> Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        if not self.cuda:
            return t.to(self.device)
        self.i = i = (self.i + 1) % len(self.bufs)
        if self.events[i] is not None:
            self.events[i].synchronize()
        n = t.numel() * t.element_size()
        if self.bufs[i] is None or self.bufs[i].numel() < n:
            self.bufs[i] = torch.empty(max(n, 1 << 20), dtype=torch.uint8, pin_memory=True)
        stage = self.bufs[i][:n].view(t.dtype).view(t.shape)
        stage.copy_(t)
        out = stage.to(self.device, non_blocking=True)
        self.events[i] = torch.cuda.Event()
        self.events[i].record()
        return out
