"""drafter.decoding.rejection: the walk over the draft vocab's support makes the direct form's
decisions (the recursive rejection sampling that rewrote [B, V] rows per sibling, kept here as
the reference) under the same uniforms: the same accepted nodes and counts and the same last
token, over trees, chains, a draft vocab smaller than the target's and a draft distribution with
zeros. The Triton kernels (the walk, the sampled expansion) make the PyTorch forms' decisions
under the same uniforms, in Triton's interpreter on the CPU and compiled on a GPU (`-m gpu`),
and their own Philox draws follow the distribution; triton_helpers' search keys give back what
they pack, in the floats' order. tests/test_sampling_exact.py holds the whole decoder to the
target's distribution."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from drafter.decoding import rejection
from drafter.decoding.rejection import DraftQ, gumbel
from drafter.decoding.tree import (TreeSpec, _path, ancestors, build_tree, children_table,
                                 sampled_children, verify_chain_sample, verify_sample)

pytestmark = pytest.mark.usefixtures("one_thread")

try:  # triton_helpers' keys and Gumbel noise alone, for check_keys (no Triton: never called)
    import triton
    import triton.language as tl

    from drafter.decoding import triton_helpers as th

    @triton.jit
    def keys_kernel(X, IDX, U, KEYS, BACK_X, BACK_I, G, N: tl.constexpr, LAST: tl.constexpr):
        n = tl.arange(0, N)
        key = th.pack_key(tl.load(X + n), tl.load(IDX + n), LAST)
        tl.store(KEYS + n, key)
        tl.store(BACK_X + n, th.key_float(key))
        tl.store(BACK_I + n, th.key_index(key, LAST))
        tl.store(G + n, th.gumbel(tl.load(U + n)))
except ImportError:
    th = keys_kernel = None


# ------------------------------------------------------------- the direct forms (the reference)
def direct_tree(tokens, parent_full, valid, depth_full, anc, logits, q, dist, temperature, D, k,
                u, noise):
    """The tree's recursive rejection sampling over [B, V] rows: q [B, E, V] the draft
    probabilities in the target vocab, tokens target ids; u [B, D, k] and noise [B, V] the
    uniforms (acceptance test of sibling r at depth i: u[:, i, r])."""
    B, N = tokens.shape
    dev = tokens.device
    p_all = F.softmax(logits.float() / temperature, dim=-1)
    par = parent_full[:, 1:]
    earlier = torch.ones(N, N, dtype=torch.bool, device=dev).tril(-1)
    rank = ((par[:, :, None] == par[:, None, :]) & earlier).sum(-1)
    rows = torch.arange(B, device=dev)
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    p = p_all[:, 0]
    q_now = q[rows, dist[:, 0].clamp(min=0)]
    tiny = torch.finfo(torch.float32).tiny
    for depth in range(D):
        found = torch.zeros_like(alive)
        nxt = cur
        for r in range(k):
            is_c = (par == cur[:, None]) & (rank == r) & valid
            c = is_c.int().argmax(1)
            tok = tokens.gather(1, c[:, None])
            pt, qt = p.gather(1, tok).squeeze(1), q_now.gather(1, tok).squeeze(1)
            live = is_c.any(1) & alive & ~found
            ok = live & (u[:, depth, r] * qt < pt)
            rej = live & ~ok
            found, nxt = found | ok, torch.where(ok, c + 1, nxt)
            res = (p - q_now).clamp(min=0)
            s = res.sum(-1, keepdim=True)
            p = torch.where(rej[:, None], torch.where(s > 0, res / s.clamp(min=tiny), p), p)
            q2 = q_now.scatter(1, tok, 0.0)
            s2 = q2.sum(-1, keepdim=True)
            q_now = torch.where(rej[:, None], q2 / s2.clamp(min=tiny), q_now)
        alive = alive & found
        cur = torch.where(alive, nxt, cur)
        p = torch.where(alive[:, None], p_all[rows, cur], p)
        q_now = torch.where(alive[:, None], q[rows, dist.gather(1, cur[:, None]).squeeze(1)
                                               .clamp(min=0)], q_now)
    bonus = (torch.log(p) + gumbel(noise)).argmax(-1)
    n_acc = depth_full.gather(1, cur[:, None]).squeeze(1)
    return _path(anc, cur, depth_full, D), n_acc, bonus


def direct_chain(tokens, logits, q_tok, q_row, temperature, u, noise):
    """The chain's rejection sampling over [B, V] rows: q_tok [B, K] each draft's probability,
    q_row(n) [B, V] the draft distribution at position n; u [B, K], noise [B, V]."""
    B, K = tokens.shape
    p = F.softmax(logits.float() / temperature, dim=-1)
    p_tok = p[:, :K].gather(2, tokens[..., None]).squeeze(2)
    ok = u * q_tok < p_tok
    n_acc = ok.long().cumprod(1).sum(1)
    p_n = p.gather(1, n_acc[:, None, None].expand(B, 1, p.shape[-1])).squeeze(1)
    res = (p_n - q_row(n_acc.clamp(max=K - 1))).clamp(min=0)
    s = res.sum(-1, keepdim=True)
    rejected = (n_acc < K)[:, None] & (s > 0)
    dist = torch.where(rejected, res / s.clamp(min=torch.finfo(torch.float32).tiny), p_n)
    return n_acc, (torch.log(dist) + gumbel(noise)).argmax(-1)


def sampled_tree(seed: int, spec: TreeSpec, B: int = 256, V: int = 100, Vd: int = 64,
                 temperature: float = 0.9, zeros: bool = False):
    """A sampled tree over a draft vocab of Vd target ids (a random injective map; Vd = V: the
    identity), its drafter a table of logits (`zeros`: a third of each row -inf), and target
    logits near the draft's rows on the support (acceptance frequent, rejections too), with
    the uniforms both forms read. -> (tree, parent_full, depth_full, anc, logits, t_ids, u,
    noise)."""
    g = torch.Generator().manual_seed(seed)
    t_ids = torch.randperm(V, generator=g)[:Vd] if Vd < V else torch.arange(V)
    table = torch.randn(min(V, 97), Vd, generator=g) * 2
    if zeros:
        table[:, ::3] = float("-inf")
    root = torch.randn(B, Vd, generator=g) * 2
    torch.manual_seed(seed)
    d = build_tree(root, lambda i, ids, parent: table[t_ids[ids] % len(table)], spec,
                   temperature)
    N = d.tokens.shape[1]
    pf = torch.cat([torch.zeros(B, 1, dtype=torch.long), d.parent], 1)
    df = torch.cat([torch.zeros(B, 1, dtype=torch.long), d.depth], 1)
    logits = torch.randn(B, N + 1, V, generator=g) * 2
    own = d.q.rows.gather(1, d.dist.clamp(min=0)[..., None].expand(B, N + 1, Vd))
    near = own.nan_to_num(neginf=-8.0) + 0.7 * torch.randn(B, N + 1, Vd, generator=g)
    logits[..., t_ids] = torch.where((d.dist >= 0)[..., None], near, logits[..., t_ids])
    u = torch.rand(B, spec.depth, spec.topk, generator=g)
    noise = torch.rand(B, V, generator=g)
    return d, pf, df, ancestors(pf, spec.depth), logits, t_ids, u, noise


TREES = [TreeSpec(3, 3, 8), TreeSpec(4, 4, 20), TreeSpec(2, 6, 12), TreeSpec.chain(4)]


@pytest.mark.parametrize("spec", TREES, ids=[t.label() for t in TREES])
@pytest.mark.parametrize("vocab", ["subset", "identity", "zeros"])
def test_the_walk_makes_the_direct_forms_decisions(spec, vocab):
    """verify_sample (the walk over the support) against the direct form over [B, V] rows,
    the same uniforms in: the same path, accepted count and last token in every row, over
    several trees; deep walks and early stops both occur."""
    total = torch.zeros(spec.depth + 1, dtype=torch.long)
    for seed in range(3):
        d, pf, df, anc, logits, t_ids, u, noise = sampled_tree(
            seed, spec, Vd=100 if vocab == "identity" else 64, zeros=vocab == "zeros")
        B, V = logits.shape[0], logits.shape[-1]
        qv = torch.zeros(B, d.q.rows.shape[1], V).index_copy_(2, t_ids, d.q.logq().exp())
        want = direct_tree(t_ids[d.tokens], pf, d.valid, df, anc, logits, qv, d.dist, 0.9,
                           spec.depth, spec.topk, u, noise)
        got = verify_sample(d.tokens, pf, d.valid, df, anc, logits, d.q, d.dist, t_ids, 0.9,
                            spec.depth, spec.topk, u=u, noise=noise)
        for name, a, b in zip(("path", "n_acc", "last token"), want, got):
            assert torch.equal(a, b), f"seed {seed}: {name} differs in rows " \
                f"{(a != b).reshape(B, -1).any(1).nonzero().flatten()[:8].tolist()}"
        total += torch.bincount(got[1], minlength=spec.depth + 1)
    assert total[0] > 0 and total[2:].sum() > 0, total.tolist()


def test_the_chain_walk_makes_the_direct_chains_decisions():
    """verify_chain_sample (the walk with one child a node) against Leviathan et al.'s
    rejection sampling over [B, V] rows, the same uniforms in, the draft vocab a subset."""
    g = torch.Generator().manual_seed(3)
    B, K, V, Vd, T = 512, 4, 90, 50, 0.8
    t_ids = torch.randperm(V, generator=g)[:Vd]
    rows = torch.randn(B, K, Vd, generator=g) * 2
    q = DraftQ(rows, torch.logsumexp(rows / T, -1), T)
    tokens = (q.logq() + gumbel(torch.rand(B, K, Vd, generator=g))).argmax(-1)    # [B, K]
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    logits[:, :K, t_ids] = rows + 0.5 * torch.randn(B, K, Vd, generator=g)
    u, noise = torch.rand(B, K, generator=g), torch.rand(B, V, generator=g)
    qv = torch.zeros(B, K, V).index_copy_(2, t_ids, q.logq().exp())                # [B, K, V]
    want = direct_chain(t_ids[tokens], logits, qv.gather(2, t_ids[tokens][..., None])[..., 0],
                        lambda n: qv[torch.arange(B), n], T, u, noise)
    got = verify_chain_sample(tokens, logits, q, t_ids, T, u=u[..., None], noise=noise)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    hist = torch.bincount(got[0], minlength=K + 1)
    assert hist[0] > 0 and hist[K] > 0, hist.tolist()


def test_children_table_lists_each_nodes_valid_children_in_draw_order():
    parent_full = torch.tensor([[0, 0, 0, 1, 1, 2, 0]])       # nodes 1..6; node 6 a 3rd root child
    valid = torch.tensor([[True, True, True, True, True, False]])
    table = children_table(parent_full, valid, 3)
    assert table[0].tolist() == [[1, 2, -1], [3, 4, -1], [5, -1, -1]] + [[-1, -1, -1]] * 4


# ------------------------------------------------------------------------ the Triton kernels
def _kernel_cases():
    """(walk_torch's arguments) for the kernel checks: trees and a chain, a subset vocab; and a
    chain as verify_chain_sample lays it out (children and dist one row for every row: batch
    stride 0), its logits and draft rows views into wider tensors (strides not their shapes')."""
    for seed, spec in ((0, TreeSpec(3, 3, 8)), (1, TreeSpec(4, 2, 10)), (2, TreeSpec.chain(3))):
        d, pf, df, anc, logits, t_ids, u, noise = sampled_tree(seed, spec, B=24,
                                                               zeros=seed == 1)
        yield (logits, d.tokens, children_table(pf, d.valid, spec.topk), d.dist, d.q, t_ids,
               0.9, u, noise)
    g = torch.Generator().manual_seed(3)
    B, K, V, Vd, T = 24, 4, 100, 64, 0.9
    t_ids = torch.randperm(V, generator=g)[:Vd]
    rows = (torch.randn(B, K + 1, Vd, generator=g) * 2)[:, :K]                    # [B, K, Vd]
    q = DraftQ(rows, torch.logsumexp(rows / T, -1), T)
    tokens = (q.logq() + gumbel(torch.rand(B, K, Vd, generator=g))).argmax(-1)
    logits = (torch.randn(B, K + 2, V, generator=g) * 2)[:, :K + 1]               # [B, K+1, V]
    logits[:, :K, t_ids] = rows + 0.5 * torch.randn(B, K, Vd, generator=g)
    children, dist = rejection.chain_layout(K, "cpu")
    yield (logits, tokens, children.expand(B, K + 1, 1), dist.expand(B, K + 1), q, t_ids, T,
           torch.rand(B, K, 1, generator=g), torch.rand(B, V, generator=g))


def check_walk_kernel(cases, exact=True):
    """walk_triton makes walk_torch's decisions on each case (the same uniforms): in every row
    (`exact`: the interpreter's numpy exp and log), else in all but a row or two in 32
    (compiled, Triton's exp and log are the GPU's approximate ones: a draw within rounding of a
    threshold may go the other way)."""
    for args in cases:
        want = rejection.walk_torch(*args)
        got = rejection.walk_triton(*args)
        same = torch.stack([(a == b).cpu() for a, b in zip(want, got)]).all(0)      # [B]
        assert (~same).sum() <= (0 if exact else max(2, len(same) // 32)), \
            (~same).nonzero().flatten().tolist()


def check_children_kernel(cases, exact=True):
    """sampled_children's kernel draws the eager form's ids, with its scores and log-sum-exp,
    from the same uniforms (`exact` as check_walk_kernel's)."""
    for x, k in cases:
        u = torch.rand(x.shape, device=x.device)
        ids, sc, lse = sampled_children(x, k, 0.7, fused=False, noise=u)
        ids2, sc2, lse2 = sampled_children(x, k, 0.7, fused=True, noise=u)
        same = (ids == ids2).all(-1).flatten()
        assert (~same).sum() <= (0 if exact else max(2, len(same) // 32)), (~same).sum()
        assert (sc - sc2).abs().max() < 1e-4 and (lse - lse2).abs().max() < 1e-4


def _children_cases(dev="cpu"):
    """Rows the chunked search takes: bf16 and float32, 2-D and 3-D, a third at -inf, k 1..8."""
    torch.manual_seed(0)
    x = torch.randn(6, 4096, device=dev) * 3
    x[0, ::3] = float("-inf")
    yield x.bfloat16(), 4
    yield torch.randn(2, 3, 4096, device=dev) * 3, 8
    yield (torch.randn(3, 32000, device=dev) * 3).bfloat16(), 8
    yield x, 1


def check_keys(dev="cpu"):
    """triton_helpers: pack_key's keys, sorted, give the floats largest first (a NaN above +inf)
    and equal floats by index, the lowest first; key_float and key_index give back the float's
    bits and the index; TAKEN lies below every key; its gumbel is noise.gumbel. Indices as the
    two searches pack them: int32 chunks (last NC - 1) and int64 columns (last INDEX_MAX)."""
    g = torch.Generator().manual_seed(0)
    special = [float("-inf"), float("inf"), float("nan"), -0.0, 0.0, 1e-45, -1e-45, 3.4e38,
               -3.4e38, 1.0, -1.0]
    x = torch.cat([torch.tensor(special), (torch.randn(117, generator=g) * 2).round()])  # ties
    x = x[torch.randperm(128, generator=g)].to(dev)
    u = torch.cat([torch.tensor([0.0, 1e-30, 1e-20, 0.5, 1 - 2 ** -24, 1 - 1e-7]),
                   torch.rand(122, generator=g)]).to(dev)
    for last, idx in ((127, torch.randperm(128, generator=g).int()),
                      (th.INDEX_MAX.value, torch.randint(0, 2 ** 31, (128,), generator=g))):
        idx = idx.to(dev)
        keys = torch.empty(128, dtype=torch.long, device=dev)
        back_x, back_i, noise = torch.empty_like(x), torch.empty_like(idx), torch.empty_like(u)
        keys_kernel[(1,)](x, idx, u, keys, back_x, back_i, noise, N=128, LAST=last)
        assert torch.equal(back_x.view(torch.int32), x.view(torch.int32))
        assert torch.equal(back_i, idx)
        assert (keys > th.TAKEN.value).all()
        order = keys.argsort(descending=True)
        xs, bits, ids = x[order], x[order].view(torch.int32), idx[order]
        assert xs[0].isnan() and (xs[1:-1] >= xs[2:]).all(), xs.tolist()
        tie = bits[:-1] == bits[1:]
        assert tie.any() and (ids[:-1] < ids[1:])[tie].all()
        assert noise.isfinite().all() and torch.allclose(noise, gumbel(u), rtol=1e-5, atol=1e-5)


def check_philox_draws(dev="cpu", rows=400):
    """The kernels' own noise: first draws follow softmax(x / T), second draws the rest
    (without replacement), within sampling error."""
    hot = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5], device=dev)
    x = torch.full((rows, 4096), float("-inf"), device=dev)
    x[:, 100:105] = hot
    ids, _, _ = sampled_children(x, 2, 0.7, fused=True)
    p = torch.softmax(hot / 0.7, 0)
    first = torch.bincount(ids[:, 0] - 100, minlength=5).float() / rows
    assert (first - p).abs().max() < 4.5 * (0.25 / rows) ** 0.5, first
    assert (ids[:, 0] != ids[:, 1]).all() and ((ids >= 100) & (ids < 105)).all()
    # the walk's last token at a root without children: a draw from p (V = 10, 3 draftable)
    logits = torch.cat([hot, hot], 0).repeat(rows, 1)[:, None]                   # [rows, 1, 10]
    q = DraftQ(torch.zeros(rows, 1, 3, device=dev), torch.zeros(rows, 1, device=dev), 0.7)
    _, n_acc, last = rejection.walk_triton(
        logits, torch.zeros(rows, 0, dtype=torch.long, device=dev),
        torch.full((rows, 1, 1), -1, device=dev), torch.zeros(rows, 1, dtype=torch.long,
                                                               device=dev),
        q, torch.tensor([0, 4, 7], device=dev), 0.7, torch.rand(rows, 1, 1, device=dev))
    freq = torch.bincount(last % 5, minlength=5).float() / rows
    assert (n_acc == 0).all() and (freq - p).abs().max() < 4.5 * (0.25 / rows) ** 0.5, freq


def test_kernels_in_the_interpreter():
    """The walk and sampled-expansion kernels run by Triton's interpreter on the CPU (skipped
    without Triton; the GPU test runs them compiled): the PyTorch forms' decisions from the
    same uniforms, and their own Philox draws follow the distribution; the search keys'
    round trip (check_keys)."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        from tests.test_rejection import (_children_cases, _kernel_cases, check_children_kernel,
                                          check_keys, check_philox_draws, check_walk_kernel)
        check_keys()
        check_walk_kernel(_kernel_cases())
        check_children_kernel(_children_cases())
        check_philox_draws()
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_on_the_gpu():
    """The kernels compiled, at evaluate's shapes too: a 6/8/48 tree over 64 rows of a
    49,152-token target with a 32,000-token draft vocab (bf16 logits), the frontier's
    [64, 8, 32000] expansion; and their Philox draws."""
    pytest.importorskip("triton")
    check_walk_kernel([_to(args, "cuda") for args in _kernel_cases()], exact=False)
    spec, B, V, Vd = TreeSpec(6, 8, 48), 64, 49152, 32000
    d, pf, df, anc, logits, t_ids, u, noise = sampled_tree(0, spec, B=B, V=V, Vd=Vd)
    big = (logits.bfloat16(), d.tokens, children_table(pf, d.valid, spec.topk), d.dist,
           DraftQ(d.q.rows.bfloat16(), torch.logsumexp(d.q.rows.bfloat16().float() / 0.9, -1),
                  0.9), t_ids, 0.9, u, noise)
    check_walk_kernel([_to(big, "cuda")], exact=False)
    check_children_kernel(list(_children_cases("cuda"))
                          + [((torch.randn(64, 8, 32000, device="cuda") * 3).bfloat16(), 8)],
                          exact=False)
    check_philox_draws("cuda", rows=20000)
    check_keys("cuda")


def _to(args, dev):
    return tuple(DraftQ(a.rows.to(dev), a.lse.to(dev), a.temperature) if isinstance(a, DraftQ)
                 else a.to(dev) if torch.is_tensor(a) else a for a in args)
