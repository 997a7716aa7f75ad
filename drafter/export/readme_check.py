"""`drafter check`'s rule on a dir's README: the serving commands for sampled requests
(temperature above 0) must sample their drafts.

    checks = c_sampled_drafts(Path(dir))      # [] when the dir has no README.md

vLLM drafts the drafter's argmax unless its speculative config says `"draft_sample_method":
"probabilistic"` (vllm/config/speculative.py: `greedy` is the default, q then taken as one-hot in
the rejection test); SGLang proposes the argmax and verifies against the target alone unless
`--speculative-use-rejection-sampling` is given (chains). drafter's evaluator samples its drafts
at every temperature above 0, so a command that serves sampled requests without the flag accepts
less than the τ evaluate reported for that temperature (evaluate's report shows how much: its
"Acceptance inside vLLM" section puts vLLM's greedy drafting beside it).

The README is read line by line: a `### Temperature X` heading (evaluate's tuned section) puts
the commands under it at temperature X; a line of prose that says "temperature > 0" (export's
"Serve it" section) puts the next code block there; other commands serve any temperature. WARN
when a command for a temperature above 0 drafts greedily, or when no command in the README
samples its drafts at all (every sampled request would be served greedily); PASS otherwise.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from drafter.export.rules import PASS, WARN, Check

NAME = "sampled_drafts"
_VLLM = re.compile(r"--speculative-config '(\{.*?\})'")
_HEADING = re.compile(r"^(#+)\s+Temperature\s+([0-9.]+)")


def commands(text: str) -> list[dict]:
    """The serving commands of a README: [{"engine", "samples", "temperature" (None: any),
    "where" (the heading above it), "line"}]."""
    out, section_t, pending, in_code, where = [], None, None, False, ""
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith("```"):
            if in_code:
                pending = None           # a prose marker covers one code block
            in_code = not in_code
            continue
        if not in_code:
            m = _HEADING.match(s)
            if m:
                section_t, where = float(m.group(2)), s.lstrip("# ")
            elif s.startswith("#"):
                if len(s) - len(s.lstrip("#")) <= 2:
                    section_t = None
                where = s.lstrip("# ")
            elif "temperature > 0" in s:
                pending = 1.0
            elif "temperature 0" in s:
                pending = 0.0
            continue
        t = pending if pending is not None else section_t
        for m in _VLLM.finditer(s):
            try:
                cfg = json.loads(m.group(1))
            except ValueError:
                continue
            out.append({"engine": "vLLM", "temperature": t, "where": where, "line": n,
                        "samples": cfg.get("draft_sample_method") == "probabilistic"})
        if "--speculative-algorithm" in s and "--speculative-eagle-topk 1" in s:
            out.append({"engine": "SGLang", "temperature": t, "where": where, "line": n,
                        "samples": "--speculative-use-rejection-sampling" in s})
    return out


def c_sampled_drafts(path: Path) -> list[Check]:
    """The rule (module doc) on `path`/README.md."""
    readme = Path(path) / "README.md"
    if not readme.is_file():
        return []
    cmds = commands(readme.read_text(errors="replace"))
    if not cmds:
        return [Check(NAME, PASS, "the README gives no vLLM or SGLang chain command")]
    greedy = [c for c in cmds if c["temperature"] and not c["samples"]]
    if greedy:
        c = greedy[0]
        return [Check(NAME, WARN, f"README.md line {c['line']} ({c['where']}): the {c['engine']} "
                      f"command for temperature {c['temperature']:g} drafts greedily, accepting "
                      f"less than evaluate's sampled τ; add "
                      + ('"draft_sample_method": "probabilistic"' if c["engine"] == "vLLM"
                         else "--speculative-use-rejection-sampling")
                      + f" ({len(greedy)} such command(s))")]
    if not any(c["samples"] for c in cmds):
        return [Check(NAME, WARN, "every serving command in README.md drafts greedily: requests "
                      "sampled at a temperature above 0 accept less than evaluate's sampled τ "
                      "(vLLM: \"draft_sample_method\": \"probabilistic\"; SGLang: "
                      "--speculative-use-rejection-sampling)")]
    return [Check(NAME, PASS, f"{sum(c['samples'] for c in cmds)} of {len(cmds)} serving "
                  "commands sample their drafts; none for a temperature above 0 drafts greedily")]
