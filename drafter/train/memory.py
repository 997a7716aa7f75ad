"""The GPU memory of a train step, estimated before any weights load: `drafter plan` prints it,
and the precompile waits for room for it beside the target (extract's, or an online train's).
    dshape = drafter_shape(cfg, target_config)   # trainable/total parameters, H, I, Vd, layer ids
    train_gpu_bytes(cfg, dshape, gpus, ht)       # bytes by part, and their total
"""
from __future__ import annotations

from drafter.core import target


def drafter_shape(cfg, config) -> dict:
    """Trainable and frozen parameters of the drafter this config trains (meta device)."""
    import torch

    from drafter.features.capture import resolve_layer_ids
    from drafter.train.model import Drafter, DrafterConfig

    ids = resolve_layer_ids(cfg.extract.layer_ids, target.num_layers(config))
    dc = DrafterConfig.from_target(config, cfg.vocab.draft_vocab_size, ids,
                                   intermediate_size=cfg.train.intermediate_size,
                                   fc_norm=cfg.train.fc_norm)
    with torch.device("meta"):
        d = Drafter(dc)
    total = sum(p.numel() for p in d.parameters())
    trainable = sum(p.numel() for p in d.parameters() if p.requires_grad)
    return {"trainable": trainable, "total": total, "hidden_size": dc.hidden_size,
            "intermediate_size": dc.intermediate_size, "draft_vocab_size": dc.draft_vocab_size,
            "layer_ids": ids}


def train_gpu_bytes(cfg, dshape: dict, gpus: int, ht: int, n_aux: int = 3) -> dict:
    """One rank of train: fp32 weights + grads + AdamW moments of the trainable parameters
    (16 bytes each, sharded over ranks under FSDP), the frozen embedding (fp32), and
    activations kept for backward over ttt_steps: per token and step ~ (10 H + 3 I) bf16 values
    (norms, attention q/k/v/o, MLP), the aux input 3 Ht, one [tokens, Vd] fp32 teacher; online,
    the captured features of the micro-batches in flight (3 x train.online_group + 1: queued,
    being captured, in use), bf16 aux states and the teacher as capture returns it; +25%. The
    target's own memory is extract's estimate, added by the caller."""
    tc = cfg.train
    shard = gpus if (tc.fsdp and gpus > 1) else 1
    states = dshape["trainable"] * 16 // shard
    frozen = (dshape["total"] - dshape["trainable"]) * 4
    H, I = dshape["hidden_size"], dshape["intermediate_size"]
    act = tc.batch_tokens * (tc.ttt_steps * (10 * H + 3 * I) + 3 * ht) * 2
    teacher = tc.batch_tokens * dshape["draft_vocab_size"] * 4
    features = 0
    if tc.online:  # teacher: hidden bf16 [Ht], or top-k int64 ids + fp32 log-probs
        per_token = n_aux * ht * 2 + (ht * 2 if cfg.extract.teacher == "hidden"
                                      else cfg.extract.topk * 12)
        features = (3 * tc.online_group + 1) * tc.batch_tokens * per_token
    total = int((states + frozen + act + teacher + features) * 1.25)
    return {"states": states, "frozen": frozen, "activations": act, "teacher": teacher,
            "online_features": features, "total": total}
