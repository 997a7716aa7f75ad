"""The EAGLE-3 drafter: one Llama-style decoder layer over fused target features, and its
training-time-test (TTT) unroll with the loss.

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

Alignment (DESIGN.md): at position t the drafter sees aux features of token t and the embedding of
token t+1, and learns the target distribution at t+1 (the teacher of position t+1). The shift is
written once, in `drafter.steps.train.align`; this file takes its result (`src`, `rows`).

Training-time test (`TTT`, EAGLE-3 paper §3.2): the drafter is unrolled K steps as it drafts at
inference. Step 0 is the plain forward above. Step i > 0 at position t embeds the token i further
on (`src[i]`), takes the drafter's own step-(i-1) output at t as `h` (`feedback`: post-norm with
norm_output), sits at RoPE position pos(t) + i, and attends to the step-0 keys of its sample
causally plus the keys that steps 1..i computed at the same position t (the "diagonal"): exactly
the KV cache it would have when drafting token i+1 after position t. Two implementations:

    sdpa  exact, any device: keys of all steps concatenated [B, nkv, (i+1)·T, hd] under a dense
          mask [B, 1, T, (i+1)·T] (block 0 causal within the sample, blocks 1..i the identity),
          and the plain loss over materialised logits;
    flex  fast GPU path: FlexAttention over the step-0 keys only, with one block mask per batch
          reused by every step, returning its log-sum-exp; the i diagonal scores are one dot
          product per position, merged with it by their log-sum-exps (nothing recomputed across
          steps, no O(T²) mask). The loss is fused with lm_head in row chunks: logits never
          exist for the whole batch, and their gradients are formed in the forward.

Both give the same loss and gradients (tests/test_model.py).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


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
    rope_scaling: dict | None = None  # exactly the target's (rope_type, factor, ...), or None
    max_position_embeddings: int = 4096
    norm_before_residual: bool = False
    fc_norm: bool = False             # EAGLE-3.1: RMSNorm each aux state before fc
    norm_output: bool = False         # EAGLE-3.1: TTT feeds back the post-norm state
    norm_before_fc: bool = False      # written out for the engines; drafter trains with False

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, aux_layer_ids: list[int],
                    **overrides) -> "DrafterConfig":
        """Drafter shaped like the target's decoder layers (H = Ht unless overridden)."""
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") \
            else target_config
        rope = dict(getattr(tc, "rope_parameters", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(tc, "rope_theta", None) or 10000.0
        if not rope and getattr(tc, "rope_scaling", None):  # transformers 4.x configs
            rope = {k: v for k, v in tc.rope_scaling.items() if k != "rope_theta"}
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" \
            else None
        heads = tc.num_attention_heads
        kw = dict(
            hidden_size=tc.hidden_size,
            intermediate_size=getattr(tc, "intermediate_size", None) or 4 * tc.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
            vocab_size=tc.vocab_size,
            draft_vocab_size=min(draft_vocab_size, tc.vocab_size),
            target_hidden_size=tc.hidden_size,
            aux_layer_ids=list(aux_layer_ids),
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=getattr(tc, "max_position_embeddings", 4096),
        )
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _f32(t: torch.Tensor) -> torch.Tensor:
    """Compute precision: half types go to float32, float32/float64 stay (gradcheck runs in fp64)."""
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
                         head_dim=cfg.head_dim, rope_parameters=rope,
                         max_position_embeddings=cfg.max_position_embeddings)
        self.inner = LlamaRotaryEmbedding(lc)

    def forward(self, x, position_ids):  # -> cos, sin [B, T, hd]
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
        self.self_attn = Attention(cfg)
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


class Drafter(nn.Module):
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
        past_kv (k, v) each [B, nkv, P, hd] or None; attn_mask bool [B, 1, T, P+T] (True =
        attend) or None for causal. Returns (h_out [B, T, H], logits [B, T, Vd], (k, v) with P+T).
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
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal,
                                           enable_gqa=layer.self_attn.nh != layer.self_attn.nkv)
        if attn_mask is None and past_kv is not None and q.shape[2] > 1:
            raise ValueError("several new tokens over a cache need an explicit attn_mask")
        h_out = layer.post_attention(layer.self_attn.out(o), residual)  # [B, T, H]
        return h_out, self.logits(h_out), (k, v)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocab ids -> target vocab ids (target = i + d2t[i])."""
        return draft_ids + self.d2t[draft_ids]

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]


def param_count(model: nn.Module, trainable_only: bool = True) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def attention_scale(cfg: DrafterConfig) -> float:
    return 1.0 / math.sqrt(cfg.head_dim)


# ------------------------------------------------------------------------ training-time test
def doc_causal(seq_id: torch.Tensor) -> Callable:
    """FlexAttention mask_mod: causal within one packed sample. seq_id [B, T] int (-1 = pad).
    The exact path evaluates the same function densely (`dense_mask`)."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (seq_id[b, q_idx] == seq_id[b, kv_idx])
    return mask_mod


