"""The target's weights as stored, read without loading the model: single tensors from its
safetensors files (`weight_files`, `read_weight`; an HF id fetches only the index and the shards
it reads), the input embeddings train copies into the drafter (`target_embeddings`), and the
bytes of its weights, quantised modules at the bits config.json's `quantization_config` gives
them (`weight_bytes`, on the model built on the meta device; docs/operations.md, "Quantised
targets").
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

from drafter.core.rundir import read_json
from drafter.core.target import (is_routed_expert, load_config, load_model, meta_model, resolve,
                                 text_config)

if TYPE_CHECKING:
    import torch

log = logging.getLogger("drafter")


def weight_files(tcfg) -> tuple[Path, dict[str, str]]:
    """(folder, tensor name -> file) of the target's safetensors, without loading any (an HF
    id: the index alone); an empty map when the folder has no safetensors."""
    from safetensors import safe_open

    spec = resolve(tcfg.model)
    folder = Path(spec)
    if not folder.is_dir():  # an HF id: the index, then only the shards a caller reads
        from huggingface_hub import snapshot_download
        folder = Path(snapshot_download(spec, revision=tcfg.revision, allow_patterns=["*.json"]))
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return folder, read_json(index)["weight_map"]
    if (folder / "model.safetensors").exists():
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            return folder, {k: "model.safetensors" for k in f.keys()}
    return folder, {}


def read_weight(tcfg, folder: Path, weight_map: dict[str, str], name: str) -> torch.Tensor:
    """One tensor of the target's checkpoint (its shard fetched first for an HF id)."""
    from safetensors import safe_open

    file = folder / weight_map[name]
    if not file.exists():
        from huggingface_hub import hf_hub_download
        file = Path(hf_hub_download(resolve(tcfg.model), weight_map[name],
                                    revision=tcfg.revision))
    with safe_open(str(file), "pt") as f:
        return f.get_tensor(name)


def target_embeddings(tcfg) -> torch.Tensor:
    """The target's input embeddings [V, Ht] read from its safetensors (no model load): the
    tensor of the module transformers calls the input embeddings, else a known name."""
    folder, weight_map = weight_files(tcfg)
    meta = meta_model(load_config(tcfg), tcfg.trust_remote_code)
    emb = meta.get_input_embeddings()
    names = [n + ".weight" for n, m in meta.named_modules() if m is emb]
    names += sorted((k for k in weight_map if k.endswith(
        ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "tok_embeddings.weight"))
        and "mtp" not in k and "vision" not in k), key=len)
    shape = tuple(emb.weight.shape)
    for name in names:
        if name in weight_map:
            w = read_weight(tcfg, folder, weight_map, name)
            if tuple(w.shape) == shape:
                return w
    log.info("train: embeddings not found by name in %s; loading the target to read them",
             tcfg.model)
    return load_model(tcfg, device="cpu").get_input_embeddings().weight.detach().clone()


# ------------------------------------------------------------------------- weights as stored
# Modules outside the language model: published multimodal checkpoints keep these towers at the
# config dtype whatever their quantization_config says (Kimi-K2.5's vision tower is bf16).
TOWERS = ("vision", "visual", "audio", "mm_projector", "multi_modal_projector")
# Storage of the scale of a group of weights (bf16/fp16; compressed-tensors' default), and of a
# zero point of an asymmetric scheme (its own bits, packed).
SCALE_BITS = 16


def quantization_config(config) -> dict | None:
    """config.json's quantization_config, top-level or in the text config, as a dict."""
    for c in (config, text_config(config)):
        q = getattr(c, "quantization_config", None)
        if q is not None:
            return q if isinstance(q, dict) else q.to_dict()
    return None


def _matches(entry: str, names: list[str], cls: str) -> bool:
    """compressed-tensors' rule for a `targets`/`ignore` entry: `re:PATTERN` matched from the
    start of a module name, else a module name or a class name."""
    if entry.startswith("re:"):
        return any(re.match(entry[3:], n) for n in names)
    return entry == cls or entry in names


def _group_bits(w: dict, fmt: str | None) -> float:
    """Bits per weight of a compressed-tensors weights scheme: the stored value, plus its share
    of a group's scale (and zero point when asymmetric)."""
    bits = int(w.get("num_bits") or 8)
    if fmt in ("naive-quantized", "int-quantized", "float-quantized"):
        bits = max(bits, 8)  # one value per byte, unpacked
    strategy, gs = w.get("strategy"), w.get("group_size")
    per_group = SCALE_BITS + (0 if w.get("symmetric", True) else int(w.get("num_bits") or 8))
    if strategy in ("group", "tensor_group") and gs:
        return bits + per_group / int(gs)
    if strategy == "block" and w.get("block_structure"):
        a, b = w["block_structure"]
        return bits + per_group / (int(a) * int(b))
    return float(bits)  # channel / tensor: one scale a row or a tensor, nothing per weight


