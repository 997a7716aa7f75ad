"""`drafter check`'s rules for a block drafter's dir (DSpark, DFlash: drafter/export/dsparkdir.py),
against what vLLM 0.32's qwen3_dflash.py / qwen3_dspark.py and config/speculative.py read. The
EAGLE-3 rules that mean the same here (weights file, dtype, d2t/t2d, embeddings, tie, RoPE,
context, vocab) are drafter/export/rules.py's; check.py runs BLOCK_CHECKS for these dirs.

    checks = [c for fn in BLOCK_CHECKS for c in fn(ctx)]      # ctx: rules.Ctx of the dir
"""
from __future__ import annotations

from drafter.export import dsparkdir as D
from drafter.export import rules as R
from drafter.export.rules import FAIL, PASS, WARN, Check, Ctx


def _ints(v) -> bool:
    return isinstance(v, list) and all(isinstance(k, int) and not isinstance(k, bool) for k in v)


def _cfg(x: Ctx):
    """The DSparkConfig as vLLM reads the dir, or None when config.json cannot give one."""
    try:
        return D.config_from_engine(x.ed.config)
    except (KeyError, TypeError, ValueError, D.EngineDirError):
        return None


def c_block_format(x: Ctx) -> list[Check]:
    f, method = x.f, x.ed.method
    if f.get("model_type") != D.MODEL_TYPE:
        return [Check("format", FAIL, f"model_type {f.get('model_type')!r}: vLLM builds "
                      f"{D.ARCHS[method]} from a Qwen3 config (write model_type: qwen3)")]
    dc = f.get("dflash_config")
    if dc is not None and not isinstance(dc, dict):
        return [Check("format", FAIL, "dflash_config is not an object")]
    if method == "dflash" and (dc or {}).get("sample_from_anchor"):
        return [Check("format", FAIL, "dflash_config.sample_from_anchor is true: vLLM's DFlash "
                      "proposer drafts the anchor as a bonus token (K+1 queries) and its V2 "
                      "speculator refuses the flag")]
    if method == "dspark":
        anchor = f.get("sample_from_anchor")
        if not isinstance(anchor, bool):
            return [Check("format", FAIL, "sample_from_anchor not written: vLLM's DSpark "
                          "speculator assumes true, its speculators reader false")]
        if f.get("dspark_bonus_anchor", not anchor) == anchor:
            return [Check("format", FAIL, f"sample_from_anchor {anchor} and dspark_bonus_anchor "
                          f"{f.get('dspark_bonus_anchor')} say different block layouts")]
        trained = ((x.ed.meta or {}).get("drafter_config") or {}).get("anchor_predicts")
        if trained is not None and trained != anchor:
            return [Check("format", FAIL, f"sample_from_anchor {anchor} but the drafter was "
                          f"trained with the anchor {'' if trained else 'not '}predicting")]
    return [Check("format", PASS, f"native layout, {D.ARCHS[method]} (method {method})")]


def c_block_fields(x: Ctx) -> list[Check]:
    need = ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "num_hidden_layers", "vocab_size", "draft_vocab_size",
            "target_hidden_size", "rms_norm_eps"]
    if x.ed.method == "dspark":
        need += ["markov_rank", "enable_confidence_head"]
    missing = [k for k in need if x.f.get(k) is None]
    if missing:
        return [Check("config_fields", FAIL, f"missing {', '.join(missing)}")]
    n = x.get("num_hidden_layers")
    if not isinstance(n, int) or n < 1:
        return [Check("config_fields", FAIL, f"num_hidden_layers is {n}: no draft layer")]
    return [Check("config_fields", PASS, f"H={x.H}, Ht={x.Ht}, V={x.V}, Vd={x.Vd}, {n} layers")]


def c_block_size(x: Ctx) -> list[Check]:
    k = x.f.get("block_size", x.f.get("dspark_block_size"))
    if k is None:
        if x.ed.method == "dspark":
            return [Check("block_size", FAIL, "not written: vLLM takes DSpark's default "
                          "num_speculative_tokens from it")]
        return [Check("block_size", WARN, "not written: the block size the drafter was trained "
                      "with is unknown (serve it with that num_speculative_tokens)")]
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        return [Check("block_size", FAIL, f"{k!r}: must be a positive integer")]
    return [Check("block_size", PASS, f"{k}: serve with num_speculative_tokens {k}")]


