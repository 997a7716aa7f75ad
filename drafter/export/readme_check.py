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

The README is read line by line (a command continued with a trailing backslash is one command):
a `### Temperature X` heading (evaluate's tuned section) puts the commands under it at
temperature X; a line of prose that says "temperature > 0" (export's "Serve it" section) puts
the next code block there; other commands serve any temperature. A vLLM command's speculative
config is read as vLLM's own argument parser reads it (vllm/utils/argparse_utils.py,
FlexibleArgumentParser; vllm/engine/arg_utils.py): `--speculative-config JSON`,
`--speculative-config=JSON`, `-sc JSON`, underscores for dashes in the flag
(`--speculative_config`), dotted keys (`--speculative-config.draft_sample_method probabilistic`,
which replace a JSON given too), `--spec-method`, `--spec-model`, `--spec-tokens`, and dashes for
underscores in the JSON's keys. Its fields are then checked as vLLM checks them: against the
installed vLLM's SpeculativeConfig (field names, types and allowed values), else against the
values drafter knows (KNOWN). WARN when vLLM would refuse a command (bad JSON, an unknown key, a
value such as a misspelt `draft_sample_method`: the command does not start), when a command for
a temperature above 0 drafts greedily, or when no command in the README samples its drafts at
all (every sampled request would be served greedily); PASS otherwise.
"""
from __future__ import annotations

import importlib.util
import json
import re
import shlex
from functools import lru_cache
from pathlib import Path

from drafter.export.rules import PASS, WARN, Check

NAME = "sampled_drafts"
_HEADING = re.compile(r"^(#+)\s+Temperature\s+([0-9.]+)")
# vLLM's flags that set speculative config fields one by one (vllm/engine/arg_utils.py)
_SPEC_FLAGS = {"--spec-method": "method", "--spec-model": "model",
               "--spec-tokens": "num_speculative_tokens"}
# The allowed values drafter knows, for a machine without vLLM (vllm/config/speculative.py:
# DraftSampleMethod, RejectionSampleMethod)
KNOWN = {"draft_sample_method": ("greedy", "probabilistic"),
         "rejection_sample_method": ("standard", "synthetic", "block")}


def commands(text: str) -> list[dict]:
    """The serving commands of a README: [{"engine", "samples", "temperature" (None: any),
    "where" (the heading above it), "line", and for vLLM "config" (the speculative config
    as vLLM reads it) and "refused" (why vLLM would not start it, or None)}]."""
    out, section_t, pending, in_code, where = [], None, None, False, ""
    lines, first, cont = text.splitlines(), 0, ""
    for n, line in enumerate(lines, 1):
        s = line.strip()
        if s.startswith("```"):
            if in_code:
                pending = None           # a prose marker covers one code block
            in_code, cont = not in_code, ""
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
        if s.endswith("\\"):            # continued on the next line: one command
            first, cont = first if cont else n, cont + s[:-1] + " "
            continue
        cmd, at, cont = cont + s, first if cont else n, ""
        t = pending if pending is not None else section_t
        try:
            argv = shlex.split(cmd, comments=True)
        except ValueError:               # an unclosed quote: the shell refuses it too
            argv = cmd.split()
        here = {"temperature": t, "where": where, "line": at}
        cfg, refused = vllm_speculative(argv)
        if cfg is not None or refused is not None:
            refused = refused or refusal(cfg)
            out.append({"engine": "vLLM", **here, "config": cfg, "refused": refused,
                        "samples": not refused and cfg.get("draft_sample_method") ==
                        "probabilistic"})
        if "--speculative-algorithm" in argv and _value(argv, "--speculative-eagle-topk") == "1":
            out.append({"engine": "SGLang", **here,
                        "samples": "--speculative-use-rejection-sampling" in argv})
    return out


def _value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a[len(flag) + 1:]
    return None


def _flag(arg: str) -> str:
    """An option as vLLM's parser sees it: underscores turned to dashes from the `--` to the
    first dot, before any `=value` (FlexibleArgumentParser.parse_args)."""
    key, eq, value = arg.partition("=")
    head, dot, rest = key[2:].partition(".")
    return "--" + head.replace("_", "-") + dot + rest + eq + value


def vllm_speculative(argv: list[str]) -> tuple[dict | None, str | None]:
    """The speculative config a vLLM command line gives, read as vLLM's parser reads it (module
    doc; the last `--speculative-config` wins, dotted keys gathered after it); keys with dashes
    for underscores. -> (the config, or None when the command gives none; why vLLM refuses its
    JSON, or None)."""
    whole, dotted, single, refused, found = None, {}, {}, None, False
    i = 0
    while i < len(argv):
        a = _flag(argv[i]) if argv[i].startswith("--") else argv[i]
        name, eq, value = a.partition("=")
        takes = not eq and i + 1 < len(argv)
        nxt = argv[i + 1] if takes else None
        if name in ("--speculative-config", "-sc"):
            found, i = True, i + (0 if eq else 1)
            raw = value if eq else nxt
            try:
                whole = json.loads(raw) if raw not in (None, "", "None") else None
                if whole is not None and not isinstance(whole, dict):
                    raise ValueError("not a JSON object")
            except ValueError as e:
                refused, whole = f"--speculative-config {raw!r} is not a JSON object ({e})", None
        elif name.startswith("--speculative-config."):
            found, i = True, i + (0 if eq else 1)
            raw = value if eq else (nxt or "")
            try:
                v = json.loads(raw)
            except ValueError:
                v = raw
            d = dotted
            *keys, last = name[len("--speculative-config."):].split(".")
            for k in keys:
                d = d.setdefault(k, {})
            d[last] = v
        elif name in _SPEC_FLAGS:
            found, i = True, i + (0 if eq else 1)
            single[_SPEC_FLAGS[name]] = value if eq else nxt
        i += 1
    if not found:
        return None, None
    cfg = dict(dotted) if dotted else dict(whole or {})  # the dotted ones come last: they win
    for key, v in single.items():
        if key in cfg:
            return cfg, f"--spec-* and --speculative-config['{key}'] are mutually exclusive"
        cfg[key] = v
    return {k.replace("-", "_"): v for k, v in cfg.items()}, refused


def refusal(cfg: dict) -> str | None:
    """Why vLLM would refuse these speculative config fields, or None: by the installed vLLM's
    SpeculativeConfig (a pydantic dataclass that forbids unknown keys), else by KNOWN."""
    fields = _vllm_fields()
    if fields is None:
        for key, allowed in KNOWN.items():
            if key in cfg and cfg[key] not in allowed:
                return f"{key}={cfg[key]!r} is not one of {', '.join(map(repr, allowed))}"
        return None
    from pydantic import ValidationError

    version, known = fields
    for key, v in cfg.items():
        if key not in known:
            return f"unknown key {key!r} (vLLM {version}'s SpeculativeConfig has no such field)"
        check = _adapter(key)
        try:
            if check is not None:
                check.validate_python(v)
        except ValidationError as e:
            return f"{key}={v!r}: {e.errors()[0]['msg']} (vLLM {version}'s SpeculativeConfig)"
    return None


@lru_cache(maxsize=1)
def _vllm_fields():
    """(vLLM's version, {field: its pydantic FieldInfo}) of the installed vLLM's
    SpeculativeConfig, or None without vLLM (or when its config cannot be read)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        from drafter.core.vllm import quiet_cpu_triton

        quiet_cpu_triton()
        import vllm
        from vllm.config.speculative import SpeculativeConfig

        return vllm.__version__, dict(SpeculativeConfig.__pydantic_fields__)
    except Exception:  # noqa: BLE001 - an engine's internals move between versions: KNOWN
        return None


@lru_cache(maxsize=None)
def _adapter(key: str):
    """A pydantic TypeAdapter of the field's type and constraints (`Field(gt=0)`), as vLLM's
    dataclass validates it; None when one cannot be built (the field is then not checked)."""
    from typing import Annotated

    from pydantic import TypeAdapter

    f = _vllm_fields()[1][key]
    try:
        return TypeAdapter(Annotated[(f.annotation, *f.metadata)] if f.metadata
                           else f.annotation)
    except Exception:  # noqa: BLE001 - an internal type pydantic cannot build alone
        return None


def c_sampled_drafts(path: Path) -> list[Check]:
    """The rule (module doc) on `path`/README.md."""
    readme = Path(path) / "README.md"
    if not readme.is_file():
        return []
    cmds = commands(readme.read_text(errors="replace"))
    if not cmds:
        return [Check(NAME, PASS, "the README gives no vLLM or SGLang chain command")]
    refused = [c for c in cmds if c.get("refused")]
    if refused:
        c = refused[0]
        return [Check(NAME, WARN, f"README.md line {c['line']} ({c['where']}): vLLM refuses "
                      f"this command's speculative config, so it does not start: "
                      f"{c['refused']} ({len(refused)} such command(s))")]
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
