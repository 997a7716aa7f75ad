"""Drafters for MLA targets (DeepSeek-V3, Kimi-K2.5) and the RoPE the engines read: the head size
and RoPE a drafter takes from an MLA config, the `rope_engines` and `aux_ids.order` rules of
`drafter check` on real export dirs, and the real vLLM (its CPU build) computing the same logits
as drafter's own model for a drafter trained against a tiny DeepSeek-V3 with DeepSeek's YaRN.
The vLLM tests skip themselves where vLLM is not installed."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from drafter.export import engines as E
from drafter.export.check import FAIL, PASS, WARN, format_report, run_checks
from drafter.train.model import Drafter, DrafterConfig, rope_problem

# Kimi-K2.5's language model (a DeepSeek-V3 text config)
KIMI = dict(vocab_size=163840, hidden_size=7168, intermediate_size=18432,
            moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64,
            num_key_value_heads=64, n_routed_experts=384, n_shared_experts=1,
            num_experts_per_tok=8, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=1536,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            max_position_embeddings=262144, rope_theta=50000.0,
            rope_scaling={"type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                          "beta_fast": 1.0, "beta_slow": 1.0,
                          "original_max_position_embeddings": 4096})
# A tiny DeepSeek-V3 with DeepSeek's YaRN: v_head_dim (32) differs from the rope part of a query
# (8), from qk_nope + qk_rope (16) and from H / heads (16), so the drafter's head size shows.
DEEPSEEK_YARN = {"type": "yarn", "factor": 16.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                 "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 64}
TINY_MLA = dict(num_hidden_layers=8, v_head_dim=32, rope_theta=50000.0,
                rope_scaling=DEEPSEEK_YARN, max_position_embeddings=1024)
IDS = [2, 4, 5]  # [2, N//2, N-3] for the 8 layers


# ------------------------------------------------------------------------ shape and RoPE chosen
def test_kimi_drafter_has_full_heads_and_plain_rope_at_the_targets_theta():
    from transformers import DeepseekV3Config

    tc = DeepseekV3Config(**{**KIMI, "rope_scaling": dict(KIMI["rope_scaling"])})
    assert tc.head_dim == 64  # transformers' head_dim of an MLA config: the rope part only
    c = DrafterConfig.from_target(tc, 32000, E.default_layer_ids(tc.num_hidden_layers))
    # SpecForge's published Kimi-K2.5 drafter (configs/kimi-k25-eagle3.json) has this shape
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size, c.draft_vocab_size) == (7168, 18432, 64, 64, 128, 163840,
                                                              32000)
    assert c.rope_scaling is None and c.rope_theta == 50000.0
    assert c.aux_layer_ids == [2, 30, 58]


def test_auto_picks_an_mla_layer_for_kimi_with_its_latent_sizes_and_rope():
    """train.draft_layer auto: the MLA layer for an MLA target, its sizes and DeepSeek's YaRN
    the target's, its score scale DeepSeek's; at Kimi-K2.5's shape its attention holds 116M
    parameters against the Llama layer's 411M (docs/train.md)."""
    from transformers import DeepseekV3Config, LlamaConfig

    from drafter.train.memory import attention_values
    from drafter.train.mla import softmax_scale
    from drafter.train.model import draft_layer_for

    tc = DeepseekV3Config(**{**KIMI, "rope_scaling": dict(KIMI["rope_scaling"])})
    assert draft_layer_for("auto", tc) == "mla" and draft_layer_for("llama", tc) == "llama"
    assert draft_layer_for("auto", LlamaConfig()) == "llama"
    ids = E.default_layer_ids(61)
    c = DrafterConfig.from_target(tc, 32000, ids, draft_layer="mla")
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
            c.v_head_dim, c.rope_dim) == (1536, 512, 128, 64, 128, 64)
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["mscale_all_dim"] == 1.0
    assert math.isclose(softmax_scale(c), 192 ** -0.5 * (0.1 * math.log(64) + 1) ** 2)
    over = DrafterConfig.from_target(tc, 32000, ids, draft_layer="mla", mla={"q_lora_rank": 768})
    assert over.q_lora_rank == 768 and over.kv_lora_rank == 512
    llama = DrafterConfig.from_target(tc, 32000, ids)
    with torch.device("meta"):
        attn = {k: sum(p.numel() for p in Drafter(x).midlayer.self_attn.parameters())
                for k, x in (("mla", c), ("llama", llama))}
    assert round(attn["mla"] / 1e6) == 116 and round(attn["llama"] / 1e6) == 411
    # the plan's activations of the attention: latents and expanded heads, against 4 H
    assert attention_values(c) == 1536 + 512 + 64 + 2 * 64 * 192 + 2 * 64 * 128
    assert attention_values(llama) == 4 * 7168
    with pytest.raises(ValueError, match="not an MLA target"):
        DrafterConfig.from_target(LlamaConfig(), 100, [1, 2, 3], draft_layer="mla")


