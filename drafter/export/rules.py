"""The static checks of `drafter check`: one function per known acceptance killer (ENGINES.md,
"Why drafters accept less in an engine than offline"). Each reads an engine dir's config.json
and tensors, against the target when one is known, and returns named Checks that end pass, warn
or fail with a one-line reason. drafter/export/check.py runs them in order (CHECKS), adds the
acceptance smoke test and prints the report.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from drafter.export import engines as E
from drafter.export.enginedir import EngineDir
from drafter.train.model import CPU_MLA_WIDTH, MLA_LATENT_WIDTHS, mla_rope_problem, rope_problem

PASS, WARN, FAIL = "pass", "warn", "fail"


@dataclass
class Check:
    name: str
    status: str
    reason: str


class Ctx:
    """What the checks share: the dir, the target, and lazily loaded small tensors."""

    def __init__(self, ed: EngineDir, target: E.TargetInfo | None, serving_context: int | None):
        self.ed, self.target, self.serving_context = ed, target, serving_context
        self.f, self.fmt = ed.flat, ed.fmt
        self._small: dict | None = None

    def small(self) -> dict[str, torch.Tensor]:
        if self._small is None:
            self._small = self.ed.load({"d2t", "t2d"})
        return self._small

    # sizes read from config.json; None when absent
    def get(self, key, default=None):
        v = self.f.get(key, default)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    @property
    def H(self):
        return self.get("hidden_size")

    @property
    def Ht(self):
        return self.get("target_hidden_size") or self.H

    @property
    def V(self):
        return self.get("vocab_size")

    @property
    def Vd(self):
        return self.get("draft_vocab_size") or self.V

    @property
    def N(self):
        return self.target.num_hidden_layers if self.target else None

    def n_aux(self) -> int:
        ids = (self.f.get("eagle_aux_hidden_state_layer_ids")
               or (self.f.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
        return len(ids) if ids else 3

    def expected(self) -> dict | None:
        f = self.f
        try:
            H, nh = int(f["hidden_size"]), int(f["num_attention_heads"])
            return E.expected_tensors(
                self.fmt, H=H, I=int(f["intermediate_size"]), nh=nh,
                nkv=int(f.get("num_key_value_heads") or nh), hd=int(f.get("head_dim") or H // nh),
                V=int(f["vocab_size"]), Vd=int(f.get("draft_vocab_size") or f["vocab_size"]),
                Ht=int(f.get("target_hidden_size") or H), n_aux=self.n_aux(),
                fc_norm=bool(f.get("fc_norm")), norm_before_fc=bool(f.get("norm_before_fc")),
                mla={k: f.get(k) for k in E.MLA_SIZES} if self.ed.mla else None)
        except (KeyError, TypeError, ValueError):
            return None


def _fmt_list(xs, n=4) -> str:
    xs = list(xs)
    return ", ".join(map(str, xs[:n])) + (f" (+{len(xs) - n} more)" if len(xs) > n else "")


# ------------------------------------------------------------------------------------- checks
def c_target(x: Ctx, source: str | None) -> list[Check]:
    t = x.target
    if t is None:
        return [Check("target", WARN, "no target given and none recorded in the dir: the layer "
                      "ids, sizes, RoPE and context are checked only for internal consistency "
                      "(pass --target)")]
    meta_t = (x.ed.meta or {}).get("target") or {}
    diff = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size")
            if meta_t.get(k) is not None and meta_t.get(k) != getattr(t, k)]
    if source == "--target" and diff:
        was = ", ".join(f"{k}={meta_t[k]}" for k in diff)
        now = ", ".join(f"{k}={getattr(t, k)}" for k in diff)
        return [Check("target", FAIL, f"drafter.json says it was trained for "
                      f"{meta_t.get('name_or_path')} ({was}), not {t.name_or_path} ({now})")]
    return [Check("target", PASS, f"{t.name_or_path}: {t.num_hidden_layers} layers, hidden "
                  f"{t.hidden_size}, vocab {t.vocab_size} (from {source})")]


def c_format(x: Ctx) -> list[Check]:
    arch = (x.ed.config.get("architectures") or [None])[0]
    if x.fmt == E.SPECULATORS:
        mt = x.ed.config.get("model_type")
        if mt not in (None, "speculators", "speculator_model"):
            return [Check("format", FAIL, f"speculators dir with model_type {mt!r}: vLLM reads it "
                          "as a plain model, not a speculator (leave model_type out)")]
        if not isinstance(x.ed.config.get("transformer_layer_config"), dict):
            return [Check("format", FAIL, "speculators dir without transformer_layer_config")]
        return [Check("format", PASS, f"speculators layout ({arch}, layers.0.*)")]
    mt = x.ed.config.get("model_type")
    if x.ed.mla:
        if arch not in E.MLA_ARCHS:
            return [Check("format", FAIL, f"MLA sizes under architectures {arch}: the engines' "
                          f"MLA draft class is {E.MLA_ARCHS[0]}")]
        if mt != E.MLA_MODEL_TYPE:
            why = (": vLLM rewrites a deepseek_v3 draft into DeepSeek's MTP module "
                   "(config/speculative.py hf_config_override)" if mt == "deepseek_v3" else "")
            return [Check("format", FAIL, f"MLA draft with model_type {mt!r}{why} (write "
                          f"model_type: {E.MLA_MODEL_TYPE})")]
        return [Check("format", PASS, f"native layout, MLA layer ({arch}, midlayer.*)")]
    if mt is None:
        return [Check("format", FAIL, "no model_type: vLLM and SGLang cannot build the config "
                      "(write model_type: llama)")]
    if mt != "llama":
        return [Check("format", WARN, f"model_type {mt!r}: the engines' EAGLE-3 classes are "
                      "Llama layers; other types need engine support")]
    if arch != "LlamaForCausalLMEagle3":
        return [Check("format", WARN, f"architectures {arch}: vLLM and llama.cpp load it, SGLang "
                      "knows only LlamaForCausalLMEagle3")]
    return [Check("format", PASS, "native layout (LlamaForCausalLMEagle3, midlayer.*)")]


def c_weights_file(x: Ctx) -> list[Check]:
    names = ", ".join(p.name for p in x.ed.weight_files)
    if x.ed.pickled:
        return [Check("weights_file", WARN, f"{names}: pickle, read here with torch.load("
                      "weights_only=True); engines load it, but prefer safetensors")]
    if x.ed.weight_files:
        return [Check("weights_file", PASS, names)]
    other = [p.name for p in x.ed.path.iterdir() if p.suffix in (".pt", ".pth", ".ckpt", ".bin")]
    return [Check("weights_file", FAIL, "no model.safetensors or pytorch_model.bin"
                  + (f" ({_fmt_list(other)} are not names the engines load)" if other else ""))]


def c_config_fields(x: Ctx) -> list[Check]:
    need = ["hidden_size", "intermediate_size", "num_attention_heads", "vocab_size",
            "draft_vocab_size", "rms_norm_eps"]
    if x.ed.mla:  # q_lora_rank may be null (a plain q_proj): c_mla says who serves that
        need += [k for k in E.MLA_SIZES if k != "q_lora_rank"]
    missing = [k for k in need if x.f.get(k) is None]
    if missing:
        why = (" (without draft_vocab_size llama.cpp does not see a draft and SGLang loads the "
               "target's lm_head)" if "draft_vocab_size" in missing else "")
        return [Check("config_fields", FAIL, f"missing {', '.join(missing)}{why}")]
    nl = x.f.get("num_hidden_layers")
    if nl != 1:
        return [Check("config_fields", FAIL, f"num_hidden_layers is {nl}: EAGLE-3 drafts have one "
                      "layer (SGLang refuses others; llama.cpp detects drafts by it)")]
    return [Check("config_fields", PASS, f"H={x.H}, V={x.V}, Vd={x.Vd}, 1 layer")]


def c_tensor_names(x: Ctx) -> list[Check]:
    exp = x.expected()
    if exp is None:
        return [Check("tensor_names", FAIL, "cannot derive the expected tensors: config fields "
                      "missing")]
    have = set(x.ed.tensors)
    other = E.PREFIX[E.SPECULATORS if x.fmt == E.NATIVE else E.NATIVE]
    wrong_prefix = sorted(n for n in have if n.startswith(other))
    if wrong_prefix and x.fmt == E.NATIVE:
        return [Check("tensor_names", FAIL, f"{_fmt_list(wrong_prefix, 2)} in a native dir: SGLang "
                      "silently ignores layers.0.* and serves a random layer (use midlayer.*)")]
    if wrong_prefix:
        return [Check("tensor_names", WARN, f"{_fmt_list(wrong_prefix, 2)}: vLLM renames "
                      "midlayer.* to layers.0.*, but the speculators layout names them layers.0.*")]
    optional = {"embed_tokens.weight", "t2d", "d2t", "lm_head.weight"}  # own checks say why
    missing = sorted(set(exp) - have - optional)
    unknown = sorted(have - set(exp))
    if missing or unknown:
        parts = [f"missing {_fmt_list(missing)}"] if missing else []
        if unknown:
            parts.append(f"unknown {_fmt_list(unknown)} (engines ignore or reject them)")
        return [Check("tensor_names", FAIL, "; ".join(parts))]
    return [Check("tensor_names", PASS, f"{len(have)} tensors, all known")]


def c_tensor_shapes(x: Ctx) -> list[Check]:
    exp = x.expected()
    if exp is None:
        return [Check("tensor_shapes", FAIL, "config fields missing")]
    bad = [f"{n} {list(s)} != {list(exp[n][0])}" for n, (s, _) in x.ed.tensors.items()
           if n in exp and tuple(s) != exp[n][0]]
    if bad:
        return [Check("tensor_shapes", FAIL, _fmt_list(bad, 3))]
    return [Check("tensor_shapes", PASS, "as ENGINES.md for this config")]


def c_dtype(x: Ctx) -> list[Check]:
    want = x.f.get("torch_dtype") or x.f.get("dtype")
    floats = {d for n, (_, d) in x.ed.tensors.items() if d in ("BF16", "F16", "F32", "F64")}
    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
    got = sorted(names[d] for d in floats)
    if len(got) > 1:
        return [Check("dtype", WARN, f"mixed float dtypes {got}")]
    if not want:
        return [Check("dtype", WARN, f"no torch_dtype in config.json (weights {got})")]
    if got and got[0] != want:
        return [Check("dtype", WARN, f"weights are {got[0]} but torch_dtype says {want}")]
    return [Check("dtype", PASS, f"{want}")]


def c_d2t(x: Ctx) -> list[Check]:
    V, Vd = x.V, x.Vd
    if "d2t" not in x.ed.tensors:
        if Vd is not None and V is not None and Vd != V:
            return [Check("d2t", FAIL, f"missing while the draft vocab ({Vd}) differs from the "
                          f"target's ({V}): vLLM maps draft id i to target id i")]
        return [Check("d2t", PASS, "absent; draft vocab = target vocab (identity)")]
    if x.ed.mla and Vd is not None and Vd == V:
        return [Check("d2t", FAIL, "shipped while the draft vocab is the target's: vLLM's MLA "
                      "draft class then has no draft_id_to_target_id and refuses to load it "
                      "(deepseek_eagle3.py); leave d2t out")]
    d2t = x.small()["d2t"]
    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        return [Check("d2t", FAIL, f"dtype {d2t.dtype}: must be int64 offsets (SGLang adds "
                      "arange to it; floats index nothing)")]
    stored = d2t.dtype
    d2t = d2t.long().reshape(-1)
    if Vd is not None and d2t.numel() != Vd:
        return [Check("d2t", FAIL, f"{d2t.numel()} entries for draft_vocab_size {Vd}")]
    tgt = torch.arange(d2t.numel()) + d2t                    # offsets: target = i + d2t[i]
    t2d = x.small().get("t2d")
    in_vocab = set(torch.nonzero(t2d.reshape(-1)).flatten().tolist()) \
        if t2d is not None and t2d.numel() == V else None
    looks_absolute = (in_vocab is not None and set(d2t.tolist()) == in_vocab
                      and set(tgt.tolist()) != in_vocab) or \
        (in_vocab is None and d2t.numel() > 16 and bool((d2t[1:] > d2t[:-1]).all())
         and bool((d2t >= torch.arange(d2t.numel())).all()))
    if looks_absolute:
        return [Check("d2t", FAIL, "holds absolute target ids, not offsets (target = i + d2t[i]): "
                      "every draft token maps to the wrong target token")]
    if V is not None and (bool((tgt < 0).any()) or bool((tgt >= V).any())):
        bad = int(((tgt < 0) | (tgt >= V)).sum())
        return [Check("d2t", FAIL, f"{bad} target ids i + d2t[i] outside [0, {V})")]
    if torch.unique(tgt).numel() != tgt.numel():
        return [Check("d2t", FAIL, f"{tgt.numel() - torch.unique(tgt).numel()} duplicated target "
                      "ids: two draft tokens overwrite one target logit (llama.cpp refuses)")]
    if not bool((tgt[1:] > tgt[:-1]).all()):
        return [Check("d2t", FAIL, "target ids are not sorted ascending: the map was built for "
                      "another row order of lm_head than the one shipped")]
    if stored != torch.int64:
        return [Check("d2t", WARN, f"dtype {x.ed.tensors['d2t'][1]}: engines expect int64")]
    return [Check("d2t", PASS, f"{d2t.numel()} sorted unique offsets within the target vocab")]


def c_t2d(x: Ctx) -> list[Check]:
    if "t2d" not in x.ed.tensors:
        return [Check("t2d", WARN, "missing: vLLM and SGLang ignore it, converters use it")]
    t2d = x.small()["t2d"].reshape(-1)
    if t2d.dtype != torch.bool:
        return [Check("t2d", WARN, f"dtype {t2d.dtype}: expected bool")]
    if x.V is not None and t2d.numel() != x.V:
        return [Check("t2d", FAIL, f"{t2d.numel()} entries for vocab_size {x.V}")]
    if "d2t" in x.ed.tensors:
        d2t = x.small()["d2t"].long().reshape(-1)
        tgt = set((torch.arange(d2t.numel()) + d2t).tolist())
        if set(torch.nonzero(t2d).flatten().tolist()) != tgt:
            return [Check("t2d", FAIL, "t2d and d2t name different target tokens")]
    return [Check("t2d", PASS, f"{int(t2d.sum())} target tokens marked, agrees with d2t")]


def c_lm_head(x: Ctx) -> list[Check]:
    if "lm_head.weight" in x.ed.tensors:
        return [Check("lm_head", PASS, f"[{x.Vd}, {x.H}]")]
    if x.Vd == x.V and x.ed.flat.get("draft_vocab_size") is None:
        return [Check("lm_head", WARN, "missing: SGLang loads the target's lm_head only because "
                      "draft_vocab_size is absent; vLLM leaves it uninitialised")]
    return [Check("lm_head", FAIL, f"missing while draft_vocab_size is set ({x.Vd}; target vocab "
                  f"{x.V}): engines serve an uninitialised head")]


def c_embed_tokens(x: Ctx) -> list[Check]:
    if "embed_tokens.weight" in x.ed.tensors:
        return [Check("embed_tokens", PASS, "shipped")]
    if x.H != x.Ht:
        return [Check("embed_tokens", FAIL, f"missing while H ({x.H}) != Ht ({x.Ht}): engines can "
                      "share the target's embeddings only when the sizes match")]
    return [Check("embed_tokens", PASS, "absent; engines share the target's (H == Ht)")]


def c_tie(x: Ctx) -> list[Check]:
    v = x.f.get("tie_word_embeddings")
    if v is True:
        return [Check("tie_word_embeddings", FAIL, "true: SGLang replaces lm_head with "
                      "embed_tokens")]
    if v is None:
        return [Check("tie_word_embeddings", WARN, "not written: engines fall back to "
                      "LlamaConfig's false; write it out")]
    return [Check("tie_word_embeddings", PASS, "false")]


def _same_scaling(a: dict | None, b: dict | None) -> bool:
    if (a is None) != (b is None):
        return False
    if a is None:
        return True
    keys = set(a) | set(b)
    for k in keys:
        va, vb = a.get(k), b.get(k)
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)):
            if not math.isclose(float(va), float(vb), rel_tol=1e-6):
                return False
        elif va != vb:
            return False
    return True


def c_rope(x: Ctx) -> list[Check]:
    """Both spellings agree; the target's theta and scaling, or plain RoPE at its theta where the
    target's scaling has no engine-portable form (model.rope_problem; see c_rope_engines)."""
    f = x.f
    theta, scaling, given = E.rope_of(f)
    if theta is None:
        return [Check("rope", FAIL, "no rope_theta: engines use 10000, which few targets do")]
    rp = f.get("rope_parameters")
    if isinstance(rp, dict) and (f.get("rope_theta") is not None or "rope_scaling" in f):
        t2, s2, _ = E.rope_of({"rope_parameters": rp})
        legacy = E.rope_of({"rope_scaling": f.get("rope_scaling")})[1]
        if (t2 is not None and not math.isclose(t2, theta)) or \
                ("rope_scaling" in f and not _same_scaling(s2, legacy)):
            return [Check("rope", FAIL, "rope_theta/rope_scaling and rope_parameters disagree: "
                          "transformers 4 and 5 engines read different RoPE")]
    t = x.target
    if t is not None and t.rope_theta is not None and x.ed.mla:
        # an MLA layer takes the target's RoPE as the target applies it (DeepSeek's YaRN
        # included), unless mla_rope_problem (then plain RoPE at its theta)
        own = mla_rope_problem(t.rope_scaling) is not None
        want = None if own else E.rope_of({"rope_scaling": t.rope_scaling})[1]
        if want:
            want = {**want, "rope_type": "yarn"}
        got = {**scaling, "rope_type": "yarn"} if scaling and scaling["rope_type"] in (
            "yarn", "deepseek_yarn") else scaling
        if not math.isclose(theta, t.rope_theta, rel_tol=1e-6):
            return [Check("rope", FAIL, f"rope_theta {theta:g} but the target's is "
                          f"{t.rope_theta:g}")]
        if _same_scaling(got, want):
            return [Check("rope", PASS, f"theta {theta:g}, scaling {scaling}: "
                          + ("the target's, as its MLA applies it" if scaling else
                             "plain, at the target's theta"))]
        return [Check("rope", FAIL, f"rope_scaling {scaling} but the target's is "
                      f"{t.rope_scaling}" + (" (an MLA layer trains plain RoPE here)" if own
                                             else ""))]
    if t is not None and t.rope_theta is not None:
        own = rope_problem(t.rope_scaling) is not None  # no Llama layer computes the target's
        if not math.isclose(theta, t.rope_theta, rel_tol=1e-6):
            return [Check("rope", WARN if own else FAIL, f"rope_theta {theta:g} but the target's "
                          f"is {t.rope_theta:g}" + (" (its scaling is no Llama layer's: a "
                                                    "drafter picks its own RoPE)" if own else ""))]
        if _same_scaling(scaling, None if own else t.rope_scaling) or \
                (own and _same_scaling(scaling, t.rope_scaling)):
            return [Check("rope", PASS, f"theta {theta:g}, scaling {scaling}: "
                          + ("the target's" if scaling else "plain, at the target's theta"))]
        return [Check("rope", FAIL, f"rope_scaling {scaling} but the target's is "
                      f"{t.rope_scaling}" + (" (a drafter trains plain RoPE here)" if own else ""))]
    if not given:
        return [Check("rope", WARN, f"theta {theta:g} but rope_scaling not written: cannot tell "
                      "whether the target scales RoPE (pass --target)")]
    return [Check("rope", PASS, f"theta {theta:g}, scaling {scaling}")]


