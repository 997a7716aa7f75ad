"""The Triton kernels of the paged cache's attention (drafter.generation.paged imports this module
only where Triton runs: a CUDA device, or TRITON_INTERPRET=1 in the tests).

    decode   one program per (row, kv head): the row's pages in turn (`decode`), the step's
             longest rows split into parts run as extra programs of the same launch and merged
             after (`merge`)
    prefill  packed prompts [1, N]: one program per (BM queries, head), over each of its
             prompts' keys in turn (`prefill`)

Both read keys in blocks and keep an online softmax (`_online_step`): per query its running
maximum m, sum s_sum and unnormalised output acc, rescaled as each block raises the maximum.

A row's output does not depend on the other rows, bit for bit, so greedy answers do not depend
on the batch size or on which prompts share a prefill: a prompt's keys are read in blocks that
start at the prompt's own first token wherever it sits in the chunk, and a row's pages go in
parts of CAP pages merged in order (`_merge_step`) whether the row was split or not.
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
def _merge_step(mx, s_sum, acc, m_p, l_p, a_p):
    """A part's (m_p [R], l_p [R], a_p [R, HDVP]) merged into the running (mx, s_sum, acc): the
    one merge both the split rows' `merge` and a whole row's program run."""
    m_new = tl.maximum(mx, m_p)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)     # nothing yet: no NaN
    alpha = tl.exp(mx - m_ref)
    beta = tl.exp(m_p - m_ref)
    return m_new, s_sum * alpha + l_p * beta, acc * alpha[:, None] + a_p * beta[:, None]


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
    for p0 in range(lo, hi, CAP):      # parts of CAP pages, as a split row's (one when split)
        m_p = tl.full([GP], float("-inf"), tl.float32)
        l_p = tl.zeros([GP], tl.float32)
        a_p = tl.zeros([GP, HDVP], tl.float32)
        for i in range(p0, tl.minimum(p0 + CAP, hi)):
            page = tl.load(table + b * s_tb + i).to(tl.int64)
            tok = page * P + t                                                     # [P]
            k = tl.load(K + tok[:, None] * s_kt + kh * s_kh + dk[None, :],
                        mask=dk[None, :] < HDK, other=0.0)                         # [P, HDKP]
            v = tl.load(V + tok[:, None] * s_vt + kh * s_vh + dv[None, :],
                        mask=dv[None, :] < HDV, other=0.0)                         # [P, HDVP]
            m_p, l_p, a_p = _online_step(q, k, v, (i * P + t)[None, :] < n, m_p, l_p, a_p,
                                         scale, IEEE)
        m, s_sum, acc = _merge_step(m, s_sum, acc, m_p, l_p, a_p)
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
        mx, s_sum, acc = _merge_step(
            mx, s_sum, acc, tl.load(PM + part, mask=hm, other=float("-inf")),
            tl.load(PL + part, mask=hm, other=0.0),
            tl.load(PACC + part[:, None] * HDV + dv[None, :], mask=hv, other=0.0))
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
    st = tl.load(starts + m, mask=mv, other=-1)           # -1: padding, attends to nothing
    dk = tl.arange(0, HDKP)
    dv = tl.arange(0, HDVP)
    q = tl.load(Q + m[:, None] * s_qt + h * s_qh + dk[None, :],
                mask=mv[:, None] & (dk[None, :] < HDK), other=0.0)                # [BM, HDKP]
    mx = tl.full([BM], float("-inf"), tl.float32)
    s_sum = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, HDVP], tl.float32)
    # each prompt among the block's queries in turn, its keys in blocks of BN from its own
    # first token: the same blocks as for that prompt alone (the other queries see none)
    seg = tl.min(tl.where(st >= 0, st, N))
    while seg < N:
        mine = st == seg
        last = tl.max(tl.where(mine, m, -1))                 # the prompt's last query here
        for n0 in range(seg, last + 1, BN):
            n = n0 + tl.arange(0, BN)                                              # [BN]
            k = tl.load(K + n[:, None] * s_kt + kh * s_kh + dk[None, :],
                        mask=(n[:, None] < N) & (dk[None, :] < HDK), other=0.0)   # [BN, HDKP]
            v = tl.load(V + n[:, None] * s_vt + kh * s_vh + dv[None, :],
                        mask=(n[:, None] < N) & (dv[None, :] < HDV), other=0.0)   # [BN, HDVP]
            seen = mine[:, None] & (n[None, :] <= m[:, None])
            mx, s_sum, acc = _online_step(q, k, v, seen, mx, s_sum, acc, scale, IEEE)
        seg = tl.min(tl.where(st > seg, st, N))
    out = acc / tl.maximum(s_sum, 1e-30)[:, None]
    tl.store(O + m[:, None] * s_ot + h * s_oh + dv[None, :], out.to(O.dtype.element_ty),
             mask=mv[:, None] & (dv[None, :] < HDV))
