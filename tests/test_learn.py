"""drafter learn's parts that run without vLLM: the kept requests and their retention, the
paired test that decides a swap (its false-swap rate measured on candidates that are no better),
the rollback chain and the pruning of versions, the engine's command line, the front's token
id fields, and one learner round on the embedded SmolLM2 in this process (a candidate trained
from the served drafter with train's own loop, exported, judged). The loop with the real vLLM
is tests/test_vllm_learn.py."""
from __future__ import annotations

import json
import os
import random
import stat
import time

import pytest
from test_agreement import prompts as _hists  # per-prompt histograms of a chain

from drafter.core import config as C
from drafter.core.rundir import Run, read_json
from drafter.learn import engine, front, judge, learner, traffic, versions


def _cfg(tmp_path, *over):
    return C.load(None, [f"run_dir={tmp_path / 'run'}", *over])


# ------------------------------------------------------------------------------------- traffic
def test_kept_requests_are_private_whole_and_bounded_by_count_and_age(tmp_path):
    cfg = _cfg(tmp_path, "learn.max_samples=5", "learn.max_age_hours=1")
    run = Run.of(cfg)
    paths = [traffic.keep(run, [1, 2, 3], [4, 5], 0.0, 1.0, "stop", 0.25) for _ in range(8)]
    d = run.learn("traffic")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in paths)
    # a write killed half way leaves a temp file, which a minute later is swept
    dead = d / ".tmp-x.json.123"
    dead.write_text("{")
    os.utime(dead, (time.time() - 120, time.time() - 120))
    assert [r["id"] for r in traffic.kept(run)] == [p.stem for p in paths]
    assert traffic.prune(run, cfg.learn) == 3 and not dead.exists()
    assert [p.stem for p in traffic.files(run)] == [p.stem for p in paths[3:]]   # the newest
    # two hours on, every one is past max_age_hours
    assert traffic.prune(run, cfg.learn, now=time.time() + 7200) == 5
    assert traffic.kept(run) == []


def test_holdout_is_decided_by_the_id_once_and_near_its_share():
    ids = [f"{i:020d}-{i:08x}" for i in range(4000)]
    share = sum(traffic.split_of(i, 0.25) == "holdout" for i in ids) / len(ids)
    assert 0.22 < share < 0.28
    assert all(traffic.split_of(i, 0.25) == traffic.split_of(i, 0.25) for i in ids[:50])


def test_token_file_trains_on_the_answer_only(tmp_path):
    from drafter.data.tokens import iter_samples

    recs = [{"id": "a", "prompt_ids": [1, 2, 3], "output_ids": [7, 8]},
            {"id": "b", "prompt_ids": [5], "output_ids": []}]        # nothing answered: left out
    assert traffic.write_tokens(recs, tmp_path / "t.parquet") == 1
    (row,) = list(iter_samples(tmp_path / "t.parquet"))
    assert row["input_ids"] == [1, 2, 3, 7, 8] and row["loss_mask"] == [0, 0, 0, 1, 1]


# --------------------------------------------------------------------------------------- judge
def test_a_better_candidate_is_swapped_and_an_equal_one_is_not():
    rng = random.Random(0)
    base = _hists(rng, 32, 20, 0.3, 0.15)
    v = judge.compare(base, _hists(rng, 32, 20, 0.6, 0.15))
    assert v["better"] and v["lower"] > 0 and v["tau_cand"] > v["tau_base"]
    assert not judge.compare(base, base)["better"]
    assert not judge.compare(base[:1], base[:1])["better"]        # one prompt: no test


def test_false_swaps_stay_at_the_tests_rate():
    """Candidates exactly as good as the served drafter, each judged on its own draw of 16
    prompts: the share judged better stays near ALPHA (0.01), well below 5%."""
    rng = random.Random(1)
    swaps = sum(judge.compare(_hists(rng, 16, 12, 0.4, 0.15),
                              _hists(rng, 16, 12, 0.4, 0.15))["better"] for _ in range(400))
    assert swaps / 400 < 0.05


def test_few_held_out_prompts_keep_the_false_swap_rate():
    """Early rounds judge on a handful of held-out prompts, where the variance is itself a
    rough estimate: judged on 3 prompts, equal candidates still pass at about ALPHA (Student's
    t with 2 degrees of freedom), not the 6-7% a normal quantile lets through."""
    rng = random.Random(2)
    swaps = sum(judge.compare(_hists(rng, 3, 12, 0.4, 0.15),
                              _hists(rng, 3, 12, 0.4, 0.15))["better"] for _ in range(2000))
    assert swaps / 2000 < 0.025


def test_student_t_quantiles():
    from drafter.measure.agreement import t_critical, z_critical

    # two-sided 0.02 = one-sided 0.01: the printed table's values
    for df, t in [(1, 31.821), (2, 6.965), (3, 4.541), (10, 2.764), (30, 2.457)]:
        assert abs(t_critical(0.02, df) - t) < 1e-3
    assert abs(t_critical(0.05, 2) - 4.303) < 1e-3
    assert t_critical(0.02, 5000) == z_critical(0.02)


