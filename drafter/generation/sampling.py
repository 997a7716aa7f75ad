"""Per-row sampling of the data engine's rows in one read of the logits: greedy where a row's
temperature is 0, else a Gumbel-max sample of logits / temperature.

    nxt = sample_rows(logits, temp, seed, use_triton, top_p)  # logits [B, V], temp [B]

The unfused form (drafter.decoding.tree: logits.float() / temp + Gumbel noise, then argmax) writes
and reads [B, V] float32 tensors seven times; at the data engine's batch of 2,048 rows over
SmolLM2's 49,152 tokens that is 400 MB each, in every step that any row samples (a synthetic
user turn at T=1 makes all of them sample). The Triton kernel (one program per row) draws its
noise in registers (Philox, four uniforms a draw, keyed by `seed` and the element's index) and
keeps a running maximum per lane, reduced once at the end: the logits are read once and nothing
[B, V] is written. `seed` is a one-element device tensor the caller advances after each draw
(inside a CUDA graph too). Greedy rows take the first index of the maximum, as torch.argmax
does. Its noise is not decoding.triton_helpers' gumbel_noise, whose draws would differ: a
Philox draw's four uniforms serve four blocks of LANES columns (not four adjacent columns), and
-log(-log(u)) is not clamped (Triton's uniforms lie in [0, 1)).
"""
from __future__ import annotations

import torch
from torch import Tensor

from drafter.decoding.noise import OFFSETS
from drafter.decoding.tree import _gumbel_like, nucleus

LANES = 1024
_KERNEL = None


def _make_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(L, T, OUT, SEED, V, s_l, Q: tl.constexpr):
        b = tl.program_id(0)
        t = tl.load(T + b)
        row = L + b.to(tl.int64) * s_l
        j = tl.arange(0, Q)
        best = tl.full([Q], float("-inf"), tl.float32)     # per lane: its maximum so far
        idx = tl.zeros([Q], tl.int32)                       # and where (its first column)
        if t > 0:
            seed = tl.load(SEED)
            for v0 in range(0, V, 4 * Q):   # one Philox draw: four uniforms, four columns
                u0, u1, u2, u3 = tl.rand4x(seed, b * V + v0 + j)
                c = v0 + j
                x = tl.load(row + c, mask=c < V, other=float("-inf")).to(tl.float32)
                x = x / t - tl.log(-tl.log(u0))
                idx = tl.where(x > best, c, idx)
                best = tl.maximum(x, best)
                c = v0 + Q + j
                x = tl.load(row + c, mask=c < V, other=float("-inf")).to(tl.float32)
                x = x / t - tl.log(-tl.log(u1))
                idx = tl.where(x > best, c, idx)
                best = tl.maximum(x, best)
                c = v0 + 2 * Q + j
                x = tl.load(row + c, mask=c < V, other=float("-inf")).to(tl.float32)
                x = x / t - tl.log(-tl.log(u2))
                idx = tl.where(x > best, c, idx)
                best = tl.maximum(x, best)
                c = v0 + 3 * Q + j
                x = tl.load(row + c, mask=c < V, other=float("-inf")).to(tl.float32)
                x = x / t - tl.log(-tl.log(u3))
                idx = tl.where(x > best, c, idx)
                best = tl.maximum(x, best)
        else:
            for v0 in range(0, V, Q):
                c = v0 + j
                x = tl.load(row + c, mask=c < V, other=float("-inf")).to(tl.float32)
                idx = tl.where(x > best, c, idx)
                best = tl.maximum(x, best)
        m = tl.max(best, 0)
        first = tl.min(tl.where(best == m, idx, V), 0)     # the first column of the maximum
        tl.store(OUT + b, first.to(tl.int64))

    return kernel


def sample_rows_torch(logits: Tensor, temp: Tensor, top_p: float = 1.0) -> Tensor:
    """The unfused form, any top_p (the nucleus for all rows): torch's random stream."""
    lg = logits.float()
    noisy = nucleus(lg / temp.clamp(min=1e-6)[:, None], top_p)
    return torch.where(temp > 0, (noisy + _gumbel_like(noisy)).argmax(-1), lg.argmax(-1))


def sample_rows(logits: Tensor, temp: Tensor, seed: Tensor, use_triton: bool,
                top_p: float = 1.0) -> Tensor:
    """Next token per row of logits [B, V]: argmax where temp [B] is 0, else Gumbel-max of
    logits / temp (within the top_p nucleus). `seed` [1] int64 on the logits' device: the
    kernel's noise key (advance it between draws); the torch form (no Triton, or top_p < 1:
    the nucleus sorts every row) draws from torch's stream instead."""
    if not use_triton or top_p < 1.0:
        return sample_rows_torch(logits, temp, top_p)
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _make_kernel()
    B, V = logits.shape
    if B * V >= OFFSETS:
        raise ValueError(f"sample_rows: {B} x {V} logits overflow the noise index")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(B, dtype=torch.long, device=logits.device)
    _KERNEL[(B,)](logits, temp.float().contiguous(), out, seed, V, logits.stride(0), Q=LANES,
                  num_warps=4)
    return out