def c_target_layers(x: Ctx) -> list[Check]:
    """Which target layers vLLM hands the drafter (dflash_config.target_layer_ids + 1, else the
    top-level target_layer_ids + 1; an eagle_aux_hidden_state_layer_ids key goes first), against
    training's (drafter.json), the target's layer count and fc's width."""
    f = x.f
    dc = f.get("dflash_config") or {}
    places = {k: v for k, v in (("dflash_config.target_layer_ids", dc.get("target_layer_ids")),
                                ("target_layer_ids", f.get("target_layer_ids"))) if v is not None}
    if not places:
        return [Check("target_layers", FAIL, "no target_layer_ids (dflash_config): vLLM feeds "
                      "the drafter no layers it was trained on")]
    bad = [k for k, v in places.items() if not _ints(v) or not v]
    if bad:
        return [Check("target_layers", FAIL, f"{bad[0]} is not a non-empty list of integers")]
    where, ids = next(iter(places.items()))
    if len({tuple(v) for v in places.values()}) > 1:
        both = " and ".join(f"{k} {v}" for k, v in places.items())
        return [Check("target_layers", FAIL, f"{both} differ: vLLM reads {where}, SGLang the "
                      "top-level one")]
    hs = D.from_vllm(ids)
    eagle = f.get("eagle_aux_hidden_state_layer_ids")
    if eagle is not None and list(eagle) != hs:
        return [Check("target_layers", FAIL, f"eagle_aux_hidden_state_layer_ids {eagle} (read "
                      f"first, as HS ids) but {where} {ids} means HS{hs}")]
    if len(set(ids)) != len(ids) or ids != sorted(ids):
        return [Check("target_layers", FAIL, f"{where} {ids} not ascending without repeats: vLLM "
                      "captures the layers once each, in layer order, so fc's column blocks "
                      "meet other layers than trained")]
    N = x.N
    if N is not None and (ids[0] < 0 or ids[-1] > N - 2):
        return [Check("target_layers", FAIL, f"{where} {ids} outside [0, {N - 2}] (outputs of "
                      f"the target's {N} layers, the last one's excepted: vLLM takes it before "
                      "the final norm, training after)")]
    trained = (x.ed.meta or {}).get("target_layer_ids_hs")
    if trained is not None and list(trained) != hs:
        return [Check("target_layers", FAIL, f"vLLM reads HS{hs} ({where} {ids} + 1) but the "
                      f"drafter was trained on HS{list(trained)}")]
    fc = x.ed.tensors.get("fc.weight")
    if fc is not None and x.Ht and len(fc[0]) == 2 and fc[0][1] != len(ids) * x.Ht:
        return [Check("target_layers", FAIL, f"fc.weight {list(fc[0])} reads {fc[0][1]} "
                      f"features but {len(ids)} layers x target_hidden_size {x.Ht} = "
                      f"{len(ids) * x.Ht}")]
    what = "the layers it was trained on" if trained is not None else \
        "no drafter.json to compare with"
    return [Check("target_layers", PASS if N is not None or trained is not None else WARN,
                  f"{where} {ids}: vLLM reads HS{hs}, {what}"
                  + ("" if N is not None else "; the target's layer count is unknown"))]


def c_mask_token(x: Ctx) -> list[Check]:
    dc = x.f.get("dflash_config") or {}
    m = dc.get("mask_token_id", x.f.get("mask_token_id"))
    if m is None:
        return [Check("mask_token_id", FAIL, "not written (dflash_config.mask_token_id): vLLM "
                      "refuses a parallel drafter without it")]
    top = x.f.get("mask_token_id")
    if top is not None and "mask_token_id" in dc and top != dc["mask_token_id"]:
        return [Check("mask_token_id", FAIL, f"dflash_config.mask_token_id {dc['mask_token_id']} "
                      f"but mask_token_id {top}: vLLM reads the first, SGLang the second")]
    if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m < (x.V or 0):
        return [Check("mask_token_id", FAIL, f"{m!r} outside the vocab [0, {x.V})")]
    trained = ((x.ed.meta or {}).get("drafter_config") or {}).get("mask_token_id")
    if trained is not None and trained != m:
        return [Check("mask_token_id", FAIL, f"{m} but the drafter was trained with {trained}")]
    return [Check("mask_token_id", PASS, f"{m} (within the vocab of {x.V})")]


def c_aux_hidden(x: Ctx) -> list[Check]:
    v = (x.f.get("dflash_config") or {}).get("use_aux_hidden_state",
                                               x.f.get("use_aux_hidden_state", True))
    if v is False:
        return [Check("use_aux_hidden_state", FAIL, "false: vLLM builds no fc and drafts on "
                      "the raw hidden state, not the fused target layers")]
    return [Check("use_aux_hidden_state", PASS, "true (fc fuses the target layers)")]


def c_attention(x: Ctx) -> list[Check]:
    f = x.f
    dc = f.get("dflash_config") or {}
    types = f.get("layer_types") or []
    why = [w for w, bad in (("is_causal true", f.get("is_causal") is True),
                            ("dflash_config.causal true", dc.get("causal") is True),
                            ("sliding layer_types", "sliding_attention" in types),
                            ("dflash_config.use_swa true", dc.get("use_swa") is True))
           if bad]
    if why:
        return [Check("attention", FAIL, f"{', '.join(why)}: vLLM runs the block causally or "
                      "windowed, but it was trained with every query seeing the whole block")]
    return [Check("attention", PASS, "non-causal over the block (no causal or sliding flag)")]


