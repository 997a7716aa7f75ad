"""Tiny random targets of real architectures, built in tests (no download).

    path = make_tiny("deepseek_v3", tmp_path, tokenizer_dir=smollm2_dir)

Each is saved as a normal HF folder (config.json + safetensors, plus the SmolLM2 tokenizer when
given) so that it loads through drafter.core.target like any user model."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 49152  # the SmolLM2 tokenizer's, so the folders can carry it

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              tie_word_embeddings=False)

ARCHS = {
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "decoder_sparse_step": 1}),
    "deepseek_v3": ("DeepseekV3Config", {
        "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
        "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
        "num_key_value_heads": 4}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 32}),
}


def make_tiny(arch: str, out: Path, tokenizer_dir: Path | None = None, seed: int = 0,
              **overrides) -> Path:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cls_name, extra = ARCHS[arch]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    out = Path(out) / arch
    model.save_pretrained(out)
    if tokenizer_dir is not None:
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out