def c_rope_engines(x: Ctx) -> list[Check]:
    """Every engine's Llama layer computes the dir's RoPE as training did (transformers' Llama):
    a DeepSeek YaRN block copied from the target passes c_rope and still scores differently.
    An MLA layer: the engines' MLA attention computes it as training did (mla_rope_problem)."""
    if x.ed.mla:
        for key in ("rope_scaling", "rope_parameters"):
            b = x.f.get(key) if isinstance(x.f.get(key), dict) else {}
            if why := mla_rope_problem(b):
                return [Check("rope_engines", FAIL, f"{key}: {why}. Fix: train with plain RoPE "
                              "or DeepSeek's YaRN")]
        _, s, _ = E.rope_of(x.f)
        return [Check("rope_engines", PASS, f"{'DeepSeek YaRN' if s else 'plain RoPE'}: "
                      "transformers' DeepSeek (training), vLLM's and SGLang's MLA compute it "
                      "alike, mscale in the score scale")]
    for key in ("rope_scaling", "rope_parameters"):
        b = x.f.get(key) if isinstance(x.f.get(key), dict) else {}
        if why := rope_problem(b.get("full_attention", b)):
            return [Check("rope_engines", FAIL, f"{key}: {why}. Fix: train with plain RoPE at the "
                          "target's rope_theta (rope_scaling null, as drafter does for such "
                          "targets); editing config.json cannot fix weights trained with it")]
    _, s, _ = E.rope_of(x.f)
    if s and s["rope_type"] == "yarn" and s.get("truncate") is False:
        return [Check("rope_engines", WARN, "yarn truncate false: vLLM's single-file "
                      "rotary_embedding.py always truncates (other frequencies than training)")]
    return [Check("rope_engines", PASS, f"{s['rope_type'] if s else 'plain RoPE'}: transformers' "
                  "Llama (training), vLLM and SGLang compute it alike")]


