"""The parallel block drafters, DSpark and DFlash, in one file: what vLLM runs
(`model_executor/models/qwen3_dflash.py`, `qwen3_dspark.py`), its config, initialisation, and
save/load. Their training objective (anchors, the block mask, the loss) is
drafter/train/dspark_objective.py; docs/train.md says when to pick which kind.

Shapes:
    B batch rows, P context tokens, Q block queries, H drafter hidden, Ht target hidden,
    L target layers read, V target vocab, Vd draft vocab, nh / nkv heads, hd head dim,
    K tokens a block drafts, r Markov rank, N rows that count in the loss.

    context:  aux [B, P, L, Ht] --fc--> c [B, P, H] --hidden_norm--> cn
              every layer l: k_l = rope(k_norm(k_proj_l(cn))), v_l = v_proj_l(cn)  [B, nkv, P, hd]
              (the context never runs through the layers: its keys and values are made once)
    block:    x = embed_tokens(block ids) [B, Q, H]: the last accepted token (the anchor), then
              the mask token; positions continue the context's
              each layer: x += o_proj(attn(q, [k_ctx; k_blk], [v_ctx; v_blk]))  (no causal mask
              inside the block), x += mlp(post_attention_layernorm(x)); Qwen3 layers (q_norm,
              k_norm per head)
    logits:   hn = norm(x) [B, Q, H];  z = lm_head(hn) [B, Q, Vd]
              DSpark: z += markov_w2(markov_w1[prev]) with prev the token before the drafted
              one (the anchor, then each draft): sampled left to right; conf = sigmoid(
              confidence_head.proj(cat(hn, markov_w1[prev]))) the draft's chance of acceptance

The two kinds' block layouts, and the parameter names (vLLM's): docs/internals.md, "Module notes".
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from drafter.train.model import (
    CONFIG_FILE,
    MLP,
    WEIGHTS_FILE,
    DrafterConfig,
    DraftVocab,
    RMSNorm,
    Rotary,
    apply_rope,
    load_drafter,
)

METHODS = ("dflash", "dspark")


@dataclass
class DSparkConfig:
    method: str                       # "dspark" or "dflash"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int            # draft layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int                   # target vocab V
    draft_vocab_size: int             # Vd
    target_hidden_size: int           # Ht
    target_layer_ids: list[int]       # drafter convention: id k = HS[k] (DESIGN.md)
    block_size: int                   # K: tokens one block drafts
    mask_token_id: int                # the id whose (frozen) embedding fills the masked queries
    markov_rank: int = 0              # r; 0: no Markov head (DFlash)
    confidence_head: bool = False
    confidence_with_markov: bool = True
    anchor_predicts: bool = True      # DSpark's layout; False: DFlash's fill-in block
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    rope_theta: float = 1000000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    draft_layer: str = "llama"        # Rotary reads it (rope_dim): the layers are Qwen3's

    @property
    def rope_dim(self) -> int:
        return self.head_dim

    @property
    def queries(self) -> int:
        """Q: queries of one block (the anchor included)."""
        return self.block_size if self.anchor_predicts else self.block_size + 1

    @classmethod
    def from_target(cls, target_config, method: str, draft_vocab_size: int,
                    target_layer_ids: list[int], block_size: int, mask_token_id: int,
                    layers: int, markov_rank: int = 0, confidence_head: bool = False,
                    **overrides) -> "DSparkConfig":
        """Shaped like the target's decoder layers, as DrafterConfig.from_target shapes an
        EAGLE-3 layer (heads, head dim, the RoPE every engine computes alike)."""
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        e = DrafterConfig.from_target(target_config, draft_vocab_size, target_layer_ids)
        kw = dict(method=method, hidden_size=e.hidden_size,
                  intermediate_size=e.intermediate_size, num_hidden_layers=layers,
                  num_attention_heads=e.num_attention_heads,
                  num_key_value_heads=e.num_key_value_heads, head_dim=e.head_dim,
                  vocab_size=e.vocab_size, draft_vocab_size=e.draft_vocab_size,
                  target_hidden_size=e.target_hidden_size,
                  target_layer_ids=list(target_layer_ids), block_size=block_size,
                  mask_token_id=mask_token_id,
                  markov_rank=markov_rank if method == "dspark" else 0,
                  confidence_head=confidence_head and method == "dspark",
                  anchor_predicts=method == "dspark", rms_norm_eps=e.rms_norm_eps,
                  rope_theta=e.rope_theta, rope_scaling=e.rope_scaling,
                  max_position_embeddings=e.max_position_embeddings)
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DSparkConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def default_target_layers(n_layers: int, count: int) -> list[int]:
    """`count` target layers spread from the second to the fourth-last, in the HS[k] meaning:
    the DFlash recipe's layer outputs round(1 + i·(N-4)/(count-1)) (for a 36-layer target and 5:
    outputs 1, 9, 17, 25, 33), each +1 (the output of layer k enters layer k+1)."""
    if count < 1:
        raise ValueError("count must be at least 1")
    if count == 1:
        return [min(2, n_layers)]
    start, end = 1, max(n_layers - 3, 2)
    outs = sorted({round(start + i * (end - start) / (count - 1)) for i in range(count)})
    return [o + 1 for o in outs]


# ------------------------------------------------------------------------------------- layers
class Attention(nn.Module):
    """Qwen3 attention: q/k/v/o projections, RMSNorm per head on q and k before RoPE."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        H, self.nh, self.nkv, self.hd = (cfg.hidden_size, cfg.num_attention_heads,
                                         cfg.num_key_value_heads, cfg.head_dim)
        self.q_proj = nn.Linear(H, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, H, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def kv(self, x, cos, sin):
        """x [B, T, H] -> k, v [B, nkv, T, hd] (k normed, RoPE applied)."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)    # [B, nkv, T, hd]
        return apply_rope(k, cos, sin), v

    def q(self, x, cos, sin):
        """x [B, T, H] -> q [B, nh, T, hd] (normed, RoPE applied)."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.nh, self.hd)).transpose(1, 2)
        return apply_rope(q, cos, sin)

    def forward(self, x, cos, sin, ctx_kv, mask):
        """x [B, Q, H] block queries; ctx_kv (k, v) [B, nkv, P, hd]; mask bool
        [B, 1, Q, P+Q] (True = attend), None (all), or a function (q, k, v) -> o that attends
        (training's FlexAttention) -> [B, Q, H]."""
        B, Q, _ = x.shape
        q = self.q(x, cos, sin)
        k, v = self.kv(x, cos, sin)
        k = torch.cat([ctx_kv[0].to(k.dtype), k], dim=2)                     # [B, nkv, P+Q, hd]
        v = torch.cat([ctx_kv[1].to(v.dtype), v], dim=2)
        if callable(mask):
            o = mask(q, k, v)                                                # [B, nh, Q, hd]
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                               enable_gqa=self.nh != self.nkv)
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, self.nh * self.hd))  # [B, Q, H]


