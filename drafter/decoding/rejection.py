"""Speculative sampling's verification on the draft vocab's support, and its fused kernel: the
recursive rejection sampling of a sampled tree (a chain: Leviathan et al.'s rejection sampling)
walked one row at a time.

    cur, n_acc, last = walk(logits, tokens, children, dist, q, t_ids, temperature, depth)

Reads the verification's target logits [B, N+1, V] (any float dtype, never copied), the drafted
nodes (draft ids, each node's children in draw order, each node's row of `q`) and the draft
distributions the children were drawn from (`DraftQ`: the drafter's logits of the expanded nodes
and their log-sum-exp); returns per row the last accepted node, the accepted count and the step's
last token (target ids). Shapes: B rows, N nodes (array index n+1; 0 the root), k children a
node, E expanded nodes, V target vocab, Vd draft vocab, t_ids [Vd] the draft -> target id map
(injective: the draft vocab is a subset of the target's).

At a node with target distribution p0 and draft distribution q0 (zero outside the support, the
t_ids image), recursive rejection sampling tests the children t_0, t_1, .. in draw order: t_r is
accepted with probability min(1, p_r(t_r) / q_r(t_r)); a rejection sets p_{r+1} = norm(max(0,
p_r - q_r)) and q_{r+1} = q_r without t_r, renormalised (the draws were without replacement).
By induction p_r is, up to a factor 1 / G_r, max(0, p0 - lam_r q0) on the tokens not yet drawn
(outside the support: p0 itself), and t_j keeps the value it had just after its rejection,
max(0, p0(t_j) - lam_{j+1} q0(t_j)); q_r = q0 / Z_r with Z_r = 1 - (q0 mass drawn before r).
With lam_0 = 0, G_0 = 1, Z_0 = 1, a rejection of t_r gives lam_{r+1} = lam_r + G_r / Z_r,
Z_{r+1} = Z_r - q0(t_r) and G_{r+1} = (the sum of those masses): one pass over the Vd support,
where the direct form rewrites [V] rows several times. The acceptance test reads two numbers,
the last token is a Gumbel-max draw over the final weights (no normalisation needed). Where
G_{r+1} is 0 (p_r = q_r, a rejection of probability 0 that only rounding reaches) p stays, as
in the direct form. tests/test_sampling_exact.py holds the result to the target's distribution,
tests/test_rejection.py to the direct form's decisions under the same uniforms.

On CUDA with Triton, `walk` is one kernel (one program a row: the row's node stats, acceptance
tests and residual passes, then the last token's Gumbel-max with in-kernel Philox noise);
elsewhere `walk_torch`, the same arithmetic in PyTorch, which also checks the kernel (the same
uniforms in, the same decisions out). The drafting side of sampling, the expansion's Gumbel top-k
(tree.sampled_children, its kernel in tree_kernels beside the walk's), is tree.py's.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from drafter.core.gpu import triton_available
from drafter.decoding.noise import OFFSETS, gumbel, philox_key

TILE = 2048          # the walk kernel's columns a load (eight a thread of its eight warps)


@dataclass
class DraftQ:
    """The draft distributions a sampled draft drew from: q_e = softmax(rows[:, e] / T), row 0
    the root's. rows [B, E, Vd] the drafter's logits (their own dtype: a graph step keeps the
    bf16 rows, not float32 copies), lse [B, E] float32 logsumexp(rows / T)."""
    rows: Tensor
    lse: Tensor
    temperature: float

    def logq(self) -> Tensor:
        """The float32 log-probs [B, E, Vd] (the reference forms and the tests)."""
        return self.rows.float() / self.temperature - self.lse[..., None]


def children_table(parent_full: Tensor, valid: Tensor, k: int) -> Tensor:
    """parent_full [B, N+1] (node-array parents; the root's 0) and valid [B, N] -> [B, N+1, k]:
    the array index of each node's r-th child in draw order (siblings appear in draw order,
    Draft's convention), -1 past its last valid child."""
    B, n = parent_full.shape
    par = parent_full[:, 1:]                                                        # [B, N]
    earlier = torch.ones(n - 1, n - 1, dtype=torch.bool, device=par.device).tril(-1)
    rank = ((par[:, :, None] == par[:, None, :]) & earlier).sum(-1)                 # [B, N]
    slot = torch.where(valid, par * k + rank, n * k)                  # invalid: a dump column
    table = torch.full((B, n * k + 1), -1, dtype=torch.long, device=par.device)
    table.scatter_(1, slot, torch.arange(1, n, device=par.device).expand(B, -1))
    return table[:, :-1].view(B, n, k)


@functools.cache  # never evicted: a captured graph reads these tensors' memory on every replay
def chain_layout(K: int, device: str) -> tuple[Tensor, Tensor]:
    """A chain of K as a tree, made once per device at the graph's eager warm-up: children
    [K+1, 1] (node n's child n+1; the last none) and dist [K+1] (node n drew from row n)."""
    n = torch.arange(K + 1, device=torch.device(device))
    return torch.where(n < K, n + 1, -1)[:, None], torch.where(n < K, n, -1)


def target_to_draft(t_ids: Tensor, V: int) -> Tensor:
    """[V] int32: each target id's draft id, -1 outside the draft vocab."""
    t2d = torch.full((V,), -1, dtype=torch.int32, device=t_ids.device)
    return t2d.scatter_(0, t_ids, torch.arange(len(t_ids), dtype=torch.int32,
                                               device=t_ids.device))


# ------------------------------------------------------------------------ the walk, in PyTorch
def walk_torch(logits: Tensor, tokens: Tensor, children: Tensor, dist: Tensor, q: DraftQ,
               t_ids: Tensor, temperature: float, u: Tensor, noise: Tensor
               ) -> tuple[Tensor, Tensor, Tensor]:
    """The walk (module doc) for all rows at once: depth by depth, sibling by sibling, each
    rejection one pass over [B, Vd]. u [B, D, k] the acceptance tests' uniforms, noise [B, V]
    the last token's. Returns cur [B] (array index of the last accepted node), n_acc [B], the
    last token [B] (a target id)."""
    B, _, V = logits.shape
    D, k = u.shape[1], u.shape[2]
    dev = logits.device
    rows = torch.arange(B, device=dev)
    outside = torch.ones(V, dtype=torch.bool, device=dev).index_fill_(0, t_ids, False)
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    n_acc = torch.zeros_like(cur)
    going = torch.ones(B, dtype=torch.bool, device=dev)
    lam, g, z, f = (torch.zeros(B, device=dev) for _ in range(4))
    drawn = torch.zeros(B, t_ids.shape[0], dtype=torch.bool, device=dev)
    frozen = torch.zeros(B, t_ids.shape[0], device=dev)        # a drawn token's lam
    for depth in range(D + 1):
        x = logits[rows, cur].float() / temperature                                 # [B, V]
        lse = torch.logsumexp(x, -1)
        p0 = (x[:, t_ids] - lse[:, None]).exp()                                    # [B, Vd]
        out0 = (x.masked_fill(~outside, -torch.inf).logsumexp(-1) - lse).exp()      # [B]
        e = dist[rows, cur]
        q0 = (q.rows[rows, e.clamp(min=0)].float() / temperature
              - q.lse[rows, e.clamp(min=0)][:, None]).exp()                        # [B, Vd]
        # the rows that moved start their node afresh; the others keep their state
        lam, f = lam.masked_fill(going, 0.0), f.masked_fill(going, 0.0)
        g, z = g.masked_fill(going, 1.0), z.masked_fill(going, 1.0)
        drawn = drawn & ~going[:, None]
        if depth == D:
            break
        found = torch.zeros_like(going)
        nxt = cur
        for r in range(k):
            c = children[rows, cur, r]
            live = going & ~found & (c >= 0)
            d = tokens[rows, (c - 1).clamp(min=0)]
            pt, qt = p0[rows, d], q0[rows, d]
            ok = live & (u[:, depth, r] * qt / z < (pt - lam * qt).clamp(min=0) / g)
            found, nxt = found | ok, torch.where(ok, c, nxt)
            rej = live & ~ok
            lam1 = lam + g / z
            drawn = drawn | (torch.zeros_like(drawn).scatter_(1, d[:, None], True)
                             & rej[:, None])
            f1 = f + (pt - lam1 * qt).clamp(min=0)
            h = (p0 - lam1[:, None] * q0).clamp(min=0).masked_fill(drawn, 0.0).sum(-1)
            g1 = h + out0 + f1
            upd = rej & (g1 > 0)                    # else p stays (a zero residual)
            keep = rej & ~upd
            frozen = torch.where(rej[:, None] & (torch.arange(drawn.shape[1], device=dev)
                                                 == d[:, None]),
                                 torch.where(upd, lam1, lam)[:, None], frozen)
            f = torch.where(upd, f1, torch.where(keep, f + (pt - lam * qt).clamp(min=0), f))
            lam, g = torch.where(upd, lam1, lam), torch.where(upd, g1, g)
            z = torch.where(rej, z - qt, z)
        going = going & found
        cur = torch.where(found, nxt, cur)
        n_acc = n_acc + found.long()
    mu = torch.where(drawn, frozen, lam[:, None])
    w = (p0 - mu * q0).clamp(min=0)
    y = (x - lse[:, None]).index_copy(1, t_ids, w.log())                           # [B, V]
    return cur, n_acc, (y + gumbel(noise)).argmax(-1)


# ---------------------------------------------------------------------------- the Triton kernels
def _walk_kernel():
    from drafter.decoding import tree_kernels  # imports triton: only where Triton runs

    return tree_kernels.walk_kernel


def walk_triton(logits, tokens, children, dist, q: DraftQ, t_ids, temperature, u,
                noise=None) -> tuple[Tensor, Tensor, Tensor]:
    """walk_torch as one Triton kernel; `noise` [B, V] uniforms as walk_torch's (the tests),
    else Philox noise from a fresh key."""
    B, n1, V = logits.shape
    D, k = u.shape[1], u.shape[2]
    if B * V >= OFFSETS:
        raise ValueError(f"walk: {B} x {V} logits overflow the noise offsets")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows = q.rows if q.rows.stride(-1) == 1 else q.rows.contiguous()
    dev = logits.device
    out = torch.empty(3, B, dtype=torch.long, device=dev)
    walk_kernel = _walk_kernel()
    noise_t = noise.contiguous() if noise is not None else u
    walk_kernel[(B,)](
        (logits, logits.stride(0), logits.stride(1), target_to_draft(t_ids, V), V),
        (tokens, tokens.stride(0), children, children.stride(0), children.stride(1), dist,
         dist.stride(0)),
        (rows, rows.stride(0), rows.stride(1), q.lse, q.lse.stride(0), t_ids, t_ids.shape[0]),
        (u.contiguous(), noise_t, philox_key(dev) if noise is None else u),
        (out[0], out[1], out[2]), float(temperature),
        D=D, K=k, KP=max(2, 1 << (k - 1).bit_length()), TILE=TILE, HAS_NOISE=noise is not None,
        num_warps=8)
    return out[0], out[1], out[2]


def walk(logits: Tensor, tokens: Tensor, children: Tensor, dist: Tensor, q: DraftQ,
         t_ids: Tensor, temperature: float, depth: int, u: Tensor | None = None,
         noise: Tensor | None = None, fused: bool | None = None
         ) -> tuple[Tensor, Tensor, Tensor]:
    """Recursive rejection sampling down a drafted tree (module doc). logits [B, N+1, V] of
    the verification (row 0: the root), tokens [B, N] draft ids, children [B, N+1, k]
    (children_table), dist [B, N+1] each node's row of q (-1: none), t_ids [Vd], depth the
    tree's. u [B, depth, k] and noise [B, V] (uniforms) fix the draws (tests); by default
    torch.rand's, and the kernel draws the last token's noise itself. fused: the Triton kernel
    (None: on CUDA where Triton imports). Returns cur [B] (array index of the last accepted
    node), n_acc [B] and the step's last token [B] (a target id)."""
    B, _, V = logits.shape
    k = children.shape[-1]
    if u is None:
        u = torch.rand(B, depth, k, device=logits.device)
    if fused is None:  # (the kernel's Philox offsets are int32)
        fused = triton_available(logits.device) and B * V < OFFSETS
    if fused:
        return walk_triton(logits, tokens, children, dist, q, t_ids, temperature, u, noise)
    if noise is None:
        noise = torch.rand(B, V, device=logits.device)
    return walk_torch(logits, tokens, children, dist, q, t_ids, temperature, u, noise)
