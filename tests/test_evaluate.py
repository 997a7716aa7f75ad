"""The evaluate step end to end on SmolLM2 (metrics.json, report.md, plots, `drafter report`), the
lossless verdicts, MT-bench's second turn, and the errors a user can act on. CPU, float32."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drafter.core import config as C
from drafter.core.rundir import Run
from drafter.decoding.decode import Output
from drafter.measure.lossless import compare
from drafter.measure.report import render_report, report
from drafter.steps import evaluate as E
from drafter.train.model import Drafter, DrafterConfig, save_drafter

REPO = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


def _drafter_dir(target_dir, out: Path, seed: int, native: bool = False) -> Path:
    """A random drafter for the target in `target_dir`: a checkpoint dir (save_drafter), or an
    exported native dir."""
    from transformers import AutoConfig

    from drafter.core.target import default_layer_ids
    from drafter.export import engines

    tc = AutoConfig.from_pretrained(target_dir)
    torch.manual_seed(seed)
    dr = Drafter(DrafterConfig.from_target(tc, 1024, default_layer_ids(tc.num_hidden_layers),
                                           intermediate_size=256))
    out.mkdir(parents=True)
    if native:
        engines.write_dir(dr, out, engines.NATIVE, target=engines.target_info(str(target_dir)))
    else:
        save_drafter(dr, out)
    return out


def _out(tokens, gaps=None, second=None):
    return Output(tokens, "length", len(tokens) - 1, None, gaps, second)


def test_lossless_verdicts():
    plain = _out([5, 6, 7, 8], gaps=[[3.0, 4, 5], [0.01, 0.02, 0.9], [2.0, 3, 4], [1.0, 2, 3]],
                 second=[[9, 1, 2], [4, 3, 2], [9, 1, 2], [9, 1, 2]])
    assert compare(plain, _out([5, 6, 7, 8]), 0.0) == ("identical", None)
    v, info = compare(plain, _out([5, 4, 1, 1]), 0.05)   # the runner-up, 0.01 apart: a tie
    assert v == "tie" and info["index"] == 1 and info["gap"] == 0.01 and info["rank"] == 2
    v, info = compare(plain, _out([5, 3, 1, 1]), 0.05)   # the third, 0.02 apart: a tie too
    assert v == "tie" and info["gap"] == 0.02 and info["rank"] == 3
    assert compare(plain, _out([5, 4, 1, 1]), 0.0)[0] == "mismatch"   # float32: no tolerance
    assert compare(plain, _out([5, 2, 1, 1]), 0.5)[0] == "mismatch"   # 0.9 below the top
    assert compare(plain, _out([5, 7, 1, 1]), 1.0)[0] == "mismatch"   # not a runner-up
    v, info = compare(plain, _out([5, 6, 7, 8, 2]), 1.0)               # longer
    assert v == "mismatch" and info["index"] == 4


def test_second_mt_bench_turn_carries_the_model_answer(smollm2_dir, shared_data):
    from transformers import AutoTokenizer

    from drafter.data.sources import load_prompts

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    recs = load_prompts(str(shared_data / "eval" / "mt_bench_questions.jsonl"), 2)
    p = E._Prompts(tok, recs, 8192, 16)
    first = p.build(0, {})
    assert [i for i, _ in first] == [0, 1]
    answers = {0: ["ANSWER-ZERO"], 1: ["ANSWER-ONE"]}
    second = p.build(1, answers)
    text = tok.decode(second[0][1])
    users = [m["content"] for m in recs[0]["messages"] if m["role"] == "user"]
    i0, ia, i1 = text.index(users[0][:40]), text.index("ANSWER-ZERO"), text.index(users[1][:40])
    assert i0 < ia < i1 and "ANSWER-ONE" not in text
    assert text.rstrip().endswith("assistant")          # generation prompt last
    assert p.build(2, answers) == []                     # MT-bench has two turns


def test_plain_is_timed_without_runners_up_and_checked_with_them(smollm2_dir, shared_data):
    """At T=0 the timed plain pass records no runners-up (the reference speedups divide by) and
    the rounds are decoded again recording them: the tokens are the timed pass's, with gaps;
    MT-bench's second turns are built once, from the timed answers. At T=1: one pass."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafter.data.sources import load_prompts
    from drafter.decoding.decode import NEAR, Decoder, stop_ids_of

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    recs = load_prompts(str(shared_data / "eval" / "mt_bench_questions.jsonl"), 2)
    dec, stop = Decoder(model, max_batch=4), stop_ids_of(tok, model)
    timed, _ = E._decode(dec, E._Prompts(tok, recs, 8192, 6), None, 6, stop, 0.0,
                         record_gaps=False)
    assert all(o.gaps is None for _, _, o in timed)
    p = E._Prompts(tok, recs, 8192, 6)
    outs, stats = E._plain(dec, p, 6, stop, 0.0, "plain", True)
    assert [o.tokens for _, _, o in outs] == [o.tokens for _, _, o in timed]
    assert len(outs) == 4 and len(p.rounds) == 2                       # two turns each
    assert all(len(o.gaps) == len(o.tokens) and len(o.gaps[0]) == NEAR for _, _, o in outs)
    assert stats["iterations"] > 0
    once, _ = E._plain(dec, E._Prompts(tok, recs, 8192, 6), 6, stop, 1.0, "plain", True)
    assert all(o.gaps is None for _, _, o in once)


