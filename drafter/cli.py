"""The `drafter` command: parse arguments, dispatch through a plain dict, print errors plainly.

    drafter run CONFIG [key=value ...] [--force] [--until STEP]   every step in order
    drafter run --help [all]                        the config keys users set [every key]
    drafter STEP CONFIG [key=value ...] [--force]   one step (prepare ... evaluate)
    drafter status RUN_DIR [--json]                 each step's state
    drafter config CONFIG [key=value ...]           the resolved config
    drafter serve CONFIG                            the generation server on its own
    drafter learn CONFIG [--rollback [VERSION]]     serve in vLLM and keep learning from the
                                                    traffic (docs/learn.md)
    drafter plan CONFIG [--json]                    tokens, disk, memory, time, before any load
    drafter precompile CONFIG [--device D]          compile train's graphs into Inductor's cache
    drafter doctor [CONFIG] [--json]                the machine: versions, GPUs, disk, engines
    drafter check DIR [--target M] [--trust-remote-code] [--strict] [--json]
                                                    lint an EAGLE-3 checkpoint directory
    drafter report RUN_DIR                          print the evaluation report

Exit status: 0 done; 2 an error you can act on (one line naming the key, file:line or step);
1 a bug (one line; `--debug` anywhere on the command line, or DRAFTER_DEBUG=1, shows the
traceback); 128 + N when stopped by signal N.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import json
import logging
import os
import signal
import sys
from pathlib import Path

from drafter import DrafterError
from drafter.core import config as C
from drafter.core.rundir import STEPS

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


def _config_epilog(command: str, advanced: bool = False) -> str:
    """The config keys for `drafter COMMAND --help`: those users set, or (`--help all`) all."""
    rows = C.help_lines(advanced=advanced)
    width = max(len(k) for k, _, _ in rows)
    head = "every config key" if advanced else "the config keys users set"
    lines = [f"{head} (YAML sections or key=value overrides):"]
    for key, default, help in rows:
        d = f" [{default}]" if default not in ("", "[...]") else ""
        lines.append(f"  {key.ljust(width)}  {help}{d}")
    if not advanced:
        more = len(C.keys()) - len(C.keys(advanced=False))
        lines.append(f"{more} more keys (tuning, housekeeping, plan figures): "
                     f"`drafter {command} --help all`")
    return "\n".join(lines)


def _load(args):
    return C.load(args.config, args.overrides)


def cmd_step(args) -> int:
    from drafter.run import pipeline

    cfg = _load(args)
    if getattr(args, "chunk", None) is not None:  # a trainer of one chunk (chunks.conduct)
        return _train_chunk(cfg, args)
    if args.command == "run":
        steps = STEPS[: STEPS.index(args.until) + 1] if args.until else None
        pipeline.run_all(cfg, force=args.force, steps=steps)
    else:
        pipeline.run_command(cfg, args.command, force=args.force)
    return 0


def _train_chunk(cfg, args) -> int:
    """`drafter train CONFIG --chunk C --result PATH`: the child a one-process chunked run
    starts for each chunk (drafter/train/chunks.py, conduct) while its parent holds the run
    dir's lock and writes train's manifest: the step's main only, its figures to PATH."""
    from drafter.core.dist import rank_world
    from drafter.core.rundir import atomic_json
    from drafter.run.lifecycle import install_signal_handlers
    from drafter.steps import train

    install_signal_handlers()
    out = train.main(cfg, chunk=args.chunk)
    if args.result and rank_world()[0] == 0:
        atomic_json(Path(args.result), out)
    return 0


def _dur(s: float | None) -> str:
    if s is None:
        return ""
    return f"{s:.1f}s" if s < 90 else f"{s / 60:.1f}m" if s < 5400 else f"{s / 3600:.1f}h"


def _mib(n: int) -> str:
    return "" if not n else f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def cmd_status(args) -> int:
    from drafter.run import pipeline

    st = pipeline.status(args.run_dir)
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    pid = f" (drafter PID {st['running_pid']} working in it)" if st["running_pid"] else ""
    print(f"run: {st['run_dir']}{pid}")
    for s in st["steps"]:
        counts = " ".join(f"{k}={v}" for k, v in s["counts"].items())
        tps = f" {s['tokens_per_s']:,.0f} tok/s" if s.get("tokens_per_s") else ""
        state = f"{s['state']} ({s['activity']})" if s.get("activity") else s["state"]
        print(f"  {s['name']:<9} {state:<22} {_dur(s['seconds']):>8} "
              f"{_mib(s['bytes']):>12}  {counts}{tps}")
        if s.get("error"):
            print(f"            error: {s['error']}")
    print(f"  {'total':<9} {'':<22} {_dur(st['seconds']):>8} {_mib(st['bytes']):>12}")
    ch = st.get("chunks")
    if ch:
        done = f"{ch['next']} of {ch['chunks']} trained, " if "chunks" in ch else "no plan yet, "
        whole = f" ({len(ch['complete'])} whole)" if "complete" in ch else ""
        budget = f" of {_mib(ch['budget'])}" if ch.get("budget") else ""
        print(f"  chunks    {done}in the spool {ch['present'] or 'none'}{whole}; "
              f"{_mib(ch['used']) or '0'}{budget} used by the run (spool "
              f"{ch['spool']} {_mib(ch['bytes']) or '0'} + val and head "
              f"{_mib(ch['stored_bytes']) or '0'})")
    return 0


