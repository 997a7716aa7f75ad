"""`drafter check`: every check passes on a good export (native and speculators, with the target
given as a folder, a config.json or only through the dir's own hints), and every check fires on a
deliberately broken copy of it. The exit code is non-zero on any fail (real CLI subprocess)."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engines import make_drafter

from drafter.export import engines as E
from drafter.export.check import (
    FAIL,
    PASS,
    SKIP,
    SMOKE_ALPHA,
    SMOKE_WARN,
    WARN,
    at_least,
    format_report,
    run_checks,
    smoke_verdict,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def good(tiny_target, tmp_path_factory) -> dict[str, Path]:
    """Good bf16 exports of one drafter, as `drafter export` writes them."""
    root = tmp_path_factory.mktemp("good")
    m = make_drafter(tiny_target, seed=11)
    t = E.target_info(str(tiny_target))
    out = {}
    for fmt in E.FORMATS:
        d = root / fmt
        d.mkdir()
        E.write_dir(m, d, fmt, target=t, dtype=torch.bfloat16, final_dir=d)
        out[fmt] = d
    return out


def copy(good: dict, fmt: str, tmp_path: Path) -> Path:
    d = tmp_path / fmt
    shutil.copytree(good[fmt], d)
    return d


def edit_config(d: Path, fn) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def edit_tensors(d: Path, fn) -> None:
    sd = load_file(str(d / "model.safetensors"))
    fn(sd)
    save_file(sd, str(d / "model.safetensors"))


def body(cfg: dict) -> dict:
    """The Llama fields: the config itself (native) or transformer_layer_config."""
    return cfg.get("transformer_layer_config", cfg)


def target_config(tiny_target: Path, tmp_path: Path, **changes) -> str:
    """A copy of the target's config.json with some fields changed, as a --target path."""
    cfg = json.loads((tiny_target / "config.json").read_text())
    cfg.update(changes)
    p = tmp_path / "target_config" / "config.json"
    p.parent.mkdir(exist_ok=True)
    p.write_text(json.dumps(cfg))
    return str(p)


# ------------------------------------------------------------------------------- the good ones
@pytest.mark.parametrize("fmt", E.FORMATS)
def test_good_export_passes_every_check(good, tiny_target, fmt, tmp_path):
    for target in (str(tiny_target), str(tiny_target / "config.json"), None):
        r = run_checks(good[fmt], target)
        assert r.format == fmt
        # engine rules skip where the engine is not installed (tests/test_vllm.py runs them)
        assert [c for c in r.checks if c.status not in (PASS, SKIP)] == [], format_report(r)
        assert r.target["num_hidden_layers"] == 8
    names = {c.name for c in r.checks}
    assert {"d2t", "t2d", "lm_head", "tie_word_embeddings", "rope", "max_position_embeddings",
            "hidden_size", "vocab_size", "tensor_names", "dtype", "aux_ids.vllm",
            "aux_ids.llama_cpp", *E.NORM_FLAGS} <= names
    assert ("aux_ids.sglang" in names) == (fmt == E.NATIVE)
    assert ("speculators_config" in names) == (fmt == E.SPECULATORS)
    # a published copy (no drafter.json): the target's layer count makes the ids checkable
    d = copy(good, fmt, tmp_path)
    (d / "drafter.json").unlink()
    r = run_checks(d, str(tiny_target))
    assert r.ok and r.counts[WARN] == 0, format_report(r)


