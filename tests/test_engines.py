"""The engine layouts (ENGINES.md is the contract): layer ids in each engine's meaning, the exact
keys, tensor names, shapes and dtypes of native/ and speculators/, the README commands, and the
round trip: a drafter reloaded from either dir gives bit-identical logits to the trained one."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafter.export import engines as E
from drafter.export.enginedir import load_drafter_dir, read_dir
from drafter.train.model import Drafter, DrafterConfig

# tiny_target's layers (conftest.py): default aux ids [2, 4, 5], in SpecForge's output-of-layer
# spelling [1, 3, 4]
N_LAYERS = 8
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


# ------------------------------------------------------------------------------------ helpers
def make_drafter(target_dir: Path, seed: int = 0, draft_vocab: int = 512, **overrides) -> Drafter:
    """A drafter shaped for the target, with every weight random (norms too) and a real vocab
    map, so that any mix-up of names, norms or ids changes its logits."""
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(target_dir)
    ids = overrides.pop("aux_layer_ids", E.default_layer_ids(tc.num_hidden_layers))
    c = DrafterConfig.from_target(tc, draft_vocab_size=draft_vocab, aux_layer_ids=ids,
                                  **overrides)
    torch.manual_seed(seed)
    m = Drafter(c)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n or n.startswith("fc_norm"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    g = torch.Generator().manual_seed(seed)
    targets = torch.sort(torch.randperm(c.vocab_size, generator=g)[:draft_vocab]).values
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[targets] = True
    m.set_vocab(targets - torch.arange(draft_vocab), t2d)
    return m.eval()


def draft_logits(m: Drafter, seed: int = 1, T: int = 6) -> list[torch.Tensor]:
    """Logits of a prefill pass and of one drafting step that feeds back the drafter's own state
    through the KV cache (the inference path the engines run)."""
    c = m.cfg
    g = torch.Generator().manual_seed(seed)
    dtype = next(m.parameters()).dtype
    aux = torch.randn(1, T, len(c.aux_layer_ids), c.target_hidden_size, generator=g).to(dtype)
    ids = torch.randint(0, c.vocab_size, (1, T), generator=g)
    pos = torch.arange(T)[None]
    with torch.no_grad():
        h, logits0, kv = m(ids, m.fuse(aux), pos)
        nxt = m.to_target_ids(logits0[:, -1:].argmax(-1))                     # [1, 1]
        _, logits1, _ = m(nxt, m.feedback(h[:, -1:]), pos[:, -1:] + 1, past_kv=kv)
    return [logits0, logits1]


def write(m: Drafter, root: Path, fmt: str, target: E.TargetInfo, **kw) -> Path:
    out = root / fmt
    out.mkdir(parents=True)
    E.write_dir(m, out, fmt, target=target, **kw)
    return out


# ---------------------------------------------------------------------------------- layer ids
def test_layer_id_meanings():
    N = 61  # Kimi-K2.5
    hs = E.default_layer_ids(N)
    assert hs == [2, 30, 58]
    # SpecForge / ModelOpt spell the same tensors [1, N//2-1, N-4] (output of layer k = HS[k+1])
    assert E.from_hs(hs, "specforge") == E.from_hs(hs, "modelopt") == [1, 29, 57]
    assert E.from_hs(hs, "sglang") == [1, 29, 57]          # explicit ids get +1 in SGLang
    assert E.from_hs(hs, "vllm") == E.from_hs(hs, "llama_cpp") == E.from_hs(hs, "drafter") == hs
    for m in ("sglang", "specforge", "vllm", "hs", "layer_output"):
        assert E.to_hs(E.from_hs([3, 7, 11], m), m) == [3, 7, 11]
    with pytest.raises(E.EngineDirError, match="embeddings"):
        E.from_hs([0, 5, 9], "sglang")                      # HS[0] is no layer's output


def test_engine_layer_id_resolution():
    ids = [2, 4, 5]
    both = {"eagle_aux_hidden_state_layer_ids": ids,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}
    r = E.engine_layer_ids(E.NATIVE, both)
    assert r["vllm"][0] == ids and r["sglang"][0] == ids     # each reads the trained layers
    assert r["llama_cpp"][0] is None                         # recomputed from the target
    # vLLM: top-level first, else eagle_config (read as HS); SGLang: only eagle_config, +1
    only_nested = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}
    r = E.engine_layer_ids(E.NATIVE, only_nested)
    assert r["vllm"][0] == [1, 3, 4] and r["sglang"][0] == [2, 4, 5]
    r = E.engine_layer_ids(E.NATIVE, {"eagle_aux_hidden_state_layer_ids": [3, 4, 5]})
    assert r["vllm"][0] == [3, 4, 5] and r["sglang"][0] is None   # SGLang: default
    r = E.engine_layer_ids(E.NATIVE, {})
    assert r["vllm"][0] is None and r["sglang"][0] is None
    r = E.engine_layer_ids(E.SPECULATORS, {"eagle_aux_hidden_state_layer_ids": ids})
    assert r["vllm"][0] == ids and "sglang" not in r


# ----------------------------------------------------------------------------- exact layouts
def test_native_layout_is_exactly_the_contract(tiny_target, tmp_path):
    m = make_drafter(tiny_target, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, intermediate_size=80)             # H=32 != Ht=64
    t = E.target_info(str(tiny_target))
    d = write(m, tmp_path, E.NATIVE, t, dtype=torch.bfloat16, max_position_embeddings=4096)
    cfg = json.loads((d / "config.json").read_text())
    c = m.cfg
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "hidden_act", "rms_norm_eps", "draft_vocab_size", "target_hidden_size"):
        assert cfg[k] == getattr(c, k), k
    assert cfg["vocab_size"] == t.vocab_size == c.vocab_size      # the target's vocab
    assert cfg["target_hidden_size"] == 64 != cfg["hidden_size"]
    assert cfg["rope_theta"] == c.rope_theta and cfg["rope_scaling"] is None
    assert cfg["max_position_embeddings"] == 4096
    assert cfg["tie_word_embeddings"] is False
    assert cfg["torch_dtype"] == "bfloat16"
    for flag in E.NORM_FLAGS:
        assert cfg[flag] is False, flag                           # every flag written out
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4],
                                   "use_aux_hidden_state": True}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]

    sd = load_file(str(d / "model.safetensors"))
    H, Ht, I, V, Vd = 32, 64, 80, t.vocab_size, 512
    nh, nkv, hd = 4, 2, 8
    want = {
        "fc.weight": [H, 3 * Ht],
        "midlayer.self_attn.q_proj.weight": [nh * hd, 2 * H],
        "midlayer.self_attn.k_proj.weight": [nkv * hd, 2 * H],
        "midlayer.self_attn.v_proj.weight": [nkv * hd, 2 * H],
        "midlayer.self_attn.o_proj.weight": [H, nh * hd],
        "midlayer.mlp.gate_proj.weight": [I, H], "midlayer.mlp.up_proj.weight": [I, H],
        "midlayer.mlp.down_proj.weight": [H, I],
        "midlayer.input_layernorm.weight": [H], "midlayer.hidden_norm.weight": [H],
        "midlayer.post_attention_layernorm.weight": [H],
        "norm.weight": [H], "lm_head.weight": [Vd, H], "d2t": [Vd], "t2d": [V],
        "embed_tokens.weight": [V, H],                           # required: H != Ht
    }
    assert {k: list(v.shape) for k, v in sd.items()} == want      # nothing more, nothing less
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert all(v.dtype == torch.bfloat16 for k, v in sd.items() if k not in ("d2t", "t2d"))
    tgt = torch.arange(Vd) + sd["d2t"]                            # offsets, sorted unique
    assert bool((tgt[1:] > tgt[:-1]).all()) and set(tgt.tolist()) == \
        set(torch.nonzero(sd["t2d"]).flatten().tolist())
    assert (d / "README.md").is_file() and (d / "drafter.json").is_file()
    assert not list(d.glob("*.bin")) and not list(d.glob("*.pt"))


def test_speculators_layout_is_exactly_the_contract(tiny_target, tmp_path):
    m = make_drafter(tiny_target, fc_norm=True, norm_output=True)
    t = E.target_info(str(tiny_target))
    d = write(m, tmp_path, E.SPECULATORS, t, speculative_tokens=5, dtype=torch.float32)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["speculators_model_type"] == "eagle3"
    assert "model_type" not in cfg            # vLLM then reads it as a "speculators" config
    tl = cfg["transformer_layer_config"]
    assert tl["model_type"] == "llama" and tl["num_hidden_layers"] == 1
    assert tl["vocab_size"] == t.vocab_size and tl["tie_word_embeddings"] is False
    assert tl["hidden_size"] == 64 and tl["rope_theta"] == m.cfg.rope_theta
    assert cfg["draft_vocab_size"] == 512 and cfg["target_hidden_size"] == 64
    assert {f: cfg[f] for f in E.NORM_FLAGS} == {"norm_before_residual": False,
                                                 "norm_before_fc": False, "fc_norm": True,
                                                 "feedback_post_norm": True}
    assert "norm_output" not in cfg and "norm_output" not in cfg["transformer_layer_config"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]   # vLLM meaning (HS)
    assert cfg["speculators_config"] == {
        "algorithm": "eagle3",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5,
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": str(tiny_target), "architectures": ["LlamaForCausalLM"]},
    }
    sd = load_file(str(d / "model.safetensors"))
    assert not [k for k in sd if k.startswith("midlayer.")]
    layer = {k for k in sd if k.startswith("layers.0.")}
    assert layer == {f"layers.0.{n}" for n in E.LAYER_TENSORS}
    # EAGLE-3.1 per-aux norms under the engines' names, one [Ht] row each
    assert [list(sd[f"fc_norm.{i}.weight"].shape) for i in range(3)] == [[64]] * 3
    assert torch.equal(torch.stack([sd[f"fc_norm.{i}.weight"] for i in range(3)]),
                       m.fc_norm.weight.detach())
    assert "fc_norm.weight" not in sd


def test_rope_settings_round_trip_through_transformers(tiny_target, tmp_path):
    """Both spellings are written and agree: transformers' own LlamaConfig reads the exact
    trained RoPE from native/config.json and from speculators' transformer_layer_config."""
    from transformers import LlamaConfig

    m = make_drafter(tiny_target, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE),
                     max_position_embeddings=2048)
    t = E.target_info(str(tiny_target))
    want = {**LLAMA3_ROPE, "rope_theta": 500000.0}
    for fmt in E.FORMATS:
        d = write(m, tmp_path, fmt, t, max_position_embeddings=2048)
        cfg = json.loads((d / "config.json").read_text())
        body = cfg if fmt == E.NATIVE else cfg["transformer_layer_config"]
        assert body["rope_theta"] == 500000.0 and body["rope_scaling"] == LLAMA3_ROPE
        assert body["rope_parameters"] == want
        lc = LlamaConfig(**{k: v for k, v in body.items() if k != "architectures"})
        assert lc.rope_parameters == want
        legacy = LlamaConfig(**{k: v for k, v in body.items() if k != "rope_parameters"})
        assert legacy.rope_parameters == want