def dense_mask(seq_id: torch.Tensor) -> torch.Tensor:
    """doc_causal evaluated on the whole grid -> bool [B, 1, T, T] (True = attend)."""
    B, T = seq_id.shape
    ar = torch.arange(T, device=seq_id.device)
    b = torch.arange(B, device=seq_id.device)[:, None, None]
    return doc_causal(seq_id)(b, None, ar[None, :, None], ar[None, None, :]).unsqueeze(1)


def attend_exact(q, ks, vs, mask0):
    """Step i = len(ks)-1 by definition: q [B, nh, T, hd]; ks, vs: i+1 tensors [B, nkv, T, hd]
    (step 0 first); mask0 [B, 1, T, T] -> [B, nh, T, hd]."""
    B, _, T, _ = q.shape
    eye = torch.eye(T, dtype=torch.bool, device=q.device).expand(B, 1, T, T)
    mask = torch.cat([mask0] + [eye] * (len(ks) - 1), dim=-1)              # [B, 1, T, (i+1)T]
    k, v = torch.cat(ks, dim=2), torch.cat(vs, dim=2)                      # [B, nkv, (i+1)T, hd]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                          enable_gqa=q.shape[1] != k.shape[1])


def merge_diagonal(q, o0, lse0, ks, vs, scale: float):
    """Add the diagonal keys of steps 1..i to attention over the step-0 keys.

    q [B, nh, T, hd]; o0 [B, nh, T, hd] and lse0 [B, nh, T] (fp32): attention output and
    log-sum-exp of the scores over the step-0 keys; ks, vs: the keys/values of steps 1..i, each
    [B, nkv, T, hd]. softmax over all keys = a convex mix of o0 (weight exp(lse0)) and each v_j
    (weight exp(q·k_j·scale)), so the result is exact."""
    if not ks:
        return o0
    return _MergeDiagonal.apply(q, o0, lse0, scale, len(ks), *ks, *vs)


class _MergeDiagonal(torch.autograd.Function):
    """merge_diagonal with its backward written out: saves the (bf16) inputs, which the
    attention keeps anyway, and the mixing weights [B, nkv, g, T, 1+i]; autograd would keep
    fp32 copies of q, o0 and q·k_j of [B, nh, T, hd] each."""

    @staticmethod
    def forward(ctx, q, o0, lse0, scale, i, *kv):
        ks, vs = kv[:i], kv[i:]
        B, nh, T, hd = q.shape
        nkv = ks[0].shape[1]
        g = nh // nkv
        qg = _f32(q).view(B, nkv, g, T, hd)                                      # [B, nkv, g, T, hd]
        s = [(qg * _f32(k).unsqueeze(2)).sum(-1) * scale for k in ks]          # i × [B, nkv, g, T]
        w = torch.stack([_f32(lse0).view(B, nkv, g, T)] + s, -1).softmax(-1)   # [B, nkv, g, T, 1+i]
        out = w[..., :1] * _f32(o0).view(B, nkv, g, T, hd)
        for j, v in enumerate(vs):
            out = out + w[..., j + 1:j + 2] * _f32(v).unsqueeze(2)
        ctx.save_for_backward(q, o0, w, *kv)
        ctx.scale, ctx.i = scale, i
        return out.view(B, nh, T, hd).to(q.dtype)

    @staticmethod
    def backward(ctx, gout):
        q, o0, w, *kv = ctx.saved_tensors
        i, scale = ctx.i, ctx.scale
        ks, vs = kv[:i], kv[i:]
        B, nh, T, hd = q.shape
        nkv = ks[0].shape[1]
        g = nh // nkv
        go = _f32(gout).view(B, nkv, g, T, hd)
        vals = [_f32(o0).view(B, nkv, g, T, hd)] + [_f32(v).unsqueeze(2) for v in vs]
        dw = torch.stack([(go * v).sum(-1) for v in vals], -1)                # [B, nkv, g, T, 1+i]
        ds = w * (dw - (w * dw).sum(-1, keepdim=True))                          # softmax backward
        qg = _f32(q).view(B, nkv, g, T, hd)
        dq = sum(ds[..., j + 1:j + 2] * _f32(k).unsqueeze(2) for j, k in enumerate(ks)) * scale
        dks = [((ds[..., j + 1:j + 2] * qg).sum(2) * scale).to(k.dtype) for j, k in enumerate(ks)]
        dvs = [(w[..., j + 1:j + 2] * go).sum(2).to(v.dtype) for j, v in enumerate(vs)]
        return (dq.view(B, nh, T, hd).to(q.dtype), (w[..., :1] * go).view(B, nh, T, hd)
                .to(o0.dtype), ds[..., 0].reshape(B, nh, T), None, None, *dks, *dvs)


