"""Attention of the unroll's later steps: the diagonal merge, exact and as two Triton kernels.

At TTT step i > 0 a position attends to the step-0 keys of its sample (FlexAttention,
drafter/train/ttt.py's flex_part0, which returns their log-sum-exp) and to the i keys that steps
1..i computed at the same position (the diagonal). `merge_diagonal` adds the diagonal to the
step-0 attention by their log-sum-exps, exactly: as eager float32 ops with a hand-written
backward (`_MergeDiagonal`), or on CUDA as one Triton kernel each way (`_FusedMerge`, switched
by FUSED_MERGE). Both equal attention over all keys (tests/test_model.py).
"""
from __future__ import annotations

import functools

import torch

from drafter.core.gpu import triton_available
from drafter.train.model import _f32


def merge_diagonal(q, o0, lse0, ks, vs, scale: float):
    """Add the diagonal keys of steps 1..i to attention over the step-0 keys.

    q [B, nh, T, hd]; o0 [B, nh, T, hd] and lse0 [B, nh, T] (fp32): attention output and
    log-sum-exp of the scores over the step-0 keys; ks, vs: the keys/values of steps 1..i, each
    [B, nkv, T, hd]. softmax over all keys = a convex mix of o0 (weight exp(lse0)) and each v_j
    (weight exp(q·k_j·scale)), so the result is exact."""
    if not ks:
        return o0
    if FUSED_MERGE and triton_available(q.device):
        return _FusedMerge.apply(q, o0, lse0, torch.stack(ks), torch.stack(vs), scale)
    return _MergeDiagonal.apply(q, o0, lse0, scale, len(ks), *ks, *vs)


FUSED_MERGE = True  # merge_diagonal on CUDA: two Triton kernels (False: _MergeDiagonal's eager ops)


class _MergeDiagonal(torch.autograd.Function):
    """merge_diagonal with its backward written out: saves the (bf16) inputs, which the
    attention keeps anyway, and the mixing weights [B, nkv, g, T, 1+i]; autograd would keep
    fp32 copies of q, o0 and q·k_j of [B, nh, T, hd] each."""

    @staticmethod
    def forward(ctx, q, o0, lse0, scale, i, *kv):
        ks, vs = kv[:i], kv[i:]
        B, nh, T, hd = q.shape
        nkv = ks[0].shape[1]
        g = nh // nkv
        qg = _f32(q).view(B, nkv, g, T, hd)                                    # [B, nkv, g, T, hd]
        s = [(qg * _f32(k).unsqueeze(2)).sum(-1) * scale for k in ks]          # i × [B, nkv, g, T]
        w = torch.stack([_f32(lse0).view(B, nkv, g, T)] + s, -1).softmax(-1)   # [B, nkv, g, T, 1+i]
        out = w[..., :1] * _f32(o0).view(B, nkv, g, T, hd)
        for j, v in enumerate(vs):
            out = out + w[..., j + 1:j + 2] * _f32(v).unsqueeze(2)
        ctx.save_for_backward(q, o0, w, *kv)
        ctx.scale, ctx.i = scale, i
        # in o0's layout (flex's follows q's: [B, T, nh, hd] in memory), so that post sees one
        # layout at every TTT step: a contiguous o from step 1 on compiled post a second time
        return torch.empty_like(o0).copy_(out.view(B, nh, T, hd))

    @staticmethod
    def backward(ctx, gout):
        q, o0, w, *kv = ctx.saved_tensors
        i, scale = ctx.i, ctx.scale
        ks, vs = kv[:i], kv[i:]
        B, nh, T, hd = q.shape
        nkv = ks[0].shape[1]
        g = nh // nkv
        go = _f32(gout).view(B, nkv, g, T, hd)
        vals = [_f32(o0).view(B, nkv, g, T, hd)] + [_f32(v).unsqueeze(2) for v in vs]
        dw = torch.stack([(go * v).sum(-1) for v in vals], -1)                # [B, nkv, g, T, 1+i]
        ds = w * (dw - (w * dw).sum(-1, keepdim=True))                          # softmax backward
        qg = _f32(q).view(B, nkv, g, T, hd)
        dq = sum(ds[..., j + 1:j + 2] * _f32(k).unsqueeze(2) for j, k in enumerate(ks)) * scale
        dks = [((ds[..., j + 1:j + 2] * qg).sum(2) * scale).to(k.dtype) for j, k in enumerate(ks)]
        dvs = [(w[..., j + 1:j + 2] * go).sum(2).to(v.dtype) for j, v in enumerate(vs)]
        return (dq.view(B, nh, T, hd).to(q.dtype), (w[..., :1] * go).view(B, nh, T, hd)
                .to(o0.dtype), ds[..., 0].reshape(B, nh, T), None, None, *dks, *dvs)


