"""The agreement test between two evaluators' sampled acceptance (drafter/measure/agreement.py),
on simulated per-prompt histograms: its false-alarm rate holds when prompts differ from one
another (the steps of a prompt share its rate: clustered), and a difference of the size greedy
drafting makes (BENCHMARKS.md, CPU, "Inside vLLM": probabilistic against greedy) is found in
samples of the size tests/test_vllm.py decodes."""
from __future__ import annotations

import random

import pytest

from drafter.measure.agreement import agree, verdict, z_critical


def prompts(rng: random.Random, n_prompts: int, steps: int, rate: float, spread: float,
            K: int = 3) -> list[list[int]]:
    """Per-prompt histograms of a chain of K: each prompt draws its own acceptance rate around
    `rate` (uniform within +-spread), each step accepts drafts while a coin at that rate says so."""
    out = []
    for _ in range(n_prompts):
        r = min(max(rate + rng.uniform(-spread, spread), 0.0), 1.0)
        h = [0] * (K + 1)
        for _ in range(steps):
            a = 0
            while a < K and rng.random() < r:
                a += 1
            h[a] += 1
        out.append(h)
    return out


def test_the_critical_value_is_the_normal_quantile():
    assert z_critical(0.05) == pytest.approx(1.95996, abs=1e-4)
    assert z_critical(1e-3 / 4) == pytest.approx(3.66226, abs=1e-4)


@pytest.mark.parametrize("spread", [0.0, 0.3])
def test_the_false_alarm_rate_holds_with_clustered_prompts(spread):
    """Two correct evaluators (the same process on both sides) at a family alpha of 0.05: the
    share of runs called different stays at or under 0.05 plus sampling error, with prompts as
    alike as coins (spread 0) or far apart (spread 0.3, where treating steps as independent
    would call about a third of the runs different)."""
    rng = random.Random(0)
    runs = 400
    differ = sum(not agree(prompts(rng, 12, 25, 0.3, spread), prompts(rng, 12, 25, 0.3, spread),
                           alpha=0.05)["agree"] for _ in range(runs))
    assert differ / runs <= 0.05 + 3 * (0.05 * 0.95 / runs) ** 0.5, differ


def test_greedy_drafting_is_told_apart():
    rng = random.Random(1)
    ours = prompts(rng, 12, 28, 0.17, 0.1)
    probabilistic = prompts(rng, 12, 28, 0.17, 0.1)
    greedy = prompts(rng, 12, 28, 0.013, 0.01)
    same, planted = agree(ours, probabilistic), agree(ours, greedy)
    assert same["agree"] and not planted["agree"]
    assert planted["positions"][0]["reject"] and planted["tau"]["reject"]
    assert "DIFFER" in verdict(planted) and verdict(same).startswith("agree")
    assert same["steps"] == [336, 336] and same["prompts"] == [12, 12]
    # the resolution: what this sample could have told apart at position 1
    assert 0.03 < same["positions"][0]["resolution"] < 0.15


def test_no_steps_is_no_verdict():
    v = agree([[0, 0, 0, 0]], [[5, 1, 0, 0]])
    assert v["agree"] is None and verdict(v).startswith("not tested")
