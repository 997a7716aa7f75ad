"""Read any drafter dir back: our training checkpoint (either kind), an EAGLE-3 native or
speculators dir, ours or published (sharded safetensors, or pytorch_model.bin read with
torch.load(weights_only=True)), or a block drafter's native dir (DSpark, DFlash:
drafter/export/dsparkdir.py).

    ed = read_dir(path)           # EngineDir: format, config.json, tensor names/shapes/dtypes,
                                  # drafter.json; no weights loaded (what `drafter check` lints)
    model = load_drafter_dir(path, target=engines.target_info(spec))   # a Drafter or DSpark,
                                                                        # in eval mode

Fields are read the way the engines read them: the layouts, flag defaults and layer-id meanings
are drafter.export.engines' (its docstring cites the engines' source). Unlike the engines, unknown
tensor names are refused.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from drafter.export import dsparkdir
from drafter.export.engines import (
    CONFIG_FILE,
    DTYPES,
    EAGLE_KEYS,
    FLAG_DEFAULTS,
    META_FILE,
    MLA_ARCHS,
    MLA_SIZES,
    NATIVE,
    NATIVE_ARCHS,
    SPECULATORS,
    SPECULATORS_ARCHS,
    WEIGHTS_FILE,
    EngineDirError,
    TargetInfo,
    default_layer_ids,
    rope_of,
    to_hs,
)
from drafter.train.dspark import DSpark, load_model
from drafter.train.model import Drafter, DrafterConfig


@dataclass
class EngineDir:
    """An engine layout read from disk without loading the weights."""
    path: Path
    fmt: str
    config: dict                      # config.json as written
    flat: dict                        # Llama fields + eagle fields in one dict
    # name -> (shape, safetensors dtype such as "BF16")
    tensors: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    weight_files: list[Path] = field(default_factory=list)
    meta: dict | None = None          # drafter.json, when present

    @property
    def method(self) -> str:
        """The drafter kind: 'eagle3', or a block drafter's 'dflash' / 'dspark'."""
        return dsparkdir.method_of(self.config) or "eagle3"

    @property
    def block(self) -> bool:
        return self.method in dsparkdir.ARCHS

    @property
    def mla(self) -> bool:
        """An MLA draft layer (Eagle3DeepseekV2ForCausalLM, or MLA sizes in the config)."""
        arch = (self.config.get("architectures") or [None])[0]
        return arch in MLA_ARCHS or bool(self.flat.get("kv_lora_rank"))

    @property
    def pickled(self) -> bool:
        """Weights in pytorch_model*.bin (read with torch.load(weights_only=True) only)."""
        return any(f.suffix == ".bin" for f in self.weight_files)

    def load(self, names=None) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        out = {}
        for f in self.weight_files:
            if f.suffix == ".bin":
                sd = _load_pickle(f)
                out.update({n: v for n, v in sd.items() if names is None or n in names})
                continue
            with safe_open(str(f), "pt") as h:
                for n in h.keys():
                    if names is None or n in names:
                        out[n] = h.get_tensor(n)
        return out


_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
                       torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
                       torch.bool: "BOOL"}


def _load_pickle(f: Path) -> dict[str, torch.Tensor]:
    """Published drafters (EAGLE's own releases) ship pytorch_model.bin: read it with
    weights_only=True (tensors only, no code runs), memory-mapped."""
    try:
        sd = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - refused or corrupt: reported by the caller
        raise EngineDirError(f"{f}: not loadable with torch.load(weights_only=True): {e}") from None
    if not isinstance(sd, dict):
        raise EngineDirError(f"{f}: holds a {type(sd).__name__}, not a state dict")
    return sd


def detect_format(config: dict) -> str | None:
    arch = (config.get("architectures") or [None])[0]
    if arch in SPECULATORS_ARCHS or "speculators_config" in config \
            or "transformer_layer_config" in config:
        return SPECULATORS
    if arch in NATIVE_ARCHS or arch in MLA_ARCHS or dsparkdir.method_of(config):
        return NATIVE
    return None


