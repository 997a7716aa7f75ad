"""The speculative setting to serve a drafter with: from its measured per-position acceptance and
the measured step costs, the chain length (or measured tree) with the highest expected speedup at
each batch size, and the engine flags that select it. Evaluate calls it; no peer tool does this.

    rec = recommend(alpha_cond, timings, k_measured=5, calib={"spec_ratio": 1.2, "plain_ratio": 1.1},
                    trees=[{"label": "tree 6/8/48", "tau": 2.4, ..., "timings": {...}}])

Model (REFERENCES.md's theory, with measured costs):
  E[tau](K) = 1 + sum_{i<=K} prod_{j<=i} alpha_j           alpha_j: conditional acceptance at j
  chain step(K) = verify(K+1 tokens) + (K+1) x drafter forward   (K drafts + the re-read of the
                  accepted tokens), verify interpolated linearly between the 1-token forward and
                  the measured (K_measured+1)-token one (small token counts are launch-bound);
  speedup(K) = E[tau](K) x plain step / (spec_ratio x chain step(K)),
  plain step = plain_ratio x the 1-token forward.
spec_ratio and plain_ratio (measured step / modelled step) come from the run evaluate just made at
its batch size and carry to the other batch sizes. Chains longer than the measured K are not
extrapolated (their acceptance is unmeasured); a measured tree competes with its own measured tau
and modelled step: verify(tokens+1) + depth + 1 drafter forwards.
"""
from __future__ import annotations


def expected_tau(alpha_cond: list, k: int) -> float:
    tau, p = 1.0, 1.0
    for a in alpha_cond[:k]:
        p *= float(a or 0.0)
        tau += p
    return tau


def verify_ms(t: dict, n_draft: int, n_measured: int) -> float:
    """One verification forward over n_draft + 1 tokens, from the 1-token forward and the
    measured (n_measured + 1)-token one."""
    if n_measured <= 0:
        return t["verify_ms"]
    return t["target_ms"] + (t["verify_ms"] - t["target_ms"]) * n_draft / n_measured


def chain_step_ms(t: dict, k: int, k_measured: int) -> float:
    return verify_ms(t, k, k_measured) + (k + 1) * t["draft_ms"]


def flags(drafter_dir: str, k: int | None = None, tree: dict | None = None) -> dict:
    """Engine flags for a chain of k (vLLM, SGLang) or an EAGLE-2 tree (SGLang only)."""
    if tree is not None:
        return {"sglang": f"--speculative-algorithm EAGLE3 --speculative-draft-model-path "
                          f"{drafter_dir} --speculative-num-steps {tree['depth']} "
                          f"--speculative-eagle-topk {tree['topk']} "
                          f"--speculative-num-draft-tokens {tree['tokens']}",
                "vllm": None}
    return {"vllm": '--speculative-config \'{"method": "eagle3", "model": "%s", '
                    '"num_speculative_tokens": %d}\'' % (drafter_dir, k),
            "sglang": f"--speculative-algorithm EAGLE3 --speculative-draft-model-path "
                      f"{drafter_dir} --speculative-num-steps {k} --speculative-eagle-topk 1 "
                      f"--speculative-num-draft-tokens {k + 1}"}


def recommend(alpha_cond: list, timings: dict, k_measured: int, calib: dict,
              trees: list | None = None, drafter_dir: str = "DRAFTER") -> dict:
    """Per batch size (the keys of `timings`: {batch: {target_ms, verify_ms, draft_ms}}), every
    chain K <= k_measured and each measured tree with expected tau, step ms and speedup; the best
    one and its flags."""
    out = {}
    for batch, t in sorted(timings.items(), key=lambda kv: int(kv[0])):
        plain = calib["plain_ratio"] * t["target_ms"]
        rows = []
        for k in range(1, k_measured + 1):
            tau = expected_tau(alpha_cond, k)
            step = calib["spec_ratio"] * chain_step_ms(t, k, k_measured)
            rows.append({"setting": f"chain K={k}", "k": k, "expected_tau": round(tau, 3),
                         "step_ms": round(step, 3), "speedup": round(tau * plain / step, 3)})
        for tr in trees or []:
            tt = tr.get("timings", {}).get(batch, t)
            step = calib["spec_ratio"] * (verify_ms(tt, tr["tokens"], tr["tokens"])
                                          + (tr["depth"] + 1) * tt["draft_ms"])
            rows.append({"setting": tr["label"], "tree": {k: tr[k] for k in
                                                          ("depth", "topk", "tokens")},
                         "expected_tau": round(tr["tau"], 3), "step_ms": round(step, 3),
                         "speedup": round(tr["tau"] * plain / step, 3)})
        best = max(rows, key=lambda r: r["speedup"])
        out[str(batch)] = {"plain_step_ms": round(plain, 3), "settings": rows,
                           "best": best["setting"], "expected_speedup": best["speedup"],
                           "flags": flags(drafter_dir, best.get("k"), best.get("tree"))}
    return out