def c_max_pos(x: Ctx) -> list[Check]:
    mpe = x.get("max_position_embeddings")
    if mpe is None:
        return [Check("max_position_embeddings", FAIL, "not written: engines assume 2048 and stop "
                      "drafting beyond it")]
    ctx = x.serving_context or (x.target.max_position_embeddings if x.target else None)
    if ctx:
        if mpe >= ctx:
            return [Check("max_position_embeddings", PASS, f"{mpe} >= serving context {ctx}")]
        chosen = (x.ed.meta or {}).get("max_position_embeddings_source") == \
            "export.max_position_embeddings"
        why = " (set on purpose with export.max_position_embeddings)" if chosen else ""
        return [Check("max_position_embeddings", WARN if chosen else FAIL,
                      f"{mpe} < the target's context {ctx}: vLLM stops drafting on longer "
                      f"requests{why}")]
    if mpe < 4096:
        return [Check("max_position_embeddings", WARN, f"{mpe}: below most serving contexts")]
    return [Check("max_position_embeddings", PASS, f"{mpe}")]


def c_hidden(x: Ctx) -> list[Check]:
    fc = x.ed.tensors.get("fc.weight")
    if fc is not None and x.H is not None and tuple(fc[0]) != (x.H, x.n_aux() * x.Ht):
        return [Check("hidden_size", FAIL, f"fc.weight {list(fc[0])} but the config gives "
                      f"[{x.H}, {x.n_aux()}*{x.Ht}]: engines build fc from target_hidden_size")]
    if x.target is not None and x.Ht != x.target.hidden_size:
        return [Check("hidden_size", FAIL, f"target_hidden_size {x.Ht} but the target's hidden "
                      f"size is {x.target.hidden_size}")]
    return [Check("hidden_size", PASS, f"H={x.H}, Ht={x.Ht}")]


