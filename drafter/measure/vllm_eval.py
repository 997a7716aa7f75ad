"""Acceptance measured inside vLLM: the export served beside the target, τ from vLLM's counters.

    res = vllm_acceptance(cfg, native_dir, k, sets, stop, max_new)
    # sets: [(name, rounds or build)]: fixed prompt rounds [[(record, ids)], ...] (the ones
    # drafter's own evaluator decoded), or build(r, answers) -> [(record, ids)] for targets only
    # vLLM runs (later turns then carry vLLM's own plain answers)

The target that drafter exists for runs only inside a serving engine, so the acceptance a user
will get is the engine's: vLLM decodes every prompt twice, each time in a fresh `LLM` with the
user's parallelism and quantisation (target.engine_args):

1. plain greedy, the reference (and the source of multi-turn prompts' later turns);
2. greedy with `speculative_config={"method": "eagle3", "model": DIR, "num_speculative_tokens":
   K}`, on the same prompt ids, its spec-decode counters read before and after each dataset.

τ per dataset = 1 + accepted / steps, steps = draft tokens / K (`vllm:spec_decode_num_accepted_tokens`
and `vllm:spec_decode_num_draft_tokens`: drafter's own definition, the bonus token counted; vLLM's
`num_drafts` also counts a last scheduling with nothing left to draft), and the acceptance at
each position from `vllm:spec_decode_num_accepted_tokens_per_pos`. Greedy outputs
with and without the drafter are compared token for token (identical, or the first difference);
in 16-bit a difference can be vLLM's own batch-dependent rounding, which is why it is reported
and not judged here (drafter's own evaluator, where the target fits, gives the lossless verdict).
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("drafter")


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
    return LLM(**kw)


def _generate(llm, batch: list[tuple[int, list[int]]], params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": ids} for _, ids in batch], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def vllm_acceptance(cfg, drafter_dir, k: int, sets: list[tuple], stop: list[int],
                    max_new: int, tokenizer=None) -> dict:
    """vLLM's τ per dataset for the export at `drafter_dir` at chain K, beside plain greedy
    (module docstring). Returns {"engine", "version", "k", "datasets": {name: {...}},
    "overall": {...}, "seconds"}."""
    from drafter import DrafterError
    from drafter.core.vllm import quiet_cpu_triton, shutdown_llm

    quiet_cpu_triton()
    import vllm
    from vllm import SamplingParams

    if k < 1:
        raise DrafterError(f"evaluate.engine=vllm: K must be >= 1, got {k}")
    params = SamplingParams(temperature=0.0, max_tokens=max_new, stop_token_ids=list(stop))
    t0 = time.perf_counter()
    longest = 1
    rounds: dict[str, list[list[tuple[int, list[int]]]]] = {}
    plain: dict[str, list[list[int]]] = {}
    # 1. plain: the reference, and the later turns of conversations when they are built here
    llm = None
    try:
        for name, given in sets:
            if callable(given):
                rounds[name], answers, r = [], {}, 0
                while True:
                    batch = given(r, answers)
                    if not batch:
                        break
                    if llm is None:
                        llm = _llm(cfg, _max_len(cfg, batch, max_new), None)
                    toks = _generate(llm, batch, params)
                    for (i, _), t in zip(batch, toks):
                        text = tokenizer.decode(t, skip_special_tokens=True) if tokenizer \
                            else ""
                        answers.setdefault(i, []).append(text)
                    rounds[name].append(batch)
                    plain[name] = plain.get(name, []) + toks
                    r += 1
            else:
                rounds[name] = [list(b) for b in given]
        longest = max([len(ids) for rs in rounds.values() for b in rs for _, ids in b] or [1])
        # K more: vLLM caps a step's tokens at max_model_len, so a request within K tokens of
        # it gets fewer drafts (a short step drafter's own evaluator never takes, and
        # draft_tokens / K no longer counts the steps; seen at τ 3.6 on the CPU)
        max_len = longest + max_new + k + 1
        if any(name not in plain for name in rounds):
            if llm is None:
                llm = _llm(cfg, max_len, None)
            for name in rounds:
                if name not in plain:
                    plain[name] = [t for b in rounds[name] for t in _generate(llm, b, params)]
    finally:
        if llm is not None:
            shutdown_llm(llm)
    log.info("evaluate: vLLM plain greedy done (%d prompts)", sum(len(v) for v in plain.values()))
    # 2. speculative: the same prompt ids, the counters per dataset
    spec = {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": k}
    llm = _llm(cfg, max_len, spec)
    per = {}
    try:
        for name in rounds:
            before = _counters(llm)
            toks = [t for b in rounds[name] for t in _generate(llm, b, params)]
            c = _delta(_counters(llm), before)
            same = sum(a == b for a, b in zip(toks, plain[name]))
            first = next(({"prompt": j, "at": next((p for p, (x, y) in enumerate(zip(a, b))
                                                    if x != y), min(len(a), len(b)))}
                          for j, (a, b) in enumerate(zip(toks, plain[name])) if a != b), None)
            per[name] = _figures(c, k) | {"prompts": len(toks),
                                          "new_tokens": sum(len(t) for t in toks),
                                          "same_as_plain": same, "first_difference": first}
            log.info("evaluate: vLLM chain K=%d %s: tau %.4f (%d accepted of %d drafted), "
                     "greedy identical to plain on %d of %d prompts", k, name,
                     per[name]["tau"] or 0, c["accepted"], c["draft_tokens"], same, len(toks))
    finally:
        shutdown_llm(llm)
    total = {"drafts": sum(d["drafts"] for d in per.values()),
             "draft_tokens": sum(d["draft_tokens"] for d in per.values()),
             "accepted": sum(d["accepted"] for d in per.values()),
             "per_pos": [sum(x) for x in zip(*[d["accepted_per_pos"] for d in per.values()])]}
    overall = _figures(total, k) | {
        "prompts": sum(d["prompts"] for d in per.values()),
        "same_as_plain": sum(d["same_as_plain"] for d in per.values())}
    return {"engine": "vllm", "version": vllm.__version__, "k": k, "method": f"chain K={k}",
            "drafter": str(drafter_dir), "datasets": per, "overall": overall,
            "seconds": round(time.perf_counter() - t0, 1)}


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


def render_vllm(res: dict, ours: dict | None = None) -> str:
    """The report's section: vLLM's τ per dataset (`res`, vllm_acceptance's), beside drafter's
    own evaluator's."""
    lines = [f"\n## Acceptance inside vLLM {res['version']}\n",
             f"The export ({res['drafter']}) served by vLLM at chain K={res['k']}, greedy; "
             "τ = 1 + accepted / drafts from vLLM's own spec-decode counters; greedy outputs "
             "compared with vLLM's plain greedy on the same prompt ids.\n",
             "| dataset | prompts | vLLM τ | drafter τ | accepted / drafted | same as plain |",
             "|---|---|---|---|---|---|"]
    for name, d in {**res["datasets"], "overall": res["overall"]}.items():
        mine = (ours or {}).get(name)
        lines.append(f"| {name} | {d['prompts']} | {d['tau'] if d['tau'] is not None else '-'}"
                     f" | {mine if mine is not None else '-'} | {d['accepted']} / "
                     f"{d['draft_tokens']} | {d['same_as_plain']} of {d['prompts']} |")
    return "\n".join(lines) + "\n"
