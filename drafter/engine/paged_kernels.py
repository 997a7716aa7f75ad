"""The Triton kernels of the paged cache's attention (drafter.engine.paged imports this module
only where Triton runs: a CUDA device, or TRITON_INTERPRET=1 in the tests).

    decode   one program per (row, kv head): the row's pages in turn (`decode`), the step's
             longest rows split into parts run as extra programs of the same launch and merged
             after (`merge`)
    prefill  packed prompts [1, N]: one program per (BM queries, head) over the keys from the
             earliest prompt start among its queries to its last query (`prefill`)

Both read keys in blocks and keep an online softmax (`_online_step`): per query its running
maximum m, sum s_sum and unnormalised output acc, rescaled as each block raises the maximum.
"""
import triton
import triton.language as tl


@triton.jit
def _online_step(q, k, v, seen, m, s_sum, acc, scale, IEEE: tl.constexpr):
    """One block of keys k [BK, HDKP] and values v [BK, HDVP] for the queries q [R, HDKP], seen
    [R, BK] which each may attend: the running (m [R], s_sum [R], acc [R, HDVP]) updated."""
    if IEEE:  # float32 models: exact products (the default would be tf32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale                 # [R, BK]
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)     # nothing seen yet: no NaN
    alpha = tl.exp(m - m_ref)
    p = tl.exp(s - m_ref[:, None])
    s_sum = s_sum * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, s_sum, acc


@triton.jit
def decode(Q, K, V, O, table, lens, scale, SLOT, ORDER, PM, PL, PACC, B, S1, NH,
           s_qb, s_qh, s_kt, s_kh, s_vt, s_vh, s_tb, s_ob, s_oh,
           G: tl.constexpr, GP: tl.constexpr, HDK: tl.constexpr, HDKP: tl.constexpr,
           HDV: tl.constexpr, HDVP: tl.constexpr, P: tl.constexpr, IEEE: tl.constexpr,
           SPLIT: tl.constexpr, CAP: tl.constexpr):
    pid = tl.program_id(0)
    kh = tl.program_id(1)
    g = tl.arange(0, GP)
    dk = tl.arange(0, HDKP)
    dv = tl.arange(0, HDVP)
    t = tl.arange(0, P)
    heads = kh * G + g
    if SPLIT:   # programs [B, B + L·S1): pages CAP·s.. of the long row ranked i (s >= 1)
        extra = pid >= B
        j = tl.maximum(pid - B, 0)
        s = tl.where(extra, j % S1 + 1, 0)
        b = tl.where(extra, tl.load(ORDER + j // S1), pid)
        n = tl.load(lens + b)
        slot = tl.load(SLOT + b)           # its rank among the split rows, -1: not split
        lo = tl.where(slot >= 0, s * CAP, 0)
        hi = tl.where(slot >= 0, tl.minimum(tl.cdiv(n, P), lo + CAP),
                      tl.where(extra, 0, tl.cdiv(n, P)))
    else:
        b = pid
        n = tl.load(lens + b)
        lo = 0
        hi = tl.cdiv(n, P)
    q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + dk[None, :],
                mask=(g[:, None] < G) & (dk[None, :] < HDK), other=0.0)            # [GP, HDKP]
    m = tl.full([GP], float("-inf"), tl.float32)
    s_sum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, HDVP], tl.float32)
    for i in range(lo, hi):
        page = tl.load(table + b * s_tb + i).to(tl.int64)
        tok = page * P + t                                                         # [P]
        k = tl.load(K + tok[:, None] * s_kt + kh * s_kh + dk[None, :],
                    mask=dk[None, :] < HDK, other=0.0)                             # [P, HDKP]
        v = tl.load(V + tok[:, None] * s_vt + kh * s_vh + dv[None, :],
                    mask=dv[None, :] < HDV, other=0.0)                             # [P, HDVP]
        m, s_sum, acc = _online_step(q, k, v, (i * P + t)[None, :] < n, m, s_sum, acc, scale,
                                     IEEE)
    hm = g < G
    hv = (g[:, None] < G) & (dv[None, :] < HDV)
    if SPLIT:   # a split row: its part's maximum, sum and unnormalised output
        part = (tl.maximum(slot, 0) * (S1 + 1) + s) * NH + heads                     # [GP]
        split = (slot + g * 0) >= 0                   # [GP] (masks are vectors, not scalars)
        tl.store(PM + part, m, mask=hm & split)
        tl.store(PL + part, s_sum, mask=hm & split)
        tl.store(PACC + part[:, None] * HDV + dv[None, :], acc, mask=hv & split[:, None])
        hv = hv & (~split & ((pid + g * 0) < B))[:, None]   # else the output, once
    out = acc / tl.maximum(s_sum, 1e-30)[:, None]                                  # idle: 0
    tl.store(O + b * s_ob + heads[:, None] * s_oh + dv[None, :], out.to(O.dtype.element_ty),
             mask=hv)