def test_skips_are_counted_apart(good, tiny_target, monkeypatch):
    """An engine rule that cannot run here (the engine not installed, or no target known) is a
    skip: neither a pass nor a warning, and the summary line and the JSON counts say how many."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("vllm", "sglang") else real(name, *a))
    r = run_checks(good[N], str(tiny_target))
    assert [c.name for c in r.checks if c.status == SKIP] == ["engine_support_vllm",
                                                               "engine_support_sglang"]
    assert r.ok and r.counts[SKIP] == 2 and r.counts[WARN] == 0
    assert r.counts[PASS] == len(r.checks) - 2 and r.to_dict()["counts"]["skip"] == 2
    last = format_report(r).splitlines()[-1]
    assert last == f"0 fail, 0 warn, {len(r.checks) - 2} pass, 2 skipped"
    assert "SKIP  engine_support_vllm" in format_report(r)


def test_without_any_target_only_warns(good, tmp_path):
    d = copy(good, E.NATIVE, tmp_path)
    (d / "drafter.json").unlink()
    r = run_checks(d)
    assert r.ok
    assert r.status("target") == WARN
    assert {r.status(f"aux_ids.{e}") for e in ("vllm", "sglang", "llama_cpp")} == {WARN}


def test_speculators_verifier_folder_is_a_hint(good, tiny_target, tmp_path):
    d = copy(good, E.SPECULATORS, tmp_path)
    (d / "drafter.json").unlink()
    r = run_checks(d)
    assert r.target_source == "speculators verifier" and r.ok, format_report(r)
    assert r.status("aux_ids.vllm") == PASS


# -------------------------------------------------------------------------- broken copies
def _drop_meta(d):
    (d / "drafter.json").unlink()


def _ids(top=None, nested=None, drop_meta=True):
    """Set (or remove, with []) the top-level and eagle_config ids."""
    def f(d):
        def g(cfg):
            for key, val in (("top", top), ("nested", nested)):
                if val is None:
                    continue
                if key == "top":
                    cfg.pop("eagle_aux_hidden_state_layer_ids", None)
                    if val:
                        cfg["eagle_aux_hidden_state_layer_ids"] = val
                else:
                    cfg.setdefault("eagle_config", {}).pop("eagle_aux_hidden_state_layer_ids", None)
                    if val:
                        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = val
        edit_config(d, g)
        if drop_meta:
            _drop_meta(d)
    return f


def _cfg(fn):
    return lambda d: edit_config(d, fn)


def _tensors(fn):
    return lambda d: edit_tensors(d, fn)


def _set(key, value, where="body"):
    def g(cfg):
        (body(cfg) if where == "body" else cfg)[key] = value
    return _cfg(g)


def _del(key, where="body"):
    def g(cfg):
        (body(cfg) if where == "body" else cfg).pop(key, None)
    return _cfg(g)


def _d2t(fn):
    def g(sd):
        sd["d2t"] = fn(sd["d2t"].clone(), sd)
    return _tensors(g)


def _targets(sd):
    return torch.arange(sd["d2t"].numel()) + sd["d2t"]


def _unsorted(d2t, sd):
    t = _targets(sd).flip(0)                               # same tokens, descending
    return t - torch.arange(t.numel())


def _dup(d2t, sd):
    t = _targets(sd)
    t[5] = t[4]
    return t - torch.arange(t.numel())


def _out_of_range(d2t, sd):
    d2t[-1] += 49152
    return d2t


def _t2d_disagrees(sd):
    t2d = sd["t2d"].clone()
    on = int(torch.nonzero(t2d)[0])
    off = int(torch.nonzero(~t2d)[0])
    t2d[on], t2d[off] = False, True
    sd["t2d"] = t2d


def _rename(old, new):
    def g(sd):
        for k in [k for k in sd if k.startswith(old)]:
            sd[new + k[len(old):]] = sd.pop(k)
    return _tensors(g)


def _rope(theta=None, params_theta=None, scaling=None):
    def g(cfg):
        b = body(cfg)
        if theta is not None:
            b["rope_theta"] = theta
        if params_theta is not None:
            b["rope_parameters"]["rope_theta"] = params_theta
        if scaling is not None:
            b["rope_scaling"] = scaling
            b["rope_parameters"] = {**scaling, "rope_theta": b["rope_theta"]}
    return _cfg(g)


def _no_rope(cfg):
    for k in ("rope_theta", "rope_parameters", "rope_scaling"):
        body(cfg).pop(k, None)


def _add_fc_norm(sd):
    for i in range(3):
        sd[f"fc_norm.{i}.weight"] = torch.ones(64, dtype=torch.bfloat16)


def _spec(key, value):
    def g(cfg):
        if key == "verifier":
            cfg["speculators_config"]["verifier"].pop("name_or_path")
        else:
            cfg["speculators_config"][key] = value
    return _cfg(g)


def _pickle(d):
    sd = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    torch.save(sd, d / "pytorch_model.bin")


N, S = E.NATIVE, E.SPECULATORS
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}
BROKEN = [
    # (id, format, mutation, check that must fire, its status)
    # --- aux layer ids, per engine
    ("ids_specforge_top_level", N, _ids(top=[1, 3, 4], nested=[]), "aux_ids.vllm", FAIL),
    ("ids_specforge_speculators", S, _ids(top=[1, 3, 4]), "aux_ids.vllm", FAIL),
    ("ids_not_trained", N, _ids(top=[3, 4, 5], drop_meta=False), "aux_ids.vllm", FAIL),
    ("ids_eagle_config_only_hs", N, _ids(top=[], nested=[2, 4, 5]), "aux_ids.sglang", FAIL),
    ("ids_eagle_config_only_specforge", N, _ids(top=[], nested=[1, 3, 4]), "aux_ids.vllm", FAIL),
    ("ids_sglang_missing", N, _ids(top=[3, 4, 6], nested=[]), "aux_ids.sglang", FAIL),
    ("ids_out_of_range", N, _ids(top=[2, 4, 9], nested=[1, 3, 8]), "aux_ids.vllm", FAIL),
    # --- d2t / t2d
    ("d2t_missing", N, _tensors(lambda sd: sd.pop("d2t")), "d2t", FAIL),
    ("d2t_absolute", N, _d2t(lambda d2t, sd: _targets(sd)), "d2t", FAIL),
    ("d2t_unsorted", N, _d2t(_unsorted), "d2t", FAIL),
    ("d2t_duplicated", S, _d2t(_dup), "d2t", FAIL),
    ("d2t_out_of_range", N, _d2t(_out_of_range), "d2t", FAIL),
    ("d2t_float", N, _d2t(lambda d2t, sd: d2t.float()), "d2t", FAIL),
    ("d2t_int32", N, _d2t(lambda d2t, sd: d2t.int()), "d2t", WARN),
    ("t2d_missing", N, _tensors(lambda sd: sd.pop("t2d")), "t2d", WARN),
    ("t2d_disagrees", N, _tensors(_t2d_disagrees), "t2d", FAIL),
    # --- heads and embeddings
    ("lm_head_missing", N, _tensors(lambda sd: sd.pop("lm_head.weight")), "lm_head", FAIL),
    ("tied_embeddings", N, _set("tie_word_embeddings", True), "tie_word_embeddings", FAIL),
    ("tied_embeddings_speculators", S, _set("tie_word_embeddings", True), "tie_word_embeddings",
     FAIL),
    ("tie_not_written", N, _del("tie_word_embeddings"), "tie_word_embeddings", WARN),
    # --- RoPE and context
    ("rope_missing", N, _cfg(_no_rope), "rope", FAIL),
    ("rope_missing_speculators", S, _cfg(_no_rope), "rope", FAIL),
    ("rope_theta_not_targets", N, _rope(theta=500000.0, params_theta=500000.0), "rope", FAIL),
    ("rope_spellings_disagree", N, _rope(theta=500000.0), "rope", FAIL),
    ("rope_scaling_not_targets", S, _rope(scaling=LLAMA3), "rope", FAIL),
    ("max_pos_missing", N, _del("max_position_embeddings"), "max_position_embeddings", FAIL),
    ("max_pos_too_small", S, _set("max_position_embeddings", 512), "max_position_embeddings",
     FAIL),
    # --- norm flags: missing, inconsistent with the tensors, unsupported by an engine
    ("nbr_missing_speculators", S, _del("norm_before_residual", "top"), "norm_before_residual",
     FAIL),
    ("nbr_missing_native", N, _del("norm_before_residual"), "norm_before_residual", WARN),
    ("nbr_true_native_sglang", N, _set("norm_before_residual", True), "norm_before_residual",
     WARN),
    ("fc_norm_tensors_flag_off", N, _tensors(_add_fc_norm), "fc_norm", FAIL),
    ("fc_norm_flag_no_tensors", S, _set("fc_norm", True, "top"), "fc_norm", FAIL),
    ("fc_norm_missing", N, _del("fc_norm"), "fc_norm", WARN),
    ("norm_before_fc_tensor_flag_off", N,
     _tensors(lambda sd: sd.__setitem__("input_norm.weight", torch.ones(192))), "norm_before_fc",
     FAIL),
    ("norm_before_fc_missing", S, _del("norm_before_fc", "top"), "norm_before_fc", WARN),
    ("feedback_post_norm_missing", N, _del("feedback_post_norm"), "feedback_post_norm", WARN),
    ("feedback_post_norm_true", S, _set("feedback_post_norm", True, "top"),
     "feedback_post_norm", WARN),
    # a key SpecForge reads as "final norm before lm_head" and EAGLE-3.1 as "post-norm feedback"
    ("norm_output_ambiguous", N, _set("norm_output", False), "ambiguous_keys", WARN),
    ("norm_output_ambiguous_layer", S, _set("norm_output", True), "ambiguous_keys", WARN),
    # --- tensor names, shapes, dtypes
    ("tensor_unknown", N, _tensors(lambda sd: sd.__setitem__("midlayer.extra.weight",
                                                             torch.zeros(2))),
     "tensor_names", FAIL),
    ("tensor_missing", S, _tensors(lambda sd: sd.pop("layers.0.mlp.down_proj.weight")),
     "tensor_names", FAIL),
    ("native_with_layers0_names", N, _rename("midlayer.", "layers.0."), "tensor_names", FAIL),
    ("speculators_with_midlayer_names", S, _rename("layers.0.", "midlayer."), "tensor_names",
     WARN),
    ("shape_mismatch", N, _set("intermediate_size", 64), "tensor_shapes", FAIL),
    ("dtype_mixed", N, _tensors(lambda sd: sd.__setitem__("norm.weight", sd["norm.weight"].half())),
     "dtype", WARN),
    ("dtype_not_as_declared", S, _set("torch_dtype", "float16"), "dtype", WARN),
    ("dtype_not_written", N, _del("torch_dtype"), "dtype", WARN),
    # --- config and format
    ("two_layers", N, _set("num_hidden_layers", 2), "config_fields", FAIL),
    ("draft_vocab_size_missing", S, _del("draft_vocab_size", "top"), "config_fields", FAIL),
    ("speculators_model_type_llama", S, _set("model_type", "llama", "top"), "format", FAIL),
    ("native_vllm_arch_name", N, _set("architectures", ["Eagle3LlamaForCausalLM"]), "format",
     WARN),
    ("native_no_model_type", N, _del("model_type"), "format", FAIL),
    ("not_eagle3", N, _set("architectures", ["LlamaForCausalLM"]), "format", FAIL),
    ("no_config", N, lambda d: (d / "config.json").unlink(), "format", FAIL),
    ("pickle_weights", N, _pickle, "weights_file", WARN),
    ("no_weights", S, lambda d: (d / "model.safetensors").rename(d / "weights.pt"),
     "weights_file", FAIL),
    ("speculators_no_verifier", S, _spec("verifier", None), "speculators_config", FAIL),
    ("speculators_wrong_algorithm", S, _spec("algorithm", "eagle"), "speculators_config", FAIL),
    ("speculators_zero_tokens", S, _spec("proposal_methods", [{"proposal_type": "greedy",
                                                              "speculative_tokens": 0}]),
     "speculators_config", FAIL),
]


@pytest.mark.parametrize("case", BROKEN, ids=[b[0] for b in BROKEN])
def test_every_check_fires_on_a_broken_copy(good, tiny_target, tmp_path, case):
    _, fmt, mutate, name, status = case
    d = copy(good, fmt, tmp_path)
    mutate(d)
    r = run_checks(d, str(tiny_target))
    assert r.status(name) == status, format_report(r)
    assert r.ok == (status != FAIL and r.counts[FAIL] == 0)


def test_target_mismatches_fire(good, tiny_target, tmp_path):
    """Hidden size, vocab size and layer count compared with the target given by --target."""
    r = run_checks(good[N], target_config(tiny_target, tmp_path, hidden_size=128))
    assert r.status("hidden_size") == FAIL and r.status("target") == FAIL
    r = run_checks(good[S], target_config(tiny_target, tmp_path, vocab_size=50000))
    assert r.status("vocab_size") == FAIL
    d = copy(good, N, tmp_path)
    _drop_meta(d)
    r = run_checks(d, target_config(tiny_target, tmp_path, num_hidden_layers=12))
    assert r.status("aux_ids.vllm") == WARN and r.status("aux_ids.llama_cpp") == WARN
    r = run_checks(d, target_config(tiny_target, tmp_path, rope_theta=100000.0,
                                    rope_parameters={"rope_type": "default",
                                                     "rope_theta": 100000.0}))
    assert r.status("rope") == FAIL


def test_embed_tokens_required_when_hidden_sizes_differ(tiny_target, tmp_path):
    m = make_drafter(tiny_target, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, intermediate_size=80)
    t = E.target_info(str(tiny_target))
    d = tmp_path / "n"
    d.mkdir()
    E.write_dir(m, d, N, target=t)
    assert run_checks(d, t).ok
    edit_tensors(d, lambda sd: sd.pop("embed_tokens.weight"))
    r = run_checks(d, t)
    assert r.status("embed_tokens") == FAIL
    edit_config(d, lambda cfg: cfg.pop("target_hidden_size"))   # engines then build fc as 3*H
    assert run_checks(d, t).status("hidden_size") == FAIL


def test_custom_ids_warn_for_llama_cpp_and_new_sglang(tiny_target, tmp_path):
    m = make_drafter(tiny_target, aux_layer_ids=[3, 4, 6])
    t = E.target_info(str(tiny_target))
    d = tmp_path / "n"
    d.mkdir()
    E.write_dir(m, d, N, target=t)
    r = run_checks(d, t)
    assert r.ok
    assert r.status("aux_ids.vllm") == PASS
    assert r.status("aux_ids.sglang") == WARN          # 2026 SGLang: +1 only when first id is 1
    assert r.status("aux_ids.llama_cpp") == WARN       # the converter recomputes the default


def test_builtin_target_spec(good, smollm2_dir):
    """--target accepts builtin:NAME; the name reported is the materialised folder."""
    r = run_checks(good[N], "builtin:smollm2-135m-instruct")
    assert r.target["name_or_path"] == str(smollm2_dir)
    assert r.target["num_hidden_layers"] == 30
    assert r.status("hidden_size") == FAIL             # a drafter for a 64-wide target
    assert r.status("target") == FAIL                  # drafter.json names another target


# ----------------------------------------------------------------------------------------- CLI
def _cli(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "drafter.cli", "check", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


def test_cli_exit_codes_and_json(good, tiny_target, tmp_path):
    # --no-smoke: `good` is a random drafter, which the acceptance smoke test fails (below)
    p = _cli(str(good[N]), "--target", str(tiny_target), "--json", "--no-smoke")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["ok"] and out["format"] == N and out["counts"]["fail"] == 0
    assert all(set(c) == {"name", "status", "reason"} for c in out["checks"])
    d = copy(good, S, tmp_path)
    edit_tensors(d, lambda sd: sd.pop("d2t"))
    p = _cli(str(d))
    assert p.returncode == 1
    assert "FAIL  d2t" in p.stdout and "vLLM maps draft id i to target id i" in p.stdout


def test_engine_rule_says_nothing_of_triton_without_a_gpu(good, tiny_target, caplog):
    """Without CUDA, importing vLLM's CPU build for the engine rule says nothing alarming ("Triton
    is installed, but doesn't include CPU backend"): that is how its CPU build always runs.
    Errors of the same logger still show."""
    import importlib.util
    import logging

    from drafter.core.vllm import quiet_cpu_triton

    if torch.cuda.is_available():
        pytest.skip("on a GPU host vLLM's Triton lines mean a broken Triton: they stay")
    quiet_cpu_triton()
    lg = logging.getLogger("vllm.triton_utils.importing")
    with caplog.at_level(logging.DEBUG):
        lg.warning("a warning that is kept out")
        lg.error("an error that stays")
    assert [r.getMessage() for r in caplog.records] == ["an error that stays"]
    if importlib.util.find_spec("vllm") is None:
        return
    p = _cli(str(good[N]), "--target", str(tiny_target), "--no-smoke")
    assert p.returncode == 0 and "engine_support_vllm" in p.stdout, p.stdout + p.stderr
    assert "Triton" not in p.stderr and "Triton" not in p.stdout, p.stderr


# ----------------------------------------------------------------- the acceptance smoke test
TOKEN = 1000  # an ordinary SmolLM2 token (ids below ~20 are special)


def constant_target(root: Path, smollm2_dir: Path) -> Path:
    """A tiny Llama whose greedy answer is TOKEN, always: its layers add nothing to the
    residual stream, dimension 0 of every embedding is positive, and lm_head reads only that
    dimension into TOKEN's logit."""
    from transformers import AutoModelForCausalLM

    from tests.tiny import make_tiny

    path = make_tiny("llama", root, tokenizer_dir=smollm2_dir, num_hidden_layers=8)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 5.0
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[TOKEN, 0] = 1.0
    model.save_pretrained(path)
    return path


