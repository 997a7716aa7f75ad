"""What differs in Inductor's FX-graph cache keys between two processes (issue 18: a `drafter
train` after a cold `drafter run` missed 7 of 9 graphs, after a `drafter train` none).

    TORCH_TRACE=/tmp/trace-a drafter run CONFIG --until train
    TORCH_TRACE=/tmp/trace-b drafter train CONFIG --force
    python benchmarks/cache_keys.py /tmp/trace-a /tmp/trace-b

Reads the structured traces (TORCH_TRACE's directories; each cache lookup is a chromium event
with the key's components, "[hash] name: value"). For each miss of B it finds A's lookup with
the most components in common, the same graph compiled in A, and prints B's status (hit or
miss), how many components the two share, and each component that differs, with both values
(a graph's code as a diff). A miss whose components all match A's would point at the cache
itself (not written, or evicted), not at the key.
"""
from __future__ import annotations

import argparse
import difflib
import json
import re
from pathlib import Path

_COMPONENT = re.compile(r"\[(\w+)\] ([^:]+): (.*)", re.S)


def lookups(trace_dir: Path) -> list[dict]:
    """The FX-graph cache lookups of every trace file in trace_dir, in order: {"name",
    "status", "key", "compile_id", "components": {name: (hash, value)}}."""
    out = []
    for f in sorted(trace_dir.glob("*.log")):
        payload: list[str] = []

        def flush():
            if not payload:
                return
            try:
                ev = json.loads("\n".join(payload))
            except json.JSONDecodeError:
                return
            args = ev.get("args") if isinstance(ev, dict) else None
            if not (isinstance(args, dict)
                    and str(ev.get("name", "")).startswith("fx_graph_cache")):
                return
            comps = {}
            for c in args.get("components") or ():
                m = _COMPONENT.match(c)
                if m:
                    comps[m.group(2)] = (m.group(1), m.group(3))
            out.append({"name": ev["name"], "status": args.get("cache_state")
                        or args.get("cache_status_detailed"), "key": args.get("key"),
                        "compile_id": args.get("compile_id"), "components": comps})

        with open(f, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("\t"):
                    payload.append(line[1:].rstrip("\n"))
                else:
                    flush()
                    payload = []
        flush()
    return out


def _short(v: str, n: int = 240) -> str:
    v = v.replace("\n", "\\n")
    return v if len(v) <= n else v[:n] + f"... ({len(v)} chars)"


def compare(a: list[dict], b: list[dict]) -> list[str]:
    lines = [f"A: {len(a)} lookups ({sum(r['status'] == 'hit' for r in a)} hits); "
             f"B: {len(b)} lookups ({sum(r['status'] == 'hit' for r in b)} hits)"]
    a = [r for r in a if r["components"]]
    for i, rb in enumerate(b):
        cb = rb["components"]
        if not cb:  # a hit carries no components: nothing to explain
            continue
        best = max(a, key=lambda ra: sum(ra["components"].get(k, (None,))[0] == h
                                         for k, (h, _) in cb.items()), default=None)
        head = (f"\nB #{i} {rb['name']} ({rb['status']}, compile {rb['compile_id']}, "
                f"key {rb['key']})")
        if best is None:
            lines.append(head + ": A has no lookups")
            continue
        ca = best["components"]
        same = sum(ca.get(k, (None,))[0] == h for k, (h, _) in cb.items())
        lines.append(head + f": closest A {best['name']} ({best['status']}, compile "
                     f"{best['compile_id']}, key {best['key']}), {same} of {len(cb)} "
                     f"components the same" + (", the same key" if best["key"] == rb["key"]
                                               else ""))
        for k in sorted(set(ca) | set(cb)):
            if ca.get(k, (None,))[0] == cb.get(k, (None,))[0]:
                continue
            va, vb = ca.get(k, (None, "(absent)"))[1], cb.get(k, (None, "(absent)"))[1]
            if k == "gm" or "\n" in va or "\n" in vb:
                diff = difflib.unified_diff(va.splitlines(), vb.splitlines(), "A", "B",
                                            lineterm="", n=1)
                lines.append(f"  {k}:\n    " + "\n    ".join(list(diff)[:60]))
            else:
                lines.append(f"  {k}:\n    A {_short(va)}\n    B {_short(vb)}")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a", type=Path, help="TORCH_TRACE directory of the first process")
    p.add_argument("b", type=Path, help="TORCH_TRACE directory of the second process")
    args = p.parse_args(argv)
    print("\n".join(compare(lookups(args.a), lookups(args.b))))


if __name__ == "__main__":
    main()