@triton.jit
def merge(O, SLOT, ORDER, PM, PL, PACC, S, NH, s_ob, s_oh, G: tl.constexpr,
          GP: tl.constexpr, HDV: tl.constexpr, HDVP: tl.constexpr):
    i = tl.program_id(0)                  # the i-th longest row: its parts into one output
    kh = tl.program_id(1)
    g = tl.arange(0, GP)
    dv = tl.arange(0, HDVP)
    heads = kh * G + g
    b = tl.load(ORDER + i)
    mine = (tl.load(SLOT + b) + g * 0) == i             # [GP]: row b was split, as rank i
    hm = (g < G) & mine
    hv = (g[:, None] < G) & (dv[None, :] < HDV) & mine[:, None]
    mx = tl.full([GP], float("-inf"), tl.float32)
    s_sum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, HDVP], tl.float32)
    for s in range(0, S):
        part = (i * S + s) * NH + heads
        m_s = tl.load(PM + part, mask=hm, other=float("-inf"))
        m_new = tl.maximum(mx, m_s)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # nothing yet: no NaN
        alpha = tl.exp(mx - m_ref)
        beta = tl.exp(m_s - m_ref)
        s_sum = s_sum * alpha + tl.load(PL + part, mask=hm, other=0.0) * beta
        acc = acc * alpha[:, None] + tl.load(PACC + part[:, None] * HDV + dv[None, :],
                                             mask=hv, other=0.0) * beta[:, None]
        mx = m_new
    out = acc / tl.maximum(s_sum, 1e-30)[:, None]
    tl.store(O + b * s_ob + heads[:, None] * s_oh + dv[None, :], out.to(O.dtype.element_ty),
             mask=hv)


@triton.jit
def prefill(Q, K, V, O, starts, N, scale, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh,
            G: tl.constexpr, HDK: tl.constexpr, HDKP: tl.constexpr, HDV: tl.constexpr,
            HDVP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
    pm = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // G
    m = pm * BM + tl.arange(0, BM)                                                 # [BM]
    mv = m < N
    st = tl.load(starts + m, mask=mv, other=0)
    dk = tl.arange(0, HDKP)
    dv = tl.arange(0, HDVP)
    q = tl.load(Q + m[:, None] * s_qt + h * s_qh + dk[None, :],
                mask=mv[:, None] & (dk[None, :] < HDK), other=0.0)                # [BM, HDKP]
    lo = (tl.min(tl.where(mv, st, N)) // BN) * BN       # the block's earliest prompt start
    hi = tl.minimum(pm * BM + BM, N)
    mx = tl.full([BM], float("-inf"), tl.float32)
    s_sum = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, HDVP], tl.float32)
    for n0 in range(lo, hi, BN):
        n = n0 + tl.arange(0, BN)                                                  # [BN]
        k = tl.load(K + n[:, None] * s_kt + kh * s_kh + dk[None, :],
                    mask=(n[:, None] < N) & (dk[None, :] < HDK), other=0.0)       # [BN, HDKP]
        v = tl.load(V + n[:, None] * s_vt + kh * s_vh + dv[None, :],
                    mask=(n[:, None] < N) & (dv[None, :] < HDV), other=0.0)       # [BN, HDVP]
        seen = (n[None, :] >= st[:, None]) & (n[None, :] <= m[:, None])
        mx, s_sum, acc = _online_step(q, k, v, seen, mx, s_sum, acc, scale, IEEE)
    out = acc / tl.maximum(s_sum, 1e-30)[:, None]
    tl.store(O + m[:, None] * s_ot + h * s_oh + dv[None, :], out.to(O.dtype.element_ty),
             mask=mv[:, None] & (dv[None, :] < HDV))
