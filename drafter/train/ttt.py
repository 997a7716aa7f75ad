"""The training-time test: the drafter's K-step training unroll (`TTT`) and its loss, for
training only. The drafter itself, its shape legend and save/load are in drafter/train/model.py.

Alignment: the shift is written once, in `drafter.train.batches.align`; this file takes its result
(`src`, `rows`).

Training-time test (`TTT`, EAGLE-3 paper §3.2): the drafter is unrolled K steps as it drafts at
inference. Step 0 is the plain forward (Drafter.forward). Step i > 0 at position t embeds the
token i further on (`src[i]`), takes the drafter's own step-(i-1) output at t as `h` (`feedback`:
post-norm with norm_output), sits at RoPE position pos(t) + i, and attends to the step-0 keys of
its sample causally plus the keys that steps 1..i computed at the same position t (the
"diagonal"): exactly the KV cache it would have when drafting token i+1 after position t. Two
implementations:

    sdpa  exact, any device: keys of all steps concatenated [B, nkv, (i+1)·T, hd] under a dense
          mask [B, 1, T, (i+1)·T] (block 0 causal within the sample, blocks 1..i the identity),
          and the plain loss over materialised logits;
    flex  fast GPU path: FlexAttention over the step-0 keys only, with one block mask per batch
          reused by every step, returning its log-sum-exp; the i diagonal scores are one dot
          product per position, merged with it by their log-sum-exps (nothing recomputed across
          steps, no O(T²) mask; on CUDA one Triton kernel each way: drafter/train/merge.py).
          The loss is fused with lm_head in row chunks: logits never exist for the whole
          batch, and their gradients are formed in the forward.

Both give the same loss and gradients (tests/test_model.py). The loss itself (its kinds, the
fused lm_head pass, D-PACE weighting) is drafter/train/losses.py, called on the unroll's rows.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from drafter.train import losses
from drafter.train.losses import DEFAULT, MarkedRows, Objective, head_loss
from drafter.train.merge import merge_diagonal
from drafter.train.model import Drafter, DrafterConfig, fuse


def attention_scale(cfg: DrafterConfig) -> float:
    """The draft layer's score scale: hd^-1/2 (llama), DeepSeek's (mla: drafter/train/mla.py)."""
    if cfg.draft_layer == "mla":
        from drafter.train.mla import softmax_scale
        return softmax_scale(cfg)
    return 1.0 / math.sqrt(cfg.head_dim)


def same_width(q, k, v):
    """MLA's keys (dqk) and values (dv) differ in width; FlexAttention's kernel and the diagonal
    merge take one head width: zero-pad the narrower side (q and k, or v) to the wider. Exact:
    zeros add nothing to q·k, and a zero value column gives a zero output column, cut off after
    (TTT.forward)."""
    dk, dv = q.shape[-1], v.shape[-1]
    if dk < dv:
        return F.pad(q, (0, dv - dk)), F.pad(k, (0, dv - dk)), v
    return q, k, (F.pad(v, (0, dk - dv)) if dv < dk else v)


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


def attend_exact(q, ks, vs, mask0, scale=None):
    """Step i = len(ks)-1 by definition: q [B, nh, T, hd]; ks, vs: i+1 tensors [B, nkv, T, hd]
    (step 0 first); mask0 [B, 1, T, T] -> [B, nh, T, hd]. scale: None, hd^-1/2."""
    B, _, T, _ = q.shape
    eye = torch.eye(T, dtype=torch.bool, device=q.device).expand(B, 1, T, T)
    mask = torch.cat([mask0] + [eye] * (len(ks) - 1), dim=-1)              # [B, 1, T, (i+1)T]
    k, v = torch.cat(ks, dim=2), torch.cat(vs, dim=2)                      # [B, nkv, (i+1)T, hd]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


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

    def part0(q, k, v, scale=None):
        gqa = q.shape[1] != k.shape[1]
        # q, k, v already carry the compute dtype; older torch has no autocast rule for flex
        with torch.autocast(q.device.type, enabled=False):
            if aux_request is not None:
                o, aux = fn(q, k, v, block_mask=block_mask, enable_gqa=gqa, scale=scale,
                            return_aux=aux_request(lse=True))
                return o, aux.lse
            return fn(q, k, v, block_mask=block_mask, enable_gqa=gqa, scale=scale,
                      return_lse=True)
    return part0


def noisy(aux: torch.Tensor, level: float) -> torch.Tensor:
    """aux [B, T, n, Ht] plus Gaussian noise of std level × each state's RMS over Ht (the
    residual stream's scale differs by layer and model, so a relative level carries over), in
    aux's dtype (a float32 copy of Kimi-sized aux would be GBs)."""
    rms = aux.float().pow(2).mean(-1, keepdim=True).sqrt()                   # [B, T, n, 1]
    return aux + torch.randn_like(aux) * (level * rms).to(aux.dtype)


