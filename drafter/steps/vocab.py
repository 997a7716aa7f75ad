"""The vocab step: which target tokens the drafter can propose (DESIGN.md, "Vocab map").

Reads   tokenize/train.parquet (input_ids where loss_mask == 1); the target's config (vocab size)
Writes  vocab/vocab.safetensors  d2t [Vd] int64, t2d [V] bool, counts [V] int64
                                 (drafter/data/tokens.py)
        vocab/vocab.json         coverage, sizes, and the coverage other draft vocab sizes would get
Command drafter vocab CONFIG

1. Count target ids over the training split where loss_mask == 1 (only what the assistant says:
   prompts and templates would crowd out answer tokens).
2. Take the draft_vocab_size most frequent (capped at the target vocab; ties go to the lower id);
   when fewer distinct ids occur, pad with the lowest unused ids so the size is what was asked.
3. Sort ascending. d2t[i] = target_id(i) - i, t2d[target_id] = True.
Coverage = the share of loss-masked tokens whose id is in the draft vocab: the ceiling on what a
drafter with this vocab can accept.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
from tqdm import tqdm

from drafter import DrafterError
from drafter.core import target
from drafter.core.rundir import Run, atomic_json
from drafter.data.tokens import iter_token_batches, num_rows, save_vocab

log = logging.getLogger("drafter")

CURVE = (1024, 2048, 4096, 8192, 16384, 32000, 65536)  # sizes in vocab.json's coverage curve


def count_tokens(path, vocab_size: int) -> np.ndarray:
    """Loss-masked token counts [V] int64 over a token file, streamed in record batches."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    with tqdm(total=num_rows(path), desc="vocab count", unit=" seq", mininterval=1.0) as bar:
        for batch in iter_token_batches(path, batch_rows=4096, columns=["input_ids", "loss_mask"]):
            ids = batch.column(0).flatten().to_numpy(zero_copy_only=False)   # [sum T] int32
            mask = batch.column(1).flatten().to_numpy(zero_copy_only=False)  # [sum T] int8
            sel = ids[mask == 1]
            if sel.size and (sel.max() >= vocab_size or sel.min() < 0):
                raise DrafterError(f"{path}: token id {int(sel.max())} is outside the target vocab "
                                   f"({vocab_size}): the token file comes from another tokenizer")
            counts += np.bincount(sel, minlength=vocab_size)
            bar.update(batch.num_rows)
    return counts


def build_vocab(counts: torch.Tensor,
                draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """counts [V] int64 -> (d2t [Vd] int64, t2d [V] bool, info). Vd = min(draft_vocab_size, V)."""
    V = counts.numel()
    vd = min(draft_vocab_size, V)
    c = counts.to(torch.int64)
    # Most frequent first, ties to the lower id: a stable sort of -count over ids in order.
    order = torch.sort(-c, stable=True).indices                       # [V]
    distinct = int((c > 0).sum())
    chosen = order[:min(vd, distinct)]
    padded = vd - chosen.numel()
    if padded:
        unused = torch.nonzero(c == 0).flatten()[:padded]             # lowest unused ids
        chosen = torch.cat([chosen, unused])
    targets = torch.sort(chosen).values                               # [Vd] ascending
    d2t = targets - torch.arange(vd, dtype=torch.int64)               # [Vd] int64
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[targets] = True
    total = int(c.sum())
    covered = int(c[targets].sum())
    sorted_c = c[order]
    cum = torch.cumsum(sorted_c, 0)
    curve = {str(n): (int(cum[n - 1]) / total if total else 0.0) for n in CURVE if n <= V}
    info = {"target_vocab_size": V, "draft_vocab_size": vd,
            "requested_draft_vocab_size": draft_vocab_size, "masked_tokens": total,
            "covered_tokens": covered, "coverage": covered / total if total else 0.0,
            "distinct_tokens": distinct, "padded": padded, "coverage_at_size": curve}
    return d2t, t2d, info


def main(cfg) -> dict:
    run = Run.of(cfg)
    path = run.require(run.tokens("train"), "tokenize")
    V = target.vocab_size(target.load_config(cfg.target))
    counts = count_tokens(path, V)
    if counts.sum() == 0:
        raise DrafterError(f"{path}: no loss-masked tokens in the training split")
    d2t, t2d, info = build_vocab(torch.from_numpy(counts), cfg.vocab.draft_vocab_size)
    if info["requested_draft_vocab_size"] > V:
        log.warning("vocab: draft_vocab_size %d capped at the target vocab %d",
                    cfg.vocab.draft_vocab_size, V)
    save_vocab(run.vocab(), d2t, t2d, torch.from_numpy(counts),
               {k: v for k, v in info.items() if not isinstance(v, dict)})
    atomic_json(run.vocab_info(), info)
    log.info("vocab: coverage %.2f%% of %d loss-masked tokens with %d of %d target ids "
             "(%d distinct seen, %d padded)", 100 * info["coverage"], info["masked_tokens"],
             info["draft_vocab_size"], V, info["distinct_tokens"], info["padded"])
    return {"counts": {"masked_tokens": info["masked_tokens"],
                       "distinct_tokens": info["distinct_tokens"],
                       "draft_vocab_size": info["draft_vocab_size"], "padded": info["padded"]},
            "coverage": info["coverage"], "target_vocab_size": V}