def vocab_from(m, first: int):
    """The drafter's draft vocab: `first` as draft id 0, then 511 larger ids."""
    g = torch.Generator().manual_seed(0)
    rest = torch.randperm(m.cfg.vocab_size - first - 1, generator=g)[:m.cfg.draft_vocab_size - 1]
    targets = torch.cat([torch.tensor([first]), torch.sort(rest + first + 1).values])
    t2d = torch.zeros(m.cfg.vocab_size, dtype=torch.bool)
    t2d[targets] = True
    m.set_vocab(targets - torch.arange(m.cfg.draft_vocab_size), t2d)
    return m


def test_acceptance_smoke_test_fails_a_drafter_that_predicts_nothing(tmp_path, smollm2_dir):
    """With --target, the drafter runs teacher-forced on answers the target wrote itself: one
    that always predicts the target's token passes with accuracy 1 and tau K+1; a random one,
    whose files pass every other check, fails; so does one built for another target."""
    target = constant_target(tmp_path, smollm2_dir)
    t = E.target_info(str(target))
    good_m = vocab_from(make_drafter(target, seed=3), TOKEN)
    with torch.no_grad():
        good_m.norm.weight.zero_()  # logits all 0: argmax is draft id 0, target id TOKEN
    bad_m = vocab_from(make_drafter(target, seed=4), TOKEN)
    dirs = {}
    for name, m in (("good", good_m), ("random", bad_m)):
        d = tmp_path / name
        d.mkdir()
        E.write_dir(m, d, E.NATIVE, target=t, dtype=torch.float32, final_dir=d)
        dirs[name] = d
    r = run_checks(dirs["good"], str(target), smoke=True)
    assert r.status("acceptance") == PASS, format_report(r)
    reason = next(c.reason for c in r.checks if c.name == "acceptance")
    assert "step-0 accuracy 1.00 (192 of 192 tokens" in reason
    assert "expected tau 4.00 (greedy chain K=3)" in reason
    r = run_checks(dirs["random"], str(target), smoke=True)
    assert r.status("acceptance") == FAIL and "predicts nothing" in format_report(r)
    assert [c.name for c in r.checks if c.status == FAIL] == ["acceptance"]  # files look fine
    assert run_checks(dirs["random"], str(target)).status("acceptance") is None  # API: opt-in
    # --target as a config.json: no weights, nothing to run
    r = run_checks(dirs["good"], str(target / "config.json"), smoke=True)
    assert r.status("acceptance") == WARN
    # the CLI runs it with --target and exits 1 on the random drafter
    p = _cli(str(dirs["random"]), "--target", str(target))
    assert p.returncode == 1 and "FAIL  acceptance" in p.stdout, p.stdout + p.stderr


