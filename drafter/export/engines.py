"""What the serving engines load: the `native/` and `speculators/` layouts of an EAGLE-3 drafter,
aux layer ids in each engine's meaning, and the writers of both layouts. drafter.export.enginedir
reads either layout (ours or a published one) back. The contract is ../shared/docs/ENGINES.md.

    native/       LlamaForCausalLMEagle3, tensors midlayer.*      (SGLang, vLLM method eagle3,
                                                                   llama.cpp convert_hf_to_gguf.py)
    speculators/  Eagle3Speculator, tensors layers.0.*, speculators_config  (`vllm serve DIR`)

Each dir holds config.json, model.safetensors, README.md (the serving commands) and drafter.json
(our own record: the trained layer ids, the target's identity and layer count, the checkpoint).
Engines ignore drafter.json; `drafter check` reads it as the dir's own hints.

Layer ids (ENGINES.md "Layer ids"): HS[k] = HF output_hidden_states[k], the residual stream
entering decoder layer k (HS[0] = embeddings).
    "hs"            id k = HS[k]: drafter, vLLM, llama.cpp          default [2, N//2, N-3]
    "layer_output"  id k = output of layer k = HS[k+1]: SGLang's explicit eagle_config ids,
                    SpecForge and NVIDIA ModelOpt configs           default [1, N//2-1, N-4]
A native config.json carries both: the top-level `eagle_aux_hidden_state_layer_ids` (vLLM reads
it first, as HS) and `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang reads only this one,
adding 1), so each engine reads the layers the drafter was trained on.

The engines' source behind each field (vLLM, SGLang, EAGLE-3.1 forks, llama.cpp; 2026
versions) is in docs/internals.md, "Module notes".
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from drafter import DrafterError
from drafter.train.model import Drafter, DrafterConfig, llama_rope_scaling

NATIVE, SPECULATORS = "native", "speculators"
FORMATS = (NATIVE, SPECULATORS)
NATIVE_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # SGLang/SpecForge, vLLM name
# The MLA draft layer (draft_layer mla): vLLM registry.py:672-673 (deepseek_eagle3.py), SGLang
# kimi_k25_eagle3.py's EntryClass. Native layout only: vLLM 0.32's speculators reader maps
# model_type llama and qwen3 only (transformers_utils/configs/speculators/algos.py:39-45).
MLA_ARCHS = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
# model_type of an MLA draft: deepseek_v2. vLLM's SpeculativeConfig.hf_config_override rewrites a
# draft of model_type deepseek_v3 into DeepSeek's MTP module (config/speculative.py:679-694).
MLA_MODEL_TYPE = "deepseek_v2"
MLA_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
SPECULATORS_ARCHS = ("Eagle3Speculator", "Eagle3DraftModel")
PREFIX = {NATIVE: "midlayer.", SPECULATORS: "layers.0."}
CONFIG_FILE, WEIGHTS_FILE, README_FILE, META_FILE = \
    "config.json", "model.safetensors", "README.md", "drafter.json"
# The norm flags an export writes. Ours for EAGLE-3.1's "feed back the post-norm state" is
# `feedback_post_norm`: exports before it wrote `norm_output`, a key SpecForge reads as "apply
# the final norm before lm_head" (default true), so a false there dropped the norm (AMBIGUOUS).
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "feedback_post_norm")
# Keys that engines or trainers read with different meanings: never written by an export;
# `drafter check` warns when a dir has one.
AMBIGUOUS = {
    "norm_output": "SpecForge reads it as 'apply the final norm before lm_head' (default "
                   "true); EAGLE-3.1 engines and drafter exports before feedback_post_norm as "
                   "'feed back the post-norm state' (default false)",
}
# What an engine assumes when a flag is absent (ENGINES.md; sources above).
FLAG_DEFAULTS = {
    (NATIVE, "norm_before_residual"): False,       # vLLM native getattr(..., False); SGLang: False
    (SPECULATORS, "norm_before_residual"): True,   # vLLM update_eagle3: .get(..., True)
}
# Top-level keys of a speculators config that vLLM copies over transformer_layer_config.
EAGLE_KEYS = ("draft_vocab_size", "target_hidden_size", *NORM_FLAGS, "norm_output",
              "eagle_aux_hidden_state_layer_ids")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class EngineDirError(DrafterError):
    """A drafter dir that cannot be read or written as an engine layout."""


# ------------------------------------------------------------------------------------ layer ids
MEANINGS = ("hs", "layer_output")
ENGINE_MEANING = {"drafter": "hs", "vllm": "hs", "llama_cpp": "hs", "sglang": "layer_output",
                  "specforge": "layer_output", "modelopt": "layer_output"}


def default_layer_ids(n_layers: int) -> list[int]:
    """[2, N//2, N-3] in the HS meaning (vLLM, SGLang and llama.cpp defaults)."""
    return [2, n_layers // 2, n_layers - 3]


def from_hs(ids, meaning: str) -> list[int]:
    """HS ids -> ids in `meaning` ('hs' or 'layer_output', or an ENGINE_MEANING key)."""
    meaning = ENGINE_MEANING.get(meaning, meaning)
    if meaning == "hs":
        return [int(k) for k in ids]
    if meaning == "layer_output":
        if any(int(k) < 1 for k in ids):
            raise EngineDirError(f"layer ids {list(ids)}: HS[0] (the embeddings) is no layer's "
                                 f"output and cannot be written in the output-of-layer meaning")
        return [int(k) - 1 for k in ids]
    raise ValueError(f"unknown layer id meaning {meaning!r}")


def to_hs(ids, meaning: str) -> list[int]:
    """Ids in `meaning` -> HS ids."""
    meaning = ENGINE_MEANING.get(meaning, meaning)
    if meaning == "hs":
        return [int(k) for k in ids]
    if meaning == "layer_output":
        return [int(k) + 1 for k in ids]
    raise ValueError(f"unknown layer id meaning {meaning!r}")


def engine_layer_ids(fmt: str, config: dict) -> dict[str, tuple[list[int] | None, str]]:
    """The HS ids each engine reads from a config.json: {engine: (ids or None, where)}; None
    means the engine falls back to its default [2, N//2, N-3]."""
    top = config.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    out: dict[str, tuple[list[int] | None, str]] = {}
    if fmt == SPECULATORS:
        # update_eagle3 copies the top-level key into the draft config; vLLM reads it as HS.
        out["vllm"] = (list(top), "eagle_aux_hidden_state_layer_ids") if top else (None, "default")
    else:
        if top:
            out["vllm"] = (list(top), "eagle_aux_hidden_state_layer_ids")
        elif nested:
            out["vllm"] = (list(nested), "eagle_config.eagle_aux_hidden_state_layer_ids")
        else:
            out["vllm"] = (None, "default")
        out["sglang"] = ((to_hs(nested, "sglang"), "eagle_config.eagle_aux_hidden_state_layer_ids"
                          " + 1") if nested else (None, "default"))
    # conversion/llama.py recomputes [2, N//2, N-3] from --target-model-dir's config.json. It
    # converts Llama draft layers only: an MLA draft has no llama.cpp reading.
    if (config.get("architectures") or [None])[0] not in MLA_ARCHS:
        out["llama_cpp"] = (None, "recomputed from the target's layer count")
    return out


# --------------------------------------------------------------------------------- the target
@dataclass
class TargetInfo:
    """What an export and a check need to know about the target (no weights)."""
    name_or_path: str
    architectures: list[str]
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int | None = None
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    local_dir: str | None = None   # an HF folder holding config.json, when there is one

    @classmethod
    def from_config_dict(cls, d: dict, name_or_path: str, local_dir: str | None = None):
        flat = {**d, **d["text_config"]} if isinstance(d.get("text_config"), dict) else d
        theta, scaling, _ = rope_of(flat)
        try:
            return cls(name_or_path=name_or_path, architectures=list(d.get("architectures") or []),
                       num_hidden_layers=int(flat["num_hidden_layers"]),
                       hidden_size=int(flat["hidden_size"]), vocab_size=int(flat["vocab_size"]),
                       max_position_embeddings=flat.get("max_position_embeddings"),
                       rope_theta=theta, rope_scaling=scaling, local_dir=local_dir)
        except KeyError as e:
            raise EngineDirError(f"target config of {name_or_path} has no {e.args[0]}") from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def target_info(spec: str, tcfg=None) -> TargetInfo:
    """Target identity from a target spec (HF id, folder, .gguf, builtin:NAME, the way
    drafter.core.target loads it) or from a path to a config.json. `name_or_path` is the spec as the
    user gave it, or the resolved folder for builtin and .gguf targets (engines cannot load those
    names)."""
    from drafter.core import target as T
    from drafter.core.config import TargetConfig

    p = Path(os.path.expanduser(spec))
    if p.is_file() and p.suffix == ".json":
        return TargetInfo.from_config_dict(json.loads(p.read_text()), str(p.parent.resolve()),
                                           str(p.parent.resolve()))
    tcfg = tcfg or TargetConfig(model=spec)
    resolved = T.resolve(tcfg.model)
    name = resolved if (tcfg.model.startswith("builtin:") or p.suffix == ".gguf") else tcfg.model
    if Path(resolved).is_dir():
        d = json.loads((Path(resolved) / "config.json").read_text())
        return TargetInfo.from_config_dict(d, name, str(Path(resolved).resolve()))
    return TargetInfo.from_config_dict(T.load_config(tcfg).to_dict(), name)


# ------------------------------------------------------------------------------- rope settings
def _norm_scaling(s) -> dict | None:
    return llama_rope_scaling(s)  # the drafter config's own spelling, so that both compare


def rope_of(d: dict) -> tuple[float | None, dict | None, bool]:
    """(rope_theta, rope_scaling or None, scaling_given) from a config dict in either the
    transformers 4 form (rope_theta, rope_scaling) or the 5 form (rope_parameters, possibly keyed
    by attention type). transformers 5 saves some configs with `rope_theta: null` and
    `rope_scaling: null` beside a full rope_parameters: the nulls are not read as settings."""
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict):
        rp = rp["full_attention"]
    rp = rp if isinstance(rp, dict) else None
    theta = d.get("rope_theta")
    theta = theta if theta is not None else (rp.get("rope_theta") if rp else None)
    theta = float(theta) if theta is not None else None
    if isinstance(d.get("rope_scaling"), dict):
        return theta, _norm_scaling(d["rope_scaling"]), True
    if rp is not None:
        return theta, _norm_scaling(rp), True
    return theta, None, "rope_scaling" in d


# ------------------------------------------------------------------------------ tensor layout
LAYER_TENSORS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight", "input_layernorm.weight", "hidden_norm.weight",
                 "post_attention_layernorm.weight")


