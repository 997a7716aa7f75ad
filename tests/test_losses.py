"""The loss unit (drafter/train/losses.py): every kind's analytic gradient against autograd through
its reference, for dense and top-k teachers and at greedy, sub-1, 1 and above-1 temperatures;
today's soft cross-entropy bit for bit; the acceptance metrics against their definition; the
greedy surrogate; D-PACE's weights against their definition and, with nla, against the gradient of
the expected acceptance length; the fused lm_head path against the exact one; the config's keys."""
from __future__ import annotations

import itertools

import pytest
import torch

from drafter.core import config as C
from drafter.core.configload import ConfigError
from drafter.features import store
from drafter.train import losses as L

VD, K_TOP = 40, 6


def teachers(c: int, seed: int = 0):
    """(logits z [c, VD], dense teacher log-probs, top-k (ids, logp), the top-k densified)."""
    g = torch.Generator().manual_seed(seed)
    z = 2 * torch.randn(c, VD, generator=g)
    full = (3 * torch.randn(c, VD, generator=g)).log_softmax(-1)
    v, i = full.topk(K_TOP, -1)
    lp = v.half().float()                                        # as the store keeps them
    dense_k = store.teacher_logprobs({"teacher_topk_ids": i, "teacher_topk_logp": lp}, VD)
    return z, full, (i, lp), dense_k


CASES = [(k, T) for k in L.KINDS for T in ((0.0,) if k == "ce" else (0.0, 0.7, 1.0, 1.5))]


@pytest.mark.parametrize("kind, T", CASES, ids=[f"{k}-T{T:g}" for k, T in CASES])
@pytest.mark.parametrize("teacher", ["dense", "topk"])
def test_analytic_gradient_equals_autograd(kind, T, teacher):
    """chunk_stats' gradient with respect to the logits (times the row weights) and its per-row
    value equal autograd through `reference` on the same teacher (the top-k one densified as
    store.teacher_logprobs reads it)."""
    z, full, (ids, lp), dense_k = teachers(11)
    w = torch.rand(11, generator=torch.Generator().manual_seed(9))
    key = (((kind, 0.7, T, 3.0),), ())
    ref_t, ids_, tl = (full, None, full) if teacher == "dense" else (dense_k, ids, lp)
    zz = z.clone().requires_grad_(True)
    value = L.reference(zz, ref_t, key)
    (grad,) = torch.autograd.grad((w * value).sum(), [zz])
    g, val, *_ = L.chunk_stats(z, ids_, tl, w, torch.float32, key)
    assert torch.allclose(val, value, atol=2e-6, rtol=1e-5)
    assert torch.allclose(g, grad, atol=1e-6, rtol=1e-4)
    assert g.abs().max() > 1e-3                                  # not vacuous


def test_a_mixture_is_the_weighted_sum_of_its_terms():
    z, full, _, _ = teachers(7, 1)
    w = torch.ones(7)
    terms = (("ce", 0.1, 0.0, 3.0), ("tv", 0.9, 1.0, 3.0), ("lk", 0.4, 0.7, 2.0))
    g, val, *_ = L.chunk_stats(z, None, full, w, torch.float32, (terms, ()))
    parts = [L.chunk_stats(z, None, full, w, torch.float32, ((t,), ())) for t in terms]
    assert torch.allclose(val, sum(p[1] for p in parts), atol=1e-6)
    assert torch.allclose(g, sum(p[0] for p in parts), atol=1e-7)


def test_the_default_is_the_soft_cross_entropy_bit_for_bit():
    """The default key runs today's soft cross-entropy's operations: the same bits as the
    formula trained with before the loss was a choice (dense and top-k teachers)."""
    z, full, (ids, lp), _ = teachers(13, 2)
    w = torch.rand(13)
    for i, tl in ((None, full), (ids, lp)):
        g, val, ce, correct, accept, accept_t = L.chunk_stats(z, i, tl, w)
        lse = z.logsumexp(-1, keepdim=True)
        q = (z - lse).exp()
        p = tl.exp()
        if i is None:
            P = p.sum(-1, keepdim=True)
            ce0 = (P * lse).squeeze(-1) - (p * z).sum(-1)
            g0 = (P * q - p) * w[:, None]
        else:
            pt = (1.0 - p.sum(-1, keepdim=True)).clamp_min(0.0).clamp_min(L.TINY) / (VD - K_TOP)
            zk = z.gather(-1, i)
            P = p.sum(-1, keepdim=True) + (VD - K_TOP) * pt
            ce0 = (P * lse).squeeze(-1) - ((p * zk).sum(-1) + pt.squeeze(-1)
                                            * (z.sum(-1) - zk.sum(-1)))
            g0 = ((P * q - pt) * w[:, None]).scatter_add(-1, i, -(p - pt) * w[:, None])
        assert torch.equal(g, g0) and torch.equal(val, ce0) and torch.equal(ce, ce0)
        assert accept_t.shape == (13, 0)


