"""The MLA draft layer's attention: DeepSeek-V2/V3 multi-head latent attention over the EAGLE-3
input [B, T, 2H], as vLLM's `Eagle3DeepseekV2ForCausalLM` (deepseek_eagle3.py) and SGLang's
Kimi MLA draft model run it. drafter/train/model.py picks it with `draft_layer: mla`; the rest of
the layer (norms, residual, SwiGLU MLP, fc, lm_head) is the Llama layer's.

Shapes (model.py's legend, plus): qr q_lora_rank, kr kv_lora_rank, dn qk_nope_head_dim, dr
qk_rope_head_dim, dv v_head_dim, dqk = dn + dr.

    x [B, T, 2H]
    q  = q_b_proj(q_a_layernorm(q_a_proj(x)))          [B, T, nh·dqk]   (q_proj(x) when qr is None)
    c, k_pe = kv_a_proj_with_mqa(x).split([kr, dr])   [B, T, kr], [B, T, dr]   (the cached latent)
    k_nope, v = kv_b_proj(kv_a_layernorm(c))          [B, T, nh·(dn+dv)] -> dn and dv per head
    q = cat(q_nope, rope(q_pe)), k = cat(k_nope, rope(k_pe) shared by all heads)
    attention at DeepSeek's score scale (`softmax_scale`) -> o [B, nh, T, dv] -> o_proj -> [B, T, H]

The engines compute the same in the absorbed form at decode (kv_b_proj folded into q and o:
they cache c and k_pe only, kr + dr values a token); training expands the latent into per-head
keys and values, which is the same arithmetic and what the engines run at prefill.

RoPE: DeepSeek's. It rotates interleaved pairs (vLLM get_rope(is_neox_style=False), transformers'
DeepseekV3 `rope_interleave`), so the rope part is de-interleaved first, then rotated as the Llama
layer rotates (the q·k dot products are the same). cos/sin are transformers' (model.Rotary over
dr): its `yarn` reads DeepSeek's mscale / mscale_all_dim as vLLM's `deepseek_yarn` does, and the
score scale takes mscale(factor, mscale_all_dim)² on top of dqk^-1/2, as vLLM's
DeepseekV2MLAAttention and transformers' DeepseekV3Attention do. docs/export.md cites the lines.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def _mscale(factor: float, m: float) -> float:
    """DeepSeek's yarn_get_mscale."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def softmax_scale(cfg) -> float:
    """dqk^-1/2, times mscale(factor, mscale_all_dim)² under a non-default RoPE scaling (vLLM
    deepseek_v2.py DeepseekV2MLAAttention: every non-default type becomes deepseek_yarn)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    s = cfg.rope_scaling or {}
    if s.get("rope_type", "default") != "default" and s.get("mscale_all_dim"):
        scale *= _mscale(float(s.get("factor") or 1.0), float(s["mscale_all_dim"])) ** 2
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] with pairs (2i, 2i+1) -> evens then odds: interleaved RoPE as rotate-half."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)                     # [..., d]


class MLAAttention(nn.Module):
    """The interface of model.Attention: qkv(x, cos, sin) -> q, k [B, nh, T, dqk], v [B, nh, T,
    dv] (RoPE applied); out(o [B, nh, T, dv]) -> [B, T, H]; nh = nkv (the expanded latent);
    k_dim, v_dim; `scale` the score scale."""

    def __init__(self, cfg, rms_norm, apply_rope):
        """rms_norm, apply_rope: model.py's RMSNorm and apply_rope (handed in: this module does
        not import model.py, which imports it)."""
        super().__init__()
        RMSNorm, self.apply_rope = rms_norm, apply_rope
        H2 = 2 * cfg.hidden_size
        self.nh = self.nkv = cfg.num_attention_heads
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kr, self.qr = cfg.kv_lora_rank, cfg.q_lora_rank
        self.k_dim, self.v_dim = self.dn + self.dr, self.dv
        self.scale = softmax_scale(cfg)
        if self.qr:
            self.q_a_proj = nn.Linear(H2, self.qr, bias=False)
            self.q_a_layernorm = RMSNorm(self.qr, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.qr, self.nh * self.k_dim, bias=False)
        else:
            self.q_proj = nn.Linear(H2, self.nh * self.k_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H2, self.kr + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kr, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kr, self.nh * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(self.nh * self.dv, cfg.hidden_size, bias=False)

    def qkv(self, x, cos, sin):
        """x [B, T, 2H]; cos/sin [B, T, dr] -> q, k [B, nh, T, dqk], v [B, nh, T, dv]."""
        apply_rope = self.apply_rope
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.qr else self.q_proj(x)
        q = q.view(B, T, self.nh, self.k_dim).transpose(1, 2)                  # [B, nh, T, dqk]
        q_nope, q_pe = q.split([self.dn, self.dr], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kr, self.dr], dim=-1)  # [B,T,kr], [B,T,dr]
        kv = self.kv_b_proj(self.kv_a_layernorm(c))                            # [B, T, nh·(dn+dv)]
        kv = kv.view(B, T, self.nh, self.dn + self.dv).transpose(1, 2)        # [B, nh, T, dn+dv]
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        q_pe = apply_rope(deinterleave(q_pe), cos, sin)                        # [B, nh, T, dr]
        k_pe = apply_rope(deinterleave(k_pe)[:, None], cos, sin)              # [B, 1, T, dr]
        q = torch.cat([q_nope, q_pe], dim=-1)                                  # [B, nh, T, dqk]
        k = torch.cat([k_nope, k_pe.expand(B, self.nh, T, self.dr)], dim=-1)   # [B, nh, T, dqk]
        return q, k, v

    def out(self, o):
        """o [B, nh, T, dv] -> [B, T, H]."""
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.dv))  # [B, T, H]


def latent_sizes(tc) -> dict:
    """The MLA sizes of a target config (q_lora_rank may be None: a plain q_proj)."""
    return {k: getattr(tc, k, None) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                              "qk_rope_head_dim", "v_head_dim")}
