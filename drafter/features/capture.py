"""Target forward with hooks: the aux hidden states and the teacher signal, for any decoder.

Shapes: B samples in a forward, S padded length, T tokens of one sample, N = ΣT tokens of a
forward, L aux layers (3 for EAGLE-3), Ht target hidden, V target vocab, Vd draft vocab, k top-k.

    cap = load_capture(cfg)                     # the target (target.load_model) + vocab + options
    samples = cap([{"input_ids": [...], "loss_mask": [...]}, ...])   # per-sample dicts
    flat = cap.run([ids0, ids1, ...])           # the same, concatenated: what extract stores

Conventions (../shared/docs/DESIGN.md):
- layer id k = HS[k] = the residual stream entering decoder layer k = HF
  `output_hidden_states[k]` (0 = embeddings). Captured by a forward pre-hook on layer k, so
  nothing beyond what the model computes anyway is recomputed, for any architecture.
- teacher hidden = the text decoder's `last_hidden_state`, after the final norm (what lm_head
  sees, = `output_hidden_states[N]`). Logits = lm_head of it, then the model's own output
  transform (Gemma softcapping, Cohere `logit_scale`, Granite `logits_scaling`), computed in
  chunks so that a [N, V] fp32 tensor never exists for a whole batch.
- the text decoder is `get_decoder()` followed down (text_decoder): a multimodal wrapper such as
  Kimi-K2.5's KimiK25ForConditionalGeneration answers with its whole language model, whose own
  get_decoder() is the decoder; the lm_head is the wrapper's or its language model's
  (output_head).
- in_vocab[t] = argmax over the full vocab at t is a draft-vocab token (training masks the
  others out of the loss).
- teacher=topk: the k largest log-probs of log_softmax over the draft vocab's logits, with
  draft-vocab ids; the values are rounded to fp16 (what the store keeps), so that online
  capture and offline shards train alike.

Batches: `padded` (default) right-pads and passes no attention mask: every real token attends
only to earlier real tokens under the causal mask, so the pad tail cannot change them, and SDPA
keeps its fast is_causal kernels. `packed` concatenates samples into one row with restarting
position_ids (transformers then builds a block-diagonal mask, and flash-attention kernels run
varlen); it wastes no compute on padding but a dense block mask costs O(N²) on SDPA, so
`auto` packs only under flash attention. Both give the one-sample values (tests/test_capture.py).

`self_check` compares the hooks and the chunked logits with a plain `model(...,
output_hidden_states=True)` forward on a real sample before a long run, so an architecture
that breaks an assumption above fails in seconds, not after the run.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from drafter import DrafterError

log = logging.getLogger("drafter")

# fp32 logits of one chunk [c, V] stay under this many bytes, whatever V (163,840 for Kimi-K2.5:
# c = 1638 tokens), so the teacher never materialises [N, V] for a 16k-token batch.
LOGITS_CHUNK_BYTES = 1 << 30
# teacher=topk log-probs are kept at fp16 precision (store.py writes fp16; 2 bytes per entry).
TOPK_LOGP_DTYPE = torch.float16


class CaptureError(DrafterError):
    """The target breaks an assumption of the capture (layer ids, architecture, self-check)."""


# ------------------------------------------------------------------------------ model anatomy
def text_decoder(model: nn.Module) -> nn.Module:
    """The text decoder: the module whose forward returns `last_hidden_state` after the final
    norm. `get_decoder()` is followed down while it leads somewhere new: a multimodal wrapper
    such as Kimi-K2.5's KimiK25ForConditionalGeneration answers with its language model, a whole
    causal LM, whose own get_decoder() is the decoder."""
    dec = model
    while hasattr(dec, "get_decoder"):
        inner = dec.get_decoder()
        if inner is None or inner is dec:
            break
        dec = inner
    return dec


def output_head(model: nn.Module) -> nn.Module | None:
    """The lm_head: the model's output embeddings, else those of the causal LM it wraps."""
    m = model
    while m is not None:
        head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
        if head is not None:
            return head
        inner = m.get_decoder() if hasattr(m, "get_decoder") else None
        m = inner if inner is not m else None
    return None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of any transformers causal LM (also VLMs' language models)."""
    from drafter.core.target import num_layers

    n = num_layers(model.config)
    layers = getattr(text_decoder(model), "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == n:
        return layers
    # Fallback: the one ModuleList of length N outside vision/audio towers.
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) == n
             and not any(s in name for s in ("vision", "visual", "audio", "mtp"))]
    if len(found) != 1:
        raise CaptureError(f"{type(model).__name__}: cannot find its {n} decoder layers "
                           f"(candidates: {[name for name, _ in found] or 'none'})")
    return found[0][1]