def test_evaluate_end_to_end(steady_speed, smollm2_dir, shared_data, tmp_path):
    """Two drafters (a checkpoint; an exported native dir as the baseline), chain and tree, three
    datasets: lossless, τ, per-position acceptance, speed columns, plots, `drafter report`.
    The target is a tiny random Llama with SmolLM2's tokenizer and chat template (SmolLM2 itself
    is decoded in tests/test_decode.py)."""
    from tests.tiny import make_tiny

    target = make_tiny("llama", tmp_path, tokenizer_dir=smollm2_dir)
    main = _drafter_dir(target, tmp_path / "ckpt", 0)
    base = _drafter_dir(target, tmp_path / "native", 1, native=True)
    ev = shared_data / "eval"
    cfg = C.load(None, [
        f"run_dir={tmp_path / 'run'}", f"target.model={target}",
        f"evaluate.drafter={main}", f"evaluate.baseline={base}",
        "evaluate.max_new_tokens=8", "evaluate.methods=[chain, tree]", "evaluate.k=2",
        "evaluate.tree_depth=2", "evaluate.tree_topk=2", "evaluate.tree_tokens=3",
        "evaluate.batch_size=2",
        "evaluate.datasets=[{name: mt_bench, path: %s, max_prompts: 1}, "
        "{name: humaneval, path: 'builtin:humaneval', max_prompts: 1}, "
        "{name: gsm8k, path: %s, max_prompts: 1}]" % (ev / "mt_bench_questions.jsonl",
                                                       ev / "gsm8k_test.jsonl")])
    res = E.main(cfg)
    assert res["lossless"] is True and res["counts"]["mismatches"] == 0
    assert res["counts"]["prompts"] == 4 and res["counts"]["runs"] in (4, 5)

    run = Run.of(cfg)
    m = json.loads(run.eval_metrics().read_text())
    assert m["lossless"] is True
    assert set(m["datasets"]) == {"mt_bench", "humaneval", "gsm8k", "overall"}
    s = m["settings"]
    assert s["primary"] == {"name": "drafter: chain K=2, T=0", "drafter": "drafter",
                            "method": "chain", "temperature": 0.0, "k": 2}
    assert s["datasets"]["mt_bench"]["prompts"] == 2     # both turns
    assert s["baseline"] == str(base) and s["dtype"] == "float32"
    assert s["cuda_graphs"] is False and s["prefill_graph_tokens"] == 0   # the CPU: none
    assert "CUDA graphs: off)" in render_report(m)
    graphed = {**m, "settings": {**s, "cuda_graphs": True, "prefill_graph_tokens": 2048}}
    assert "CUDA graphs: on, prefills of up to 2048 tokens graphed)" in render_report(graphed)
    # the untimed warm-up: MT-bench's first round (1 prompt), 2 tokens, before any timed pass
    assert s["warm_up"]["prompts"] == 1 and s["warm_up"]["seconds"] > 0
    for r in m["runs"]:
        D = r.get("k") or r["depth"]
        for name, d in r["datasets"].items():
            assert d["tau"] >= 1.0 and len(d["acceptance"]) == len(d["acceptance_conditional"]) == D
            assert sum(d["accept_hist"]) == d["steps"] > 0
            assert d["tau"] == pytest.approx(1 + d["accepted"] / d["steps"])
            assert d["drafted"] == d["steps"] * (r.get("k") or r["tokens"])
            assert d["lossless"]["mismatch"] == 0 and d["lossless"]["compared"] == d["prompts"]
            assert d["tokens_per_s"] > 0 and d["plain_tokens_per_s"] > 0 and d["speedup"] > 0
            # a step's own time leaves the prefills out; the end-to-end figures keep them
            assert 0 < d["prefill_seconds"] < d["seconds"]
            assert d["decode_step_ms"] == pytest.approx(
                1000 * (d["seconds"] - d["prefill_seconds"]) / d["iterations"],
                abs=0.1 / d["iterations"] + 1e-3)   # both seconds rounded to 1e-4
            assert d["decode_step_ms"] < d["step_ms"] and d["plain_decode_step_ms"] > 0
            p = m["plain"]["0.0"][name]
            assert d["decode_speedup"] == pytest.approx(
                (p["seconds"] - p["prefill_seconds"]) / (d["seconds"] - d["prefill_seconds"]),
                rel=2e-3)
        assert r["timing"]["verify_ms"] > 0 and 0 < r["timing"]["c"]
        ov = r["datasets"]["overall"]
        assert ov["prompts"] == 4
        assert ov["steps"] == sum(d["steps"] for n, d in r["datasets"].items() if n != "overall")
    assert [r["drafter"] for r in m["runs"]][:4] == ["drafter", "drafter", "baseline",
                                                     "baseline"]
    # each step against what it must run at the shapes it ran at (the forwards timed there)
    for d in [m["plain"]["0.0"]["overall"]] + [r["datasets"]["overall"] for r in m["runs"]]:
        assert sum(n for n, _ in d["parts_by_shape"].values()) == d["iterations"]
        assert sum(d["spans"].values()) == d["iterations"]
        assert all(ms > 0 for _, ms in d["parts_by_shape"].values())
        assert d["x_parts"] == pytest.approx(d["decode_step_ms"] / d["parts_ms"], rel=2e-3)
        assert d.get("step_gpu_ms") is None                # the CPU: no GPU time
    assert "| x parts |" in run.eval_report().read_text()
    # the serving setting: chains K=1..2 and the drafter's tree, at batch 1 and 2
    rec = s["recommended"]
    assert set(rec["by_batch"]) == {"1", "2"} and rec["calibration"]["spec_ratio"] > 0
    # every dataset has one prompt a round: batch_size 2, but every step ran at 1 row, and the
    # calibration compares those steps with the costs timed at 1 row, not at 2
    for r in m["runs"]:
        assert all(d["rows_per_step"] == 1.0 for d in r["datasets"].values())
    assert rec["calibration"]["batch"] == 1
    assert "the steps ran at 1.0 rows on average" in run.eval_report().read_text()
    assert rec["calibration"]["static_batch_efficiency"] > 0
    for r in rec["by_batch"].values():
        assert [x["setting"] for x in r["settings"]][:3] == \
            ["chain K=1", "chain K=2", "tree depth=2 topk=2 tokens=3"]
        # and the smaller trees the greedy tree run stands for: the best size at each depth
        est = r["settings"][3:]
        assert est and all(x["estimated"] for x in est)
        assert [x["tree"]["depth"] for x in est] == sorted({x["tree"]["depth"] for x in est})
        assert all(x["tree"]["topk"] == 2 and x["tree"]["tokens"] <= 3 and
                   (x["tree"]["depth"], x["tree"]["tokens"]) != (2, 3) for x in est)
        assert r["best"] in [x["setting"] for x in r["settings"]] and r["flags"]["sglang"]
    # the tuner's best setting at the batch evaluated was decoded too: a run of its own (a fifth)
    # unless a configured run was it, marked, with its measured speedup beside the expected one
    best = rec["by_batch"]["1"]["best"]
    marked = [r for r in m["runs"] if r.get("recommended")]
    assert len(marked) == 1 and marked[0]["name"] == f"drafter: {best}, T=0"
    assert len(m["runs"]) == (4 if best in ("chain K=2", "tree depth=2 topk=2 tokens=3") else 5)
    got = rec["measured"]
    assert got["run"] == marked[0]["name"] and got["batch"] == 1
    assert got["speedup"] == marked[0]["datasets"]["overall"]["speedup"] > 0
    assert got["expected_speedup"] == rec["by_batch"]["1"]["expected_speedup"]
    assert marked[0]["datasets"]["overall"]["lossless"]["mismatch"] == 0
    assert f"(the run `{got['run']}`)" in run.eval_report().read_text()
    # the greedy tree run's counts by smaller shape: its own shape is every step, as accepted
    tree_run = next(r for r in m["runs"] if r["name"] == "drafter: tree depth=2 topk=2 tokens=3, "
                    "T=0")
    for d in tree_run["datasets"].values():
        sh = d["tree_shapes"]
        assert sh["valid"][1][2] == d["steps"] and sh["accepted"][1][2] == d["accepted"]
        assert sh["valid"][0][0] == d["steps"]       # one node at depth 1: always verified

    report = run.eval_report().read_text()
    assert "## Serving setting" in report and "**(best)**" in report and "*(estimated)*" in report
    assert "Lossless: PASS" in report and "| drafter: tree depth=2 topk=2 tokens=3, T=0 |" in report
    assert "baseline: chain K=2, T=0" in report and "| decode ms | plain decode ms |" in report
    assert "| speedup | decode speedup |" in report
    for name in ("acceptance", "tau"):
        assert run.eval_plot(name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    cli = subprocess.run([sys.executable, "-m", "drafter.cli", "report", str(run.root)],
                         capture_output=True, text=True, cwd=REPO)
    assert cli.returncode == 0 and cli.stdout == report


def test_a_block_drafter_evaluates(steady_speed, smollm2_dir, tmp_path, caplog):
    """A DSpark checkpoint (drafter.train.dspark: random weights for a tiny target with
    SmolLM2's tokenizer): its chain is its whole block (K = 3, evaluate.k aside), lossless at
    T=0, sampled and block-verified at T=1, no tree (logged); its step against its parts (the
    block forward and the Markov positions timed), the confidence head's calibration in the
    metrics and the report, and the tuner's settings served as vLLM's dspark method."""
    from transformers import AutoConfig

    from drafter.core.target import default_block_layer_ids
    from drafter.train.dspark import DSpark, DSparkConfig
    from tests.tiny import make_tiny

    target = make_tiny("llama", tmp_path, tokenizer_dir=smollm2_dir)
    tc = AutoConfig.from_pretrained(target)
    torch.manual_seed(0)
    dr = DSpark(DSparkConfig.from_target(tc, "dspark", 1024, default_block_layer_ids(6, 3), 3,
                                         tc.vocab_size - 1, layers=1, markov_rank=8,
                                         confidence_head=True, intermediate_size=128))
    save_drafter(dr, tmp_path / "ckpt")
    cfg = C.load(None, [
        f"run_dir={tmp_path / 'run'}", f"target.model={target}",
        f"evaluate.drafter={tmp_path / 'ckpt'}", "evaluate.max_new_tokens=8",
        "evaluate.methods=[chain, tree, block]", "evaluate.temperatures=[0.0, 1.0]",
        "evaluate.batch_size=2",
        "evaluate.datasets=[{name: humaneval, path: 'builtin:humaneval', max_prompts: 2}]"])
    res = E.main(cfg)
    assert res["lossless"] is True and res["counts"]["mismatches"] == 0
    assert caplog.text.count("drafts a chain: no tree run for it") == 1
    m = json.loads(Run.of(cfg).eval_metrics().read_text())
    assert [(r["method"], r["temperature"], r["k"]) for r in m["runs"][:3]] == \
        [("chain", 0.0, 3), ("chain", 1.0, 3), ("block", 1.0, 3)]
    for r in m["runs"]:
        assert r["kind"] == "dspark" and "depth" not in r
        t, ov = r["timing"], r["datasets"]["overall"]
        assert t["markov_ms"] > 0 and t["c"] == pytest.approx(
            (t["draft_ms"] + r["k"] * t["markov_ms"]) / t["verify_ms"], rel=0.05)
        assert ov["x_parts"] > 0 and ov["parts_ms"] > 0
        c = ov["confidence"]
        assert len(c["predicted"]) == r["k"]
        if r.get("cut") is None:  # (a cut run tests the positions its cut lets through)
            assert c["tested"][0] == ov["steps"]
            assert c["measured"] == pytest.approx(ov["acceptance_conditional"])
        assert all(0 < p < 1 for p in c["predicted_unconditional"])
    report = Run.of(cfg).eval_report().read_text()
    assert "## Confidence head" in report and "a Markov position" in report
    rec = m["settings"]["recommended"]["by_temperature"]
    assert set(rec) == {"0.0", "1.0"}
    for x in (x for r in rec.values() for x in r["by_batch"].values()):
        assert {row["k"] for row in x["settings"]} >= {1, 2, 3}
        assert '"method": "dspark"' in x["flags"]["vllm"] and x["flags"]["sglang"] is None
        cut = [row for row in x["settings"] if row.get("cut") is not None]
        assert len(cut) == 1 and cut[0]["estimated"] and cut[0]["verified"] <= cut[0]["k"]
    # the best setting at the batch evaluated, decoded: a cut one with a cut proposer
    for T, r in rec.items():
        best = r["by_batch"][str(r["calibration"]["batch"])]["best"]
        run = next(x for x in m["runs"] if x["name"] == r["measured"]["run"])
        assert run["name"] == f"drafter: {best}, T={float(T):g}" and run.get("recommended")
        assert run.get("cut") == (float(best.split("cut=")[1]) if "cut=" in best else None)


def test_continuous_and_static_batches_give_the_same_decodings(smollm2_dir, shared_data,
                                                               tmp_path, monkeypatch):
    """evaluate.continuous (the default): 5 prompts at batch_size 2 decode with rows refilled
    as answers end; every greedy output, plain and speculative, is the static batches' (float32:
    the same τ, accepted tokens and steps per run), and the settings say which batching ran."""
    from tests.tiny import make_tiny

    target = make_tiny("llama", tmp_path, tokenizer_dir=smollm2_dir)
    from drafter.decoding.decode import Decoder

    dr = _drafter_dir(target, tmp_path / "native", 0, native=True)
    got, calls, real = {}, [], Decoder._continuous
    monkeypatch.setattr(Decoder, "_continuous", lambda *a: (calls.append(1), real(*a))[1])
    for cont in (True, False):
        calls.clear()
        cfg = C.load(None, [
            f"run_dir={tmp_path / f'run-{cont}'}", f"target.model={target}",
            f"evaluate.drafter={dr}", "evaluate.max_new_tokens=6",
            "evaluate.methods=[chain, tree]", "evaluate.k=2", "evaluate.tree_depth=2",
            "evaluate.tree_topk=2", "evaluate.tree_tokens=3", "evaluate.batch_size=2",
            f"evaluate.continuous={str(cont).lower()}", "evaluate.run_recommended=false",
            "evaluate.datasets=[{name: gsm8k, path: %s, max_prompts: 5}]"
            % (shared_data / "eval" / "gsm8k_test.jsonl")])
        assert E.main(cfg)["lossless"] is True
        m = json.loads(Run.of(cfg).eval_metrics().read_text())
        assert m["settings"]["continuous"] is cont
        # plain timed, plain recording runners-up, chain, tree (the warm-up: one batch)
        assert len(calls) == (4 if cont else 0)
        assert len(m["runs"]) == 2 and not any(r.get("recommended") for r in m["runs"])
        got[cont] = [(r["name"], d["prompts"], d["tau"], d["accepted"], d["steps"],
                      d["new_tokens"]) for r in m["runs"] for d in [r["datasets"]["gsm8k"]]]
        assert all(p == 5 for _, p, *_ in got[cont])
    assert got[True] == got[False]


def test_a_mismatch_is_reported_and_fails_the_step(tmp_path):
    """finish() writes everything, then raises naming the first divergence; `drafter report`
    then exits 1."""
    ds = {"tau": 1.5, "prompts": 2, "steps": 4, "drafted": 8, "accepted": 2, "accept_rate": 0.25,
          "new_tokens": 8, "acceptance": [0.5, 0.0], "acceptance_conditional": [0.5, 0.0],
          "accept_hist": [2, 2, 0], "tokens_per_s": 3.0, "plain_tokens_per_s": 2.0,
          "speedup": 1.5, "step_ms": 1.0, "plain_step_ms": 1.0,
          "lossless": {"compared": 2, "identical": 1, "tie": 0, "mismatch": 1,
                       "divergences": [{"record": 1, "turn": 1, "verdict": "mismatch",
                                        "index": 3, "plain": 42, "speculative": 7,
                                        "gap": 2.5}]}}
    runs = [{"name": "drafter: chain K=2, T=0", "drafter": "drafter", "method": "chain",
             "temperature": 0.0, "k": 2, "path": "x",
             "timing": {"target_ms": 1.0, "verify_ms": 1.2, "draft_ms": 0.1, "c": 0.083},
             "datasets": {"humaneval": ds, "overall": dict(ds, lossless={
                 "compared": 2, "identical": 1, "tie": 0, "mismatch": 1})}}]
    settings = {"target": "t", "device": "cpu", "dtype": "float32", "drafter": "x",
                "baseline": None, "max_new_tokens": 4, "batch_size": 1, "temperatures": [0.0],
                "seed": 0, "cuda_graphs": False, "tie_tolerance": 0.0,
                "datasets": {"humaneval": {"path": "builtin:humaneval", "records": 2,
                                           "prompts": 2}}}
    run = Run(tmp_path / "run")
    with pytest.raises(E.EvaluateError, match="NOT lossless: 1 prompt.*'plain': 42"):
        E.finish(run, settings, runs, {})
    m = json.loads(run.eval_metrics().read_text())
    assert m["lossless"] is False and m["mismatches"] == 1
    assert "Lossless: FAIL" in run.eval_report().read_text()
    assert report(run.root) == 1


def test_report_without_an_evaluation_names_the_step(tmp_path):
    cli = subprocess.run([sys.executable, "-m", "drafter.cli", "report", str(tmp_path)],
                         capture_output=True, text=True, cwd=REPO)
    assert cli.returncode == 2 and "drafter evaluate" in cli.stderr


def test_config_errors_name_the_key(smollm2_dir, tmp_path):
    def cfg(*over):
        return C.load(None, [f"run_dir={tmp_path / 'run'}", f"target.model={smollm2_dir}",
                             *over])

    with pytest.raises(E.EvaluateError, match="temperatures must include 0"):
        E.main(cfg("evaluate.temperatures=[0.7]"))
    # refused when the config loads; the step keeps its own check for configs built otherwise
    with pytest.raises(C.ConfigError,
                       match=r"evaluate\.methods\[0\]: must be chain, tree or block"):
        cfg("evaluate.methods=[beam]")
    with pytest.raises(E.EvaluateError, match="unknown method 'beam'"):
        E.main(C.load(None, [f"run_dir={tmp_path / 'run'}", f"target.model={smollm2_dir}",
                             "evaluate.methods=[beam]"], validate=False))
    with pytest.raises(E.EvaluateError, match="evaluate.drafter: .*nowhere not found"):
        E.main(cfg(f"evaluate.drafter={tmp_path / 'nowhere'}"))
    with pytest.raises(Exception, match="drafter export CONFIG"):   # MissingInput: run export
        E.main(cfg())


def test_a_drafter_for_another_target_is_refused(smollm2_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.tiny import make_tiny

    model = AutoModelForCausalLM.from_pretrained(make_tiny("llama", tmp_path))
    d = _drafter_dir(smollm2_dir, tmp_path / "ckpt", 0)
    from drafter.train.model import load_drafter

    with pytest.raises(E.EvaluateError, match="target_hidden_size 576 != the target's 64"):
        E._check_drafter(load_drafter(d), model, "drafter", d)


def test_a_killed_evaluate_resumes_after_its_finished_passes(steady_speed, smollm2_dir,
                                                             shared_data, tmp_path, caplog):
    """kill -9 once the first decoding pass is kept; the rerun decodes only the passes left and
    ends with the metrics of an uninterrupted run (tokens, τ, verdicts: float32 on CPU)."""
    import os
    import signal
    import time

    from tests.tiny import make_tiny

    target = make_tiny("llama", tmp_path, tokenizer_dir=smollm2_dir)
    dr = _drafter_dir(target, tmp_path / "ckpt", 0)
    ev = shared_data / "eval"

    def cfg(name):
        return C.load(None, [
            f"run_dir={tmp_path / name}", f"target.model={target}", f"evaluate.drafter={dr}",
            "evaluate.max_new_tokens=24", "evaluate.methods=[chain]", "evaluate.k=2",
            "evaluate.temperatures=[0.0, 1.0]", "evaluate.batch_size=2",
            "evaluate.datasets=[{name: mt_bench, path: %s, max_prompts: 2}]"
            % (ev / "mt_bench_questions.jsonl")])

    E.main(cfg("whole"))
    whole = json.loads(Run.of(cfg("whole")).eval_metrics().read_text())

    killed = cfg("killed")
    (tmp_path / "killed.yaml").write_text(C.dump(killed))
    passes = Run.of(killed).step_dir("evaluate") / "passes"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys, torch; torch.set_num_threads(1); "
         "from drafter.core import config as C; from drafter.steps import evaluate as E; "
         "E.main(C.load(sys.argv[1], []))", str(tmp_path / "killed.yaml")],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while not (passes.is_dir() and any(passes.glob("*.json"))) and proc.poll() is None:
        assert time.time() - t0 < 300
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = len(list(passes.glob("*.json")))
    assert 1 <= kept < 4                               # 4 passes: plain and chain at T=0 and 1
    older = sorted(passes.glob("*.json"))[0]  # a pass in an older layout (its figures at the
    d = json.loads(older.read_text())          # top, no shapes): decoded again, not trusted
    older.write_text(json.dumps({**{k: v for k, v in d.items() if k != "stats"},
                                 **{k: d["stats"][k] for k in ("seconds", "iterations")}}))

    with caplog.at_level("INFO", logger="drafter"):
        E.main(killed)
    assert caplog.text.count("kept from the interrupted run") == kept - 1
    again = json.loads(Run.of(killed).eval_metrics().read_text())
    assert not passes.exists()                         # cleaned up once the metrics are written
    for a, b in zip(whole["runs"], again["runs"]):
        assert a["name"] == b["name"]
        for key in ("tau", "steps", "accepted", "new_tokens", "accept_hist", "lossless"):
            assert a["datasets"]["mt_bench"].get(key) == b["datasets"]["mt_bench"].get(key), key
        assert sum(b["datasets"]["overall"]["spans"].values()) == \
            b["datasets"]["overall"]["iterations"]
    assert whole["settings"]["datasets"] == again["settings"]["datasets"]


def test_any_drafter_evaluates_in_a_run_dir_of_its_own(smollm2_dir, shared_data, tmp_path):
    """`drafter evaluate CONFIG evaluate.drafter=DIR`: a drafter named by path needs no export
    step in the run dir (the CLI runs evaluate alone); with the default (`export`) the missing
    input is named."""
    from tests.tiny import make_tiny

    target = make_tiny("llama", tmp_path, tokenizer_dir=smollm2_dir)
    dr = _drafter_dir(target, tmp_path / "native", 0, native=True)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(C.dump(C.load(None, [
        f"run_dir={tmp_path / 'run'}", f"target.model={target}", "evaluate.max_new_tokens=4",
        "evaluate.methods=[chain]", "evaluate.k=2", "evaluate.temperatures=[0.0]",
        "evaluate.datasets=[{name: gsm8k, path: %s, max_prompts: 1}]"
        % (shared_data / "eval" / "gsm8k_test.jsonl")])))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "drafter.cli", *args], capture_output=True,
                              text=True, cwd=REPO)

    r = cli("evaluate", str(cfg))
    assert r.returncode != 0 and "export" in r.stderr
    r = cli("evaluate", str(cfg), f"evaluate.drafter={dr}")
    assert r.returncode == 0, r.stderr[-2000:]
    st = json.loads(cli("status", str(tmp_path / "run"), "--json").stdout)
    states = {s["name"]: s["state"] for s in st["steps"]}
    assert states["evaluate"] == "done" and states["export"] == "pending"
    m = json.loads((tmp_path / "run" / "evaluate" / "metrics.json").read_text())
    assert m["settings"]["drafter"] == str(dr) and m["lossless"] is True


