"""The block drafters' training objective (DSpark, DFlash; the model is
drafter/train/dspark.py): anchors sampled along each packed row (`block_align`, the block form of
batches.align), every anchor's block drafted in one forward over the row (`BlockTrain`), and the
loss of each draft against the target's distribution.

Anchor a (a position of the row whose next token is an assistant token, with context before
it in its sample): its block's queries sit at positions a, a+1, ... and attend to the context
keys of positions < a of the same sample and to their own block, nothing else (one boolean
mask, [B, 1, A·Q, T + A·Q]); draft m (1..K) learns the teacher of row a+m-1 (the target's
distribution over token a+m), counts when token a+m is an assistant token of the sample and
the teacher's argmax is in the draft vocab, with weight decay^(m-1); DSpark's Markov bias for
draft m comes from token a+m-1 (the data's, teacher forcing).

Loss: train.loss, by default the published recipes' 0.1 · soft cross-entropy + 0.9 · total
variation (1 - Σ min(p, q): one minus the chance rejection sampling accepts the draft;
losses.BLOCK), through the fused lm_head loss of drafter/train/losses.py, as EAGLE-3's (the
Markov bias rides along as extra columns:
[hn, markov_w1[prev]] @ [lm_head; markov_w2]ᵀ = lm_head(hn) + markov_w2(markov_w1[prev])); plus,
with a confidence head, binary cross-entropy of its logit against each draft's Σ min(p, q),
the head reading detached states (a probe of the drafter, not a pull on it).
"""
from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from drafter.train.dspark import DSpark
from drafter.train.losses import BLOCK, Objective, head_loss
from drafter.train.ttt import noisy


def anchor_seed(seed: int, rows: list[list[int]]) -> int:
    """A micro-batch's anchor seed from its samples: the same batch draws the same anchors
    whatever process, rank or resume builds it."""
    return (seed * 1_000_003 + zlib.crc32(repr(rows).encode())) % 2**63


def block_align(seq_id: torch.Tensor, position_ids: torch.Tensor, loss_mask: torch.Tensor,
                in_vocab: torch.Tensor, K: int, anchors: int, decay: float, seed: int) -> dict:
    """Anchors and the rows of their drafts in the loss. Inputs [B, T]. Returns
        anchors [B, A]   positions in the row, ascending, -1 for none (A = min(anchors, T))
        rows [N]         flat indices into [B, A, K] of the drafts in the loss
        trows [N]        their teacher rows, flat into [B, T] (a+m-1: also the Markov
                         prev token's position)
        weights [N]      decay**(m-1);  row_step [N] m-1
        n_valid [K], n_lm [K]  drafts in the loss, and with the loss mask alone (the
                         denominator of acc/accept: out-of-vocab teacher argmaxes count as misses)
    The anchors are a uniform draw without replacement among the candidates (`seed`)."""
    B, T = seq_id.shape
    dev = seq_id.device
    t = torch.arange(T, device=dev).expand(B, T)
    nxt = (t + 1).clamp(max=T - 1)
    cand = ((seq_id >= 0) & (position_ids >= 1) & (t + 1 < T)
            & (seq_id.gather(1, nxt) == seq_id) & loss_mask.gather(1, nxt).bool())
    g = torch.Generator().manual_seed(seed)
    score = torch.where(cand, torch.rand(B, T, generator=g).to(dev), -1.0)
    A = min(anchors, T)
    val, idx = score.topk(A, dim=1)                                          # [B, A]
    a = torch.where(val >= 0, idx, T + idx).sort(dim=1).values               # real ones first
    a = torch.where(a < T, a, -1)
    m = torch.arange(1, K + 1, device=dev)                                   # [K]
    tgt = a[..., None] + m                                                   # [B, A, K]
    ok = (a[..., None] >= 0) & (tgt < T)
    tgt_c = tgt.clamp(0, T - 1).reshape(B, -1)
    a_c = a.clamp(min=0)
    same = seq_id.gather(1, tgt_c).view(B, A, K) == seq_id.gather(1, a_c)[..., None]
    lm = ok & same & loss_mask.gather(1, tgt_c).view(B, A, K).bool()
    trow = (tgt - 1).clamp(0, T - 1)                                         # [B, A, K]
    valid = lm & in_vocab.gather(1, trow.reshape(B, -1)).view(B, A, K)
    rows = valid.reshape(-1).nonzero().squeeze(-1)                           # [N]
    row_step = rows % K
    trows = (trow + torch.arange(B, device=dev)[:, None, None] * T).reshape(-1)[rows]
    weights = torch.full_like(row_step, decay, dtype=torch.float64).pow_(row_step).float()
    return {"anchors": a, "rows": rows, "trows": trows, "weights": weights, "row_step": row_step,
            "n_valid": valid.sum((0, 1)), "n_lm": lm.sum((0, 1))}


