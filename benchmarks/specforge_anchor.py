"""The side-by-side anchor of benchmarks/train_throughput.py: SpecForge's own EAGLE-3 model and
training step at the same shape, timed the same way. Optional: it runs when
`import specforge` works on a CUDA machine, and the benchmark prints why it skipped otherwise.

    pip install 'drafter[bench]'   # SpecForge from PyPI, with its pins (torch 2.11, sglang, ...)
    pip install --no-deps specforge  # enough here: this file needs its model code only (and
                                     # torch, transformers and triton, which the GPU image has)

What runs, read from specforge 0.2.0 (the wheel's specforge/, MIT): the draft model
`modeling.draft.llama3_eagle.LlamaForCausalLMEagle3` with `attention_backend="flex_attention"`
(its compiled FlexAttention over a growing KV cache, one block mask per TTT step), wrapped in
`algorithms.eagle3.model.OnlineEagle3Model(length=K)` (the TTT unroll, its Triton
LogSoftmaxLoss), driven by `training.strategies.base.Eagle3TrainStrategy.forward_loss` with an
offline target head (`modeling.target.target_head.TargetHead`: the stored final hidden state
through the full-vocab lm_head, shifted, every step), and `optimizer.BF16Optimizer` (bf16
weights, fp32 master copies, clip 0.5, AdamW): what `specforge train` runs per step on one GPU
(its FSDP wrapper, a no-op at one rank, left out). Same features as drafter's fixed mode: one
sample per row, every token in the loss, aux N(0, 1); SpecForge takes the teacher as the
final hidden state only (it has no top-k form). Its weights are bf16 without autocast, as in its
trainer. Timing: warm-up steps, then `steps` steps between two synchronisations; peak memory
over the timed steps.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch


def unavailable(device) -> str | None:
    """Why the anchor cannot run here, or None."""
    if device.type != "cuda":
        return "SpecForge's step needs a CUDA GPU (Triton loss kernel, compiled FlexAttention)"
    try:
        import specforge  # noqa: F401
        import triton  # noqa: F401
    except ImportError as e:
        return f"{e.name} is not installed (pip install 'drafter[bench]' or --no-deps specforge)"
    return None


def bench(shape: dict, B: int, T: int, K: int, steps: int, warmup: int, device) -> dict:
    """SpecForge's training step at `shape` (train_throughput.SHAPES keys): tokens/s, ms/step,
    warm-up seconds, peak GiB."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from specforge.optimizer import BF16Optimizer
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.strategies.base import Eagle3TrainStrategy
    from transformers import LlamaConfig

    H, Ht, V, Vd = (shape["hidden_size"], shape["target_hidden_size"], shape["vocab_size"],
                    shape["draft_vocab_size"])
    cfg = dict(hidden_size=H, intermediate_size=shape["intermediate_size"],
               num_attention_heads=shape["num_attention_heads"],
               num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"],
               vocab_size=V, num_hidden_layers=1, max_position_embeddings=max(8192, T + K),
               rope_theta=shape.get("rope_theta", 10000.0), rms_norm_eps=1e-5,
               hidden_act="silu", pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    draft = LlamaForCausalLMEagle3(LlamaConfig(**cfg, draft_vocab_size=Vd, target_hidden_size=Ht),
                                   attention_backend="flex_attention")
    with torch.no_grad():  # draft vocab = the first Vd target ids (d2t: offsets, all 0)
        draft.t2d.zero_()
        draft.t2d[:Vd] = True
        draft.d2t.zero_()
    draft.freeze_embedding()
    draft = draft.to(device=device, dtype=torch.bfloat16)
    model = OnlineEagle3Model(draft, length=K, attention_backend="flex_attention") \
        .to(device=device, dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as d:  # TargetHead reads the target's config from a dir
        (Path(d) / "config.json").write_text(json.dumps(
            {**cfg, "hidden_size": Ht, "model_type": "llama", "num_hidden_layers": 32}))
        head = TargetHead(d)
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.05)
    head.freeze_weights()
    head = head.eval().to(device=device, dtype=torch.bfloat16)
    strategy = Eagle3TrainStrategy(model, target_head=head)
    opt = BF16Optimizer(draft, lr=1e-4, max_grad_norm=0.5, total_steps=10 * (steps + warmup))

    g = torch.Generator().manual_seed(0)
    tensors = {"input_ids": torch.randint(0, V, (B, T), generator=g),
               "attention_mask": torch.ones(B, T, dtype=torch.long),
               "loss_mask": torch.ones(B, T, dtype=torch.long),
               "hidden_state": torch.randn(B, T, 3 * Ht, generator=g).to(torch.bfloat16),
               "target": torch.randn(B, T, Ht, generator=g).to(torch.bfloat16)}
    tensors = {k: v.pin_memory() for k, v in tensors.items()}
    batch = TrainBatch(sample_ids=[str(i) for i in range(B)], strategy="eagle3",
                       tensors=tensors, metadata={"target_repr": "hidden_state"})

    def step():
        out = strategy.forward_loss(batch)  # moves the batch to the GPU, as its trainer does
        out.loss.backward()
        opt.step()

    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize(device)
    warm_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize(device)
    dt = time.perf_counter() - t0
    return {"tok_s": B * T * steps / dt, "step_ms": 1e3 * dt / steps, "warmup_s": warm_s,
            "mem_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "params": sum(p.numel() for p in draft.parameters() if p.requires_grad)}