def test_smoke_verdict_tells_a_weak_drafter_from_one_that_predicts_nothing():
    """On 192 tokens with 1,024 draft ids a uniform guess hits about 0.19 of them, 3 or more with
    probability 0.001: 0 to 2 hits predict nothing, 3 and 15 are a weak drafter's (fewer than
    always guessing the most frequent token's 12 would be no reason to fail it), 0.2 passes."""
    assert at_least(2, 192, 1 / 1024) > SMOKE_ALPHA > at_least(3, 192, 1 / 1024)
    assert abs(at_least(1, 192, 1 / 1024) - (1 - (1 - 1 / 1024) ** 192)) < 1e-12
    a = {"tokens": 192, "prompts": 4, "k": 3, "tau": 1.08, "chance": 1 / 1024, "blind": 0.0625}
    for hits, status in ((0, FAIL), (2, FAIL), (3, WARN), (11, WARN), (15, WARN),
                         (math.ceil(SMOKE_WARN * 192), PASS)):
        c = smoke_verdict({**a, "acc": [hits / 192]})
        assert c.status == status, (hits, c.reason)
        assert f"({hits} of 192 tokens the target wrote for 4 prompts" in c.reason
    assert "predicts nothing" in smoke_verdict({**a, "acc": [0.0]}).reason
    weak = smoke_verdict({**a, "acc": [15 / 192]}).reason
    assert "weak but working" in weak and "most frequent one would score 0.06" in weak
    assert "predicts nothing" not in weak and "random weights" not in weak