@pytest.mark.parametrize("teacher", ["dense", "topk"])
def test_acceptance_metrics_are_the_rejection_sampling_acceptance(teacher):
    """accept: Σ min(p, q) at T = 1; accept_t: the same of softmax(z/T) and softmax(log p/T)
    renormalised at each metric temperature; correct: the argmaxes match (T = 0)."""
    z, full, (ids, lp), dense_k = teachers(9, 3)
    ref_t, ids_, tl = (full, None, full) if teacher == "dense" else (dense_k, ids, lp)
    _, _, _, correct, accept, accept_t = L.chunk_stats(
        z, ids_, tl, torch.ones(9), torch.float32, (L.DEFAULT.key[0], (0.5, 0.7, 1.5)))
    assert torch.allclose(accept, torch.minimum(ref_t.exp(), z.softmax(-1)).sum(-1), atol=1e-6)
    for j, T in enumerate((0.5, 0.7, 1.5)):
        want = torch.minimum((ref_t / T).softmax(-1), (z / T).softmax(-1)).sum(-1)
        assert torch.allclose(accept_t[:, j], want, atol=1e-6), T
    assert torch.equal(correct, (z.argmax(-1) == ref_t.argmax(-1)).float())
    # a colder temperature sharpens both distributions: acceptance differs from T = 1's
    assert (accept_t[:, 0] - accept).abs().max() > 0.01


def test_greedy_surrogate():
    """T = 0: the teacher one-hot at its argmax a, the draft at temperature 1: α = q(a), tv is
    1 - q(a), kl and ce are the hard-label cross-entropy, nla -log(q(a) + epsilon)."""
    z, full, _, _ = teachers(8, 4)
    q, a = z.softmax(-1), full.argmax(-1)
    qa = q.gather(-1, a[:, None]).squeeze(-1)
    hard = torch.nn.functional.cross_entropy(z, a, reduction="none")
    one = torch.ones(8)

    def value(kind):
        return L.chunk_stats(z, None, full, one, torch.float32, (((kind, 1.0, 0.0, 3.0),), ()))[1]
    assert torch.allclose(value("tv"), 1 - qa, atol=1e-6)
    for kind in ("kl", "ce"):
        assert torch.allclose(value(kind), hard, atol=1e-5)
    assert torch.allclose(value("nla"), -(qa + L.NLA_EPS).log(), atol=1e-5)
    assert (value("nla") - hard).abs().max() < 2e-3            # where q(a) is near the epsilon
    assert torch.allclose(L.acceptance(z, full, 0.0), qa, atol=1e-6)


@pytest.mark.parametrize("kind", ["tv", "nla", "lk"])
def test_a_step_against_the_gradient_raises_the_acceptance(kind):
    """A small step of the logits against the loss's gradient raises the acceptance at the
    loss's temperature on every row (these losses target the acceptance itself)."""
    z, full, _, _ = teachers(6, 5)
    for T in (0.7, 1.0):
        key = (((kind, 1.0, T, 3.0),), (T,))
        g, _, _, _, accept, accept_t = L.chunk_stats(z, None, full, torch.ones(6),
                                                      torch.float32, key)
        before = accept_t[:, 0]
        after = L.chunk_stats(z - 0.05 * g / g.norm(dim=-1, keepdim=True), None, full,
                              torch.ones(6), torch.float32, key)[5][:, 0]
        assert (after > before).all(), (kind, T)


def test_dpace_weights_match_their_definition():
    g = torch.Generator().manual_seed(6)
    G, K, alpha = 5, 4, 0.3
    cells = [(gr, k) for gr in range(G) for k in range(K)]
    keep = torch.rand(len(cells), generator=g) > 0.25            # some positions not in the loss
    rows = [c for c, m in zip(cells, keep) if m]
    group = torch.tensor([r[0] for r in rows])
    pos = torch.tensor([r[1] for r in rows])
    conf = torch.rand(len(rows), generator=g)
    w = L.dpace_weights(conf, group, pos, G, K, alpha)
    a = {(int(gr), int(k)): (1 - alpha) * float(c) + alpha for gr, k, c in zip(group, pos, conf)}
    for n, (gr, k) in enumerate(rows):
        want = 0.0
        for j in range(k, K):
            if (gr, j) in a:
                want += float(torch.tensor([a.get((gr, i), 1.0) for i in range(j + 1)]).prod())
        assert abs(float(w[n]) - want) < 1e-5


