"""Static batches vs continuous batching for plain generation (generate.server.engine: local).

    python benchmarks/continuous_batching.py                       # SmolLM2, quickstart prompts
    python benchmarks/continuous_batching.py --prompts 1024 --batch 256 --max-new 512 \
        --data ../shared/data/train/alpaca_seed_tasks.jsonl        # on a GPU

Real prompts, the target's chat template, greedy, stop tokens on: answers end at different
lengths, which is where a static batch idles (every row waits for the batch's longest answer).
Both modes decode the same prompts with the same Decoder (prompts sorted longest first, batches
of --batch rows); continuous batching prefills the next prompt into a row as soon as its answer
ends (`Decoder.generate_continuous`). Reports, for each mode: target forwards (decode steps),
row utilisation (new tokens / (steps x rows)), tokens/s of the decode loop and end to end, and
whether the greedy answers are identical.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter.config import TargetConfig  # noqa: E402
from drafter.decode import Decoder, stop_ids_of  # noqa: E402
from drafter.sources import load_prompts  # noqa: E402
from drafter.target import load_model, load_tokenizer  # noqa: E402

QUICKSTART = Path(__file__).resolve().parents[1] / "drafter" / "data" / "quickstart_prompts.jsonl"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--data", type=Path, default=QUICKSTART,
                    help="prompts in any format drafter reads (first user turns are used)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)

    tcfg = TargetConfig(model=a.target)
    model, tok = load_model(tcfg), load_tokenizer(tcfg)
    convs = [r["messages"][: next(i for i, m in enumerate(r["messages"]) if m["role"] == "user")
                           + 1] for r in load_prompts(str(a.data), a.prompts)]
    prompts = [tok(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for c in convs]
    stop = stop_ids_of(tok, model)
    dec = Decoder(model, max_batch=a.batch)
    dec.generate(prompts[: a.batch], 4, stop_ids=stop)                  # warm-up, both modes
    dec.generate_continuous(prompts[: a.batch], 4, stop_ids=stop)

    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    res = {}
    for mode in ("static", "continuous"):
        t0 = time.perf_counter()
        if mode == "static":
            outs = dec.generate([prompts[i] for i in order], a.max_new, stop_ids=stop)
            outs = [o for _, o in sorted(zip(order, outs))]
        else:
            outs = dec.generate_continuous(prompts, a.max_new, stop_ids=stop)
        if dec.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        n = sum(len(o.tokens) for o in outs)
        last = dec.last
        loop = last["seconds"] - last["prefill_seconds"]
        res[mode] = {"outs": [o.tokens for o in outs], "new_tokens": n,
                     "steps": last["iterations"],
                     "row_utilisation": round(n / (last["iterations"] * a.batch), 3),
                     "loop_tokens_per_s": round(n / loop, 1), "tokens_per_s": round(n / wall, 1),
                     "seconds": round(wall, 2)}
    same = sum(x == y for x, y in zip(res["static"]["outs"], res["continuous"]["outs"]))
    lengths = sorted(len(o) for o in res["static"]["outs"])
    dev = torch.cuda.get_device_name() if dec.device.type == "cuda" else "cpu"
    print(f"\n{a.target} on {dev} ({dec.target.dtype}), {len(prompts)} prompts of {a.data.name}, "
          f"batch {a.batch}, max {a.max_new} new tokens; answer lengths min {lengths[0]}, "
          f"median {lengths[len(lengths) // 2]}, max {lengths[-1]}")
    print("| mode | target forwards | row utilisation | tokens/s (decode loop) | "
          "tokens/s (end to end) | seconds |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode in ("static", "continuous"):
        r = res[mode]
        print(f"| {mode} | {r['steps']} | {r['row_utilisation']} | {r['loop_tokens_per_s']} | "
              f"{r['tokens_per_s']} | {r['seconds']} |")
    print(f"identical greedy answers: {same} of {len(prompts)}")
    if a.json:
        for r in res.values():
            r.pop("outs")
        Path(a.json).write_text(json.dumps({"target": a.target, "device": dev, "batch": a.batch,
                                            "max_new": a.max_new, "prompts": len(prompts),
                                            "identical": same, **res}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