_FLEX = {}


def flex_part0(seq_id: torch.Tensor, compiled: bool = True) -> Callable:
    """(q, k0, v0) -> (o [B, nh, T, hd], lse [B, nh, T] fp32) by FlexAttention under doc_causal,
    its block mask built once here (once per batch) and reused by all K steps. The compiled
    kernel is the fast one; uncompiled flex is a slow reference (and forward-only on CPU)."""
    from torch.nn.attention import flex_attention as fa

    B, T = seq_id.shape
    block_mask = fa.create_block_mask(doc_causal(seq_id), B, None, T, T, device=seq_id.device)
    if compiled and "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(fa.flex_attention, dynamic=False)
    fn = _FLEX["fn"] if compiled else fa.flex_attention
    aux_request = getattr(fa, "AuxRequest", None)  # torch >= 2.9; return_lse before

    def part0(q, k, v):
        gqa = q.shape[1] != k.shape[1]
        # q, k, v already carry the compute dtype; older torch has no autocast rule for flex
        with torch.autocast(q.device.type, enabled=False):
            if aux_request is not None:
                o, aux = fn(q, k, v, block_mask=block_mask, enable_gqa=gqa,
                            return_aux=aux_request(lse=True))
                return o, aux.lse
            return fn(q, k, v, block_mask=block_mask, enable_gqa=gqa, return_lse=True)
    return part0


# -------------------------------------------------------------------------------- the loss
def _teacher_rows(teacher: dict, rows: torch.Tensor):
    """Teacher log-probs of the given flat rows: dense [n, Vd], or top-k (ids, logp) [n, k]."""
    if "ids" in teacher:
        return teacher["ids"][rows], teacher["logp"][rows].float()
    return None, teacher["logp"][rows].float()


def _chunk_stats(z, ids, tl, w, grad_dtype=torch.float32):
    """One chunk of rows. z [c, Vd] fp32 drafter logits; w [c] row weights; teacher log-probs
    tl: dense [c, Vd], or top-k [c, k] at draft ids [c, k], read as store.teacher_logprobs
    reads them: the rest of the mass, 1 - Σ exp(tl), spread evenly over the other Vd - k ids.
    Soft cross-entropy against p with total mass P (≈ 1): ce = P·lse(z) - Σ p·z, dce/dz = P·q - p.
    -> grad_z [c, Vd] (times w, in grad_dtype), ce [c], correct [c] (argmax match), accept [c]
    (Σ min(p, q): the chance that a draft sampled from q is accepted by rejection sampling
    against p). Compiled on GPU: one pass over z instead of a dozen."""
    z = z.float()
    lse = z.logsumexp(-1, keepdim=True)                                      # [c, 1]
    q = (z - lse).exp()                                                      # [c, Vd]
    p = tl.exp()
    if ids is None:
        P = p.sum(-1, keepdim=True)
        ce = (P * lse).squeeze(-1) - (p * z).sum(-1)
        grad = (P * q - p) * w[:, None]
        t_arg = tl.argmax(-1)
        accept = torch.minimum(p, q).sum(-1)
    else:  # never builds the dense [c, Vd] teacher: only z-sized work
        vd, k = z.shape[-1], ids.shape[-1]
        rest = (1.0 - p.sum(-1, keepdim=True)).clamp_min(0.0)               # [c, 1]
        pt = rest.clamp_min(torch.finfo(torch.float32).tiny) / max(vd - k, 1)   # [c, 1]
        zk, qk = z.gather(-1, ids), q.gather(-1, ids)                        # [c, k]
        P = p.sum(-1, keepdim=True) + (vd - k) * pt
        pz = (p * zk).sum(-1) + pt.squeeze(-1) * (z.sum(-1) - zk.sum(-1))
        ce = (P * lse).squeeze(-1) - pz
        grad = ((P * q - pt) * w[:, None]).scatter_add(-1, ids, -(p - pt) * w[:, None])
        t_arg = ids.gather(-1, tl.argmax(-1, keepdim=True)).squeeze(-1)
        accept = (torch.minimum(q, pt).sum(-1) - torch.minimum(qk, pt).sum(-1)
                  + torch.minimum(qk, p).sum(-1))
    return grad.to(grad_dtype), ce, (z.argmax(-1) == t_arg).float(), accept