class _FusedMerge(torch.autograd.Function):
    """merge_diagonal in two Triton kernels, forward and backward, on CUDA (the CPU tests run
    them in Triton's interpreter). _MergeDiagonal's eager float32 ops are 564 kernels a
    micro-batch at K=7, forward and backward (44 at TTT step 1 to 144 at step 6, counted on the
    CPU; the SmolLM2 step waits on the host), each a pass over [B, nh, T, hd] or
    [B, nkv, T, hd] (the Llama-8B step's GPU time); here 4 a step (2 stacks, 2 kernels). One
    program takes a kv head's g query heads at a block of positions: the scores q·k_j, their
    softmax with lse0 (online), and the mix of o0 and the v_j, in float32 registers. It saves
    lse, the log-sum-exp of all 1 + i scores [B, nh, T], instead of the mixing weights: the
    backward recomputes them from q and the keys. ks, vs come stacked [i, B, nkv, T, hd]
    (torch.stack: autograd splits their gradients back to each step's k and v)."""

    @staticmethod
    def forward(ctx, q, o0, lse0, kst, vst, scale):
        B, nh, T, hd = q.shape
        n, nkv = kst.shape[0], kst.shape[2]
        kst, vst = kst.contiguous(), vst.contiguous()
        out = torch.empty_like(o0)                       # o0's layout: see _MergeDiagonal
        lse = torch.empty(B, nh, T, dtype=torch.float32, device=q.device)
        grid, meta = _merge_launch(B, nh, nkv, T, hd)
        _merge_kernels()[0][grid](
            q, o0, lse0, kst, vst, out, lse, T, n, nh // nkv, nkv, scale,
            *q.stride(), *o0.stride(), *lse0.stride(), *kst.stride()[:4], *out.stride(),
            **meta)
        ctx.save_for_backward(q, o0, lse0, kst, vst, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, gout):
        q, o0, lse0, kst, vst, lse = ctx.saved_tensors
        B, nh, T, hd = q.shape
        n, nkv = kst.shape[0], kst.shape[2]
        dq, do0 = torch.empty_like(q), torch.empty_like(o0)
        dlse0 = torch.empty(B, nh, T, dtype=torch.float32, device=q.device)
        dk, dv = torch.empty_like(kst), torch.empty_like(vst)
        grid, meta = _merge_launch(B, nh, nkv, T, hd)
        _merge_kernels()[1][grid](
            q, o0, lse0, kst, vst, lse, gout, dq, do0, dlse0, dk, dv, T, n, nh // nkv, nkv,
            ctx.scale, *q.stride(), *o0.stride(), *lse0.stride(), *kst.stride()[:4],
            *gout.stride(), *dq.stride(), *do0.stride(), **meta)
        return dq, do0, dlse0, dk, dv, None


