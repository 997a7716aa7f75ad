"""drafter.measure.tuning and measure.summary.recommend_setting: the serving setting per
temperature from acceptance and step costs, and its expected speedup in evaluate's own
quantities (pure arithmetic)."""
from __future__ import annotations

import pytest

from drafter.measure.tuning import as_evaluated, chain_step_ms, expected_tau, recommend, shape_taus


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


def test_a_block_drafter_chooses_its_length_and_its_confidence_cut():
    """A block drafter's step: verify(k+1) + one forward + k Markov positions, so long chains
    cost little drafting; its chains k <= K from the per-position acceptance; the best cut from
    the counts of what each threshold accepted and verified, its verification at the mean
    drafts verified; its flags are vLLM's dspark method, adaptive verification for a cut."""
    t = {"target_ms": 3.0, "verify_ms": 4.0, "draft_ms": 0.5, "markov_ms": 0.05}
    assert chain_step_ms(t, 4, 4) == pytest.approx(4.0 + 0.5 + 4 * 0.05)
    assert chain_step_ms(t, 2, 4) == pytest.approx(3.5 + 0.5 + 2 * 0.05)
    assert chain_step_ms(t, 4, 4, verified=1.0) == pytest.approx(3.25 + 0.5 + 4 * 0.05)
    calib = {"spec_ratio": 1.0, "plain_ratio": 1.0}
    alpha = [0.9, 0.8, 0.3, 0.2]
    steps = 100
    # threshold 0.5 verifies 1.2 drafts a step and keeps 80 of the 100 first acceptances;
    # threshold 0.1 verifies nearly all and accepts what the chain does
    cuts = {"steps": steps, "thresholds": [0.5, 0.1],
            "accepted": [[80, 80, 80, 80], [90, 162, 180, 185]],
            "verified": [[100, 120, 120, 120], [100, 200, 290, 380]]}
    r = recommend(alpha, {1: t}, 4, calib, method="dspark", cuts=cuts)["1"]
    rows = {x["setting"]: x for x in r["settings"]}
    assert [x["k"] for x in r["settings"][:4]] == [1, 2, 3, 4]
    cut = [x for x in r["settings"] if x.get("cut") is not None]
    assert len(cut) == 1 and cut[0]["estimated"]
    # every (threshold, k) weighed: the best of them listed
    best = max(((c, k) for c in (0, 1) for k in range(1, 5)), key=lambda ck: (
        1 + cuts["accepted"][ck[0]][ck[1] - 1] / steps) * 3.0 / chain_step_ms(
        t, ck[1], 4, cuts["verified"][ck[0]][ck[1] - 1] / steps))
    c, k = best
    assert cut[0]["setting"] == f"chain K={k} cut={cuts['thresholds'][c]:g}"
    assert cut[0]["expected_tau"] == pytest.approx(1 + cuts["accepted"][c][k - 1] / steps)
    assert cut[0]["verified"] == pytest.approx(cuts["verified"][c][k - 1] / steps)
    assert rows["chain K=2"]["expected_tau"] == pytest.approx(1 + 0.9 + 0.72)
    flags = r["flags"]["vllm"]
    assert '"method": "dspark"' in flags and r["flags"]["sglang"] is None
    assert ('"enable_adaptive_verification": true' in flags) == (r["best"] == cut[0]["setting"])
    # a cut that cannot pay (drafts free, every draft accepted): the full chain wins
    free = {**t, "verify_ms": 3.0}
    sure = recommend([1.0] * 4, {1: free}, 4, calib, method="dspark", cuts={
        **cuts, "accepted": [[100, 200, 300, 400]] * 2, "verified": [[100, 200, 300, 400]] * 2})
    assert sure["1"]["best"] == "chain K=4"
    assert "enable_adaptive_verification" not in sure["1"]["flags"]["vllm"]


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


def _run(T, tau, alpha, it, decode_ms, prefill_s, method="chain", **kw):
    """A run of evaluate's metrics (overall figures only) for summary.recommend_setting."""
    dec = it * decode_ms / 1000
    timing = {"by_batch": {64: {"target_ms": 8.0, "verify_ms": 10.0, "draft_ms": 1.0}}}
    name = f"drafter: chain K={kw['k']}, T={T:g}" if method == "chain" else \
        f"drafter: tree depth={kw['depth']} topk={kw['topk']} tokens={kw['tokens']}, T={T:g}"
    return {"name": name, "drafter": "drafter", "method": method, "temperature": T, **kw,
            "timing": timing,
            "datasets": {"overall": {"tau": tau, "acceptance_conditional": alpha, "iterations": it,
                                     "seconds": dec + prefill_s, "prefill_seconds": prefill_s,
                                     "step_ms": 1000 * (dec + prefill_s) / it,
                                     "decode_step_ms": decode_ms}}}


