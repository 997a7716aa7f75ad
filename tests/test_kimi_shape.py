"""The Kimi-K2.5 shape benchmarks (benchmarks/kimi_shape.sh) and the decoder and data engine on a
tiny Kimi-K2.5-shaped target (benchmarks/kimi_slice.py's config at --tiny: DeepSeek-V3 with MLA at
Kimi's head sizes, YaRN, a dense first layer, then MoE layers with sigmoid routing).

CPU:
- kimi_plan.py's figures against hand arithmetic from the two config.json files: plan's extract
  rate on the slice, the decoder's active parameters, the per-layer rescaling to Kimi-K2.5, and
  the full plan fed with it;
- benchmarks/kimi-slice.yaml loads as the evaluate run it says it is; the driver refuses what it
  does not know (a real bash subprocess).
GPU (`pytest -m gpu tests/test_kimi_shape.py`; they skip themselves without CUDA):
- plain greedy decoding (drafter.decoding.decode.Decoder, CUDA graphs, left-padded batch) and the
  data engine (drafter.generation.generator.Generator, paged MLA cache) give transformers' own
  `generate`, one prompt at a time, token for token (float32);
- the data engine's greedy answers are the same at two batch sizes (bfloat16, as generate's
  `engine: drafter` runs: other rows, other refills, other prefill chunks in every step).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
STOP = 2  # the tiny config's eos_token_id

def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def _kimi_slice():
    return _bench("kimi_slice")


# ------------------------------------------------------------------------------------- CPU
def _decoder_active(c: dict) -> int:
    """Active parameters per token of the decoder layers and the final norm, by hand: MLA
    (q and kv low-rank projections, their norms, o_proj), the layer's two norms, the dense MLP
    or the router + shared expert + k routed experts."""
    H, nh = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attn = (c["q_lora_rank"] * H + c["q_lora_rank"] + nh * qk * c["q_lora_rank"]
            + (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * H + c["kv_lora_rank"]
            + nh * (c["qk_nope_head_dim"] + c["v_head_dim"]) * c["kv_lora_rank"]
            + H * nh * c["v_head_dim"] + 2 * H)
    dense = 3 * H * c["intermediate_size"]
    moe = c["n_routed_experts"] * H + 3 * H * c["moe_intermediate_size"] * (
        c["n_shared_experts"] + c["num_experts_per_tok"])
    n, k = c["num_hidden_layers"], c["first_k_dense_replace"]
    return n * attn + k * dense + (n - k) * moe + H


def test_kimi_plan_against_hand_arithmetic(tmp_path):
    """A measured extract of the default slice (figures given, no GPU): plan's extract rate is
    mfu x TFLOP/s / (2 x active params), the whole model's rate adds the decoder's time for the
    layers it has more of, and the full plan takes that rate as its configured one."""
    ks, kp = _kimi_slice(), _bench("kimi_plan")
    sl = ks.slice_config(6, 64)
    (tmp_path / "slice").mkdir()
    (tmp_path / "slice" / "config.json").write_text(json.dumps(sl))
    full = json.loads((REPO / "configs/kimi-k2.5/config.json").read_text())
    m = {"model": str(tmp_path / "slice"), "tokens": 131072, "batch_tokens": 16384, "topk": 64,
         "Vd": 32000, "load_s": 40.0, "gpu_memory_gib": 139.8, "decoder_tokens_per_s": 40000.0,
         "options": {"fp8/topk": {"tokens_per_s": 25000.0, "peak_gib": 40.0},
                     "bf16/hidden": {"tokens_per_s": 20000.0, "peak_gib": None}}}
    r = kp.compare(m, str(REPO / "configs/kimi-k2.5"), str(REPO / "configs/plan-kimi-k2.5.yaml"))
    a_slice, a_full = _decoder_active(sl), _decoder_active(full)
    head = sl["vocab_size"] * sl["hidden_size"]                    # lm_head, untied
    assert r["slice"]["params"]["decoder_active"] == a_slice
    assert r["full"]["params"]["decoder_active"] == a_full
    plan_tps = 0.3 * 989e12 / (2 * (a_slice + head))
    o = r["options"]["fp8/topk"]
    assert o["plan_tokens_per_s"] == pytest.approx(plan_tps, rel=1e-9)
    assert o["measured_over_plan"] == pytest.approx(25000 / plan_tps, rel=1e-9)
    assert o["measured_seconds"] == pytest.approx(131072 / 25000)
    per_layer = 1 / (1 / 25000 + (a_full / a_slice - 1) / 40000)
    assert o["full_tokens_per_s_per_layer"] == pytest.approx(per_layer, rel=1e-9)
    assert o["full_tokens_per_s_per_param"] == pytest.approx(
        25000 * (a_slice + head) / (a_full + head), rel=1e-9)
    assert o["peak_over_plan"] == pytest.approx(40.0 / o["plan_gib"])
    assert r["options"]["bf16/hidden"]["peak_over_plan"] is None
    # bf16 weights as the slice's files hold them (routing biases aside) at plan's 2 GB/s
    assert r["load"]["plan_s"] == pytest.approx(ks.sizes(sl)["bytes_bf16"] / 2e9, rel=1e-6)
    fp = r["full_plan"]
    assert fp["rescaled_from"] == "fp8/topk"
    assert fp["rescaled"]["source"] == "config" and fp["estimated"]["source"] == "estimated"
    assert fp["rescaled"]["tokens_per_s"] == pytest.approx(8 * per_layer)   # plan.gpus: 8
    assert "fp8/topk" in kp.render(r)


def test_the_evaluate_config_loads_as_the_run_it_describes(tmp_path):
    """benchmarks/kimi-slice.yaml: the shared data's own answers (no generate), online, 200
    steps, chain and tree at T=0 from batch 1; every data file it names exists."""
    from drafter.core import config as C

    cfg = C.load(REPO / "benchmarks/kimi-slice.yaml", [f"target.model={tmp_path}"])
    assert cfg.target.model == str(tmp_path) and not cfg.generate.enabled
    assert cfg.prepare.require_assistant and cfg.train.online
    assert (cfg.train.max_steps, cfg.train.batch_tokens) == (200, 4096)
    assert cfg.extract.layer_ids == [1, 2, 3]
    assert cfg.evaluate.methods == ["chain", "tree"] and cfg.evaluate.temperatures == [0.0]
    assert cfg.evaluate.tie_tolerance is None              # bf16: ties, then float32 recheck
    data = REPO.parent / "shared" / "data"
    if data.exists():
        for path in [s.path for s in cfg.prepare.sources] + \
                [d.path for d in cfg.evaluate.datasets]:
            assert (REPO / path).resolve().exists(), path


def test_the_driver_refuses_unknown_steps_and_says_its_steps(tmp_path):
    """bash benchmarks/kimi_shape.sh: a step it does not know, or no OUT_DIR, is exit 2 with the
    usage (every step named), before anything runs or is written."""
    for args in (["extract,bogus", str(tmp_path / "out")], ["extract"]):
        r = subprocess.run(["bash", str(REPO / "benchmarks/kimi_shape.sh"), *args],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
        assert r.returncode == 2, r.stdout + r.stderr
        for s in ("pack", "slice", "extract", "train", "evaluate-train", "evaluate", "test"):
            assert f"  {s} " in r.stdout
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------- GPU
@pytest.fixture(scope="module")
def tiny_kimi(tmp_path_factory) -> Path:
    """kimi_slice's tiny config (4 layers, 16 routed experts, 4 per token) as an HF folder with
    transformers' own random init at std 0.2 (at the slice's 0.02 a hidden size of 64 answers
    every prompt with one token repeated, top logits within 0.002: a check of nothing); no
    tokenizer (the tests decode token ids)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    c = _kimi_slice().slice_config(layers=4, experts=16, per_token=4, tiny=True)
    cfg = DeepseekV3Config(**{k: v for k, v in c.items() if k not in ("architectures",
                                                                      "model_type")})
    cfg.initializer_range = 0.2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    out = tmp_path_factory.mktemp("kimi") / "tiny-kimi"
    model.save_pretrained(out)
    return out


