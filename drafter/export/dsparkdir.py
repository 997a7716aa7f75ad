"""The block drafters' engine dir (DSpark, DFlash: drafter/train/dspark.py) as vLLM 0.32 loads it
with `--speculative-config '{"method": "dspark" | "dflash", "model": DIR, ...}'`: its config.json,
tensor names and shapes, README, the writer, and the reading of such a dir back into a config.

    cfg = write_dir(model, tmp, target=TargetInfo, dtype=torch.bfloat16, ...)   # export
    c = config_from_engine(config, meta)       # a DSparkConfig from config.json (+ drafter.json)

One layout, `native/`: model_type qwen3, architectures DFlashDraftModel (vLLM's registry maps it
to qwen3_dflash.py's DFlashQwen3ForCausalLM) or Qwen3DSparkModel (qwen3_dspark.py's
Qwen3DSparkForCausalLM). The contract is ../shared/docs/ENGINES.md and docs/export.md; the
installed vLLM 0.32.0's source behind each field (tensor names, target layer ids, the mask token,
DSpark's flags, what SGLang reads) is in docs/internals.md, "Module notes".
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from drafter.export.engines import (
    CONFIG_FILE,
    META_FILE,
    NATIVE,
    README_FILE,
    README_HEAD,
    WEIGHTS_FILE,
    EngineDirError,
    TargetInfo,
    llama_layer_config,
    rope_of,
)
from drafter.train.dspark import DSpark, DSparkConfig

ARCHS = {"dflash": "DFlashDraftModel", "dspark": "Qwen3DSparkModel"}
METHOD_OF = {a: m for m, a in ARCHS.items()}
MODEL_TYPE = "qwen3"
FORMATS = (NATIVE,)           # vLLM's speculators reader is not written for block drafters


def method_of(config: dict) -> str | None:
    """'dflash' or 'dspark' for a block drafter's config.json, else None."""
    archs = config.get("architectures") or [None]
    return METHOD_OF.get(archs[0]) if isinstance(archs, list) and archs else None


def to_vllm(hs_ids) -> list[int]:
    """HS ids -> vLLM's target_layer_ids (layer outputs: HS[k] is the output of layer k-1)."""
    if any(int(k) < 1 for k in hs_ids):
        raise EngineDirError(f"target layer ids {list(hs_ids)}: HS[0] (the embeddings) is no "
                             "layer's output, which vLLM's target_layer_ids name")
    return [int(k) - 1 for k in hs_ids]


def from_vllm(ids) -> list[int]:
    return [int(k) + 1 for k in ids]


# ------------------------------------------------------------------------------------ config
def engine_config(c: DSparkConfig, dtype: torch.dtype, max_position_embeddings: int,
                  target_layers: int | None = None) -> dict:
    """config.json of a block drafter (module doc for every key)."""
    ids = to_vllm(c.target_layer_ids)
    dflash = {"mask_token_id": int(c.mask_token_id), "target_layer_ids": ids,
              "use_aux_hidden_state": True}
    out = {
        "architectures": [ARCHS[c.method]],
        # the layer config an EAGLE-3 export writes (sizes, RoPE as trained, the target's vocab,
        # tie_word_embeddings false, torch_dtype), as a Qwen3 config of the draft layers
        **llama_layer_config(c, dtype, max_position_embeddings),
        "model_type": MODEL_TYPE,
        "num_hidden_layers": c.num_hidden_layers,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "block_size": c.block_size,
        "dflash_config": dflash,
        "target_layer_ids": ids,
        "mask_token_id": int(c.mask_token_id),
    }
    if target_layers:
        out["num_target_layers"] = int(target_layers)   # SGLang's DFlash reads it
    if c.method == "dspark":
        out.update({"markov_rank": c.markov_rank, "markov_head_type": "vanilla",
                    "enable_confidence_head": bool(c.confidence_head),
                    "confidence_head_with_markov": bool(c.confidence_with_markov),
                    "sample_from_anchor": bool(c.anchor_predicts),
                    "dspark_bonus_anchor": not c.anchor_predicts})
    return out


