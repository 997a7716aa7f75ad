"""Acceptance measured inside vLLM: the export served beside the target, at every temperature
evaluated, τ from vLLM's counters, set against drafter's own evaluator.

    res = vllm_acceptance(cfg, native_dir, k, sets, stop, max_new, temperatures=[0.0, 1.0])
    # sets: {temperature: [(name, rounds or build)]}: fixed prompt rounds [[(record, ids)], ...]
    # (the ones drafter's own evaluator decoded at that temperature), or build(r, answers) ->
    # [(record, ids)] for targets only vLLM runs (later turns then carry vLLM's own answers)
    compare(res, runs)            # drafter's chain runs beside each row: counts, agreement test

The target that drafter exists for runs only inside a serving engine, so the acceptance a user
will get is the engine's. vLLM decodes the prompts in fresh `LLM`s with the user's parallelism
and quantisation (target.engine_args):

1. plain, no drafter: at temperature 0 the reference (and multi-turn prompts' later turns when
   vLLM builds them; at a temperature above 0 only for that);
2. `speculative_config={"method": "eagle3", "model": DIR, "num_speculative_tokens": K,
   "draft_sample_method": "probabilistic"}`: drafts sampled from the drafter and its whole
   distribution used in the rejection test, what drafter's evaluator measures at every
   temperature (at temperature 0 vLLM drafts the argmax whatever the method);
3. at temperatures above 0, the same with vLLM's default `draft_sample_method: greedy`: the
   drafter's argmax proposed and its q taken as one-hot: the second row, what serving without
   the flag gives (vllm/config/speculative.py).

A block drafter's export (DSpark, DFlash: config.json's architectures) is served with its own
method (`"method": "dflash"`), K its trained block size whatever K the caller passes (a block of
another length attends over other queries than in training); `engine_method(dir)` reads both.
vLLM's CPU build serves DFlash through its V1 runner's DFlashProposer; DSpark only through the
V2 runner, which needs Triton (docs/export.md), so its LLM refuses to start there.

τ per dataset = 1 + accepted / steps, steps = draft tokens / K
(`vllm:spec_decode_num_accepted_tokens` and `vllm:spec_decode_num_draft_tokens`: drafter's own
definition, the bonus token counted; vLLM's `num_drafts` also counts a last scheduling with
nothing left to draft), and the acceptance at each position from
`vllm:spec_decode_num_accepted_tokens_per_pos`; each prompt's own histogram of accepted drafts
per step comes from vLLM's per-request metrics (`per_request_spec_decode_metrics: summary`). At
temperature 0 greedy outputs with and without the drafter are compared token for token
(identical, or the first difference); in 16-bit a difference can be vLLM's own batch-dependent
rounding, which is why it is reported and not judged here (drafter's own evaluator, where the
target fits, gives the lossless verdict).

`compare` puts drafter's chain run at the same K and temperature beside each row: at temperature
0 the counts must be equal (both decode the target's greedy text); above 0 the two sample
different texts, and drafter/measure/agreement.py tests whether their per-position acceptance
and τ differ by more than chance.
"""
from __future__ import annotations

import logging
import time

from drafter.measure.agreement import agree, verdict

log = logging.getLogger("drafter")
PROBABILISTIC, GREEDY = "probabilistic", "greedy"