def c_vocab(x: Ctx) -> list[Check]:
    if x.V is not None and x.Vd is not None and x.Vd > x.V:
        return [Check("vocab_size", FAIL, f"draft vocab {x.Vd} > vocab_size {x.V}")]
    if x.target is not None and x.V != x.target.vocab_size:
        return [Check("vocab_size", FAIL, f"vocab_size {x.V} but the target's is "
                      f"{x.target.vocab_size} (vocab_size must be the target's, not the draft's)")]
    return [Check("vocab_size", PASS, f"V={x.V}, Vd={x.Vd}")]


def c_norm_before_residual(x: Ctx) -> list[Check]:
    v = x.f.get("norm_before_residual")
    if v is None:
        if x.fmt == E.SPECULATORS:
            return [Check("norm_before_residual", FAIL, "not written: vLLM's speculators path "
                          "assumes true, its native path and SGLang false")]
        return [Check("norm_before_residual", WARN, "not written: every engine reads a native dir "
                      "as false; write it out")]
    if v and x.fmt == E.NATIVE:
        return [Check("norm_before_residual", WARN, "true: SGLang implements only false (serve "
                      "with vLLM or llama.cpp)")]
    return [Check("norm_before_residual", PASS, str(bool(v)).lower())]


def _flag_with_tensors(x: Ctx, flag: str, names: list[str], what: str) -> list[Check]:
    v = x.f.get(flag)
    has = [n for n in names if n in x.ed.tensors]
    if has and not v:
        return [Check(flag, FAIL, f"{_fmt_list(has, 2)} shipped but {flag} is "
                      f"{'missing' if v is None else 'false'}: engines skip {what}")]
    if v and len(has) != len(names):
        gone = _fmt_list(sorted(set(names) - set(has)), 2)
        return [Check(flag, FAIL, f"{flag} is true but {gone} missing")]
    if v is None:
        return [Check(flag, WARN, "not written: engines read false; write it out")]
    if v:
        return [Check(flag, WARN, f"true: needs a 2026 vLLM or SGLang; llama.cpp does not "
                      f"implement {what}")]
    return [Check(flag, PASS, "false")]


