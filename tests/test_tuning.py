"""drafter.tuning: the serving setting from acceptance and step costs (pure arithmetic)."""
from __future__ import annotations

import pytest

from drafter.tuning import chain_step_ms, expected_tau, recommend


def test_expected_tau_is_the_chain_formula():
    a = [0.8, 0.5, 0.5, 0.0]
    assert expected_tau(a, 0) == 1.0
    assert expected_tau(a, 1) == pytest.approx(1.8)
    assert expected_tau(a, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert expected_tau(a, 4) == expected_tau(a, 3)          # nothing after a zero
    assert expected_tau([None, 1.0], 2) == 1.0


def test_recommend_picks_short_chains_when_drafting_costs_and_long_ones_when_it_is_free():
    t = {"target_ms": 3.0, "verify_ms": 3.5, "draft_ms": 0.2}
    # verify interpolates: K=5 -> 3.5, K=1 -> 3.1; plus K+1 drafter forwards
    assert chain_step_ms(t, 5, 5) == pytest.approx(3.5 + 6 * 0.2)
    assert chain_step_ms(t, 1, 5) == pytest.approx(3.1 + 2 * 0.2)
    calib = {"spec_ratio": 1.0, "plain_ratio": 1.0}
    weak = recommend([0.5, 0.1, 0.1, 0.1, 0.1], {1: t}, 5, calib)["1"]
    assert weak["best"] == "chain K=1"
    strong = recommend([0.95] * 5, {1: {**t, "draft_ms": 0.01}}, 5, calib)["1"]
    assert strong["best"] == "chain K=5" and strong["expected_speedup"] > 3
    k5 = next(r for r in strong["settings"] if r["k"] == 5)
    assert k5["speedup"] == pytest.approx(k5["expected_tau"] * 3.0 / k5["step_ms"], rel=1e-3)
    assert '"num_speculative_tokens": 5' in strong["flags"]["vllm"]
    assert "--speculative-num-draft-tokens 6" in strong["flags"]["sglang"]
    # a measured tree with a high tau beats the chains; its flags are SGLang's
    tree = {"label": "tree 6/8/48", "tau": 4.0, "depth": 6, "topk": 8, "tokens": 48,
            "timings": {1: {"target_ms": 3.0, "verify_ms": 3.6, "draft_ms": 0.2}}}
    r = recommend([0.5, 0.1, 0.1, 0.1, 0.1], {1: t}, 5, calib, [tree])["1"]
    assert r["best"] == "tree 6/8/48" and r["flags"]["vllm"] is None
    assert "--speculative-eagle-topk 8" in r["flags"]["sglang"]