def read_dir(path) -> EngineDir:
    """Config, tensor names/shapes/dtypes and hints of an engine dir (native or speculators)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_dir():
        raise EngineDirError(f"{path}: not a directory")
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        hint = (" (a drafter training checkpoint: run `drafter export`)"
                if (path / "drafter_config.json").exists() else "")
        raise EngineDirError(f"{cfg_path}: not found{hint}")
    try:
        config = json.loads(cfg_path.read_bytes())
    except json.JSONDecodeError as e:
        raise EngineDirError(f"{cfg_path}:{e.lineno}: not valid JSON: {e.msg}") from None
    except ValueError as e:  # not UTF-8
        raise EngineDirError(f"{cfg_path}: not a JSON text ({e})") from None
    if not isinstance(config, dict):
        raise EngineDirError(f"{cfg_path}: holds a JSON {type(config).__name__}, expected an "
                             f"object of config fields")
    fmt = detect_format(config)
    if fmt is None:
        known = NATIVE_ARCHS + MLA_ARCHS + SPECULATORS_ARCHS + tuple(dsparkdir.ARCHS.values())
        raise EngineDirError(f"{cfg_path}: architectures {config.get('architectures')} is not a "
                             f"draft model drafter knows ({', '.join(known)})")
    flat = dict(config)
    if fmt == SPECULATORS:
        # What vLLM's update_eagle3 builds: the layer config, then the eagle fields on top
        # (other top-level keys such as tie_word_embeddings are not read by it).
        flat = {**{k: v for k, v in config.items() if k != "transformer_layer_config"},
                **(config.get("transformer_layer_config") or {}),
                **{k: config[k] for k in EAGLE_KEYS if k in config}}
    ed = EngineDir(path=path, fmt=fmt, config=config, flat=flat)
    for index, single in (("model.safetensors.index.json", WEIGHTS_FILE),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if (path / index).is_file():
            try:
                files = sorted(set(json.loads((path / index).read_bytes())["weight_map"]
                                   .values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise EngineDirError(f"{path / index}: not a weight index ({e})") from None
            ed.weight_files = [path / f for f in files]
        elif (path / single).is_file():
            ed.weight_files = [path / single]
        if ed.weight_files:
            break
    for f in ed.weight_files:
        if f.suffix == ".bin":
            for n, v in _load_pickle(f).items():
                ed.tensors[n] = (tuple(v.shape), _SAFETENSORS_DTYPES.get(v.dtype, str(v.dtype)))
            continue
        try:
            with safe_open(str(f), "pt") as h:
                for n in h.keys():
                    sl = h.get_slice(n)
                    ed.tensors[n] = (tuple(sl.get_shape()), str(sl.get_dtype()))
        except Exception as e:  # noqa: BLE001 - a corrupt file is reported, not raised
            raise EngineDirError(f"{f}: not a readable safetensors file: {e}") from None
    if (path / META_FILE).is_file():
        try:
            meta = json.loads((path / META_FILE).read_bytes())
        except ValueError:
            meta = None
        ed.meta = meta if isinstance(meta, dict) else None
    return ed


def drafter_config_from_dir(ed: EngineDir, num_target_layers: int | None = None) -> DrafterConfig:
    """DrafterConfig of an engine dir, read the way the engines read it. Aux ids (HS meaning):
    drafter.json, else vLLM's reading (top-level key), else SGLang's (eagle_config + 1), else the
    default for `num_target_layers`."""
    f = ed.flat
    if f.get("norm_before_fc"):
        raise EngineDirError(f"{ed.path}: norm_before_fc (one RMSNorm over the concatenated aux "
                             "states) is not implemented by drafter.train.model")
    H = int(f["hidden_size"])
    nh = int(f["num_attention_heads"])
    theta, scaling, _ = rope_of(f)
    if ed.meta and ed.meta.get("aux_layer_ids_hs"):
        ids = list(ed.meta["aux_layer_ids_hs"])
    elif f.get("eagle_aux_hidden_state_layer_ids"):
        ids = list(f["eagle_aux_hidden_state_layer_ids"])
    elif (f.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
        ids = to_hs(f["eagle_config"]["eagle_aux_hidden_state_layer_ids"], "sglang")
    elif num_target_layers:
        ids = default_layer_ids(num_target_layers)
    else:
        raise EngineDirError(f"{ed.path}: no aux layer ids in config.json: give the target so "
                             "that the default [2, N//2, N-3] can be computed")
    nbr = f.get("norm_before_residual", FLAG_DEFAULTS.get((ed.fmt, "norm_before_residual")))
    vocab = int(f["vocab_size"])
    mla = {}
    if ed.mla:  # DeepSeek's latent attention (drafter/train/mla.py); a q/k head of dn + dr
        mla = {"draft_layer": "mla", **{k: f.get(k) for k in MLA_SIZES}}
        mla["head_dim"] = int(f["qk_nope_head_dim"]) + int(f["qk_rope_head_dim"])
        if scaling:  # what the engines' MLA attention computes: DeepSeek's YaRN
            scaling = {**scaling, "rope_type": "yarn"}
    return DrafterConfig(**{**dict(
        hidden_size=H, intermediate_size=int(f["intermediate_size"]), num_attention_heads=nh,
        num_key_value_heads=int(f.get("num_key_value_heads") or nh),
        head_dim=int(f.get("head_dim") or H // nh), vocab_size=vocab,
        draft_vocab_size=int(f.get("draft_vocab_size") or vocab),
        target_hidden_size=int(f.get("target_hidden_size") or H), aux_layer_ids=ids,
        rms_norm_eps=float(f.get("rms_norm_eps", 1e-6)), hidden_act=f.get("hidden_act", "silu"),
        rope_theta=theta if theta is not None else 10000.0, rope_scaling=scaling,
        max_position_embeddings=int(f.get("max_position_embeddings") or 2048),
        norm_before_residual=bool(nbr), fc_norm=bool(f.get("fc_norm", False)),
        norm_output=_feedback_post_norm(ed), norm_before_fc=False), **mla})


def _feedback_post_norm(ed: EngineDir) -> bool:
    """EAGLE-3.1's "feed back the post-norm state": `feedback_post_norm`; in our own exports
    from before that key (drafter.json present), `norm_output`. Another dir's `norm_output` is
    not read: SpecForge means by it the final norm before lm_head, which this drafter always
    applies (`drafter check` warns about it)."""
    f = ed.flat
    if "feedback_post_norm" in f:
        return bool(f["feedback_post_norm"])
    if ed.mla:  # the engines' MLA draft classes read norm_output in this meaning
        return bool(f.get("norm_output", False))
    return bool(f.get("norm_output", False)) if ed.meta is not None else False


def _target_embeddings(target: TargetInfo | None, V: int, H: int) -> torch.Tensor:
    """The target's input embeddings [V, H] read from its safetensors (for dirs that do not ship
    embed_tokens; engines share the target's in that case)."""
    from safetensors import safe_open

    if target is None or not target.local_dir:
        raise EngineDirError("the drafter dir has no embed_tokens.weight: give a target with a "
                             "local HF folder to take the embeddings from")
    d = Path(target.local_dir)
    index = d / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else [p.name for p in d.glob("*.safetensors")])
    for fname in files:
        with safe_open(str(d / fname), "pt") as h:
            for n in h.keys():
                if n.endswith("embed_tokens.weight"):
                    w = h.get_tensor(n)
                    if tuple(w.shape) == (V, H):
                        return w
    raise EngineDirError(f"{d}: no embed_tokens.weight of shape [{V}, {H}]")