def c_fc_norm(x: Ctx) -> list[Check]:
    # EAGLE-3.1 engines name the per-aux norms fc_norm.{i}.weight (an nn.ModuleList).
    names = [f"fc_norm.{i}.weight" for i in range(x.n_aux())]
    names += sorted(k for k in x.ed.tensors if k.startswith("fc_norm.") and k not in names)
    return _flag_with_tensors(x, "fc_norm", names, "the per-aux RMSNorm before fc")


def c_norm_before_fc(x: Ctx) -> list[Check]:
    return _flag_with_tensors(x, "norm_before_fc", ["input_norm.weight"],
                              "the RMSNorm over the concatenated aux states")


def c_feedback_post_norm(x: Ctx) -> list[Check]:
    v = x.f.get("feedback_post_norm")
    if v is None:
        return [Check("feedback_post_norm", WARN, "not written: engines feed back the pre-norm "
                      "state; write it out")]
    if v:
        return [Check("feedback_post_norm", WARN, "true: needs a 2026 vLLM or SGLang; llama.cpp "
                      "feeds back the pre-norm state")]
    return [Check("feedback_post_norm", PASS, "false")]


def c_ambiguous_keys(x: Ctx) -> list[Check]:
    """Keys that engines or trainers read with different meanings (engines.AMBIGUOUS). An MLA
    dir's norm_output equal to feedback_post_norm is the engines' MLA classes' own key."""
    found = []
    for where, d in (("", x.ed.config), ("transformer_layer_config.",
                                         x.ed.config.get("transformer_layer_config") or {})):
        found += [f"{where}{k}={json.dumps(d[k])} ({why})" for k, why in E.AMBIGUOUS.items()
                  if isinstance(d, dict) and k in d and not (
                      x.ed.mla and k == "norm_output"
                      and d[k] == d.get("feedback_post_norm", d[k]))]
    if found:
        return [Check("ambiguous_keys", WARN, "; ".join(found) + ": an engine or trainer may "
                      "read it in another meaning than the one it was written with (drafter "
                      "writes feedback_post_norm)")]
    return [Check("ambiguous_keys", PASS, "no key that tools read in different meanings")]