def few_steps_drafter(smollm2_dir: Path, out: Path, steps: int) -> Path:
    """A real drafter for SmolLM2, trained `steps` AdamW steps (0: its random init) on the
    target's own predictions over 40 quickstart prompts the smoke test does not use
    (teacher-forced, one TTT step), its draft vocab the 1,024 most frequent tokens there."""
    from collections import Counter
    from types import SimpleNamespace

    from drafter.core import target as T
    from drafter.core.config import TargetConfig
    from drafter.data.sources import load_prompts
    from drafter.features.capture import Capture
    from drafter.train.batches import Source, device_batch, host_batch, model_inputs
    from drafter.train.model import Drafter, DrafterConfig
    from drafter.train.ttt import TTT

    tcfg = TargetConfig(model=str(smollm2_dir))
    model, tok = T.load_model(tcfg, device="cpu"), T.load_tokenizer(tcfg)
    samples = []
    for rec in load_prompts("builtin:quickstart-prompts", max_n=48)[8:]:
        text = tok.apply_chat_template(rec["messages"], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        samples.append({"input_ids": ids, "loss_mask": [1] * len(ids)})
    V, Vd = model.config.vocab_size, 1024
    common = [t for t, _ in Counter(t for s in samples for t in s["input_ids"]).most_common(Vd)]
    rest = sorted(set(range(V)) - set(common))[:Vd - len(common)]
    targets = torch.tensor(sorted(common + rest))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[targets] = True
    ids = E.default_layer_ids(model.config.num_hidden_layers)
    cfg = DrafterConfig.from_target(model.config, draft_vocab_size=Vd, aux_layer_ids=ids)
    torch.manual_seed(0)
    m = Drafter(cfg)
    m.set_embeddings(model.get_input_embeddings().weight.detach().float())
    m.set_vocab(targets - torch.arange(Vd), t2d)
    if steps:
        cap = Capture(model, cfg.aux_layer_ids, m.d2t, m.t2d, teacher="hidden",
                      out_dtype=torch.float32)
        src = Source.memory(cap(samples))
        hb = host_batch(src, [[i] for i in range(len(src))], len(src), max(src.lengths),
                        SimpleNamespace(method="eagle3", ttt_steps=1, ttt_decay=1.0),
                        m.embed_tokens.weight)
        d = device_batch(hb, torch.device("cpu"), cap.head, fused=False)
        ttt = TTT(m, attention="sdpa")
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-3)
        for _ in range(steps):
            ttt(**model_inputs(d))["loss"].backward()
            opt.step()
            opt.zero_grad()
    out.mkdir()
    E.write_dir(m.eval(), out, E.NATIVE, target=E.target_info(str(smollm2_dir)),
                dtype=torch.float32, final_dir=out)
    return out