# ------------------------------------------------------------------------------- the unroll
class _Pre(nn.Module):
    """The layer up to attention, as a module's forward over the borrowed decoder layer, so that
    torch.func.functional_call can run it with the layer's matrices replaced by their casts
    (TTT.cast_layer). Kept out of TTT's modules (and never referring back to TTT)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, h, emb, cos, sin):
        """h, emb [B, T, H] -> q [B, nh, T, hd], k, v [B, nkv, T, hd], residual [B, T, H]."""
        x, residual = self.layer.pre_attention(emb, h)                      # [B, T, 2H], [B, T, H]
        return (*self.layer.self_attn.qkv(x.to(h.dtype), cos, sin), residual)


class _Post(nn.Module):
    """The layer after attention and the final norm (as _Pre)."""

    def __init__(self, layer: nn.Module, norm: nn.Module):
        super().__init__()
        self.layer, self.norm = layer, norm

    def forward(self, o, residual):
        """o [B, nh, T, hd] -> h_out (layer output), hn = norm(h_out), each [B, T, H]."""
        h_out = self.layer.post_attention(self.layer.self_attn.out(o), residual)
        return h_out, self.norm(h_out)


def _memory_format(name: str) -> torch.memory_format:
    return getattr(torch, name)


def _reduce_memory_format(m: torch.memory_format):
    return _memory_format, (str(m).removeprefix("torch."),)


def stable_memory_format_pickles() -> None:
    """Pickle torch.memory_format objects by name through a function of this module, as
    torch.serialization does torch.layout (copyreg). Inductor's FX-graph cache keys pickle each
    graph input's metadata, its memory format included. Pickled by torch's own `__reduce__`, a
    memory format is a global found by searching sys.modules in order (pickle.whichmodule), so
    the bytes, and the key, depend on which modules the process imported first. With torch
    2.11, a `drafter train` after a cold `drafter run` hashed every graph input that has a
    memory format differently from the run, and those without one alike (compared in their
    TORCH_TRACE records): it missed most of the run's graphs and compiled them again.
    Idempotent."""
    import copyreg
    copyreg.pickle(torch.memory_format, _reduce_memory_format)


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
      Returns losses.head_loss's dict: loss = Σ weights·value (differentiable), per row value,
      ce, correct, accept [N] and accept_t [N, m].
    obj: the loss (drafter/train/losses.py; default the soft cross-entropy at T = 1); under its
    D-PACE weighting a row's chain is its token position, its place the TTT step.
    noise: while training (grad enabled), Gaussian noise on the aux states, std = noise × each
    state's RMS (per token and layer); 0 leaves them as captured.
    compile: torch.compile the layer pieces and the loss chunk with `backend` (inductor; tests
    count dynamo's graphs with aot_eager, which builds no kernels); the merge runs eagerly.
    saved: with Inductor, "load" the layer pieces and the loss chunk compiled whole where a
    precompile process saved them ("save"), skipping dynamo's tracing; "off" (drafter/train/aot.py).

    Under autocast the layer's float32 matrices are cast once per forward (`cast_layer`) and
    all K steps use the casts: autograd then sums the K steps' gradients of each matrix at the
    compute dtype and casts the sum to float32 once. Eager autocast does the same through its
    cast cache; compiled pieces would cast inside each graph, K times, and return K float32
    gradients to add.
    """

    def __init__(self, drafter: "Drafter", attention: str = "sdpa", compile: bool = False,
                 loss_chunk: int = 0, backend: str = "inductor", saved: str = "off",
                 obj: Objective = DEFAULT, noise: float = 0.0):
        super().__init__()
        if attention not in ("sdpa", "flex"):
            raise ValueError(f"attention must be sdpa or flex, got {attention!r}")
        self.cfg = drafter.cfg
        self.fc_norm, self.fc, self.midlayer = drafter.fc_norm, drafter.fc, drafter.midlayer
        self.norm, self.lm_head, self.rotary = drafter.norm, drafter.lm_head, drafter.rotary
        self.attention, self.loss_chunk, self.compiled = attention, loss_chunk, compile
        self.obj, self.noise = obj, noise
        self.scale = attention_scale(self.cfg)
        # MLA: DeepSeek's score scale, given to the attention explicitly (a llama layer's is the
        # default, hd^-1/2), and on the flex path keys and values padded to one width
        self.mla = self.cfg.draft_layer == "mla"
        pieces = (_Pre(self.midlayer), _Post(self.midlayer, self.norm))  # a tuple: unregistered

        def pre(ws, *a):
            return functional_call(pieces[0], ws, a)

        def post(ws, *a):
            return functional_call(pieces[1], ws, a)

        self.pre_fn, self.post_fn, self.stats_fn = pre, post, losses.chunk_stats
        if compile:
            # Static shapes: rows are padded to max_length and micro-batches to B rows, so the
            # layer pieces see one shape per run; the loss rows vary per batch, so the loss
            # chunks' rows are marked dynamic (_rows_dynamic). The merge runs eagerly: compiled,
            # it was a graph per TTT step (a list of i keys: six forward and six backward
            # compiles of a cold warm-up at K=7); eager, a cold warm-up is shorter at the same
            # step speed.
            import torch._dynamo
            import torch._functorch.config as aot_config
            torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
            # AOTAutograd's on-disk cache refuses a graph holding a custom autograd.Function
            # (_RMSNormFn, in pre and post) unless this flag allows it, so each process traced
            # and partitioned their joint graphs again, most of a warm warm-up's compile time.
            # PyTorch found the Function's operator pure in its
            # inputs and means to make it the default (pytorch#149751). The environment's
            # TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD=0 still turns it off.
            if hasattr(aot_config, "autograd_cache_allow_custom_autograd_functions"):
                aot_config.autograd_cache_allow_custom_autograd_functions = True
            stable_memory_format_pickles()
            jit = [torch.compile(f, dynamic=False, backend=backend) for f in (pre, post)]
            jit.append(MarkedRows(torch.compile(losses.chunk_stats, dynamic=False,
                                                backend=backend)))
            if saved != "off" and backend == "inductor":  # only Inductor's output is saved
                # the pieces whole, dynamo's tracing included: drafter/train/aot.py
                from drafter.train.aot import Piece
                mods = {"pre": pieces[0], "post": pieces[1]}
                jit = [Piece(n, f, j, m, saved, dynamic_rows=n == "chunk_stats")
                       for n, f, j, m in zip(("pre", "post", "chunk_stats"),
                                             (pre, post, losses.chunk_stats), jit,
                                             (mods, mods, {}))]
            self.pre_fn, self.post_fn, self.stats_fn = jit

    def cast_layer(self, device_type: str) -> dict:
        """{name: the matrix at autocast's dtype} for the layer's float32 matrices (names as
        functional_call on _Pre and _Post takes them); {} without autocast. The norms' vectors stay:
        _RMSNormFn casts them itself, and their gradients are small."""
        if not torch.is_autocast_enabled(device_type):
            return {}
        dt = torch.get_autocast_dtype(device_type)
        return {f"layer.{n}": p.to(dt) for n, p in self.midlayer.named_parameters()
                if p.ndim > 1 and p.is_floating_point() and p.dtype != dt}

    def forward(self, aux, emb, position_ids, seq_id, src, rows, trows, weights, teacher,
                part0: Callable | None = None):
        K = src.shape[0]
        if self.noise > 0 and self.training and torch.is_grad_enabled():
            aux = noisy(aux, self.noise)
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
        ws = self.cast_layer(h.device.type)                                  # once for K steps
        for i in range(K):
            emb_i = emb.gather(1, src[i].unsqueeze(-1).expand(B, T, H)).to(h.dtype)  # [B, T, H]
            q, k, v, residual = self.pre_fn(ws, h, emb_i, cos[:, i], sin[:, i])
            if self.mla and self.attention == "flex":
                q, k, v = same_width(q, k, v)
            ks.append(k)
            vs.append(v)
            if self.attention == "sdpa":
                o = attend_exact(q, ks, vs, mask0, self.scale if self.mla else None)
            else:
                o0, lse0 = part0(q, ks[0], vs[0], **({"scale": self.scale} if self.mla else {}))
                o = merge_diagonal(q, o0, lse0, ks[1:], vs[1:], self.scale)  # eager: see init
                if self.mla:
                    o = o[..., :self.cfg.v_head_dim]                         # [B, nh, T, dv]
            h_out, hn = self.post_fn(ws, o, residual)
            outs.append(hn.reshape(B * T, H))
            h = hn if self.cfg.norm_output else h_out  # = Drafter.feedback(h_out), norm reused
        hn_rows = torch.cat(outs, 0)[rows]                                   # [N, H]
        chains = (rows % (B * T), rows // (B * T), B * T, K) \
            if self.obj.position == "dpace" else None
        return head_loss(hn_rows, self.lm_head.weight, teacher, trows, weights,
                         fused=self.attention == "flex", chunk=self.loss_chunk, obj=self.obj,
                         chains=chains, stats_fn=self.stats_fn)