def test_dpace_with_nla_is_the_gradient_of_the_expected_acceptance_length():
    """alpha 0: rows of G chains of K positions, each accepted with α_i; the chain's expected
    acceptance length is 1 + Σ_j Π_{i<=j} α_i. Minimising Σ w_i·(-log α_i) with D-PACE's
    (constant) weights w moves the logits exactly along its gradient."""
    G, K = 3, 4
    z, full, _, _ = teachers(G * K, 7)
    group = torch.arange(G).repeat_interleave(K)
    pos = torch.arange(K).repeat(G)
    key = ((("nla", 1.0, 1.0, 3.0),), ())
    conf = L.acceptance(z, full, 1.0)
    w = L.dpace_weights(conf, group, pos, G, K, alpha=0.0)
    g = L.chunk_stats(z, None, full, w, torch.float32, key)[0]
    zz = z.clone().requires_grad_(True)
    alpha = torch.minimum(full.exp(), zz.softmax(-1)).sum(-1).view(G, K)
    tau = (1 + alpha.cumprod(-1).sum(-1)).sum()
    (dtau,) = torch.autograd.grad(tau, [zz])
    assert torch.allclose(-g, dtau, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("teacher", ["dense", "topk"])
def test_fused_head_loss_equals_the_exact_one_for_every_kind(teacher):
    """lm_head + loss in chunks (gradients formed in the forward) == materialised logits and
    autograd through the reference, for a sum of every kind under D-PACE weights."""
    g = torch.Generator().manual_seed(8)
    N, H, M = 29, 12, 17
    hn = torch.randn(N, H, generator=g, requires_grad=True)
    head = torch.randn(VD, H, generator=g, requires_grad=True)
    full = (3 * torch.randn(M, VD, generator=g)).log_softmax(-1)
    v, i = full.topk(K_TOP, -1)
    lp = v.half().float()
    dense = {"logp": full if teacher == "dense" else store.teacher_logprobs(
        {"teacher_topk_ids": i, "teacher_topk_logp": lp}, VD)}
    t = dense if teacher == "dense" else {"ids": i, "logp": lp}
    trows, w = torch.randint(0, M, (N,), generator=g), torch.rand(N, generator=g)
    obj = L.Objective(tuple(L.Term(k, 0.3 + j * 0.2, T) for j, (k, T) in enumerate(
        [("ce", 0.0), ("kl", 0.7), ("tv", 1.0), ("nla", 1.5), ("lk", 0.7)])), "dpace", 0.4,
        (0.7,))
    chains = (torch.arange(N) % 10, torch.arange(N) // 10, 10, 3)
    ref = L.head_loss(hn, head, dense, trows, w, fused=False, obj=obj, chains=chains)
    got = L.head_loss(hn, head, t, trows, w, fused=True, chunk=8, obj=obj, chains=chains)
    for key in ("loss", "value", "ce", "correct", "accept", "accept_t"):
        assert torch.allclose(ref[key], got[key], atol=1e-5, rtol=1e-5), key
    gr = torch.autograd.grad(ref["loss"], [hn, head])
    gg = torch.autograd.grad(got["loss"], [hn, head])
    for a, b in zip(gr, gg):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_objective_from_the_config():
    cfg = C.load(None, ["train.loss=[{kind: ce, weight: 0.1}, {kind: tv, weight: 0.9}]",
                        "evaluate.temperatures=[0.0, 0.7]", "train.position_weight=dpace"])
    obj = L.objective(cfg)
    assert [(t.kind, t.weight, t.temperature) for t in obj.terms] == [("ce", 0.1, 0.0),
                                                                      ("tv", 0.9, 1.0)]
    assert obj.temperatures == (0.7,) and obj.position == "dpace"
    assert obj.describe() == "0.1·ce + 0.9·tv@T1, dpace (alpha 0.5)"
    assert L.objective(C.load(None, [])) == L.DEFAULT                # the default: today's
    for bad in ("train.loss=[]", "train.loss=[{kind: tv, weight: 0}]",
                "train.loss=[{kind: ce, temperature: 1}]", "train.loss=[{kind: kl2}]",
                "train.noise=-1", "train.dpace_alpha=2"):
        with pytest.raises(ConfigError):
            C.load(None, [bad])


def test_chunk_stats_keys_are_plain_constants():
    """The key a compiled chunk specialises on (and aot's saved graphs are keyed by): tuples of
    str and float only, equal for equal objectives."""
    obj = L.Objective((L.Term("tv", 0.9, 0.7), L.Term("ce", 0.1, 0.0)), temperatures=(0.7,))
    flat = list(itertools.chain.from_iterable(obj.key[0])) + list(obj.key[1])
    assert all(isinstance(x, (str, float)) for x in flat)
    assert obj.key == L.Objective(obj.terms, temperatures=(0.7,)).key != L.DEFAULT.key