def cmd_config(args) -> int:
    print(C.dump(_load(args)), end="")
    return 0


def _dispatch(module: str, fn: str, *a) -> int:
    return getattr(importlib.import_module(module), fn)(*a) or 0


def cmd_serve(args) -> int:
    return _dispatch("drafter.serve.servers", "main", _load(args))


def cmd_learn(args) -> int:
    from drafter.run.lifecycle import install_signal_handlers

    install_signal_handlers()
    return _dispatch("drafter.learn.command", "main", _load(args), args.learner,
                     args.rollback or None, args.rollback is not None)


def cmd_plan(args) -> int:
    return _dispatch("drafter.run.plan", "main", _load(args), args.json)


def cmd_doctor(args) -> int:
    config, overrides = args.config, list(args.overrides)
    if config and "=" in config and not Path(config).exists():  # `drafter doctor key=value`
        config, overrides = None, [config, *overrides]
    return _dispatch("drafter.run.doctor", "main", C.load(config, overrides), args.json)


def cmd_precompile(args) -> int:
    from drafter.core.rundir import atomic_json
    from drafter.train.precompile import main as precompile

    out = precompile(_load(args), args.device)
    if args.result:  # extract's or the pipeline's child: its figures for a manifest
        atomic_json(Path(args.result), out)
    return 0


def cmd_check(args) -> int:
    return _dispatch("drafter.export.check", "main", args)


def cmd_report(args) -> int:
    return _dispatch("drafter.measure.report", "report", args.run_dir)


def build_parser(advanced: bool = False) -> argparse.ArgumentParser:
    """`advanced`: the config commands' help lists every key (`--help all`)."""
    p = argparse.ArgumentParser(
        prog="drafter",
        description="Train EAGLE-3 drafters for any LLM, end to end, from one config file.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="`drafter run --help` lists the config keys users set, with their defaults and "
        "docs; `drafter run --help all` every key.")
    p.add_argument("--debug", action="store_true", help="show the traceback of an internal "
                   "error (also accepted after the command)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(sp):
        sp.add_argument("config", help="YAML config file")
        sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4")

    fmt = argparse.RawDescriptionHelpFormatter
    sp = sub.add_parser("run", help="run every step in order (skipping finished ones)",
                        epilog=_config_epilog("run", advanced), formatter_class=fmt)
    with_config(sp)
    sp.add_argument("--force", action="store_true", help="redo every step")
    sp.add_argument("--until", choices=STEPS, metavar="STEP",
                    help="stop after this step (e.g. --until train)")
    sp.set_defaults(fn=cmd_step)
    for step in STEPS:
        sp = sub.add_parser(step, help=STEP_HELP[step], epilog=_config_epilog(step, advanced),
                            formatter_class=fmt)
        with_config(sp)
        sp.add_argument("--force", action="store_true", help="redo the step even if up to date")
        if step == "train":  # the trainer of one chunk that a one-process chunked run starts
            sp.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
            sp.add_argument("--result", help=argparse.SUPPRESS)
        sp.set_defaults(fn=cmd_step)

    sp = sub.add_parser("status", help="show each step's state in a run directory")
    sp.add_argument("run_dir")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(fn=cmd_status)

    sp = sub.add_parser("config", help="print the resolved config",
                        epilog=_config_epilog("config", advanced), formatter_class=fmt)
    with_config(sp)
    sp.set_defaults(fn=cmd_config)

    sp = sub.add_parser("serve", help="run the generation server on its own")
    with_config(sp)
    sp.set_defaults(fn=cmd_serve)

    sp = sub.add_parser("learn", help="serve the target with a drafter in vLLM and keep learning "
                        "from the traffic: candidates trained beside serving, swapped in only "
                        "when measurably better (docs/learn.md)",
                        epilog=_config_epilog("learn", advanced), formatter_class=fmt)
    with_config(sp)
    sp.add_argument("--rollback", nargs="?", const="", metavar="VERSION",
                    help="serve the drafter served before the current one (or VERSION, e.g. "
                    "v0002): swapped into the running drafter learn, else at its next start")
    sp.add_argument("--learner", action="store_true", help=argparse.SUPPRESS)  # the child
    sp.set_defaults(fn=cmd_learn)

    sp = sub.add_parser("plan", help="estimate tokens, disk, memory and time before any load",
                        epilog=_config_epilog("plan", advanced), formatter_class=fmt)
    with_config(sp)
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(fn=cmd_plan)

    sp = sub.add_parser("precompile", help="compile train's graphs into Inductor's cache on "
                        "random batches (GPU; extract does it by itself beside the target, and "
                        "`drafter run` ahead of an online train)",
                        epilog=_config_epilog("precompile", advanced), formatter_class=fmt)
    with_config(sp)
    sp.add_argument("--device", help="default: the configured one (cuda:0 for a GPU)")
    sp.add_argument("--result", help=argparse.SUPPRESS)  # extract's child writes its figures
    sp.set_defaults(fn=cmd_precompile)

    sp = sub.add_parser("doctor", help="check the machine: versions, GPUs, disk, engines")
    sp.add_argument("config", nargs="?", help="optional config (for the run and cache dirs)")
    sp.add_argument("overrides", nargs="*")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(fn=cmd_doctor)

    sp = sub.add_parser("check", help="lint an EAGLE-3 checkpoint dir for acceptance killers")
    sp.add_argument("dir", help="native or speculators EAGLE-3 directory")
    sp.add_argument("--target", help="target model (id, folder, gguf, builtin:) or config.json; "
                    "a model also runs the acceptance smoke test")
    sp.add_argument("--no-smoke", action="store_true", help="skip the acceptance smoke test "
                    "(it loads the target's weights)")
    sp.add_argument("--trust-remote-code", action="store_true", help="let a target that ships "
                    "its own model code (config.json auto_map) run it, as "
                    "target.trust_remote_code does for the steps; off by default")
    sp.add_argument("--strict", action="store_true", help="exit 1 on warnings too, not only "
                    "on failures (a CI gate; skipped checks never count)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(fn=cmd_check)

    sp = sub.add_parser("report", help="print a run's evaluation report")
    sp.add_argument("run_dir")
    sp.set_defaults(fn=cmd_report)
    return p


_FULL = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded",
         errno.EFBIG: "File too large (a file-size limit: `ulimit -f`)"}


def _disk_full(e: BaseException | None) -> str | None:
    """'No space left on device' (+ the file) when `e` or an exception in its chain is a full
    disk, a quota or RLIMIT_FSIZE: an OSError, or a library's wrapper of one that keeps only the
    text (safetensors' SafetensorError says '... (os error 28)')."""
    import re

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL:
            return _FULL[e.errno] + (f" writing {e.filename}" if e.filename else "")
        m = re.search(r"\(os error (\d+)\)", str(e))
        if m and int(m.group(1)) in _FULL:
            return _FULL[int(m.group(1))]
        e = e.__cause__ or e.__context__
    return None


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname).1s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    for noisy in ("httpx", "httpcore", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


# OSErrors a user causes with a path (a read-only or foreign run dir, a file where a folder
# belongs): one line naming the file, never a traceback.
_PATH_ERRORS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR,
                errno.ENAMETOOLONG, errno.ELOOP, errno.EEXIST}