def _quant_rule(q: dict | None):
    """(bits(names, class) -> float | None, description) for a quantization_config; a None rule
    for none or an unknown method (everything at the config dtype)."""
    if q is None:
        return None, "no quantization_config"
    method = str(q.get("quant_method") or "").lower()
    if method == "compressed-tensors":
        fmt = q.get("format")
        groups = [(g.get("targets") or [], _group_bits(g["weights"], fmt), g["weights"])
                  for g in (q.get("config_groups") or {}).values() if g.get("weights")]
        ignore = list(q.get("ignore") or [])

        def rule(names, cls):
            if any(_matches(e, names, cls) for e in ignore):
                return None
            return next((b for targets, b, _ in groups
                         if any(_matches(t, names, cls) for t in targets)), None)

        desc = "; ".join(f"{w.get('num_bits')}-bit {w.get('type', 'int')} "
                         f"{w.get('strategy')}" + (f" {w['group_size']}" if w.get("group_size")
                                                    else "") + f" = {b:.2f} bits/weight"
                         for _, b, w in groups)
        return rule, f"compressed-tensors {fmt}: {desc or 'no weight scheme'}"
    if method in ("gptq", "awq", "fp8"):
        skip = list(q.get("modules_to_not_convert") or []) + ["lm_head"]
        if method == "fp8":
            block = q.get("weight_block_size")
            bits = 8 + (32 / (block[0] * block[1]) if block else 0)  # fp32 scale a block
            desc = f"fp8 {'blocks ' + 'x'.join(map(str, block)) if block else 'per tensor'}"
        else:
            n, gs = int(q.get("bits") or 4), int(q.get("group_size") or -1)
            bits = n + ((SCALE_BITS + n) / gs if gs > 0 else 0)  # fp16 scale + packed zero
            desc = f"{method} {n}-bit, groups of {gs}"

        def rule(names, cls):
            if cls != "Linear" or any(s == n or n.endswith("." + s) for s in skip
                                      for n in names):
                return None
            return bits

        return rule, f"{desc} = {bits:.2f} bits/weight"
    return None, f"quant_method {method or '?'} unknown to drafter"


def _lm_prefix(model) -> str:
    """'language_model.' when the model wraps a whole causal LM (its lm_head included) under a
    submodule, as Kimi-K2.5 does: the names its quantization_config was written for start
    below it."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model
    if inner is model or getattr(inner, "get_output_embeddings", lambda: None)() is None:
        return ""
    return next((n + "." for n, m in model.named_modules() if m is inner), "")


def weight_bytes(config, dtype_bytes: int, model=None) -> dict:
    """The target's weights as stored: the Linear weights a quantization_config covers at its
    bits (routed experts fused into [E, ...] tensors count as Linears), everything else, and
    anything under an unknown method, at `dtype_bytes`. -> {"bytes", "routed_bytes" (of the
    routed experts), "quantised_params", "source" (one line: where the figure comes from)}.
    `model`: the meta model when the caller has it (else built here)."""
    from torch import nn

    model = meta_model(config) if model is None else model
    q = quantization_config(config)
    rule, how = _quant_rule(q)
    prefix = _lm_prefix(model)
    total = routed = 0.0
    quantised = 0
    seen: set[int] = set()
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{mname}.{pname}" if mname else pname
            bits = None
            linear = isinstance(mod, nn.Linear) and pname == "weight"
            if rule is not None and not any(t in full for t in TOWERS) \
                    and (linear or (p.dim() == 3 and is_routed_expert(full))):
                name = mname if linear else full
                names = [name] + ([name[len(prefix):]] if prefix and name.startswith(prefix)
                                  else [])
                bits = rule(names, "Linear")
            n = p.numel() * (bits / 8 if bits else dtype_bytes)
            quantised += p.numel() if bits else 0
            total += n
            routed += n if is_routed_expert(full) else 0
    dname = f"{8 * dtype_bytes} bits"
    if rule is None:
        source = f"{how}: every weight at {dname}"
    elif not quantised:
        source = f"quantization_config ({how}) covers no weight here: every weight at {dname}"
    else:
        source = (f"quantization_config {how}, on {quantised:,} weights; the rest at {dname}")
    return {"bytes": int(total), "routed_bytes": int(routed), "quantised_params": quantised,
            "source": source}
