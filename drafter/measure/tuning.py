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
settings they are a prediction that assumes the chain's efficiency and prefill seconds. Chains
longer than the measured K are not extrapolated (their acceptance is unmeasured); a measured tree
competes with its own measured tau and modelled step: verify(tokens+1) + depth + 1 drafter
forwards, calibrated on its own measured step when it has one.

A block drafter (DSpark, DFlash: drafter/decoding/dspark.py; its timings carry `markov_ms`)
drafts its K in one forward and a Markov pass per draft, so its step is
  chain step(k) = verify(k+1 tokens) + drafter forward + k x Markov position
(the drafter forward: the context of the verified positions and the block), for k <= K of its
block. Its confidence head can cut each row's chain where the running product of confidences
falls below a threshold (vLLM's `enable_adaptive_verification` ranks drafts by the same
product); from the chain run's counts of what each threshold of dspark.CUTS would have accepted
and verified at each k (`cuts`: exact per step, the first drafts' acceptance not depending on
the later ones), the best (k, threshold) competes with tau 1 + accepted / steps and its step at
the mean drafts verified (an engine packs each row's own number of tokens into one forward),
marked estimated.

Block verification (drafter/decoding/block.py, evaluate's method `block`, temperatures above 0):
its acceptance at a shorter K is not the chain's truncated (the last position's test differs),
so a block run competes at its measured K only, with its measured tau and the chain's step
model calibrated on its own measured step.

Tree shapes: a greedy tree run with tree_stats (decode.Decoder.generate) also counts what every
smaller tree of its topk (depth D' <= D, N' <= N nodes) would have accepted on the same steps
(tree.shape_acceptance: exact on the steps whose selection holds the smaller tree's nodes). Each
(D', N') that at least `min_valid` of the steps stand for competes with tau 1 + accepted / steps
and the tree's step model at N' tokens and D' levels; per depth the best N' is listed.
"""
from __future__ import annotations

from drafter.measure.serving import sglang_flags, vllm_flag


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


def chain_step_ms(t: dict, k: int, k_measured: int, verified: float | None = None) -> float:
    """A chain step of k drafts: EAGLE-3's k + 1 drafter forwards, or a block drafter's one
    forward and k Markov positions (`markov_ms` in t); `verified` drafts verified of the k
    (a confidence cut; default k)."""
    v = verify_ms(t, k if verified is None else verified, k_measured)
    if "markov_ms" in t:
        return v + t["draft_ms"] + k * t["markov_ms"]
    return v + (k + 1) * t["draft_ms"]


def flags(drafter_dir: str, k: int | None = None, tree: dict | None = None,
          temperature: float = 0.0, block: bool = False, method: str = "eagle3",
          adaptive: bool = False) -> dict:
    """Engine flags for one setting: a chain of k (vLLM, SGLang), with block verification
    (vLLM only), or an EAGLE-2 tree (SGLang only); at a temperature above 0 the drafts sampled
    as evaluate's were (measure.serving: vLLM's `draft_sample_method`, SGLang's rejection
    sampling). SGLang's draft tokens count the root (the last verified token): a chain of K is
    K + 1 of them, a tree of N drafted nodes N + 1 (its build_tree selects num_draft_tokens - 1
    nodes). A block drafter (`method` dspark or dflash) is vLLM's alone; `adaptive`: its
    confidence cut, vLLM's adaptive verification."""
    if tree is not None:
        return {"sglang": sglang_flags(drafter_dir, tree=tree), "vllm": None}
    cfg = {"method": method, "model": drafter_dir, "num_speculative_tokens": k}
    if temperature > 0:
        cfg["draft_sample_method"] = "probabilistic"
    if block:
        cfg["rejection_sample_method"] = "block"
    if adaptive:
        cfg["enable_adaptive_verification"] = True
    return {"vllm": vllm_flag(cfg),
            "sglang": None if block or method != "eagle3" else
            sglang_flags(drafter_dir, k, temperature=temperature)}


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


def cut_rows(cuts: dict, t: dict, k_measured: int, ratio: float, plain: float) -> list[dict]:
    """The best confidence cut (module doc) at one batch size's costs t: [row] or []."""
    steps, best = cuts.get("steps"), None
    for c, acc, ver in zip(cuts["thresholds"], cuts["accepted"], cuts["verified"]):
        for k in range(1, len(acc) + 1):
            tau, v = 1 + acc[k - 1] / steps, ver[k - 1] / steps
            step = ratio * chain_step_ms(t, k, k_measured, v)
            row = {"setting": f"chain K={k} cut={c:g}", "k": k, "cut": c, "estimated": True,
                   "verified": round(v, 3), "expected_tau": round(tau, 3),
                   "step_ms": round(step, 3), "speedup": round(tau * plain / step, 3)}
            if best is None or row["speedup"] > best["speedup"]:
                best = row
    return [best] if steps and best else []


def recommend(alpha_cond: list, timings: dict, k_measured: int, calib: dict,
              trees: list | None = None, drafter_dir: str = "DRAFTER",
              blocks: list | None = None, temperature: float = 0.0, method: str = "eagle3",
              cuts: dict | None = None) -> dict:
    """Per batch size (the keys of `timings`: {batch: {target_ms, verify_ms, draft_ms}}), every
    chain K <= k_measured, each measured tree and, for a tree with `shapes`, the best number of
    nodes at each smaller depth, each measured block-verified chain (`blocks`: {label, k, tau,
    timings, ratio}: its own τ at its own K, as a tree's), with expected tau, step ms and
    speedup; the best one and its flags at `temperature`. A tree's `ratio` (measured step /
    modelled) calibrates its shapes; else spec_ratio. With calib["evaluated"] (as_evaluated's
    figures and the `batch` they were measured at), the settings at that batch also get
    `as_evaluated` (evaluate's speedup and decode speedup). A block drafter: `method` (its
    vLLM method) and `cuts` (dspark.cut_counts of the chain run plus its `steps`): the best
    confidence cut (cut_rows)."""
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
        if cuts:
            rows += cut_rows(cuts, t, k_measured, calib["spec_ratio"], plain)
        for bl in blocks or []:  # block verification: its own tau, the chain's step model
            tt = bl.get("timings", {}).get(batch, t)
            step = (bl.get("ratio") or calib["spec_ratio"]) * chain_step_ms(tt, bl["k"], bl["k"])
            rows.append({"setting": bl["label"], "k": bl["k"], "block": True,
                         "expected_tau": round(bl["tau"], 3), "step_ms": round(step, 3),
                         "speedup": round(bl["tau"] * plain / step, 3)})
        best = max(rows, key=lambda r: r["speedup"])
        out[str(batch)] = {"plain_step_ms": round(plain, 3), "settings": rows,
                           "best": best["setting"], "expected_speedup": best["speedup"],
                           "flags": flags(drafter_dir, best.get("k"), best.get("tree"),
                                          temperature, bool(best.get("block")), method,
                                          best.get("cut") is not None)}
        if ev and str(ev["batch"]) == str(batch):
            for r in rows:
                r["as_evaluated"] = as_evaluated(r["speedup"], ev)
            out[str(batch)]["expected_as_evaluated"] = best["as_evaluated"]
    return out
