"""`drafter check`'s engine rule: does the installed engine serve EAGLE-3 for this target at all?

An engine hands a drafter its aux hidden states only through target classes that capture them
(vLLM: the `SupportsEagle3` interface, `set_aux_hidden_state_layers`; SGLang:
`set_eagle3_layers_to_capture`). For any other class the engine still runs the drafter, on no
features, and acceptance collapses without an error (a Kimi-K2.5 drafter in a vLLM whose class
for the wrapper lacked the interface accepted a fraction of what it does offline). The rule
resolves the target's architecture (the wrapper's own, from its config.json) in each installed
engine's model registry and fails when the class lacks the interface, naming the engine's
version and what to do. An engine that is not installed, or a target whose architecture is not
known, is a skip: said in the report and counted apart (neither a pass nor a warning), never
assumed. A registry that cannot be read is a warning.
"""
from __future__ import annotations

import importlib.util

from drafter.core.vllm import quiet_cpu_triton
from drafter.export.rules import FAIL, PASS, WARN, Check

SKIP = "skip"   # the rule could not run here: said, not counted as a pass or a warning


def _vllm(archs: list[str]) -> Check:
    quiet_cpu_triton()
    import vllm
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    ver = vllm.__version__
    for arch in archs:
        cls = ModelRegistry._try_load_model_cls(arch)
        if cls is None:
            continue
        if supports_eagle3(cls):
            return Check("engine_support_vllm", PASS, f"vLLM {ver}: {arch} ({cls.__name__}) "
                         f"hands aux hidden states to EAGLE-3 drafters")
        return Check("engine_support_vllm", FAIL,
                     f"vLLM {ver}: {arch} ({cls.__name__}) does not implement EAGLE-3 (no "
                     f"SupportsEagle3 / set_aux_hidden_state_layers): served with this drafter "
                     f"it would draft on no features and accept almost nothing. Upgrade vLLM to "
                     f"a version whose {arch} supports EAGLE-3, or serve with SGLang if it does")
    return Check("engine_support_vllm", FAIL,
                 f"vLLM {ver} has no model class for {archs}: it cannot serve this target")


def _sglang(archs: list[str]) -> Check:
    import sglang
    from sglang.srt.models.registry import ModelRegistry

    ver = getattr(sglang, "__version__", "?")
    models = getattr(ModelRegistry, "models", {})
    for arch in archs:
        cls = models.get(arch)
        if cls is None:
            continue
        if hasattr(cls, "set_eagle3_layers_to_capture"):
            return Check("engine_support_sglang", PASS, f"SGLang {ver}: {arch} captures "
                         f"EAGLE-3 layers")
        return Check("engine_support_sglang", FAIL,
                     f"SGLang {ver}: {arch} does not implement EAGLE-3 "
                     f"(set_eagle3_layers_to_capture): acceptance would collapse. Upgrade "
                     f"SGLang, or serve with vLLM if it supports this target")
    return Check("engine_support_sglang", FAIL,
                 f"SGLang {ver} has no model class for {archs}: it cannot serve this target")


def c_engine_support(target) -> list[Check]:
    """One check per engine: pass, fail, skip (not installed, or no target known), or a warning
    when the registry could not be read."""
    out = []
    archs = list(getattr(target, "architectures", None) or []) if target is not None else []
    for engine, name, fn in (("vllm", "vLLM", _vllm), ("sglang", "SGLang", _sglang)):
        key = f"engine_support_{engine}"
        if importlib.util.find_spec(engine) is None:
            out.append(Check(key, SKIP, f"{name} is not installed here: whether it serves "
                             f"EAGLE-3 for this target was not checked"))
        elif not archs:
            out.append(Check(key, SKIP, "no target architecture known (give --target): "
                             f"{name}'s support was not checked"))
        else:
            try:
                out.append(fn(archs))
            except Exception as e:  # noqa: BLE001 - an engine's internals move between versions
                out.append(Check(key, WARN, f"{name}'s model registry could not be read "
                                 f"({type(e).__name__}: {e}): not checked"))
    return out