class FusedHeadLoss(torch.autograd.Function):
    """lm_head + soft cross-entropy in row chunks; the gradients are formed in the forward, so
    [N, Vd] logits never exist (EAGLE training is dominated by them at small H)."""

    @staticmethod
    def forward(ctx, hn, weight, w, teacher_ids, teacher_logp, trows, chunk, stats_fn,
                need_grad):
        N, dt = hn.shape[0], hn.dtype
        wc = weight.to(dt)                                                   # [Vd, H] at compute dtype
        grad_hn = torch.empty_like(hn) if need_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if need_grad else None
        ce, correct, accept = (hn.new_empty(N, dtype=torch.float32) for _ in range(3))
        teacher = {"logp": teacher_logp} if teacher_ids is None else \
            {"ids": teacher_ids, "logp": teacher_logp}
        for s in range(0, N, chunk):
            e = min(N, s + chunk)
            z = hn[s:e] @ wc.T                                               # [c, Vd]
            ids, tl = _teacher_rows(teacher, trows[s:e])
            g, ce[s:e], correct[s:e], accept[s:e] = stats_fn(z, ids, tl, w[s:e], dt)
            if need_grad:
                grad_hn[s:e] = g @ wc                                        # [c, H]
                grad_w.add_(g.T @ hn[s:e])  # [Vd, H]; promoted in the kernel, no fp32 temp
        ctx.save_for_backward(grad_hn, grad_w)
        ctx.weight_dtype = weight.dtype
        loss = (w * ce).sum()
        ctx.mark_non_differentiable(ce, correct, accept)
        return loss, ce, correct, accept

    @staticmethod
    def backward(ctx, g_loss, *_):
        grad_hn, grad_w = ctx.saved_tensors
        # scaled in place and handed over: autograd adopts them as the .grad, no second copy
        grad_hn.mul_(g_loss.to(grad_hn.dtype))
        grad_w.mul_(g_loss)
        return (grad_hn, grad_w.to(ctx.weight_dtype), None, None, None, None, None, None, None)


