"""Nothing lost, nothing silently accepted: a table of bad inputs, each refused by the
real CLI (in-process) with exit status 2 and one message that names the key (or file:line),
after a finished run whose files must not change; folders and files drafter did not write are
never cleared or overwritten; user errors are one line, bugs one line too (the traceback behind
--debug). The corruption cases that need real steps are in test_faults.py (shards, checkpoints,
manifests, generate's output) and test_generate.py (an over-long prompt)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import yaml

from drafter import cli
from drafter.core.rundir import STEPS, Run, atomic_write
from drafter.features import store
from drafter.run import pipeline

# ------------------------------------------------------------------------------------ the world
BASE = {
    "target": {"device": "cpu"},
    "prepare": {"sources": [{"path": "builtin:quickstart-prompts", "max_samples": 8}]},
    "tokenize": {"max_length": 256},
    "train": {"max_length": 128, "batch_tokens": 256},
}


def _fake_step(name):
    """A stand-in step: one output file (extract: also its empty shard indexes)."""
    def main(cfg):
        run = Run.of(cfg)
        atomic_write(run.step_dir(name) / "result.txt", f"{name} output\n")
        if name == "extract":
            for split in ("train", "val"):
                store.write_index(run.shard_index(split), {}, [], None)
        return {"counts": {"n": 1}}
    return main


def tree(root: Path) -> dict:
    """Every file under root with its bytes' hash and its mtime."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                       p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A finished run (every step done by stand-in steps: real manifests, real folders) of a
    valid config whose target is a config-only 6-layer Llama folder."""
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("hardening")
    target = root / "target"
    LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2).save_pretrained(target)
    cfg_path = root / "cfg.yaml"
    data = {"run_dir": str(root / "run"), **BASE}
    data["target"] = {**BASE["target"], "model": str(target)}
    cfg_path.write_text(yaml.safe_dump(data))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "_step_fn", _fake_step)
        assert cli.main(["run", str(cfg_path)]) == 0
    st = pipeline.status(root / "run")
    assert [s["state"] for s in st["steps"]] == ["done"] * len(STEPS)
    return {"root": root, "cfg": cfg_path, "target": target, "run": Run(root / "run")}


def refused(world, capsys, argv: list[str], pattern: str) -> str:
    """argv is refused with exit 2 and one line naming `pattern`; no file changes."""
    before = tree(world["root"])
    with pytest.MonkeyPatch.context() as mp:  # a case that slips through never runs a real step
        mp.setattr(pipeline, "_step_fn", _fake_step)
        rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2, f"exit {rc}: {err}"
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("drafter: error: "), err
    assert len(err.strip().splitlines()) == 1, err          # one message, nothing else
    import re
    assert re.search(pattern, last), f"{pattern!r} not in {last!r}"
    assert tree(world["root"]) == before, "a refused command changed files"
    return last


# ------------------------------------------------------------------- bad values (overrides)
# (id, command, overrides, what the message must name). The key is always named; where the
# value came from (the override, or file:line) too.
CASES = [
    # train
    ("epochs_0", "train", ["train.epochs=0"], r"train\.epochs: must be >= 1, got 0"),
    ("lr_negative", "train", ["train.lr=-1"], r"train\.lr: must be > 0, got -1"),
    ("lr_zero", "train", ["train.lr=0"], r"train\.lr: must be > 0"),
    ("lr_nan", "train", ["train.lr=.nan"], r"train\.lr: expected a finite number"),
    ("lr_inf", "train", ["train.lr=.inf"], r"train\.lr: expected a finite number"),
    ("lr_word", "train", ["train.lr=fast"], r"train\.lr: expected a number"),
    ("epochs_bool", "train", ["train.epochs=true"], r"train\.epochs: expected an integer"),
    ("ttt_steps_0", "train", ["train.ttt_steps=0"], r"train\.ttt_steps: must be >= 1"),
    ("ttt_decay_0", "train", ["train.ttt_decay=0"], r"train\.ttt_decay: must be > 0"),
    ("grad_accum_0", "train", ["train.grad_accum=0"], r"train\.grad_accum: must be >= 1"),
    ("max_length_2", "train", ["train.max_length=2"], r"train\.max_length: must be >= 4"),
    ("batch_lt_length", "train", ["train.batch_tokens=64"],
     r"train\.batch_tokens: must be at least train\.max_length \(128\)"),
    ("min_lr_ratio", "train", ["train.min_lr_ratio=1.5"],
     r"train\.min_lr_ratio: must be in \[0, 1\]"),
    ("warmup_1", "train", ["train.warmup_ratio=1"], r"train\.warmup_ratio: must be in \[0, 1\)"),
    ("weight_decay", "train", ["train.weight_decay=-0.1"], r"train\.weight_decay: must be >= 0"),
    ("grad_clip_0", "train", ["train.grad_clip=0"], r"train\.grad_clip: must be > 0"),
    ("eval_every", "train", ["train.eval_every=-1"], r"train\.eval_every: must be >= 0"),
    ("save_every_0", "train", ["train.save_every=0"], r"train\.save_every: must be >= 1"),
    ("keep_0", "train", ["train.keep_checkpoints=0"], r"train\.keep_checkpoints: must be >= 1"),
    ("max_steps_0", "train", ["train.max_steps=0"], r"train\.max_steps: must be >= 1"),
    ("eval_batches_0", "train", ["train.eval_batches=0"], r"train\.eval_batches: must be >= 1"),
    ("intermediate_0", "train", ["train.intermediate_size=0"],
     r"train\.intermediate_size: must be >= 1"),
    ("attention_word", "train", ["train.attention=fast"], r"train\.attention: must be one of"),
    ("train_dtype", "train", ["train.dtype=fp16"], r"train\.dtype: must be one of"),
    ("resume_empty", "train", ["train.resume="], r"train\.resume: must be auto, off"),
    ("resume_missing", "train", ["train.resume=/nonexistent/step_000001"],
     r"train\.resume: /nonexistent/step_000001 is not a usable checkpoint"),
    ("flex_on_cpu", "train", ["train.attention=flex"], r"train\.attention: flex needs a CUDA"),
    # generate
    ("max_tokens_neg", "generate", ["generate.max_tokens=-5"],
     r"generate\.max_tokens: must be >= 1, got -5"),
    ("max_tokens_0", "generate", ["generate.max_tokens=0"], r"generate\.max_tokens: must be >= 1"),
    ("concurrency_0", "generate", ["generate.concurrency=0"],
     r"generate\.concurrency: must be >= 1"),
    ("temperature_neg", "generate", ["generate.temperature=-1"],
     r"generate\.temperature: must be >= 0"),
    ("top_p_0", "generate", ["generate.top_p=0"], r"generate\.top_p: must be in \(0, 1\]"),
    ("top_p_big", "generate", ["generate.top_p=1.5"], r"generate\.top_p: must be in \(0, 1\]"),
    ("retries_neg", "generate", ["generate.max_retries=-1"],
     r"generate\.max_retries: must be >= 0"),
    ("timeout_0", "generate", ["generate.request_timeout=0"],
     r"generate\.request_timeout: must be > 0"),
    ("gen_batch_0", "generate", ["generate.batch_size=0"], r"generate\.batch_size: must be >= 1"),
    ("port_big", "generate", ["generate.server.port=70000"],
     r"generate\.server\.port: must be in \[0, 65535\]"),
    ("port_neg", "generate", ["generate.server.port=-1"], r"generate\.server\.port: must be in"),
    ("host_public", "generate", ["generate.server.host=0.0.0.0"],
     r"generate\.server\.host: is not localhost.*generate\.server\.allow_remote: true"),
    ("host_other", "serve", ["generate.server.host=10.0.0.5"],
     r"generate\.server\.host: is not localhost"),
    ("replicas_0", "generate", ["generate.server.replicas=0"],
     r"generate\.server\.replicas: must be >= 1"),
    ("startup_0", "generate", ["generate.server.startup_timeout=0"],
     r"generate\.server\.startup_timeout: must be > 0"),
    ("external_no_urls", "generate", ["generate.server.engine=external"],
     r"generate\.server\.urls: must list the server URLs"),
    ("external_bad_url", "generate", ["generate.server.engine=external",
                                      "generate.server.urls=[ftp://x/v1]"],
     r"generate\.server\.urls\[0\]: must be an http:// or https:// URL"),
    ("engine_word", "generate", ["generate.server.engine=magic"],
     r"generate\.server\.engine: must be one of"),
    ("synthetic_not_local", "generate",
     ["prepare.sources=[{synthetic: {count: 4}}]", "generate.server.engine=transformers"],
     r"generate\.server\.engine: prepare\.sources\[0\] is synthetic"),
    # tokenize, vocab, extract
    ("tok_max_length_neg", "tokenize", ["tokenize.max_length=-1"],
     r"tokenize\.max_length: must be >= 4, got -1"),
    ("tok_max_length_0", "tokenize", ["tokenize.max_length=0"], r"tokenize\.max_length"),
    ("tok_batch_0", "tokenize", ["tokenize.batch_size=0"], r"tokenize\.batch_size: must be >= 1"),
    ("tok_workers_neg", "tokenize", ["tokenize.workers=-2"], r"tokenize\.workers: must be >= 0"),
    ("tok_overflow", "tokenize", ["tokenize.overflow=wrap"], r"tokenize\.overflow: must be one"),
    ("tok_loop_neg", "tokenize", ["tokenize.max_loop_tokens=-1"],
     r"tokenize\.max_loop_tokens: must be >= 0"),
    ("tok_loop_copies_1", "tokenize", ["tokenize.loop_copies=1"],
     r"tokenize\.loop_copies: must be >= 2"),
    ("chat_template_missing", "tokenize", ["target.chat_template=/nonexistent.jinja"],
     r"target\.chat_template: /nonexistent\.jinja is not a file"),
    ("draft_vocab_0", "vocab", ["vocab.draft_vocab_size=0"],
     r"vocab\.draft_vocab_size: must be >= 1"),
    ("layer_ids_empty", "extract", ["extract.layer_ids=[]"], r"extract\.layer_ids: must list"),
    ("layer_ids_negative", "extract", ["extract.layer_ids=[-1, 3, 4]"],
     r"extract\.layer_ids\[0\]: must be >= 0, got -1"),
    ("layer_ids_beyond", "extract", ["extract.layer_ids=[2, 3, 9]"],
     r"extract\.layer_ids: \[9\] outside 0\.\.5 for this 6-layer target"),
    ("layer_ids_unsorted", "extract", ["extract.layer_ids=[4, 2, 3]"],
     r"extract\.layer_ids: must be ascending and distinct"),
    ("layer_ids_repeated", "extract", ["extract.layer_ids=[2, 3, 3]"],
     r"extract\.layer_ids: must be ascending and distinct"),
    ("engine_vllm_tp", "extract", ["extract.engine=vllm", "extract.tp=true"],
     r"extract\.tp: must be false with extract\.engine=vllm"),
    ("engine_vllm_online", "extract", ["extract.engine=vllm", "train.online=true"],
     r"train\.online: must be false with extract\.engine=vllm"),
    ("engine_args_owned", "extract", ["target.engine_args={speculative_config: {}}"],
     r"target\.engine_args\.speculative_config: is set by drafter itself"),
    ("topk_0", "extract", ["extract.topk=0"], r"extract\.topk: must be >= 1"),
    ("shard_tokens_0", "extract", ["extract.shard_tokens=0"], r"extract\.shard_tokens: must be"),
    ("extract_batch_0", "extract", ["extract.batch_tokens=0"], r"extract\.batch_tokens: must be"),
    ("aux_dtype", "extract", ["extract.aux_dtype=fp4"], r"extract\.aux_dtype: must be one of"),
    # export, evaluate
    ("spec_tokens_0", "export", ["export.speculative_tokens=0"],
     r"export\.speculative_tokens: must be >= 1, got 0"),
    ("checkpoint_typo", "export", ["export.checkpoint=lsat"],
     r"export\.checkpoint: .*did you mean 'last'"),
    ("checkpoint_missing", "export", ["export.checkpoint=/nonexistent/step_000009"],
     r"export\.checkpoint: /nonexistent/step_000009 is not a checkpoint folder"),
    ("mpe_0", "export", ["export.max_position_embeddings=0"],
     r"export\.max_position_embeddings: must be >= 1"),
    ("eval_k_0", "evaluate", ["evaluate.k=0"], r"evaluate\.k: must be >= 1"),
    ("eval_method", "evaluate", ["evaluate.methods=[beam]"],
     r"evaluate\.methods\[0\]: must be chain, tree or block"),
    ("eval_no_methods", "evaluate", ["evaluate.methods=[]"], r"evaluate\.methods: must list"),
    ("eval_temperature", "evaluate", ["evaluate.temperatures=[-0.5]"],
     r"evaluate\.temperatures\[0\]: must be >= 0"),
    ("eval_new_tokens", "evaluate", ["evaluate.max_new_tokens=0"],
     r"evaluate\.max_new_tokens: must be >= 1"),
    ("eval_prompts_missing", "evaluate", ["evaluate.datasets[0].path=/nonexistent.jsonl"],
     r"evaluate\.datasets\[0\]\.path: /nonexistent\.jsonl not found"),
    ("eval_max_prompts_0", "evaluate", ["evaluate.datasets[0].max_prompts=0"],
     r"evaluate\.datasets\[0\]\.max_prompts: must be >= 1"),
    ("eval_drafter_missing", "evaluate", ["evaluate.drafter=/nonexistent/native"],
     r"evaluate\.drafter: /nonexistent/native not found"),
    # the run dir, the target, prepare
    ("run_dir_empty", "run", ["run_dir="], r"run_dir: must name the run directory"),
    ("target_empty", "run", ["target.model="], r"target\.model: must name the target"),
    ("device_word", "run", ["target.device=gpu"], r"target\.device: must be auto, cpu, cuda"),
    ("val_fraction_1", "prepare", ["prepare.val_fraction=1"],
     r"prepare\.val_fraction: must be in \[0, 1\)"),
    ("bad_fraction_2", "prepare", ["prepare.max_bad_fraction=2"],
     r"prepare\.max_bad_fraction: must be in \[0, 1\]"),
    ("source_no_path", "prepare", ["prepare.sources[0].path="],
     r"prepare\.sources\[0\]\.path: must name a file.*`synthetic` section"),
    ("source_max_samples_0", "prepare", ["prepare.sources[0].max_samples=0"],
     r"prepare\.sources\[0\]\.max_samples: must be >= 1"),
    ("no_sources", "prepare", ["prepare.sources=[]"], r"prepare\.sources: must list"),
    ("source_missing", "prepare", ["prepare.sources[0].path=/nonexistent/data.jsonl"],
     r"prepare\.sources\[0\]\.path: /nonexistent/data\.jsonl not found"),
    ("source_builtin_typo", "prepare", ["prepare.sources[0].path=builtin:quickstart"],
     r"prepare\.sources\[0\]\.path: unknown builtin 'builtin:quickstart'"),
    ("source_names_clash", "prepare", ["prepare.sources=[{path: builtin:quickstart-prompts}, "
                                       "{path: builtin:quickstart-prompts}]"],
     r"prepare\.sources\[1\]\.name: 'quickstart-prompts' is also the name"),
    ("synthetic_count_0", "prepare", ["prepare.sources=[{synthetic: {count: 0}}]"],
     r"prepare\.sources\[0\]\.synthetic\.count: must be >= 1"),
    ("synthetic_near_dup", "prepare", ["prepare.sources=[{synthetic: {near_dup: 0}}]"],
     r"prepare\.sources\[0\]\.synthetic\.near_dup: must be in \(0, 1\]"),
    ("plan_mfu_0", "plan", ["plan.mfu=0"], r"plan\.mfu: must be in \(0, 1\]"),
    ("plan_gpus_0", "plan", ["plan.gpus=0"], r"plan\.gpus: must be >= 1"),
    # the key itself, the override syntax
    ("unknown_key", "train", ["train.lrr=1"], r"unknown key 'train\.lrr'.*did you mean 'lr'"),
    ("unknown_section", "run", ["tran.lr=1"], r"unknown key 'tran'.*did you mean 'train'"),
    ("no_equals", "train", ["train.lr"], r"override 'train\.lr': expected key=value"),
    ("not_a_section", "train", ["train.lr.x=1"], r"train\.lr"),
    ("list_index_beyond", "prepare", ["prepare.sources[3].path=x"],
     r"sources has 1 item\(s\), no \[3\]"),
    # every step of `drafter run` is checked before the first one runs
    ("run_checks_export_first", "run", ["export.checkpoint=/nonexistent/x"],
     r"export\.checkpoint: /nonexistent/x is not a checkpoint folder"),
    ("run_checks_evaluate_first", "run", ["evaluate.datasets[0].path=/nonexistent.jsonl"],
     r"evaluate\.datasets\[0\]\.path"),
]


CROSS = {"external_no_urls"}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_value_is_refused_and_nothing_changes(world, capsys, case):
    _, command, overrides, pattern = case
    last = refused(world, capsys, [command, str(world["cfg"]), *overrides], pattern)
    # where the value came from (a rule between fields names the file's key it asks for)
    assert "override '" in last or (case[0] in CROSS and str(world["cfg"]) in last)


# --------------------------------------------------------------- bad values (the config file)
FILES = [
    ("yaml_syntax", "train:\n  lr: [1\n", r"cfg\.yaml:3: not valid YAML: while parsing"),
    ("not_utf8", b"train:\n  lr: 0.1\n  # caf\xe9\n",
     r"cfg\.yaml:3: not UTF-8: byte 0xe9 at column 8"),
    ("top_is_list", "- train\n- lr\n", r"cfg\.yaml: the top level must be a mapping"),
    ("section_scalar", "train: 5\n", r"cfg\.yaml:1: train: expected a mapping"),
    ("range_in_file", "run_dir: {run}\ntrain:\n  max_length: 128\n  epochs: 0\n",
     r"cfg\.yaml:4: train\.epochs: must be >= 1, got 0"),
    ("host_in_file", "run_dir: {run}\ngenerate:\n  server:\n    host: 0.0.0.0\n",
     r"cfg\.yaml:4: generate\.server\.host: is not localhost"),
    ("source_no_path_file", "run_dir: {run}\nprepare:\n  sources:\n    - max_samples: 3\n",
     r"cfg\.yaml:4: prepare\.sources\[0\]\.path: must name a file"),
    ("unknown_in_file", "run_dir: {run}\nexport:\n  speculative_token: 3\n",
     r"cfg\.yaml:3: unknown key 'export\.speculative_token'.*did you mean"),
    ("missing_file", None, r"config file not found"),
]


@pytest.mark.parametrize("case", FILES, ids=[c[0] for c in FILES])
def test_bad_config_file_names_file_and_line(world, capsys, tmp_path, case):
    name, text, pattern = case
    p = world["root"] / "cases" / name / "cfg.yaml"
    p.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, str):
        p.write_text(text.format(run=world["run"].root))
    elif text is not None:
        p.write_bytes(text)
    refused(world, capsys, ["train", str(p)], pattern)


def test_at_least_60_bad_inputs():
    assert len(CASES) + len(FILES) >= 60


# ------------------------------------------------------------------- folders drafter did not write
def _clone(world, dst: Path) -> Path:
    """A copy of the finished run (with its config) at dst; returns the config path."""
    import shutil

    shutil.copytree(world["run"].root, dst / "run")
    data = yaml.safe_load(world["cfg"].read_text())
    data["run_dir"] = str(dst / "run")
    (dst / "cfg.yaml").write_text(yaml.safe_dump(data))
    return dst / "cfg.yaml"


def test_a_users_step_folder_is_never_cleared(world, tmp_path, capsys):
    """A folder named like a step that drafter did not write (no pipeline file, files no step
    writes) is refused, not cleared, by the step and by `drafter run`."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({**BASE, "run_dir": str(tmp_path / "run"),
                                   "target": {"model": str(world["target"])}}))
    mine = tmp_path / "run" / "train"
    mine.mkdir(parents=True)
    (mine / "my_notes.txt").write_text("my own work\n")
    (tmp_path / "run" / "prepare").mkdir()
    (tmp_path / "run" / "prepare" / "data.jsonl").write_text('{"prompt": "mine"}\n')
    before = tree(tmp_path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "_step_fn", _fake_step)
        assert cli.main(["prepare", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert "run/prepare holds files drafter did not write (data.jsonl)" in err
        assert "nothing was changed" in err and "Traceback" not in err
        assert cli.main(["run", str(cfg)]) == 2
        assert "holds files drafter did not write" in capsys.readouterr().err
    after = tree(tmp_path)
    assert {k: v for k, v in after.items() if k != "run/.lock"} == before


def test_a_users_config_yaml_in_the_run_dir_is_not_overwritten(world, tmp_path, capsys):
    """run_dir=. next to the user's own config.yaml: drafter keeps its snapshot there, so it
    refuses rather than overwrite the user's file."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({**BASE, "run_dir": str(tmp_path),
                                   "target": {"model": str(world["target"])}}))
    text = cfg.read_text()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "_step_fn", _fake_step)
        assert cli.main(["prepare", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "config.yaml was not written by drafter" in err
    assert cfg.read_text() == text and not (tmp_path / "prepare").exists()


def test_a_bad_config_change_keeps_finished_work(world, tmp_path, capsys):
    """The issue's first reproduction: after a complete run, `drafter train CFG
    train.epochs=0` and a mistyped export.checkpoint leave train/, export/ and config.yaml as
    they were; a valid change then runs as before."""
    cfg = _clone(world, tmp_path)
    before = tree(tmp_path)
    for argv in (["train", str(cfg), "train.epochs=0"],
                 ["export", str(cfg), "export.checkpoint=lsat"],
                 ["run", str(cfg), "export.checkpoint=runs/nope/step_1"]):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pipeline, "_step_fn", _fake_step)
            assert cli.main(argv) == 2, argv
    assert tree(tmp_path) == before
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "_step_fn", _fake_step)
        assert cli.main(["train", str(cfg), "train.epochs=2"]) == 0
    run = Run(tmp_path / "run")
    snap = run.config_snapshot().read_text()
    assert snap.startswith("# drafter:") and "epochs: 2" in snap


# ------------------------------------------------------------------------------ user errors
def test_run_dir_below_a_file_is_one_line(world, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert cli.main(["prepare", str(world["cfg"]), f"run_dir={blocker}/run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("drafter: error: cannot use") and str(blocker) in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_run_dir_is_one_line(world, tmp_path, capsys):
    cfg = _clone(world, tmp_path)
    for p in [tmp_path / "run", *(tmp_path / "run").rglob("*")]:
        if p.is_dir():
            p.chmod(0o555)
    try:
        assert cli.main(["train", str(cfg), "train.epochs=2"]) == 2
    finally:
        for p in [tmp_path / "run", *(tmp_path / "run").rglob("*")]:
            if p.is_dir():
                p.chmod(0o755)
    err = capsys.readouterr().err
    assert "Permission denied" in err and "Traceback" not in err


def test_status_of_a_torn_manifest_and_an_unknown_dir(world, tmp_path, capsys):
    """A truncated manifest.json: status exits 0 and shows the step damaged (not done), its
    dependants stale; a folder that is no run dir is one line."""
    _clone(world, tmp_path)
    run = Run(tmp_path / "run")
    m = run.manifest("tokenize")
    m.write_bytes(m.read_bytes()[: m.stat().st_size // 2])
    assert cli.main(["status", str(run.root), "--json"]) == 0
    st = {s["name"]: s for s in json.loads(capsys.readouterr().out)["steps"]}
    assert (st["tokenize"]["state"], st["tokenize"]["activity"]) == ("stale", "damaged")
    assert "manifest.json is unreadable" in st["tokenize"]["error"]
    assert st["prepare"]["state"] == "done" and st["vocab"]["state"] == "stale"
    # an edited manifest fails its checksum the same way
    run2 = Run(tmp_path / "run")
    g = json.loads(run2.manifest("generate").read_text())
    g["counts"]["n"] = 99
    run2.manifest("generate").write_text(json.dumps(g))
    assert pipeline.status(run2.root)["steps"][1]["activity"] == "damaged"
    assert cli.main(["status", str(tmp_path / "nowhere")]) == 2
    assert "is not a drafter run directory" in capsys.readouterr().err


def test_a_damaged_manifest_is_redone_not_cleared(world, tmp_path):
    """A finished step whose manifest is torn resumes in its folder (its outputs kept), the
    manifest is written again, and the steps after it run again."""
    cfg = _clone(world, tmp_path)
    run = Run(tmp_path / "run")
    (run.step_dir("prepare") / "kept.txt").write_text("kept")
    run.manifest("prepare").write_text('{"step": "prep')
    calls = []

    def step(name):
        calls.append(name)
        return _fake_step(name)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "_step_fn", step)
        assert cli.main(["run", str(cfg), "--until", "generate"]) == 0
    assert calls == ["prepare", "generate"]
    assert (run.step_dir("prepare") / "kept.txt").read_text() == "kept"
    assert run.read_manifest("prepare")["checksum"].startswith("sha256:")


def test_check_on_a_config_json_list_is_a_failed_check(tmp_path, capsys):
    d = tmp_path / "eagle"
    d.mkdir()
    (d / "config.json").write_text("[1, 2, 3]")
    assert cli.main(["check", str(d)]) == 1
    out = capsys.readouterr()
    assert "FAIL  format" in out.out and "holds a JSON list, expected an object" in out.out
    assert "Traceback" not in out.err
    (d / "config.json").write_bytes(b'{"architectures": ["\xff"]}')
    assert cli.main(["check", str(d)]) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_a_bug_is_one_line_and_debug_shows_the_traceback(world, tmp_path, capsys):
    cfg = _clone(world, tmp_path)

    def boom(name):
        def main(cfg):
            raise ValueError("a bug in a step")
        return main

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "_step_fn", boom)
        assert cli.main(["prepare", str(cfg), "--force"]) == 1
        err = capsys.readouterr().err
        assert "drafter: internal error: ValueError: a bug in a step" in err
        assert "--debug" in err and "Traceback" not in err
        with pytest.raises(ValueError, match="a bug in a step"):
            cli.main(["--debug", "prepare", str(cfg), "--force"])
        with pytest.raises(ValueError):
            cli.main(["prepare", str(cfg), "--force", "--debug"])


def test_allowed_remote_host_loads_and_warns(world, caplog):
    """generate.server.allow_remote: true lets a non-local host through; the server start
    warns (serve.servers, tested here through the config alone)."""
    from drafter.core import config as C
    from drafter.core.configload import is_local_host

    cfg = C.load(world["cfg"], ["generate.server.host=0.0.0.0",
                                "generate.server.allow_remote=true"])
    assert cfg.generate.server.host == "0.0.0.0" and not is_local_host("0.0.0.0")
    assert is_local_host("127.0.0.1") and is_local_host("localhost")
    assert is_local_host("::1") and is_local_host("[::1]")