def _counters(llm) -> dict:
    """vLLM's spec-decode counters now: drafts, draft_tokens, accepted, per_pos [K]."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts",
             "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            out["per_pos"] = [a + b for a, b in zip(out["per_pos"], vals)] \
                if out["per_pos"] else vals
    return out


def _delta(after: dict, before: dict) -> dict:
    per = [a - b for a, b in zip(after["per_pos"], before["per_pos"] or
                                 [0] * len(after["per_pos"]))]
    return {"drafts": after["drafts"] - before["drafts"],
            "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
            "accepted": after["accepted"] - before["accepted"], "per_pos": per}


def _llm(cfg, max_len: int, speculative: dict | None):
    import torch

    from drafter.core.vllm import llm_kwargs, quiet_cpu_triton, vllm_dtype

    quiet_cpu_triton()
    from vllm import LLM

    t = cfg.target
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = llm_kwargs(t, vllm_dtype(t, device), max_model_len=max_len, seed=cfg.evaluate.seed)
    if speculative:
        kw["speculative_config"] = speculative
        kw["disable_log_stats"] = False  # the spec-decode counters are its stats
        kw["per_request_spec_decode_metrics"] = "summary"   # each prompt's histogram
    return LLM(**kw)


def _generate(llm, batch: list[tuple[int, list[int]]], params) -> tuple[list, list]:
    """The new tokens of each prompt, and its histogram of accepted drafts per step (None
    without speculative decoding)."""
    outs = llm.generate([{"prompt_token_ids": ids} for _, ids in batch], params, use_tqdm=False)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    hists = [list(getattr(o.outputs[0].spec_decode_metrics, "histogram", None) or [])
             for o in outs]
    return toks, hists


def _params(T: float, max_new: int, stop: list[int]):
    from vllm import SamplingParams

    # token ids only: drafter decodes what it needs itself (a target served without its
    # tokenizer, `skip_tokenizer_init`, has nothing to detokenize with)
    return SamplingParams(temperature=T, max_tokens=max_new, stop_token_ids=list(stop),
                          detokenize=False)


def engine_method(drafter_dir) -> tuple[str, int | None]:
    """(vLLM's speculative method, the trained block size or None) of an export dir: 'eagle3',
    or a block drafter's 'dflash' / 'dspark' (drafter/export/dsparkdir.py)."""
    import json
    from pathlib import Path

    from drafter.export.dsparkdir import method_of

    try:
        config = json.loads((Path(drafter_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "eagle3", None
    m = method_of(config) if isinstance(config, dict) else None
    return (m, int(config.get("block_size") or 0) or None) if m else ("eagle3", None)


def vllm_acceptance(cfg, drafter_dir, k: int, sets, stop: list[int], max_new: int,
                    tokenizer=None, temperatures=(0.0,)) -> dict:
    """vLLM's τ per temperature and dataset for the export at `drafter_dir` at chain K, or a
    block drafter's at its block size (module doc). `sets`: {temperature: [(name, rounds or
    build)]} (a list: the same sets at every temperature). Returns {"engine", "version", "k",
    "spec_method", "rows": [{"temperature", "draft_sample_method", "datasets": {name: {...}},
    "overall": {...}}], "datasets" and "overall" (the temperature-0 row's), "seconds"}."""
    from drafter import DrafterError
    from drafter.core.vllm import quiet_cpu_triton, shutdown_llm

    quiet_cpu_triton()
    import vllm

    spec_method, block = engine_method(drafter_dir)
    if block and k != block:
        log.info("evaluate: vLLM serves the %s drafter at its trained block size %d (not K=%d)",
                 spec_method, block, k)
        k = block
    if k < 1:
        raise DrafterError(f"evaluate.engine=vllm: K must be >= 1, got {k}")
    temps = [float(t) for t in temperatures]
    if not isinstance(sets, dict):
        sets = {T: sets for T in temps}
    t0 = time.perf_counter()
    rounds: dict[float, dict] = {T: {} for T in temps}
    plain: dict[float, dict] = {T: {} for T in temps}
    # 1. plain: the greedy reference, and the later turns of conversations built here
    llm = None
    try:
        for T in temps:
            for name, given in sets[T]:
                if callable(given):
                    rounds[T][name], answers, r = [], {}, 0
                    while batch := given(r, answers):
                        if llm is None:
                            llm = _llm(cfg, _max_len(cfg, batch, max_new), None)
                        toks, _ = _generate(llm, batch, _params(T, max_new, stop))
                        for (i, _), t in zip(batch, toks):
                            text = tokenizer.decode(t, skip_special_tokens=True) if tokenizer \
                                else ""
                            answers.setdefault(i, []).append(text)
                        rounds[T][name].append(batch)
                        plain[T][name] = plain[T].get(name, []) + toks
                        r += 1
                else:
                    rounds[T][name] = [list(b) for b in given]
        longest = max([len(ids) for rs in rounds.values() for x in rs.values() for b in x
                       for _, ids in b] or [1])
        # K more: vLLM caps a step's tokens at max_model_len, so a request within K tokens of
        # it gets fewer drafts (a short step drafter's own evaluator never takes, and
        # draft_tokens / K no longer counts the steps); a block drafter's queries take K + 1
        # slots more (config/speculative.py, max_num_new_slots_for_drafting)
        max_len = longest + max_new + k + 1 + (k + 1 if block else 0)
        if 0.0 in temps and any(name not in plain[0.0] for name in rounds[0.0]):
            if llm is None:
                llm = _llm(cfg, max_len, None)
            for name in rounds[0.0]:
                if name not in plain[0.0]:
                    plain[0.0][name] = [t for b in rounds[0.0][name]
                                        for t in _generate(llm, b, _params(0.0, max_new,
                                                                           stop))[0]]
    finally:
        if llm is not None:
            shutdown_llm(llm)
    log.info("evaluate: vLLM plain decoding done")
    # 2. and 3. speculative: the same prompt ids, the counters per temperature and dataset
    rows = []
    for method in (PROBABILISTIC, GREEDY):
        at = temps if method == PROBABILISTIC else [T for T in temps if T > 0]
        if not at:
            continue
        spec = {"method": spec_method, "model": str(drafter_dir), "num_speculative_tokens": k}
        if method == PROBABILISTIC:
            spec["draft_sample_method"] = PROBABILISTIC
        llm = _llm(cfg, max_len, spec)
        try:
            for T in at:
                rows.append(_row(llm, T, method, k, rounds[T], plain[T], max_new, stop))
        finally:
            shutdown_llm(llm)
    rows.sort(key=lambda r: (r["temperature"], r["draft_sample_method"] != PROBABILISTIC))
    first = rows[0] if rows and rows[0]["temperature"] == 0 else None
    label = f"chain K={k}" if spec_method == "eagle3" else f"{spec_method} block of {k}"
    return {"engine": "vllm", "version": vllm.__version__, "k": k, "method": label,
            "spec_method": spec_method, "drafter": str(drafter_dir), "temperatures": temps,
            "rows": rows,
            "datasets": first["datasets"] if first else {},
            "overall": first["overall"] if first else {},
            "seconds": round(time.perf_counter() - t0, 1)}


def _row(llm, T: float, method: str, k: int, rounds: dict, plain: dict, max_new: int,
         stop: list[int]) -> dict:
    """One temperature x drafting method: per dataset the counters' difference, each prompt's
    histogram and, at temperature 0, the comparison with plain greedy."""
    per = {}
    for name in rounds:
        before = _counters(llm)
        toks, hists = [], []
        for b in rounds[name]:
            t, h = _generate(llm, b, _params(T, max_new, stop))
            toks += t
            hists += h
        c = _delta(_counters(llm), before)
        per[name] = _figures(c, k) | {"prompts": len(toks), "new_tokens": sum(map(len, toks)),
                                      "prompt_hists": hists}
        if T == 0:
            same = sum(a == b for a, b in zip(toks, plain[name]))
            first = next(({"prompt": j, "at": next((p for p, (x, y) in enumerate(zip(a, b))
                                                    if x != y), min(len(a), len(b)))}
                          for j, (a, b) in enumerate(zip(toks, plain[name])) if a != b), None)
            per[name] |= {"same_as_plain": same, "first_difference": first}
        log.info("evaluate: vLLM K=%d T=%g %s drafting %s: tau %.4f (%d accepted of %d "
                 "drafted)", k, T, method, name, per[name]["tau"] or 0, c["accepted"],
                 c["draft_tokens"])
    total = {"drafts": sum(d["drafts"] for d in per.values()),
             "draft_tokens": sum(d["draft_tokens"] for d in per.values()),
             "accepted": sum(d["accepted"] for d in per.values()),
             "per_pos": [sum(x) for x in zip(*[d["accepted_per_pos"] for d in per.values()])]}
    overall = _figures(total, k) | {"prompts": sum(d["prompts"] for d in per.values())}
    if T == 0:
        overall["same_as_plain"] = sum(d["same_as_plain"] for d in per.values())
    return {"temperature": T, "draft_sample_method": method if T > 0 else "argmax (T = 0)",
            "datasets": per, "overall": overall}


def _max_len(cfg, batch, max_new: int) -> int:
    """The context vLLM is started with when prompts are built as it goes: the target's own
    limit unless the user set one (target.engine_args.max_model_len)."""
    from drafter.core import target

    tc = target.text_config(target.load_config(cfg.target))
    return int(getattr(tc, "max_position_embeddings", 0) or
               max(len(ids) for _, ids in batch) + 4 * max_new)


def _figures(c: dict, k: int) -> dict:
    """τ over verification steps of K drafts: draft_tokens / K. vLLM's own `num_drafts` also
    counts a request's last scheduling, where nothing was left to draft (0 tokens): kept as
    `drafts`, not divided by."""
    steps = c["draft_tokens"] / k
    per_pos = [a / steps if steps else None for a in c["per_pos"]]
    return {"tau": round(1 + c["accepted"] / steps, 5) if steps else None,
            "steps": round(steps, 3), "drafts": c["drafts"], "draft_tokens": c["draft_tokens"],
            "accepted": c["accepted"], "accepted_per_pos": c["per_pos"],
            "acceptance_per_pos": per_pos}


# ------------------------------------------------------------------------ beside drafter's runs
def compare(res: dict, runs: list[dict]) -> dict:
    """Drafter's chain run of the same drafter kind (EAGLE-3, or a block drafter's block with no
    confidence cut: the runs' `kind` and `cut`) at res's K and each row's temperature beside the
    row, as `drafter`: its τ per dataset, steps, accepted, acceptance; at temperature 0
    `same_counts` (steps and accepted equal on every dataset), above it `agreement`
    (agreement.agree over the prompts' histograms, all datasets together). Returns res."""
    kind = res.get("spec_method", "eagle3")
    for row in res["rows"]:
        ours = next((r for r in runs if r["drafter"] == "drafter" and r["method"] == "chain"
                     and r.get("kind", "eagle3") == kind and r.get("cut") is None
                     and r.get("k") == res["k"] and r["temperature"] == row["temperature"]),
                    None)
        if ours is None:
            continue
        row["drafter"] = {n: {"tau": d.get("tau"), "steps": d["steps"],
                              "accepted": d["accepted"], "acceptance": d["acceptance"]}
                          for n, d in ours["datasets"].items()}
        if row["temperature"] == 0:
            row["same_counts"] = all(
                row["datasets"][n]["steps"] == d["steps"]
                and row["datasets"][n]["accepted"] == d["accepted"]
                for n, d in ours["datasets"].items() if n in row["datasets"])
        else:
            row["agreement"] = agree(hists(ours["datasets"]), hists(row["datasets"]))
    return res


def hists(datasets: dict) -> list[list[int]]:
    """Every prompt's histogram of accepted drafts per step, over the datasets (`overall` left
    out: it holds none)."""
    return [h for n, d in datasets.items() if n != "overall" for h in d.get("prompt_hists", [])]


def render_vllm(res: dict) -> str:
    """The report's section: per temperature, vLLM's τ and per-position acceptance with each
    drafting method beside drafter's own evaluator's, and the verdict."""
    L = [f"\n## Acceptance inside vLLM {res['version']}\n",
         f"The export ({res['drafter']}) served by vLLM, {res['method']}; τ = 1 + accepted "
         "/ steps from vLLM's own spec-decode counters. `probabilistic`: "
         "`\"draft_sample_method\": \"probabilistic\"` (drafts sampled, the drafter's whole "
         "distribution in the rejection test: what drafter's evaluator measures); `greedy`: "
         "vLLM's default (the drafter's argmax proposed, its q taken as one-hot). At "
         "temperature 0 the counts must equal drafter's; above it the two sample different "
         "texts, and the verdict is drafter/measure/agreement.py's test (per position and τ, "
         "prompts as clusters, Bonferroni).\n"]
    for row in res.get("rows") or []:
        o, T = row["overall"], row["temperature"]
        D = len(o.get("acceptance_per_pos") or [])
        L += [f"**Temperature {T:g}, vLLM drafting {row['draft_sample_method']}**\n",
              "| dataset | prompts | vLLM τ | drafter τ | accepted / drafted | "
              + " | ".join(f"pos {i} vLLM / drafter" for i in range(1, D + 1)) + " |",
              "|---|---|---|---|---|" + "---|" * D]
        ours = row.get("drafter") or {}
        for name, d in {**row["datasets"], "overall": o}.items():
            mine = ours.get(name) or {}
            acc = mine.get("acceptance") or [None] * D
            L.append(f"| {name} | {d['prompts']} | {_f(d['tau'])} | {_f(mine.get('tau'))} | "
                     f"{d['accepted']} / {d['draft_tokens']} | "
                     + " | ".join(f"{_f(a, 3)} / {_f(b, 3)}"
                                  for a, b in zip(d["acceptance_per_pos"], acc)) + " |")
        if T == 0:
            same = row.get("same_counts")
            L.append(f"\nGreedy outputs identical to vLLM's plain greedy on "
                     f"{o.get('same_as_plain')} of {o['prompts']} prompts; counts "
                     + ("equal to drafter's on every dataset." if same else
                        "NOT equal to drafter's." if same is False else "not compared.")
                     + "\n")
        else:
            L.append(f"\nAgainst drafter's evaluator: {verdict(row.get('agreement'))}.\n")
    return "\n".join(L) + "\n"


def _f(x, n=4) -> str:
    return "-" if x is None else f"{x:.{n}f}" if isinstance(x, float) else str(x)