def formats_for(c: DrafterConfig) -> tuple[str, ...]:
    """The layouts a drafter is exported in: both for a Llama layer, native for an MLA one."""
    return (NATIVE,) if c.draft_layer == "mla" else FORMATS


def mla_attention_shapes(H: int, nh: int, mla: dict) -> dict[str, tuple[int, ...]]:
    """The MLA attention's tensors (vLLM deepseek_v2.py DeepseekV2MLAAttention, input 2H)."""
    qr, kr = mla.get("q_lora_rank"), int(mla["kv_lora_rank"])
    dn, dr, dv = (int(mla[k]) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    q = ({"self_attn.q_a_proj.weight": (int(qr), 2 * H), "self_attn.q_a_layernorm.weight":
          (int(qr),), "self_attn.q_b_proj.weight": (nh * (dn + dr), int(qr))} if qr else
         {"self_attn.q_proj.weight": (nh * (dn + dr), 2 * H)})
    return {**q, "self_attn.kv_a_proj_with_mqa.weight": (kr + dr, 2 * H),
            "self_attn.kv_a_layernorm.weight": (kr,),
            "self_attn.kv_b_proj.weight": (nh * (dn + dv), kr),
            "self_attn.o_proj.weight": (H, nh * dv)}


def expected_tensors(fmt: str, *, H: int, I: int, nh: int, nkv: int, hd: int, V: int, Vd: int,
                     Ht: int, n_aux: int = 3, fc_norm: bool = False, norm_before_fc: bool = False,
                     mla: dict | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, kind) with kind 'float', 'int' or 'bool' (ENGINES.md tensor table).
    `embed_tokens.weight` [V, H] is included; it is optional when H == Ht. `mla`: the MLA
    sizes (MLA_SIZES) of an MLA draft layer, whose attention tensors replace q/k/v/o_proj."""
    L = PREFIX[fmt]
    t: dict[str, tuple[tuple[int, ...], str]] = {"fc.weight": ((H, n_aux * Ht), "float")}
    attn = mla_attention_shapes(H, nh, mla) if mla else {
        "self_attn.q_proj.weight": (nh * hd, 2 * H),               # attention input is 2H
        "self_attn.k_proj.weight": (nkv * hd, 2 * H),
        "self_attn.v_proj.weight": (nkv * hd, 2 * H), "self_attn.o_proj.weight": (H, nh * hd)}
    shapes = {**attn,
              "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H),
              "mlp.down_proj.weight": (H, I), "input_layernorm.weight": (H,),
              "hidden_norm.weight": (H,), "post_attention_layernorm.weight": (H,)}
    t.update({L + k: (v, "float") for k, v in shapes.items()})
    t["norm.weight"] = ((H,), "float")
    t["lm_head.weight"] = ((Vd, H), "float")
    t["d2t"] = ((Vd,), "int")
    t["t2d"] = ((V,), "bool")
    t["embed_tokens.weight"] = ((V, H), "float")
    if fc_norm:
        t.update({f"fc_norm.{i}.weight": ((Ht,), "float") for i in range(n_aux)})
    if norm_before_fc:
        t["input_norm.weight"] = ((n_aux * Ht,), "float")
    return t


def engine_state_dict(model: Drafter, fmt: str, dtype: torch.dtype, embed_tokens: bool = True,
                      ) -> dict[str, torch.Tensor]:
    """Our parameter names -> the engine's: midlayer.* -> layers.0.* for speculators, our
    fc_norm.weight [3, Ht] -> fc_norm.{i}.weight [Ht] (the engines' per-aux RMSNorm list).
    Floats are cast to `dtype`; d2t stays int64, t2d bool."""
    out: dict[str, torch.Tensor] = {}
    for name, v in model.state_dict().items():
        v = v.detach().cpu()
        if name == "embed_tokens.weight" and not embed_tokens:
            continue
        if name == "d2t" and model.cfg.draft_layer == "mla" \
                and model.cfg.draft_vocab_size == model.cfg.vocab_size:
            # vLLM's MLA draft class has no draft_id_to_target_id when Vd == V and refuses a
            # d2t then (deepseek_eagle3.py:308-314, 378-379); identity is what it means
            continue
        if name == "fc_norm.weight":
            for i in range(v.shape[0]):
                out[f"fc_norm.{i}.weight"] = v[i].to(dtype).contiguous()          # [Ht]
            continue
        if name.startswith("midlayer."):
            name = PREFIX[fmt] + name[len("midlayer."):]
        if name == "d2t":
            v = v.to(torch.int64)
        elif name == "t2d":
            v = v.to(torch.bool)
        elif v.is_floating_point():
            v = v.to(dtype)
        out[name] = v.contiguous()
    c = model.cfg
    known = expected_tensors(fmt, H=c.hidden_size, I=c.intermediate_size,
                             nh=c.num_attention_heads, nkv=c.num_key_value_heads, hd=c.head_dim,
                             V=c.vocab_size, Vd=c.draft_vocab_size, Ht=c.target_hidden_size,
                             n_aux=len(c.aux_layer_ids), fc_norm=c.fc_norm,
                             mla=mla_sizes(c))
    unknown = sorted(set(out) - set(known))
    if unknown:  # a model change must not ship tensors that every engine ignores
        raise EngineDirError(f"drafter tensors with no engine name: {unknown}")
    return out


# ----------------------------------------------------------------------------------- configs
def _rope_keys(c: DrafterConfig) -> dict:
    """Both spellings, equal: transformers 4 engines read rope_theta/rope_scaling, transformers 5
    reads rope_parameters (and converts the legacy keys to it)."""
    scaling = dict(c.rope_scaling) if c.rope_scaling else None
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": float(c.rope_theta)}
    return {"rope_theta": float(c.rope_theta), "rope_scaling": scaling, "rope_parameters": params}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def llama_layer_config(c: DrafterConfig, dtype: torch.dtype, max_position_embeddings: int) -> dict:
    """The Llama config of the draft layer (native config.json body; speculators'
    transformer_layer_config). vocab_size is the target's V."""
    return {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        **_rope_keys(c),
        "max_position_embeddings": int(max_position_embeddings),
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": False,    # SGLang ties lm_head to embed_tokens otherwise
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": _dtype_name(dtype),
    }


def mla_sizes(c: DrafterConfig) -> dict | None:
    return {k: getattr(c, k) for k in MLA_SIZES} if c.draft_layer == "mla" else None


def mla_layer_config(c: DrafterConfig, dtype: torch.dtype, max_position_embeddings: int) -> dict:
    """The DeepseekV2 config of an MLA draft layer, as vLLM's deepseek_eagle3.py and SGLang's
    kimi_k25_eagle3.py build it: the MLA sizes, the MLP size, and the RoPE as trained (the
    target's DeepSeek YaRN included: both engines apply it as DeepSeek's, with its mscale in the
    score scale: docs/export.md)."""
    return {
        "model_type": MLA_MODEL_TYPE,
        "num_hidden_layers": 1,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_attention_heads,
        **mla_sizes(c),
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        **_rope_keys(c),
        "max_position_embeddings": int(max_position_embeddings),
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": _dtype_name(dtype),
    }


def _flags(c: DrafterConfig) -> dict:
    return {"norm_before_residual": bool(c.norm_before_residual),
            "norm_before_fc": bool(c.norm_before_fc), "fc_norm": bool(c.fc_norm),
            "feedback_post_norm": bool(c.norm_output)}


def native_config(c: DrafterConfig, dtype: torch.dtype, max_position_embeddings: int) -> dict:
    mla = c.draft_layer == "mla"
    return {
        "architectures": [MLA_ARCHS[0] if mla else "LlamaForCausalLMEagle3"],
        **(mla_layer_config if mla else llama_layer_config)(c, dtype, max_position_embeddings),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        **_flags(c),
        # the MLA classes of both engines read EAGLE-3.1's post-norm feedback as norm_output
        # (deepseek_eagle3.py:222, kimi_k25_eagle3.py): written when set, absent means false
        **({"norm_output": True} if mla and c.norm_output else {}),
        # vLLM reads this key first, as HS[k]; SGLang never reads it.
        "eagle_aux_hidden_state_layer_ids": from_hs(c.aux_layer_ids, "vllm"),
        # SGLang reads only this one and adds 1 (model_runner: val + 1).
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": from_hs(c.aux_layer_ids, "sglang"),
                         "use_aux_hidden_state": True},
    }


def speculators_config(c: DrafterConfig, dtype: torch.dtype, max_position_embeddings: int,
                       target: TargetInfo, speculative_tokens: int) -> dict:
    # No top-level model_type: vLLM's get_config reads a dict with speculators_config and no
    # model_type as "speculators"; a model_type of "llama" here would load it as a plain Llama.
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": llama_layer_config(c, dtype, max_position_embeddings),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        **_flags(c),
        "eagle_aux_hidden_state_layer_ids": from_hs(c.aux_layer_ids, "vllm"),
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "torch_dtype": _dtype_name(dtype),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target.name_or_path,
                         "architectures": list(target.architectures)},
        },
    }