# ------------------------------------------------------------------------------------ versions
def test_rollback_goes_to_the_drafter_served_before_and_pruning_keeps_every_served(tmp_path):
    run = Run.of(_cfg(tmp_path))
    for n in range(6):
        (run.learn_version(n)).mkdir(parents=True)
        (run.learn_version(n) / versions.META).write_text("{}")
    with pytest.raises(versions.VersionError, match="nothing served"):
        versions.rollback_target(run)
    versions.set_serving(run, "v0000", {"kind": "start"})
    with pytest.raises(versions.VersionError, match="first drafter"):
        versions.rollback_target(run)
    versions.set_serving(run, "v0002", {"kind": "swap", "from": "v0000"})
    assert versions.rollback_target(run) == "v0000"
    assert versions.rollback_target(run, "v0001") == "v0001"
    with pytest.raises(versions.VersionError, match="no such"):
        versions.rollback_target(run, "v0009")
    versions.propose(run, {"version": "v0003", "based_on": "v0002"})
    # v0001, v0004 and v0005 were never served; v0003 is proposed: v0001 goes
    assert versions.prune(run, keep=2) == ["v0001"]
    assert versions.versions(run) == ["v0000", "v0002", "v0003", "v0004", "v0005"]
    assert read_json(run.learn("serving.json"))["version"] == "v0002"


# -------------------------------------------------------------------------------------- engine
def test_engine_command_serves_the_drafter_with_the_swap_backend(tmp_path, tiny_target):
    pytest.importorskip("vllm")
    cfg = _cfg(tmp_path, f"target.model={tiny_target}",
               "target.engine_args={enforce_eager: true, max_model_len: 512}",
               "export.speculative_tokens=2", "generate.server.extra_args=[--x]")
    argv = engine.command(cfg, 1234, tmp_path / "v0003")
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(tmp_path / "v0003"),
                    "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"}
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == \
        {"backend": "drafter_files"}
    assert argv[argv.index("--worker-extension-cls") + 1] == engine.EXTENSION
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and "--enforce-eager" in argv
    assert argv[argv.index("--model") + 1] == str(tiny_target)
    assert argv[argv.index("--served-model-name") + 1] == str(tiny_target)
    assert argv[argv.index("--max-model-len") + 1] == "512" and argv[-1] == "--x"
    assert engine.flags({"a_b": False, "c": [1], "d": None}) == ["--no-a-b", "--c", "[1]"]


def test_served_acceptance_counters_are_read_from_prometheus_text():
    text = ("# HELP x\nvllm:spec_decode_num_drafts_total{engine=\"0\",model_name=\"m\"} 7.0\n"
            "vllm:spec_decode_num_draft_tokens_total{engine=\"0\"} 21.0\n"
            "vllm:spec_decode_num_accepted_tokens_total{engine=\"0\"} 9.0\n"
            "vllm:spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"} 5.0\n")
    assert engine.parse_counters(text) == {"drafts": 7, "draft_tokens": 21, "accepted": 9}


# --------------------------------------------------------------------------------------- front
def test_front_takes_the_token_ids_it_asked_for_out_again():
    obj = {"prompt_token_ids": [1, 2], "choices": [
        {"index": 0, "token_ids": [5, 6], "finish_reason": "stop"},
        {"index": 1, "token_ids": [7], "finish_reason": "length"}]}
    answers: dict = {}
    assert front._collect(obj, answers, asked=False) == [1, 2]
    assert answers == {0: {"ids": [5, 6], "finish": "stop"}, 1: {"ids": [7], "finish": "length"}}
    assert obj["prompt_token_ids"] is None and obj["choices"][0]["token_ids"] is None
    # streamed: deltas add up; a client that asked keeps them
    chunk = {"choices": [{"index": 0, "token_ids": [8]}]}
    front._collect(chunk, answers, asked=True)
    assert answers[0]["ids"] == [5, 6, 8] and chunk["choices"][0]["token_ids"] == [8]


# ------------------------------------------------------------------------------------- learner
def _keep(run, split: str) -> dict:
    """A kept request of the given split (others drawn on the way are deleted)."""
    while True:
        p = traffic.keep(run, [1, 2], [3, 4], 0.0, 1.0, "stop", 0.4)
        r = read_json(p)
        if r["split"] == split:
            return r
        p.unlink()


def test_a_round_waits_for_enough_new_requests_and_keeps_its_held_out_set(tmp_path):
    cfg = _cfg(tmp_path, "learn.round_samples=4", "learn.eval_prompts=3")
    run = Run.of(cfg)
    versions.set_serving(run, "v0000", {"kind": "start"})
    hold = [_keep(run, "holdout") for _ in range(4)][-3:]
    for _ in range(3):
        _keep(run, "train")
    assert learner.next_round(run, cfg.learn) is None          # 3 new: not yet
    _keep(run, "train")
    rec = learner.next_round(run, cfg.learn)
    assert rec["round"] == 1 and rec["base"] == "v0000" and rec["samples"] == 4
    assert read_json(run.learn_round(1) / "holdout.json") == hold
    # a restart finds the same round, whatever came in since
    traffic.keep(run, [9], [9], 0.0, 1.0, "stop", 0.4)
    assert learner.next_round(run, cfg.learn) == rec
    learner.finish_round(run, rec)
    assert not (run.learn_round(1) / "train.parquet").exists()
    assert not (run.learn_round(1) / "holdout.json").exists()
    assert learner.next_round(run, cfg.learn) is None          # nothing new since


