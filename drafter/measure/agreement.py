"""Whether two evaluators measured the same acceptance: drafter's own decoder and vLLM, at a
temperature above 0, sample different texts from the same prompts, so their counts differ by
chance; this says whether they differ by more, per draft position and in τ.

    v = agree(ours, theirs)        # per-prompt histograms: h[a] = steps that accepted a drafts
    v["agree"], v["positions"], v["tau"], v["resolution"]

The tests, K + 1 of them for a chain of K:
  - position i = 1..K: the unconditional acceptance P[a >= i] (the share of steps whose draft i
    was accepted), estimated as x = sum_c y_c / sum_c n_c over prompts c (y_c: steps of c with
    a >= i, n_c: steps of c);
  - τ - 1, the mean accepted drafts per step (the same ratio with y_c = accepted drafts of c).
Each is a two-sample z-test, z = (x_ours - x_theirs) / sqrt(V_ours + V_theirs), two-sided. A
prompt's steps read one text, so they are not independent draws: each V is the cluster-robust
variance of the ratio estimator, prompts as the clusters, C / (C - 1) * sum_c (y_c - x n_c)^2 /
N^2 (N = sum_c n_c), and never less than the variance of N independent steps (the binomial
x (1 - x) / N for a position; the steps' own variance of a over N for τ). The family's
false-alarm rate is ALPHA, Bonferroni over the K + 1 tests: each rejects at p < ALPHA / (K + 1).
`resolution` is the smallest difference each test would have rejected (its critical z times its
standard error): "agree" says no difference of that size, not that there is none.

At temperature 0 no test is needed: both decode the target's greedy text and the counts are
compared as they are (drafter/measure/vllm_eval.py).
"""
from __future__ import annotations

import math

ALPHA = 1e-3     # the family-wise false-alarm rate on two correct evaluators


