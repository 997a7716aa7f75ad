"""The drafter's training loss: its kinds, their parsing from the config, the per-row chunk
function that turns rows of logits, teacher rows and row weights into the gradient, the loss and
the metrics, and lm_head fused with it over any rows (`head_loss`). Nothing here knows the TTT
unroll: drafter/train/ttt.py calls `head_loss` on its rows; a block drafter calls it on its own.

    obj = objective(cfg)                 # train.loss, position weighting, metric temperatures
    obj = Objective((Term("kl", 0.1), Term("tv", 0.9)))     # or built directly (BLOCK)
    out = head_loss(hn, lm_head.weight, teacher, trows, w, fused, chunk, obj)   # a dict
    g, value, ce, correct, accept, accept_t = chunk_stats(z, ids, tl, w, torch.float32, obj.key)

Shapes: N rows, c rows of one chunk, Vd draft vocab, k the top-k teacher's width, m the metric
temperatures other than 0 and 1. `tl` is the teacher's log-probs over the draft vocab: dense
[c, Vd] (store.teacher_logprobs), or top-k [c, k] at draft ids `ids` [c, k] whose remaining
mass is spread evenly over the other Vd - k ids, as store.teacher_logprobs reads it.

A loss is a weighted sum of terms; each term compares the draft's distribution q_T =
softmax(z / T) with the teacher's at the same serving temperature T, p_T = softmax(log p / T)
renormalised (at T = 1 the teacher as stored). Rejection sampling at T accepts a draft with
probability α_T = Σ min(p_T, q_T) = 1 - TV(p_T, q_T). Kinds (docs/train.md, "The loss"):

    kl    soft cross-entropy to p_T (KL(p_T || q_T) + H(p_T): KL's gradient); the default, at T = 1
    ce    hard-label cross-entropy to the teacher's argmax (kl at T = 0)
    tv    1 - α_T: the rejection probability itself
    nla   -log(α_T + 1e-6): tv's optimum with a 1/α gradient, which trains from a cold start
    lk    λ·KL + (1 - λ)·TV with λ = exp(-eta·α_T), α_T held constant (LK losses, hybrid)

T = 0 (greedy serving) accepts a draft when argmaxes match, a step function. Its surrogate: the
teacher one-hot at its argmax a, the draft at temperature 1: α_0 = q(a), so tv is 1 - q(a), nla
and kl are the hard-label cross-entropy, and each is smallest where the draft's argmax is a.

Each kind's gradient with respect to the logits is written out (`chunk_stats`) and equals
autograd through `reference` (tests/test_losses.py), so the fused path forms it in the forward
without [N, Vd] logits, as drafter/train/ttt.py's design wants. With α = Σ_v min(p_v, q_v) and
S = {v : q_v < p_v}: dα/du_j = q_j (1[j ∈ S] - Σ_{v ∈ S} q_v) for u = z / T.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

KINDS = ("kl", "ce", "tv", "nla", "lk")
NLA_EPS = 1e-6  # keeps -log(α) finite (and its gradient bounded) where α underflows
TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class Term:
    kind: str = "kl"
    weight: float = 1.0
    temperature: float = 1.0
    eta: float = 3.0  # lk only: λ = exp(-eta·α); 3 is the LK paper's best hybrid


@dataclass(frozen=True)
class Objective:
    """What training minimises and what its log shows. terms: summed by weight per row;
    position: "decay" (the caller's row weights, train.ttt_decay**step) or "dpace" (weights from
    the rows' acceptance, `dpace_weights`); temperatures: the served temperatures whose
    acceptance the metrics show besides T = 0 (acc) and T = 1 (accept)."""
    terms: tuple[Term, ...] = (Term(),)
    position: str = "decay"
    dpace_alpha: float = 0.5
    temperatures: tuple[float, ...] = ()

    @property
    def key(self) -> tuple:
        """The plain constants `chunk_stats` takes (a compiled chunk specialises on them, and
        drafter/train/aot.py's saved graphs are keyed by them)."""
        return (tuple((t.kind, t.weight, t.temperature, t.eta) for t in self.terms),
                self.temperatures)

    @property
    def confidence_temperature(self) -> float:
        """dpace's per-row acceptance is taken at the first term's temperature."""
        return self.terms[0].temperature

    def describe(self) -> str:
        """'kl@T1' or '0.1·ce + 0.9·tv@T1', plus ', dpace' when so weighted."""
        parts = []
        for t in self.terms:
            s = t.kind if t.kind == "ce" else f"{t.kind}@T{t.temperature:g}"
            parts.append(s if t.weight == 1 else f"{t.weight:g}·{s}")
        return " + ".join(parts) + (f", dpace (alpha {self.dpace_alpha:g})"
                                    if self.position == "dpace" else "")

    def to_dict(self) -> dict:
        return {"loss": [{"kind": t.kind, "weight": t.weight, "temperature": t.temperature,
                          **({"eta": t.eta} if t.kind == "lk" else {})} for t in self.terms],
                "position_weight": self.position,
                **({"dpace_alpha": self.dpace_alpha} if self.position == "dpace" else {}),
                "describe": self.describe()}


DEFAULT = Objective()
# The published block-drafter recipes' mixture (DSpark, DFlash: REFERENCES.md): the soft
# cross-entropy and total variation at T = 1, 0.1 and 0.9 (drafter/train/dspark_objective.py).
BLOCK = Objective((Term("kl", 0.1), Term("tv", 0.9)))


def objective(cfg) -> Objective:
    """The Objective of a config (train.loss, or when it is null the method's: DEFAULT for
    eagle3, BLOCK for the block drafters; train.position_weight, train.dpace_alpha; metrics at
    evaluate.temperatures and each term's temperature). The config's checks
    (drafter/core/configload.py) have already refused what this cannot build."""
    tc = cfg.train
    if tc.loss is None:
        terms = (DEFAULT if tc.method == "eagle3" else BLOCK).terms
    else:
        terms = tuple(Term(t.kind, float(t.weight),
                           0.0 if t.kind == "ce" else float(1.0 if t.temperature is None
                                                            else t.temperature),
                           float(t.eta)) for t in tc.loss)
    temps = {float(x) for x in cfg.evaluate.temperatures} | {t.temperature for t in terms}
    return Objective(terms, tc.position_weight, float(tc.dpace_alpha),
                     tuple(sorted(t for t in temps if t not in (0.0, 1.0))))


# ------------------------------------------------------------------------ the teacher at T
def _teacher(ids, tl, vd: int, T: float):
    """The teacher at temperature T as (ids, p, pt, P): dense (ids None, p [c, Vd], pt None) or
    sparse (ids [c, k], p [c, k] at them, pt [c, 1] at each other id), P [c, 1] its mass (or
    1.0). T = 1: as stored (today's numbers); T = 0: one-hot at the argmax (sparse, k = 1)."""
    if T == 0:
        a = tl.argmax(-1, keepdim=True)                                      # [c, 1]
        a = a if ids is None else ids.gather(-1, a)
        one = torch.ones_like(a, dtype=torch.float32)
        return a, one, torch.zeros_like(one), 1.0
    if ids is None:
        if T == 1:
            p = tl.exp()
            return None, p, None, p.sum(-1, keepdim=True)
        return None, (tl / T).softmax(-1), None, 1.0
    k = ids.shape[-1]
    p = tl.exp()
    rest = (1.0 - p.sum(-1, keepdim=True)).clamp_min(0.0)                    # [c, 1]
    pt = rest.clamp_min(TINY) / max(vd - k, 1)                               # [c, 1]
    if T == 1:
        return ids, p, pt, p.sum(-1, keepdim=True) + (vd - k) * pt
    a, at = tl / T, pt.log() / T                                             # [c, k], [c, 1]
    lse = torch.cat([a, at + math.log(max(vd - k, 1))], -1).logsumexp(-1, keepdim=True)
    return ids, (a - lse).exp(), (at - lse).exp(), 1.0


def _entropy(tl, ids, p, pt, vd: int, T: float):
    """H(p_T) [c]: what separates the soft cross-entropy from KL (lk's value only)."""
    if T == 0:
        return torch.zeros_like(p[:, 0])
    if ids is None:
        logp = tl if T == 1 else (tl / T).log_softmax(-1)
        return -(p * logp).sum(-1)
    return -torch.special.xlogy(p, p).sum(-1) - (vd - ids.shape[-1]) * \
        torch.special.xlogy(pt, pt).squeeze(-1)


# ------------------------------------------------------------------------ per-term pieces
def _ce(u, lse, q, t, s):
    """Soft cross-entropy P·lse(u) - Σ p·u [c] and its gradient (P·q - p) times s [c, 1]."""
    ids, p, pt, P = t
    if ids is None:
        return (P * lse).squeeze(-1) - (p * u).sum(-1), (P * q - p) * s
    uk = u.gather(-1, ids)                                                   # [c, k]
    pu = (p * uk).sum(-1) + pt.squeeze(-1) * (u.sum(-1) - uk.sum(-1))
    return (P * lse).squeeze(-1) - pu, ((P * q - pt) * s).scatter_add(-1, ids, -(p - pt) * s)


def _overlap(q, t, grad: bool = True):
    """α = Σ min(p, q) [c] and (grad) dα/du [c, Vd] (module docstring)."""
    ids, p, pt, _ = t
    if ids is None:
        alpha = torch.minimum(p, q).sum(-1)
        m = (q < p).float()
    else:
        qk = q.gather(-1, ids)                                               # [c, k]
        alpha = (torch.minimum(q, pt).sum(-1) - torch.minimum(qk, pt).sum(-1)
                 + torch.minimum(qk, p).sum(-1))
        m = (q < pt).float().scatter(-1, ids, (qk < p).float()) if grad else None
    if not grad:
        return alpha, None
    return alpha, q * (m - (q * m).sum(-1, keepdim=True))


class _Views:
    """The draft and the teacher at each temperature a chunk needs, each made once."""

    def __init__(self, z, ids, tl):
        self.z, self.ids, self.tl, self.vd = z, ids, tl, z.shape[-1]
        self.lse = z.logsumexp(-1, keepdim=True)                             # [c, 1]
        self.q = (z - self.lse).exp()                                        # [c, Vd]
        self._draft, self._teacher = {}, {}

    def draft(self, T: float):
        """(u, lse(u), softmax(u)) with u = z / T (the logits themselves at T = 0 and 1)."""
        if T in (0.0, 1.0):
            return self.z, self.lse, self.q
        if T not in self._draft:
            u = self.z / T
            lse = u.logsumexp(-1, keepdim=True)
            self._draft[T] = u, lse, (u - lse).exp()
        return self._draft[T]

    def teacher(self, T: float):
        if T not in self._teacher:
            self._teacher[T] = _teacher(self.ids, self.tl, self.vd, T)
        return self._teacher[T]


def chunk_stats(z, ids, tl, w, grad_dtype=torch.float32, key: tuple = DEFAULT.key):
    """One chunk of rows: z [c, Vd] draft logits, teacher ids/tl (module docstring), w [c] row
    weights, key an Objective's. -> grad_z [c, Vd] (times w, in grad_dtype), value [c] (the
    objective per row, before w), ce [c] (soft cross-entropy at T = 1: the log's ce whatever the
    loss), correct [c] (argmax match: acceptance at T = 0), accept [c] (α at T = 1), accept_t
    [c, m] (α at each of key's metric temperatures). Compiled on a GPU (one pass over z instead
    of dozens); the default key runs today's soft cross-entropy's operations exactly."""
    terms, temps = key
    z = z.float()
    v = _Views(z, ids, tl)
    t1 = v.teacher(1.0)
    w1 = w[:, None]
    grad = value = ce = None
    for kind, weight, T, eta in terms:
        u, lse, q = v.draft(T)
        t = v.teacher(T)
        scale = weight if T == 0 else weight / T                             # dL/dz = dL/du / T
        s = w1 if scale == 1 else w1 * scale                                 # [c, 1]
        if kind in ("kl", "ce"):
            val, g = _ce(u, lse, q, t, s)
            if T == 1:
                ce = val
        else:
            alpha, da = _overlap(q, t)
            if kind == "tv":
                val, g = 1.0 - alpha, -da * s
            elif kind == "nla":
                a = alpha + NLA_EPS
                val, g = -a.log(), -da * (s / a[:, None])
            else:  # lk
                lam = (-eta * alpha).exp()[:, None]                          # [c, 1], held
                c_val, c_g = _ce(u, lse, q, t, s * lam)
                kl = c_val - _entropy(v.tl, v.ids, t[1], t[2], v.vd, T)
                val = lam.squeeze(-1) * kl + (1 - lam.squeeze(-1)) * (1.0 - alpha)
                g = c_g - da * (s * (1 - lam))
        val = val if weight == 1 else weight * val
        value = val if value is None else value + val
        grad = g if grad is None else grad + g
    if ce is None:
        ce = _ce(z, v.lse, v.q, t1, w1)[0]
    t_arg = tl.argmax(-1) if ids is None else ids.gather(-1, tl.argmax(-1, keepdim=True)) \
        .squeeze(-1)
    correct = (z.argmax(-1) == t_arg).float()
    accept = _overlap(v.q, t1, grad=False)[0]
    accept_t = torch.stack([_overlap(v.draft(T)[2], v.teacher(T), grad=False)[0]
                            for T in temps], -1) if temps else z.new_zeros(z.shape[0], 0)
    return grad.to(grad_dtype), value, ce, correct, accept, accept_t


# ------------------------------------------------------------------ the reference (autograd)
def _ref_views(z, tl, T: float):
    """(log q_T, p_T, log p_T) from dense logits z [N, Vd] and teacher log-probs tl [N, Vd]."""
    if T == 0:
        p = F.one_hot(tl.argmax(-1), tl.shape[-1]).float()
        return z.log_softmax(-1), p, None
    if T == 1:
        return z.log_softmax(-1), tl.exp(), tl
    return (z / T).log_softmax(-1), (tl / T).softmax(-1), (tl / T).log_softmax(-1)


def reference(z, tl, key: tuple = DEFAULT.key):
    """Each row's objective through autograd: z [N, Vd] logits (differentiable), tl [N, Vd]
    dense teacher log-probs -> value [N]. The exact (sdpa) path's loss, and what the analytic
    gradients of `chunk_stats` are tested against."""
    value = None
    for kind, weight, T, eta in key[0]:
        logq, p, logp = _ref_views(z, tl.float(), T)
        ce = -(p * logq).sum(-1)
        if kind in ("kl", "ce"):
            val = ce
        else:
            alpha = torch.minimum(p, logq.exp()).sum(-1)
            if kind == "tv":
                val = 1.0 - alpha
            elif kind == "nla":
                val = -(alpha + NLA_EPS).log()
            else:
                lam = (-eta * alpha.detach()).exp()
                h = torch.zeros_like(ce) if logp is None else -(p * logp).sum(-1)
                val = lam * (ce - h) + (1 - lam) * (1.0 - alpha)
        val = val if weight == 1 else weight * val
        value = val if value is None else value + val
    return value


@torch.no_grad()
def acceptance(z, tl, T: float, ids=None):
    """Each row's α_T [c] (T = 0: the surrogate q(argmax p)), no gradient: dpace's confidence
    and the exact path's metrics."""
    v = _Views(z.float(), ids, tl.float())
    return _overlap(v.draft(T)[2], v.teacher(T), grad=False)[0]


def dpace_weights(conf, group, position, n_groups: int, n_positions: int, alpha: float = 0.5):
    """D-PACE's row weights from each row's acceptance conf [N] (held constant): rows are
    positions of chains (group [N]: which chain; position [N]: its place in it, 0 first, e.g.
    the TTT step); with a_i = (1 - alpha)·conf_i + alpha (a missing row counts 1),
    w_i = Σ_{j >= i} Π_{l <= j} a_l, the expected accepted tokens that need position i
    accepted. With alpha 0 and nla, w_i·dℓ_i is exactly the gradient of the chain's expected
    acceptance length. -> [N]."""
    grid = conf.new_ones(n_positions, n_groups, dtype=torch.float32)
    mask = torch.zeros_like(grid)
    grid[position, group] = (1 - alpha) * conf.float() + alpha
    mask[position, group] = 1.0
    prefix = grid.cumprod(0) * mask                                          # [K, G]
    w = prefix.flip(0).cumsum(0).flip(0)
    return w[position, group]


# --------------------------------------------------------------------- lm_head fused with it
def _teacher_rows(teacher: dict, rows: torch.Tensor):
    """Teacher log-probs of the given flat rows: dense [n, Vd], or top-k (ids, logp) [n, k]."""
    if "ids" in teacher:
        return teacher["ids"][rows], teacher["logp"][rows].float()
    return None, teacher["logp"][rows].float()


def _rows_dynamic(*ts) -> None:
    """Mark dim 0 (rows) of a loss chunk dynamic. The rows in the loss differ from batch to
    batch, so a batch's last chunk has any size, and a compiled stats function specialised on
    each one recompiled until dynamo's recompile_limit ("tensor 'w' size mismatch at index 0.
    expected 2097, actual 1357"), and the first steps ran several times slower than steady.
    Every chunk is marked: dynamo would run full chunks through the dynamic graph anyway once
    it exists (it checks the newest graph first), so one graph serves all from the first batch,
    and a static one would only add a compile. No padding: the numbers are the eager ones.
    A function loaded whole (drafter/train/aot.py) takes them unmarked: its guards refuse a
    marking it was not saved with."""
    import torch._dynamo

    for t in ts:
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, 0)


class MarkedRows:
    """A compiled loss-chunk function that marks its tensors' rows dynamic before each call."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, z, ids, tl, w, *rest):
        _rows_dynamic(z, ids, tl, w)
        return self.fn(z, ids, tl, w, *rest)


def loss_chunks(N: int, chunk: int) -> list[tuple[int, int]]:
    """The loss's row ranges: `chunk` rows each and the rest last, where a rest of 1 row joins
    the chunk before it. Dynamo specialises a size of 1, so a 1-row chunk (about one batch in
    `chunk` has one) would compile one more graph mid-run, after the warm-up."""
    ends = list(range(chunk, N, chunk)) + [N] if N > 0 else []
    if len(ends) > 1 and ends[-1] - ends[-2] == 1:
        del ends[-2]
    return list(zip([0] + ends[:-1], ends))


_ADDMM_F32: dict = {}  # device -> whether torch.addmm takes out_dtype=float32 with a float32 sum


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc float32 and a, b half precision. On a GPU whose torch has addmm's
    float32 output (cuBLAS's C += A·B, accumulated in float32), one GEMM into acc; otherwise the
    product, rounded to a's dtype, then an add: a [m, n] temporary and one more pass over acc
    (at the Llama-8B shape, each loss chunk's [32000, 4096] lm_head gradient). Older torch
    refuses a float32 `self` for bf16 inputs: probed once."""
    if acc.is_cuda and a.dtype != acc.dtype and _ADDMM_F32.get(acc.device) is not False:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            _ADDMM_F32[acc.device] = True
            return
        except (RuntimeError, TypeError):  # checked before any work: acc is untouched
            _ADDMM_F32[acc.device] = False
    acc.add_(a @ b)


class FusedHeadLoss(torch.autograd.Function):
    """lm_head + the loss in row chunks; the gradients are formed in the forward, so [N, Vd]
    logits never exist (EAGLE training is dominated by them at small H)."""

    @staticmethod
    def forward(ctx, hn, weight, w, teacher_ids, teacher_logp, trows, chunk, stats_fn,
                need_grad, key):
        N, dt = hn.shape[0], hn.dtype
        wc = weight.to(dt)                                          # [Vd, H] at compute dtype
        grad_hn = torch.empty_like(hn) if need_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if need_grad else None
        teacher = {"logp": teacher_logp} if teacher_ids is None else \
            {"ids": teacher_ids, "logp": teacher_logp}
        # Per chunk only its three matmuls and the compiled stats (the step waits on the
        # host): a top-k teacher's rows gathered once ([N, k], small; a dense one's [c, Vd]
        # stay per chunk), grad_hn written in place, the per-row stats joined once at the end.
        topk = None if teacher_ids is None else _teacher_rows(teacher, trows)
        stats = []
        for s, e in loss_chunks(N, chunk):
            z = hn[s:e] @ wc.T                                               # [c, Vd]
            ids, tl = _teacher_rows(teacher, trows[s:e]) if topk is None else \
                (topk[0][s:e], topk[1][s:e])
            g, *st = stats_fn(z, ids, tl, w[s:e], dt, key)
            stats.append(st)
            if need_grad:
                torch.mm(g, wc, out=grad_hn[s:e])                            # [c, H]
                _accumulate(grad_w, g.T, hn[s:e])                            # [Vd, H]
        if stats:
            value, ce, correct, accept, accept_t = (torch.cat(c) for c in zip(*stats))
        else:  # no row in the loss
            value, ce, correct, accept = (hn.new_empty(0, dtype=torch.float32)
                                          for _ in range(4))
            accept_t = hn.new_empty(0, len(key[1]), dtype=torch.float32)
        ctx.save_for_backward(grad_hn, grad_w)
        ctx.weight_dtype = weight.dtype
        loss = (w * value).sum()
        ctx.mark_non_differentiable(value, ce, correct, accept, accept_t)
        return loss, value, ce, correct, accept, accept_t

    @staticmethod
    def backward(ctx, g_loss, *_):
        grad_hn, grad_w = ctx.saved_tensors
        # scaled in place and handed over: autograd adopts them as the .grad, no second copy
        grad_hn.mul_(g_loss.to(grad_hn.dtype))
        grad_w.mul_(g_loss)
        return (grad_hn, grad_w.to(ctx.weight_dtype)) + (None,) * 8


OUTPUTS = ("loss", "value", "ce", "correct", "accept", "accept_t")


def head_loss(hn, weight, teacher: dict, trows, w, fused: bool, chunk: int = 0,
              obj: Objective = DEFAULT, chains: tuple | None = None,
              stats_fn: Callable = chunk_stats) -> dict:
    """hn [N, H] post-norm states of the rows in the loss; weight [Vd, H] (lm_head); teacher
    {"logp": [M, Vd]} (store.teacher_logprobs) or, fused only, the top-k form {"ids": [M, k],
    "logp": [M, k]} over M teacher rows; trows [N] which teacher row each row learns; w [N] row
    weights (ttt_decay**step); under obj.position "dpace" replaced by D-PACE's, for which
    chains = (group [N], position [N], n_groups, n_positions) says which chain each row is a
    position of (dpace_weights; TTT: the row's token position and its step). fused: lm_head
    and the loss in chunks of `chunk` rows (0: float32 logits of 256 MiB), gradients formed in
    the forward by `stats_fn` (chunk_stats, or its compiled form); else materialised logits and
    autograd through `reference`.
    -> {"loss": Σ w·value (differentiable), "value", "ce", "correct", "accept" [N],
        "accept_t" [N, m]}; all but loss carry no gradient."""
    chunk = chunk or max(256, (256 << 20) // (4 * weight.shape[0]))  # fp32 logits <= 256 MiB
    if obj.position == "dpace":
        w = _dpace_rows(hn, weight, teacher, trows, chains, chunk, obj)
    if fused:
        need_grad = torch.is_grad_enabled() and (hn.requires_grad or weight.requires_grad)
        out = FusedHeadLoss.apply(hn, weight, w, teacher.get("ids"), teacher["logp"], trows,
                                  chunk, stats_fn, need_grad, obj.key)
        return dict(zip(OUTPUTS, out))
    if "ids" in teacher:
        raise ValueError("the exact loss takes a dense teacher (store.teacher_logprobs)")
    z = F.linear(hn, weight).float()                                         # [N, Vd]
    tl = teacher["logp"][trows].float()
    value = reference(z, tl, obj.key)
    with torch.no_grad():
        p = tl.exp()
        logq = z.log_softmax(-1)
        ce = -(p * logq).sum(-1)
        accept = torch.minimum(p, logq.exp()).sum(-1)
        correct = (z.argmax(-1) == tl.argmax(-1)).float()
        accept_t = torch.stack([acceptance(z, tl, T) for T in obj.temperatures], -1) \
            if obj.temperatures else z.new_zeros(z.shape[0], 0)
    return {"loss": (w * value).sum(), "value": value.detach(), "ce": ce, "correct": correct,
            "accept": accept, "accept_t": accept_t}


def _dpace_rows(hn, weight, teacher, trows, chains: tuple, chunk: int, obj: Objective):
    """D-PACE's row weights (head_loss): each row's acceptance at the first term's temperature
    from one no-grad pass of lm_head in chunks (the weighting's cost: one more logits pass)."""
    if chains is None:
        raise ValueError("position weighting dpace needs the rows' chains (head_loss)")
    group, position, n_groups, n_positions = chains
    conf = torch.empty(hn.shape[0], dtype=torch.float32, device=hn.device)
    with torch.no_grad():
        wc = weight.to(hn.dtype)
        for s, e in loss_chunks(hn.shape[0], chunk):
            ids, tl = _teacher_rows(teacher, trows[s:e])
            conf[s:e] = acceptance(hn[s:e].detach() @ wc.T, tl, obj.confidence_temperature, ids)
    return dpace_weights(conf, group, position, n_groups, n_positions, obj.dpace_alpha)