class Layer(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, ctx_kv, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))                 # [B, Q, H]


class MarkovHead(nn.Module):
    """The previous token's bias on the next draft's logits, low rank: markov_w1 [V, r] embeds
    it (target vocab), markov_w2 [Vd, r] projects to the draft vocab."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
        self.markov_w2 = nn.Linear(cfg.markov_rank, cfg.draft_vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    """A draft's chance of acceptance given the earlier ones (vLLM's adaptive verification
    multiplies them along a block), as a logit: proj(cat(hn, markov embedding)), in float32."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        width = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_with_markov else 0)
        self.proj = nn.Linear(width, 1, bias=True)


# --------------------------------------------------------------------------------------- model
class DSpark(DraftVocab):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.cfg = cfg
        H, Ht, L = cfg.hidden_size, cfg.target_hidden_size, len(cfg.target_layer_ids)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # copied from the target, frozen
        self.fc = nn.Linear(L * Ht, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.markov_head = MarkovHead(cfg) if cfg.markov_rank else None
        self.confidence_head = ConfidenceHead(cfg) if cfg.confidence_head else None
        self.rotary = Rotary(cfg)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """All initialisation lives here: linears N(0, std), norms 1, embeddings N(0, std) until
        `set_embeddings`, the Markov head zero (the block starts as its backbone alone),
        the confidence head zero, d2t identity offsets until `set_vocab`."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
        nn.init.normal_(self.embed_tokens.weight, std=std)
        if self.markov_head is not None:
            nn.init.normal_(self.markov_head.markov_w1.weight, std=std)
            self.markov_head.markov_w2.weight.zero_()
        if self.confidence_head is not None:
            self.confidence_head.proj.weight.zero_()
        self.reset_vocab()

    @torch.no_grad()
    def set_head(self, weight: torch.Tensor) -> None:
        """Start lm_head from the target's rows of the draft vocab [Vd, Ht] (H = Ht only)."""
        if tuple(weight.shape) == tuple(self.lm_head.weight.shape):
            self.lm_head.weight.copy_(weight.to(self.lm_head.weight.dtype))

    # --------------------------------------------------------------------------------- context
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, P, L, Ht] -> cn = hidden_norm(fc(aux)) [B, P, H]."""
        B, P = aux.shape[:2]
        dev = aux.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) \
            else self.fc.weight.dtype
        return self.hidden_norm(self.fc(aux.reshape(B, P, -1).to(dt)))

    def context(self, cn: torch.Tensor, position_ids: torch.Tensor) -> list[tuple]:
        """cn [B, P, H], position_ids [B, P] -> per layer (k, v) [B, nkv, P, hd]."""
        cos, sin = self.rotary(cn, position_ids)
        return [layer.self_attn.kv(cn, cos, sin) for layer in self.layers]

    # ----------------------------------------------------------------------------------- block
    def block(self, x: torch.Tensor, position_ids: torch.Tensor, ctx_kv: list[tuple],
              mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, Q, H] query embeddings, position_ids [B, Q], ctx_kv from `context`, mask bool
        [B, 1, Q, P+Q], None, or an attention function (Attention.forward) -> hn [B, Q, H]
        (after the final norm)."""
        cos, sin = self.rotary(x, position_ids)
        for layer, kv in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, cos, sin, kv, mask)
        return self.norm(x)

    def queries(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """The token ids of blocks: anchor_ids [...] -> [..., Q] (anchor, then the mask)."""
        ids = anchor_ids.new_full((*anchor_ids.shape, self.cfg.queries), self.cfg.mask_token_id)
        ids[..., 0] = anchor_ids
        return ids

    def draft_rows(self, hn: torch.Tensor) -> torch.Tensor:
        """hn [..., Q, H] -> the K rows that predict drafts 1..K [..., K, H]."""
        return hn if self.cfg.anchor_predicts else hn[..., 1:, :]

    def logits(self, hn: torch.Tensor) -> torch.Tensor:
        """hn [..., H] -> base logits [..., Vd] (no Markov bias)."""
        return self.lm_head(hn)

    def markov_embed(self, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """prev_ids [...] target vocab -> [..., r], or None without a Markov head."""
        return None if self.markov_head is None else self.markov_head.markov_w1(prev_ids)

    def markov_bias(self, m: torch.Tensor | None) -> torch.Tensor | float:
        return 0.0 if m is None else self.markov_head.markov_w2(m.to(self.markov_head.markov_w2
                                                                         .weight.dtype))

    def confidence_logit(self, hn: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        """hn [..., H], m [..., r] -> the acceptance logit [...] (float32, as vLLM)."""
        c = self.confidence_head
        x = torch.cat([hn, m], dim=-1) if self.cfg.confidence_with_markov and m is not None \
            else hn
        return F.linear(x.float(), c.proj.weight.float(), c.proj.bias.float()).squeeze(-1)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def draft(self, ctx_kv: list[tuple], ctx_len: torch.Tensor, anchor_ids: torch.Tensor,
              anchor_pos: torch.Tensor, temperature: float = 0.0,
              generator: torch.Generator | None = None) -> dict:
        """One block for each row, as vLLM's speculators draft it: ctx_kv of P cached
        positions (row b's first ctx_len[b] are its context), anchor_ids [B] (target ids),
        anchor_pos [B] -> {"ids" [B, K] target ids, "logits" [B, K, Vd] (the Markov bias in),
        "confidence" [B, K] or None}. Left to right: each draft's bias comes from the draft
        before it (the anchor for the first); greedy at temperature 0, else sampled from
        softmax(logits / temperature)."""
        B, K, Q = anchor_ids.shape[0], self.cfg.block_size, self.cfg.queries
        P = ctx_kv[0][0].shape[2]
        dev = anchor_ids.device
        x = self.embed_tokens(self.queries(anchor_ids))                      # [B, Q, H]
        pos = anchor_pos[:, None] + torch.arange(Q, device=dev)             # [B, Q]
        keep = torch.arange(P, device=dev)[None, :] < ctx_len[:, None]      # [B, P]
        mask = torch.cat([keep[:, None, :].expand(B, Q, P),
                          torch.ones(B, Q, Q, dtype=torch.bool, device=dev)], -1)[:, None]
        hn = self.draft_rows(self.block(x.to(self.fc.weight.dtype), pos, ctx_kv, mask))
        base = self.logits(hn).float()                                       # [B, K, Vd]
        prev, ids, zs, conf = anchor_ids, [], [], []
        for m in range(K):
            e = self.markov_embed(prev)
            z = base[:, m] + (self.markov_bias(e).float() if e is not None else 0.0)
            if temperature > 0:
                d = torch.multinomial((z / temperature).softmax(-1), 1,
                                      generator=generator).squeeze(-1)
            else:
                d = z.argmax(-1)
            if self.confidence_head is not None:
                conf.append(torch.sigmoid(self.confidence_logit(hn[:, m], e)))
            prev = self.to_target_ids(d)
            ids.append(prev)
            zs.append(z)
        return {"ids": torch.stack(ids, 1), "logits": torch.stack(zs, 1),
                "confidence": torch.stack(conf, 1) if conf else None}


# ------------------------------------------------------------------------------- save and load
# Checkpoints hold either kind under one file pair (model.save_drafter writes any model with a
# `cfg`): drafter_config.json with a "method" key is a DSpark or DFlash drafter's.
def is_block_config(d: dict) -> bool:
    return d.get("method") in METHODS


def load_model(directory, device="cpu", dtype=torch.float32):
    """A checkpoint dir of either kind (model.save_drafter's layout) -> Drafter or DSpark."""
    from safetensors.torch import load_file

    d = Path(directory)
    raw = json.loads((d / CONFIG_FILE).read_text())
    if not is_block_config(raw):
        return load_drafter(d, device=device, dtype=dtype)
    model = DSpark(DSparkConfig.from_dict(raw))
    model.load_state_dict(load_file(str(d / WEIGHTS_FILE)), strict=True)
    return model.to(device=device, dtype=dtype)