def z_critical(alpha: float) -> float:
    """The two-sided normal quantile: P[|Z| > z] = alpha (bisection on erfc)."""
    lo, hi = 0.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if math.erfc(mid / math.sqrt(2)) > alpha:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def t_critical(alpha: float, df: int) -> float:
    """The two-sided Student t quantile with `df` (integer) degrees of freedom: P[|T| > t] =
    alpha (bisection on the exact CDF of integer df; the normal quantile past 1000)."""
    if df > 1000:
        return z_critical(alpha)

    def tail2(t: float) -> float:  # P[|T| > t]: the finite series in cos(theta)
        th = math.atan(t / math.sqrt(df))
        c2, s = math.cos(th) ** 2, math.sin(th)
        if df % 2:  # odd: 2/pi (theta + sin cos (1 + 2/3 c2 + 2.4/3.5 c2^2 + ...))
            term, acc = 1.0, 1.0 if df > 1 else 0.0
            for j in range(1, (df - 1) // 2):
                term *= c2 * (2 * j) / (2 * j + 1)
                acc += term
            p = 2 / math.pi * (th + s * math.cos(th) * acc)
        else:       # even: sin (1 + 1/2 c2 + 1.3/2.4 c2^2 + ...)
            term, acc = 1.0, 1.0
            for j in range(1, df // 2):
                term *= c2 * (2 * j - 1) / (2 * j)
                acc += term
            p = s * acc
        return 1 - p

    lo, hi = 0.0, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2
        if tail2(mid) > alpha:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def ratio(ys: list[float], ns: list[int], sq: float | None = None) -> tuple[float, float]:
    """The ratio estimate sum(y) / sum(n) over clusters and its variance: cluster-robust, never
    below the independent steps' (sq: sum over steps of y^2, for a count; None: a proportion)."""
    N, C = sum(ns), len(ns)
    x = sum(ys) / N
    iid = (x * (1 - x) if sq is None else max(sq / N - x * x, 0.0)) / N
    if C < 2:
        return x, iid
    cl = C / (C - 1) * sum((y - x * n) ** 2 for y, n in zip(ys, ns)) / N ** 2
    return x, max(cl, iid)


def _stats(hists: list[list[int]], K: int) -> dict:
    """Per-position and τ estimates with their variances from per-prompt histograms."""
    hists = [list(h) + [0] * (K + 1 - len(h)) for h in hists if sum(h)]
    ns = [sum(h) for h in hists]
    out = {"steps": sum(ns), "prompts": len(hists), "positions": []}
    if not ns:
        return out
    for i in range(1, K + 1):
        out["positions"].append(ratio([sum(h[i:]) for h in hists], ns))
    acc = [sum(a * c for a, c in enumerate(h)) for h in hists]
    out["accepted"] = ratio(acc, ns, sq=sum(a * a * c for h in hists for a, c in enumerate(h)))
    return out


def _test(a: tuple[float, float], b: tuple[float, float], zc: float) -> dict:
    se = math.sqrt(a[1] + b[1])
    z = (a[0] - b[0]) / se if se > 0 else 0.0
    return {"ours": round(a[0], 5), "theirs": round(b[0], 5), "z": round(z, 3),
            "p": float(f"{math.erfc(abs(z) / math.sqrt(2)):.3g}"),
            "resolution": round(zc * se, 5), "reject": abs(z) > zc}


def agree(ours: list[list[int]], theirs: list[list[int]], alpha: float = ALPHA) -> dict:
    """The K + 1 tests (module doc) between two evaluators' per-prompt acceptance histograms
    (h[a]: the prompt's steps that accepted a drafts, a = 0..K). Returns {"agree", "alpha",
    "per_test_alpha", "z_critical", "positions": [{i, ours, theirs, z, p, resolution,
    reject}], "tau": {...}, "steps": [ours, theirs], "prompts": [ours, theirs], "test"};
    "agree" is None when a side has no step."""
    K = max([len(h) for h in list(ours) + list(theirs)] or [1]) - 1
    a, b = _stats(ours, K), _stats(theirs, K)
    per = alpha / (K + 1)
    zc = z_critical(per)
    out = {"alpha": alpha, "per_test_alpha": per, "z_critical": round(zc, 3),
           "steps": [a["steps"], b["steps"]], "prompts": [a["prompts"], b["prompts"]],
           "test": (f"two-sample z per draft position (P[a >= i]) and for tau, prompts as "
                    f"clusters; Bonferroni over {K + 1} tests at family alpha {alpha:g}")}
    if not a["steps"] or not b["steps"]:
        return {**out, "agree": None, "positions": [], "tau": None}
    out["positions"] = [{"i": i + 1, **_test(x, y, zc)}
                        for i, (x, y) in enumerate(zip(a["positions"], b["positions"]))]
    t = _test(a["accepted"], b["accepted"], zc)
    out["tau"] = {**t, "ours": round(1 + t["ours"], 5), "theirs": round(1 + t["theirs"], 5)}
    out["agree"] = not (out["tau"]["reject"] or any(p["reject"] for p in out["positions"]))
    return out


def verdict(v: dict | None) -> str:
    """One line for the report: the verdict, the largest |z| and the test's resolution."""
    if not v or v.get("agree") is None:
        return "not tested (no steps on one side)"
    tests = v["positions"] + [{**v["tau"], "i": "τ"}]
    worst = max(tests, key=lambda t: abs(t["z"]))
    what = "agree" if v["agree"] else "DIFFER"
    at = f"position {worst['i']}" if worst["i"] != "τ" else "τ"
    return (f"{what} (largest |z| {abs(worst['z']):.2f} at {at}, critical "
            f"{v['z_critical']:.2f}; resolution at position 1 "
            f"±{v['positions'][0]['resolution']:.3f}, τ ±{v['tau']['resolution']:.3f}; "
            f"{v['steps'][0]} and {v['steps'][1]} steps)")
