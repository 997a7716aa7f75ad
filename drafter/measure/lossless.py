"""The lossless verdict: at temperature 0 each speculative output must equal plain greedy decoding
of the target token for token; a 16-bit mismatch is decoded again in float32 to tell numerical
drift from a real divergence.
    v, info = compare(plain_out, spec_out, tie_tolerance)     # identical | tie | mismatch
    recheck_float32(model, checks, max_new, stop_ids)   # mismatch -> drift where float32 agrees
    drift = recheck_runs(model, runs, parts, rounds, max_new, stop_ids)   # evaluate's runs

In float32 any difference is a mismatch. In 16-bit the verification forward (N+1 tokens) and the
plain one (1 token) round differently, so a near-tie can flip the argmax, and once one token
differs the rest of the answer does too. Two rules keep such drift from failing a run:
- tie: the speculative token is one of the plain run's 8 runners-up (decode.runners_up) and its
  logit is within `evaluate.tie_tolerance` of the top one: counted and reported, not failed.
- drift: any other 16-bit mismatch is decoded again, plainly and speculatively with the same
  drafter and method, in float32 (the target and drafter converted in place; bf16 to float32 is
  exact), the mismatched prompts alone, batched with CUDA graphs (one by one in eager float32
  they took minutes: BENCHMARKS.md, Decoding). Identical there (or an exact float32 tie): numerical
  drift, counted and reported, not failed. Different there too: a real divergence, and the run
  fails naming it.
A planted acceptance bug (a step that accepts one token too many) differs in both precisions and
still fails (tests/test_evaluate.py).
"""
from __future__ import annotations

import logging

log = logging.getLogger("drafter")


def compare(plain, spec, tol: float) -> tuple[str, dict | None]:
    """Lossless verdict for one prompt: identical, tie (see the module doc) or mismatch; with the
    first divergence (index, both tokens, the speculative token's rank and gap in the plain run)."""
    a, b = plain.tokens, spec.tokens
    if a == b:
        return "identical", None
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    near = plain.second[i] if plain.second and i < len(plain.second) else []
    gaps = plain.gaps[i] if plain.gaps and i < len(plain.gaps) else []
    j = near.index(b[i]) if i < len(a) and i < len(b) and b[i] in near else None
    info = {"index": i, "plain": a[i] if i < len(a) else None,
            "speculative": b[i] if i < len(b) else None,
            "gap": (gaps[j] if j is not None else gaps[0]) if gaps else None, "rank": (
                j + 2 if j is not None else None)}
    if j is not None and gaps[j] <= tol:
        return "tie", info
    return "mismatch", info


def lossless_sum(items: list[dict]) -> dict:
    return {k: sum(d["lossless"][k] for d in items)
            for k in ("compared", "identical", "tie", "drift", "mismatch")}


def recheck_runs(model, runs: list[dict], parts: list[tuple], rounds: dict, max_new: int,
                 stop_ids) -> int:
    """Every 16-bit mismatch of evaluate's greedy runs (parts: each run's (drafter, tree);
    rounds: per dataset its prompt rounds, [(record, ids)] a round) decoded again in float32:
    a drift moves from the mismatch count to the drift count, the overall sums follow.
    Returns the drifts."""
    checks = []
    for r, (dr, tree) in zip(runs, parts):
        if r["temperature"] != 0:
            continue
        for name, d in r["datasets"].items():
            if name == "overall" or not d["lossless"]["mismatch"]:
                continue
            ids = {(i, t): x for t, batch in enumerate(rounds[name]) for i, x in batch}
            checks += [{"ids": ids[(x["record"], x["turn"] - 1)], "drafter": dr, "tree": tree,
                        "cut": r.get("cut"), "divergence": x, "counts": d["lossless"]}
                       for x in d["lossless"]["divergences"] if x["verdict"] == "mismatch"]
    drift = recheck_float32(model, checks, max_new, stop_ids)
    for c in checks:
        if c["divergence"]["verdict"] == "drift":
            c["counts"]["mismatch"] -= 1
            c["counts"]["drift"] += 1
    for r in runs:
        if r["temperature"] == 0:
            items = [d for n, d in r["datasets"].items() if n != "overall"]
            r["datasets"]["overall"]["lossless"] = lossless_sum(items)
    return drift


def recheck_float32(model, checks: list[dict], max_new: int, stop_ids, max_batch: int = 64
                    ) -> int:
    """checks: [{"ids": prompt token ids, "drafter": its Drafter, "tree": its TreeSpec,
    "divergence": the divergence dict compare() described, optionally "cut": a block drafter's
    confidence cut}], every one a 16-bit mismatch.
    Decodes the prompts again in float32, plainly (each prompt once) and speculatively (per
    drafter and method), in batches of up to `max_batch` with CUDA graphs on a GPU: in float32
    a row's tokens do not depend on the rows beside it (tests/test_decode.py). Sets
    divergence["verdict"] to "drift" where the two agree, and divergence["float32"] to the
    float32 verdict either way. The target and the drafters go back to their dtype after.
    Returns the number of drifts."""
    import torch

    from drafter.decoding.decode import Decoder
    from drafter.decoding.dspark import proposer_for

    if not checks:
        return 0
    dtype = next(model.parameters()).dtype
    drafters = {id(c["drafter"]): c["drafter"] for c in checks}
    log.info("evaluate: %d mismatch(es) in %s: decoding them again in float32", len(checks),
             str(dtype).replace("torch.", ""))
    drift = 0
    model.float()
    try:
        prompts = list(dict.fromkeys(tuple(c["ids"]) for c in checks))
        dec = Decoder(model, max_batch=min(max_batch, len(prompts)))
        plain = dict(zip(prompts, dec.generate([list(p) for p in prompts], max_new,
                                               stop_ids=stop_ids, temperature=0.0,
                                               record_gaps=True, continuous=True)))
        groups: dict[tuple, list[dict]] = {}
        for c in checks:
            groups.setdefault((id(c["drafter"]), c["tree"], c.get("cut")), []).append(c)
        for (key, tree, cut), group in groups.items():
            proposer = proposer_for(drafters[key], cut)        # allocate() makes it float32
            specs = dec.generate([c["ids"] for c in group], max_new, stop_ids=stop_ids,
                                 temperature=0.0, proposer=proposer, tree=tree, continuous=True)
            for c, spec in zip(group, specs):
                v, info = compare(plain[tuple(c["ids"])], spec, 0.0)
                c["divergence"]["float32"] = {"verdict": v, **(info or {})}
                if v != "mismatch":
                    c["divergence"]["verdict"] = "drift"
                    drift += 1
    finally:
        model.to(dtype)
        for d in drafters.values():
            d.to(dtype)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    log.info("evaluate: float32 found %d of %d drift, %d real divergence(s)", drift, len(checks),
             len(checks) - drift)
    return drift