# ----------------------------------------------------------------------------------- round trip
VARIANTS = {
    "fp32": (dict(), torch.float32),
    "bf16": (dict(), torch.bfloat16),
    # H != Ht, EAGLE-3.1 options, norm before residual, llama3-scaled RoPE, custom ids
    "everything": (dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        intermediate_size=80, fc_norm=True, norm_output=True,
                        norm_before_residual=True, rope_theta=500000.0,
                        rope_scaling=dict(LLAMA3_ROPE), aux_layer_ids=[1, 3, 6]),
                   torch.float32),
}


@pytest.mark.parametrize("fmt", E.FORMATS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_identical_logits(tiny_target, tmp_path, fmt, variant):
    overrides, dtype = VARIANTS[variant]
    trained = make_drafter(tiny_target, seed=3, **dict(overrides))
    t = E.target_info(str(tiny_target))
    d = write(trained, tmp_path, fmt, t, dtype=dtype)
    loaded = load_drafter_dir(d)
    assert loaded.cfg == trained.cfg                           # ids, flags, rope, sizes
    assert next(loaded.parameters()).dtype == dtype
    ref = trained.to(dtype)
    for a, b in zip(draft_logits(ref), draft_logits(loaded)):
        assert torch.equal(a, b)
    assert torch.equal(loaded.d2t, trained.d2t) and torch.equal(loaded.t2d, trained.t2d)


def test_loader_reads_published_layouts(tiny_target, tmp_path):
    """A SpecForge-style native dir: ids only in eagle_config (output-of-layer meaning), no
    drafter.json, no embed_tokens, no t2d; and a speculators dir whose norm_before_residual is
    left out (vLLM's speculators path then assumes true)."""
    trained = make_drafter(tiny_target, seed=5)
    t = E.target_info(str(tiny_target))
    d = write(trained, tmp_path, E.NATIVE, t, dtype=torch.float32, embed_tokens=False)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["eagle_aux_hidden_state_layer_ids"]
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "drafter.json").unlink()
    sd = load_file(str(d / "model.safetensors"))
    del sd["t2d"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(E.EngineDirError, match="embed_tokens"):
        load_drafter_dir(d)                                     # needs the target's embeddings
    loaded = load_drafter_dir(d, target=t)
    assert loaded.cfg.aux_layer_ids == [2, 4, 5]              # eagle_config [1, 3, 4] + 1
    target_embed = load_file(str(tiny_target / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(loaded.embed_tokens.weight, target_embed)
    assert torch.equal(loaded.t2d, trained.t2d)               # rebuilt from d2t

    s = write(trained, tmp_path / "s", E.SPECULATORS, t, dtype=torch.float32)
    cfg = json.loads((s / "config.json").read_text())
    del cfg["norm_before_residual"]
    (s / "config.json").write_text(json.dumps(cfg))
    assert load_drafter_dir(s).cfg.norm_before_residual is True


def test_feedback_flag_is_not_norm_output(tiny_target, tmp_path):
    """Exports write feedback_post_norm, never norm_output (SpecForge reads that key as "apply
    the final norm before lm_head"). Our own older exports (drafter.json present) still load
    their norm_output; another dir's norm_output is not taken for post-norm feedback."""
    trained = make_drafter(tiny_target, seed=5, norm_output=True)
    t = E.target_info(str(tiny_target))
    for fmt in E.FORMATS:
        d = write(trained, tmp_path / fmt, fmt, t, dtype=torch.float32)
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["feedback_post_norm"] is True and "norm_output" not in json.dumps(cfg)
        assert load_drafter_dir(d).cfg.norm_output is True
        cfg["norm_output"] = cfg.pop("feedback_post_norm")          # as exports wrote it before
        (d / "config.json").write_text(json.dumps(cfg))
        assert load_drafter_dir(d).cfg.norm_output is True
        (d / "drafter.json").unlink()                                # not ours: SpecForge's key
        assert load_drafter_dir(d, target=t).cfg.norm_output is False


def test_loader_reads_sharded_and_pickled_weights(tiny_target, tmp_path):
    """Published dirs come as sharded safetensors or as EAGLE's own pytorch_model.bin (read
    with torch.load(weights_only=True)); both load to the same logits."""
    trained = make_drafter(tiny_target, seed=7)
    t = E.target_info(str(tiny_target))
    d = write(trained, tmp_path, E.NATIVE, t, dtype=torch.float32)
    sd = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[:7],
              "model-00002-of-00002.safetensors": names[7:]}
    for f, ns in shards.items():
        save_file({n: sd[n] for n in ns}, str(d / f))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    ref = draft_logits(trained)
    assert all(torch.equal(a, b) for a, b in zip(ref, draft_logits(load_drafter_dir(d))))
    for f in shards:
        (d / f).unlink()
    (d / "model.safetensors.index.json").unlink()
    torch.save(sd, d / "pytorch_model.bin")
    assert read_dir(d).pickled
    assert all(torch.equal(a, b) for a, b in zip(ref, draft_logits(load_drafter_dir(d))))


def test_loader_refuses_unknown_tensors_and_unsupported_norm(tiny_target, tmp_path):
    m = make_drafter(tiny_target)
    t = E.target_info(str(tiny_target))
    d = write(m, tmp_path, E.NATIVE, t, dtype=torch.float32)
    sd = load_file(str(d / "model.safetensors"))
    sd["midlayer.extra.weight"] = torch.zeros(3)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(E.EngineDirError, match="unknown"):
        load_drafter_dir(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["norm_before_fc"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(E.EngineDirError, match="norm_before_fc"):
        load_drafter_dir(d)


def test_writer_refuses_what_engines_cannot_serve(tiny_target, tmp_path):
    t = E.target_info(str(tiny_target))
    m = make_drafter(tiny_target, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, intermediate_size=80)
    (tmp_path / "a").mkdir()
    with pytest.raises(E.EngineDirError, match="embed_tokens"):
        E.write_dir(m, tmp_path / "a", E.NATIVE, target=t, embed_tokens=False)
    m = make_drafter(tiny_target, norm_before_fc=True)
    with pytest.raises(E.EngineDirError, match="norm_before_fc"):
        E.write_dir(m, tmp_path / "a", E.NATIVE, target=t)


def test_load_our_checkpoint_dir(tiny_target, tmp_path):
    from drafter.train.model import save_drafter

    m = make_drafter(tiny_target, seed=9)
    save_drafter(m, tmp_path)
    loaded = load_drafter_dir(tmp_path)
    for a, b in zip(draft_logits(m), draft_logits(loaded)):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------- README
def test_readme_has_exact_commands_and_ids(tiny_target, tmp_path):
    m = make_drafter(tiny_target)
    t = E.target_info(str(tiny_target))
    nat = write(m, tmp_path, E.NATIVE, t, speculative_tokens=3, chat_template="/x/chat.jinja")
    spec = write(m, tmp_path, E.SPECULATORS, t, speculative_tokens=3)
    r = (nat / "README.md").read_text()
    D, T = str(nat.resolve()), str(tiny_target)
    assert (f"vllm serve {T} --chat-template /x/chat.jinja --speculative-config "
            f"'{{\"method\":\"eagle3\",\"model\":\"{D}\",\"num_speculative_tokens\":3}}'") in r
    assert (f"python -m sglang.launch_server --model {T} --chat-template /x/chat.jinja "
            f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {D} "
            "--speculative-num-steps 3 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 4") in r
    assert "--speculative-algorithm EAGLE " not in r
    assert (f"python convert_hf_to_gguf.py {D} --target-model-dir {T} "
            "--outfile draft.gguf") in r
    assert ("llama-server -m target.gguf -md draft.gguf --spec-type draft-eagle3 --jinja "
            "--chat-template-file /x/chat.jinja") in r
    assert "| HS[k] | [2, 4, 5] |" in r and "| output of layer k = HS[k+1] | [1, 3, 4] |" in r
    r = (spec / "README.md").read_text()
    assert f"vllm serve {spec.resolve()}\n" in r
    assert "| HS[k] | [2, 4, 5] |" in r


def test_readme_warns_about_version_dependent_ids(tiny_target, tmp_path):
    m = make_drafter(tiny_target, aux_layer_ids=[3, 4, 6], norm_before_residual=True)
    r = E.readme(E.NATIVE, tmp_path, m.cfg, E.target_info(str(tiny_target)), 3)
    assert "llama.cpp's converter recomputes the default" in r
    assert "only when the first id is 1" in r
    assert "SGLang implements only false" in r
