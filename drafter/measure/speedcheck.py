"""Speed figures a user can trust: plain and speculative decode steps timed in turns, and whether
a temperature's speedups hold up, with the reason when they do not.

    t = interleaved(dec, prompts, settings, temperature, stop, steps)   # {name: {step_ms: [..]}}
    v = check(runs, plain, t)            # {"reliable", "reasons", "interleaved"}

Evaluate times each method in a pass of its own over every prompt, one after the other: a load
that comes and goes (another job on the machine, a thermal or clock change) lands on one method's
pass and not the other's, and the ratio of the two is then that load's, not the drafter's (a
busy machine can make a plain step many times its forward, and a speedup far beyond τ). So each
temperature's settings also decode the same prompts in turns, REPEATS times, the order rotated
each time (plain, chain, tree; then chain, tree, plain; ...; a repeat decodes the prompts again
until its steps took MIN_SECONDS): each repeat gives every setting's decode step time under the
same conditions, and `interleaved_speedup` = τ x plain's median step / the setting's median step.

A temperature's speed figures are unreliable, and the tuner recommends nothing from them, when:
- a setting's step time moves across the repeats by more than SPREAD (max / min - 1): the
  machine's speed changed while it was measured;
- a plain step took more than PLAIN_X_MAX times its parts (evaluate's `x_parts`: the step over
  its target forward, timed on its own at the shapes the steps ran at): a plain step is that
  forward plus one token's sampling and commit, near its forward where the forward is the
  work (docs/evaluate.md, "A step against its parts"; BENCHMARKS.md#decoding) and some more for
  a tiny target on a CPU, whose forward is a few milliseconds of Python; a step many times its
  forward is waiting on something else;
- a plain step took less than PLAIN_X_MIN times its parts: a plain step runs that forward and
  more, so the forward, timed on its own after the passes, ran under a load the steps did not
  see (or the steps under less), and every figure divided by it is that load's;
- a setting's pass ran at a step time more than DISAGREE times off the one it ran at in turns
  (either way; both having run MIN_STEPS decode steps): the pass, one after the other, saw a
  machine the turns did not (the turns decode the first prompts only, at the rows the passes
  ran at, so their shapes differ a little: the factor is wide).
"""
from __future__ import annotations

import statistics

import torch

REPEATS = 3        # interleaved repeats of every setting
MIN_SECONDS = 0.25  # a repeat decodes the prompts again until its steps took this long
SPREAD = 0.5       # a setting's repeats: max / min - 1 above this is unstable
PLAIN_X_MAX = 5.0  # a plain step over its target forward (x_parts) above this is not its own
PLAIN_X_MIN = 0.8  # ... below this, the forward was timed under another load than the steps
DISAGREE = 2.0     # a pass's step time against the turns': a ratio beyond this either way
MIN_STEPS = 16     # ... compared only when the pass ran this many decode steps


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
    run records (their `name` keys `timing`; their overall's decode_step_ms, iterations, tau);
    plain: the plain summary's overall (decode_step_ms, x_parts, parts_ms, iterations). Sets
    each run's overall `interleaved_speedup`. Returns {"reliable", "reasons": [...],
    "interleaved": timing, "limits": {...}}."""
    reasons = []
    for name, t in timing.items():
        if t["spread"] is not None and t["spread"] > SPREAD:
            reasons.append(f"{name}: its decode step took {min(t['step_ms']):.2f} to "
                           f"{max(t['step_ms']):.2f} ms over {len(t['step_ms'])} interleaved "
                           f"repeats (spread {t['spread']:.0%}, above {SPREAD:.0%})")
    x = plain.get("x_parts")
    if x and x > PLAIN_X_MAX:
        reasons.append(f"plain's decode step took {plain['decode_step_ms']:.2f} ms against the "
                       f"{plain['parts_ms']:.2f} ms of its target forward ({x:.2f}x, above "
                       f"{PLAIN_X_MAX:g}x): a plain step is that forward plus one token's "
                       "sampling and commit, so it waited on something else")
    elif x and x < PLAIN_X_MIN:
        reasons.append(f"plain's decode step took {plain['decode_step_ms']:.2f} ms against the "
                       f"{plain['parts_ms']:.2f} ms of its target forward ({x:.2f}x, below "
                       f"{PLAIN_X_MIN:g}x): a plain step runs that forward and more, so the "
                       "forward was timed under a load the steps did not see")
    p_med = (timing.get(plain_name) or {}).get("median")
    for name, o in [(plain_name, plain)] + [(r["name"], r["datasets"]["overall"]) for r in runs]:
        med = (timing.get(name) or {}).get("median")
        if name != plain_name and o.get("tau") and p_med and med:
            o["interleaved_speedup"] = round(o["tau"] * p_med / med, 3)
        step = o.get("decode_step_ms")
        if step and med and (o.get("iterations") or 0) >= MIN_STEPS \
                and not 1 / DISAGREE <= step / med <= DISAGREE:
            reasons.append(f"{name}: its pass ran at {step:.2f} ms a decode step, {med:.2f} ms "
                           "when timed in turns with the others: the machine's speed changed "
                           "between the passes")
    return {"reliable": not reasons, "reasons": reasons, "interleaved": timing,
            "limits": {"repeats": REPEATS, "spread": SPREAD, "plain_x_max": PLAIN_X_MAX,
                       "plain_x_min": PLAIN_X_MIN, "disagree": DISAGREE,
                       "min_steps": MIN_STEPS}}


def mark(runs: list[dict], verdict: dict) -> None:
    """Each run's overall records whether its temperature's speed figures hold up."""
    for r in runs:
        r["datasets"]["overall"]["speed_reliable"] = verdict["reliable"]
