"""A target that ships its own model code, shaped like Kimi-K2.5 (tests/remote_code.py: a
KimiK25ForConditionalGeneration wrapper around a tiny DeepSeek-V3 with a vision stub), through
plan -> prepare -> tokenize -> vocab -> extract -> train -> export -> evaluate -> check on the
CPU with
`target.trust_remote_code: true`; without it, one error naming the key, from a fresh process
(transformers registers a remote class for the rest of a process once it has loaded it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from drafter.core import config as C
from drafter.core import target as T
from drafter.core import weights as W
from drafter.core.rundir import Run, read_json
from drafter.export.check import FAIL, PASS, format_report, run_checks
from drafter.run import plan as P
from tests.remote_code import make_kimi_like

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


def write_config(path: Path, run_dir: Path, model: Path, shared_data: Path,
                 trust: bool = True) -> Path:
    path.write_text(yaml.safe_dump({
        "run_dir": str(run_dir),
        "target": {"model": str(model), "trust_remote_code": trust},
        "prepare": {"sources": [{"path": str(shared_data / "train/sharegpt_dummy_conversation"
                                             ".json"), "max_samples": 16}],
                    "val_fraction": 0.25},
        "generate": {"enabled": False},
        "tokenize": {"max_length": 64, "workers": 1},
        "vocab": {"draft_vocab_size": 256},
        "extract": {"shard_tokens": 256, "batch_tokens": 128},
        "train": {"max_length": 64, "batch_tokens": 128, "ttt_steps": 2, "lr": 3e-3,
                  "log_every": 1, "eval_every": 0, "save_every": 1000, "max_steps": 6},
        "export": {"dtype": "float32"},
        "evaluate": {"datasets": [{"name": "humaneval", "path": "builtin:humaneval",
                                   "max_prompts": 2}], "max_new_tokens": 8, "k": 2,
                     "run_recommended": False},
    }))
    return path


@pytest.fixture(scope="module")
def kimi(tmp_path_factory, smollm2_dir) -> Path:
    """The wrapper folder with float32 weights and the SmolLM2 tokenizer; no
    quantization_config here (transformers would act on one and want compressed-tensors' packed
    weights): test_plan.py sizes the quantised form."""
    return make_kimi_like(tmp_path_factory.mktemp("kimi"), tokenizer_dir=smollm2_dir,
                          quantization=None)


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "drafter.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_without_trust_remote_code_the_error_names_the_key(kimi, tmp_path, shared_data):
    cfg = write_config(tmp_path / "cfg.yaml", tmp_path / "run", kimi, shared_data, trust=False)
    p = cli("plan", str(cfg))
    assert p.returncode == 2, p.stdout + p.stderr        # an error the user can act on
    err = p.stderr.strip().splitlines()[-1]
    assert "target.trust_remote_code: true" in err and str(kimi) in err
    assert "Traceback" not in p.stderr


def test_plan_extract_train_export_check_on_a_remote_code_wrapper(kimi, tmp_path, shared_data):
    cfg_path = write_config(tmp_path / "cfg.yaml", tmp_path / "run", kimi, shared_data)
    cfg = C.load(cfg_path)
    run = Run.of(cfg)

    plan = P.make_plan(cfg)
    t = plan["target"]
    model = T.load_model(cfg.target, device="cpu")
    assert type(model).__name__ == "KimiK25ForConditionalGeneration"
    assert t["architecture"] == "KimiK25ForConditionalGeneration"
    assert (t["num_layers"], t["hidden_size"], t["experts"], t["mla"]) == (6, 64, 4, True)
    assert t["params"] == sum(p.numel() for p in model.parameters())     # vision stub included
    assert t["weights_bytes"] == t["params"] * 4                            # float32 on a CPU
    assert t["weights_source"] == "no quantization_config: every weight at 32 bits"
    assert plan["refused"] == []
    assert not run.root.exists()                                            # plan writes nothing

    # every step in a fresh process, where only target.trust_remote_code lets the code run
    p = cli("run", str(cfg_path))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    # evaluate decoded the wrapper (the static-cache decoder found its language model's final
    # norm), plain and speculative, identical in float32
    ev = read_json(run.manifest("evaluate"))
    assert ev["lossless"] is True and ev["counts"]["prompts"] == 2
    ext = read_json(run.manifest("extract"))
    # the capture found the language model's decoder inside the wrapper, and its self-check
    # compared the hooks and the teacher with the wrapper's own forward
    assert ext["info"]["num_layers"] == 6 and ext["info"]["hidden_size"] == 64
    assert ext["self_check"]["tokens"] > 0 and ext["counts"]["tokens"] > 0
    assert read_json(run.manifest("train"))["counts"]["steps"] == 6
    for fmt in ("native", "speculators"):
        r = run_checks(run.export(fmt), str(kimi), smoke=True, trust_remote_code=True)
        acc = next(c for c in r.checks if c.name == "acceptance")
        # the smoke test ran: the wrapper generated, its capture fed the drafter
        assert acc.reason.startswith("step-0 accuracy"), format_report(r)
        assert [c.name for c in r.checks if c.status == FAIL and c.name != "acceptance"] == []
        assert r.status("target") == PASS
    # drafter check from a fresh process: the smoke test needs the flag, and says which
    native = str(run.export("native"))
    p = cli("check", native, "--target", str(kimi), "--json")
    acc = next(c for c in json.loads(p.stdout)["checks"] if c["name"] == "acceptance")
    assert p.returncode == 1 and acc["status"] == FAIL and "--trust-remote-code" in acc["reason"]
    p = cli("check", native, "--target", str(kimi), "--trust-remote-code", "--json")
    acc = next(c for c in json.loads(p.stdout)["checks"] if c["name"] == "acceptance")
    assert acc["reason"].startswith("step-0 accuracy"), p.stdout
    meta = json.loads((run.export("speculators") / "config.json").read_text())
    assert meta["speculators_config"]["verifier"]["architectures"] == [
        "KimiK25ForConditionalGeneration"]
    # the drafter's embeddings came from the wrapper's safetensors (language_model.model.*)
    emb = W.target_embeddings(cfg.target)
    assert torch.equal(emb, model.get_input_embeddings().weight)