def test_scalings_every_engine_computes_alike_are_kept():
    from transformers import LlamaConfig, Qwen3Config

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    q = Qwen3Config(num_hidden_layers=8, head_dim=128, rope_theta=1e6, rope_scaling=dict(yarn))
    assert DrafterConfig.from_target(q, 1000, IDS).rope_scaling == yarn
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    ll = LlamaConfig(num_hidden_layers=8, rope_parameters={**llama3, "rope_theta": 5e5})
    c = DrafterConfig.from_target(ll, 1000, IDS)
    assert c.rope_scaling == llama3 and c.rope_theta == 5e5 and c.head_dim == 128


@pytest.mark.parametrize("scaling, names", [
    (KIMI["rope_scaling"], ["mscale and mscale_all_dim", "1.416", "x 2.00"]),
    ({"rope_type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0}, ["mscale_all_dim"]),
    ({**KIMI["rope_scaling"], "type": "deepseek_yarn"}, ["'deepseek_yarn'"]),
    ({"rope_type": "yarn", "factor": 8.0, "attention_factor": 1.0}, ["attention_factor 1.0"]),
    ({"rope_type": "yarn", "factor": 8.0, "attn_factor": 0.5}, ["attn_factor"]),
    ({"rope_type": "mrope_weird", "factor": 2.0}, ["'mrope_weird'", "llama3"]),
])
def test_rope_problem_names_the_key(scaling, names):
    why = rope_problem(scaling)
    assert why is not None and all(n in why for n in names), why


@pytest.mark.parametrize("scaling", [
    None, {"rope_type": "default"}, {"type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096},
    # the value every engine computes anyway: 0.1·ln(8)+1
    {"rope_type": "yarn", "factor": 8.0, "attention_factor": 0.1 * math.log(8.0) + 1.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
])
def test_portable_scalings_have_no_problem(scaling):
    assert rope_problem(scaling) is None


# ----------------------------------------------------- the Kimi slice and the benchmark's shape
REPO = Path(__file__).resolve().parents[1]


def _bench_module(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_kimi_slice_sizes_and_the_benchmark_shape_are_the_drafters():
    """--dry-run (a real subprocess): the default slice is Kimi-K2.5's sizes at 6 layers and 64
    experts, about 18B parameters and 35 GB of bf16; the drafter shaped from it is the
    `--shape kimi` of benchmarks/train_throughput.py."""
    import subprocess
    import sys

    from transformers import DeepseekV3Config

    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kimi_slice.py"), "--dry-run"],
                       capture_output=True, text=True, timeout=120, check=True)
    head, cfg = r.stdout.split("\n", 1)
    assert "6 layers, 64 routed experts (8 per token)" in head, head
    params = float(head.split("tensors, ")[1].split("B params")[0])
    gb = float(head.split("params, ")[1].split(" GB")[0])
    assert 17.0 < params < 18.5 and 34.0 < gb < 37.0, head
    cfg = json.loads(cfg)
    assert {k: cfg[k] for k in ("hidden_size", "vocab_size", "q_lora_rank", "kv_lora_rank",
                                "num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                "v_head_dim", "intermediate_size", "moe_intermediate_size",
                                "n_shared_experts", "first_k_dense_replace")} == \
        {k: KIMI[k] for k in ("hidden_size", "vocab_size", "q_lora_rank", "kv_lora_rank",
                              "num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                              "v_head_dim", "intermediate_size", "moe_intermediate_size",
                              "n_shared_experts", "first_k_dense_replace")}
    assert cfg["rope_scaling"] == KIMI["rope_scaling"] and cfg["rope_theta"] == 50000.0
    c = DrafterConfig.from_target(DeepseekV3Config(**cfg), 32000, IDS)
    shape = _bench_module("train_throughput").SHAPES["kimi"]
    assert {k: v for k, v in shape.items() if k not in ("batch", "seq", "ttt")} == \
        {k: getattr(c, k) for k in shape if k not in ("batch", "seq", "ttt")}
    assert (shape["seq"], shape["draft_vocab_size"]) == (4096, 32000)


def test_tiny_kimi_slice_loads_as_a_target(tmp_path, smollm2_dir):
    """The writer at a tiny size (a real subprocess, CPU): an HF folder that drafter's target
    loader reads with no missing or unexpected tensor, the DeepSeek YaRN config intact, whose
    aux states the capture takes."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from drafter.core import target as T
    from drafter.core.config import TargetConfig
    from drafter.features.capture import Capture

    out = tmp_path / "slice"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "kimi_slice.py"), str(out),
                    "--tiny", "--layers", "4", "--experts", "4", "--shard-gb", "0.004"],
                   capture_output=True, text=True, timeout=300, check=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in index["weight_map"]
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tcfg = TargetConfig(model=str(out))
    model = T.load_model(tcfg, device="cpu")
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert model.config.rope_parameters["mscale_all_dim"] == 1.0
    assert (model.config.num_hidden_layers, model.config.n_routed_experts) == (4, 4)
    ids = T.load_tokenizer(tcfg)("a slice of Kimi", add_special_tokens=False)["input_ids"]
    d2t, t2d = torch.zeros(256, dtype=torch.long), torch.zeros(49152, dtype=torch.bool)
    t2d[:256] = True
    got = Capture(model, [1, 2, 3], d2t, t2d, teacher="hidden",
                  out_dtype=torch.float32)([{"input_ids": ids, "loss_mask": [1] * len(ids)}])
    assert got[0]["aux"].shape == (len(ids), 3, 64) and got[0]["aux"].abs().sum() > 0


# ------------------------------------------------------------------ `drafter check` on real dirs
@pytest.fixture(scope="module")
def mla_target(tmp_path_factory) -> Path:
    from tiny import make_tiny

    # transformers fills in the dict it is given: pass a copy
    return make_tiny("deepseek_v3", tmp_path_factory.mktemp("mla"),
                     **{**TINY_MLA, "rope_scaling": dict(DEEPSEEK_YARN)})


def drafter_for(target: Path, seed: int = 0, **overrides) -> Drafter:
    from transformers import AutoConfig

    c = DrafterConfig.from_target(AutoConfig.from_pretrained(target), 256,
                                  overrides.pop("aux_layer_ids", IDS), **overrides)
    torch.manual_seed(seed)
    return Drafter(c).eval()


def export(m: Drafter, target: Path, root: Path, fmt: str = E.NATIVE,
           dtype=torch.bfloat16) -> Path:
    out = root / fmt
    out.mkdir(parents=True)
    E.write_dir(m, out, fmt, target=E.target_info(str(target)), dtype=dtype, final_dir=out)
    return out


@pytest.mark.parametrize("fmt", E.FORMATS)
def test_mla_drafter_export_passes_every_check(mla_target, tmp_path, fmt):
    m = drafter_for(mla_target)
    assert m.cfg.head_dim == 32 and m.cfg.rope_scaling is None and m.cfg.rope_theta == 50000.0
    t = E.target_info(str(mla_target))
    assert t.rope_theta == 50000.0 and t.rope_scaling["mscale_all_dim"] == 1.0
    d = export(m, mla_target, tmp_path, fmt)
    r = run_checks(d, str(mla_target))
    assert [c for c in r.checks if c.status not in (PASS, "skip")] == [], format_report(r)
    assert {"rope", "rope_engines", "aux_ids.order"} <= {c.name for c in r.checks}
    assert "plain, at the target's theta" in next(c.reason for c in r.checks if c.name == "rope")


@pytest.mark.parametrize("fmt", E.FORMATS)
def test_deepseek_yarn_copied_into_a_llama_layer_fails(mla_target, tmp_path, fmt):
    """The old derivation (the target's YaRN block verbatim): the scaling equals the target's,
    so `rope` passes, and `rope_engines` fails it, naming the keys and the fix."""
    t = E.target_info(str(mla_target))
    m = drafter_for(mla_target, rope_scaling=dict(t.rope_scaling))
    r = run_checks(export(m, mla_target, tmp_path, fmt), str(mla_target))
    assert r.status("rope") == PASS and r.status("rope_engines") == FAIL, format_report(r)
    why = next(c.reason for c in r.checks if c.name == "rope_engines")
    assert "mscale and mscale_all_dim" in why and "plain RoPE" in why and "rope_theta" in why


def _edit(d: Path, fn) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg.get("transformer_layer_config", cfg))
    (d / "config.json").write_text(json.dumps(cfg))


def test_deepseek_rope_types_and_keys_fail_in_either_spelling(mla_target, tmp_path):
    d = export(drafter_for(mla_target), mla_target, tmp_path)
    ds = {**DEEPSEEK_YARN, "type": "deepseek_yarn"}

    def only_parameters(b):  # transformers 5 spelling only; the legacy key says nothing
        b["rope_scaling"] = None
        b["rope_parameters"] = {**ds, "rope_theta": 50000.0}
    _edit(d, only_parameters)
    r = run_checks(d, str(mla_target))
    assert r.status("rope_engines") == FAIL and "'deepseek_yarn'" in format_report(r)
    assert r.status("rope") == FAIL  # and the two spellings disagree
    _edit(d, lambda b: b.update(rope_scaling=dict(ds), rope_parameters={**ds,
                                                                        "rope_theta": 50000.0}))
    assert run_checks(d, str(mla_target)).status("rope_engines") == FAIL


def test_yarn_without_truncation_warns(tiny_target, tmp_path):
    from test_engines import make_drafter

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    d = export(make_drafter(tiny_target, rope_scaling=yarn), tiny_target, tmp_path)
    r = run_checks(d)
    assert r.status("rope_engines") == WARN and "truncate" in format_report(r)


def test_a_published_kimi_style_drafter_only_warns_on_its_own_theta(mla_target, tmp_path):
    """SpecForge's Kimi-K2.5 drafter: plain RoPE at theta 1e6 for a target at 50000 with
    DeepSeek's YaRN. No drafter can take that target's RoPE, so another theta warns."""
    d = export(drafter_for(mla_target, rope_theta=1e6), mla_target, tmp_path)
    (d / "drafter.json").unlink()
    r = run_checks(d, str(mla_target))
    assert r.status("rope") == WARN and r.status("rope_engines") == PASS and r.ok


@pytest.mark.parametrize("ids, words", [([4, 2, 5], ["not ascending", "[2, 4, 5]", "permute"]),
                                        ([2, 5, 5], ["repeats [5]", "2 states"])])
def test_aux_ids_unsorted_or_repeated_fail(tiny_target, tmp_path, ids, words):
    """Trained in this order, but vLLM and SGLang hand the states over in layer order, once
    each: the fc weight's column blocks would meet other layers."""
    from test_engines import make_drafter

    for fmt in E.FORMATS:
        d = export(make_drafter(tiny_target, aux_layer_ids=ids), tiny_target, tmp_path / fmt, fmt)
        r = run_checks(d, str(tiny_target))
        assert r.status("aux_ids.order") == FAIL, format_report(r)
        why = next(c.reason for c in r.checks if c.name == "aux_ids.order")
        assert all(w in why for w in words), why
    # a published dir whose only ids are SGLang's (eagle_config, output-of-layer meaning)
    d = tmp_path / E.NATIVE / E.NATIVE
    (d / "drafter.json").unlink()
    _edit(d, lambda b: (b.pop("eagle_aux_hidden_state_layer_ids"),
                        b["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[3, 1, 4])))
    r = run_checks(d, str(tiny_target))
    assert r.status("aux_ids.order") == FAIL and "eagle_config" in format_report(r)


# ------------------------------------------------------------- the real vLLM against our model
def _vocab_map(model, samples: list[list[int]], Vd: int, V: int):
    """The draft vocab as the vocab step builds it, from the target's own predictions: its
    most frequent argmax tokens, padded, sorted; -> (d2t, t2d)."""
    with torch.no_grad():
        top = torch.cat([model(torch.tensor([s])).logits[0].argmax(-1) for s in samples])
    ids = torch.bincount(top, minlength=V).argsort(descending=True)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(Vd), t2d


def train_briefly(target: Path, steps: int = 8) -> tuple[Drafter, list[float]]:
    """A drafter for `target` trained a few steps the way train does (capture, batches, the
    TTT loss), in float32 on the CPU. -> (drafter, losses)."""
    from transformers import AutoModelForCausalLM

    from drafter.features.capture import Capture
    from drafter.train.batches import Source, device_batch, host_batch, model_inputs
    from drafter.train.ttt import TTT

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    seqs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (48, 40, 56, 32)]
    d2t, t2d = _vocab_map(model, seqs, 256, V)
    drafter = drafter_for(target)
    drafter.set_embeddings(model.get_input_embeddings().weight)
    drafter.set_vocab(d2t, t2d)
    cap = Capture(model, drafter.cfg.aux_layer_ids, d2t, t2d, teacher="hidden",
                  out_dtype=torch.float32)
    src = Source.memory(cap([{"input_ids": s, "loss_mask": [1] * len(s)} for s in seqs]))
    tc = SimpleNamespace(method="eagle3", ttt_steps=3, ttt_decay=0.8)
    batch = device_batch(host_batch(src, [[i] for i in range(len(src))], len(src),
                                    max(src.lengths), tc, drafter.embed_tokens.weight),
                         torch.device("cpu"), cap.head, fused=False)
    ttt = TTT(drafter.train(), attention="sdpa")
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = ttt(**model_inputs(batch))["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return drafter.eval(), losses


class VllmDrafter:
    """vLLM's own EAGLE-3 Llama drafter class (model_executor/models/llama_eagle3.py), built
    from an export dir with a VllmConfig and loaded by its own weight loader; `logits` runs its
    layers (fc, norms, qkv, rotary embedding, o_proj, MLP, lm_head, d2t) with causal softmax
    attention at the layer's own scale in place of the paged-attention op, which needs a
    scheduler's metadata. -> logits over the target vocab, -inf outside the draft vocab."""

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
        from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

        mc = ModelConfig(model=str(target), dtype="float32", max_model_len=512,
                         enforce_eager=True)
        sc = SpeculativeConfig(method="eagle3", model=str(export_dir), num_speculative_tokens=1,
                               target_model_config=mc, target_parallel_config=ParallelConfig())
        self.vc = VllmConfig(model_config=mc, speculative_config=sc)
        with set_current_vllm_config(self.vc):
            self.model = Eagle3LlamaForCausalLM(vllm_config=self.vc)
            self.model.load_weights(load_file(str(export_dir / "model.safetensors")).items())
            process_weights_after_loading(self.model, sc.draft_model_config, torch.device("cpu"))

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, aux: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids [T], aux [T, 3·Ht], pos [T] -> [T, V]."""
        import torch.nn.functional as F
        from vllm.config import set_current_vllm_config

        vm, T = self.model, ids.shape[0]
        with set_current_vllm_config(self.vc):
            layer = vm.model.layers[0]
            a = layer.self_attn
            emb = layer.input_layernorm(vm.model.embed_input_ids(ids))
            h, residual = layer._residual_norm(hidden_states=vm.combine_hidden_states(aux))
            qkv, _ = a.qkv_proj(torch.cat([emb, h], -1))                     # [T, (nh+2nkv)hd]
            q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
            q, k = a.rotary_emb(pos, q, k)
            nh, nkv, hd = a.num_heads, a.num_kv_heads, a.head_dim
            o = F.scaled_dot_product_attention(
                q.view(T, nh, hd).transpose(0, 1), k.view(T, nkv, hd).transpose(0, 1),
                v.view(T, nkv, hd).transpose(0, 1), is_causal=True, scale=a.scaling,
                enable_gqa=nh != nkv)                                           # [nh, T, hd]
            o, _ = a.o_proj(o.transpose(0, 1).reshape(T, nh * hd))              # [T, H]
            h, residual = layer.post_attention_layernorm(o, residual)
            h, _ = vm.model.norm(layer.mlp(h), residual)
            return vm.compute_logits(h)                                         # [T, V]


@pytest.fixture(scope="module")
def vllm_world(tmp_path_factory):
    """vLLM's single-process distributed state (one rank, gloo, a file rendezvous), torn down
    after the module."""
    pytest.importorskip("vllm")
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


def _ours(m: Drafter, ids, aux, pos) -> torch.Tensor:
    with torch.no_grad():
        _, logits, _ = m(ids[None], m.fuse(aux.view(1, ids.shape[0], 3, -1)), pos[None])
    return logits[0]                                                            # [T, Vd]


def _inputs(c: DrafterConfig, T: int = 24, start: int = 300):
    g = torch.Generator().manual_seed(7)
    aux = torch.randn(T, 3 * c.target_hidden_size, generator=g)
    # positions past the target's original context (64): where its YaRN interpolates
    return torch.randint(0, c.vocab_size, (T,), generator=g), aux, torch.arange(T) + start


def test_vllm_computes_the_trained_mla_drafters_logits(vllm_world, mla_target, tmp_path):
    m, losses = train_briefly(mla_target)
    assert losses[-1] < losses[0] - 0.1, losses
    d = export(m, mla_target, tmp_path, dtype=torch.float32)
    assert run_checks(d, str(mla_target)).ok
    vm = VllmDrafter(mla_target, d)
    a = vm.model.model.layers[0].self_attn
    assert a.head_dim == 32 and math.isclose(a.scaling, 32 ** -0.5)
    ids, aux, pos = _inputs(m.cfg)
    ours = _ours(m, ids, aux, pos)
    theirs = vm.logits(ids, aux, pos)[:, torch.arange(m.cfg.draft_vocab_size) + m.d2t]
    # the same float32 arithmetic: far inside the 1e-2 a served drafter could differ by unseen
    assert ours.abs().max() > 0.3 and (theirs - ours).abs().max() < 1e-4, \
        (theirs - ours).abs().max()
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


def test_engines_that_ignore_mscale_score_a_copied_deepseek_block_differently(
        vllm_world, mla_target, tmp_path):
    """Why `rope_engines` fails a copied DeepSeek YaRN block: the installed vLLM reads it as
    training does, but an engine that ignores mscale / mscale_all_dim (vLLM's single-file
    rotary_embedding.py, SGLang before 2026) computes exactly vLLM's `yarn` without those keys:
    cos and sin x (0.1·ln(factor)+1), other logits."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    t = E.target_info(str(mla_target))
    m = drafter_for(mla_target, seed=3, rope_scaling=dict(t.rope_scaling))
    with torch.no_grad():
        for p in m.parameters():
            if p.requires_grad and p.dim() == 2:
                p.mul_(10.0)  # attention far from uniform: a score scale shows in the logits
    d = export(m, mla_target, tmp_path, dtype=torch.float32)
    vm = VllmDrafter(mla_target, d)
    ids, aux, pos = _inputs(m.cfg)
    ours = _ours(m, ids, aux, pos)
    sel = torch.arange(m.cfg.draft_vocab_size) + m.d2t
    assert (vm.logits(ids, aux, pos)[:, sel] - ours).abs().max() < 1e-2
    a = vm.model.model.layers[0].self_attn
    params = {k: v for k, v in vm.model.config.rope_parameters.items()
              if k not in ("mscale", "mscale_all_dim")}
    with set_current_vllm_config(vm.vc):
        old = get_rope(a.head_dim, max_position=m.cfg.max_position_embeddings,
                       rope_parameters=params, is_neox_style=True, dtype=torch.float32)
    scale = 0.1 * math.log(DEEPSEEK_YARN["factor"]) + 1.0
    n = a.rotary_emb.cos_sin_cache.shape[0]
    assert torch.allclose(old.cos_sin_cache[:n], a.rotary_emb.cos_sin_cache * scale, atol=1e-5)
    a.rotary_emb = old
    assert (vm.logits(ids, aux, pos)[:, sel] - ours).abs().max() > 0.1


# ------------------------------------------------------------- the MLA draft layer's export dir
def test_mla_layer_exports_native_only_and_its_rules_hold(tmp_path):
    """An MLA drafter over a target's whole vocab: the native dir as vLLM's and SGLang's
    Eagle3DeepseekV2ForCausalLM read it passes every check; without d2t (vLLM's MLA class has
    no draft_id_to_target_id then and refuses one); a d2t added fails, a deepseek_v3
    model_type fails (vLLM reads it as DeepSeek's MTP), a latent no MLA backend takes fails."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config

    from drafter.export.enginedir import load_drafter_dir

    tc = DeepseekV3Config(vocab_size=300, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=2,
                          q_lora_rank=16, kv_lora_rank=512, qk_nope_head_dim=8,
                          qk_rope_head_dim=64, v_head_dim=16, max_position_embeddings=1024,
                          rope_theta=50000.0, rope_scaling=dict(DEEPSEEK_YARN))
    (tmp_path / "t").mkdir()
    tc.save_pretrained(tmp_path / "t")
    target = str(tmp_path / "t" / "config.json")
    torch.manual_seed(0)
    m = Drafter(DrafterConfig.from_target(tc, 300, IDS, draft_layer="mla")).eval()
    assert E.formats_for(m.cfg) == (E.NATIVE,)
    d = tmp_path / "native"
    d.mkdir()
    E.write_dir(m, d, E.NATIVE, target=E.target_info(target), dtype=torch.float32, final_dir=d)
    r = run_checks(d, target)
    assert [c for c in r.checks if c.status not in (PASS, "skip")] == [], format_report(r)
    assert r.status("mla") == PASS and "aux_ids.llama_cpp" not in {c.name for c in r.checks}
    sd = load_file(str(d / "model.safetensors"))
    assert "d2t" not in sd and "midlayer.self_attn.kv_b_proj.weight" in sd
    back = load_drafter_dir(d, dtype=torch.float32)
    ids, h, pos = torch.randint(0, 300, (1, 7)), torch.randn(1, 7, 32), torch.arange(7)[None] + 90
    assert back.cfg == m.cfg and torch.equal(back(ids, h, pos)[1], m(ids, h, pos)[1])
    save_file({**sd, "d2t": torch.zeros(300, dtype=torch.long)}, str(d / "model.safetensors"))
    assert run_checks(d, target).status("d2t") == FAIL
    save_file(sd, str(d / "model.safetensors"))
    _edit(d, lambda b: b.update(model_type="deepseek_v3"))
    r = run_checks(d, target)
    assert r.status("format") == FAIL and "MTP" in format_report(r)
    _edit(d, lambda b: b.update(model_type="deepseek_v2", kv_lora_rank=256))   # 320: GPU only
    assert run_checks(d, target).status("mla") == WARN
    _edit(d, lambda b: b.update(kv_lora_rank=100))
    assert run_checks(d, target).status("mla") == FAIL