@pytest.mark.slow
def test_acceptance_smoke_test_tells_a_weak_drafter_from_a_random_one(tmp_path, smollm2_dir):
    """On the real SmolLM2: a drafter trained 10 steps predicts some of the target's tokens, far
    fewer than SMOKE_WARN: a warning that calls it weak, not broken. The same drafter untrained
    (random weights) predicts nothing: a failure. (Slow: SmolLM2 writes the smoke test's
    answers twice and trains the drafter, CPU minutes.)"""
    for steps, status in ((0, FAIL), (10, WARN)):
        d = few_steps_drafter(smollm2_dir, tmp_path / f"steps{steps}", steps)
        r = run_checks(d, str(smollm2_dir), smoke=True)
        c = next(c for c in r.checks if c.name == "acceptance")
        assert c.status == status, format_report(r)
        assert ("predicts nothing" in c.reason) == (status == FAIL), c.reason
        assert ("weak but working" in c.reason) == (status == WARN), c.reason


def test_sampled_requests_served_with_greedy_drafts_warn(good, tmp_path):
    """`sampled_drafts` (drafter/export/readme_check.py): export's README samples the drafts of
    its commands for temperatures above 0 and passes; the same README with vLLM's
    `draft_sample_method` dropped there, or an evaluate section whose temperature-1 commands
    draft greedily (vLLM's default; SGLang without rejection sampling), warns naming the line;
    a README whose every command drafts greedily warns; a dir without a README has no verdict."""
    from drafter.export.readme_check import NAME, commands

    for fmt in E.FORMATS:
        c = next(c for c in run_checks(good[fmt]).checks if c.name == NAME)
        assert c.status == PASS and "none for a temperature above 0 drafts greedily" in c.reason
    d = copy(good, E.NATIVE, tmp_path)
    text = (d / "README.md").read_text()
    assert ',"draft_sample_method":"probabilistic"' in text
    cmds = commands(text)
    assert {(x["engine"], x["temperature"], x["samples"]) for x in cmds} == {
        ("vLLM", None, False), ("vLLM", 1.0, True), ("SGLang", None, False),
        ("SGLang", 1.0, True)}

    def status(readme: str):
        (d / "README.md").write_text(readme)
        return next(c for c in run_checks(d).checks if c.name == NAME)

    c = status(text.replace(',"draft_sample_method":"probabilistic"', ""))
    assert c.status == WARN and "the vLLM command for temperature 1 drafts greedily" in c.reason
    assert '"draft_sample_method": "probabilistic"' in c.reason
    tuned = ("\n### Temperature 0 (greedy)\n\n```bash\nvllm serve T --speculative-config "
             "'{\"method\": \"eagle3\", \"model\": \"D\", \"num_speculative_tokens\": 3}'\n```\n"
             "\n### Temperature 0.7\n\n```bash\npython -m sglang.launch_server --model T "
             "--speculative-algorithm EAGLE3 --speculative-draft-model-path D "
             "--speculative-num-steps 3 --speculative-eagle-topk 1 "
             "--speculative-num-draft-tokens 4\n```\n")
    c = status(text + tuned)
    assert c.status == WARN and "SGLang command for temperature 0.7" in c.reason
    assert "Temperature 0.7" in c.reason and "--speculative-use-rejection-sampling" in c.reason
    greedy_only = "\n".join(x for x in text.splitlines()
                            if "probabilistic" not in x and "rejection-sampling" not in x)
    c = status(greedy_only)
    assert c.status == WARN and "every serving command in README.md drafts greedily" in c.reason
    (d / "README.md").unlink()
    assert NAME not in {c.name for c in run_checks(d).checks}