def _plain(it, decode_ms, prefill_s):
    dec = it * decode_ms / 1000
    return {"overall": {"iterations": it, "seconds": dec + prefill_s, "prefill_seconds": prefill_s,
                        "step_ms": 1000 * (dec + prefill_s) / it, "decode_step_ms": decode_ms}}


def test_a_setting_per_temperature_and_its_speedup_as_evaluate_measures_it():
    """summary.recommend_setting at each temperature reads that temperature's chain, trees and
    plain run; at the batch evaluated, `as_evaluated` is the expected speedup in evaluate's own
    quantities (its batches' waiting and the prefills in): for the chain the model is calibrated
    on, exactly what evaluate measured."""
    from drafter.measure.summary import measured, recommend_setting

    greedy_alpha, sampled_alpha = [0.9, 0.85, 0.8], [0.5, 0.3, 0.2]
    runs = [_run(0.0, expected_tau(greedy_alpha, 3), greedy_alpha, 400, 15.0, 2.5, k=3),
            _run(1.0, expected_tau(sampled_alpha, 3), sampled_alpha, 700, 19.0, 2.6, k=3),
            _run(1.0, 1.9, None, 600, 40.0, 2.6, method="tree", depth=2, topk=4, tokens=6)]
    plain = {"0.0": _plain(800, 10.0, 2.0), "1.0": _plain(800, 11.0, 2.1)}
    g = recommend_setting(runs, plain, 64, "D", 0.0)
    s = recommend_setting(runs, plain, 64, "D", 1.0)
    assert (g["temperature"], s["temperature"]) == (0.0, 1.0)
    assert recommend_setting(runs, plain, 64, "D", 0.7) is None       # no chain run there
    # each calibrated on its own temperature's steps: the sampled step is the slower one
    assert s["calibration"]["spec_ratio"] > g["calibration"]["spec_ratio"]
    assert s["calibration"]["plain_ratio"] == pytest.approx(11.0 / 8.0, abs=1e-3)
    assert g["by_batch"]["64"]["best"] == "chain K=3" and s["by_batch"]["64"]["best"] == \
        "chain K=1"
    assert not any(r.get("tree") for r in g["by_batch"]["64"]["settings"])   # greedy: no tree
    assert [r["setting"] for r in s["by_batch"]["64"]["settings"]][-1] == \
        "tree depth=2 topk=4 tokens=6"
    for rec, run, p in ((g, runs[0], plain["0.0"]), (s, runs[1], plain["1.0"])):
        o, po = run["datasets"]["overall"], p["overall"]
        k3 = next(r for r in rec["by_batch"]["64"]["settings"] if r.get("k") == 3)
        # per step: tau x plain step / speculative step, prefills left out
        assert k3["speedup"] == pytest.approx(o["tau"] * po["decode_step_ms"]
                                              / o["decode_step_ms"], rel=2e-3)
        # as evaluate measures it: its batches' steps and the prefills in
        dec = (po["seconds"] - po["prefill_seconds"]) / (o["seconds"] - o["prefill_seconds"])
        assert k3["as_evaluated"]["decode_speedup"] == pytest.approx(dec, rel=2e-3)
        assert k3["as_evaluated"]["speedup"] == pytest.approx(po["seconds"] / o["seconds"],
                                                              rel=2e-3)
        ae = k3["as_evaluated"]
        # the batches' waiting lowers it; the prefills, the same in both, pull it towards 1
        assert ae["decode_speedup"] < k3["speedup"]
        assert abs(ae["speedup"] - 1) < abs(ae["decode_speedup"] - 1)
        best = rec["by_batch"]["64"]
        assert best["expected_as_evaluated"] == next(
            r for r in best["settings"] if r["setting"] == best["best"])["as_evaluated"]
    # the figures beside the measured run of the best setting
    got = measured(s, {"name": "drafter: chain K=1, T=1", "datasets": {"overall": {
        "tau": 1.5, "speedup": 1.1, "decode_speedup": 1.2, "x_parts": 1.3}}})
    assert got["temperature"] == 1.0 and got["batch"] == 64 and got["speedup"] == 1.1
    assert got["expected_speedup"] == s["by_batch"]["64"]["expected_speedup"]
    assert got["expected_as_evaluated"] == s["by_batch"]["64"]["expected_as_evaluated"]