def _merge_launch(B: int, nh: int, nkv: int, T: int, hd: int) -> tuple[tuple, dict]:
    """The kernels' grid and block sizes: a program takes g = nh / nkv heads (a power of 2,
    G) × BT positions × hd (D) in registers, G·BT·D = 4096 float32 a tile."""
    G, D = 1 << (nh // nkv - 1).bit_length(), 1 << (hd - 1).bit_length()
    BT = max(1, 4096 // (G * D))
    return (_cdiv(T, BT), B * nkv), dict(G=G, BT=BT, D=D, HD=hd, num_warps=4)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _merge_kernels():
    import triton
    import triton.language as tl

    # n (the step's diagonal keys, 1..K-1) and T are not specialised on: Triton would compile
    # n = 1 apart (a value of 1 is a constant to it), a second cold compile of each kernel
    @triton.jit(do_not_specialize=["T", "n"])
    def forward(Q, O0, L0, KS, VS, OUT, LSE, T, n, g, nkv, scale,
                sqb, sqh, sqt, sqd, sob, soh, sot, sod, slb, slh, slt, skj, skb, skh, skt,
                syb, syh, syt, syd, G: tl.constexpr, BT: tl.constexpr, D: tl.constexpr,
                HD: tl.constexpr):
        # one program: kv head kh of sample b, its g query heads (kh·g + gi) at positions
        # t0..t0+BT; tiles [G, BT, D] in float32, the keys and values [BT, D] of one step
        bh = tl.program_id(1)
        b, kh = (bh // nkv).to(tl.int64), bh % nkv
        ag, ad = tl.arange(0, G), tl.arange(0, D)
        at = tl.program_id(0) * BT + tl.arange(0, BT)
        gi, t, d = ag[:, None, None], at[None, :, None], ad[None, None, :]    # tiles [G, BT, D]
        h, h2, t2 = kh * g + gi, kh * g + ag[:, None], at[None, :]            # rows [G, BT]
        m3 = (gi < g) & (t < T) & (d < HD)
        m2 = (ag[:, None] < g) & (t2 < T)
        kv = b * skb + kh * skh + at[:, None] * skt + ad[None, :]              # [BT, D]
        mkv = (at[:, None] < T) & (ad[None, :] < HD)
        q = tl.load(Q + b * sqb + h * sqh + t * sqt + d * sqd, mask=m3, other=0.0).to(tl.float32)
        acc = tl.load(O0 + b * sob + h * soh + t * sot + d * sod, mask=m3,
                      other=0.0).to(tl.float32)
        m = tl.load(L0 + b * slb + h2 * slh + t2 * slt, mask=m2, other=0.0)
        s_sum = tl.full([G, BT], 1.0, tl.float32)      # Σ exp(score - m), o0's weight first
        for j in range(n):
            k = tl.load(KS + j * skj + kv, mask=mkv, other=0.0).to(tl.float32)
            v = tl.load(VS + j * skj + kv, mask=mkv, other=0.0).to(tl.float32)
            s = tl.sum(q * k[None, :, :], 2) * scale                               # [G, BT]
            m_new = tl.maximum(m, s)
            alpha, p = tl.exp(m - m_new), tl.exp(s - m_new)
            acc = acc * alpha[:, :, None] + p[:, :, None] * v[None, :, :]
            s_sum = s_sum * alpha + p
            m = m_new
        out = acc / s_sum[:, :, None]
        tl.store(OUT + b * syb + h * syh + t * syt + d * syd, out.to(OUT.dtype.element_ty),
                 mask=m3)
        tl.store(LSE + (b * nkv * g + h2) * T + t2, m + tl.log(s_sum), mask=m2)

    @triton.jit(do_not_specialize=["T", "n"])
    def backward(Q, O0, L0, KS, VS, LSE, GO, DQ, DO0, DL0, DK, DV, T, n, g, nkv, scale,
                 sqb, sqh, sqt, sqd, sob, soh, sot, sod, slb, slh, slt, skj, skb, skh, skt,
                 sgb, sgh, sgt, sgd, sdb, sdh, sdt, sdd, sxb, sxh, sxt, sxd,
                 G: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, HD: tl.constexpr):
        # _MergeDiagonal.backward's formulas: w_0 = exp(lse0 - lse), w_j = exp(s_j - lse),
        # dw_j = go·v_j (v_0 = o0), ds_j = w_j (dw_j - Σ w dw); dq = Σ_j ds_j k_j scale,
        # dk_j = Σ_g ds_j q scale, dv_j = Σ_g w_j go, do0 = w_0 go, dlse0 = ds_0
        bh = tl.program_id(1)
        b, kh = (bh // nkv).to(tl.int64), bh % nkv
        ag, ad = tl.arange(0, G), tl.arange(0, D)
        at = tl.program_id(0) * BT + tl.arange(0, BT)
        gi, t, d = ag[:, None, None], at[None, :, None], ad[None, None, :]    # tiles [G, BT, D]
        h, h2, t2 = kh * g + gi, kh * g + ag[:, None], at[None, :]            # rows [G, BT]
        m3 = (gi < g) & (t < T) & (d < HD)
        m2 = (ag[:, None] < g) & (t2 < T)
        kv = b * skb + kh * skh + at[:, None] * skt + ad[None, :]              # [BT, D]
        mkv = (at[:, None] < T) & (ad[None, :] < HD)
        q = tl.load(Q + b * sqb + h * sqh + t * sqt + d * sqd, mask=m3, other=0.0).to(tl.float32)
        o0 = tl.load(O0 + b * sob + h * soh + t * sot + d * sod, mask=m3,
                     other=0.0).to(tl.float32)
        go = tl.load(GO + b * sgb + h * sgh + t * sgt + d * sgd, mask=m3,
                     other=0.0).to(tl.float32)
        l0 = tl.load(L0 + b * slb + h2 * slh + t2 * slt, mask=m2, other=0.0)
        lse = tl.load(LSE + (b * nkv * g + h2) * T + t2, mask=m2, other=0.0)
        w0 = tl.exp(l0 - lse)
        dw0 = tl.sum(go * o0, 2)
        dot = w0 * dw0                                                  # Σ_j w_j dw_j [G, BT]
        for j in range(n):
            k = tl.load(KS + j * skj + kv, mask=mkv, other=0.0).to(tl.float32)
            v = tl.load(VS + j * skj + kv, mask=mkv, other=0.0).to(tl.float32)
            w = tl.exp(tl.sum(q * k[None, :, :], 2) * scale - lse)
            dot += w * tl.sum(go * v[None, :, :], 2)
        tl.store(DO0 + b * sxb + h * sxh + t * sxt + d * sxd,
                 (w0[:, :, None] * go).to(DO0.dtype.element_ty), mask=m3)
        tl.store(DL0 + (b * nkv * g + h2) * T + t2, w0 * (dw0 - dot), mask=m2)
        dq = tl.zeros([G, BT, D], tl.float32)
        for j in range(n):
            k = tl.load(KS + j * skj + kv, mask=mkv, other=0.0).to(tl.float32)
            v = tl.load(VS + j * skj + kv, mask=mkv, other=0.0).to(tl.float32)
            w = tl.exp(tl.sum(q * k[None, :, :], 2) * scale - lse)
            ds = w * (tl.sum(go * v[None, :, :], 2) - dot)                         # [G, BT]
            dq += ds[:, :, None] * k[None, :, :] * scale
            tl.store(DK + j * skj + kv, (tl.sum(ds[:, :, None] * q, 0) * scale)
                     .to(DK.dtype.element_ty), mask=mkv)
            tl.store(DV + j * skj + kv, tl.sum(w[:, :, None] * go, 0).to(DV.dtype.element_ty),
                     mask=mkv)
        tl.store(DQ + b * sdb + h * sdh + t * sdt + d * sdd, dq.to(DQ.dtype.element_ty), mask=m3)

    return forward, backward