def block_mask(seq_id: torch.Tensor, anchors: torch.Tensor, Q: int) -> torch.Tensor:
    """bool [B, 1, A·Q, T + A·Q]: block j's queries attend to the context positions before its
    anchor in the anchor's sample, and to the Q queries of their own block (True = attend)."""
    B, T = seq_id.shape
    A = anchors.shape[1]
    dev = seq_id.device
    a = anchors.clamp(min=0)
    t = torch.arange(T, device=dev)
    ctx = ((t[None, None, :] < a[..., None]) & (anchors[..., None] >= 0)
           & (seq_id[:, None, :] == seq_id.gather(1, a)[..., None]))          # [B, A, T]
    ctx = ctx[:, :, None, :].expand(B, A, Q, T).reshape(B, A * Q, T)
    blk = torch.arange(A * Q, device=dev) // Q
    own = (blk[:, None] == blk[None, :]).expand(B, A * Q, A * Q)
    return torch.cat([ctx, own], dim=-1)[:, None]                            # [B, 1, AQ, T+AQ]


_FLEX = {}


def flex_block_attention(seq_id: torch.Tensor, anchors: torch.Tensor, Q: int,
                         compiled: bool = True):
    """block_mask as FlexAttention's mask_mod, its block mask built once a batch and shared by
    the layers: -> (q [B, nh, A·Q, hd], k, v [B, nkv, T + A·Q, hd]) -> o. The fast GPU path: no
    [A·Q, T + A·Q] grid, and the context blocks after each anchor skipped (uncompiled it is a
    slow reference, forward-only on the CPU)."""
    from torch.nn.attention import flex_attention as fa

    B, T = seq_id.shape
    AQ = anchors.shape[1] * Q
    a_q = anchors.repeat_interleave(Q, dim=1)                               # [B, AQ]
    sid_q = seq_id.gather(1, a_q.clamp(min=0))

    def mask_mod(b, h, qi, kv):
        kc = kv.clamp(max=T - 1)
        ctx = (kv < T) & (kv < a_q[b, qi]) & (seq_id[b, kc] == sid_q[b, qi]) & (a_q[b, qi] >= 0)
        return ctx | ((kv >= T) & ((kv - T) // Q == qi // Q))
    bm = fa.create_block_mask(mask_mod, B, None, AQ, T + AQ, device=seq_id.device)
    if compiled and "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(fa.flex_attention, dynamic=False)
    fn = _FLEX["fn"] if compiled else fa.flex_attention

    def attend(q, k, v):
        with torch.autocast(q.device.type, enabled=False):
            return fn(q, k.to(q.dtype), v.to(q.dtype), block_mask=bm,
                      enable_gqa=q.shape[1] != k.shape[1])
    return attend


# DSpark's modules BlockTrain registers under their own names (its state dict is the
# drafter's, less the frozen table): all but embed_tokens.
TRAINED = ("fc", "hidden_norm", "layers", "norm", "lm_head", "markov_head", "confidence_head",
           "rotary")


class BlockTrain(nn.Module):
    """The training forward of a DSpark / DFlash drafter over its trainable modules (shared, not
    copied, registered under the drafter's names); the frozen embeddings stay out, where the
    table lives: the caller passes `emb` (the rows' token embeddings), and the mask token's
    embedding is kept here.

    forward(aux [B, T, L, Ht], emb [B, T, H], position_ids, seq_id, input_ids [B, T],
            anchors [B, A], rows [N], trows [N], weights [N], teacher) -> dict
      losses.head_loss's dict (loss differentiable; value, ce, correct, accept [N], accept_t
      [N, m]), and with a confidence head conf_err [N] (|sigmoid(logit) - accept|).
    obj: the loss (losses.BLOCK by default; D-PACE chains are the anchors' blocks); noise: as
    TTT's, on the aux states while training."""

    def __init__(self, model: DSpark, fused: bool = False, loss_chunk: int = 0,
                 flex: bool = False, obj: Objective = BLOCK, noise: float = 0.0):
        super().__init__()
        self.flex, self.obj, self.noise = flex, obj, noise
        self.cfg = model.cfg
        self.drafter = (model,)  # a tuple: not registered, its table stays where it is
        for name in TRAINED:
            setattr(self, name, getattr(model, name))
        self.fused, self.loss_chunk, self.compiled = fused, loss_chunk, False
        self.register_buffer("mask_emb", model.embed_tokens.weight[model.cfg.mask_token_id]
                             .detach().clone(), persistent=False)

    def forward(self, aux, emb, position_ids, seq_id, input_ids, anchors, rows, trows, weights,
                teacher):
        m, cfg = self.drafter[0], self.cfg
        B, T = seq_id.shape
        A, Q, K = anchors.shape[1], cfg.queries, cfg.block_size
        if self.noise > 0 and self.training and torch.is_grad_enabled():
            aux = noisy(aux, self.noise)
        cn = m.fuse(aux)                                                     # [B, T, H]
        H = cn.shape[-1]
        ctx = m.context(cn, position_ids)
        a = anchors.clamp(min=0)
        e0 = emb.gather(1, a[..., None].expand(B, A, H)).to(cn.dtype)       # [B, A, H]
        x = torch.cat([e0[:, :, None], self.mask_emb.to(cn.dtype).expand(B, A, Q - 1, H)],
                      dim=2).reshape(B, A * Q, H)                            # [B, A·Q, H]
        pos = (position_ids.gather(1, a)[..., None]
               + torch.arange(Q, device=a.device)).reshape(B, A * Q)         # [B, A·Q]
        mask = flex_block_attention(seq_id, anchors, Q) if self.flex \
            else block_mask(seq_id, anchors, Q)
        hn = m.block(x, pos, ctx, mask)                                      # [B, A·Q, H]
        hn = m.draft_rows(hn.view(B, A, Q, H)).reshape(B * A * K, H)[rows]   # [N, H]
        head_w = m.lm_head.weight
        me = m.markov_embed(input_ids.reshape(-1)[trows])                   # [N, r] or None
        hx = hn
        if me is not None:
            hx = torch.cat([hn, me.to(hn.dtype)], dim=-1)                    # [N, H+r]
            head_w = torch.cat([head_w, m.markov_head.markov_w2.weight], dim=1)  # [Vd, H+r]
        chains = (rows // K, rows % K, B * A, K) if self.obj.position == "dpace" else None
        out = head_loss(hx, head_w, teacher, trows, weights, fused=self.fused,
                        chunk=self.loss_chunk, obj=self.obj, chains=chains)
        loss, accept = out["loss"], out["accept"]
        if m.confidence_head is not None:
            logit = m.confidence_logit(hn.detach(), None if me is None else me.detach())
            bce = F.binary_cross_entropy_with_logits(logit, accept, reduction="none")
            out["loss"] = loss + (weights * bce).sum()
            out["conf_err"] = (torch.sigmoid(logit) - accept).abs().detach()
        return out
