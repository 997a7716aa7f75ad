"""The EAGLE-3 drafter: one Llama-style decoder layer over fused target features, what an engine
runs; its config, layers, initialisation, and save/load. Training's K-step unroll (training-time
test, TTT) and its loss are in drafter/train/ttt.py.

Shapes:
    B batch rows, T tokens per row, P cached tokens, H drafter hidden, Ht target hidden,
    V target vocab, Vd draft vocab, nh query heads, nkv key/value heads, hd head dim, g = nh/nkv,
    I MLP size, K training-time-test steps, N rows that count in the loss, k teacher top-k.

    aux [B, T, 3, Ht] --fc_norm?--> [B, T, 3·Ht] --fc--> h [B, T, H]
    emb = embed_tokens(input_ids) [B, T, H]      (frozen copy of the target's embeddings)
    midlayer: x = cat(input_layernorm(emb), hidden_norm(h)) [B, T, 2H]
              h = h + o_proj(attn(q_proj(x), k_proj(x), v_proj(x)))   (residual on h:
                                                  norm_before_residual=False, what SGLang runs)
              h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h)) [B, T, Vd];  draft id i is target id i + d2t[i]

Parameter and buffer names are the engines' own (ENGINES.md): `fc`, `midlayer.*`, `norm`,
`lm_head`, `d2t`, `t2d`, `embed_tokens`, so export copies instead of translating.

Alignment (DESIGN.md): at position t, aux of token t and the embedding of token t+1 learn the
teacher of t+1; the shift is written once, in `drafter.train.batches.align`.

Its shape and RoPE from the target, and the two draft-layer attentions (llama, mla):
docs/internals.md, "Module notes".
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from drafter.train.mla import MLAAttention


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int                   # target vocab V
    draft_vocab_size: int             # Vd
    target_hidden_size: int           # Ht
    aux_layer_ids: list[int]          # drafter convention: id k = HS[k] (DESIGN.md)
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # the target's (rope_type, factor, ...) or None: from_target
    max_position_embeddings: int = 4096
    norm_before_residual: bool = False
    fc_norm: bool = False             # EAGLE-3.1: RMSNorm each aux state before fc
    norm_output: bool = False         # EAGLE-3.1: TTT feeds back the post-norm state
    norm_before_fc: bool = False      # written out for the engines; drafter trains with False
    # The draft layer's attention: "llama" (q/k/v/o_proj, every engine) or "mla" (DeepSeek's
    # latent attention, drafter/train/mla.py; vLLM's and SGLang's Eagle3DeepseekV2ForCausalLM)
    # with the five sizes below (the target's unless overridden; None for llama).
    draft_layer: str = "llama"
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    @property
    def rope_dim(self) -> int:
        """The width RoPE rotates: a whole head (llama), the rope part of one (mla)."""
        return self.qk_rope_head_dim if self.draft_layer == "mla" else self.head_dim

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, aux_layer_ids: list[int],
                    draft_layer: str = "llama", mla: dict | None = None,
                    **overrides) -> "DrafterConfig":
        """Drafter shaped like the target's decoder layers (H = Ht unless overridden). With
        draft_layer "mla", the latent sizes are the target's, or `mla`'s where given."""
        from drafter.train.mla import latent_sizes

        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") \
            else target_config
        rope = dict(getattr(tc, "rope_parameters", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(tc, "rope_theta", None) or 10000.0
        if not rope and getattr(tc, "rope_scaling", None):  # transformers 4.x configs
            rope = {k: v for k, v in tc.rope_scaling.items() if k != "rope_theta"}
        scaling = llama_rope_scaling(rope)
        if (mla_rope_problem if draft_layer == "mla" else rope_problem)(scaling):
            scaling = None  # plain RoPE at the target's theta: the same in every engine
        elif draft_layer == "mla" and scaling:  # DeepSeek's own spelling, transformers' yarn
            scaling["rope_type"] = "yarn"
        heads = tc.num_attention_heads
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
        if getattr(tc, "kv_lora_rank", None):  # MLA: head_dim is only the rope part of a query
            head_dim = getattr(tc, "v_head_dim", None) or getattr(tc, "qk_nope_head_dim", None) \
                or head_dim
        kw = dict(
            hidden_size=tc.hidden_size,
            intermediate_size=getattr(tc, "intermediate_size", None) or 4 * tc.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=tc.vocab_size,
            draft_vocab_size=min(draft_vocab_size, tc.vocab_size),
            target_hidden_size=tc.hidden_size,
            aux_layer_ids=list(aux_layer_ids),
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=getattr(tc, "max_position_embeddings", 4096),
        )
        if draft_layer == "mla":
            sizes = {**latent_sizes(tc), **{k: v for k, v in (mla or {}).items()
                                            if v is not None}}
            need = [k for k, v in sizes.items() if k != "q_lora_rank" and not v]
            if need:
                raise ValueError(f"draft_layer mla: the target has no {', '.join(need)} (not an "
                                 "MLA target): set them in train.mla")
            kw.update(draft_layer="mla", **sizes,
                      head_dim=sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"])
        elif draft_layer != "llama":
            raise ValueError(f"draft_layer must be llama or mla, got {draft_layer!r}")
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# The MLA backends' latent widths kv_lora_rank + qk_rope_head_dim (vLLM 0.32
# mla_attention.py:1601-1602; its CPU backend cpu_mla.py:61-64 takes 576 only).
MLA_LATENT_WIDTHS, CPU_MLA_WIDTH = (320, 512, 576), 576


def draft_layer_for(choice: str, target_config) -> str:
    """train.draft_layer resolved for a target: auto is mla for MLA targets (a config with
    kv_lora_rank: DeepSeek-V2/V3, Kimi-K2/K2.5) whose latent width vLLM's MLA backends take,
    llama otherwise: an MLA drafter no engine serves is not the better one (docs/train.md)."""
    if choice != "auto":
        return choice
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") \
        else target_config
    kv, rope = getattr(tc, "kv_lora_rank", None), getattr(tc, "qk_rope_head_dim", None)
    return "mla" if kv and rope and kv + rope in MLA_LATENT_WIDTHS else "llama"


# ------------------------------------------------------------------------------------- RoPE
# What a Llama layer computes for each RoPE form, in the transformers Llama code the drafter trains
# with and in the engines' (vLLM model_executor/layers/rotary_embedding: get_rope and
# yarn_scaling_rope.py; SGLang srt/layers/rotary_embedding: factory.py and yarn.py; both reach it
# through their llama.py attention, which llama_eagle3.py reuses). Engines that are not the
# newest read DeepSeek's YaRN keys differently: vLLM's single-file rotary_embedding.py and SGLang
# before its 2026 fix (PR 22711) ignore mscale / mscale_all_dim in a `yarn` block and scale
# cos and sin by 0.1·ln(factor) + 1, where transformers and the newest engines scale by the
# mscale ratio (docs/export.md works both out for Kimi-K2.5).
LLAMA_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
DEEPSEEK_YARN_KEYS = ("mscale", "mscale_all_dim")


def _yarn_mscale(factor: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def llama_rope_scaling(rope: dict | None) -> dict | None:
    """A config's RoPE scaling block as the drafter config keeps it: `type` spelled `rope_type`,
    no `rope_theta` (a field of its own), None for plain RoPE."""
    if not isinstance(rope, dict):
        return None
    s = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")}
    s["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return None if s["rope_type"] == "default" else s


def rope_problem(scaling: dict | None) -> str | None:
    """Why an engine's Llama layer would compute this RoPE scaling differently from training
    (transformers' Llama), naming the key; None when every engine computes it the same."""
    s = llama_rope_scaling(scaling)
    if s is None:
        return None
    kind = s["rope_type"]
    if kind in ("deepseek_yarn", "deepseek_llama_scaling"):
        return (f"rope_type {kind!r} is DeepSeek's MLA RoPE: transformers' Llama layer does not "
                "implement it, and engines pair it with a softmax scale a Llama layer lacks")
    if kind not in LLAMA_ROPE_TYPES:
        return (f"rope_type {kind!r}: not one that transformers' Llama layer and the engines' "
                f"Llama layers all implement ({', '.join(LLAMA_ROPE_TYPES)})")
    if kind != "yarn":
        return None
    keys = [k for k in DEEPSEEK_YARN_KEYS if s.get(k) is not None]
    if keys:
        f = float(s.get("factor") or 1.0)
        return (f"yarn with DeepSeek's {' and '.join(keys)}: transformers and the newest vLLM and "
                f"SGLang scale cos/sin by their ratio, while vLLM's single-file "
                f"rotary_embedding.py and SGLang before 2026 ignore them and scale by "
                f"0.1*ln(factor)+1 = {_yarn_mscale(f):.3f} (attention logits x "
                f"{_yarn_mscale(f) ** 2:.2f})")
    f = float(s.get("factor") or 1.0)
    af = s.get("attention_factor")
    if af is not None and not math.isclose(float(af), _yarn_mscale(f), rel_tol=1e-6):
        return (f"yarn attention_factor {af}: SGLang's yarn reads attn_factor, not "
                f"attention_factor, and older vLLM neither; they scale by 0.1*ln(factor)+1 = "
                f"{_yarn_mscale(f):.3f}")
    for k in ("attn_factor", "extrapolation_factor"):
        if s.get(k) is not None and float(s[k]) != 1.0:
            return (f"yarn {k} {s[k]}: SGLang reads it, transformers (training) and vLLM do not")
    return None


def mla_rope_problem(scaling: dict | None) -> str | None:
    """Why an MLA draft layer in the engines would compute this RoPE scaling differently from
    training; None when they compute it alike. vLLM's DeepseekV2MLAAttention turns every
    non-default type into deepseek_yarn (deepseek_llama_scaling when attention_factor is 1.0);
    SGLang's into deepseek_yarn: only plain RoPE and (DeepSeek's) YaRN mean what they say."""
    s = llama_rope_scaling(scaling)
    if s is None:
        return None
    if s["rope_type"] not in ("yarn", "deepseek_yarn"):
        return (f"rope_type {s['rope_type']!r}: the engines' MLA attention computes every "
                "scaled RoPE as DeepSeek's YaRN")
    if s.get("attention_factor") is not None:
        return ("yarn attention_factor: vLLM's MLA attention turns it into another RoPE "
                "(deepseek_llama_scaling at 1.0), SGLang's ignores it")
    return None


def _f32(t: torch.Tensor) -> torch.Tensor:
    """Compute precision: half types go to float32, float32/float64 stay (gradcheck runs in
    fp64)."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


class _RMSNormFn(torch.autograd.Function):
    """y = weight · (x / rms(x)), rounded to x's dtype as HF and the engines do. Saves x and
    1/rms only: autograd through the fp32 formula would keep two fp32 copies of x per norm."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        r = torch.rsqrt(_f32(x).pow(2).mean(-1, keepdim=True) + eps)           # [..., 1]
        ctx.save_for_backward(x, weight, r)
        return weight.to(x.dtype) * (_f32(x) * r).to(x.dtype)

    @staticmethod
    def backward(ctx, gy):
        x, weight, r = ctx.saved_tensors
        n = _f32(x) * r
        gw = None
        if ctx.needs_input_grad[1]:
            gw = (_f32(gy) * _f32(n.to(x.dtype))).reshape(-1, x.shape[-1]).sum(0)
            gw = gw.to(weight.dtype)
        gn = _f32(gy) * _f32(weight.to(x.dtype))
        gx = r * (gn - n * (gn * n).mean(-1, keepdim=True))
        return gx.to(x.dtype), gw, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # In x's dtype, as engines compute it with bf16 weights; fp32 master weights under
        # autocast would otherwise turn every normed activation (and what follows) into fp32.
        return _RMSNormFn.apply(x, self.weight, self.eps)


class Rotary(nn.Module):
    """cos/sin for any RoPE type, computed by transformers' own code so that they match the
    target's exactly (llama3, yarn, linear, dynamic ... scaling included)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
        lc = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                         head_dim=cfg.rope_dim, rope_parameters=rope,
                         max_position_embeddings=cfg.max_position_embeddings)
        self.inner = LlamaRotaryEmbedding(lc)

    def forward(self, x, position_ids):  # -> cos, sin [B, T, hd] (mla: [B, T, dr])
        return self.inner(x, position_ids)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """x [B, nh, T, hd]; cos/sin [B, T, hd]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, hd]
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.k_dim = self.v_dim = self.hd
        self.scale = None  # SDPA's default, hd^-1/2
        H2 = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(H2, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(H2, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(H2, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def qkv(self, x, cos, sin):
        """x [B, T, 2H] -> q [B, nh, T, hd], k, v [B, nkv, T, hd] (RoPE applied)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)   # [B, nh, T, hd]
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # [B, nkv, T, hd]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, o):
        """o [B, nh, T, hd] -> [B, T, H]."""
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))  # [B, T, H]


class _SwiGLUDown(torch.autograd.Function):
    """down_proj(silu(g) · u), saving g, u and the weight only: silu(g) · u, the [.., I] input of
    down_proj, is recomputed in backward (autograd would keep it and silu(g): 2 × [T, I] per TTT
    step)."""

    @staticmethod
    def forward(ctx, g, u, w):
        ctx.save_for_backward(g, u, w)
        act = (F.silu(_f32(g)) * _f32(u)).to(g.dtype)                           # [.., I]
        return F.linear(act, w)                                                 # [.., H]

    @staticmethod
    def backward(ctx, gy):
        g, u, w = ctx.saved_tensors
        gf, sig = _f32(g), torch.sigmoid(_f32(g))
        act = (gf * sig * _f32(u)).to(gy.dtype)
        gw = (gy.reshape(-1, gy.shape[-1]).T @ act.reshape(-1, act.shape[-1])).to(w.dtype)
        dact = _f32(gy @ w.to(gy.dtype))                                        # [.., I]
        dg = dact * _f32(u) * sig * (1 + gf * (1 - sig))
        return dg.to(g.dtype), (dact * gf * sig).to(u.dtype), gw


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        assert cfg.hidden_act == "silu", "only SwiGLU (silu) drafters are supported"

    def forward(self, x):
        return _SwiGLUDown.apply(self.gate_proj(x), self.up_proj(x), self.down_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg, RMSNorm, apply_rope) if cfg.draft_layer == "mla" \
            else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def pre_attention(self, emb, h):
        """-> x [B, T, 2H] (attention input), residual [B, T, H]."""
        hn = self.hidden_norm(h)
        x = torch.cat([self.input_layernorm(emb), hn], dim=-1)  # [B, T, 2H]
        return x, (hn if self.cfg.norm_before_residual else h)

    def post_attention(self, attn_out, residual):
        h = residual + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))  # [B, T, H]


def fuse(fc_norm: RMSNorm | None, fc: nn.Linear, aux: torch.Tensor) -> torch.Tensor:
    """aux [B, T, 3, Ht] -> h [B, T, H] (Drafter.fuse; shared with the TTT unroll)."""
    if fc_norm is not None:  # EAGLE-3.1: each aux state normed on its own, one weight row each
        a = aux.float()
        a = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + fc_norm.eps)
        aux = (fc_norm.weight * a).to(aux.dtype)                             # [B, T, 3, Ht]
    B, T = aux.shape[:2]
    dev = aux.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else fc.weight.dtype
    return fc(aux.reshape(B, T, -1).to(dt))                                  # [B, T, H]


class DraftVocab(nn.Module):
    """What every drafter kind shares about the target's table and the draft vocab: embed_tokens
    [V, H] (frozen, the target's), d2t [Vd], t2d [V] (buffers)."""

    @torch.no_grad()
    def reset_vocab(self) -> None:
        """The identity map: the draft vocab is the first Vd target tokens."""
        self.d2t.zero_()
        self.t2d.zero_()
        self.t2d[: self.cfg.draft_vocab_size] = True

    @torch.no_grad()
    def set_embeddings(self, weight: torch.Tensor) -> None:
        """Copy the target's input embeddings [V, H] (frozen)."""
        self.embed_tokens.weight.copy_(weight.to(self.embed_tokens.weight.dtype))

    @torch.no_grad()
    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)


class Drafter(DraftVocab):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        H, Ht = cfg.hidden_size, cfg.target_hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # copied from the target, frozen
        self.fc_norm = RMSNorm(Ht, cfg.rms_norm_eps) if cfg.fc_norm else None
        if cfg.fc_norm:  # one weight row per aux state: fc_norm.weight [3, Ht]
            self.fc_norm.weight = nn.Parameter(torch.ones(len(cfg.aux_layer_ids), Ht))
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * Ht, H, bias=False)
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.reset_parameters()

    # ----------------------------------------------------------------------------- initialisation
    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """All initialisation lives here: linears N(0, std), norms 1, embeddings N(0, std) until
        `set_embeddings` copies the target's; d2t = identity offsets until `set_vocab`."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
        nn.init.normal_(self.embed_tokens.weight, std=std)
        self.reset_vocab()

    # ---------------------------------------------------------------------------------- forward
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, T, 3, Ht] -> h [B, T, H]."""
        return fuse(self.fc_norm, self.fc, aux)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, T, H] (layer output, pre-norm) -> [B, T, Vd]."""
        return self.lm_head(self.norm(h))

    def feedback(self, h: torch.Tensor) -> torch.Tensor:
        """What the next drafting step receives as `h` (post-norm with norm_output)."""
        return self.norm(h) if self.cfg.norm_output else h

    def forward(self, input_ids, h, position_ids, past_kv=None, attn_mask=None):
        """One drafter pass over T new tokens with an optional KV cache (inference path).

        input_ids [B, T]; h [B, T, H] (fused aux, or fed-back states); position_ids [B, T];
        past_kv (k, v) each [B, nkv, P, hd] or None (mla: hd of k dqk, of v dv); attn_mask bool
        [B, 1, T, P+T] (True = attend) or None for causal. Returns (h_out [B, T, H],
        logits [B, T, Vd], (k, v) with P+T).
        """
        layer = self.midlayer
        emb = self.embed_tokens(input_ids).to(h.dtype)                  # [B, T, H]
        x, residual = layer.pre_attention(emb, h)                       # [B, T, 2H], [B, T, H]
        cos, sin = self.rotary(x, position_ids)
        q, k, v = layer.self_attn.qkv(x, cos, sin)
        if past_kv is not None:
            k = torch.cat([past_kv[0], k], dim=2)                       # [B, nkv, P+T, hd]
            v = torch.cat([past_kv[1], v], dim=2)
        causal = attn_mask is None and past_kv is None
        a = layer.self_attn
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal,
                                           scale=a.scale, enable_gqa=a.nh != a.nkv)
        if attn_mask is None and past_kv is not None and q.shape[2] > 1:
            raise ValueError("several new tokens over a cache need an explicit attn_mask")
        h_out = layer.post_attention(layer.self_attn.out(o), residual)  # [B, T, H]
        return h_out, self.logits(h_out), (k, v)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocab ids -> target vocab ids (target = i + d2t[i])."""
        return draft_ids + self.d2t[draft_ids]


def param_count(model: nn.Module, trainable_only: bool = True) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


# ------------------------------------------------------------------------------- save and load
CONFIG_FILE = "drafter_config.json"
WEIGHTS_FILE = "model.safetensors"


def save_drafter(model: Drafter, directory, dtype=None, state_dict: dict | None = None) -> None:
    """Our own layout (checkpoints): model.safetensors with the engines' tensor names plus
    drafter_config.json (DrafterConfig). Writes atomically; `directory` must exist.
    `state_dict` overrides entries of model.state_dict() (train passes the full weights
    gathered from FSDP shards)."""
    import json
    from pathlib import Path

    from drafter.core.rundir import atomic_write, safe_save_file

    d = Path(directory)
    sd = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
          .detach().contiguous().cpu()
          for k, v in {**model.state_dict(), **(state_dict or {})}.items()}
    safe_save_file(sd, d / WEIGHTS_FILE)
    atomic_write(d / CONFIG_FILE, json.dumps(model.cfg.to_dict(), indent=2) + "\n")


def load_drafter(directory, device="cpu", dtype=torch.float32) -> Drafter:
    """Inverse of save_drafter."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    d = Path(directory)
    cfg = DrafterConfig.from_dict(json.loads((d / CONFIG_FILE).read_text()))
    model = Drafter(cfg)
    sd = load_file(str(d / WEIGHTS_FILE))
    model.load_state_dict(sd, strict=True)
    return model.to(device=device, dtype=dtype)