def _t1(command: str) -> str:
    """A README whose one serving command is for temperature 1."""
    return f"# D\n\n### Temperature 1\n\n```bash\n{command}\n```\n"


SPEC = '{"method": "eagle3", "model": "D", "num_speculative_tokens": 3%s}'
SAMPLED = ', "draft_sample_method": "probabilistic"'
# every way vLLM's parser (vllm/utils/argparse_utils.py) takes a speculative config, sampled
FORMS = {
    "dash": f"vllm serve T --speculative-config '{SPEC % SAMPLED}'",
    "underscore": f"vllm serve T --speculative_config '{SPEC % SAMPLED}'",
    "equals": f"vllm serve T --speculative-config='{SPEC % SAMPLED}'",
    "short": f"vllm serve T -sc '{SPEC % SAMPLED}'",
    "escaped": "vllm serve T --speculative-config " + (SPEC % SAMPLED).replace(" ", "")
    .replace('"', '\\"'),
    "dotted": "vllm serve T --speculative-config.method eagle3 --speculative_config.model=D "
              "--speculative-config.draft_sample_method probabilistic",
    "spec flags": "vllm serve T --spec-method eagle3 --spec-model D --spec-tokens 3 "
                  "--speculative-config.draft_sample_method=probabilistic",
    "json dashes": f"vllm serve T --speculative-config '{SPEC % SAMPLED.replace('_', '-')}'",
    "continued": f"vllm serve T \\\n  --max-model-len 4096 \\\n  --speculative_config "
                 f"'{SPEC % SAMPLED}'",
}


