"""The Triton kernels of speculative trees: the expansions that draft them (tree's greedy_children
and sampled_children, one kernel each) and the walk that verifies a sampled one (rejection's
walk). tree and rejection import this module only where Triton runs (a CUDA device, or
TRITON_INTERPRET=1 in the tests). Each kernel has a PyTorch form that the tests hold it to:
tree.greedy_children's and tree.sampled_children's eager branches, rejection.walk_torch (whose
module doc gives the walk's arithmetic).

    greedy_kernel   one program a row of draft logits: the k largest (ids, log-probs), in two
                    reads (the chunks' maxima and log-sum-exp, then the k best chunks again)
    sampled_kernel  the same two reads for two searches: the k largest log-probs and k Gumbel-top-k
                    draws (without replacement), and the log-sum-exp
    walk_kernel     one program a row: the row's node statistics, acceptance tests and residual
                    passes down the tree, then the last token's Gumbel-max

The top-k searches' keys (a value and its column in one int64) and the Philox-plus-Gumbel noise
are triton_helpers'.
"""
import triton
import triton.language as tl

from drafter.decoding import triton_helpers as th


@triton.jit
def greedy_kernel(X, MAXES, IDS, LOGP, V, s_x, NC: tl.constexpr, TILE: tl.constexpr,
                  C: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    # one program a row of V: each chunk of C columns' maximum and the row's log-sum-exp in
    # one read, then the K chunks with the largest maxima read again (L2), whose K·C values
    # hold the row's K largest (tree.top_indices' argument). Both searches pick by max
    # reductions over triton_helpers' keys: a value and its column (or chunk) in one int64.
    r = tl.program_id(0).to(tl.int64)
    row = X + r * s_x
    tile, col = tl.arange(0, TILE), tl.arange(0, C)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    for t in range(NC // TILE):
        idx = (t * TILE + tile)[:, None] * C + col[None, :]                       # [TILE, C]
        x = tl.load(row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        cmax = tl.max(x, 1)                                                       # [TILE]
        tl.store(MAXES + r * NC + t * TILE + tile, cmax)
        m_new = tl.maximum(m, tl.max(cmax, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.sum(tl.exp(x - m_new), 1), 0)
        m = m_new
    lse = m + tl.log(s)
    tl.debug_barrier()  # the maxima this block stored, visible to all of its threads
    best = th.top_chunks(MAXES + r * NC, NC, K, KP)                    # the K chunks [KP]
    kk = tl.arange(0, KP)
    idx = best[:, None] * C + col[None, :]                                        # [KP, C]
    ok = (kk[:, None] < K) & (idx < V)
    x = tl.load(row + idx, mask=ok, other=float("-inf")).to(tl.float32)
    ids, lp = th.top_k(x, idx, ok, lse, K, KP)
    tl.store(IDS + r * K + kk, ids, mask=kk < K)
    tl.store(LOGP + r * K + kk, lp, mask=kk < K)


@triton.jit
def sampled_kernel(rows, out, rand, size, temp, NC: tl.constexpr, TILE: tl.constexpr,
                   C: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, HAS_NOISE: tl.constexpr):
    # greedy_kernel's two reads for two searches at once: the K largest of x / temp (their
    # values: the scores) and of x / temp + Gumbel noise (their ids: K draws without
    # replacement, in draw order), with the row's log-sum-exp. The second read recomputes the
    # noise of the chunks it reads (Philox is a function of its offset). The arguments are
    # tuples (sampled_children_kernel's): rows (X, XMAX, YMAX) the logits [R, V] and the
    # chunks' maxima without and with the noise [R, NC], out (IDS, TOPV, LSE) [R, K], [R, K],
    # [R], rand (NOISE, SEED) the tests' uniforms [R, V] (HAS_NOISE) or the Philox key [1],
    # size (V, s_x) the rows' length and the logits' row stride
    X, XMAX, YMAX = rows
    IDS, TOPV, LSE = out
    NOISE, SEED = rand
    V, s_x = size
    r = tl.program_id(0).to(tl.int64)
    row = X + r * s_x
    tile, col = tl.arange(0, TILE), tl.arange(0, C)
    col4 = tl.arange(0, C // 4)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    for t in range(NC // TILE):
        idx = (t * TILE + tile)[:, None] * C + col[None, :]                       # [TILE, C]
        ok = idx < V
        x = tl.load(row + idx, mask=ok, other=float("-inf")).to(tl.float32) / temp
        # chunk j's offsets: (r V + j C) / 4 + the column's fourth (C divides V)
        off4 = (r * V) // 4 + (t * TILE + tile)[:, None] * (C // 4) + col4[None, :]
        y = x + th.gumbel_noise(NOISE + r * V, idx, ok, SEED, off4, HAS_NOISE)
        y = tl.where(ok, y, float("-inf"))
        cmax = tl.max(x, 1)
        tl.store(XMAX + r * NC + t * TILE + tile, cmax)
        tl.store(YMAX + r * NC + t * TILE + tile, tl.max(y, 1))
        m_new = tl.maximum(m, tl.max(cmax, 0))
        a = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))
        ex = tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
        s = s * a + tl.sum(tl.sum(ex, 1), 0)
        m = m_new
    lse = m + tl.log(s)
    tl.debug_barrier()  # the maxima this block stored, visible to all of its threads
    for which in tl.static_range(2):       # 0: the scores' search, 1: the draws'
        if which == 0:
            best = th.top_chunks(XMAX + r * NC, NC, K, KP)                     # the K chunks
        else:
            best = th.top_chunks(YMAX + r * NC, NC, K, KP)
        kk = tl.arange(0, KP)
        idx = best[:, None] * C + col[None, :]                                    # [KP, C]
        ok = (kk[:, None] < K) & (idx < V)
        x = tl.load(row + idx, mask=ok, other=float("-inf")).to(tl.float32) / temp
        if which == 1:  # the first read's offsets for these chunks
            off4 = (r * V) // 4 + best[:, None] * (C // 4) + col4[None, :]
            x = x + th.gumbel_noise(NOISE + r * V, idx, ok, SEED, off4, HAS_NOISE)
        out_i, out_v = th.top_k(x, idx, ok, lse, K, KP)
        if which == 0:
            tl.store(TOPV + r * K + kk, out_v, mask=kk < K)
        else:
            tl.store(IDS + r * K + kk, out_i, mask=kk < K)
    tl.store(LSE + r, lse)


@triton.jit
def _row_stats(LROW, T2D, V, temp, TILE: tl.constexpr):
    # log-sum-exp of the row / temp and its probability outside the draft vocab, one read
    t = tl.arange(0, TILE)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    so = tl.zeros([], tl.float32)
    for v0 in range(0, V, TILE):
        v = v0 + t
        x = tl.load(LROW + v, mask=v < V, other=float("-inf")).to(tl.float32) / temp
        out = tl.load(T2D + v, mask=v < V, other=0) < 0
        m_new = tl.maximum(m, tl.max(x, 0))
        a = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))
        ex = tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
        s = s * a + tl.sum(ex, 0)
        so = so * a + tl.sum(tl.where(out, ex, 0.0), 0)
        m = m_new
    return m + tl.log(s), so / s


@triton.jit
def _residual_mass(p, q, TIDS, dids, lam, temp, Vd, t, TILE: tl.constexpr):
    # the support's mass of max(0, p0 - lam q0) outside the drawn tokens dids, one read of the
    # support: p, q a node's target and draft rows (logits row, log-sum-exp), t [TILE] lanes
    lrow, lse = p
    qrow, qlse = q
    h = tl.zeros([], tl.float32)
    for v0 in range(0, Vd, TILE):
        dv = v0 + t
        ok = dv < Vd
        tv = tl.load(TIDS + dv, mask=ok, other=0)
        p0 = tl.exp(tl.load(lrow + tv, mask=ok, other=float("-inf")).to(tl.float32) / temp - lse)
        q0 = tl.exp(tl.load(qrow + dv, mask=ok, other=float("-inf")).to(tl.float32) / temp - qlse)
        hit = tl.max((dv[:, None] == dids[None, :]).to(tl.int32), 1)
        h += tl.sum(tl.where(ok & (hit == 0), tl.maximum(p0 - lam * q0, 0.0), 0.0), 0)
    return h


@triton.jit
def _children(kids, p, q, out0, vocab, cur, temp, lanes, K: tl.constexpr, KP: tl.constexpr,
              TILE: tl.constexpr):
    # a node's children tested in draw order until one is accepted (the module doc's
    # recursion). kids (CH, TOK, U): the node's children (array indices, -1: none), the row's
    # draft ids, the tests' uniforms; p, q: the node's target and draft rows (logits row,
    # log-sum-exp), out0 the target's mass outside the draft vocab; vocab (TIDS, Vd). Returns
    # whether one was accepted, the node walked to, and for the last token the final lam and
    # the drawn tokens (dids: draft ids) with their own lam (dmu)
    CH, TOK, U = kids
    TIDS, Vd = vocab
    lrow, lse = p
    qrow, qlse = q
    t, _, kk = lanes
    lam = tl.zeros([], tl.float32)
    g = tl.full([], 1.0, tl.float32)
    z = tl.full([], 1.0, tl.float32)
    f = tl.zeros([], tl.float32)
    dids = tl.full([KP], -1, tl.int64)
    dmu = tl.zeros([KP], tl.float32)
    found = tl.zeros([], tl.int32)
    nxt = cur
    for r in range(K):
        c = tl.load(CH + r).to(tl.int64)
        if (c >= 0) & (found == 0):
            d = tl.load(TOK + c - 1).to(tl.int64)
            pt = tl.exp(tl.load(lrow + tl.load(TIDS + d)).to(tl.float32) / temp - lse)
            qt = tl.exp(tl.load(qrow + d).to(tl.float32) / temp - qlse)
            if tl.load(U + r) * qt / z < tl.maximum(pt - lam * qt, 0.0) / g:
                found = tl.full([], 1, tl.int32)
                nxt = c
            else:
                lam1 = lam + g / z
                dids = tl.where(kk == r, d, dids)
                h = _residual_mass(p, q, TIDS, dids, lam1, temp, Vd, t, TILE)
                f1 = f + tl.maximum(pt - lam1 * qt, 0.0)
                g1 = h + out0 + f1
                if g1 > 0:
                    dmu = tl.where(kk == r, lam1, dmu)
                    lam, g, f = lam1, g1, f1
                else:             # a zero residual: p stays
                    dmu = tl.where(kk == r, lam, dmu)
                    f = f + tl.maximum(pt - lam * qt, 0.0)
                z = z - qt
    return found, nxt, lam, dids, dmu


@triton.jit
def _last_token(p, q, drawn, T2D, V, noise, b, temp, lanes, TILE: tl.constexpr,
                HAS_NOISE: tl.constexpr):
    # Gumbel-max over the final weights max(0, p0 - mu q0) (outside the support: p0), mu a drawn
    # token's own lam, else the node's: p, q the last node's rows (logits row, log-sum-exp),
    # drawn (lam, dids, dmu) as _children returns them, noise (NOISE, SEED) the row's uniforms
    # (the tests') or the Philox key
    lrow, lse = p
    qrow, qlse = q
    lam, dids, dmu = drawn
    NOISE, SEED = noise
    t, t4, _ = lanes
    best = tl.full([TILE], float("-inf"), tl.float32)
    idx = tl.zeros([TILE], tl.int64)
    for v0 in range(0, V, TILE):
        v = v0 + t
        ok = v < V
        x = tl.load(lrow + v, mask=ok, other=float("-inf")).to(tl.float32) / temp - lse
        dv = tl.load(T2D + v, mask=ok, other=-1).to(tl.int64)
        ins = dv >= 0
        q0 = tl.exp(tl.load(qrow + dv, mask=ok & ins, other=float("-inf"))
                    .to(tl.float32) / temp - qlse)
        hit = (dv[:, None] == dids[None, :]) & (dids[None, :] >= 0)             # [TILE, KP]
        mu = tl.where(tl.max(hit.to(tl.int32), 1) > 0,
                      tl.sum(tl.where(hit, dmu[None, :], 0.0), 1), lam)
        w = tl.where(ins, tl.log(tl.maximum(tl.exp(x) - mu * q0, 0.0)), x)
        # row b's offsets: b * ceil(V / 4) + the column's fourth
        y = w + th.gumbel_noise(NOISE, v, ok, SEED, b * ((V + 3) // 4) + v0 // 4 + t4,
                                HAS_NOISE)
        y = tl.where(ok, y, float("-inf"))
        idx = tl.where(y > best, v, idx)
        best = tl.maximum(y, best)
    m = tl.max(best, 0)
    return tl.min(tl.where(best == m, idx, V), 0)


@triton.jit
def walk_kernel(target, tree, draft, rand, out, temp, D: tl.constexpr, K: tl.constexpr,
                KP: tl.constexpr, TILE: tl.constexpr, HAS_NOISE: tl.constexpr):
    # one program a row: walk_torch's arithmetic, one node at a time (the module doc). The
    # arguments are tuples, tensors with their strides (walk_triton's):
    #   target (L, s_lb, s_ln, T2D, V): the verification's logits [B, N+1, V] and the target ->
    #     draft id map [V] (-1 outside the draft vocab)
    #   tree (TOK, s_tb, CH, s_cb, s_cn, DIST, s_db): the nodes' draft ids [B, N], their
    #     children [B, N+1, K] (array indices in draw order, -1: none), each node's row of the
    #     draft distributions [B, N+1] (-1: none)
    #   draft (Q, s_qb, s_qe, QLSE, s_sb, TIDS, Vd): the drafter's logits [B, E, Vd], their
    #     log-sum-exps at temp [B, E], the draft -> target id map [Vd]
    #   rand (U, NOISE, SEED): the acceptance tests' uniforms [B, D, K], the last token's [B, V]
    #     (the tests', HAS_NOISE) or the Philox key [1]
    #   out (CUR, NACC, BONUS) [B]: the last accepted node, the accepted count, the last token
    L, s_lb, s_ln, T2D, V = target
    TOK, s_tb, CH, s_cb, s_cn, DIST, s_db = tree
    Q, s_qb, s_qe, QLSE, s_sb, TIDS, Vd = draft
    U, NOISE, SEED = rand
    CUR, NACC, BONUS = out
    b = tl.program_id(0).to(tl.int64)
    # the helpers' index vectors, made once here (made inside them, they would be remade in
    # every node's loop)
    lanes = (tl.arange(0, TILE), tl.arange(0, TILE // 4), tl.arange(0, KP))
    cur = tl.zeros([], tl.int64)
    n_acc = tl.zeros([], tl.int64)
    going = tl.full([], 1, tl.int32)
    lam = tl.zeros([], tl.float32)
    dids = tl.full([KP], -1, tl.int64)                   # the drawn tokens (draft ids)
    dmu = tl.zeros([KP], tl.float32)                     # and their lam
    lse = tl.zeros([], tl.float32)
    qlse = tl.zeros([], tl.float32)
    e = tl.zeros([], tl.int64)
    for depth in range(D + 1):
        if going != 0:
            lrow = L + b * s_lb + cur * s_ln
            lse, out0 = _row_stats(lrow, T2D, V, temp, TILE)
            e = tl.load(DIST + b * s_db + cur).to(tl.int64)
            qrow = Q + b * s_qb + tl.maximum(e, 0) * s_qe
            qlse = tl.load(QLSE + b * s_sb + tl.maximum(e, 0))
            lam = tl.zeros([], tl.float32)
            dids = tl.full([KP], -1, tl.int64)
            dmu = tl.zeros([KP], tl.float32)
            found = tl.zeros([], tl.int32)
            nxt = cur
            if depth < D:
                kids = (CH + b * s_cb + cur * s_cn, TOK + b * s_tb, U + (b * D + depth) * K)
                found, nxt, lam, dids, dmu = _children(kids, (lrow, lse), (qrow, qlse), out0,
                                                       (TIDS, Vd), cur, temp, lanes, K, KP,
                                                       TILE)
            if found != 0:
                cur = nxt
                n_acc += 1
            else:
                going = tl.zeros([], tl.int32)
    lrow = L + b * s_lb + cur * s_ln
    qrow = Q + b * s_qb + tl.maximum(e, 0) * s_qe
    last = _last_token((lrow, lse), (qrow, qlse), (lam, dids, dmu), T2D, V,
                       (NOISE + b * V, SEED), b, temp, lanes, TILE, HAS_NOISE)
    tl.store(BONUS + b, last)
    tl.store(CUR + b, cur)
    tl.store(NACC + b, n_acc)
