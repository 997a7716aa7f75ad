"""drafter.engine.tuning: the serving setting from acceptance and step costs (pure arithmetic)."""
from __future__ import annotations

import pytest

from drafter.engine.tuning import chain_step_ms, expected_tau, recommend, shape_taus


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
    # SGLang's draft tokens count the root: 48 drafted nodes are 49 of them
    assert "--speculative-num-draft-tokens 49" in r["flags"]["sglang"]


def test_smaller_tree_shapes_compete_with_their_counted_taus():
    """A tree run's counts by smaller (depth, tokens): each shape that enough steps stand for
    gets tau 1 + accepted / steps and the tree's step model at its size; the best size at each
    depth is listed, calibrated by the tree's own measured ratio, and can win."""
    t = {"target_ms": 3.0, "verify_ms": 3.6, "draft_ms": 0.5}
    steps = 100
    valid = [[steps, steps, 0, 0], [steps, steps, steps, 90], [steps] * 4]   # D=3, N=4
    accepted = [[60, 80, 0, 0], [60, 80, 120, 120], [60, 80, 120, 130]]
    tree = {"label": "tree 3/2/4", "tau": 2.3, "depth": 3, "topk": 2, "tokens": 4,
            "timings": {1: t}, "ratio": 1.5,
            "shapes": {"accepted": accepted, "valid": valid}}
    assert shape_taus(tree["shapes"]) == pytest.approx(
        {(1, 1): 1.6, (1, 2): 1.8, (2, 1): 1.6, (2, 2): 1.8, (2, 3): 2.2, (3, 1): 1.6,
         (3, 2): 1.8, (3, 3): 2.2, (3, 4): 2.3})       # (2, 4): 90 of 100 steps, left out
    r = recommend([0.1] * 2, {1: t}, 2, {"spec_ratio": 1.0, "plain_ratio": 1.0}, [tree])["1"]
    rows = {x["setting"]: x for x in r["settings"]}
    measured = rows["tree 3/2/4"]
    assert measured["step_ms"] == pytest.approx(1.5 * (3.6 + 4 * 0.5), rel=1e-3)
    est = [x for x in r["settings"] if x.get("estimated")]
    assert [x["tree"]["depth"] for x in est] == [1, 2, 3]
    d2 = est[1]
    assert d2["tree"]["tokens"] == 3 and d2["expected_tau"] == pytest.approx(2.2)
    # verify at 3 of the measured 4 tokens (3.0 + 0.6 x 3/4) and 2 + 1 drafter forwards
    assert d2["step_ms"] == pytest.approx(1.5 * (3.45 + 3 * 0.5), rel=1e-3)
    assert d2["speedup"] == pytest.approx(2.2 * 3.0 / d2["step_ms"], rel=1e-3)
    assert r["best"] == d2["setting"] == "tree depth=2 topk=2 tokens=3"
    assert "--speculative-num-steps 2 --speculative-eagle-topk 2 " \
           "--speculative-num-draft-tokens 4" in r["flags"]["sglang"]
