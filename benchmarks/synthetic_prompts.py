"""Synthetic prompts at scale: how many distinct user prompts the target writes per minute, and how
diverse they are against the shared prompt pools.

Headline figure (BENCHMARKS.md, Data engine): seconds to 100,000 distinct prompts written by
SmolLM2-135M-Instruct on one H200; the file it writes is the synthetic source of
configs/scale-smollm2.yaml (benchmarks/reproduce_h200.sh makes it first):

    python benchmarks/synthetic_prompts.py --count 100000 --batch 2048 --max-tokens 128 \
        --out runs/synthetic-100k.jsonl.gz --compare ../shared/data/train

It prints one line per sampling pass, then the totals (seconds, kept prompts/s, samples,
rejections by reason, tokens written) and a diversity table. Other uses:

    python benchmarks/synthetic_prompts.py --count 100000 --batch 1024 \
        --out runs/synthetic-100k.jsonl.gz --json syn.json --compare ../shared/data/train   # H200
    python benchmarks/synthetic_prompts.py --count 40 --batch 8 --max-tokens 48      # CPU smoke

The same pieces as the generate step's synthetic source (drafter.data.synthetic: PreQuery,
PromptFilter; drafter.generation.local.LocalGenerator): the chat template up to the start of a user
turn, sampled at --temperature, each sample filtered (empty, truncated, length, non-text, markup, exact
and near duplicates), in passes until --count are kept. Reported: seconds, kept prompts per
second, samples, rejections by reason, tokens written; then diversity (distinct 1-3-gram ratios,
exact and near-duplicate rates, word lengths) of the kept prompts, and, with --compare, of the
first user turns of the pools and of an equal-size sample of the synthetic ones (n-gram ratios
fall as a set grows: compare equal sizes). --out writes the prompts as gzipped JSONL in the
prompt-only format (a prepare source as is).
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter.core.config import TargetConfig  # noqa: E402
from drafter.data.synthetic import PreQuery, PromptFilter, diversity  # noqa: E402
from drafter.generation.local import LocalGenerator  # noqa: E402

DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".gz")


def pool_prompts(data: Path) -> list[str]:
    from drafter.data.sources import load_prompts

    files = sorted(p for p in data.iterdir() if p.name.endswith(DATA_SUFFIXES)) \
        if data.is_dir() else [data]
    out = []
    for f in files:
        for r in load_prompts(str(f), None):
            out += [m["content"] for m in r["messages"] if m["role"] == "user"][:1]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--min-chars", type=int, default=16)
    ap.add_argument("--max-chars", type=int, default=2000)
    ap.add_argument("--near-dup", type=float, default=0.8)
    ap.add_argument("--topics", type=Path, help="one topic per line: 'The user asks about X.'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", type=Path, help="prompt pools (file or folder) to compare with")
    ap.add_argument("--out", type=Path, help="write the prompts here (.jsonl.gz)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)

    gen = LocalGenerator(TargetConfig(model=a.target), batch_size=a.batch)
    tok = gen.tokenizer
    pq = PreQuery(tok)
    filt = PromptFilter(a.min_chars, a.max_chars, a.near_dup)
    topics = [t.strip() for t in a.topics.read_text().splitlines() if t.strip()] \
        if a.topics else []
    rng = random.Random(a.seed)
    stop = sorted(set(gen.stop_ids) | set(pq.stop_ids))
    plain = pq.ids([])
    kept: list[str] = []
    written = samples = passes = 0
    t0 = time.perf_counter()
    while len(kept) < a.count and passes < 30:
        need = a.count - len(kept)
        n = int(need * 1.2) + 32
        prompts = []
        for _ in range(n):
            if topics:
                prompts.append(pq.ids([{"role": "system", "content":
                                        f"The user asks about {rng.choice(topics)}."}]))
            else:
                prompts.append(plain)
        outs = gen.generate(prompts, a.max_tokens, temperature=a.temperature,
                            seed=a.seed + passes, stop_ids=stop)
        passes += 1
        for ids, finish in outs:
            samples += 1
            written += len(ids)
            text = tok.decode(ids, skip_special_tokens=True).strip()
            if filt.check(text, finish) is None and len(kept) < a.count:
                kept.append(text)
        el = time.perf_counter() - t0
        print(f"pass {passes}: {len(kept)} kept of {samples} samples, {el:.0f}s, "
              f"{written / el:,.0f} tokens/s", flush=True)
    seconds = time.perf_counter() - t0
    rej = Counter({k: v for k, v in filt.counts.items() if k != "kept"})
    res = {"target": a.target, "count": a.count, "kept": len(kept), "samples": samples,
           "passes": passes, "seconds": round(seconds, 1),
           "kept_per_s": round(len(kept) / seconds, 1), "tokens_written": written,
           "tokens_per_s": round(written / seconds, 1), "rejected_by_reason": dict(rej),
           "settings": {"temperature": a.temperature, "max_tokens": a.max_tokens,
                        "near_dup": a.near_dup, "topics": len(topics), "batch": a.batch},
           "diversity": {"synthetic_all": diversity(kept, a.near_dup)}}
    if a.compare:
        pool = pool_prompts(a.compare)
        n = min(len(pool), len(kept))
        res["diversity"]["pools"] = diversity(random.Random(1).sample(pool, n), a.near_dup)
        res["diversity"]["synthetic_same_size"] = diversity(random.Random(1).sample(kept, n),
                                                            a.near_dup)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(a.out, "wt") as f:
            for i, t in enumerate(kept):
                f.write(json.dumps({"id": f"synthetic-{i}", "prompt": t}) + "\n")
    print(json.dumps(res, indent=1))
    print("\n| set | prompts | distinct 1/2/3-gram | exact dup | near dup | words p10/p50/p90 |")
    print("|---|---:|---|---:|---:|---|")
    for name, d in res["diversity"].items():
        print(f"| {name} | {d['prompts']:,} | {d['distinct_1gram']:.3f} / {d['distinct_2gram']:.3f}"
              f" / {d['distinct_3gram']:.3f} | {d['exact_duplicate_rate']:.4f} | "
              f"{d['near_duplicate_rate']:.4f} | {d['words_p10']} / {d['words_p50']} / "
              f"{d['words_p90']} |")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
