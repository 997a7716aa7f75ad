"""A block drafter (DSpark or DFlash: drafter.train.dspark.DSpark, taken by duck typing as
EagleDraft takes the EAGLE-3 Drafter) in evaluate's decoder: its context cache, its step, and
what its confidence head predicted against what verification accepted.

    P = proposer_for(model)                       # DSparkDraft for a block drafter, else EagleDraft
    P = DSparkDraft(model, cut=0.4)               # verify while the confidences' product >= 0.4
    outs = dec.generate(prompts, 128, proposer=P, tree=TreeSpec.chain(k))   # k <= block size K

Shapes: B rows, S attention span (cache slots read), Q block queries (DSpark K, DFlash K+1),
K the drafter's block size, k drafts verified (k <= K), H drafter hidden, Vd draft vocab,
A target layers read, Ht target hidden, C the thresholds of CUTS.

The reasoning: docs/internals.md, "Module notes", dspark.py.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from drafter.decoding.rejection import DraftQ, walk
from drafter.decoding.tree import DecodeError, EagleDraft, sampled_children, verify_chain_sample

CUTS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)  # thresholds the steps count cuts at
STAT_ROWS = 4   # stats rows before the cuts': confidence tested, tested, accepted, product


@functools.cache  # never evicted: a captured graph reads it on every replay
def _cuts(device: str) -> Tensor:
    return torch.tensor(CUTS, device=torch.device(device))


def proposer_for(model, cut: float | None = None):
    """The DraftModel evaluate's decoder drafts with: a block drafter (a `block_size` in its
    config) as DSparkDraft, an EAGLE-3 Drafter as EagleDraft."""
    if getattr(model.cfg, "block_size", None):
        return DSparkDraft(model, cut)
    if cut is not None:
        raise DecodeError("a confidence cut needs a block drafter with a confidence head")
    return EagleDraft(model)


class DSparkDraft:
    """drafter.train.dspark.DSpark (DSpark or DFlash) behind `DraftModel`, with the context
    cache and the block step (module doc). `cut`: verify only the drafts whose running product
    of confidences stays >= cut (a confidence head needed)."""

    def __init__(self, model, cut: float | None = None):
        self.m, c = model.eval(), model.cfg
        if cut is not None and model.confidence_head is None:
            raise DecodeError(f"a confidence cut needs a confidence head; this {c.method} "
                              f"drafter has none")
        self.cut = cut
        self.aux_layer_ids = list(c.target_layer_ids)
        self.vocab_size, self.block_size = c.draft_vocab_size, c.block_size
        self.extra_slots = c.queries    # the block's scratch slots past the committed ones
        self.kc = self.vc = self.t_ids = self._root = None
        self.rows = None  # set by the decoder around a refill (DraftModel)

    def allocate(self, max_batch, max_slots, device, dtype):
        self.m.to(device=device, dtype=dtype)
        a = self.m.layers[0].self_attn
        shape = (len(self.m.layers), max_batch, a.nkv, max_slots, a.hd)
        self.kc = torch.zeros(shape, device=device, dtype=dtype)
        self.vc = torch.zeros(shape, device=device, dtype=dtype)
        self.t_ids = self.m.to_target_ids(torch.arange(self.vocab_size, device=device))
        self._root = torch.zeros(max_batch, self.vocab_size, device=device, dtype=dtype)

    def stats_shape(self, k: int) -> tuple[int, int] | None:
        """Per row, the step's records (module doc): [STAT_ROWS + 2C, k]; None without a
        confidence head."""
        return None if self.m.confidence_head is None else (STAT_ROWS + 2 * len(CUTS), k)

    def to_target(self, draft_ids):
        return self.t_ids[draft_ids]

    # ------------------------------------------------------------------------------- the cache
    def _context(self, aux: Tensor, pos: Tensor, slots: Tensor) -> None:
        """The context K/V of positions pos [B, T] from their aux states [B, T, A, Ht], written
        at slots [B, T] (a refill: cache rows `rows` only)."""
        for i, (k, v) in enumerate(self.m.context(self.m.fuse(aux), pos)):  # [B, nkv, T, hd]
            kc, vc = self.kc[i], self.vc[i]
            if self.rows is None:
                B, n, T, d = k.shape
                idx = slots[:, None, :, None].expand(B, n, T, d)
                kc[:B].scatter_(2, idx, k)
                vc[:B].scatter_(2, idx, v)
            else:
                r = self.rows[:, None]
                kc[r, :, slots] = k.transpose(1, 2)                             # [B, T, nkv, hd]
                vc[r, :, slots] = v.transpose(1, 2)

    def observe(self, ids, aux, pos, slots, vis, last):
        """The prefill's positions become context (the block step writes its own); `ids` and
        `vis` are not read. The root logits the decoder keeps are not the block's: zeros."""
        self._context(aux, pos, slots)
        return None if last is None else self._root[:ids.shape[0]]

    def score(self, depth, ids, parent, pos, slots, vis):
        raise DecodeError("a block drafter drafts its block in its own step (a chain), not "
                          "a tree's frontier")

    # ------------------------------------------------------------------------------- the block
    def _block(self, anchor: Tensor, L: Tensor, start: Tensor, span: int) -> Tensor:
        """The block of anchor [B] (target ids, at slot L [B]) over the context of slots
        start..L-1 -> hn [B, Q, H] (after the final norm): DSpark.block's arithmetic, the
        block's keys and values written at slots L..L+Q-1."""
        m, Q = self.m, self.extra_slots
        B, dev = anchor.shape[0], anchor.device
        slots = L[:, None] + torch.arange(Q, device=dev)                            # [B, Q]
        s = torch.arange(span, device=dev)
        vis = ((s[None] >= start[:, None]) & (s[None] < L[:, None] + Q))[:, None, None]
        x = m.embed_tokens(m.queries(anchor)).to(self.kc.dtype)                     # [B, Q, H]
        cos, sin = m.rotary(x, slots - start[:, None])
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q(h, cos, sin)                                                   # [B, nh, Q, hd]
            k, v = a.kv(h, cos, sin)                                              # [B, nkv, Q, hd]
            idx = slots[:, None, :, None].expand(*k.shape)
            kc, vc = self.kc[i, :B], self.vc[i, :B]
            kc.scatter_(2, idx, k)
            vc.scatter_(2, idx, v)
            o = F.scaled_dot_product_attention(q, kc[:, :, :span], vc[:, :, :span],
                                               attn_mask=vis, enable_gqa=a.nh != a.nkv)
            x = x + a.o_proj(o.transpose(1, 2).reshape(B, Q, a.nh * a.hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return m.norm(x)

    def draft(self, anchor: Tensor, L: Tensor, start: Tensor, span: int, k: int,
              temperature: float) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """One block of k drafts for each row (module doc, 1): draft ids [B, k], the logits
        they were drawn from [B, k, Vd] float32 (the Markov bias in), their log-sum-exp at
        the temperature [B, k] (sampling; else None) and confidences [B, k] (or None)."""
        m = self.m
        hn = m.draft_rows(self._block(anchor, L, start, span))[:, :k]              # [B, k, H]
        base = m.logits(hn).float()                                                 # [B, k, Vd]
        prev, ids, zs, lses, conf = anchor, [], [], [], []
        for i in range(k):
            e = m.markov_embed(prev)                                               # [B, r]
            z = base[:, i] + m.markov_bias(e).float() if e is not None else base[:, i]
            if temperature > 0:
                d, _, lse = sampled_children(z, 1, temperature)
                d = d[:, 0]
                lses.append(lse)
            else:
                d = z.argmax(-1)
            if m.confidence_head is not None:
                conf.append(torch.sigmoid(m.confidence_logit(hn[:, i], e)))
            prev = self.t_ids[d]
            ids.append(d)
            zs.append(z)
        return (torch.stack(ids, 1), torch.stack(zs, 1),
                torch.stack(lses, 1) if lses else None, torch.stack(conf, 1) if conf else None)

    # -------------------------------------------------------------------------------- the step
    def check(self, dec, tree, temperature: float) -> None:
        """What the decoder asks of this drafter before its steps run (Decoder._begin)."""
        if not tree.is_chain:
            raise DecodeError(f"a {self.m.cfg.method} drafter drafts a chain, not a "
                              f"{tree.label()}")
        if tree.depth > self.block_size:
            raise DecodeError(f"chain K={tree.depth}: this {self.m.cfg.method} drafter drafts "
                              f"{self.block_size} tokens a block (verify at most that many)")
        if self.cut is not None and temperature > 0 and dec.chain_verify is not None:
            raise DecodeError("a confidence cut verifies each row's own number of drafts; "
                              "block verification tests a whole chain: use one of the two")

    def step(self, dec, st, span: int, k: int, temperature: float) -> None:
        """One speculative step of decoder `dec` over its state `st` (module doc): draft,
        verify k drafts as a chain, write the verified positions' context, commit."""
        tgt, dev = dec.target, dec.device
        L, start = st.L, st.start
        d_ids, z, lse, conf = self.draft(st.pending, L, start, span, k, temperature)
        toks = self.t_ids[d_ids]                                                    # [B, k]
        s = torch.arange(span, device=dev)
        rel = (s[None] - L[:, None])[:, None]                                       # [B, 1, S]
        j = torch.arange(k + 1, device=dev)
        vis = ((s[None] >= start[:, None]) & (s[None] < L[:, None]))[:, None] \
            | ((rel >= 0) & (rel <= j[None, :, None]))                              # [B, k+1, S]
        pos, slots = (L - start)[:, None] + j, L[:, None] + j
        logits, aux = tgt.forward(torch.cat([st.pending[:, None], toks], 1), pos, slots, vis,
                                  start)
        kcut = torch.full_like(L, k) if self.cut is None else \
            (conf.float().cumprod(1) >= self.cut).sum(1)                            # [B]
        if temperature == 0:
            y = logits.argmax(-1)                                                   # [B, k+1]
            n_acc = (toks == y[:, :k]).long().cumprod(1).sum(1)
        else:
            q = DraftQ(z, lse, temperature)
            if self.cut is None:
                n_acc, bonus = (dec.chain_verify or verify_chain_sample)(
                    d_ids, logits, q, self.t_ids, temperature)
            else:  # a chain per row, ending at its cut: the last token then comes from p
                live = j[None] < kcut[:, None]                                      # [B, k+1]
                _, n_acc, bonus = walk(logits, d_ids, torch.where(live, j + 1, -1)[..., None],
                                       torch.where(live, j, -1), q, self.t_ids, temperature, k)
        n_acc = torch.minimum(n_acc, kcut)
        if temperature == 0:
            bonus = y.gather(1, n_acc[:, None]).squeeze(1)
        emitted = torch.cat([toks, bonus[:, None]], 1).scatter(1, n_acc[:, None], bonus[:, None])
        self._context(aux, pos, slots)
        if st.stats is not None:
            self._record(st, conf, n_acc, kcut, k)
        dec._commit(st, emitted, n_acc, bonus)

    def _record(self, st, conf: Tensor, n_acc: Tensor, kcut: Tensor, k: int) -> None:
        """The step's confidence records into st.stats [B, STAT_ROWS + 2C, k] (module doc):
        rows 0..3 per position i: the confidence where i was tested, tested, accepted, the
        running product; then per threshold c, for k' = 1..k: min(accepted, cut at c, k') and
        min(cut at c, k') (zero while a cut of its own decides)."""
        c = conf.float()                                                            # [B, k]
        cp = c.cumprod(1)
        j = torch.arange(k, device=c.device)
        tested = ((n_acc[:, None] >= j) & (j < kcut[:, None])).float()
        rows = [c * tested, tested, (n_acc[:, None] > j).float(), cp]
        new = torch.stack(rows, 1)                                                  # [B, 4, k]
        if self.cut is None:
            kc = (cp[:, None, :] >= _cuts(str(c.device))[None, :, None]).sum(-1)   # [B, C]
            kk = j + 1
            verified = torch.minimum(kc[..., None], kk)                             # [B, C, k]
            acc = torch.minimum(verified, n_acc[:, None, None])
            new = torch.cat([new, torch.stack([acc, verified], 2).flatten(1, 2).float()], 1)
        else:
            new = torch.cat([new, c.new_zeros(c.shape[0], 2 * len(CUTS), k)], 1)
        st.stats.add_(new * (~st.finished).float()[:, None, None])

    # ------------------------------------------------------------------------------- its parts
    def time_fns(self, B: int, span: int, context: int, k: int) -> dict:
        """What a step runs beside the verification, for Decoder.time_forwards at B rows with
        `context` committed slots: `draft_ms`, the context write of k+1 positions and the
        block forward with its K base logits; `markov_ms`, one Markov position (the bias, the
        argmax, the confidence)."""
        dev, m = self.t_ids.device, self.m
        L = torch.full((B,), context, dtype=torch.long, device=dev)
        start, anchor = torch.zeros_like(L), torch.zeros_like(L)
        aux = torch.zeros(B, k + 1, len(self.aux_layer_ids), m.cfg.target_hidden_size,
                          dtype=self.kc.dtype, device=dev)
        j = torch.arange(k + 1, device=dev)

        def draft():
            self._context(aux, L[:, None] + j, L[:, None] + j)
            return m.logits(m.draft_rows(self._block(anchor, L, start, span))[:, :k])

        hn = torch.zeros(B, m.cfg.hidden_size, dtype=self.kc.dtype, device=dev)
        base = draft()[:, 0].float()

        def markov():
            e = m.markov_embed(anchor)
            z = base + m.markov_bias(e).float() if e is not None else base
            d = z.argmax(-1)
            if m.confidence_head is not None:
                return d, torch.sigmoid(m.confidence_logit(hn, e))
            return d

        return {"draft_ms": draft, "markov_ms": markov}


def calibration(stats: list, steps: int) -> dict:
    """What the confidence head predicted against what verification accepted, per position
    i = 1..k, from Output.stats summed over outputs ([STAT_ROWS + 2C][k]) and the steps they
    took: conditional (the mean confidence where position i was tested; the share of those
    tests accepted) and unconditional (the mean running product over every step; the share of
    steps that accepted position i)."""
    conf, tested, acc, prod = stats[:STAT_ROWS]
    return {"predicted": [c / t if t else None for c, t in zip(conf, tested)],
            "measured": [a / t if t else None for a, t in zip(acc, tested)],
            "tested": [int(t) for t in tested],
            "predicted_unconditional": [p / steps if steps else None for p in prod],
            "measured_unconditional": [a / steps if steps else None for a in acc]}


def cut_counts(stats: list) -> dict:
    """What cuts at the thresholds of CUTS would have accepted and verified on the recorded
    steps (a run without a cut of its own): {"thresholds", "accepted": [C][k],
    "verified": [C][k]} sums, index [c][k'-1] for verifying at most k' drafts."""
    rest = stats[STAT_ROWS:]
    return {"thresholds": list(CUTS), "accepted": [list(map(int, r)) for r in rest[0::2]],
            "verified": [list(map(int, r)) for r in rest[1::2]]}