def _one_dataset_cfg(smollm2_dir, tmp_path, dtype: str):
    """A tiny random Llama target in `dtype`, a random drafter, chain K=2 on two HumanEval
    prompts; tie_tolerance 0, so that every 16-bit divergence is a mismatch first."""
    from tests.tiny import make_tiny

    target = make_tiny("llama", tmp_path, tokenizer_dir=smollm2_dir)
    main = _drafter_dir(target, tmp_path / "ckpt", 0)
    return C.load(None, [
        f"run_dir={tmp_path / 'run'}", f"target.model={target}", f"target.dtype={dtype}",
        f"evaluate.drafter={main}", "evaluate.max_new_tokens=8", "evaluate.methods=[chain]",
        "evaluate.k=2", "evaluate.batch_size=2", "evaluate.tie_tolerance=0",
        "evaluate.datasets=[{name: humaneval, path: 'builtin:humaneval', max_prompts: 2}]"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_planted_acceptance_bug_fails_in_both_precisions(smollm2_dir, tmp_path, monkeypatch,
                                                           dtype):
    """A speculative step that accepts one draft token more than verification allowed: in
    bfloat16 the float32 recheck finds the same divergence (not drift), in float32 it fails at
    once; either way the step fails naming the prompt."""
    from drafter.decoding.decode import Decoder

    real = Decoder._commit

    def one_too_many(self, st, emitted, n_acc, bonus, root=None):
        if emitted.shape[1] > 1:  # a speculative step
            n_acc = (n_acc + 1).clamp(max=emitted.shape[1] - 1)
        return real(self, st, emitted, n_acc, bonus, root)

    monkeypatch.setattr(Decoder, "_commit", one_too_many)
    cfg = _one_dataset_cfg(smollm2_dir, tmp_path, dtype)
    with pytest.raises(E.EvaluateError, match="NOT lossless: .*'record'"):
        E.main(cfg)
    m = json.loads(Run.of(cfg).eval_metrics().read_text())
    assert m["lossless"] is False and m["mismatches"] >= 1 and m["drift"] == 0
    assert m["settings"]["float32_recheck"] is (dtype == "bfloat16")
    div = m["runs"][0]["datasets"]["humaneval"]["lossless"]["divergences"][0]
    assert div["verdict"] == "mismatch"
    if dtype == "bfloat16":
        assert div["float32"]["verdict"] == "mismatch"
    else:
        assert "float32" not in div
    assert "Lossless: FAIL" in Run.of(cfg).eval_report().read_text()


def test_a_bfloat16_only_divergence_passes_as_drift(smollm2_dir, tmp_path, monkeypatch):
    """A divergence that only bfloat16 decoding makes (planted: the first speculative answer's
    second token changed while the target runs in bfloat16) is decoded again in float32, found
    identical there, and counted as drift: the step passes and the report says so."""
    from drafter.decoding.decode import Decoder

    real = Decoder.generate
    planted = []

    def drifting(self, prompts, max_new_tokens, **kw):
        out = real(self, prompts, max_new_tokens, **kw)
        if kw.get("proposer") is not None and self.target.dtype == torch.bfloat16 \
                and len(out[0].tokens) > 1:
            out[0].tokens[1] = 49_151 if out[0].tokens[1] != 49_151 else 49_150
            planted.append(1)
        return out

    monkeypatch.setattr(Decoder, "generate", drifting)
    cfg = _one_dataset_cfg(smollm2_dir, tmp_path, "bfloat16")
    res = E.main(cfg)
    assert planted and res["lossless"] is True
    assert res["counts"]["mismatches"] == 0 and res["counts"]["drift"] >= 1
    m = json.loads(Run.of(cfg).eval_metrics().read_text())
    ll = m["runs"][0]["datasets"]["humaneval"]["lossless"]
    assert ll["drift"] >= 1 and ll["mismatch"] == 0
    assert res["counts"]["drift"] == sum(r["datasets"]["overall"]["lossless"]["drift"]
                                         for r in m["runs"])
    drift = [d for d in ll["divergences"] if d["verdict"] == "drift"]
    assert drift and all(d["float32"]["verdict"] in ("identical", "tie") for d in drift)
    assert m["runs"][0]["datasets"]["overall"]["lossless"]["drift"] == ll["drift"]
    text = Run.of(cfg).eval_report().read_text()
    assert "Lossless: PASS" in text and "bf16 drift" in text


@pytest.mark.parametrize("plant", ["every plain step", "the chain's pass", "plain's forward"])
def test_a_planted_slowdown_is_reported_instead_of_a_speedup(smollm2_dir, tmp_path, monkeypatch,
                                                             plant):
    """A load planted on one method: a sleep in every plain step (plain decoding slowed
    throughout: its step runs many times its forward), in the chain's steps during its pass
    only (a load that came and went: the pass and the same chain timed in turns disagree), or
    in plain's target forward while it is timed on its own (its parts: the plain step then runs
    faster than its own forward). The report says the speedups are unreliable and why instead
    of printing them, the tuner recommends nothing, and the export README carries no expected
    speedup."""
    import time

    from drafter.decoding.decode import Decoder
    from drafter.export.engines import README_FILE
    from drafter.measure.tuned import BEGIN, END
    from tests.tiny import make_tiny

    target = make_tiny("llama", tmp_path, tokenizer_dir=smollm2_dir)
    native = _drafter_dir(target, tmp_path / "run" / "export" / "native", 0, native=True)
    if plant == "every plain step":
        real = Decoder._plain_step

        def slowed(self, *a, **kw):
            time.sleep(0.1)
            return real(self, *a, **kw)
        monkeypatch.setattr(Decoder, "_plain_step", slowed)
    elif plant == "plain's forward":
        real_parts = Decoder.parts_ms

        def loaded(self, proposer, *a, **kw):  # another job while plain's parts are timed
            if proposer is not None:
                return real_parts(self, proposer, *a, **kw)
            real = self.target.forward

            def slow(*x, **y):
                time.sleep(0.05)
                return real(*x, **y)
            self.target.forward = slow
            try:
                return real_parts(self, proposer, *a, **kw)
            finally:
                del self.target.forward
        monkeypatch.setattr(Decoder, "parts_ms", loaded)
    else:
        real_decode, real_chain = E._decode, Decoder._chain_step
        in_pass = []

        def passes(dec, prompts, rounds, max_new, stop, T, proposer=None, *a, **kw):
            in_pass.append(proposer is not None)
            try:
                return real_decode(dec, prompts, rounds, max_new, stop, T, proposer, *a, **kw)
            finally:
                in_pass.pop()

        def chain(self, *a, **kw):
            if in_pass and in_pass[-1]:
                time.sleep(0.1)
            return real_chain(self, *a, **kw)
        monkeypatch.setattr(E, "_decode", passes)
        monkeypatch.setattr(Decoder, "_chain_step", chain)
    cfg = C.load(None, [
        f"run_dir={tmp_path / 'run'}", f"target.model={target}", f"evaluate.drafter={native}",
        "evaluate.max_new_tokens=24", "evaluate.methods=[chain]", "evaluate.k=2",
        "evaluate.batch_size=2",
        "evaluate.datasets=[{name: humaneval, path: 'builtin:humaneval', max_prompts: 3}]"])
    E.main(cfg)
    run = Run.of(cfg)
    m = json.loads(run.eval_metrics().read_text())
    check = m["settings"]["speed_check"]["0.0"]
    assert m["lossless"] and not check["reliable"]
    want = {"every plain step": "waited on something else",
            "the chain's pass": "drafter: chain K=2, T=0: its pass ran at",
            "plain's forward": "was timed under a load the steps did not see"}[plant]
    assert any(want in r for r in check["reasons"]), check["reasons"]
    assert "recommended" not in m["settings"]
    assert m["runs"][0]["datasets"]["overall"]["speed_reliable"] is False
    report = run.eval_report().read_text()
    assert "Temperature 0: speedups unreliable" in report and want in report
    rows = [x for x in report.splitlines() if x.startswith("| drafter: chain K=2, T=0 | ")
            and "unreliable" in x]
    assert len(rows) == 2 and not any("x |" in x.split(" | ")[6] for x in rows)
    assert "## Serving setting" not in report
    readme = (native / README_FILE).read_text()
    section = readme.split(BEGIN)[1].split(END)[0]
    assert "Not tuned" in section and want in section
    assert "unreliable | unreliable" in section
    assert not re.search(r"speedup \d|\| \d+\.\d+x \|", section)  # no speedup figure at all
