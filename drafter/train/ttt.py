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

Both give the same loss and gradients (tests/test_model.py).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

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


def _rows_dynamic(*ts) -> None:
    """Mark dim 0 (rows) of a loss chunk dynamic. The rows in the loss differ from batch to
    batch, so a batch's last chunk has any size, and a compiled stats_fn specialised on each one
    recompiled until dynamo's recompile_limit ("tensor 'w' size mismatch at index 0. expected
    2097, actual 1357"), and the first steps ran several times slower than steady. Every
    chunk is marked: dynamo would run full chunks through the dynamic graph anyway once it
    exists (it checks the newest graph first), so one graph serves all from the first batch,
    and a static one would only add a compile. No padding: the numbers are the eager ones.
    TTT's compiled stats function marks its arguments itself (_MarkedRows); a function loaded
    whole (drafter/train/aot.py) takes them unmarked: its guards refuse a marking it was not saved
    with."""
    import torch._dynamo

    for t in ts:
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, 0)


class _MarkedRows:
    """A compiled loss-chunk function that marks its tensors' rows dynamic before each call."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, z, ids, tl, w, *rest):
        _rows_dynamic(z, ids, tl, w)
        return self.fn(z, ids, tl, w, *rest)


def loss_chunks(N: int, chunk: int) -> list[tuple[int, int]]:
    """The loss's row ranges: `chunk` rows each and the rest last, where a rest of 1 row joins
    the chunk before it. Dynamo specialises a size of 1, so a 1-row chunk (about one batch in
    `chunk` has one) would compile one more graph mid-run, after the warm-up."""
    ends = list(range(chunk, N, chunk)) + [N] if N > 0 else []
    if len(ends) > 1 and ends[-1] - ends[-2] == 1:
        del ends[-2]
    return list(zip([0] + ends[:-1], ends))


_ADDMM_F32: dict = {}  # device -> whether torch.addmm takes out_dtype=float32 with a float32 sum


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc float32 and a, b half precision. On a GPU whose torch has addmm's
    float32 output (cuBLAS's C += A·B, accumulated in float32), one GEMM into acc; otherwise the
    product, rounded to a's dtype, then an add: a [m, n] temporary and one more pass over acc
    (at the Llama-8B shape, each loss chunk's [32000, 4096] lm_head gradient). Older torch
    refuses a float32
    `self` for bf16 inputs: probed once."""
    if acc.is_cuda and a.dtype != acc.dtype and _ADDMM_F32.get(acc.device) is not False:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            _ADDMM_F32[acc.device] = True
            return
        except (RuntimeError, TypeError):  # checked before any work: acc is untouched
            _ADDMM_F32[acc.device] = False
    acc.add_(a @ b)


class FusedHeadLoss(torch.autograd.Function):
    """lm_head + soft cross-entropy in row chunks; the gradients are formed in the forward, so
    [N, Vd] logits never exist (EAGLE training is dominated by them at small H)."""

    @staticmethod
    def forward(ctx, hn, weight, w, teacher_ids, teacher_logp, trows, chunk, stats_fn,
                need_grad):
        N, dt = hn.shape[0], hn.dtype
        wc = weight.to(dt)                                          # [Vd, H] at compute dtype
        grad_hn = torch.empty_like(hn) if need_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if need_grad else None
        teacher = {"logp": teacher_logp} if teacher_ids is None else \
            {"ids": teacher_ids, "logp": teacher_logp}
        # Per chunk only its three matmuls and the compiled stats (the step waits on the
        # host): a top-k teacher's rows gathered once ([N, k], small; a dense one's [c, Vd]
        # stay per chunk), grad_hn written in place, the per-row stats joined once at the end.
        # -> 3 kernels a chunk besides the stats, not 10 (counted on the CPU).
        topk = None if teacher_ids is None else _teacher_rows(teacher, trows)
        stats = []
        for s, e in loss_chunks(N, chunk):
            z = hn[s:e] @ wc.T                                               # [c, Vd]
            ids, tl = _teacher_rows(teacher, trows[s:e]) if topk is None else \
                (topk[0][s:e], topk[1][s:e])
            g, *st = stats_fn(z, ids, tl, w[s:e], dt)
            stats.append(st)
            if need_grad:
                torch.mm(g, wc, out=grad_hn[s:e])                            # [c, H]
                _accumulate(grad_w, g.T, hn[s:e])                            # [Vd, H]
        if stats:
            ce, correct, accept = (torch.cat(c) for c in zip(*stats))        # [N] each
        else:  # no row in the loss
            ce, correct, accept = (hn.new_empty(0, dtype=torch.float32) for _ in range(3))
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
      Returns loss = Σ weights·ce (differentiable) and per-row ce, correct, accept [N].
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
                 loss_chunk: int = 0, backend: str = "inductor", saved: str = "off"):
        super().__init__()
        if attention not in ("sdpa", "flex"):
            raise ValueError(f"attention must be sdpa or flex, got {attention!r}")
        self.cfg = drafter.cfg
        self.fc_norm, self.fc, self.midlayer = drafter.fc_norm, drafter.fc, drafter.midlayer
        self.norm, self.lm_head, self.rotary = drafter.norm, drafter.lm_head, drafter.rotary
        self.attention, self.loss_chunk, self.compiled = attention, loss_chunk, compile
        self.scale = attention_scale(self.cfg)
        # MLA: DeepSeek's score scale, given to the attention explicitly (a llama layer's is the
        # default, hd^-1/2), and on the flex path keys and values padded to one width
        self.mla = self.cfg.draft_layer == "mla"
        pieces = (_Pre(self.midlayer), _Post(self.midlayer, self.norm))  # a tuple: unregistered

        def pre(ws, *a):
            return functional_call(pieces[0], ws, a)

        def post(ws, *a):
            return functional_call(pieces[1], ws, a)

        self.pre_fn, self.post_fn, self.stats_fn = pre, post, _chunk_stats
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
            jit.append(_MarkedRows(torch.compile(_chunk_stats, dynamic=False, backend=backend)))
            if saved != "off" and backend == "inductor":  # only Inductor's output is saved
                # the pieces whole, dynamo's tracing included: drafter/train/aot.py
                from drafter.train.aot import Piece
                mods = {"pre": pieces[0], "post": pieces[1]}
                jit = [Piece(n, f, j, m, saved, dynamic_rows=n == "chunk_stats")
                       for n, f, j, m in zip(("pre", "post", "chunk_stats"),
                                             (pre, post, _chunk_stats), jit, (mods, mods, {}))]
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
        loss, ce, correct, accept = head_loss(
            hn_rows, self.lm_head.weight, teacher, trows, weights,
            fused=self.attention == "flex", chunk=self.loss_chunk, stats_fn=self.stats_fn)
        return {"loss": loss, "ce": ce, "correct": correct, "accept": accept}