def config_from_engine(config: dict, meta: dict | None = None) -> DSparkConfig:
    """The DSparkConfig of a block drafter's config.json, read as vLLM reads it: the target
    layers from drafter.json (HS ids) when present, else dflash_config's, else the top-level
    target_layer_ids (each + 1); mask_token_id from dflash_config, else the top level."""
    f = config
    method = method_of(f)
    if method is None:
        raise EngineDirError(f"architectures {f.get('architectures')}: not a block drafter "
                             f"({', '.join(ARCHS.values())})")
    dc = f.get("dflash_config") or {}
    if meta and meta.get("target_layer_ids_hs"):
        ids = list(meta["target_layer_ids_hs"])
    elif dc.get("target_layer_ids") or f.get("target_layer_ids"):
        ids = from_vllm(dc.get("target_layer_ids") or f.get("target_layer_ids"))
    else:
        raise EngineDirError("no target_layer_ids in config.json (dflash_config)")
    mask = dc.get("mask_token_id", f.get("mask_token_id"))
    block = f.get("block_size") or f.get("dspark_block_size")
    if mask is None or block is None:
        raise EngineDirError(f"config.json has no {'mask_token_id' if mask is None else ''}"
                             f"{' and no ' if mask is None and block is None else ''}"
                             f"{'block_size' if block is None else ''}")
    H, nh = int(f["hidden_size"]), int(f["num_attention_heads"])
    V = int(f["vocab_size"])
    theta, scaling, _ = rope_of(f)
    dspark = method == "dspark"
    heads = dict(markov_rank=int(f.get("markov_rank") or 0),
                 confidence_head=bool(f.get("enable_confidence_head", False)),
                 confidence_with_markov=bool(f.get("confidence_head_with_markov", False)),
                 anchor_predicts=bool(f.get("sample_from_anchor", True))) if dspark else \
        dict(anchor_predicts=False)   # DFlash: the anchor is a bonus token, masks predict
    return DSparkConfig(
        method=method, hidden_size=H, intermediate_size=int(f["intermediate_size"]),
        num_hidden_layers=int(f["num_hidden_layers"]), num_attention_heads=nh,
        num_key_value_heads=int(f.get("num_key_value_heads") or nh),
        head_dim=int(f.get("head_dim") or H // nh), vocab_size=V,
        draft_vocab_size=int(f.get("draft_vocab_size") or V),
        target_hidden_size=int(f.get("target_hidden_size") or H), target_layer_ids=ids,
        block_size=int(block), mask_token_id=int(mask), **heads,
        rms_norm_eps=float(f.get("rms_norm_eps", 1e-6)), hidden_act=f.get("hidden_act", "silu"),
        rope_theta=theta if theta is not None else 1000000.0, rope_scaling=scaling,
        max_position_embeddings=int(f.get("max_position_embeddings") or 4096))


# ------------------------------------------------------------------------------------ tensors
def expected_tensors(c: DSparkConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, kind) of every tensor vLLM's class for `c` loads (kind 'float', 'int',
    'bool'); embed_tokens, d2t and t2d included (their own checks say when they are needed)."""
    H, I, hd = c.hidden_size, c.intermediate_size, c.head_dim
    nh, nkv, V, Vd = c.num_attention_heads, c.num_key_value_heads, c.vocab_size, \
        c.draft_vocab_size
    layer = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
             "self_attn.q_proj.weight": (nh * hd, H), "self_attn.k_proj.weight": (nkv * hd, H),
             "self_attn.v_proj.weight": (nkv * hd, H), "self_attn.o_proj.weight": (H, nh * hd),
             "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
             "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H),
             "mlp.down_proj.weight": (H, I)}
    t = {"fc.weight": ((H, len(c.target_layer_ids) * c.target_hidden_size), "float"),
         "hidden_norm.weight": ((H,), "float"), "norm.weight": ((H,), "float"),
         "lm_head.weight": ((Vd, H), "float"), "embed_tokens.weight": ((V, H), "float"),
         "d2t": ((Vd,), "int"), "t2d": ((V,), "bool")}
    for i in range(c.num_hidden_layers):
        t.update({f"layers.{i}.{k}": (s, "float") for k, s in layer.items()})
    if c.markov_rank:
        t["markov_head.markov_w1.weight"] = ((V, c.markov_rank), "float")
        t["markov_head.markov_w2.weight"] = ((Vd, c.markov_rank), "float")
    if c.confidence_head:
        width = H + (c.markov_rank if c.confidence_with_markov else 0)
        t["confidence_head.proj.weight"] = ((1, width), "float")
        t["confidence_head.proj.bias"] = ((1,), "float")
    return t


def engine_state_dict(model: DSpark, dtype: torch.dtype, embed_tokens: bool = True,
                      ) -> dict[str, torch.Tensor]:
    """The model's tensors under vLLM's names (ours), floats cast to `dtype`, d2t int64 (left
    out over the target's whole vocab), t2d bool; embed_tokens left out when not wanted."""
    c = model.cfg
    known = expected_tensors(c)
    out = {}
    for name, v in model.state_dict().items():
        if name == "embed_tokens.weight" and not embed_tokens:
            continue
        if name == "d2t" and c.draft_vocab_size == c.vocab_size:
            # both classes have no draft_id_to_target_id then, and their loaders rename d2t to
            # it and refuse it (qwen3_dflash.py, qwen3_dspark.py __init__ / load_weights)
            continue
        if name not in known:  # a model change must not ship a tensor vLLM's loader refuses
            raise EngineDirError(f"block drafter tensor {name} has no name in vLLM's class")
        v = v.detach().cpu()
        v = v.to(torch.int64) if name == "d2t" else v.to(torch.bool) if name == "t2d" \
            else v.to(dtype)
        out[name] = v.contiguous()
    return out


def engine_to_model(sd: dict[str, torch.Tensor], c: DSparkConfig,
                    embed: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """An engine dir's tensors -> DSpark's state dict: a missing d2t is the identity (what vLLM
    does), t2d is rebuilt from d2t, a missing embed_tokens is `embed` (the target's)."""
    ours = dict(sd)
    if "embed_tokens.weight" not in ours:
        if embed is None:
            raise EngineDirError("the dir has no embed_tokens.weight: give the target (a local "
                                 "HF folder) to take the embeddings from")
        ours["embed_tokens.weight"] = embed
    d2t = ours.get("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long)).long()
    ours["d2t"] = d2t
    if "t2d" not in ours:
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[torch.arange(c.draft_vocab_size) + d2t] = True
        ours["t2d"] = t2d
    ours["t2d"] = ours["t2d"].bool()
    return ours


# ------------------------------------------------------------------------------------ README
def readme(out_dir: Path, c: DSparkConfig, target: TargetInfo,
           chat_template: str | None = None, trained: list[str] = ()) -> str:
    """The serving commands (vLLM per temperature; adaptive verification where the confidence
    head exists), what the other engines take, and `trained` (lines: how it was trained,
    export/trained.py)."""
    d = str(Path(out_dir).resolve())
    tgt = target.name_or_path
    tmpl = f" --chat-template {chat_template}" if chat_template else ""
    K, kind = c.block_size, {"dflash": "DFlash", "dspark": "DSpark"}[c.method]

    def cmd(**extra) -> str:
        spec = json.dumps({"method": c.method, "model": d, "num_speculative_tokens": K, **extra},
                          separators=(",", ":"))
        return f"vllm serve {tgt}{tmpl} --speculative-config '{spec}'"

    hs, out = list(c.target_layer_ids), to_vllm(c.target_layer_ids)
    lines = [
        f"# {kind} drafter for {tgt}",
        "",
        *README_HEAD,
        f"vLLM (0.32 and later; `num_speculative_tokens` is the block size the drafter was "
        f"trained with, {K}: a block of another length attends over other queries than in "
        "training). For requests at temperature 0:",
        "", "```bash", cmd(), "```", "",
        "For requests sampled at a temperature > 0, sample the drafts too (vLLM's default "
        "proposes the drafter's argmax and takes its q as one-hot, accepting less than drafter "
        "measures at that temperature):",
        "", "```bash", cmd(draft_sample_method="probabilistic"), "```", "",
    ]
    if c.method == "dspark" and c.confidence_head:
        lines += [
            "Adaptive verification (vLLM's V2 model runner): the confidence head predicts each "
            "draft's acceptance and vLLM verifies each request only as far as its measured step "
            "cost says pays; worth it where verification is not free (large batches). Add it to "
            "either command, e.g. at temperature 0:",
            "", "```bash", cmd(enable_adaptive_verification=True), "```", ""]
    if c.method == "dspark":
        lines += [
            "vLLM serves DSpark with its V2 model runner only (`config/vllm.py`, "
            "`_get_v1_model_runner_unsupported_features`: the default on CUDA with Triton); "
            "its CPU build runs the V1 runner and refuses it.", ""]
    lines += [
        "SGLang: its DFlash draft class takes the target's embeddings and lm_head and ignores "
        "this drafter's (trained) lm_head, and its Qwen3 DSpark class serves only a drafter "
        "over the target's whole vocabulary without d2t; neither serves this export as trained "
        "(docs/export.md). llama.cpp: no converter for either kind.",
        "",
        *trained,
        "## Aux layer ids: the target layers the drafter reads",
        "",
        f"The target has N = {target.num_hidden_layers} decoder layers. HS[k] is the residual "
        "stream entering layer k (HF output_hidden_states[k]) = the output of layer k-1.",
        "",
        "| meaning | ids | who |",
        "|---|---|---|",
        f"| HS[k] | {hs} | drafter (drafter.json) |",
        f"| output of layer k = HS[k+1] | {out} | vLLM (`dflash_config.target_layer_ids`; its "
        "runners add 1), SGLang |",
        "",
        "## Notes",
        "",
        f"- Block size {K}, mask token {c.mask_token_id}, draft vocab {c.draft_vocab_size} of "
        f"{c.vocab_size}"
        + (f", Markov rank {c.markov_rank}" if c.markov_rank else "")
        + (", confidence head" if c.confidence_head else "") + ".",
        "- Serve with the same chat template the training data was rendered with"
        + (f" ({chat_template})." if chat_template else " (the target's own)."),
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ writer
def write_dir(model: DSpark, out_dir: Path, *, target: TargetInfo,
              dtype: torch.dtype = torch.bfloat16, max_position_embeddings: int | None = None,
              embed_tokens: bool = True, chat_template: str | None = None,
              final_dir: Path | None = None, meta: dict | None = None,
              trained: list[str] = ()) -> dict:
    """Write the block drafter's native dir into `out_dir` (existing, empty; export builds it
    under a temp name and renames it to `final_dir`). Returns the config.json written."""
    from drafter.core.rundir import atomic_json, atomic_write, safe_save_file

    c = model.cfg
    if c.target_hidden_size != c.hidden_size and not embed_tokens:
        raise EngineDirError("H != Ht: embed_tokens.weight must be shipped (vLLM shares the "
                             "target's embeddings only when the sizes match)")
    mpe = int(max_position_embeddings or c.max_position_embeddings)
    out_dir = Path(out_dir)
    safe_save_file(engine_state_dict(model, dtype, embed_tokens), out_dir / WEIGHTS_FILE,
                   {"format": "pt"})
    cfg = engine_config(c, dtype, mpe, target.num_hidden_layers)
    atomic_json(out_dir / CONFIG_FILE, cfg)
    atomic_write(out_dir / README_FILE, readme(final_dir or out_dir, c, target, chat_template,
                                                    trained))
    atomic_json(out_dir / META_FILE, {
        "format": NATIVE, "method": c.method, "target_layer_ids_hs": list(c.target_layer_ids),
        "target_layer_ids": {"vllm": to_vllm(c.target_layer_ids)},
        "target": target.to_dict(), "max_position_embeddings": mpe,
        "max_position_embeddings_source": (meta or {}).get("max_position_embeddings_source",
                                                           "target"),
        "drafter_config": c.to_dict(), **(meta or {})})
    return cfg