def c_block_tensors(x: Ctx) -> list[Check]:
    """Names and shapes as vLLM's class for this config loads them (an unknown name fails its
    loader; a missing one stays uninitialised)."""
    c = _cfg(x)
    if c is None:
        return [Check("tensor_names", FAIL, "cannot derive the expected tensors: config fields "
                      "missing")]
    exp = D.expected_tensors(c)
    have = set(x.ed.tensors)
    optional = {"embed_tokens.weight", "d2t", "t2d", "lm_head.weight",
                "confidence_head.proj.weight", "confidence_head.proj.bias"}
    missing, unknown = sorted(set(exp) - have - optional), sorted(have - set(exp))
    out = []
    if missing or unknown:
        parts = [f"missing {R._fmt_list(missing)}"] if missing else []
        if unknown:
            parts.append(f"unknown {R._fmt_list(unknown)} (vLLM's loader refuses them)")
        out.append(Check("tensor_names", FAIL, "; ".join(parts)))
    else:
        out.append(Check("tensor_names", PASS, f"{len(have)} tensors, all vLLM's"))
    bad = [f"{n} {list(s)} != {list(exp[n][0])}" for n, (s, _) in x.ed.tensors.items()
           if n in exp and tuple(s) != exp[n][0]]
    out.append(Check("tensor_shapes", FAIL, R._fmt_list(bad, 3)) if bad else
               Check("tensor_shapes", PASS, "as vLLM's class builds them for this config"))
    return out


def c_heads(x: Ctx) -> list[Check]:
    """DSpark's Markov and confidence heads against the flags vLLM builds them from."""
    if x.ed.method != "dspark":
        extra = sorted(n for n in x.ed.tensors if n.startswith(("markov_head.",
                                                                "confidence_head.")))
        return [Check("heads", FAIL, f"{R._fmt_list(extra, 2)} in a DFlash dir: vLLM's DFlash "
                      "class has no such heads and refuses them")] if extra else []
    r = x.f.get("markov_rank")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        return [Check("heads", FAIL, f"markov_rank {r!r}: vLLM's DSpark builds a Markov head "
                      "of this rank (DFlash is method dflash)")]
    conf = [n for n in ("confidence_head.proj.weight", "confidence_head.proj.bias")
            if n in x.ed.tensors]
    on = x.f.get("enable_confidence_head") is True
    if on and len(conf) != 2:
        return [Check("heads", WARN, "enable_confidence_head is true but the head's weights are "
                      "not all shipped: vLLM drops the head, and adaptive verification falls "
                      "back to its online acceptance estimate")]
    if conf and not on:
        return [Check("heads", WARN, "confidence head weights shipped but enable_confidence_head "
                      "is not true: vLLM ignores them")]
    if on and not isinstance(x.f.get("confidence_head_with_markov"), bool):
        return [Check("heads", FAIL, "confidence_head_with_markov not written: vLLM assumes "
                      "false (the head then reads the hidden state alone)")]
    reads = " and the Markov embedding" if x.f.get("confidence_head_with_markov") else ""
    return [Check("heads", PASS, f"Markov rank {r}, " + (
        f"confidence head over the hidden state{reads}" if on else "no confidence head"))]


def c_block_d2t(x: Ctx) -> list[Check]:
    if "d2t" in x.ed.tensors and x.Vd is not None and x.Vd == x.V:
        return [Check("d2t", FAIL, "shipped while the draft vocab is the target's: vLLM's class "
                      "then has no draft_id_to_target_id and refuses to load it; leave d2t out")]
    return R.c_d2t(x)


def c_block_lm_head(x: Ctx) -> list[Check]:
    if "lm_head.weight" in x.ed.tensors:
        return [Check("lm_head", PASS, f"[{x.Vd}, {x.H}]")]
    if x.Vd is not None and x.V is not None and x.Vd < x.V:
        return [Check("lm_head", FAIL, f"missing with a reduced draft vocab ({x.Vd} of {x.V}): "
                      "vLLM refuses it (DSpark) or serves an uninitialised head")]
    return [Check("lm_head", WARN, "missing: vLLM shares the target's lm_head, not one trained "
                  "for this drafter")]


BLOCK_CHECKS = [c_block_format, R.c_weights_file, c_block_fields, c_block_tensors, R.c_dtype,
                c_block_d2t, R.c_t2d, c_block_lm_head, R.c_embed_tokens, R.c_tie, R.c_rope,
                R.c_rope_engines, R.c_max_pos, R.c_vocab, c_target_layers, c_mask_token,
                c_block_size, c_aux_hidden, c_attention, c_heads]