def logit_transform(config) -> tuple[float, float | None]:
    """(scale, softcap) such that logits = softcap(scale * lm_head(h)); the forward of the
    causal-LM classes applies these after lm_head (Cohere, Granite, Gemma 2/3)."""
    from drafter.core.target import text_config

    tc = text_config(config)
    scale = 1.0
    if getattr(tc, "logit_scale", None) is not None:          # Cohere: logits * logit_scale
        scale *= float(tc.logit_scale)
    if getattr(tc, "logits_scaling", None):                  # Granite: logits / logits_scaling
        scale /= float(tc.logits_scaling)
    softcap = getattr(tc, "final_logit_softcapping", None)  # Gemma: cap * tanh(logits / cap)
    return scale, (float(softcap) if softcap else None)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (tensor-parallel load) as the full tensor; a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _transform(z: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    z = z.float()
    if scale != 1.0:
        z = z * scale
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    return z


@dataclass
class Head:
    """The target's lm_head rows of the draft vocab and its output transform.

    logits(h) [..., Vd] float32 = softcap(scale * h @ weight.T), computed at the weight's dtype
    (the target's own precision) and then in fp32."""
    weight: torch.Tensor          # [Vd, Ht]
    scale: float = 1.0
    softcap: float | None = None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        w = self.weight.to(h.device)
        return _transform(F.linear(h.to(w.dtype), w), self.scale, self.softcap)

    def to(self, device) -> "Head":
        return Head(self.weight.to(device), self.scale, self.softcap)


def layer_count(cfg) -> int | None:
    """How many target layers the configured drafter kind reads when extract.layer_ids is
    unset: train.dspark.target_layers for the block drafters, None for EAGLE-3's three."""
    return None if cfg.train.method == "eagle3" else cfg.train.dspark.target_layers


def resolve_layer_ids(layer_ids: Sequence[int] | None, n_layers: int,
                      count: int | None = None) -> list[int]:
    """Configured ids (HS[k] convention), or the default: [2, N//2, N-3], or with `count`
    (layer_count) the block drafters' `count` layers; checked."""
    from drafter.core.target import default_block_layer_ids, default_layer_ids

    ids = list(layer_ids) if layer_ids else (
        default_layer_ids(n_layers) if count is None else default_block_layer_ids(n_layers, count))
    bad = [k for k in ids if not 0 <= k < n_layers]
    if bad:
        raise CaptureError(f"extract.layer_ids: {bad} out of range for a {n_layers}-layer target "
                           f"(valid: 0..{n_layers - 1}; id k = HS[k], the input of layer k; "
                           f"HS[{n_layers}] is after the final norm: that is the teacher)")
    if len(set(ids)) != len(ids):  # the default repeats for N < 8; legal, only wasteful
        log.warning("extract.layer_ids %s repeats a layer (a %d-layer target)", ids, n_layers)
    return ids


# ------------------------------------------------------------------------------------- batching
def plan_batches(lengths: Sequence[int], batch_tokens: int, packed: bool = False
                 ) -> list[list[int]]:
    """Group positions 0..n-1 (in the given order; callers sort by length) into forwards of at
    most `batch_tokens` tokens: B * max length when padded, ΣT when packed. A sample longer
    than the budget gets a forward of its own."""
    out: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    used = 0
    for i, n in enumerate(lengths):
        new_longest = max(longest, n)
        cost = (len(cur) + 1) * new_longest if not packed else used + n
        if cur and cost > batch_tokens:
            out.append(cur)
            cur, longest, used = [], 0, 0
            new_longest = n
        cur.append(i)
        longest = new_longest
        used += n
    if cur:
        out.append(cur)
    return out


def length_order(lengths: Sequence[int]) -> list[int]:
    """Indices sorted longest first (ties by index): deterministic, and an OOM shows at once."""
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


# -------------------------------------------------------------------------------------- capture
class Capture:
    """Hooks on a loaded target; `run` / `__call__` do prefill-only forwards under no_grad."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int] | None, d2t: torch.Tensor,
                 t2d: torch.Tensor, teacher: str = "hidden", topk: int = 64,
                 out_dtype: torch.dtype | None = torch.bfloat16, packing: str = "auto",
                 batch_tokens: int = 16384, layer_count: int | None = None):
        from drafter.core.target import hidden_size, vocab_size

        if teacher not in ("hidden", "topk"):
            raise CaptureError(f"extract.teacher: must be hidden or topk, got {teacher!r}")
        if packing not in ("auto", "padded", "packed"):
            raise CaptureError(f"Capture: packing must be auto, padded or packed, got {packing!r}")
        self.model = model
        self.layers = decoder_layers(model)
        self.num_layers = len(self.layers)
        self.layer_ids = resolve_layer_ids(layer_ids, self.num_layers, layer_count)
        self.hidden_size = hidden_size(model.config)
        self.vocab_size = vocab_size(model.config)
        self.decoder = text_decoder(model)
        self.lm_head = output_head(model)
        if self.lm_head is None:
            raise CaptureError(f"{type(model).__name__}: no lm_head found (get_output_embeddings "
                               f"of the model and of the causal LM it wraps)")
        self.scale, self.softcap = logit_transform(model.config)
        self.teacher = teacher
        self.device = model.get_input_embeddings().weight.device
        self.model_dtype = model.get_input_embeddings().weight.dtype
        self.out_dtype = out_dtype or self.model_dtype
        attn = str(getattr(model.config, "_attn_implementation", "") or "")
        self.packed = packing == "packed" or (packing == "auto" and "flash" in attn)
        self._vocab(d2t, t2d, topk, batch_tokens)

    def _vocab(self, d2t: torch.Tensor, t2d: torch.Tensor, topk: int, batch_tokens: int):
        """The draft vocab, top-k and the state every capture shares (VllmCapture too), once
        vocab_size and device are known."""
        d2t = d2t.long()
        if t2d.numel() != self.vocab_size:
            raise CaptureError(f"vocab: t2d has {t2d.numel()} entries but the target vocab is "
                               f"{self.vocab_size}: the vocab step ran on another target")
        self.draft_ids = (torch.arange(d2t.numel()) + d2t).to(self.device)  # [Vd] target ids
        self.t2d = t2d.bool().to(self.device)                                # [V]
        self.draft_vocab_size = d2t.numel()
        self.topk = min(topk, self.draft_vocab_size)
        self.batch_tokens = batch_tokens
        self.pad_id = 0
        self._head: Head | None = None
        # online training captures on a prefetch thread while validation captures on the main
        # one; training also holds it while torch.compile traces (trainer.compiles_hold)
        self.lock = threading.RLock()

    # -- the head (draft-vocab rows of lm_head); a collective under tensor parallelism
    @property
    def head(self) -> Head:
        if self._head is None:
            w = _full(self.lm_head.weight)
            if tuple(w.shape) != (self.vocab_size, self.hidden_size):
                raise CaptureError(f"lm_head weight has shape {tuple(w.shape)}, expected "
                                   f"({self.vocab_size}, {self.hidden_size})")
            if getattr(self.lm_head, "bias", None) is not None:
                raise CaptureError("lm_head has a bias: not supported by EAGLE-3 heads")
            self._head = Head(w.index_select(0, self.draft_ids.to(w.device)).detach().clone(),
                              self.scale, self.softcap)
        return self._head

    def info(self) -> dict:
        """What the outputs mean: recorded in the manifest and in every index."""
        return {"layer_ids": self.layer_ids, "num_layers": self.num_layers,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "draft_vocab_size": self.draft_vocab_size, "teacher": self.teacher,
                "topk": self.topk if self.teacher == "topk" else None,
                "target_dtype": str(self.model_dtype).replace("torch.", ""),
                "logit_scale": self.scale, "logit_softcap": self.softcap,
                "packing": "packed" if self.packed else "padded"}

    @contextlib.contextmanager
    def _hooks(self, out: torch.Tensor, index: torch.Tensor | None):
        """Pre-hooks copying HS[k] of the real tokens into out[:, j] (cast to out's dtype)."""
        def make(j):
            def hook(module, args, kwargs):
                x = args[0] if args else kwargs["hidden_states"]     # [B, S, Ht]
                x = _full(x).reshape(-1, x.shape[-1])               # [B*S, Ht]
                out[:, j] = (x if index is None else x.index_select(0, index)).to(out.device)
            return hook

        handles = [self.layers[k].register_forward_pre_hook(make(j), with_kwargs=True)
                   for j, k in enumerate(self.layer_ids)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def run(self, input_ids: Sequence[torch.Tensor | Sequence[int]]) -> dict:
        """One forward over these samples. Returns the outputs concatenated over samples:

            input_ids [N] int64, offsets [B+1] int64 (sample b = rows offsets[b]:offsets[b+1]),
            aux [N, L, Ht] out_dtype, in_vocab [N] bool, and teacher_hidden [N, Ht] out_dtype or
            teacher_topk_ids [N, k] int64 + teacher_topk_logp [N, k] float32.
        All on the target's (first) device but offsets, which stay on the host (known there).

        No transfer here waits on the GPU: host tensors go up pinned and without blocking, and
        nothing comes back. Online training runs this on its prefetch thread, and a copy to or
        from pageable memory would hold up the training thread's kernel launches until the
        target's forward is done (pytorch/pytorch#143825): the overlap would be lost."""
        ids, lens, offsets = host_samples(input_ids)                            # built on host
        n_tok = int(offsets[-1])
        flat = self._to_device(torch.cat(ids))                                   # [N]
        if self.packed:
            batch = flat[None]                                                  # [1, N]
            pos = self._to_device(torch.cat([torch.arange(int(n)) for n in lens])[None])
            index = None
        else:
            S = int(lens.max())
            batch = torch.full((len(ids), S), self.pad_id, dtype=torch.long)    # [B, S]
            for b, x in enumerate(ids):
                batch[b, :len(x)] = x
            batch = self._to_device(batch)
            pos = torch.arange(S, device=self.device)[None].expand(len(ids), S)  # [B, S]
            valid = torch.arange(S)[None] < lens[:, None]                        # [B, S]
            index = self._to_device(valid.reshape(-1).nonzero()[:, 0])          # [N]
        aux = torch.empty(n_tok, len(self.layer_ids), self.hidden_size, dtype=self.out_dtype,
                          device=self.device)                                   # [N, L, Ht]
        with self.lock, self._hooks(aux, index):  # hooks on shared layers: one forward at once
            h = self.decoder(input_ids=batch, position_ids=pos, use_cache=False).last_hidden_state
        h = _full(h).reshape(-1, self.hidden_size).to(self.device)               # [B*S, Ht]
        if index is not None:
            h = h.index_select(0, index)                                         # [N, Ht]
        out = {"input_ids": flat, "offsets": offsets, "aux": aux}
        out.update(self._teacher(h))
        return out

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the target's device: pinned and non-blocking to a GPU."""
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _teacher(self, h: torch.Tensor) -> dict:
        """in_vocab and the teacher of final hidden states h [N, Ht], chunk by chunk."""
        n = h.shape[0]
        chunk = max(1, LOGITS_CHUNK_BYTES // (4 * self.vocab_size))
        in_vocab = torch.empty(n, dtype=torch.bool, device=h.device)
        out = {"in_vocab": in_vocab}
        if self.teacher == "hidden":
            out["teacher_hidden"] = h.to(self.out_dtype)
        else:
            ids = torch.empty(n, self.topk, dtype=torch.long, device=h.device)
            logp = torch.empty(n, self.topk, dtype=torch.float32, device=h.device)
            out.update(teacher_topk_ids=ids, teacher_topk_logp=logp)
        for a in range(0, n, chunk):
            z = self.lm_head(h[a:a + chunk].to(self.lm_head.weight.device))
            z = _transform(_full(z), self.scale, self.softcap).to(self.device)          # [c, V]
            in_vocab[a:a + chunk] = self.t2d[z.argmax(-1)]
            if self.teacher == "topk":
                lp = torch.log_softmax(z.index_select(1, self.draft_ids), -1)     # [c, Vd]
                v, i = lp.topk(self.topk, -1)                                     # [c, k]
                logp[a:a + chunk] = v.to(TOPK_LOGP_DTYPE).float()
                ids[a:a + chunk] = i
        return out

    def __call__(self, samples: Sequence[dict], batch_tokens: int | None = None) -> list[dict]:
        """Per-sample dicts (docs/internals.md) for samples with `input_ids` and `loss_mask`,
        in the given order; forwards are grouped by length under `batch_tokens`. input_ids and
        loss_mask are host tensors, the captured fields are on the target's device."""
        lens = [len(s["input_ids"]) for s in samples]
        order = length_order(lens)
        result: list[dict | None] = [None] * len(samples)
        for group in plan_batches([lens[i] for i in order], batch_tokens or self.batch_tokens,
                                  self.packed):
            idx = [order[g] for g in group]
            ids = [torch.as_tensor(samples[i]["input_ids"], dtype=torch.long) for i in idx]
            flat = self.run(ids)
            for i, x, s in zip(idx, ids, split(flat)):
                # the token fields stay on the host (batches.collate builds the rows there)
                s["input_ids"] = x
                s["loss_mask"] = torch.as_tensor(samples[i]["loss_mask"], dtype=torch.long)
                result[i] = s
        return result  # type: ignore[return-value]

    # -- the guard before a long run
    @torch.no_grad()
    def self_check(self, input_ids: Sequence[int]) -> dict:
        """Compare the capture of one sample with a plain forward with output_hidden_states:
        HS[k] for every layer id and the teacher hidden must match, in_vocab and the draft-vocab
        log-probs must agree (within the target dtype's rounding). Raises CaptureError."""
        ids = torch.as_tensor(list(input_ids)[:64], dtype=torch.long)
        saved = self.out_dtype, self.teacher
        try:
            self.out_dtype, self.teacher = self.model_dtype, "hidden"
            mine = self.run([ids])
            self.teacher = "topk"
            mine.update({k: v for k, v in self.run([ids]).items() if k.startswith("teacher_topk")})
        finally:
            self.out_dtype, self.teacher = saved
        ref = self.model(input_ids=ids[None].to(self.device), output_hidden_states=True,
                         use_cache=False)
        hs = [_full(x)[0].to(self.device) for x in ref.hidden_states]
        name = type(self.model).__name__
        # fp32 forwards agree to rounding; bf16 MoE kernels may add in another order (atomics).
        rel = 1e-4 if self.model_dtype == torch.float32 else 3e-2

        def close(a, b) -> float:
            d = (a.float() - b.float()).abs().max().item()
            return d / max(b.float().abs().max().item(), 1e-6)

        for j, k in enumerate(self.layer_ids):
            e = close(mine["aux"][:, j], hs[k])
            if e > rel:
                raise CaptureError(f"{name}: the hook on layer {k} does not see "
                                   f"output_hidden_states[{k}] (relative diff {e:.3g}); this "
                                   f"architecture needs its own capture rule")
        e = close(mine["teacher_hidden"], hs[-1])
        if e > rel:
            raise CaptureError(f"{name}: the decoder's last_hidden_state differs from "
                               f"output_hidden_states[-1], the final-norm output "
                               f"(relative diff {e:.3g})")
        z = _full(ref.logits)[0].float().to(self.device)                             # [T, V]
        ref_lp = torch.log_softmax(z[:, self.draft_ids], -1)
        err = (ref_lp.gather(1, mine["teacher_topk_ids"]) - mine["teacher_topk_logp"]).abs()
        err = err.max().item()
        tol = 1e-2 if self.model_dtype == torch.float32 else 0.25  # fp16 rounding / bf16 logits
        agree = (self.t2d[z.argmax(-1)] == mine["in_vocab"]).float().mean().item()
        if err > tol or agree < 0.95:
            raise CaptureError(f"{name}: teacher log-probs from lm_head differ from the model's "
                               f"logits (max diff {err:.3g}, in_vocab agreement {agree:.0%}): "
                               f"an output transform (logit scale, softcap) is not handled")
        return {"tokens": len(ids), "max_logp_diff": err}


def host_samples(input_ids) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Samples as host int64 tensors, their lengths [B] and offsets [B+1] (sample b = rows
    offsets[b]:offsets[b+1] of the concatenation). Raises on no sample or an empty one."""
    ids = [torch.as_tensor(x, dtype=torch.long).cpu() for x in input_ids]
    lens = torch.tensor([len(x) for x in ids])
    if not ids or (lens == 0).any():
        raise CaptureError("capture: no samples, or an empty one")
    offsets = torch.zeros(len(ids) + 1, dtype=torch.long)
    offsets[1:] = lens.cumsum(0)
    return ids, lens, offsets


def split(flat: dict) -> list[dict]:
    """The concatenated output of `Capture.run` as per-sample dicts (views, no copies)."""
    off = flat["offsets"].tolist()
    keys = [k for k in flat if k != "offsets"]
    return [{k: flat[k][a:b] for k in keys} for a, b in zip(off[:-1], off[1:])]


def load_capture(cfg, model: nn.Module | None = None, device: str | None = None,
                 out_dtype: torch.dtype | None = torch.bfloat16, **load_kw) -> Capture:
    """The capture a config describes: the target loaded the one way (target.load_model), the
    draft vocab from the vocab step, layer ids / teacher / top-k / batch size from cfg.extract.
    Used by extract and by train's online mode."""
    from drafter.core import target
    from drafter.core.rundir import Run
    from drafter.data import tokens

    run = Run.of(cfg)
    d2t, t2d, _ = tokens.load_vocab(run.require(run.vocab(), "vocab"))
    if model is None:
        model = target.load_model(cfg.target, device=device, **load_kw)
    ec = cfg.extract
    return Capture(model, ec.layer_ids, d2t, t2d, teacher=ec.teacher, topk=ec.topk,
                   out_dtype=out_dtype, batch_tokens=ec.batch_tokens,
                   layer_count=layer_count(cfg))


# ---------------------------------------------------------------------------- memory estimate
# Where a target the transformers path cannot hold goes instead (the key docs/extract.md names).
VLLM_PATH = "extract.engine: vllm (docs/extract.md)"


class UnfitTarget(DrafterError):
    """The transformers path cannot hold this target: refused before any weight loads."""


def param_count(config, trust_remote_code: bool | None = None) -> int:
    """Parameters of a target from its config alone (built on the meta device: no memory)."""
    from drafter.core.target import meta_model

    return sum(p.numel() for p in meta_model(config, trust_remote_code).parameters())


def weights_per_gpu(weights: dict, tp: int) -> int:
    """Weight bytes one rank holds (`weights` from core.weights.weight_bytes): 1/tp of them under
    transformers' tensor parallelism, but the routed experts whole, which its tp plans do not
    shard (each rank of a 2-rank tiny DeepSeek-V3 held every expert)."""
    if tp <= 1:
        return weights["bytes"]
    return (weights["bytes"] - weights["routed_bytes"]) // tp + weights["routed_bytes"]


def _gib(n: float) -> str:
    return f"{n / (1 << 30):,.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):,.1f} MiB"


def transformers_refusal(config, weights: dict, sharded: bool, ranks: int,
                         gpu_bytes: float | None) -> str | None:
    """Why extract's transformers path cannot run this target, in one line, or None: a MoE
    target under extract.tp (its experts would be whole on every rank), or weights per GPU
    above one GPU's memory. `drafter plan` and extract's check before loading share it."""
    from drafter.core.target import moe_shape

    experts, _ = moe_shape(config)
    if sharded and experts > 1:
        return (f"extract.tp: the target is a MoE ({experts} routed experts) and transformers' "
                f"tensor parallelism leaves the routed experts whole on every rank "
                f"({_gib(weights['routed_bytes'])} per GPU, not 1/{ranks}): use {VLLM_PATH}, "
                f"or extract.tp=false where one GPU holds the whole target "
                f"({_gib(weights['bytes'])})")
    per_gpu = weights_per_gpu(weights, ranks if sharded else 1)
    if gpu_bytes and per_gpu > gpu_bytes:
        more = "" if sharded or experts > 1 else ", or extract.tp=true over enough GPUs"
        return (f"extract: the target's weights need {_gib(per_gpu)} per GPU "
                f"({weights['source']}), more than one GPU's {_gib(gpu_bytes)}: transformers "
                f"cannot load it; use {VLLM_PATH}{more}")
    return None


def refuse_unfit(tcfg, config, sharded: bool, d) -> dict | None:
    """extract's check before any weight loads (drafter plan tells the same): raises UnfitTarget
    with transformers_refusal's line. `d`: the process's Dist (device, world, local rank); GPU
    memory from NVML. Returns the weights (core.weights.weight_bytes) where it sized them, for the
    memory estimate that follows, else None (a CPU run that shards nothing)."""
    from drafter.core import gpu
    from drafter.core.target import meta_model, moe_shape, pick_dtype
    from drafter.core.weights import weight_bytes

    on_gpu = d.device.type == "cuda"
    if not on_gpu and not (sharded and moe_shape(config)[0] > 1):
        return None
    nbytes = torch.finfo(pick_dtype(tcfg, str(d.device))).bits // 8
    weights = weight_bytes(config, nbytes, meta_model(config, tcfg.trust_remote_code))
    mem = None
    if on_gpu:
        devs = gpu.devices()
        visible = gpu.visible_indices(devs) if devs else []
        if d.local_rank < len(visible):
            mem = next((g.total for g in devs if g.index == visible[d.local_rank]), None)
    why = transformers_refusal(config, weights, sharded, d.world, mem)
    if why:
        raise UnfitTarget(why)
    return weights


def estimate_gpu_bytes(config, dtype_bytes: int, batch_tokens: int, n_aux: int = 3,
                       tp: int = 1, weights: dict | None = None) -> dict:
    """GPU bytes one rank needs for extraction: its weights (weights_per_gpu) + activations of
    a prefill of `batch_tokens` + the capture buffers + a logits chunk. Activations: residual,
    norm output, attention q/k/v/o and the MLP's three intermediate tensors are alive at once in
    a no-grad forward (~4 Ht + 3 I per token), plus 25% for allocator fragmentation. `weights`:
    core.weights.weight_bytes of the target (sized here when not given: quantised modules at their
    stored bits)."""
    from drafter.core.target import hidden_size, text_config, vocab_size
    from drafter.core.weights import weight_bytes

    tc = text_config(config)
    weights = weight_bytes(config, dtype_bytes) if weights is None else weights
    ht = hidden_size(config)
    # per token: the dense MLP's intermediate, or k routed experts' (whichever is wider)
    inter = max(getattr(tc, "intermediate_size", None) or 4 * ht,
                (getattr(tc, "moe_intermediate_size", None) or 0)
                * (getattr(tc, "num_experts_per_tok", None) or 1))
    act = batch_tokens * (4 * ht + 3 * inter) * dtype_bytes
    capture = batch_tokens * (n_aux + 1) * ht * dtype_bytes
    # one fp32 chunk [c, V] and its model-dtype source
    logits = min(LOGITS_CHUNK_BYTES, batch_tokens * vocab_size(config) * 4) * 3 // 2
    w = weights_per_gpu(weights, tp)
    total = int((w + act + capture + logits) * 1.25) if w else 0
    return {"weights": w, "activations": act, "capture": capture, "logits": logits,
            "total": total}
