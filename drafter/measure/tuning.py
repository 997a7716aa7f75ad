"""The speculative setting to serve a drafter with: from its measured per-position acceptance and
the measured step costs, the chain length or tree shape with the highest expected speedup at each
batch size, and the engine flags that select it. Evaluate calls it once per temperature it
evaluated (the acceptance and the step costs of sampling differ from greedy decoding's); no peer
tool does this.

    rec = recommend(alpha_cond, timings, k_measured=5,
                    calib={"spec_ratio": 1.2, "plain_ratio": 1.1},
                    trees=[{"label": "tree 6/8/48", "tau": 2.4, ..., "timings": {...}}])

Model (REFERENCES.md's theory, with measured costs):
  E[tau](K) = 1 + sum_{i<=K} prod_{j<=i} alpha_j           alpha_j: conditional acceptance at j
  chain step(K) = verify(K+1 tokens) + (K+1) x drafter forward   (K drafts + the re-read of the
                  accepted tokens), verify interpolated linearly between the 1-token forward and
                  the measured (K_measured+1)-token one (small token counts are launch-bound);
  speedup(K) = E[tau](K) x plain step / (spec_ratio x chain step(K)),
  plain step = plain_ratio x the 1-token forward.
spec_ratio and plain_ratio (measured step / modelled step) come from the run evaluate just made, at
the batch its steps ran at, and carry to the other batch sizes.

The expected speedup is per decode step: tokens per step over the step's time, against plain
decoding's, prefills left out, every row live at every step: what an engine with continuous
batching gets. Evaluate's own speedup counts two things more, so at the batch evaluate ran at
each setting also gets `as_evaluated`, the speedups evaluate would measure for it:
  decode_speedup = speedup x efficiency   (evaluate's batches wait for their slowest row: the
                   share of tau its steps kept, the measured chain's, static_batch_efficiency)
  speedup = plain seconds / (the speculative run's prefill seconds + plain decode seconds /
            decode_speedup)               (prefills in: what evaluate's `speedup` counts)
For the measured chain these equal evaluate's measured figures (up to rounding); for the other
settings they are a prediction that assumes the chain's efficiency and prefill seconds. Chains longer than the measured K
are not extrapolated (their acceptance is unmeasured); a measured tree competes with its own
measured tau and modelled step: verify(tokens+1) + depth + 1 drafter forwards, calibrated on its own
measured step when it has one.

Tree shapes: a greedy tree run with tree_stats (decode.Decoder.generate) also counts what every
smaller tree of its topk (depth D' <= D, N' <= N nodes) would have accepted on the same steps
(tree.shape_acceptance: exact on the steps whose selection holds the smaller tree's nodes). Each
(D', N') that at least `min_valid` of the steps stand for competes with tau 1 + accepted / steps
and the tree's step model at N' tokens and D' levels; per depth the best N' is listed.
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
    """Engine flags for a chain of k (vLLM, SGLang) or an EAGLE-2 tree (SGLang only). SGLang's
    draft tokens count the root (the last verified token): a chain of K is K + 1 of them, a tree
    of N drafted nodes N + 1 (its build_tree selects num_draft_tokens - 1 nodes)."""
    if tree is not None:
        return {"sglang": f"--speculative-algorithm EAGLE3 --speculative-draft-model-path "
                          f"{drafter_dir} --speculative-num-steps {tree['depth']} "
                          f"--speculative-eagle-topk {tree['topk']} "
                          f"--speculative-num-draft-tokens {tree['tokens'] + 1}",
                "vllm": None}
    return {"vllm": '--speculative-config \'{"method": "eagle3", "model": "%s", '
                    '"num_speculative_tokens": %d}\'' % (drafter_dir, k),
            "sglang": f"--speculative-algorithm EAGLE3 --speculative-draft-model-path "
                      f"{drafter_dir} --speculative-num-steps {k} --speculative-eagle-topk 1 "
                      f"--speculative-num-draft-tokens {k + 1}"}


def tree_step_ms(t: dict, depth: int, tokens: int, tokens_measured: int) -> float:
    """A tree step at `tokens` nodes and `depth` levels from the costs measured for a tree of
    tokens_measured nodes (t: its timings at one batch size)."""
    return verify_ms(t, tokens, tokens_measured) + (depth + 1) * t["draft_ms"]


def shape_taus(shapes: dict, min_valid: float = 0.95) -> dict:
    """{(depth, tokens): expected tau} of the smaller trees a greedy tree run stands for.
    shapes: {"accepted": [D][N], "valid": [D][N]} summed over steps (evaluate's tree_shapes);
    the steps of the full shape, valid[D-1][N-1], are all its steps."""
    acc, valid = shapes["accepted"], shapes["valid"]
    steps = valid[-1][-1]
    return {(d + 1, n + 1): 1 + acc[d][n] / valid[d][n]
            for d in range(len(valid)) for n in range(len(valid[d]))
            if steps and valid[d][n] >= min_valid * steps}


def as_evaluated(speedup: float, evaluated: dict) -> dict:
    """The speedups evaluate measures, for a setting of per-step `speedup`: evaluated holds
    `efficiency` (static_batch_efficiency), `plain_seconds` and `plain_prefill_seconds` (the
    plain run's, prefills included and alone) and `prefill_seconds` (the speculative run's)."""
    dec = speedup * evaluated["efficiency"]
    plain_decode = evaluated["plain_seconds"] - evaluated["plain_prefill_seconds"]
    spec = evaluated["prefill_seconds"] + plain_decode / dec
    return {"speedup": round(evaluated["plain_seconds"] / spec, 3),
            "decode_speedup": round(dec, 3)}


def recommend(alpha_cond: list, timings: dict, k_measured: int, calib: dict,
              trees: list | None = None, drafter_dir: str = "DRAFTER") -> dict:
    """Per batch size (the keys of `timings`: {batch: {target_ms, verify_ms, draft_ms}}), every
    chain K <= k_measured, each measured tree and, for a tree with `shapes`, the best number of
    nodes at each smaller depth, with expected tau, step ms and speedup; the best one and its
    flags. A tree's `ratio` (measured step / modelled) calibrates its shapes; else spec_ratio.
    With calib["evaluated"] (as_evaluated's figures and the `batch` they were measured at), the
    settings at that batch also get `as_evaluated` (evaluate's speedup and decode speedup)."""
    out = {}
    ev = calib.get("evaluated")
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
            ratio = tr.get("ratio") or calib["spec_ratio"]
            D, k, N = tr["depth"], tr["topk"], tr["tokens"]
            step = ratio * tree_step_ms(tt, D, N, N)
            rows.append({"setting": tr["label"], "tree": {"depth": D, "topk": k, "tokens": N},
                         "expected_tau": round(tr["tau"], 3), "step_ms": round(step, 3),
                         "speedup": round(tr["tau"] * plain / step, 3)})
            best_at: dict[int, dict] = {}
            for (d, n), tau in shape_taus(tr["shapes"]).items() if tr.get("shapes") else ():
                if (d, n) == (D, N):
                    continue
                step = ratio * tree_step_ms(tt, d, n, N)
                row = {"setting": f"tree depth={d} topk={k} tokens={n}", "estimated": True,
                       "tree": {"depth": d, "topk": k, "tokens": n},
                       "expected_tau": round(tau, 3), "step_ms": round(step, 3),
                       "speedup": round(tau * plain / step, 3)}
                if d not in best_at or row["speedup"] > best_at[d]["speedup"]:
                    best_at[d] = row
            rows += [best_at[d] for d in sorted(best_at)]
        best = max(rows, key=lambda r: r["speedup"])
        out[str(batch)] = {"plain_step_ms": round(plain, 3), "settings": rows,
                           "best": best["setting"], "expected_speedup": best["speedup"],
                           "flags": flags(drafter_dir, best.get("k"), best.get("tree"))}
        if ev and str(ev["batch"]) == str(batch):
            for r in rows:
                r["as_evaluated"] = as_evaluated(r["speedup"], ev)
            out[str(batch)]["expected_as_evaluated"] = best["as_evaluated"]
    return out
