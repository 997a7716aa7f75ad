"""A candidate against the drafter it would replace, on held-out requests of recent traffic:
both decoded by drafter's evaluator (the target in transformers, a chain of K as vLLM serves
it) on the same prompts, each at the temperature and top-p it was served with, and a one-sided
paired test on τ.

    hists = acceptance(decoder, drafter, requests, k, max_new, stop, seed)   # per request
    verdict = compare(base_hists, cand_hists)    # {"better", "gain", "lower", ...}

The test. For prompt c and drafter d, n_c^d verification steps accepted y_c^d drafts in all;
x_d = Σ_c y_c^d / Σ_c n_c^d is τ_d - 1. The gain g = x_cand - x_base is estimated with the
paired cluster-robust variance of the two ratio estimators (prompts the clusters, as
drafter/measure/agreement.py's `ratio` treats one evaluator's): V = C / (C - 1) Σ_c u_c²,
u_c = (y_c^cand - x_cand n_c^cand) / N_cand - (y_c^base - x_base n_c^base) / N_base. The
candidate is better only when the lower confidence bound g - t_(1-ALPHA, C-1) sqrt(V) is above
0: a gain larger than the measurement's noise, at a false-swap rate of at most ALPHA when the
candidate is no better. Student's t with C - 1 degrees of freedom, not the normal quantile: with
the few held-out prompts of early rounds the variance is itself a rough estimate (at 3 prompts
the normal bound let a worse drafter in; t's does not: tests/test_learn.py). At temperature 0
both decode the target's greedy text, so the noise is
only which prompts traffic brought; above it, also the texts each sampled (the same seed for
both, so that they read the same text until their drafts first differ).
"""
from __future__ import annotations

import math

from drafter.measure.agreement import t_critical

ALPHA = 0.01     # one-sided: the share of swaps to a drafter that is no better


def acceptance(decoder, drafter, requests: list[dict], k: int, max_new: int,
               stop: list[int], seed: int = 0) -> list[list[int]]:
    """Each request's histogram of accepted drafts per step (h[a], a = 0..k): decoded from its
    prompt for up to `max_new` tokens, at its own temperature and top-p, in its order."""
    import torch

    from drafter.decoding.decode import EagleDraft, TreeSpec

    prop, tree = EagleDraft(drafter), TreeSpec.chain(k)
    out: list[list[int] | None] = [None] * len(requests)
    groups: dict[tuple[float, float], list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault((float(r["temperature"]), float(r.get("top_p", 1.0))), []).append(i)
    for (T, top_p), idx in sorted(groups.items()):
        torch.manual_seed(seed)
        res = decoder.generate([requests[i]["prompt_ids"] for i in idx], max_new,
                               stop_ids=stop, temperature=T, top_p=top_p, proposer=prop,
                               tree=tree, continuous=True)
        for i, o in zip(idx, res):
            h = [int(x) for x in o.hist] + [0] * (k + 1 - len(o.hist))
            out[i] = h[:k + 1]
    return out


def _sums(h: list[int]) -> tuple[int, int]:
    """(steps, accepted drafts) of one histogram."""
    return sum(h), sum(a * c for a, c in enumerate(h))


def compare(base: list[list[int]], cand: list[list[int]], alpha: float = ALPHA) -> dict:
    """The paired test (module doc) between per-request histograms of the same requests.
    Returns {"better", "tau_base", "tau_cand", "gain" (in τ), "se", "lower" (the gain's
    one-sided lower bound), "t", "prompts", "steps": [base, cand], "alpha", "test"}."""
    pairs = [(_sums(b), _sums(c)) for b, c in zip(base, cand) if sum(b) and sum(c)]
    out = {"alpha": alpha, "prompts": len(pairs),
           "test": "one-sided paired t on tau, prompts as clusters (drafter/learn/judge.py)"}
    if len(pairs) < 2:
        return {**out, "better": False, "tau_base": None, "tau_cand": None, "gain": None,
                "se": None, "lower": None, "t": None, "steps": [0, 0],
                "why": "fewer than 2 prompts decoded"}
    Nb = sum(b[0] for b, _ in pairs)
    Nc = sum(c[0] for _, c in pairs)
    xb = sum(b[1] for b, _ in pairs) / Nb
    xc = sum(c[1] for _, c in pairs) / Nc
    C = len(pairs)
    u = [(c[1] - xc * c[0]) / Nc - (b[1] - xb * b[0]) / Nb for b, c in pairs]
    var = C / (C - 1) * sum(x * x for x in u)
    se = math.sqrt(var)
    tc = t_critical(2 * alpha, C - 1)   # agreement's quantiles are two-sided
    gain = xc - xb
    lower = gain - tc * se
    return {**out, "better": lower > 0, "tau_base": round(1 + xb, 5),
            "tau_cand": round(1 + xc, 5), "gain": round(gain, 5), "se": round(se, 5),
            "lower": round(lower, 5), "t": round(gain / se, 3) if se > 0 else None,
            "t_critical": round(tc, 3), "steps": [Nb, Nc]}
