"""Evaluate's figures from its decoding passes: speed, acceptance, the lossless verdicts, sums
over datasets, and the serving setting the tuner picks from them.

    m = summarize(outs, stats, tree, plain_outs, tol, records)   # one dataset of one run
    m = with_plain(m, plain_summary)                             # speedups against plain
    o = overall({"mt_bench": m, ...}, tree)                      # sums over the datasets
    rec = recommend_setting(runs, plain_all, batch, drafter_dir, temperature=0.0)
    rec["measured"] = measured(rec, run)     # the run decoded at rec's best setting

`stats` is one pass's timing (drafter.decoding.decode.Decoder.last summed over its calls):
seconds (prefills included: what a user waits for), prefill_seconds, iterations (decode steps),
row_steps, spans ({"BxS": steps}: the steps by rows and attention span) and step_gpu_seconds (the
GPU's time in the steps' replays; None off the GPU).
"""
from __future__ import annotations

from drafter.measure.lossless import compare, lossless_sum


def _r(x, n=3):
    return None if x is None else round(x, n)


def add_spans(a: dict, b: dict) -> dict:
    """{"BxS": steps} summed."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


def speed(new: int, stats: dict) -> dict:
    """tokens/s and step_ms over all seconds, prefills included (what a user waits for);
    decode_step_ms without them (a step's own time, host included); step_gpu_ms the GPU's time in
    the steps' replays, so that decode_step_ms - step_gpu_ms is the host's share (syncs, the
    refills' bookkeeping); rows_per_step: the batch the steps ran at (below batch_size when
    prompts run out)."""
    seconds, it = stats["seconds"], stats["iterations"]
    m = {"new_tokens": new, "seconds": round(seconds, 4), "iterations": it,
         "tokens_per_s": round(new / seconds, 2) if seconds > 0 else None,
         "step_ms": _r(1000 * seconds / it) if it else None}
    if stats.get("prefill_seconds") is not None:
        m["prefill_seconds"] = round(stats["prefill_seconds"], 4)
        m["decode_step_ms"] = _r(1000 * (seconds - stats["prefill_seconds"]) / it) if it \
            else None
    if stats.get("step_gpu_seconds") is not None:
        m["step_gpu_seconds"] = round(stats["step_gpu_seconds"], 4)
        m["step_gpu_ms"] = _r(1000 * stats["step_gpu_seconds"] / it) if it else None
    if stats.get("row_steps") is not None and it:
        m["rows_per_step"] = round(stats["row_steps"] / it, 2)
    if stats.get("spans") is not None:
        m["spans"] = dict(stats["spans"])
    return m


def acceptance(hist: list[int], tree) -> dict:
    from drafter.decoding.decode import acceptance_stats

    st = acceptance_stats(hist)
    drafted = st["steps"] * tree.nodes
    return {"tau": st["tau"], "steps": st["steps"], "drafted": drafted, "accepted": st["accepted"],
            "accept_rate": st["accepted"] / drafted if drafted else None,
            "acceptance": st["acceptance"],
            "acceptance_conditional": st["acceptance_conditional"], "accept_hist": hist}


def summarize(outs, stats: dict, tree=None, plain_outs=None, tol=0.0, records=None) -> dict:
    """One dataset of one run: outs [(record, turn, Output)]; with plain_outs (greedy), each
    output's lossless verdict against plain's (measure.lossless.compare)."""
    m = {"prompts": len(outs), "records": len({i for i, _, _ in outs}),
         **speed(sum(len(o.tokens) for _, _, o in outs), stats)}
    if tree is not None:
        m.update(acceptance([sum(o.hist[a] for _, _, o in outs) for a in range(tree.depth + 1)],
                            tree))
        m["prompt_hists"] = [list(o.hist) for _, _, o in outs]  # (vllm_eval's agreement test)
        shapes = [o.shapes for _, _, o in outs if o.shapes is not None]
        if shapes and len(shapes) == len(outs):
            m["tree_shapes"] = sum_shapes([{"accepted": x[0], "valid": x[1]} for x in shapes])
        stats = [o.stats for _, _, o in outs if o.stats is not None]
        if stats and len(stats) == len(outs):
            m.update(confidence(_sum(stats), m["steps"]))
    if plain_outs is not None:
        verdicts = {"identical": 0, "tie": 0, "drift": 0, "mismatch": 0}
        details = []
        ref = {(i, r): o for i, r, o in plain_outs}
        for i, r, o in outs:
            v, info = compare(ref[(i, r)], o, tol)
            verdicts[v] += 1
            if info is not None:
                rid = records[i].get("id") if records else None
                details.append({"record": i, "id": rid, "turn": r + 1, "verdict": v, **info})
        m["lossless"] = {"compared": len(outs), **verdicts,
                         "max_tie_gap": max((d["gap"] for d in details if d["verdict"] == "tie"),
                                            default=None),
                         "divergences": details}  # all until evaluate's finish keeps the first 20
    return m


def _sum(xs: list[list]) -> list:
    """Elementwise sums of equally shaped nested lists."""
    if isinstance(xs[0], list):
        return [_sum([x[i] for x in xs]) for i in range(len(xs[0]))]
    return sum(xs)


def confidence(stats: list, steps: int) -> dict:
    """A block drafter's confidence records (Output.stats summed: drafter.decoding.dspark) ->
    {"block_stats": them, "confidence": predicted against measured acceptance per position,
    with the counts of the cuts at its thresholds (the tuner's `cuts`)}."""
    from drafter.decoding.dspark import calibration, cut_counts

    return {"block_stats": stats, "confidence": {**calibration(stats, steps),
                                                 "cuts": {**cut_counts(stats), "steps": steps}}}


def with_plain(m: dict, plain: dict) -> dict:
    """m with plain decoding's speed beside it and the speedups over it."""
    m["plain_tokens_per_s"] = plain.get("tokens_per_s")
    m["plain_step_ms"] = plain.get("step_ms")
    if plain.get("decode_step_ms") is not None:
        m["plain_decode_step_ms"] = plain["decode_step_ms"]
    if m.get("tokens_per_s") and plain.get("tokens_per_s"):
        m["speedup"] = round(m["tokens_per_s"] / plain["tokens_per_s"], 3)
    # the same without the prefills: the time of the steps alone (the warm-up takes the process's
    # one-off start-up costs out of the first plain pass; a prefill's cost is the target's alone)
    if m.get("prefill_seconds") is not None and plain.get("prefill_seconds") is not None \
            and m["seconds"] > m["prefill_seconds"]:
        m["decode_speedup"] = round((plain["seconds"] - plain["prefill_seconds"])
                                    / (m["seconds"] - m["prefill_seconds"]), 3)
    return m


def with_parts(m: dict, parts: dict) -> dict:
    """m with what its steps must run (Decoder.parts_ms, at the shapes they ran at) and the
    decode step over it: x_parts 1.0 means the step is its forwards alone."""
    m["parts_ms"] = parts["parts_ms"]
    m["parts_by_shape"] = parts["by_shape"]
    if parts["parts_ms"] and m.get("decode_step_ms"):
        m["x_parts"] = round(m["decode_step_ms"] / parts["parts_ms"], 3)
        if m.get("step_gpu_ms"):
            m["gpu_x_parts"] = round(m["step_gpu_ms"] / parts["parts_ms"], 3)
    return m


def sum_shapes(parts: list[dict]) -> dict:
    """Elementwise sums of tree_shapes ({"accepted", "valid"}: [D][N] step counts)."""
    return {key: [[sum(p[key][d][n] for p in parts) for n in range(len(parts[0][key][d]))]
                  for d in range(len(parts[0][key]))] for key in ("accepted", "valid")}


def overall(per: dict, tree) -> dict:
    """Sums over datasets (τ from summed counts, not an average of τs)."""
    items = [d for n, d in per.items() if n != "overall"]

    def total(key):
        return sum(d[key] for d in items) if all(d.get(key) is not None for d in items) \
            else None

    spans = {}
    for d in items:
        spans = add_spans(spans, d.get("spans") or {})
    stats = {"seconds": total("seconds"), "iterations": total("iterations"),
             "prefill_seconds": total("prefill_seconds"),
             "step_gpu_seconds": total("step_gpu_seconds"),
             "row_steps": sum(d["rows_per_step"] * d["iterations"] for d in items)
             if all("rows_per_step" in d for d in items) else None,
             "spans": spans if all("spans" in d for d in items) else None}
    m = {"prompts": total("prompts"), **speed(total("new_tokens"), stats)}
    if tree is not None:
        m.update(acceptance([sum(d["accept_hist"][a] for d in items)
                             for a in range(tree.depth + 1)], tree))
        if all("tree_shapes" in d for d in items):
            m["tree_shapes"] = sum_shapes([d["tree_shapes"] for d in items])
        if all("block_stats" in d for d in items):
            m.update(confidence(_sum([d["block_stats"] for d in items]), m["steps"]))
        if all("lossless" in d for d in items):
            m["lossless"] = lossless_sum(items)
    return m


def recommend_setting(runs: list[dict], plain: dict, batch: int, drafter_dir: str,
                      temperature: float = 0.0) -> dict | None:
    """The serving setting at `temperature` (drafter.measure.tuning) from the drafter's chain run
    at that temperature: its conditional acceptance, the step costs measured per batch size,
    calibrated on this run's step times (decode steps, prefills left out: the per-step figures
    an engine with continuous batching gets) against the costs timed at `batch`, the rows those
    steps ran at (costs timed at more rows than the steps ran at, e.g. a batch_size 64 run
    whose batches held 21 rows, would calibrate its steps too fast; BENCHMARKS.md, The user's
    path: "x parts"); from each tree run at that temperature, its own tau, and
    from a greedy one those of its smaller shapes (counted at temperature 0 only); a block
    drafter's chain run (its `kind`) brings its vLLM method and its confidence cuts. At `batch`
    each setting also gets the speedups evaluate would measure for it (tuning.as_evaluated:
    evaluate's batches and prefills in). None without a chain run at that temperature."""
    from drafter.measure.tuning import chain_step_ms, recommend, tree_step_ms

    T = float(temperature)
    chain = next((r for r in runs if r["drafter"] == "drafter" and r["method"] == "chain"
                  and r["temperature"] == T and r.get("cut") is None), None)
    if chain is None or not chain["datasets"]["overall"].get("step_ms"):
        return None
    o, k = chain["datasets"]["overall"], chain["k"]
    t = chain["timing"]["by_batch"]
    spec_ratio = (o.get("decode_step_ms") or o["step_ms"]) / chain_step_ms(t[batch], k, k)
    po = plain[str(T)]["overall"]
    plain_ms = po.get("decode_step_ms") or po.get("step_ms")
    plain_ratio = plain_ms / t[batch]["target_ms"] if plain_ms else 1.0
    trees = []
    for r in runs:
        ov = r["datasets"]["overall"]
        if r["drafter"] != "drafter" or r["method"] != "tree" or r["temperature"] != T \
                or not ov.get("tau"):
            continue
        tt, D, N = r["timing"]["by_batch"], r["depth"], r["tokens"]
        step = ov.get("decode_step_ms") or ov.get("step_ms")
        trees.append({"label": r["name"].split(",")[0].split(": ", 1)[-1], "tau": ov["tau"],
                      "depth": D, "topk": r["topk"], "tokens": N, "timings": tt,
                      "ratio": step / tree_step_ms(tt[batch], D, N, N) if step else None,
                      "shapes": ov.get("tree_shapes")})
    blocks = [{"label": r["name"].split(",")[0].split(": ", 1)[-1], "k": r["k"],
               "tau": r["datasets"]["overall"]["tau"], "timings": r["timing"]["by_batch"],
               "ratio": (r["datasets"]["overall"].get("decode_step_ms")
                         or r["datasets"]["overall"]["step_ms"])
               / chain_step_ms(r["timing"]["by_batch"][batch], r["k"], r["k"])}
              for r in runs if r["drafter"] == "drafter" and r["method"] == "block"
              and r["temperature"] == T and r["datasets"]["overall"].get("tau")]
    # a batch waits for its slowest row (static batches; continuous ones at their last prompts):
    # the steps the batches took, against tau's promise
    p_it = po.get("iterations")
    eff = (p_it / o["iterations"]) / o["tau"] if p_it and o.get("iterations") and o["tau"] \
        else None
    calib = {"spec_ratio": spec_ratio, "plain_ratio": plain_ratio}
    if eff and all(x.get("prefill_seconds") is not None for x in (o, po)) and po.get("seconds"):
        calib["evaluated"] = {"batch": batch, "efficiency": eff, "plain_seconds": po["seconds"],
                              "plain_prefill_seconds": po["prefill_seconds"],
                              "prefill_seconds": o["prefill_seconds"]}
    cuts = (o.get("confidence") or {}).get("cuts")  # a block drafter's confidence head
    rec = recommend(o["acceptance_conditional"], t, k, calib, trees, drafter_dir, blocks, T,
                    chain.get("kind", "eagle3"), cuts)
    return {"temperature": T,
            "calibration": {"batch": batch, "spec_ratio": round(spec_ratio, 3),
                            "plain_ratio": round(plain_ratio, 3),
                            "static_batch_efficiency": _r(eff)}, "by_batch": rec}


def measured(rec: dict, run: dict) -> dict:
    """The figures evaluate measured for the setting `rec` (recommend_setting's) finds best at
    its batch, beside the expected ones: `expected_speedup` per step (as an engine with
    continuous batching gets) and `expected_as_evaluated`, the same two quantities evaluate
    measured (`speedup`, prefills in; `decode_speedup`, the steps alone)."""
    b = str(rec["calibration"]["batch"])
    return {"batch": rec["calibration"]["batch"], "temperature": rec.get("temperature", 0.0),
            "run": run["name"], **{k: run["datasets"]["overall"].get(k)
                                   for k in ("tau", "speedup", "decode_speedup", "x_parts")},
            "expected_speedup": rec["by_batch"][b]["expected_speedup"],
            "expected_as_evaluated": rec["by_batch"][b].get("expected_as_evaluated")}


def best_row(rec: dict, batch: int) -> dict | None:
    """The row of the setting `rec` (recommend_setting's) finds best at `batch`, or None."""
    r = rec["by_batch"].get(str(batch))
    return next((x for x in r["settings"] if x["setting"] == r["best"]), None) if r else None


def best_tree(rec: dict, batch: int):
    """The TreeSpec of the setting `rec` (recommend_setting's) finds best at `batch`, or None
    (a block-verified chain: its chain; best_row tells)."""
    from drafter.decoding.decode import TreeSpec

    row = best_row(rec, batch)
    if row is None:
        return None
    if row.get("k"):
        return TreeSpec.chain(row["k"])
    t = row["tree"]
    return TreeSpec(t["depth"], t["topk"], t["tokens"])