@pytest.mark.usefixtures("one_thread")
def test_one_round_trains_a_candidate_from_the_served_drafter_and_judges_it(
        tmp_path, smollm2_dir, shared_data):
    """v0000 a random drafter; 12 kept requests with the target's own greedy answers; one
    round in this process: v0001 trained from v0000 by train's loop, exported without
    embed_tokens, judged against v0000 on the held-out requests, proposed only when better."""
    import torch

    from drafter.core.target import load_model, load_tokenizer
    from drafter.core.weights import target_embeddings
    from drafter.export.engines import target_info
    from drafter.train.trainer import build_drafter

    cfg = _cfg(tmp_path, f"target.model={smollm2_dir}", "target.dtype=float32",
               "learn.round_samples=6", "learn.eval_prompts=4", "learn.holdout=0.4",
               "train.max_steps=8", "train.batch_tokens=512", "train.max_length=256",
               "train.ttt_steps=2", "train.lr=3e-3", "train.log_every=4", "train.save_every=4",
               "evaluate.max_new_tokens=24", "export.speculative_tokens=2",
               "export.dtype=float32", "extract.teacher=topk", "extract.topk=8")
    run = Run.of(cfg)
    tc = target_info(cfg.target.model, cfg.target)
    emb = target_embeddings(cfg.target)
    Vd = 2048
    t2d = torch.zeros(emb.shape[0], dtype=torch.bool)
    t2d[:Vd] = True
    from drafter.core import target as T

    base = build_drafter(cfg, T.load_config(cfg.target), [2, 15, 27],
                         torch.zeros(Vd, dtype=torch.long), t2d, emb)
    versions.write_version(run, 0, base, tc, torch.float32, {"from": "random"})
    versions.set_serving(run, "v0000", {"kind": "start"})
    assert not (run.learn_version(0) / "model.safetensors").stat().st_size > 30e6  # no table

    tok, model = load_tokenizer(cfg.target), load_model(cfg.target, "cpu", torch.float32)
    convs = json.loads((shared_data / "train/sharegpt_dummy_conversation.json").read_text())
    hold = train = 0
    for c in convs[:60]:
        text = tok.apply_chat_template([{"role": "user", "content": c["conversations"][0]
                                         ["value"][:300]}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok(text, add_special_tokens=False).input_ids
        out = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
        p = traffic.keep(run, ids, out[0, len(ids):].tolist(), 0.0, 1.0, "stop", 0.4)
        split = read_json(p)["split"]
        if (split == "train" and train >= 8) or (split == "holdout" and hold >= 4):
            p.unlink()
            continue
        train, hold = train + (split == "train"), hold + (split == "holdout")
        if train >= 8 and hold >= 4:
            break
    assert learner.main(cfg, once=True) == 0
    res = read_json(run.learn_round(1) / "judged.json")
    meta = versions.version_meta(run, "v0001")
    assert meta["base"] == "v0000" and meta["round"] == 1 and meta["steps"] == 8
    assert res["prompts"] == 4 and res["tau_base"] == 1.0 and res["tau_cand"] > 1.0
    prop = versions.proposal(run)
    assert (prop is not None) == res["better"]
    if prop:
        assert prop["based_on"] == "v0000" and prop["figures"]["lower"] > 0
    from drafter.export.enginedir import load_drafter_dir

    cand = load_drafter_dir(run.learn_version(1), target=tc)
    assert not torch.equal(cand.fc.weight, base.fc.weight.to(cand.fc.weight.dtype))
    assert torch.equal(cand.embed_tokens.weight, emb.to(cand.embed_tokens.weight.dtype))
    # the round's copies of traffic and its checkpoints are gone; the state moved on
    assert sorted(p.name for p in run.learn_round(1).iterdir()) == ["judged.json", "round.json"]
    assert read_json(run.learn("learner.json"))["round"] == 1


def test_the_learner_on_a_cpu_decodes_with_one_thread(tmp_path, smollm2_dir):
    """On a CPU vLLM's threads hold the cores: the learner's torch threads, waiting for each
    other at every op, stalled the judge's decoding for minutes a round (docs/learn.md, "On a
    CPU"). Whatever count the process started with, the learner's models leave it one."""
    import torch

    cfg = _cfg(tmp_path, f"target.model={smollm2_dir}", "target.dtype=float32")
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        models = learner.Models(cfg, Run.of(cfg))
        assert str(models.device) == "cpu"
        assert torch.get_num_threads() == learner.CPU_THREADS == 1
    finally:
        torch.set_num_threads(n)
