"""Speculative drafting: the tree (EAGLE-2 dynamic tree; a chain is the tree with k = 1), its
verification (greedy, and recursive rejection sampling), and the drafters behind `DraftModel`.
drafter.decoding.decode runs them inside its static-cache decoding loop; the module doc there
explains one speculative step. Shapes as there: B rows, D depth, k children per node, N nodes
verified, E expanded nodes, Vd draft vocab, S attention span.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from drafter import DrafterError
from drafter.core.gpu import triton_available
from drafter.decoding.noise import OFFSETS, gumbel, philox_key
from drafter.decoding.rejection import DraftQ, chain_layout, children_table, walk


class DecodeError(DrafterError):
    """The target or the settings cannot be decoded here (architecture, sizes, memory)."""


def _additive(vis: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean visibility [B, T, S] -> additive mask [B, 1, T, S] (0 or the dtype's min)."""
    return torch.zeros(vis.shape, dtype=dtype, device=vis.device).masked_fill_(
        ~vis, torch.finfo(dtype).min)[:, None]


# ------------------------------------------------------------------------------ drafting a tree
@dataclass(frozen=True)
class TreeSpec:
    """Drafting shape: depth D, children per node k, nodes verified per step N.
    A chain of K is (K, 1, K)."""
    depth: int
    topk: int
    tokens: int

    @classmethod
    def chain(cls, k: int) -> "TreeSpec":
        return cls(k, 1, k)

    def __post_init__(self):
        if self.depth < 1 or self.topk < 1 or self.tokens < 1:
            raise DecodeError(f"tree: depth, topk and tokens must be >= 1, got {self}")

    @property
    def nodes(self) -> int:
        """N: verified draft tokens per step (capped by the candidates the tree can hold)."""
        return min(self.tokens, self.topk + (self.depth - 1) * self.topk ** 2)

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    def label(self) -> str:
        return f"chain K={self.depth}" if self.is_chain else \
            f"tree depth={self.depth} topk={self.topk} tokens={self.nodes}"


@dataclass
class Draft:
    """A drafted tree in node-array form: node n sits at index n+1; index 0 is the root (the
    pending token). Siblings appear in the order they were drawn (what sampling verifies by)."""
    tokens: Tensor        # [B, N] draft-vocab ids
    parent: Tensor        # [B, N] array index of each node's parent (0 = root)
    depth: Tensor         # [B, N] 1..D
    valid: Tensor         # [B, N] bool: drawn with non-zero draft probability
    dist: Tensor          # [B, N+1] row of `q` its children were drawn from; -1 = leaf
    q: DraftQ | None      # the draft distributions of the E expanded nodes (sampling only)
    rank: Tensor          # [B, N] place in the selection's score order (0: the best)


def _gumbel_like(x: Tensor) -> Tensor:
    return gumbel(torch.rand_like(x, dtype=torch.float32))


TOP_CHUNKS = (128, 64, 32)  # top_indices' chunk widths, the first that divides the row


def chunk_width(V: int, k: int, chunks: Sequence[int] | None = None) -> int:
    """top_indices' chunk width for rows of V: the first of `chunks` (default TOP_CHUNKS) that
    divides V into at least 8·k chunks; 0 (torch.topk) when none does."""
    return next((c for c in (TOP_CHUNKS if chunks is None else chunks)
                 if V % c == 0 and V >= 8 * k * c), 0)