def head_loss(hn, weight, teacher: dict, trows, w, fused: bool, chunk: int = 0,
              stats_fn: Callable = _chunk_stats):
    """hn [N, H] post-norm states of the rows in the loss; weight [Vd, H] (lm_head); teacher
    {"logp": [M, Vd]} (store.teacher_logprobs) or, fused only, the top-k form {"ids": [M, k],
    "logp": [M, k]} over M teacher rows; trows [N] which teacher row each row learns; w [N] row
    weights (ttt_decay**step).
    -> (Σ w·ce, ce [N], correct [N], accept [N]); the last three carry no gradient."""
    if fused:
        chunk = chunk or max(256, (256 << 20) // (4 * weight.shape[0]))  # fp32 logits <= 256 MiB
        need_grad = torch.is_grad_enabled() and (hn.requires_grad or weight.requires_grad)
        return FusedHeadLoss.apply(hn, weight, w, teacher.get("ids"), teacher["logp"], trows,
                                   chunk, stats_fn, need_grad)
    if "ids" in teacher:
        raise ValueError("the exact loss takes a dense teacher (store.teacher_logprobs)")
    z = F.linear(hn, weight).float()                                         # [N, Vd]
    logq = z.log_softmax(-1)
    p = teacher["logp"][trows].float().exp()                                 # [N, Vd]
    ce = -(p * logq).sum(-1)
    t_arg = teacher["logp"][trows].argmax(-1)
    accept = torch.minimum(p, logq.exp()).sum(-1)
    correct = (z.argmax(-1) == t_arg).float()
    return (w * ce).sum(), ce.detach(), correct, accept.detach()


# ------------------------------------------------------------------------------- the unroll
class TTT(nn.Module):
    """The training forward: K-step unroll plus loss over a Drafter's trainable modules (shared,
    not copied). The frozen embeddings stay out: the caller passes `emb` = embed_tokens of the
    row's tokens, looked up where the table lives (the CPU for a 128k-vocab target), so neither
    DDP nor FSDP holds or syncs them.

    forward(aux [B, T, 3, Ht], emb [B, T, H], position_ids [B, T], seq_id [B, T], src [K, B, T],
            rows [N], trows [N], weights [N], teacher) -> dict
      src[i, b, t]: the token position that step i embeds at (b, t); rows: flat indices into
      [K, B, T] of the positions in the loss; trows: their teacher rows in [B·T]; weights: their
      loss weights; teacher: {"logp": [B·T, Vd]} or {"ids", "logp": [B·T, k]}.
      Returns loss = Σ weights·ce (differentiable) and per-row ce, correct, accept [N].
    """

    def __init__(self, drafter: "Drafter", attention: str = "sdpa", compile: bool = False,
                 loss_chunk: int = 0):
        super().__init__()
        if attention not in ("sdpa", "flex"):
            raise ValueError(f"attention must be sdpa or flex, got {attention!r}")
        self.cfg = drafter.cfg
        self.fc_norm, self.fc, self.midlayer = drafter.fc_norm, drafter.fc, drafter.midlayer
        self.norm, self.lm_head, self.rotary = drafter.norm, drafter.lm_head, drafter.rotary
        self.attention, self.loss_chunk, self.compiled = attention, loss_chunk, compile
        self.scale = attention_scale(self.cfg)
        self.pre_fn, self.post_fn, self.merge_fn, self.stats_fn = \
            self.pre, self.post, merge_diagonal, _chunk_stats
        if compile:  # rows are padded to max_length, so shapes are static for a run
            import torch._dynamo
            torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
            self.pre_fn, self.post_fn, self.merge_fn, self.stats_fn = (
                torch.compile(f, dynamic=False)
                for f in (self.pre, self.post, merge_diagonal, _chunk_stats))

    def pre(self, h, emb, cos, sin):
        """h, emb [B, T, H] -> q [B, nh, T, hd], k, v [B, nkv, T, hd], residual [B, T, H]."""
        x, residual = self.midlayer.pre_attention(emb, h)                   # [B, T, 2H], [B, T, H]
        return (*self.midlayer.self_attn.qkv(x.to(h.dtype), cos, sin), residual)

    def post(self, o, residual):
        """o [B, nh, T, hd] -> h_out (layer output), hn = norm(h_out), each [B, T, H]."""
        h_out = self.midlayer.post_attention(self.midlayer.self_attn.out(o), residual)
        return h_out, self.norm(h_out)

    def forward(self, aux, emb, position_ids, seq_id, src, rows, trows, weights, teacher,
                part0: Callable | None = None):
        K = src.shape[0]
        h = fuse(self.fc_norm, self.fc, aux)                                 # [B, T, H]
        B, T, H = h.shape
        pos = position_ids[:, None, :] + torch.arange(K, device=h.device)[None, :, None]
        cos, sin = self.rotary(h, pos.reshape(B, K * T))                     # [B, K·T, hd]
        cos, sin = cos.view(B, K, T, -1), sin.view(B, K, T, -1)              # [B, K, T, hd]
        if self.attention == "sdpa":
            mask0 = dense_mask(seq_id)                                       # [B, 1, T, T]
        else:
            part0 = part0 or flex_part0(seq_id, compiled=self.compiled or seq_id.is_cuda)
        ks, vs, outs = [], [], []
        for i in range(K):
            emb_i = emb.gather(1, src[i].unsqueeze(-1).expand(B, T, H)).to(h.dtype)  # [B, T, H]
            q, k, v, residual = self.pre_fn(h, emb_i, cos[:, i], sin[:, i])
            ks.append(k)
            vs.append(v)
            if self.attention == "sdpa":
                o = attend_exact(q, ks, vs, mask0)
            else:
                o0, lse0 = part0(q, ks[0], vs[0])
                o = self.merge_fn(q, o0, lse0, ks[1:], vs[1:], self.scale)
            h_out, hn = self.post_fn(o, residual)
            outs.append(hn.reshape(B * T, H))
            h = hn if self.cfg.norm_output else h_out  # = Drafter.feedback(h_out), norm reused
        hn_rows = torch.cat(outs, 0)[rows]                                   # [N, H]
        loss, ce, correct, accept = head_loss(
            hn_rows, self.lm_head.weight, teacher, trows, weights,
            fused=self.attention == "flex", chunk=self.loss_chunk, stats_fn=self.stats_fn)
        return {"loss": loss, "ce": ce, "correct": correct, "accept": accept}


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

    from .rundir import atomic_write, safe_save_file

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
