"""The paged KV cache and its attention: what lets the data engine (drafter.generation.generator)
hold each row's keys and values at its own length, and read only those.

    cache = PagedCache()                                   # a transformers Cache
    cache.allocate(pages=4096, page_size=64, shapes={0: (3, 64, 64), ...}, dtype, device)
    use_paged_attention(model)                             # attention through `paged_attention`
    with paged_context(cache):                             # this thread's forwards use the cache
        cache.prefill(write)   / cache.decode(write, table, lens)
        model.get_decoder()(input_ids=..., position_ids=..., cache=cache)

Shapes: B rows, T tokens of a forward, P tokens per page, W pages a row may hold (table width),
nh query heads, nkv key/value heads, hdk / hdv key / value head dims (MLA: 192 / 128), g = nh/nkv.

Layout. Per layer one key pool [pages·P, nkv, hdk] and one value pool [pages·P, nkv, hdv]; token
position p of row b lives at flat slot table[b, p // P]·P + p % P. Page 0 is a sink that rows
without a request (and prefill padding) write to and nobody reads: every shape stays fixed, so
the decode step is one CUDA graph however many rows are live and however long they are.

Two modes, set per forward:
  prefill  prompts from position 0, keys/values written to their slots. Packed (`starts` given):
           the prompts one after another in a single row [1, N], each token attending causally
           within its own prompt only (`packed_attention`: a Triton kernel on CUDA, one SDPA per
           prompt elsewhere), so no token is padding. Without `starts`: right-padded prompts
           [B, T], plain causal SDPA over the fresh keys (padding sits after every real token of
           its row, so no real token sees it);
  decode   one token per row: written at its slot, then attention over the row's lens[b] tokens
           read through its page table: a Triton kernel on CUDA (`paged_attention_triton`; the
           kernels: drafter.generation.paged_kernels), one program per (row, kv head), online
           softmax over the row's pages only, the step's longest rows split into parts of their
           own and merged after (`long_rows`); a gather + SDPA anywhere else
           (`paged_attention_reference`, also the kernel's test oracle).

The cost of decode attention is then the row's own length, not the longest row's: the static cache
(drafter.decoding.static) reads every row's slots up to the batch's longest, and its buffer
[rows, slots] is sized by the longest prompt, so one long prompt can take a large batch out of
memory (BENCHMARKS.md, Data engine).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

_IMPL = "drafter_paged"
_local = threading.local()   # LocalGenerator runs one replica per GPU, each in its own thread


# ------------------------------------------------------------------------------ the cache
def _paged_cache_class():
    from transformers.cache_utils import Cache

    class PagedCache(Cache):
        """Per-layer key/value pools written at flat slots (module docstring). Before a forward
        the caller sets the mode with `prefill(write)` or `decode(write, table, lens)`; `write`
        [B·T] holds each token's slot (0: the sink). Pools are allocated by `allocate`, or, when
        `shapes` is None, by the first forward (a probe: it records each layer's head layout)."""

        def __init__(self):
            super().__init__(layers=[])
            self.k: dict[int, Tensor] = {}
            self.v: dict[int, Tensor] = {}
            self.shapes: dict[int, tuple[int, int, int]] = {}   # layer -> (nkv, hdk, hdv)
            # layers whose attention does not read what the cache returns (MLA caches latents
            # and expands them after): decode hands them each row's gathered pages instead
            self.gather: set[int] = set()
            self.returned: dict[int, int] = {}
            self.mode, self.write, self.table, self.lens = "prefill", None, None, None
            self.starts = self.split = None
            self.page_size, self.use_triton = 0, False

        def allocate(self, pages: int, page_size: int, dtype, device) -> None:
            """Pools of `pages` pages of `page_size` tokens for every layer seen by the probe."""
            self.k, self.v, self.page_size = {}, {}, page_size
            for i, (nkv, hdk, hdv) in self.shapes.items():
                self.k[i] = torch.zeros(pages * page_size, nkv, hdk, dtype=dtype, device=device)
                self.v[i] = torch.zeros(pages * page_size, nkv, hdv, dtype=dtype, device=device)

        def bytes_per_token(self, dtype) -> int:
            size = torch.empty((), dtype=dtype).element_size()
            return sum(nkv * (hdk + hdv) * size for nkv, hdk, hdv in self.shapes.values())

        def prefill(self, write: Tensor | None, starts: Tensor | None = None) -> None:
            """starts [N]: packed prompts, each token's prompt's first index in the row (None:
            right-padded rows)."""
            self.mode, self.write, self.starts = "prefill", write, starts

        def decode(self, write: Tensor, table: Tensor, lens: Tensor) -> None:
            self.mode, self.write, self.table, self.lens = "decode", write, table, lens
            self.split = long_rows(lens) if self.use_triton and not self.gather \
                and table.shape[1] * self.page_size > SPLIT_TOKENS else None

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            B, nkv, T, hdk = key_states.shape
            if layer_idx not in self.k:                      # the probe: record, store nothing
                self.shapes[layer_idx] = (nkv, hdk, value_states.shape[-1])
                self.returned[layer_idx] = id(key_states)
                return key_states, value_states
            kp, vp = self.k[layer_idx], self.v[layer_idx]
            kp.index_copy_(0, self.write, key_states.transpose(1, 2).reshape(B * T, nkv, hdk)
                           .to(kp.dtype))
            vp.index_copy_(0, self.write, value_states.transpose(1, 2)
                           .reshape(B * T, nkv, vp.shape[-1]).to(vp.dtype))
            if self.mode == "prefill":
                return key_states, value_states
            if layer_idx in self.gather or -1 in self.gather:
                return (gather_rows(kp, self.table, self.page_size),
                        gather_rows(vp, self.table, self.page_size))
            return kp, vp                                    # decode: attention reads the pools

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0  # positions are always given explicitly

    return PagedCache


def PagedCache():  # noqa: N802  (a class made on first use: transformers is imported lazily)
    global _CLS
    if "_CLS" not in globals():
        _CLS = _paged_cache_class()
    return _CLS()


@contextmanager
def paged_context(cache):
    """Forwards on this thread read `cache`'s mode, page table and lengths."""
    prev = getattr(_local, "cache", None)
    _local.cache = cache
    try:
        yield cache
    finally:
        _local.cache = prev


# -------------------------------------------------------------------------- attention
def gather_rows(pool: Tensor, table: Tensor, page_size: int) -> Tensor:
    """Each row's pages of a pool [pages·P, nkv, hd] -> [B, nkv, W·P, hd] (position order)."""
    B, W = table.shape
    idx = (table.long()[:, :, None] * page_size
           + torch.arange(page_size, device=pool.device)).reshape(B, W * page_size)
    return pool[idx].transpose(1, 2)


def masked_decode_sdpa(q: Tensor, k: Tensor, v: Tensor, lens: Tensor, scale: float) -> Tensor:
    """One query token per row over k [B, nkv, S, hdk], v [B, nkv, S, hdv], of which the first
    lens[b] are the row's: q [B, nh, hdk] -> [B, nh, hdv] (0 for rows with lens 0)."""
    B, nh, hdk = q.shape
    nkv, S = k.shape[1], k.shape[2]
    seen = torch.arange(S, device=q.device)[None] < lens[:, None]          # [B, S]
    mask = torch.zeros(B, 1, 1, S, dtype=q.dtype, device=q.device) \
        .masked_fill(~seen[:, None, None], float("-inf"))
    qg = q.reshape(B, nkv, nh // nkv, hdk)                                 # head h = kv·g + j
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # [B, nkv, g, hdv]
    o = torch.where((lens > 0)[:, None, None, None], o, 0.0)              # idle rows: no keys
    return o.reshape(B, nh, v.shape[-1])


def paged_attention_reference(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor,
                              lens: Tensor, scale: float, page_size: int) -> Tensor:
    """Decode attention by gathering each row's pages: q [B, nh, hdk], pools [pages·P, nkv, hd],
    table [B, W] page ids, lens [B] tokens to attend (0: the row is idle, output 0).
    Returns [B, nh, hdv]. Exact; reads all W pages of every row whatever its length."""
    return masked_decode_sdpa(q, gather_rows(k_pool, table, page_size),
                              gather_rows(v_pool, table, page_size), lens, scale)


# Decode attention splits the longest rows (at most SPLIT_ROWS of a step, each over SPLIT_TOKENS
# tokens) into parts of SPLIT_TOKENS that run as programs of their own, merged after. One program
# per (row, kv head) reads its row's pages in turn, so a step's few rows of thousands of tokens
# (a long prompt) would set the time of every layer's attention; split, they cost little more
# than a step without them (BENCHMARKS.md, Data engine: `generate_throughput.py --attention`).
# A row not split runs the same parts in turn and the same merge, so its output does not
# depend on the split: greedy answers do not depend on which rows share a step.
SPLIT_ROWS = 16
SPLIT_TOKENS = 1024


def _next_pow2(x: int, floor: int = 16) -> int:
    return max(floor, 1 << (int(x) - 1).bit_length())


def long_rows(lens: Tensor, rows: int = SPLIT_ROWS, tokens: int = SPLIT_TOKENS
              ) -> tuple[Tensor, Tensor]:
    """The rows decode attention splits, from lens [B] (no host sync: a graph captures it) ->
    (order [L]: the L = min(rows, B) longest rows, longest first; slot [B]: a row's rank in
    order where it holds over `tokens` tokens, else -1)."""
    L = min(rows, lens.shape[0])
    top = torch.topk(lens, L).indices                                              # [L]
    slot = torch.full_like(lens, -1)
    rank = torch.arange(L, dtype=lens.dtype, device=lens.device)
    slot[top] = torch.where(lens[top] > tokens, rank, -1)
    return top.int(), slot


def paged_attention_triton(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor,
                           lens: Tensor, scale: float, page_size: int,
                           split: tuple[Tensor, Tensor] | None = None,
                           split_tokens: int = SPLIT_TOKENS) -> Tensor:
    """The Triton decode kernel (same contract as `paged_attention_reference`). split: the rows
    to split (`long_rows`, computed once a step), each into parts of split_tokens tokens."""
    from drafter.generation import paged_kernels as pk

    B, nh, hdk = q.shape
    nkv, hdv = k_pool.shape[1], v_pool.shape[-1]
    g = nh // nkv
    q = q.contiguous()
    out = torch.empty(B, nh, hdv, dtype=q.dtype, device=q.device)
    cap = max(1, split_tokens // page_size)                       # pages a part reads
    S = -(-table.shape[1] // cap)                                 # parts of the widest row
    if split is None or S < 2:
        order = slot = pm = pl = pacc = lens                      # unused (SPLIT off)
        L = S = 1
    else:
        order, slot = split
        L = order.shape[0]
        pm = torch.empty(L, S, nh, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pacc = torch.empty(L, S, nh, hdv, dtype=torch.float32, device=q.device)
    on = S > 1
    pk.decode[(B + (L * (S - 1) if on else 0), nkv)](
        q, k_pool, v_pool, out, table, lens, scale, slot, order, pm, pl, pacc, B, max(1, S - 1),
        nh, q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), table.stride(0), out.stride(0), out.stride(1),
        G=g, GP=_next_pow2(g), HDK=hdk, HDKP=_next_pow2(hdk), HDV=hdv,
        HDVP=_next_pow2(hdv), P=page_size, IEEE=q.dtype == torch.float32, SPLIT=on, CAP=cap,
        num_warps=4, num_stages=2)
    if on:
        pk.merge[(L, nkv)](out, slot, order, pm, pl, pacc, S, nh, out.stride(0), out.stride(1),
                        G=g, GP=_next_pow2(g), HDV=hdv, HDVP=_next_pow2(hdv), num_warps=4)
    return out


def packed_attention_reference(q: Tensor, k: Tensor, v: Tensor, starts: Tensor,
                               scale: float) -> Tensor:
    """Causal attention of packed prompts, one SDPA per prompt: q [N, nh, hdk], k [N, nkv, hdk],
    v [N, nkv, hdv], starts [N] each token's prompt's first index -> [N, nh, hdv]."""
    N, nh, _ = q.shape
    g = nh // k.shape[1]
    first = torch.nonzero(starts == torch.arange(N, device=q.device))[:, 0].tolist() + [N]
    out = []
    for a, b in zip(first[:-1], first[1:]):
        qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))      # [1, heads, T, hd]
        if g > 1:
            ks, vs = ks.repeat_interleave(g, dim=1), vs.repeat_interleave(g, dim=1)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=b - a > 1, scale=scale)
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


def packed_attention_triton(q: Tensor, k: Tensor, v: Tensor, starts: Tensor,
                            scale: float) -> Tensor:
    """The Triton kernel for packed prompts (same contract as `packed_attention_reference`, and
    starts -1 for padding, which attends to nothing: output 0): one program per (64 queries,
    head), over each of its prompts' keys in blocks from that prompt's first token, so a
    prompt's output is the same bit for bit wherever it sits in the chunk. No host sync and
    fixed shapes: a prefill of N tokens graphs."""
    from drafter.generation import paged_kernels as pk

    N, nh, hdk = q.shape
    nkv, hdv = k.shape[1], v.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty(N, nh, hdv, dtype=q.dtype, device=q.device)
    BM = 64
    pk.prefill[(-(-N // BM), nh)](
        q, k, v, out, starts, N, scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        G=nh // nkv, HDK=hdk, HDKP=_next_pow2(hdk), HDV=hdv, HDVP=_next_pow2(hdv), BM=BM, BN=64,
        IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2)
    return out


def packed_attention(q: Tensor, k: Tensor, v: Tensor, starts: Tensor, scale: float,
                     use_triton: bool) -> Tensor:
    if use_triton:
        return packed_attention_triton(q, k, v, starts, scale)
    return packed_attention_reference(q, k, v, starts, scale)


def paged_decode(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, lens: Tensor,
                 scale: float, page_size: int, use_triton: bool,
                 split: tuple[Tensor, Tensor] | None = None) -> Tensor:
    if use_triton:
        return paged_attention_triton(q, k_pool, v_pool, table, lens, scale, page_size, split)
    return paged_attention_reference(q, k_pool, v_pool, table, lens, scale, page_size)


def _paged_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     is_causal=None, **kwargs):
    """transformers attention function (registered as `drafter_paged`): query [B, nh, T, hdk]
    after RoPE; key/value are what PagedCache.update returned. Returns [B, T, nh, hdv]."""
    cache = _local.cache
    B, nh, T, hdk = query.shape
    scale = scaling if scaling is not None else hdk ** -0.5
    if cache.returned and not cache.k:                  # the probe: does attention see the cache?
        i = getattr(module, "layer_idx", None)
        if i is None or cache.returned.get(i) != id(key):
            cache.gather.add(i if i is not None else -1)
    if cache.mode == "prefill" and cache.starts is not None:              # packed prompts [1, N]
        o = packed_attention(query[0].transpose(0, 1), key[0].transpose(0, 1),
                             value[0].transpose(0, 1), cache.starts, scale, cache.use_triton)
        return o[None], None
    if cache.mode == "prefill":
        if key.shape[1] != nh:  # grouped heads repeated: enable_gqa would leave the flash kernel
            key = key.repeat_interleave(nh // key.shape[1], dim=1)
            value = value.repeat_interleave(nh // value.shape[1], dim=1)
        o = F.scaled_dot_product_attention(query, key, value, is_causal=T > 1, scale=scale)
        return o.transpose(1, 2).contiguous(), None
    if key.dim() == 4:                                  # gathered rows (cache.gather)
        o = masked_decode_sdpa(query[:, :, 0], key, value, cache.lens, scale)
    else:
        o = paged_decode(query[:, :, 0], key, value, cache.table, cache.lens, scale,
                         cache.page_size, cache.use_triton, cache.split)         # [B, nh, hdv]
    return o[:, None], None


def use_paged_attention(model) -> None:
    """Switch an HF model to `_paged_attention`. No mask function is registered: transformers
    then builds no mask at all (prefill is causal, decode reads lens)."""
    from transformers import AttentionInterface

    AttentionInterface.register(_IMPL, _paged_attention)
    if model.config._attn_implementation != _IMPL:
        model.set_attn_implementation(_IMPL)


def unsupported(model) -> str | None:
    """Why the paged generator cannot run this model exactly (None: it can): sliding windows, logit
    softcapping, attention sinks and scaled logits need masks or outputs it does not build."""
    from drafter.core.target import text_config

    tc = text_config(model.config)
    types = set(getattr(tc, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        return f"layer types {sorted(types)} (full attention only)"
    if getattr(tc, "layer_types", None) is None and getattr(tc, "sliding_window", None) \
            and getattr(tc, "use_sliding_window", True):
        return f"sliding-window attention (window {tc.sliding_window})"
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(tc, key, None):
            return f"{key}={getattr(tc, key)}"
    for key in ("logit_scale", "logits_scaling"):
        if getattr(tc, key, None) not in (None, 1, 1.0):
            return f"{key}={getattr(tc, key)}"
    return None
