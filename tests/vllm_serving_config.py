"""Run as a script by tests/test_vllm.py: every `--speculative-config` of an export README parsed
by vLLM itself, as `vllm serve` parses it (EngineArgs' command line, then the engine config that
builds SpeculativeConfig and validates it), and its batch-size schedule expanded by vLLM's own
scheduler function; prints one JSON line.

    python tests/vllm_serving_config.py README.md [README.md ...]

A script, not a test: building vLLM's config registers the platform in the process."""
from __future__ import annotations

import json
import re
import shlex
import sys


def main(paths: list[str]) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    out = []
    for path in paths:
        text = open(path).read()
        for line in text.splitlines():
            if not line.strip().startswith("vllm serve ") or "--speculative-config" not in line:
                continue
            argv = shlex.split(line.strip())[2:]        # after `vllm serve`: the target, flags
            target, flags = argv[0], argv[1:]
            args = parser.parse_args(["--model", target, *flags, "--dtype", "float32",
                                      "--max-model-len", "2048"])
            engine = EngineArgs.from_cli_args(args)
            sc = engine.create_engine_config().speculative_config
            sch = sc.num_speculative_tokens_per_batch_size
            lookup = build_dynamic_sd_schedule_lookup(sch, 256, sc.num_speculative_tokens) \
                if sch else None
            out.append({"readme": path, "heading": _heading(text, line),
                        "given": json.loads(re.search(r"--speculative-config '(\{.*?\})'",
                                                      line).group(1)),
                        "method": sc.method, "num_speculative_tokens": sc.num_speculative_tokens,
                        "draft_sample_method": sc.draft_sample_method,
                        "rejection_sample_method": sc.rejection_sample_method,
                        "schedule": [list(x) for x in sch] if sch else None,
                        "k_by_batch": lookup})
    print(json.dumps(out))


def _heading(text: str, line: str) -> str:
    """The nearest `#` heading above `line`."""
    head = ""
    for x in text.splitlines():
        if x == line:
            return head
        if x.startswith("#"):
            head = x.lstrip("# ")
    return head


if __name__ == "__main__":
    main(sys.argv[1:])