def top_indices(x: Tensor, k: int, chunks: Sequence[int] | None = None) -> Tensor:
    """Indices [..., k] of the k largest of each row of x [..., V], largest first: torch.topk's
    values (among exactly equal values, perhaps other indices). A wide row is searched in two
    reads: each chunk of c columns' maximum, then the k chunks with the largest maxima, whose
    c·k values hold the row's k largest (a value outside them has k chunk maxima at least as
    large above it). torch.topk reads a row in one thread block, a radix pass at a time, which is
    the slower of the two on the frontier's wide rows of the draft vocab (BENCHMARKS.md, Figures
    behind design choices)."""
    V = x.shape[-1]
    c = chunk_width(V, k, chunks)
    if not c:
        return x.topk(k, dim=-1).indices
    xc = x.reshape(-1, V // c, c)                                                  # [R, V/c, c]
    R = xc.shape[0]
    best = xc.amax(-1).topk(k, dim=-1).indices                                     # [R, k]
    top = xc.gather(1, best[..., None].expand(R, k, c)).flatten(1).topk(k, dim=-1).indices
    return (best.gather(1, top // c) * c + top % c).view(*x.shape[:-1], k)        # [..., k]


FUSED_SEARCH = True  # greedy_children on CUDA: one Triton kernel (False: the eager kernels)


def greedy_children(logits: Tensor, k: int, fused: bool | None = None) -> tuple[Tensor, Tensor]:
    """A greedy tree's expansion of logits [..., Vd]: the k best ids [..., k] and their float32
    log-probs. The k largest logits are the k largest log-probs, so the search reads the logits
    in their own dtype (bf16: half the bytes of float32 log-probs), and log_softmax reads them
    once more, in float32 inside the kernel (no float32 copy first). On CUDA with Triton, a row
    that chunk_width splits is one kernel's work instead (`fused_children`: the same ids and
    log-probs); `fused` False keeps the eager kernels (None: FUSED_SEARCH decides)."""
    fused = FUSED_SEARCH if fused is None else fused
    if fused and chunk_width(logits.shape[-1], k) and triton_available(logits.device):
        return fused_children(logits, k)
    ids = top_indices(logits, k)
    return ids, F.log_softmax(logits, dim=-1, dtype=torch.float32).gather(-1, ids)


def sampled_children(logits: Tensor, k: int, temperature: float, fused: bool | None = None,
                     noise: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """A sampled expansion of logits [..., Vd] at temperature > 0: k children drawn without
    replacement from softmax(logits / temperature) (Gumbel top-k: ids [..., k] in draw order),
    the k largest log-probs [..., k] (float32, largest first: the scores build_tree ranks by,
    whichever tokens were drawn) and logsumexp(logits / temperature) [...] (float32: with the
    logits, the distribution verification reads; DraftQ). On CUDA with Triton a row that
    chunk_width splits is one kernel's work (sampled_children_kernel: the logits read twice,
    nothing [..., Vd] written); `fused` as greedy_children's. noise: uniforms
    [..., Vd] for the Gumbel noise (the tests' fixed draws; by default torch.rand's, the
    kernel's own Philox stream)."""
    fused = FUSED_SEARCH if fused is None else fused
    c = chunk_width(logits.shape[-1], k)
    if fused and c and triton_available(logits.device) and logits.numel() < OFFSETS:
        return sampled_children_kernel(logits, k, temperature, c, noise)
    x = logits.float() / temperature
    lse = torch.logsumexp(x, -1)
    g = gumbel(torch.rand_like(x) if noise is None else noise)
    return top_indices(x + g, k), x.gather(-1, top_indices(x, k)) - lse[..., None], lse


def sampled_children_kernel(logits: Tensor, k: int, temperature: float, chunk: int,
                            noise: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """sampled_children as one Triton kernel (tree_kernels.sampled_kernel) over rows that
    `chunk` divides (CUDA; the CPU tests run it in Triton's interpreter with `noise`, uniforms
    [..., V] as the eager form reads): ids [..., k] drawn without replacement, the k largest
    log-probs [..., k], the log-sum-exp [...] of logits / temperature."""
    from drafter.decoding import tree_kernels  # imports triton: only where Triton runs

    *lead, V = logits.shape
    x = logits.reshape(-1, V)
    if x.stride(-1) != 1:
        x = x.contiguous()
    R, nc = x.shape[0], 1 << (V // chunk - 1).bit_length()            # chunks, a power of 2
    if R * V >= OFFSETS:
        raise ValueError(f"sampled_children: {R} x {V} logits overflow the noise offsets")
    dev = x.device
    xmax = torch.empty(2, R, nc, dtype=torch.float32, device=dev)
    ids = torch.empty(R, k, dtype=torch.long, device=dev)
    topv = torch.empty(R, k, dtype=torch.float32, device=dev)
    lse = torch.empty(R, dtype=torch.float32, device=dev)
    tree_kernels.sampled_kernel[(R,)](
        (x, xmax[0], xmax[1]), (ids, topv, lse),
        (noise.reshape(R, V).contiguous() if noise is not None else lse,
         philox_key(dev) if noise is None else lse), (V, x.stride(0)), float(temperature),
        NC=nc, TILE=min(nc, 4096 // chunk), C=chunk, K=k, KP=max(2, 1 << (k - 1).bit_length()),
        HAS_NOISE=noise is not None, num_warps=8)
    return ids.view(*lead, k), topv.view(*lead, k), lse.view(lead)


def fused_children(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """greedy_children as one Triton kernel (CUDA; the CPU tests run it in Triton's
    interpreter): ids [..., k] of the k largest logits, largest first (the lower id first among
    equal ones), and their float32 log-probs, without writing the row's log-probs. Rows that
    chunk_width does not split into chunks (it gives 0) are refused: greedy_children sends them
    to the eager kernels (torch.topk)."""
    *lead, V = logits.shape
    c = chunk_width(V, k)
    if not c or V >= 2 ** 31:  # a column must fit the search key (triton_helpers.INDEX_MAX)
        raise ValueError(f"fused_children: rows of {V} are not searched by chunks for top {k}")
    from drafter.decoding import tree_kernels  # imports triton: only where Triton runs

    x = logits.reshape(-1, V)
    if x.stride(-1) != 1:
        x = x.contiguous()
    R, nc = x.shape[0], 1 << (V // c - 1).bit_length()                 # chunks, a power of 2
    maxes = torch.empty(R, nc, dtype=torch.float32, device=x.device)
    ids = torch.empty(R, k, dtype=torch.long, device=x.device)
    logp = torch.empty(R, k, dtype=torch.float32, device=x.device)
    tile = min(nc, 8192 // c)
    tree_kernels.greedy_kernel[(R,)](x, maxes, ids, logp, V, x.stride(0), NC=nc, TILE=tile, C=c,
                                     K=k, KP=1 << (k - 1).bit_length(), num_warps=8)
    return ids.view(*lead, k), logp.view(*lead, k)


@functools.cache  # never evicted: a captured graph reads these tensors' memory on every replay
def _layout(k: int, D: int, device: str) -> tuple[Tensor, Tensor, Tensor]:
    """Constants of a (topk k, depth D) tree's M = k + (D-1)·k² candidates, made once per device
    (a captured step would rebuild them every step: a dozen kernels, at batch 1 each as slow as
    a small matmul), at the graph's eager warm-up, never under capture: the depth of each [M],
    its tie-break 1e-9·depth in float64 [M], and, in order, the draft-distribution row
    1 + i·k + r that expansion i+1 drew frontier node r's children from [(D-1)·k] (row 0: the
    root's)."""
    dev = torch.device(device)
    m = torch.arange(k + (D - 1) * k * k, device=dev)
    depth = torch.where(m < k, 1, 2 + (m - k) // (k * k))
    return depth, 1e-9 * depth.double(), 1 + torch.arange((D - 1) * k, device=dev)


def build_tree(root_logits: Tensor, scorer, spec: TreeSpec, temperature: float) -> Draft:
    """EAGLE-2's dynamic tree. root_logits [B, Vd]: the drafter after the last committed token.
    `scorer(i, ids [B, k], parent [B, k]) -> logits [B, k, Vd]` runs the drafter on the frontier
    at depth i (parent: index of each node's parent in the previous frontier).

    A node's score is its parent's plus the r-th largest child log-prob of its parent, r its rank
    in draw order (greedy: its own log-prob; sampling: independent of which token was drawn, so
    that the tree's shape does not depend on tokens still to be verified: lossless sampling)."""
    B, Vd = root_logits.shape
    k, D, dev = spec.topk, spec.depth, root_logits.device
    sample = temperature > 0
    if k > Vd:
        raise DecodeError(f"tree topk {k} exceeds the draft vocab ({Vd})")

    def expand(logits):  # [..., Vd] -> children's ids, log-probs [..., k]; the log-sum-exp
        if sample:           # [...] of the logits their draws came from (sampling only)
            return sampled_children(logits, k, temperature)
        return (*greedy_children(logits, k), None)

    ids, sc, lse = expand(root_logits)                                              # [B, k]
    c_ids, c_sc, c_par = [ids], [sc], [torch.full_like(ids, -1)]
    q_rows, q_lse = [root_logits[:, None]], [lse[:, None] if sample else None]
    f_ids, f_sc, f_par = ids, sc, torch.zeros_like(ids)
    f_cand = torch.arange(k, device=dev).expand(B, k)
    fronts, offset = [], k
    for i in range(1, D):
        fronts.append(f_cand)
        lg = scorer(i, f_ids, f_par)                                                # [B, k, Vd]
        cid, csc, lse = expand(lg)                                                  # [B, k, k]
        tot = (f_sc[:, :, None] + csc).flatten(1)                                   # [B, k·k]
        cid = cid.flatten(1)
        c_ids.append(cid)
        c_sc.append(tot)
        c_par.append(f_cand[:, :, None].expand(B, k, k).flatten(1))
        if sample:
            q_rows.append(lg)
            q_lse.append(lse)
        if i < D - 1:
            top = tot.topk(k, dim=-1)
            f_par = top.indices // k
            f_ids, f_sc = cid.gather(1, top.indices), top.values
            f_cand = offset + top.indices
        offset += k * k
    ids, sc, par = torch.cat(c_ids, 1), torch.cat(c_sc, 1), torch.cat(c_par, 1)     # [B, M]
    M, N = ids.shape[1], spec.nodes
    depth, tie, rows = _layout(k, D, str(dev))                           # [M], [M], [(D-1)·k]
    # A child scores strictly below its parent (the depth term breaks exact ties), so the N best
    # candidates are ancestor-closed; float64 keeps the 1e-9 visible at any score magnitude.
    key = sc.double() - tie
    sel, rank = key.topk(N, dim=-1).indices.sort(dim=-1)                           # [B, N]
    psel = par.gather(1, sel)
    parent = torch.where(psel < 0, 0, torch.searchsorted(sel, psel.clamp(min=0)) + 1)
    row = torch.full((B, M), -1, dtype=torch.long, device=dev)
    if fronts:  # expansion i+1 drew frontier node r's children from distribution row 1+i·k+r
        row.scatter_(1, torch.cat(fronts, 1), rows.expand(B, -1))
    dist = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), row.gather(1, sel)], 1)
    return Draft(tokens=ids.gather(1, sel), parent=parent, depth=depth[sel],
                 valid=torch.isfinite(sc.gather(1, sel)), dist=dist,
                 q=DraftQ(torch.cat(q_rows, 1), torch.cat(q_lse, 1), temperature) if sample
                 else None, rank=rank)                       # [B, E, Vd], [B, E]


def shape_acceptance(rank: Tensor, depth: Tensor, path: Tensor, n_acc: Tensor
                     ) -> tuple[Tensor, Tensor]:
    """What a greedy step of a (D, k, N) tree would have accepted with a smaller tree of the same
    topk: depth D' <= D and N' <= N nodes, for every (D', N'), from this step's selection.

    EAGLE-2's (D', k, N') tree is the N' best candidates of depth <= D' (the same candidates up
    to depth D'). The nodes this step selected with depth <= D' are the best of those (a
    candidate left out ranks below every selected one), so when there are at least N' of them,
    the smaller tree is exactly their N' best, and it accepts the part of this step's accepted
    path that it holds: a prefix (a parent outranks its children). With fewer than N' of them
    the smaller tree holds candidates this step never verified: not valid.

    rank [B, N] (Draft.rank), depth [B, N] 1..D, path [B, D+1] and n_acc [B] (verify_greedy).
    Returns accepted [B, D, N] and valid [B, D, N] (index [b, D'-1, N'-1])."""
    B, N = rank.shape
    D = path.shape[1] - 1
    dev = rank.device
    d = torch.arange(1, D + 1, device=dev)
    r_path = torch.cat([torch.full_like(rank[:, :1], -1), rank], 1).gather(1, path[:, 1:])
    upto = (depth[:, :, None] <= d).float()                                # [B, N, D'] depth <= D'
    above = (rank[:, None, :] < r_path[:, :, None]).float()                # [B, j, N] outranks
    place = torch.bmm(above, upto)                          # [B, j, D'] path node j's rank in D'
    on = (d[:, None] <= n_acc[:, None, None]) & (d[:, None] <= d[None, :])  # [B, j, D'] held
    n = torch.arange(1, N + 1, device=dev)
    accepted = ((place[..., None] < n) & on[..., None]).sum(1)                     # [B, D', N']
    valid = n <= upto.sum(1)[..., None]                                            # [B, D', N']
    return accepted, valid


def ancestors(parent_full: Tensor, depth: int) -> Tensor:
    """parent_full [B, N+1] (root's parent = 0) -> anc [B, N+1, N+1]: anc[b, i, j] = j is i or
    an ancestor of i."""
    B, n = parent_full.shape
    eye = torch.eye(n, dtype=torch.bool, device=parent_full.device).expand(B, n, n)
    anc, idx = eye, parent_full[:, :, None].expand(B, n, n)
    for _ in range(depth):
        anc = eye | anc.gather(1, idx)
    return anc


def _path(anc: Tensor, best: Tensor, depth_full: Tensor, D: int) -> Tensor:
    """Node indices along the root -> best path, by depth: [B, D+1] (0 past the path's end)."""
    B, n = depth_full.shape
    on = anc.gather(1, best[:, None, None].expand(B, 1, n)).squeeze(1)              # [B, N+1]
    col = torch.where(on, depth_full, D + 1)
    path = torch.zeros(B, D + 2, dtype=torch.long, device=anc.device)
    path.scatter_(1, col, torch.arange(n, device=anc.device).expand(B, n))
    return path[:, : D + 1]


def verify_greedy(tokens: Tensor, parent_full: Tensor, valid: Tensor, depth_full: Tensor,
                  anc: Tensor, logits: Tensor, D: int) -> tuple[Tensor, Tensor, Tensor]:
    """tokens [B, N] target ids; logits [B, N+1, V] of the verify forward (row 0: the root).
    Returns path [B, D+1], accepted count [B], bonus token [B] (the target's argmax after the
    last accepted node)."""
    y = logits.argmax(-1)                                                           # [B, N+1]
    match = (tokens == y.gather(1, parent_full[:, 1:])) & valid
    base = torch.cat([torch.ones_like(match[:, :1]), match], 1)                     # [B, N+1]
    acc = base
    for _ in range(D):
        acc = base & acc.gather(1, parent_full)
    best = torch.where(acc, depth_full, -1).argmax(1)                               # [B]
    n_acc = depth_full.gather(1, best[:, None]).squeeze(1)
    return _path(anc, best, depth_full, D), n_acc, y.gather(1, best[:, None]).squeeze(1)


def verify_sample(tokens: Tensor, parent_full: Tensor, valid: Tensor, depth_full: Tensor,
                  anc: Tensor, logits: Tensor, q: DraftQ, dist: Tensor, t_ids: Tensor,
                  temperature: float, D: int, k: int, u: Tensor | None = None,
                  noise: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Recursive rejection sampling over the tree (drafter.decoding.rejection). tokens [B, N] the
    nodes' draft ids; logits [B, N+1, V] of the verify forward (row 0: the root); q the draft
    distributions (Draft.q), dist [B, N+1] each node's row of them; t_ids [Vd] the draft ->
    target id map. u, noise: fixed uniforms (rejection.walk). Same returns as verify_greedy."""
    cur, n_acc, bonus = walk(logits, tokens, children_table(parent_full, valid, k), dist, q,
                             t_ids, temperature, D, u, noise)
    return _path(anc, cur, depth_full, D), n_acc, bonus


def verify_chain_sample(tokens: Tensor, logits: Tensor, q: DraftQ, t_ids: Tensor,
                        temperature: float, u: Tensor | None = None, noise: Tensor | None = None
                        ) -> tuple[Tensor, Tensor]:
    """Rejection sampling for a chain (Leviathan et al.): draft i (tokens [B, K], draft ids) is
    accepted with probability min(1, p_i / q_i) while every earlier one was; at the first
    rejection the step's last token is drawn from norm(max(0, p - q)) there, after K
    acceptances from p_K. logits [B, K+1, V] of the verify forward; q [B, K] rows: position i's
    draft distribution (row 0: the root's). verify_sample's walk with one child a node. Returns
    accepted count [B] and the last token [B] (a target id)."""
    B, K = tokens.shape
    children, dist = chain_layout(K, str(tokens.device))                  # [K+1, 1], [K+1]
    _, n_acc, last = walk(logits, tokens, children.expand(B, K + 1, 1), dist.expand(B, K + 1),
                          q, t_ids, temperature, K, u, noise)
    return n_acc, last


def nucleus(lg: Tensor, top_p: float) -> Tensor:
    """Logits [B, V] with everything outside the smallest top_p nucleus set to -inf."""
    if top_p >= 1.0:
        return lg
    srt, idx = lg.sort(dim=-1, descending=True)
    pr = F.softmax(srt, dim=-1)
    drop = (pr.cumsum(-1) - pr) > top_p                        # keep the smallest nucleus
    return torch.full_like(lg, -math.inf).scatter(-1, idx, srt.masked_fill(drop, -math.inf))


def pick(logits: Tensor, temperature: float, top_p: float = 1.0) -> Tensor:
    """Next token from logits [B, V]: argmax at temperature 0, else a nucleus sample (Gumbel-max,
    no host sync, capturable)."""
    if temperature <= 0:
        return logits.argmax(-1)
    lg = nucleus(logits.float() / temperature, top_p)
    return (lg + _gumbel_like(lg)).argmax(-1)


# ------------------------------------------------------------------------------- the drafters
class DraftModel(Protocol):
    """What speculative decoding asks of a drafter. Ids passed in are target ids; logits returned
    are over the draft vocab (`to_target` maps draft ids to target ids). Positions are token
    positions (slot - start); `vis` [B, T, S] says which cache slots each query sees."""
    aux_layer_ids: Sequence[int] | None   # HS[k] the drafter needs from the target (None: none)
    vocab_size: int                       # Vd

    def allocate(self, max_batch: int, max_slots: int, device, dtype) -> None: ...

    # Continuous batching (Decoder.generate(continuous=True)) sets `rows` [R] around a refill:
    # observe's batch is then cache rows `rows`, and the other rows' caches stay as they are.
    # Optional: a proposer without the attribute decodes static batches only. An optional
    # `assign(rows, prompts)` hears which prompt (an index into generate's list) each row takes.
    rows: Tensor | None

    def state_tensors(self) -> list[Tensor]:
        """Tensors carried from one step to the next (updated in place), restored after a
        CUDA-graph warm-up. Optional: none by default."""

    def to_target(self, draft_ids: Tensor) -> Tensor: ...

    def observe(self, ids: Tensor, aux: Tensor | None, pos: Tensor, slots: Tensor, vis: Tensor,
                last: Tensor | None) -> Tensor | None:
        """Committed tokens: ids [B, T] are the *next* tokens of positions pos [B, T] (EAGLE-3:
        position t reads aux[t] and token t+1); aux [B, T, A, Ht]. Returns the logits [B, Vd] at
        index `last` [B] (the distribution of the token after the last committed one)."""

    def score(self, depth: int, ids: Tensor, parent: Tensor, pos: Tensor, slots: Tensor,
              vis: Tensor) -> Tensor:
        """Frontier nodes at tree depth `depth`: ids [B, k] (target ids), parent [B, k] (index in
        the previous frontier; depth 1: the root). Returns logits [B, k, Vd] of their children."""


class EagleDraft:
    """drafter.train.model.Drafter (EAGLE-3) behind `DraftModel`, with a static KV cache of its own.
    Same arithmetic as Drafter.forward (tests/test_decode.py checks it)."""

    def __init__(self, drafter):
        self.dr = drafter.eval()
        self.aux_layer_ids = list(drafter.cfg.aux_layer_ids)
        self.vocab_size = drafter.cfg.draft_vocab_size
        self.kc = self.vc = self.root_h = self.t_ids = None
        self._front_h = None
        self.rows = None  # set by the decoder around a refill (DraftModel)

    def allocate(self, max_batch, max_slots, device, dtype):
        self.dr.to(device=device, dtype=dtype)
        a = self.dr.midlayer.self_attn
        # keys and values of their own widths (mla: dqk and dv)
        self.kc = torch.zeros(max_batch, a.nkv, max_slots, a.k_dim, device=device, dtype=dtype)
        self.vc = torch.zeros(max_batch, a.nkv, max_slots, a.v_dim, device=device, dtype=dtype)
        self.root_h = torch.zeros(max_batch, self.dr.cfg.hidden_size, device=device, dtype=dtype)
        # draft id -> target id as one lookup (a step maps ids up to depth + 1 times)
        self.t_ids = self.dr.to_target_ids(torch.arange(self.vocab_size, device=device))

    def state_tensors(self):
        return [self.root_h]

    def to_target(self, draft_ids):  # after allocate, as every decoding step is
        return self.t_ids[draft_ids]

    def _forward(self, ids, h, pos, slots, vis):
        """ids, pos, slots [B, T]; h [B, T, H]; vis [B, T, S] -> h_out [B, T, H]."""
        dr, layer = self.dr, self.dr.midlayer
        a = layer.self_attn
        emb = dr.embed_tokens(ids).to(h.dtype)                                      # [B, T, H]
        x, residual = layer.pre_attention(emb, h)                                   # [B, T, 2H]
        cos, sin = dr.rotary(x, pos)
        q, k, v = a.qkv(x, cos, sin)                           # [B, nh|nkv, T, hd]
        B, T, S = vis.shape
        if self.rows is None:
            idx = slots[:, None, :, None].expand(B, a.nkv, T, 1)
            kc, vc = self.kc[:B], self.vc[:B]
            kc.scatter_(2, idx.expand(B, a.nkv, T, a.k_dim), k)
            vc.scatter_(2, idx.expand(B, a.nkv, T, a.v_dim), v)
        else:  # a refill: these cache rows only, read up to the span
            r = self.rows[:, None]
            self.kc[r, :, slots] = k.transpose(1, 2)                               # [B, T, nkv, hd]
            self.vc[r, :, slots] = v.transpose(1, 2)
            kc = self.kc[:, :, :S].index_select(0, self.rows)
            vc = self.vc[:, :, :S].index_select(0, self.rows)
        g = a.nh // a.nkv
        kk = kc[:, :, :S, None].expand(B, a.nkv, S, g, a.k_dim).transpose(2, 3) \
            .reshape(B, a.nh, S, a.k_dim)                                           # [B, nh, S, hd]
        vv = vc[:, :, :S, None].expand(B, a.nkv, S, g, a.v_dim).transpose(2, 3) \
            .reshape(B, a.nh, S, a.v_dim)
        o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=_additive(vis, q.dtype),
                                           scale=a.scale)
        return layer.post_attention(a.out(o), residual)                             # [B, T, H]

    def observe(self, ids, aux, pos, slots, vis, last):
        h_out = self._forward(ids, self.dr.fuse(aux), pos, slots, vis)
        if last is None:
            return None
        B, _, H = h_out.shape
        hl = h_out.gather(1, last[:, None, None].expand(B, 1, H)).squeeze(1)        # [B, H]
        if self.rows is None:
            self.root_h[:B].copy_(self.dr.feedback(hl))
        else:
            self.root_h.index_copy_(0, self.rows, self.dr.feedback(hl))
        return self.dr.logits(hl)

    def score(self, depth, ids, parent, pos, slots, vis):
        B, k = ids.shape
        H = self.root_h.shape[-1]
        h = self.root_h[:B, None].expand(B, k, H) if depth == 1 else \
            self._front_h.gather(1, parent[:, :, None].expand(B, k, H))
        h_out = self._forward(ids, h, pos, slots, vis)
        self._front_h = self.dr.feedback(h_out)          # within one step only
        return self.dr.logits(h_out)