# ------------------------------------------------------------------------------------ README
# the lines under a README's title, shared by every export kind's README
README_HEAD = ["Written by `drafter export`. Weights: model.safetensors; drafter.json records how "
               "it was", "trained. Check any copy of this folder with `drafter check DIR --target "
               "TARGET`.", "", "## Serve it", ""]


def readme(fmt: str, out_dir: Path, c: DrafterConfig, target: TargetInfo, k: int,
           chat_template: str | None = None, trained: list[str] = ()) -> str:
    """The exact serving commands, `trained` (lines: how it was trained, export/trained.py) and
    the layer ids in each meaning."""
    d = str(Path(out_dir).resolve())
    native_dir = str(Path(out_dir).resolve().parent / NATIVE)
    tgt = target.name_or_path
    hf_dir = target.local_dir or "TARGET_HF_DIR"
    tmpl_v = f" --chat-template {chat_template}" if chat_template else ""
    tmpl_l = f" --jinja --chat-template-file {chat_template}" if chat_template else ""
    spec = json.dumps({"method": "eagle3", "model": d, "num_speculative_tokens": k},
                      separators=(",", ":"))
    # sampled requests: drafts sampled too (vLLM's default drafts the argmax, q one-hot)
    sampled = json.dumps({"method": "eagle3", "model": d, "num_speculative_tokens": k,
                          "draft_sample_method": "probabilistic"}, separators=(",", ":"))
    sampling = ("For requests sampled at a temperature > 0, sample the drafts too (vLLM's "
                "default proposes the drafter's argmax and takes its q as one-hot, accepting "
                "less than `drafter evaluate` measures at that temperature):")
    hs = from_hs(c.aux_layer_ids, "hs")
    out = from_hs(c.aux_layer_ids, "layer_output")
    N = target.num_hidden_layers
    lines = [
        f"# EAGLE-3 drafter for {tgt} ({fmt} layout)",
        "",
        *README_HEAD,
    ]
    if fmt == SPECULATORS:
        lines += ["vLLM (the target is read from speculators_config.verifier):", "", "```bash",
                  f"vllm serve {d}{tmpl_v}", "```", "",
                  "or with the target named explicitly:", "", "```bash",
                  f"vllm serve {tgt}{tmpl_v} --speculative-config '{spec}'", "```", "",
                  sampling, "", "```bash",
                  f"vllm serve {tgt}{tmpl_v} --speculative-config '{sampled}'", "```", "",
                  f"SGLang and llama.cpp: use the native layout in {native_dir} (see its README).",
                  ""]
    else:
        lines += [
            "vLLM:", "", "```bash", f"vllm serve {tgt}{tmpl_v} --speculative-config '{spec}'",
            "```", "", sampling, "", "```bash",
            f"vllm serve {tgt}{tmpl_v} --speculative-config '{sampled}'", "```", "",
            f"SGLang (the algorithm must be EAGLE3: EAGLE silently gives tau = 1.0; draft tokens "
            f"D = K + 1 = {k + 1}):", "", "```bash",
            f"python -m sglang.launch_server --model {tgt}{tmpl_v} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {d} --speculative-num-steps {k} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}", "```", "",
            "SGLang for requests sampled at a temperature > 0 (its 2026 versions; without the "
            "flag it proposes the argmax and verifies against the target alone):", "",
            "```bash",
            f"python -m sglang.launch_server --model {tgt}{tmpl_v} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {d} --speculative-num-steps {k} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1} "
            "--speculative-use-rejection-sampling", "```", ""]
        if c.draft_layer == "mla":
            lines += [
                "This drafter's layer is MLA (Eagle3DeepseekV2ForCausalLM): vLLM (0.32 and "
                "later) and SGLang (its Kimi MLA draft model) serve it; SGLang needs "
                "q_lora_rank set. llama.cpp's converter knows only the Llama draft layer: "
                "train with train.draft_layer=llama for llama.cpp.", ""]
        else:
            lines += [
                "llama.cpp (convert the drafter against the target's HF folder, then serve):",
                "", "```bash",
                *([f"huggingface-cli download {tgt} --local-dir {hf_dir}"]
                  if not target.local_dir else []),
                f"python convert_hf_to_gguf.py {d} --target-model-dir {hf_dir} --outfile "
                "draft.gguf",
                f"python convert_hf_to_gguf.py {hf_dir} --outfile target.gguf",
                f"llama-server -m target.gguf -md draft.gguf --spec-type draft-eagle3{tmpl_l}",
                "```", ""]
    lines += [
        *trained,
        "## Aux layer ids",
        "",
        f"The target has N = {N} decoder layers. HS[k] is the residual stream entering layer k "
        "(HF output_hidden_states[k]).",
        "",
        "| meaning | ids | who |",
        "|---|---|---|",
        f"| HS[k] | {hs} | drafter, vLLM (`eagle_aux_hidden_state_layer_ids`), llama.cpp |",
        f"| output of layer k = HS[k+1] | {out} | SGLang (`eagle_config`, it adds 1), SpecForge, "
        "NVIDIA ModelOpt |",
        "",
    ]
    notes = []
    if hs != default_layer_ids(N) and c.draft_layer != "mla":
        notes.append(f"These ids are not the default [2, N//2, N-3] = {default_layer_ids(N)}: "
                     "llama.cpp's converter recomputes the default from the target and will read "
                     "other layers than the drafter was trained on.")
    if out and out[0] != 1:
        notes.append("SGLang versions from 2026 add 1 to explicit ids only when the first id is "
                     "1; with these ids such a version reads one layer lower.")
    if c.norm_before_residual:
        notes.append("norm_before_residual is true: SGLang implements only false and will accept "
                     "less; serve with vLLM.")
    if c.fc_norm or c.norm_output:
        notes.append("EAGLE-3.1 options (fc_norm / feedback_post_norm: feed back the post-norm "
                     "state) need an engine version that implements them (vLLM and SGLang from "
                     "2026); llama.cpp does not.")
    notes.append(f"K = {k} here is the export's default (export.speculative_tokens). Which K, or "
                 "which tree, serves this drafter best at your batch size is measured by "
                 "`drafter evaluate`: it writes the flags of the best one per batch size into "
                 "this README ('Tuned serving settings', above 'Aux layer ids'), and the "
                 "expected speedup of each into the 'Serving setting' section of its report "
                 "(`drafter report RUN_DIR`).")
    notes.append("Serve with the same chat template the training data was rendered with"
                 + (f" ({chat_template})." if chat_template else " (the target's own)."))
    lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ writers