@pytest.mark.parametrize("form", FORMS)
def test_sampled_drafts_reads_every_form_vllm_takes(good, tmp_path, form):
    """`--speculative_config`, `--speculative-config=`, `-sc`, an escaped bare JSON, dotted keys,
    `--spec-*` flags, dashed keys and a command continued over lines are read as vLLM reads
    them: sampled, the rule passes; the same command drafting greedily warns (it used to pass
    unread)."""
    from drafter.export.readme_check import NAME, commands

    d = copy(good, E.NATIVE, tmp_path)
    text = _t1(FORMS[form])
    (cmd,) = commands(text)
    assert cmd["engine"] == "vLLM" and cmd["temperature"] == 1.0 and cmd["line"] == 6
    assert cmd["samples"] and cmd["refused"] is None, cmd
    assert cmd["config"]["method"] == "eagle3" and str(cmd["config"]["model"]) == "D"
    (d / "README.md").write_text(text)
    c = next(c for c in run_checks(d).checks if c.name == NAME)
    assert c.status == PASS, c.reason
    greedy = text.replace("probabilistic", "greedy")
    (d / "README.md").write_text(greedy)
    c = next(c for c in run_checks(d).checks if c.name == NAME)
    assert c.status == WARN and "the vLLM command for temperature 1 drafts greedily" in c.reason


TYPO = SPEC % ', "draft_sample_method": "probabilistc"'
UNKNOWN = SPEC % ', "draft_sampling_method": "greedy"'
REFUSED = {  # what vLLM would not start: the command, what the warning must say
    "typo": (f"vllm serve T --speculative-config '{TYPO}'", "draft_sample_method='probabilistc'"),
    "unknown key": (f"vllm serve T --speculative_config '{UNKNOWN}'",
                    "unknown key 'draft_sampling_method'"),
    "out of range": ("vllm serve T --speculative-config '{\"method\": \"eagle3\", "
                     "\"num_speculative_tokens\": 0}'", "num_speculative_tokens=0"),
    "bad json": ("vllm serve T --speculative-config '{\"method\": \"eagle3\",}'",
                 "is not a JSON object"),
    "unquoted": ("vllm serve T --speculative-config {\"method\": \"eagle3\"}",
                 "is not a JSON object"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_speculative_config_vllm_refuses_is_reported_as_refused(good, tmp_path, case):
    """A misspelt `draft_sample_method`, an unknown key, a value out of range and JSON the shell
    or json.loads breaks are what vLLM refuses (checked against the installed vLLM's
    SpeculativeConfig): the warning says so, never that the command drafts greedily."""
    import importlib.util

    from drafter.export.readme_check import NAME

    command, want = REFUSED[case]
    if importlib.util.find_spec("vllm") is None and case in ("unknown key", "out of range"):
        pytest.skip("the keys and ranges of its fields are vLLM's to know")
    d = copy(good, E.NATIVE, tmp_path)
    (d / "README.md").write_text(_t1(command))
    c = next(c for c in run_checks(d).checks if c.name == NAME)
    assert c.status == WARN and "vLLM refuses this command's speculative config" in c.reason
    assert want in c.reason and "line 6" in c.reason
    assert "greedily" not in c.reason


def test_refusals_without_vllm_come_from_the_values_drafter_knows(monkeypatch):
    """Without vLLM installed the known literal sets decide: a misspelt draft_sample_method or
    rejection_sample_method is refused; what only vLLM knows is not judged."""
    from drafter.export import readme_check as R

    monkeypatch.setattr(R, "_vllm_fields", lambda: None)
    assert "is not one of 'greedy', 'probabilistic'" in R.refusal(
        {"method": "eagle3", "draft_sample_method": "probabilistc"})
    assert "rejection_sample_method" in R.refusal({"rejection_sample_method": "strict"})
    assert R.refusal({"method": "eagle3", "draft_sample_method": "probabilistic",
                      "anything": 1}) is None


def test_cli_strict_exits_non_zero_on_warnings(good, tiny_target, tmp_path):
    """`drafter check --strict` (a CI gate) exits 1 when a check warns, where plain `drafter
    check` exits 0; a dir with no warning passes both."""
    d = copy(good, E.NATIVE, tmp_path)
    args = (str(d), "--target", str(tiny_target), "--no-smoke", "--json")
    p = _cli(*args, "--strict")
    out = json.loads(p.stdout)
    assert out["strict"] is True and out["counts"]["fail"] == 0, p.stdout
    assert p.returncode == (1 if out["counts"]["warn"] else 0), p.stdout
    text = (d / "README.md").read_text()
    (d / "README.md").write_text(text.replace(',"draft_sample_method":"probabilistic"', ""))
    p = _cli(*args)
    assert p.returncode == 0 and json.loads(p.stdout)["counts"]["warn"] >= 1, p.stdout
    p = _cli(*args, "--strict")
    assert p.returncode == 1, p.stdout + p.stderr
    assert any(c["name"] == "sampled_drafts" and c["status"] == WARN
               for c in json.loads(p.stdout)["checks"])