def load_drafter_dir(path, device="cpu", dtype: torch.dtype | None = None,
                     target: TargetInfo | None = None) -> Drafter | DSpark:
    """A drafter from our checkpoint dir (drafter_config.json, either kind), a native dir or a
    speculators dir, ours or published, as drafter.train.model.Drafter, or a block drafter's
    native dir as drafter.train.dspark.DSpark. Unlike the engines it refuses unknown tensor
    names. dtype None keeps the file's (config torch_dtype). A missing d2t loads as the identity
    (what vLLM does); a missing embed_tokens is taken from `target`."""
    path = Path(path)
    if (path / "drafter_config.json").exists():
        return load_model(path, device=device, dtype=dtype or torch.float32).eval()
    ed = read_dir(path)
    if ed.block:
        return load_block_dir(ed, device, dtype, target)
    cfg = drafter_config_from_dir(ed, target.num_hidden_layers if target else None)
    sd = ed.load()
    ours: dict[str, torch.Tensor] = {}
    fc_norm: dict[int, torch.Tensor] = {}
    for n, v in sd.items():
        if n.startswith("layers.0."):  # either layout's layer prefix -> ours (midlayer.*)
            n = "midlayer." + n[len("layers.0."):]
        if n.startswith("fc_norm.") and n.endswith(".weight") and n.split(".")[1].isdigit():
            fc_norm[int(n.split(".")[1])] = v
            continue
        ours[n] = v
    if fc_norm:
        ours["fc_norm.weight"] = torch.stack([fc_norm[i] for i in sorted(fc_norm)])  # [3, Ht]
    if "lm_head.weight" not in ours:
        raise EngineDirError(f"{path}: no lm_head.weight")
    if "embed_tokens.weight" not in ours:
        ours["embed_tokens.weight"] = _target_embeddings(target, cfg.vocab_size, cfg.hidden_size)
    if "d2t" not in ours:
        ours["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    if "t2d" not in ours:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + ours["d2t"].long()] = True
        ours["t2d"] = t2d
    ours["d2t"] = ours["d2t"].long()
    ours["t2d"] = ours["t2d"].bool()
    return _load_strict(Drafter(cfg), ours, ed, sd, device, dtype)


def _load_strict(model, ours: dict, ed: EngineDir, sd: dict, device, dtype):
    """`model` with every tensor of `ours` by name and shape (EngineDirError otherwise), in
    `dtype` (None: config.json's torch_dtype, else the file's), in eval mode."""
    try:
        missing, unexpected = model.load_state_dict(ours, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise EngineDirError(f"{ed.path}: tensors do not match config.json: {e}") from None
    if missing or unexpected:
        raise EngineDirError(f"{ed.path}: tensors do not match the config: missing {missing}, "
                             f"unknown {unexpected}")
    if dtype is None:
        name = ed.flat.get("torch_dtype") or ed.flat.get("dtype")
        dtype = DTYPES.get(str(name), next(v.dtype for v in sd.values() if v.is_floating_point()))
    return model.to(device=device, dtype=dtype).eval()


def load_block_dir(ed: EngineDir, device="cpu", dtype: torch.dtype | None = None,
                   target: TargetInfo | None = None) -> DSpark:
    """A block drafter's native dir (read_dir's) as DSpark: its config as vLLM reads it
    (dsparkdir.config_from_engine), every tensor by name and shape, strict."""
    cfg = dsparkdir.config_from_engine(ed.config, ed.meta)
    sd = ed.load()
    embed = None if "embed_tokens.weight" in sd else \
        _target_embeddings(target, cfg.vocab_size, cfg.hidden_size)
    return _load_strict(DSpark(cfg), dsparkdir.engine_to_model(sd, cfg, embed), ed, sd, device,
                        dtype)