def _path_error(e: BaseException | None) -> str | None:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _PATH_ERRORS:
            where = f" {e.filename}" if e.filename else ""
            return (f"cannot use{where}: {e.strerror}. Check the path and its permissions (the "
                    f"run directory must be a folder you can write)")
        e = e.__cause__ or e.__context__
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("DRAFTER_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    # `drafter run --help all`: every config key, where `--help` lists those users set
    at = next((i for i, a in enumerate(argv[:-1]) if a in ("-h", "--help") and
               argv[i + 1] == "all"), None)
    if at is not None:
        del argv[at + 1]
    parser = build_parser(advanced=at is not None)
    args, extra = parser.parse_known_args(argv)
    # overrides after an option (`drafter run CFG --until train a.b=1`): argparse stops the
    # positional list at the option, so the rest comes back here
    if extra:
        if not hasattr(args, "overrides") or any("=" not in x or x.startswith("-") for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    setup_logging()
    try:
        return args.fn(args)
    except (DrafterError, NotImplementedError, FileNotFoundError) as e:
        print(f"drafter: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from drafter.run.lifecycle import signalled

        sig = signalled()
        if sig is not None:  # a signal raised inside C code that came out as another error
            print(f"drafter: interrupted by {signal.Signals(sig).name}; rerun the same command "
                  f"to resume", file=sys.stderr)
            return 128 + sig
        full = _disk_full(e)
        if full is not None:
            # a full disk (or RLIMIT_FSIZE): every write is atomic, so only complete files remain
            print(f"drafter: error: {full}. The run directory holds only complete files: free "
                  f"space (or move run_dir), then rerun the same command to resume; `drafter "
                  f"plan CONFIG` estimates the space a run needs.", file=sys.stderr)
            return 2
        path = _path_error(e)
        if path is not None:
            print(f"drafter: error: {path}", file=sys.stderr)
            return 2
        if debug:
            raise
        # anything else is a bug: one line here, the traceback behind --debug
        print(f"drafter: internal error: {type(e).__name__}: {e}\n(a bug in drafter: rerun "
              f"with --debug for the traceback, and please report it)", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        # the step's folder is consistent (temp files go, completed parts stay): a rerun resumes
        print(f"drafter: {e or 'interrupted'}; rerun the same command to resume", file=sys.stderr)
        return 128 + getattr(e, "signum", 2)


if __name__ == "__main__":
    sys.exit(main())
