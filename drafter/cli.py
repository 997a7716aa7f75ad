"""The `drafter` command: parse arguments, dispatch through a plain dict, print errors plainly.

    drafter run CONFIG [key=value ...] [--force]    every step in order
    drafter STEP CONFIG [key=value ...] [--force]   one step (prepare ... evaluate)
    drafter status RUN_DIR [--json]                 each step's state
    drafter config CONFIG [key=value ...]           the resolved config
    drafter serve CONFIG                            the generation server on its own
    drafter plan CONFIG [--json]                    tokens, disk, memory, time, before any load
    drafter doctor [CONFIG] [--json]                the machine: versions, GPUs, disk, engines
    drafter check DIR [--target M] [--json]         lint an EAGLE-3 checkpoint directory
    drafter report RUN_DIR                          print the evaluation report
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from pathlib import Path

from . import DrafterError
from . import config as C
from .rundir import STEPS

STEP_HELP = {
    "prepare": "read the sources into canonical conversations",
    "generate": "re-answer every user turn with the target through a server",
    "tokenize": "render the chat template: input_ids + loss_mask",
    "vocab": "draft vocab from loss-masked token counts: d2t, t2d",
    "extract": "target hidden states and teacher signal, sharded on disk",
    "train": "train the EAGLE-3 drafter with training-time test",
    "export": "write native and speculators checkpoint dirs for the engines",
    "evaluate": "speculative decoding against the target: tau, lossless check, speedup",
}


def _config_epilog() -> str:
    rows = C.help_lines()
    width = max(len(k) for k, _, _ in rows)
    lines = ["config keys (YAML sections or key=value overrides):"]
    for key, default, help in rows:
        d = f" [{default}]" if default not in ("", "[...]") else ""
        lines.append(f"  {key.ljust(width)}  {help}{d}")
    return "\n".join(lines)


def _load(args):
    return C.load(args.config, args.overrides)


def cmd_step(args) -> int:
    from . import pipeline

    cfg = _load(args)
    if args.command == "run":
        pipeline.run_all(cfg, force=args.force)
    else:
        pipeline.run_step(cfg, args.command, force=args.force)
    return 0


def cmd_status(args) -> int:
    from . import pipeline

    st = pipeline.status(args.run_dir)
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    print(f"run: {st['run_dir']}")
    for s in st["steps"]:
        secs = f"{s['seconds']:.1f}s" if s["seconds"] is not None else ""
        counts = " ".join(f"{k}={v}" for k, v in s["counts"].items())
        mb = f"{s['bytes'] / 2**20:.1f} MiB" if s["bytes"] else ""
        print(f"  {s['name']:<9} {s['state']:<8} {secs:>9} {mb:>12}  {counts}")
        if s.get("error"):
            print(f"            error: {s['error']}")
    return 0


def cmd_config(args) -> int:
    print(C.dump(_load(args)), end="")
    return 0


def _dispatch(module: str, fn: str, *a) -> int:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            raise NotImplementedError(f"{module}: not implemented yet") from None
        raise
    return getattr(mod, fn)(*a) or 0


def cmd_serve(args) -> int:
    return _dispatch("drafter.serve", "main", _load(args))


def cmd_plan(args) -> int:
    return _dispatch("drafter.plan", "main", _load(args), args.json)


def cmd_doctor(args) -> int:
    config, overrides = args.config, list(args.overrides)
    if config and "=" in config and not Path(config).exists():  # `drafter doctor key=value`
        config, overrides = None, [config, *overrides]
    return _dispatch("drafter.doctor", "main", C.load(config, overrides), args.json)


def cmd_check(args) -> int:
    return _dispatch("drafter.check", "main", args)


def cmd_report(args) -> int:
    return _dispatch("drafter.steps.evaluate", "report", args.run_dir)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="drafter",
        description="Train EAGLE-3 drafters for any LLM, end to end, from one config file.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="`drafter run --help` lists every config key with its default and doc.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(sp):
        sp.add_argument("config", help="YAML config file")
        sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4")

    fmt = argparse.RawDescriptionHelpFormatter
    sp = sub.add_parser("run", help="run every step in order (skipping finished ones)",
                        epilog=_config_epilog(), formatter_class=fmt)
    with_config(sp)
    sp.add_argument("--force", action="store_true", help="redo every step")
    sp.set_defaults(fn=cmd_step)
    for step in STEPS:
        sp = sub.add_parser(step, help=STEP_HELP[step], epilog=_config_epilog(),
                            formatter_class=fmt)
        with_config(sp)
        sp.add_argument("--force", action="store_true", help="redo the step even if up to date")
        sp.set_defaults(fn=cmd_step)

    sp = sub.add_parser("status", help="show each step's state in a run directory")
    sp.add_argument("run_dir")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(fn=cmd_status)

    sp = sub.add_parser("config", help="print the resolved config", epilog=_config_epilog(),
                        formatter_class=fmt)
    with_config(sp)
    sp.set_defaults(fn=cmd_config)

    sp = sub.add_parser("serve", help="run the generation server on its own")
    with_config(sp)
    sp.set_defaults(fn=cmd_serve)

    sp = sub.add_parser("plan", help="estimate tokens, disk, memory and time before any load",
                        epilog=_config_epilog(), formatter_class=fmt)
    with_config(sp)
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(fn=cmd_plan)

    sp = sub.add_parser("doctor", help="check the machine: versions, GPUs, disk, engines")
    sp.add_argument("config", nargs="?", help="optional config (for the run and cache dirs)")
    sp.add_argument("overrides", nargs="*")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(fn=cmd_doctor)

    sp = sub.add_parser("check", help="lint an EAGLE-3 checkpoint dir for acceptance killers")
    sp.add_argument("dir", help="native or speculators EAGLE-3 directory")
    sp.add_argument("--target", help="target model (id, folder, gguf, builtin:) or config.json")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(fn=cmd_check)

    sp = sub.add_parser("report", help="print a run's evaluation report")
    sp.add_argument("run_dir")
    sp.set_defaults(fn=cmd_report)
    return p


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname).1s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    for noisy in ("httpx", "httpcore", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        return args.fn(args)
    except (DrafterError, NotImplementedError, FileNotFoundError) as e:
        print(f"drafter: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("drafter: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