def test_as_evaluated_is_the_per_step_speedup_through_the_batches_and_prefills():
    ev = {"efficiency": 0.8, "plain_seconds": 10.0, "plain_prefill_seconds": 2.0,
          "prefill_seconds": 2.5}
    got = as_evaluated(2.0, ev)
    assert got["decode_speedup"] == pytest.approx(1.6)
    assert got["speedup"] == pytest.approx(10.0 / (2.5 + 8.0 / 1.6), abs=1e-3)   # rounded
    # no prefill time at all: the speedup is the decode speedup
    assert as_evaluated(2.0, {**ev, "plain_seconds": 8.0, "plain_prefill_seconds": 0.0,
                              "prefill_seconds": 0.0})["speedup"] == pytest.approx(1.6)


@pytest.mark.usefixtures("one_thread")
def test_evaluate_recommends_and_measures_a_setting_per_temperature(steady_speed, smollm2_dir,
                                                                   shared_data, tmp_path):
    """A real evaluate at temperatures 0 and 1 (a tiny Llama target, a random drafter, CPU):
    a serving setting per temperature, each decoded and measured at its own temperature, and
    for the chain the model is calibrated on, the expected speedups as evaluated are the ones
    evaluate measured; the report shows both temperatures."""
    from test_evaluate import _drafter_dir

    from drafter.core import config as C
    from drafter.core.rundir import Run, read_json
    from drafter.steps import evaluate as E
    from tests.tiny import make_tiny

    target = make_tiny("llama", tmp_path, tokenizer_dir=smollm2_dir)
    dr = _drafter_dir(target, tmp_path / "native", 0, native=True)
    cfg = C.load(None, [
        f"run_dir={tmp_path / 'run'}", f"target.model={target}", f"evaluate.drafter={dr}",
        "evaluate.max_new_tokens=8", "evaluate.methods=[chain, tree, block]", "evaluate.k=2",
        "evaluate.tree_depth=2", "evaluate.tree_topk=2", "evaluate.tree_tokens=3",
        "evaluate.temperatures=[0, 1]", "evaluate.batch_size=2",
        "evaluate.datasets=[{name: gsm8k, path: %s, max_prompts: 3}]"
        % (shared_data / "eval" / "gsm8k_test.jsonl")])
    E.main(cfg)
    run = Run.of(cfg)
    m = read_json(run.eval_metrics())
    # block verification: a sampled run only (greedy, it is the chain), competing at its own K
    blocks = [x for x in m["runs"] if x["method"] == "block"]
    assert [x["name"] for x in blocks] == ["drafter: chain K=2 block, T=1"]
    row = next(x for x in m["settings"]["recommended"]["by_temperature"]["1.0"]["by_batch"]["1"]
               ["settings"] if x.get("block"))
    assert row["k"] == 2 and row["expected_tau"] == pytest.approx(
        blocks[0]["datasets"]["overall"]["tau"], abs=1e-3)
    assert m["settings"]["speed_check"]["1.0"]["reliable"]
    assert set(m["settings"]["speed_check"]["1.0"]["interleaved"]) == {
        "plain", "drafter: chain K=2, T=1", "drafter: tree depth=2 topk=2 tokens=3, T=1",
        "drafter: chain K=2 block, T=1"}
    rec = m["settings"]["recommended"]
    by_t = rec["by_temperature"]
    assert set(by_t) == {"0.0", "1.0"} and rec["by_batch"] == by_t["0.0"]["by_batch"]
    for t, r in by_t.items():
        T = float(t)
        assert r["temperature"] == T
        cal = str(r["calibration"]["batch"])
        got = r["measured"]
        marked = next(x for x in m["runs"] if x["name"] == got["run"])
        assert marked["recommended"] and marked["temperature"] == T
        assert got["run"] == f"drafter: {r['by_batch'][cal]['best']}, T={T:g}"
        assert got["expected_as_evaluated"] == r["by_batch"][cal]["expected_as_evaluated"]
        chain = next(x for x in m["runs"] if x["name"] == f"drafter: chain K=2, T={T:g}")
        o = chain["datasets"]["overall"]
        k2 = next(x for x in r["by_batch"][cal]["settings"] if x.get("k") == 2)
        assert k2["as_evaluated"]["decode_speedup"] == pytest.approx(o["decode_speedup"],
                                                                     rel=0.02)
        assert k2["as_evaluated"]["speedup"] == pytest.approx(o["speedup"], rel=0.02)
    # smaller tree shapes are counted by greedy trees only
    assert not any(x.get("estimated") for b in by_t["1.0"]["by_batch"].values()
                   for x in b["settings"])
    assert sum(bool(x.get("recommended")) for x in m["runs"]) == 2
    report = run.eval_report().read_text()
    assert "| temperature | batch | setting |" in report
    assert "Temperature 1, batch 2: " in report and ", temperature 1 (the run" in report
