"""What a drafter was trained with, as its export says it: the `training` record of drafter.json,
the README's "How it was trained" section, and `drafter check`'s rule on greedy-only answers.

    rec = record(state, generate_manifest)     # export: from the checkpoint and generate
    lines = readme_section(rec, state.get("val"))
    checks = c_greedy_answers(Path(dir), ed.meta)   # drafter check: [] without the record

A drafter learns the contexts it is trained on: one trained only on greedy answers
(generate.temperature 0, no extra temperatures) never saw the sampled continuations a request
at T > 0 produces, and accepts less there (docs/generate.md, "More than one answer per
prompt"). The rule warns when such a drafter's README carries tuned serving settings for a
temperature above 0 (evaluate's "### Temperature X" sections): an export served with T > 0
flags. Without them it passes and says what the answers were.
"""
from __future__ import annotations

import re
from pathlib import Path

from drafter.export.rules import PASS, WARN, Check

NAME = "answer_temperatures"
_TUNED = re.compile(r"^###\s+Temperature\s+([0-9.]+)")


def record(state: dict, generate: dict | None) -> dict:
    """drafter.json's `training`: the checkpoint's objective (state.json; None before the loss
    was recorded) and the answers the drafter learned: "generated" at `temperatures`, the
    "data"'s own (generate disabled), or "unknown" (no generate manifest in the run)."""
    if generate is None:
        answers, temps = "unknown", None
    elif generate.get("enabled") is False:
        answers, temps = "data", None
    else:
        s = generate.get("sampling") or {}
        answers = "generated"
        temps = [float(s.get("temperature", 0.0)), *map(float, s.get("extra_temperatures") or [])]
    return {"objective": state.get("objective"), "answers": answers,
            "answer_temperatures": temps}


def greedy_only(rec: dict | None) -> bool:
    return bool(rec) and rec.get("answers") == "generated" and \
        all(t == 0 for t in rec.get("answer_temperatures") or [0.0])


def readme_section(rec: dict, val: dict | None, step=None) -> list[str]:
    """The README's "How it was trained": the loss, the answers' temperatures, and the
    validation's simulated τ at each temperature it was measured at."""
    obj = rec.get("objective") or {}
    if obj:
        how = ["draft positions weighted by D-PACE" if obj.get("position_weight") == "dpace"
               else f"draft position i weighted {obj.get('ttt_decay', 0.8):g}**i",
               f"optimizer {obj.get('optimizer', 'adamw')}"]
        if obj.get("noise"):
            how.append(f"noise {obj['noise']:g} x the aux states' RMS")
        lines = ["## How it was trained", "", f"- Loss: {obj.get('describe')} (docs/train.md, "
                 f"\"The loss\"); {', '.join(how)}."]
    else:
        lines = ["## How it was trained", "", "- Loss: the soft cross-entropy to the target "
                 "(kl@T1; recorded before the loss was a choice)."]
    temps = rec.get("answer_temperatures")
    if rec.get("answers") == "generated":
        lines.append("- Answers: written by the target at temperature "
                     + ", ".join(f"{t:g}" for t in temps) + " (generate.temperature, "
                     "generate.extra_temperatures), one pass each, in one dataset.")
    else:
        lines.append("- Answers: " + ("the data's own (generate disabled)."
                                      if rec.get("answers") == "data" else "not recorded."))
    val = val if isinstance(val, dict) else {}
    taus = val.get("sim_tau_t") or {t: val[k] for t, k in (("0", "sim_tau"), ("1", "sim_tau_p"))
                                    if isinstance(val.get(k), (int, float))}
    if taus:
        chain = f"a {len(val['acc'])}-draft chain" if val.get("acc") else "a chain"
        lines.append(f"- Validation at step {step}: simulated τ of {chain}, teacher-forced on "
                     "held-out answers, " + ", ".join(f"{float(v):.2f} at T={t}"
                                                      for t, v in taus.items())
                     + " (`drafter evaluate` measures the real one).")
    if greedy_only(rec):
        lines.append("- Trained on greedy answers only: requests sampled at a temperature above "
                     "0 continue in ways it never saw, and accept less. To serve them, answer "
                     "again at the temperatures you serve (`generate.extra_temperatures: "
                     "evaluate`) and train again.")
    return lines + [""]


def c_greedy_answers(path: Path, meta: dict | None) -> list[Check]:
    """The rule (module docstring) on an engine dir: [] when drafter.json has no record or
    does not know the answers."""
    rec = (meta or {}).get("training")
    if not isinstance(rec, dict) or rec.get("answers") == "unknown":
        return []
    if not greedy_only(rec):
        temps = rec.get("answer_temperatures")
        return [Check(NAME, PASS, "answers generated at temperature " + ", ".join(
            f"{t:g}" for t in temps) if temps else f"answers: {rec.get('answers')}")]
    readme = Path(path) / "README.md"
    text = readme.read_text(errors="replace") if readme.is_file() else ""
    sampled = [(n, float(m.group(1))) for n, line in enumerate(text.splitlines(), 1)
               if (m := _TUNED.match(line.strip())) and float(m.group(1)) > 0]
    if sampled:
        n, t = sampled[0]
        return [Check(NAME, WARN, f"trained on greedy answers only (generate.temperature 0, no "
                      f"extra temperatures), but README.md line {n} serves temperature {t:g}: "
                      "sampled requests continue in ways it never saw and accept less; answer "
                      "again at the temperatures you serve (generate.extra_temperatures: "
                      "evaluate) and train again")]
    return [Check(NAME, PASS, "trained on greedy answers only; its README tunes no temperature "
                  "above 0 (serve it greedily, or train on sampled answers too)")]