def c_aux_ids(x: Ctx) -> list[Check]:
    """Which target layers each engine feeds the drafter, in HS meaning, against the layers it
    was trained on (drafter.json), or else against what the other engine reads and the default
    [2, N//2, N-3] (a SpecForge-style [1, N//2-1, N-4] read as HS is the classic off-by-one)."""
    read = E.engine_layer_ids(x.fmt, x.ed.config)
    trained = (x.ed.meta or {}).get("aux_layer_ids_hs")
    N = x.N
    if N is None:
        out = []
        for eng, (ids, where) in read.items():
            why = "the target's layer count is unknown (pass --target)"
            if eng == "sglang" and read["vllm"][0] and ids and read["vllm"][0] != ids:
                why = f"vLLM reads HS{read['vllm'][0]}: one of them is off by one (pass --target)"
            what = f"HS{ids}" if ids else "the default [2, N//2, N-3]"
            out.append(Check(f"aux_ids.{eng}", WARN, f"reads {what} ({where}); {why}"))
        return out
    default = E.default_layer_ids(N)
    specforge = E.from_hs(default, "layer_output")
    ids = {eng: list(v) if v else default for eng, (v, _) in read.items()}
    where = {eng: w for eng, (_, w) in read.items()}
    explicit = {eng: v is not None for eng, (v, _) in read.items()}
    verdict: dict[str, tuple[str, str]] = {}
    for eng in read:
        got = f"reads HS{ids[eng]} ({where[eng]})"
        bad = [k for k in ids[eng] if k < 0 or k > N]
        if bad:
            verdict[eng] = (FAIL, f"{got}: {bad} outside [0, {N}]")
        elif trained is not None:
            if ids[eng] == list(trained):
                verdict[eng] = (PASS, f"{got}, the layers it was trained on")
            elif eng == "llama_cpp":  # version-dependent: newer converters read explicit ids
                verdict[eng] = (WARN, f"its converter recomputes HS{ids[eng]} from the target, "
                                f"but the drafter was trained on HS{list(trained)}")
            else:
                verdict[eng] = (FAIL, f"{got} but the drafter was trained on HS{list(trained)}")
        elif eng != "llama_cpp" and explicit[eng] and ids[eng] == specforge:
            verdict[eng] = (FAIL, f"{got}: these look like SpecForge / ModelOpt output-of-layer "
                            f"ids {specforge} read as HS: off by one")
        else:
            verdict[eng] = (PASS if ids[eng] == default else WARN,
                            got + ("" if ids[eng] == default else f", not the default HS{default}"))
    if x.fmt == E.NATIVE and trained is None and ids["vllm"] != ids["sglang"]:
        # vLLM and SGLang read different layers: at most one is right. An explicit key beats an
        # engine's silent fallback; between two explicit readings, the default wins.
        if explicit["vllm"] != explicit["sglang"]:
            wrong = "sglang" if explicit["vllm"] else "vllm"
        elif (ids["vllm"] == default) != (ids["sglang"] == default):
            wrong = "sglang" if ids["vllm"] == default else "vllm"
        else:
            wrong = None
        for eng in ("vllm", "sglang"):
            status, reason = verdict[eng]
            other = "sglang" if eng == "vllm" else "vllm"
            if eng == wrong and status != FAIL:
                verdict[eng] = (FAIL, f"{reason}; the other engine reads HS{ids[other]}: "
                                "off by one for this engine")
            elif wrong is None and status == PASS:
                verdict[eng] = (WARN, f"{reason}; the other engine reads HS{ids[other]}")
    nested = (x.ed.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if x.fmt == E.NATIVE and nested and nested[0] != 1 and verdict["sglang"][0] == PASS:
        verdict["sglang"] = (WARN, verdict["sglang"][1] + "; SGLang versions from 2026 add 1 "
                             f"only when the first id is 1 (here {nested[0]})")
    if trained is None and ids["vllm"] != default and "llama_cpp" in verdict \
            and verdict["llama_cpp"][0] == PASS:
        verdict["llama_cpp"] = (WARN, f"its converter recomputes HS{default} from the target, "
                                f"but vLLM reads HS{ids['vllm']} from this dir")
    return [Check(f"aux_ids.{eng}", *verdict[eng]) for eng in read]


def c_aux_order(x: Ctx) -> list[Check]:
    """vLLM (deepseek_v2.py, llama.py: `if idx in aux_hidden_state_layers`) and SGLang (`if i in
    self.layers_to_capture`) capture aux states walking the layers: fc gets them in layer order,
    each layer once, whatever order the config lists."""
    for where, ids in (("eagle_aux_hidden_state_layer_ids",
                        x.f.get("eagle_aux_hidden_state_layer_ids")),
                       ("eagle_config.eagle_aux_hidden_state_layer_ids",
                        (x.ed.config.get("eagle_config") or {}).get(
                            "eagle_aux_hidden_state_layer_ids"))):
        if not isinstance(ids, list) or not ids:
            continue
        rep = sorted({k for k in ids if ids.count(k) > 1})
        if rep:
            return [Check("aux_ids.order", FAIL, f"{where} {ids} repeats {rep}: vLLM and SGLang "
                          f"capture each layer once, so fc gets {len(set(ids))} states for its "
                          f"{len(ids)} column blocks. Fix: train on {len(ids)} distinct layers")]
        if ids != sorted(ids):
            return [Check("aux_ids.order", FAIL, f"{where} {ids} not ascending: vLLM and SGLang "
                          f"hand the states to fc in layer order {sorted(ids)}, so fc.weight's "
                          "column blocks meet other layers than trained. Fix: write the ids "
                          "ascending and permute fc.weight's [H, Ht] column blocks (and fc_norm's "
                          "rows) alike, or retrain with ascending ids")]
    return [Check("aux_ids.order", PASS, "ascending, no repeats (the order engines use)")]


def c_mla(x: Ctx) -> list[Check]:
    """An MLA draft layer's sizes against what the engines' MLA draft classes take."""
    if not x.ed.mla:
        return []
    try:
        width = int(x.f["kv_lora_rank"]) + int(x.f["qk_rope_head_dim"])
    except (KeyError, TypeError, ValueError):
        return [Check("mla", FAIL, "kv_lora_rank or qk_rope_head_dim missing")]
    if width not in MLA_LATENT_WIDTHS:
        return [Check("mla", FAIL, f"kv_lora_rank + qk_rope_head_dim = {width}: vLLM's MLA "
                      f"backends take {MLA_LATENT_WIDTHS} (DeepSeek-V3 and Kimi-K2.5: 512 + 64)")]
    notes = []
    if width != CPU_MLA_WIDTH:
        notes.append(f"vLLM's CPU MLA backend takes {CPU_MLA_WIDTH} only")
    if not x.f.get("q_lora_rank"):
        notes.append("q_lora_rank null: SGLang's MLA draft class needs it (serve with vLLM)")
    if x.f.get("norm_before_residual"):
        notes.append("norm_before_residual true: SGLang's MLA draft class implements false")
    if notes:
        return [Check("mla", WARN, f"latent {width}; " + "; ".join(notes))]
    return [Check("mla", PASS, f"latent {width} ({x.f['kv_lora_rank']} + "
                  f"{x.f['qk_rope_head_dim']}): vLLM's and SGLang's MLA draft classes load it")]


def c_speculators(x: Ctx) -> list[Check]:
    if x.fmt != E.SPECULATORS:
        return []
    c = x.ed.config
    sc = c.get("speculators_config") or {}
    problems = []
    if c.get("speculators_model_type") != "eagle3":
        problems.append(f"speculators_model_type {c.get('speculators_model_type')!r} != 'eagle3'")
    if sc.get("algorithm") != "eagle3":
        problems.append(f"speculators_config.algorithm {sc.get('algorithm')!r} != 'eagle3'")
    methods = sc.get("proposal_methods") or [{}]
    k = methods[0].get("speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool):
        problems.append("no proposal_methods[0].speculative_tokens")
    elif k < 1:
        problems.append(f"proposal_methods[0].speculative_tokens is {k}: nothing is drafted")
    ver = sc.get("verifier") or {}
    if not ver.get("name_or_path"):
        problems.append("no verifier.name_or_path (vLLM serves it as the target)")
    if problems:
        return [Check("speculators_config", FAIL, "; ".join(problems))]
    t = x.target
    if t is not None and t.architectures and ver.get("architectures") \
            and list(ver["architectures"]) != list(t.architectures):
        return [Check("speculators_config", WARN, f"verifier architectures {ver['architectures']} "
                      f"but the target is {t.architectures}")]
    return [Check("speculators_config", PASS, f"eagle3, K={methods[0]['speculative_tokens']}, "
                  f"verifier {ver['name_or_path']}")]


CHECKS = [c_format, c_weights_file, c_config_fields, c_tensor_names, c_tensor_shapes, c_dtype,
          c_d2t, c_t2d, c_lm_head, c_embed_tokens, c_tie, c_rope, c_rope_engines, c_max_pos,
          c_hidden, c_vocab, c_norm_before_residual, c_fc_norm, c_norm_before_fc,
          c_feedback_post_norm, c_ambiguous_keys, c_aux_ids, c_aux_order, c_mla, c_speculators]