def _load(path: Path, dtype: str):
    from drafter.core.config import TargetConfig
    from drafter.core.target import load_model

    return load_model(TargetConfig(model=str(path), dtype=dtype), device="cuda")


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 120, (n,), generator=g).tolist()   # past YaRN's 64 positions too
    return [torch.randint(3, 40000, (k,), generator=g).tolist() for k in lens]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_plain_decoding_and_the_generator_equal_transformers_generate(tiny_kimi):
    """float32: the static decoder (4 prompts left-padded into one batch, CUDA graphs where
    the MoE routing lets them capture) and the paged generator (3 rows: refills) give what
    transformers' generate gives each prompt alone."""
    from drafter.decoding.decode import Decoder
    from drafter.generation.generator import Generator

    model = _load(tiny_kimi, "float32")
    assert type(model).__name__ == "DeepseekV3ForCausalLM" and model.config.kv_lora_rank == 512
    prompts, max_new = _prompts(5), 24
    want = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=STOP, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    assert all(len(set(w)) > 4 for w in want)  # varied answers: a check that can fail
    dec = Decoder(model, max_batch=4)
    got = dec.generate(prompts, max_new, stop_ids=[STOP])
    assert [o.tokens for o in got] == want    # graphed, or eager where a capture fell back
    eng = Generator(model, max_batch=3, cuda_graphs=True, sync_every=2)
    res = eng.generate(prompts, max_new, stop_ids=[STOP])
    assert [r.tokens for r in res] == want
    assert eng.cache.gather                               # MLA: the gathered latent cache


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_generator_answers_are_the_same_at_two_batch_sizes(tiny_kimi):
    """bfloat16, as the generate step runs the generator: 24 prompts at batch 32 (one admission,
    one prefill) and at batch 8 (refills as rows end, other prompts sharing every step and
    prefill chunk) give the same greedy answers token for token."""
    from drafter.generation.generator import Generator

    model = _load(tiny_kimi, "bfloat16")
    prompts = _prompts(24, seed=1)
    max_new = [16 + 7 * (i % 5) for i in range(len(prompts))]  # rows end at different steps
    runs = {}
    for batch in (32, 8):
        eng = Generator(model, max_batch=batch, cuda_graphs=True)
        runs[batch] = eng.generate(prompts, max_new, stop_ids=[STOP])
        assert eng.last["requests"] == len(prompts)
    assert [r.tokens for r in runs[32]] == [r.tokens for r in runs[8]]
    assert [r.finish for r in runs[32]] == [r.finish for r in runs[8]]
    assert sum(len(r.tokens) for r in runs[8]) > len(prompts)
