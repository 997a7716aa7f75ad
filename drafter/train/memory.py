"""The GPU memory of a train step, estimated before any weights load: `drafter plan` prints it,
and the precompile waits for room for it beside the target (extract's, or an online train's).
    dshape = drafter_shape(cfg, target_config)   # trainable/total parameters, H, I, Vd, layer ids,
                                                 # bytes per value of the frozen embedding
    train_gpu_bytes(cfg, dshape, gpus, ht)       # GPU bytes by part, their total, and the
                                                 # frozen embedding's host bytes
"""
from __future__ import annotations

from drafter.core import target


def embed_dtype_bytes(config) -> int:
    """Bytes per value of the frozen embedding table as train holds it:
    core.weights.target_embeddings reads the tensor from the safetensors as stored and
    build_drafter keeps that dtype, so it is config.json's dtype (bf16 where the config names
    none)."""
    dt = getattr(config, "dtype", None) or getattr(getattr(config, "text_config", None),
                                                   "dtype", None)
    return 4 if "32" in str(dt or "bfloat16") else 2


def drafter_shape(cfg, config) -> dict:
    """Trainable and frozen parameters of the drafter this config trains (meta device); the
    frozen ones are the embedding table [V, H], held at `embed_bytes` per value."""
    import torch

    from drafter.features.capture import layer_count, resolve_layer_ids
    from drafter.train.model import Drafter, DrafterConfig, draft_layer_for

    ids = resolve_layer_ids(cfg.extract.layer_ids, target.num_layers(config), layer_count(cfg))
    if cfg.train.method != "eagle3":
        return _block_shape(cfg, config, ids)
    dc = DrafterConfig.from_target(config, cfg.vocab.draft_vocab_size, ids,
                                   draft_layer=draft_layer_for(cfg.train.draft_layer, config),
                                   mla=cfg.train.mla,
                                   intermediate_size=cfg.train.intermediate_size,
                                   fc_norm=cfg.train.fc_norm)
    with torch.device("meta"):
        d = Drafter(dc)
    total = sum(p.numel() for p in d.parameters())
    trainable = sum(p.numel() for p in d.parameters() if p.requires_grad)
    return {"trainable": trainable, "total": total, "hidden_size": dc.hidden_size,
            "intermediate_size": dc.intermediate_size, "draft_vocab_size": dc.draft_vocab_size,
            "layer_ids": ids, "embed_bytes": embed_dtype_bytes(config),
            "draft_layer": dc.draft_layer, "attention_values": attention_values(dc)}


def _block_shape(cfg, config, ids) -> dict:
    """drafter_shape of a DSpark / DFlash drafter (meta device)."""
    import torch

    from drafter.train.dspark import DSpark, DSparkConfig

    bc = cfg.train.dspark
    dc = DSparkConfig.from_target(config, cfg.train.method,
                                  min(cfg.vocab.draft_vocab_size, target.vocab_size(config)),
                                  ids, bc.block_size, 0, bc.layers, markov_rank=bc.markov_rank,
                                  confidence_head=bc.confidence_head,
                                  intermediate_size=cfg.train.intermediate_size)
    with torch.device("meta"):
        d = DSpark(dc)
    return {"trainable": sum(p.numel() for p in d.parameters() if p.requires_grad),
            "total": sum(p.numel() for p in d.parameters()), "hidden_size": dc.hidden_size,
            "intermediate_size": dc.intermediate_size, "draft_vocab_size": dc.draft_vocab_size,
            "layer_ids": ids, "embed_bytes": embed_dtype_bytes(config), "draft_layer": "qwen3",
            "attention_values": 4 * dc.hidden_size, "method": cfg.train.method,
            "draft_layers": dc.num_hidden_layers}


def passes(tc) -> float:
    """The drafter's forwards a trained token costs, per layer: EAGLE-3's ttt_steps; a block
    drafter's block queries per row token (anchors × queries / max_length; the context's keys
    and values, made once a token, are small beside them), at least one."""
    if tc.method == "eagle3":
        return float(tc.ttt_steps)
    q = tc.dspark.block_size + (tc.method == "dflash")
    return max(1.0, tc.dspark.anchors * q / tc.max_length)


def attention_values(dc) -> int:
    """Values per token and TTT step that the draft layer's attention keeps for backward. Llama:
    q, k, v, o, counted as 4 H (the `10 H` of train_gpu_bytes holds them). MLA: its latents
    (q_lora_rank, kv_lora_rank + qk_rope_head_dim), q and k expanded to nh·dqk each, v and o
    to nh·dv each."""
    if dc.draft_layer != "mla":
        return 4 * dc.hidden_size
    nh, dqk = dc.num_attention_heads, dc.qk_nope_head_dim + dc.qk_rope_head_dim
    return ((dc.q_lora_rank or 0) + dc.kv_lora_rank + dc.qk_rope_head_dim
            + 2 * nh * dqk + 2 * nh * dc.v_head_dim)


def train_gpu_bytes(cfg, dshape: dict, gpus: int, ht: int, n_aux: int = 3) -> dict:
    """One rank of train: fp32 weights + grads + AdamW moments of the trainable parameters
    (16 bytes each, sharded over ranks under FSDP); activations kept for backward over
    ttt_steps: per token and step ~ (6 H + A + 3 I) bf16 values (norms, their inputs including
    the step's gathered embeddings, the attention's A = attention_values: q/k/v/o, 4 H for a
    Llama layer, the latents and expanded heads for an MLA one; MLP), the aux input 3 Ht bf16,
    and the
    batch's token embeddings [tokens, H] as the host ships them, at the table's dtype; one
    [tokens, Vd] fp32 teacher; online, the captured features of the micro-batches in flight
    (3 x train.online_group + 1: queued, being captured, in use), bf16 aux states and the
    teacher as capture returns it; +25%. The target's own memory is extract's estimate, added
    by the caller.
    Not on the GPU: the frozen embedding table [V, H] stays in host memory (setup_model moves
    only the trainable modules; host_batches looks the rows up there), at the dtype train holds
    it (dshape's embed_bytes, from drafter_shape; 2, bf16, where the shape does not say):
    `host_embedding`, outside `total`."""
    tc = cfg.train
    shard = gpus if (tc.fsdp and gpus > 1) else 1
    states = dshape["trainable"] * 16 // shard
    emb_bytes = dshape.get("embed_bytes", 2)
    host_embedding = (dshape["total"] - dshape["trainable"]) * emb_bytes
    H, I = dshape["hidden_size"], dshape["intermediate_size"]
    attn = dshape.get("attention_values", 4 * H)   # MLA: its own (attention_values)
    layers = dshape.get("draft_layers", 1)
    act = tc.batch_tokens * (passes(tc) * layers * (6 * H + attn + 3 * I) + n_aux * ht) * 2 \
        + tc.batch_tokens * H * emb_bytes
    teacher = tc.batch_tokens * dshape["draft_vocab_size"] * 4
    features = 0
    if tc.online:  # teacher: hidden bf16 [Ht], or top-k int64 ids + fp32 log-probs
        per_token = n_aux * ht * 2 + (ht * 2 if cfg.extract.teacher == "hidden"
                                      else cfg.extract.topk * 12)
        features = (3 * tc.online_group + 1) * tc.batch_tokens * per_token
    total = int((states + act + teacher + features) * 1.25)
    return {"states": states, "activations": act, "teacher": teacher,
            "online_features": features, "total": total, "host_embedding": host_embedding}
