"""The serving command per temperature (drafter/measure/serving.py: one vLLM config whose K follows
the batch size, the drafts sampled above temperature 0, block verification where it wins) and the
speed check that keeps unreliable step times out of it (drafter/measure/speedcheck.py), on made-up
tuner results and timings. vLLM's own parse of the configs is tests/test_vllm.py's."""
from __future__ import annotations

import pytest

from drafter.measure import speedcheck
from drafter.measure.serving import schedule, sglang_flags, sglang_notes, vllm_config
from drafter.measure.tuning import recommend

ALPHA = [0.8, 0.6, 0.5]
TIMINGS = {1: {"target_ms": 10.0, "verify_ms": 10.5, "draft_ms": 0.6},
           8: {"target_ms": 11.0, "verify_ms": 14.0, "draft_ms": 0.9},
           64: {"target_ms": 14.0, "verify_ms": 40.0, "draft_ms": 3.0}}


def rec(temperature=0.0, blocks=None, alpha=ALPHA):
    return recommend(alpha, TIMINGS, 3, {"spec_ratio": 1.2, "plain_ratio": 1.05},
                     drafter_dir="D", blocks=blocks, temperature=temperature)


def test_the_schedule_follows_the_best_chain_and_stops_where_plain_wins():
    r = rec()
    assert [r[b]["best"] for b in ("1", "8", "64")] == ["chain K=3", "chain K=2", "chain K=1"]
    assert r["64"]["expected_speedup"] < 1
    # cut at the geometric means of 1 and 8 (2), of 8 and 64 (22); 0 from there on
    assert schedule(r) == [[1, 2, 3], [3, 22, 2], [23, 64, 0]]
    cfg = vllm_config("D", r, 0.0)
    assert cfg == {"method": "eagle3", "model": "D", "num_speculative_tokens": 3,
                   "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 22, 2],
                                                             [23, 64, 0]]}
    # sampled requests: the drafts sampled; one K everywhere needs no schedule
    one = {b: x for b, x in r.items() if b == "1"}
    assert vllm_config("D", one, 1.0) == {"method": "eagle3", "model": "D",
                                          "num_speculative_tokens": 3,
                                          "draft_sample_method": "probabilistic"}
    assert r["1"]["flags"]["vllm"].count("probabilistic") == 0
    assert "probabilistic" in rec(1.0)["1"]["flags"]["vllm"]
    assert "--speculative-use-rejection-sampling" in rec(1.0)["1"]["flags"]["sglang"]


def test_no_config_where_no_batch_size_speculates():
    r = rec(alpha=[0.05, 0.01, 0.0])
    assert all(x["expected_speedup"] < 1 for x in r.values())
    assert schedule(r) == [[1, 64, 0]] and vllm_config("D", r, 1.0) is None


def test_block_verification_where_it_wins_is_the_whole_servers_method():
    block = {"label": "chain K=3 block", "k": 3, "tau": 2.9, "timings": TIMINGS, "ratio": 1.25}
    r = rec(1.0, [block])
    assert r["1"]["best"] == "chain K=3 block" and r["1"]["flags"]["sglang"] is None
    assert '"rejection_sample_method": "block"' in r["1"]["flags"]["vllm"]
    cfg = vllm_config("D", r, 1.0)
    assert cfg["rejection_sample_method"] == "block" and cfg["num_speculative_tokens"] == 3
    assert any("no block verification" in n for n in sglang_notes(1.0, r))
    assert sglang_flags("N", 2, temperature=1.0).endswith("--speculative-use-rejection-sampling")
    assert "rejection" not in sglang_flags("N", tree={"depth": 3, "topk": 2, "tokens": 6},
                                           temperature=1.0)


def _run(name, tau, step):
    return {"name": name, "datasets": {"overall": {"tau": tau, "decode_step_ms": step,
                                                   "iterations": 100}}}


def _timing(plain, spec):
    def t(xs):
        return {"step_ms": xs, "median": sorted(xs)[len(xs) // 2],
                "spread": max(xs) / min(xs) - 1}
    return {"plain": t(plain), "drafter: chain K=3, T=0": t(spec)}


PLAIN = {"decode_step_ms": 10.5, "parts_ms": 10.0, "x_parts": 1.05, "iterations": 90}


def test_steady_step_times_hold_up():
    runs = [_run("drafter: chain K=3, T=0", 2.0, 15.0)]
    v = speedcheck.check(runs, PLAIN, _timing([10.4, 10.6, 10.5], [15.1, 14.9, 15.0]))
    assert v["reliable"] and not v["reasons"]
    assert runs[0]["datasets"]["overall"]["interleaved_speedup"] == pytest.approx(1.4, abs=0.01)


@pytest.mark.parametrize("what,plain,timing,reason", [
    # the user's busy machine: a plain step of 834 ms against a 43 ms forward
    ("slow plain steps", {"decode_step_ms": 834.0, "parts_ms": 43.0, "x_parts": 19.4,
                          "iterations": 90},
     _timing([820.0, 840.0, 830.0], [850.0, 845.0, 840.0]), "waited on something else"),
    # the parts timed under a load the steps did not see: a plain step at 0.70x its forward
    ("plain faster than its forward", {**PLAIN, "parts_ms": 15.0, "x_parts": 0.7},
     _timing([10.4, 10.6, 10.5], [15.1, 14.9, 15.0]), "(0.70x, below 0.8x)"),
    ("a repeat slowed", PLAIN, _timing([10.4, 25.0, 10.5], [15.1, 14.9, 15.0]), "spread"),
    ("the plain pass slowed", {**PLAIN, "decode_step_ms": 40.0},
     _timing([10.4, 10.6, 10.5], [15.1, 14.9, 15.0]), "plain: its pass ran at 40.00 ms"),
    ("the chain's pass slowed", PLAIN, _timing([10.4, 10.6, 10.5], [5.1, 4.9, 5.0]),
     "drafter: chain K=3, T=0: its pass ran at 15.00 ms"),
])
def test_unsteady_step_times_are_unreliable(what, plain, timing, reason):
    runs = [_run("drafter: chain K=3, T=0", 1.08, 15.0)]
    v = speedcheck.check(runs, plain, timing)
    assert not v["reliable"] and any(reason in r for r in v["reasons"]), (what, v["reasons"])