def write_dir(model: Drafter, out_dir: Path, fmt: str, *, target: TargetInfo,
              dtype: torch.dtype = torch.bfloat16, max_position_embeddings: int | None = None,
              speculative_tokens: int = 3, embed_tokens: bool = True,
              chat_template: str | None = None, final_dir: Path | None = None,
              meta: dict | None = None, trained: list[str] = ()) -> dict:
    """Write one engine layout into `out_dir` (an existing, empty dir; the export step builds it
    under a temp name and renames it to `final_dir`). Returns the config.json written."""
    from drafter.core.rundir import atomic_json, atomic_write, safe_save_file

    c = model.cfg
    if c.norm_before_fc:
        raise EngineDirError("norm_before_fc is set but drafter.train.model has no input_norm: "
                             "refusing to write a flag the weights do not implement")
    if c.target_hidden_size != c.hidden_size and not embed_tokens:
        raise EngineDirError("H != Ht: embed_tokens.weight must be shipped (engines can share "
                             "the target's embeddings only when the sizes match)")
    mpe = int(max_position_embeddings or c.max_position_embeddings)
    out_dir = Path(out_dir)
    safe_save_file(engine_state_dict(model, fmt, dtype, embed_tokens), out_dir / WEIGHTS_FILE,
                   {"format": "pt"})
    cfg = (native_config(c, dtype, mpe) if fmt == NATIVE
           else speculators_config(c, dtype, mpe, target, speculative_tokens))
    atomic_json(out_dir / CONFIG_FILE, cfg)
    atomic_write(out_dir / README_FILE,
                 readme(fmt, final_dir or out_dir, c, target, speculative_tokens, chat_template,
                        trained))
    atomic_json(out_dir / META_FILE, {
        "format": fmt, "aux_layer_ids_hs": list(c.aux_layer_ids),
        "aux_layer_ids": {m: from_hs(c.aux_layer_ids, m) for m in ("vllm", "sglang", "llama_cpp")},
        "target": target.to_dict(), "max_position_embeddings": mpe,
        "max_position_embeddings_source": (meta or {}).get("max_position_embeddings_source",
                                                           "target"),
        "drafter_config": c.to_dict(), **(meta or {})})
    return cfg
