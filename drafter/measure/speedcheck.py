"""Speed figures a user can trust: plain and speculative decode steps timed in turns, and whether
a temperature's speedups hold up, with the reason when they do not.

    t = interleaved(dec, prompts, settings, temperature, stop, steps)   # {name: {step_ms: [..]}}
    v = check(runs, plain, t)            # {"reliable", "reasons", "interleaved"}

Evaluate times each method in a pass of its own over every prompt, one after the other: a load
that comes and goes (another job on the machine, a thermal or clock change) lands on one method's
pass and not the other's, and the ratio of the two is then that load's, not the drafter's (a
busy CPU once gave a plain step of 834 ms against its 43 ms forward, and a 10.6x speedup at τ
1.08). So each temperature's settings also decode the same prompts in turns, REPEATS times, the
order rotated each time (plain, chain, tree; then chain, tree, plain; ...; a repeat decodes the
prompts again until its steps took MIN_SECONDS): each repeat gives every setting's decode step
time under the same conditions, and `interleaved_speedup` = τ x
plain's median step / the setting's median step.

A temperature's speed figures are unreliable, and the tuner recommends nothing from them, when:
- a setting's step time moves across the repeats by more than SPREAD (max / min - 1): the
  machine's speed changed while it was measured;
- a plain step runs longer beyond its parts (its target forward, timed on its own at the shapes
  its steps ran at: evaluate's `parts_ms`) than a speculative step beyond its parts (its
  verification and drafter forwards), by more than PARTS_SLACK of the plain step: a speculative
  step runs every piece of a plain step's own logic (sampling, the commit, the host's reads)
  and more, so a plain step's surplus cannot exceed it unless something slowed the plain pass
  alone; the 834 ms plain step above ran 791 ms over its forward;
- the passes' speedup per step (τ x plain's decode step / the setting's) and the interleaved one
  differ by more than DISAGREE (their ratio): the passes, one after the other, saw a machine the
  turns did not.
"""
from __future__ import annotations

import statistics

import torch

REPEATS = 3        # interleaved repeats of every setting
MIN_SECONDS = 0.25  # a repeat decodes the prompts again until its steps took this long
SPREAD = 0.5       # a setting's repeats: max / min - 1 above this is unstable
PARTS_SLACK = 0.25  # plain's surplus over its parts may exceed a speculative step's by this
DISAGREE = 0.5     # passes' against interleaved speedup: a ratio beyond 1 +- this disagrees


def interleaved(dec, prompts: list[list[int]], settings: list[tuple], temperature: float,
                stop, steps: int, repeats: int = REPEATS, seed: int = 0) -> dict:
    """The decode step time of each setting, `repeats` times in turns (module doc). settings:
    [(name, proposer or None, tree or None, chain_verify or None)]; each decodes `prompts` (one
    batch) for `steps` new tokens at `temperature` with the same seed. Returns {name:
    {"step_ms": [per repeat], "median", "spread"}} (spread: max / min - 1)."""
    times: dict[str, list[float]] = {name: [] for name, *_ in settings}
    n = len(settings)
    for r in range(repeats):
        for name, prop, tree, verify in settings[r % n:] + settings[:r % n]:
            seconds, its = 0.0, 0
            dec.chain_verify = verify
            try:
                while seconds < MIN_SECONDS:     # (a tiny model's decoding: milliseconds)
                    torch.manual_seed(seed)
                    dec.generate(prompts, steps, stop_ids=stop, temperature=temperature,
                                 proposer=prop, tree=tree)
                    seconds += dec.last["seconds"] - dec.last["prefill_seconds"]
                    its += dec.last["iterations"]
                    if not dec.last["iterations"]:
                        break
            finally:
                dec.chain_verify = None
            if its:
                times[name].append(1000 * seconds / its)
    return {name: {"step_ms": [round(x, 3) for x in ts],
                   "median": round(statistics.median(ts), 3) if ts else None,
                   "spread": round(max(ts) / min(ts) - 1, 3) if ts and min(ts) > 0 else None}
            for name, ts in times.items()}


def check(runs: list[dict], plain: dict, timing: dict, plain_name: str = "plain") -> dict:
    """The verdict on one temperature's speed figures (module doc). runs: that temperature's
    run records (their `name` keys `timing`, their overall's decode_step_ms, parts_ms, tau);
    plain: the plain summary's overall. Sets each run's overall `interleaved_speedup`. Returns
    {"reliable", "reasons": [...], "interleaved": timing, "limits": {...}}."""
    reasons = []
    for name, t in timing.items():
        if t["spread"] is not None and t["spread"] > SPREAD:
            reasons.append(f"{name}: its decode step took {min(t['step_ms']):.2f} to "
                           f"{max(t['step_ms']):.2f} ms over {len(t['step_ms'])} interleaved "
                           f"repeats (spread {t['spread']:.0%}, above {SPREAD:.0%})")
    p_step, p_parts = plain.get("decode_step_ms"), plain.get("parts_ms")
    p_med = (timing.get(plain_name) or {}).get("median")
    for r in runs:
        o = r["datasets"]["overall"]
        s_step, s_parts, tau = o.get("decode_step_ms"), o.get("parts_ms"), o.get("tau")
        s_med = (timing.get(r["name"]) or {}).get("median")
        if tau and p_med and s_med:
            o["interleaved_speedup"] = round(tau * p_med / s_med, 3)
        if p_step and p_parts and s_step and s_parts:
            surplus, theirs = p_step - p_parts, s_step - s_parts
            if surplus > theirs + PARTS_SLACK * p_step:
                reasons.append(
                    f"plain's decode step took {p_step:.2f} ms against the {p_parts:.2f} ms of "
                    f"its target forward ({p_step / p_parts:.2f}x its parts), {surplus:.2f} ms "
                    f"over them, while {r['name']}'s ran {theirs:.2f} ms over its parts: a "
                    "speculative step runs all of a plain step's own logic and more, so the "
                    "plain pass was slowed by something else")
        if tau and p_step and s_step and o.get("interleaved_speedup"):
            passes = tau * p_step / s_step
            ratio = passes / o["interleaved_speedup"]
            if not 1 / (1 + DISAGREE) <= ratio <= 1 + DISAGREE:
                reasons.append(f"{r['name']}: the passes give {passes:.2f}x per step, the "
                               f"interleaved repeats {o['interleaved_speedup']:.2f}x: the "
                               "machine's speed changed between the passes")
    return {"reliable": not reasons, "reasons": reasons, "interleaved": timing,
            "limits": {"repeats": REPEATS, "spread": SPREAD, "parts_slack": PARTS_SLACK,
                       "disagree": DISAGREE}}


def mark(runs: list[dict], verdict: dict) -> None:
    """Each run's overall records whether its temperature's speed figures hold up."""
    for r in runs:
        r["datasets"]["overall"]["speed_reliable"] = verdict["reliable"]
