"""The export step on checkpoints written exactly as the train contract says (docs/internals.md:
train/step_NNNNNN/ with model.safetensors + drafter_config.json, state.json, COMPLETE last):
checkpoint choice, both engine dirs written atomically and linted, the round trip to the trained
logits, the target's identity in speculators_config, and nothing shipped when the lint fails."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_engines import draft_logits, make_drafter

from drafter.core import config as C
from drafter.core.rundir import MissingInput, Run, atomic_json
from drafter.export import engines as E
from drafter.export.check import PASS, WARN, run_checks
from drafter.export.enginedir import load_drafter_dir
from drafter.run import pipeline
from drafter.steps import export
from drafter.train.model import load_drafter, save_drafter


def checkpoint(run: Run, step: int, model, sim_tau: float | None, complete: bool = True) -> Path:
    d = run.checkpoint(step)
    d.mkdir(parents=True)
    save_drafter(model, d)
    atomic_json(d / "state.json", {"step": step, "val": None if sim_tau is None else
                                   {"sim_tau": sim_tau, "acc": [0.5, 0.3]}})
    if complete:
        (d / "COMPLETE").write_text("ok\n")
    return d


def make_run(tmp_path: Path, target: Path | str, *overrides: str,
             taus=((10, 1.8), (20, 1.6)), model_for=None):
    """A run dir whose train/ holds checkpoints (step, val.sim_tau), plus an incomplete later
    one with the best score (it must never be picked)."""
    cfg = C.load(None, [f"run_dir={tmp_path / 'run'}", f"target.model={target}", *overrides])
    run = Run.of(cfg)
    model_for = model_for or (lambda step: make_drafter(Path(target), seed=step))
    for step, tau in taus:
        checkpoint(run, step, model_for(step), tau)
    checkpoint(run, 30, model_for(30), 9.9, complete=False)
    return cfg, run


def test_export_writes_both_engine_dirs(tiny_target, tmp_path):
    cfg, run = make_run(tmp_path, tiny_target, "export.dtype=float32",
                        "export.speculative_tokens=4")
    out = export.main(cfg)
    assert out["step"] == 20 and out["sim_tau"] == 1.6          # checkpoint: last
    assert out["checks"] == {"native": {"pass": 27, "warn": 0, "fail": 0, "skip": 0},
                             "speculators": {"pass": 27, "warn": 0, "fail": 0, "skip": 0}}
    assert out["aux_layer_ids"] == {"hs": [2, 4, 5], "layer_output": [1, 3, 4]}
    assert out["counts"]["native_bytes"] > 0 and out["counts"]["speculators_bytes"] > 0
    exp = run.step_dir("export")
    assert sorted(p.name for p in exp.iterdir()) == ["native", "speculators"]   # no temp dirs
    trained = load_drafter(run.checkpoint(20))
    for fmt in E.FORMATS:
        d = run.export(fmt)
        assert sorted(p.name for p in d.iterdir()) == ["README.md", "config.json", "drafter.json",
                                                       "model.safetensors"]
        meta = json.loads((d / "drafter.json").read_text())
        assert meta["step"] == 20 and meta["checkpoint"] == str(run.checkpoint(20).resolve())
        assert str(d.resolve()) in (d / "README.md").read_text()   # the final path, not the temp
        assert run_checks(d, str(tiny_target)).ok
        loaded = load_drafter_dir(d)
        for a, b in zip(draft_logits(trained), draft_logits(loaded)):
            assert torch.equal(a, b)                               # float32: bit-identical
    spec = json.loads((run.export("speculators") / "config.json").read_text())
    assert spec["speculators_config"]["verifier"] == {"name_or_path": str(tiny_target),
                                                      "architectures": ["LlamaForCausalLM"]}
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4


def test_bf16_export_round_trips_to_the_trained_model_in_bf16(tiny_target, tmp_path):
    cfg, run = make_run(tmp_path, tiny_target, "export.checkpoint=best")
    out = export.main(cfg)
    assert out["step"] == 10 and out["dtype"] == "bfloat16"     # best complete val.sim_tau
    trained = load_drafter(run.checkpoint(10)).to(torch.bfloat16)
    for fmt in E.FORMATS:
        loaded = load_drafter_dir(run.export(fmt))
        assert next(loaded.parameters()).dtype == torch.bfloat16
        for a, b in zip(draft_logits(trained), draft_logits(loaded)):
            assert torch.equal(a, b)


def test_checkpoint_choice(tiny_target, tmp_path):
    cfg, run = make_run(tmp_path, tiny_target)
    assert export.choose_checkpoint(run, "last")[0] == run.checkpoint(20)
    assert export.choose_checkpoint(run, "best")[0] == run.checkpoint(10)
    p, state = export.choose_checkpoint(run, str(run.checkpoint(30)))    # an explicit path
    assert p == run.checkpoint(30) and state["val"]["sim_tau"] == 9.9
    with pytest.raises(export.ExportError, match="not found"):
        export.choose_checkpoint(run, str(tmp_path / "nope"))
    _, run2 = make_run(tmp_path / "b", tiny_target, taus=((5, None), (6, None)))
    with pytest.raises(export.ExportError, match="val.sim_tau"):
        export.choose_checkpoint(run2, "best")
    with pytest.raises(MissingInput, match="drafter train"):
        export.choose_checkpoint(Run(tmp_path / "empty"), "last")


def test_serving_context_override(tiny_target, tmp_path):
    cfg, run = make_run(tmp_path, tiny_target, "export.max_position_embeddings=512")
    export.main(cfg)
    d = run.export("native")
    assert json.loads((d / "config.json").read_text())["max_position_embeddings"] == 512
    # below the target's 1024, chosen on purpose: a warning, not a failure
    r = run_checks(d, str(tiny_target))
    assert r.status("max_position_embeddings") == WARN and r.ok
    cfg, run = make_run(tmp_path / "b", tiny_target)
    export.main(cfg)
    spec = json.loads((run.export("speculators") / "config.json").read_text())
    assert spec["transformer_layer_config"]["max_position_embeddings"] == 1024   # the target's


def test_export_refuses_a_checkpoint_for_another_target(tiny_target, tmp_path):
    from tiny import make_tiny

    other = make_tiny("llama", tmp_path / "other", num_hidden_layers=8, hidden_size=96)
    cfg, run = make_run(tmp_path, other, model_for=lambda s: make_drafter(tiny_target, seed=s))
    with pytest.raises(export.ExportError, match="does not fit"):
        export.main(cfg)
    assert not run.step_dir("export").exists() or not any(run.step_dir("export").iterdir())


def test_failed_lint_ships_nothing_and_keeps_the_old_export(tiny_target, tmp_path):
    cfg, run = make_run(tmp_path, tiny_target)
    export.main(cfg)
    before = (run.export("native") / "model.safetensors").read_bytes()
    # a newer checkpoint whose RoPE is not the target's: `drafter check` fails it
    checkpoint(run, 40, make_drafter(tiny_target, seed=40, rope_theta=500000.0), 2.0)
    with pytest.raises(export.ExportError, match="rope"):
        export.main(cfg)
    assert (run.export("native") / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in run.step_dir("export").iterdir()) == ["native", "speculators"]


def test_export_through_the_pipeline(tiny_target, tmp_path):
    cfg, run = make_run(tmp_path, tiny_target)
    atomic_json(run.manifest("train"), {"step": "train", "counts": {}, "fingerprint": {}})
    m = pipeline.run_step(cfg, "export")
    assert m["counts"]["params"] > 0 and m["step"] == 20
    assert json.loads(run.manifest("export").read_text())["checks"]["native"]["fail"] == 0
    again = pipeline.run_step(cfg, "export")                  # up to date: skipped
    assert again["started"] == m["started"]


def test_builtin_target_names_the_materialised_folder(smollm2_dir, tmp_path):
    """builtin: targets are written as the resolved HF folder (engines cannot load the spec),
    with the target's architectures; without embed_tokens the loader takes the target's."""
    from safetensors.torch import load_file

    embed = load_file(str(next(smollm2_dir.glob("*.safetensors"))))["model.embed_tokens.weight"]

    def model_for(step):
        m = make_drafter(smollm2_dir, seed=step, draft_vocab=256, intermediate_size=64)
        m.set_embeddings(embed)
        return m

    cfg, run = make_run(tmp_path, "builtin:smollm2-135m-instruct", "export.embed_tokens=false",
                        taus=((1, 1.5),), model_for=model_for)
    export.main(cfg)
    spec = json.loads((run.export("speculators") / "config.json").read_text())
    assert spec["speculators_config"]["verifier"] == {"name_or_path": str(smollm2_dir),
                                                      "architectures": ["LlamaForCausalLM"]}
    nat = run.export("native")
    cfgn = json.loads((nat / "config.json").read_text())
    assert cfgn["rope_theta"] == 100000.0 and cfgn["max_position_embeddings"] == 8192
    assert cfgn["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert cfgn["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    r = run_checks(nat, "builtin:smollm2-135m-instruct")
    assert r.ok and r.status("embed_tokens") == PASS and r.status("rope") == PASS
    assert r.status("aux_ids.sglang") == PASS and r.status("target") == PASS
    loaded = load_drafter_dir(nat, target=E.target_info(str(smollm2_dir)))
    trained = load_drafter(run.checkpoint(1)).to(torch.bfloat16)
    for a, b in zip(draft_logits(trained), draft_logits(loaded)):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_export_after_the_real_pipeline(smollm2_dir, shared_data, tmp_path):
    """prepare -> tokenize -> vocab -> extract -> train (4 steps, validation every 2) -> export
    on SmolLM2 through the real steps: best picks the higher val.sim_tau, both dirs pass
    `drafter check` against builtin:, and reload to the trained logits. 3-5 min on 2 CPUs."""
    import yaml

    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"),
        "prepare": {"sources": [{"path": str(shared_data / "train/sharegpt_dummy_conversation"
                                             ".json"), "max_samples": 40}], "val_fraction": 0.2},
        "generate": {"enabled": False},
        "tokenize": {"max_length": 96, "workers": 1},
        "vocab": {"draft_vocab_size": 1024},
        "extract": {"shard_tokens": 1024, "batch_tokens": 512},
        "train": {"max_length": 96, "batch_tokens": 96, "ttt_steps": 3, "lr": 1e-3,
                  "log_every": 1, "eval_every": 2, "save_every": 2, "max_steps": 4},
        "export": {"checkpoint": "best"}}))
    cfg = C.load(cfg_path)
    pipeline.run_all(cfg, steps=["prepare", "generate", "tokenize", "vocab", "extract", "train",
                                 "export"])
    run = Run.of(cfg)
    taus = {p: json.loads((p / "state.json").read_text())["val"]["sim_tau"]
            for p in run.checkpoints()}
    best = max(taus, key=taus.get)
    m = json.loads(run.manifest("export").read_text())
    assert m["checkpoint"] == str(best) and m["aux_layer_ids"]["hs"] == [2, 15, 27]
    trained = load_drafter(best).to(torch.bfloat16)
    for fmt in E.FORMATS:
        assert run_checks(run.export(fmt), "builtin:smollm2-135m-instruct").ok
        loaded = load_drafter_dir(run.export(fmt))
        for a, b in zip(draft_logits(trained), draft_logits(loaded)):
            assert torch.equal(a, b)


def test_export_says_how_the_drafter_was_trained_and_check_warns_on_greedy_only(tiny_target,
                                                                                tmp_path):
    """drafter.json's `training` and the README's "How it was trained" name the loss (the
    checkpoint's state.json), the temperatures the answers were generated at (generate's
    manifest) and the validation's simulated τ at each temperature. `drafter check` passes a
    drafter trained on greedy answers only until its README serves a temperature above 0 (a
    tuned "### Temperature 1" section): then it warns; trained on sampled answers too, it
    passes."""
    cfg, run = make_run(tmp_path, tiny_target, "export.dtype=float32")
    obj = {"loss": [{"kind": "ce", "weight": 0.1, "temperature": 0.0},
                    {"kind": "tv", "weight": 0.9, "temperature": 1.0}],
           "position_weight": "decay", "describe": "0.1·ce + 0.9·tv@T1", "ttt_decay": 0.8,
           "noise": 0.05, "optimizer": "muon"}
    state_path = run.checkpoint(20) / "state.json"
    state = json.loads(state_path.read_text())
    state.update(objective=obj, val={"sim_tau": 1.6, "sim_tau_p": 1.3, "acc": [0.5, 0.3],
                                     "sim_tau_t": {"0": 1.6, "0.7": 1.45, "1": 1.3}})
    atomic_json(state_path, state)
    atomic_json(run.manifest("generate"), {"enabled": True, "sampling": {
        "temperature": 0.0, "extra_temperatures": []}})
    export.main(cfg)
    d = run.export("native")
    rec = json.loads((d / "drafter.json").read_text())["training"]
    assert rec == {"objective": obj, "answers": "generated", "answer_temperatures": [0.0]}
    text = (d / "README.md").read_text()
    sec = text[text.index("## How it was trained"):text.index("## Aux layer ids")]
    assert "0.1·ce + 0.9·tv@T1" in sec and "optimizer muon" in sec and "noise 0.05" in sec
    assert "written by the target at temperature 0 " in sec
    assert "1.60 at T=0, 1.45 at T=0.7, 1.30 at T=1" in sec
    assert "Trained on greedy answers only" in sec

    def rule(path):
        return [c for c in run_checks(path, str(tiny_target)).checks
                if c.name == "answer_temperatures"]
    assert [c.status for c in rule(d)] == [PASS]
    (d / "README.md").write_text(text.replace("## Aux layer ids", "## Tuned serving settings\n\n"
                                              "### Temperature 0 (greedy)\n\n### Temperature 1\n"
                                              "\n## Aux layer ids"))
    (warn,) = rule(d)
    assert warn.status == WARN and "temperature 1" in warn.reason and "line" in warn.reason
    # answers at 0 and 0.8: the same README passes
    meta = json.loads((d / "drafter.json").read_text())
    meta["training"]["answer_temperatures"] = [0.0, 0.8]
    (d / "drafter.json").write_text(json.dumps(meta))
    assert [c.status for c in rule(d)] == [PASS]
