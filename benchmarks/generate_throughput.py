"""Throughput of the data engine (drafter.generation.generator: generate.server.engine:
drafter) per batch size, and of the generate step beside it (--step).

Headline figure (BENCHMARKS.md, Data engine): completion tokens/s end to end over 10,000 real
prompts, greedy, at most 512 new tokens, SmolLM2-135M-Instruct on one H200:

    python benchmarks/generate_throughput.py --data ../shared/data/train --prompts 10000 \
        --batches 1024,2048,512,256 --max-new 512 --profile

The generate step against one Generator call on the same prompts and batch (the step's own code
path: templates, tokenize, the request stream, bookkeeping, output; their ratio printed, and the
step's seconds by phase in its JSON line):

    python benchmarks/generate_throughput.py --data ../shared/data/train --prompts 10000 \
        --batches 2048 --max-new 512 --step

With --writes N the first batch size also writes N synthetic user turns first, as the generate
step does for a synthetic source (the target's pre-query prefix, the source's default sampling:
T=1, at most 256 tokens, its end-of-turn stop), in one Generator call before the answers: the same
work as a step that wrote N user turns and answered the --data prompts, in two closed calls.
Its rows: the writes, and "writes + answers" (the answers' tokens over both calls' seconds):

    python benchmarks/generate_throughput.py --data runs/user-path/generate/conversations.jsonl \
        --prompts 40000 --batches 2048 --max-new 512 --writes 11869

With --attention N it times the decode attention kernel alone at the first batch size, N rows of
3,000-6,000 tokens among them, its longest rows split and not (drafter.generation.paged.SPLIT_ROWS):

    python benchmarks/generate_throughput.py --batches 2048 --attention 6

It prints a JSON line per batch size as it goes, then a markdown table (one row per batch size, the
columns below) and, with --profile, the top CUDA kernels of 16 decode steps. Other uses:

    python benchmarks/generate_throughput.py --data ../shared/data/train --prompts 10000 \
        --batches 256,512,1024,2048 --max-new 512 --json gen.json          # one H200
    python benchmarks/generate_throughput.py --prompts 16 --batches 4,8 --max-new 24   # CPU smoke
    python benchmarks/generate_throughput.py --profile --batches 1024      # + a kernel table

Real prompts (the first user turn of each record of --data: a file or a folder of files in any
format drafter reads), the target's chat template, greedy, its stop tokens: answers end at their
natural lengths or at --max-new, as in the generate step. For each batch size one Generator decodes
every prompt; reported: completion tokens/s end to end (prefill, refills, the tail and the one
graph capture included, as the generate step counts them), the same without capture, seconds of
prefill, decode steps, row utilisation (tokens / (steps x batch)), peak GPU memory and the KV
pool, and how many answers equal the first batch size's (bf16 greedy: near-ties may flip with
the batch shape). --static adds drafter.decoding.decode's static batches at the first batch size
(the decoder the engine replaced). --profile prints the top CUDA kernels of 16 decode steps.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter.core.config import TargetConfig  # noqa: E402
from drafter.core.target import load_model, load_tokenizer  # noqa: E402
from drafter.data.sources import load_prompts  # noqa: E402
from drafter.decoding.decode import Decoder, stop_ids_of  # noqa: E402
from drafter.generation.generator import Generator  # noqa: E402

QUICKSTART = Path(__file__).resolve().parents[1] / "drafter" / "data" / "quickstart_prompts.jsonl"
DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".gz")


def read_conversations(data: Path, n: int) -> list[list[dict]]:
    """The messages up to the first user turn of up to n records of data (a file, or every data
    file of a folder, taken in turn)."""
    files = sorted(p for p in data.iterdir() if p.name.endswith(DATA_SUFFIXES)) \
        if data.is_dir() else [data]
    per = [load_prompts(str(f), None) for f in files]
    recs, i = [], 0
    while len(recs) < n and any(i < len(p) for p in per):
        recs += [p[i] for p in per if i < len(p)]
        i += 1
    out = []
    for r in recs[:n]:
        msgs = r["messages"]
        first = next(j for j, m in enumerate(msgs) if m["role"] == "user")
        out.append([{"role": m["role"], "content": m["content"]} for m in msgs[:first + 1]])
    return out


def read_prompts(data: Path, n: int, tok) -> list[list[int]]:
    """read_conversations rendered with the chat template."""
    out = []
    for msgs in read_conversations(data, n):
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def run_step(a, batch: int, device: str) -> dict:
    """The generate step (drafter.steps.generate.main, engine: drafter) on a fresh run dir whose
    prepare output holds the same conversations the Generator call decodes: its own code path
    (templates, tokenize, the stream, bookkeeping, the output written). Its tokens/s count from
    its first request, as the manifest's do (the target's load is phases_s.load)."""
    import tempfile

    from drafter.core import config as C
    from drafter.core.rundir import Run, atomic_json
    from drafter.steps import generate

    with tempfile.TemporaryDirectory(prefix="drafter-bench-") as d:
        run = Run(Path(d))
        path = run.conversations("prepare")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for i, msgs in enumerate(read_conversations(a.data, a.prompts)):
                f.write(json.dumps({"id": f"bench:{i:06d}", "source": "bench", "split": "train",
                                    "messages": msgs}) + "\n")
        atomic_json(run.manifest("prepare"), {"step": "prepare"})
        cfg = C.load(None, [f"run_dir={d}", f"target.model={a.target}", f"target.dtype={a.dtype}",
                            f"target.device={device}", "generate.server.engine=drafter",
                            f"generate.batch_size={batch}", f"generate.max_tokens={a.max_new}"])
        m = generate.main(cfg)                           # the manifest's contents
    t = m["throughput"]
    return {"batch": f"{batch} (generate step)", "tokens": t["completion_tokens"],
            "seconds": t["seconds"], "tokens_per_s": t["completion_tokens_per_s"],
            "steps": "", "phases_s": m.get("phases_s")}


def write_user_turns(model, tok, stop, batch: int, n: int) -> dict:
    """n user turns written from the target's pre-query prefix at a synthetic source's default
    settings (drafter.data.synthetic), in one Generator call: the generate step's writes."""
    from drafter.core.config import SyntheticConfig
    from drafter.data.synthetic import PreQuery

    sc, pq = SyntheticConfig(), PreQuery(tok)
    eng = Generator(model, max_batch=batch)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    res = eng.generate([pq.ids([])] * n, sc.max_tokens, stop_ids=sorted(set(stop)
                                                                          | set(pq.stop_ids)),
                       temperature=sc.temperature)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = sum(len(r.tokens) for r in res)
    return {"batch": f"{batch} (writes)", "tokens": tokens, "seconds": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 1), "steps": eng.last["steps"],
            **seconds_of(eng.last)}


def seconds_of(last: dict) -> dict:
    """An Generator call's seconds by part (Generator.last), the GPU timeline's spans among them."""
    return {k: round(last.get(k, 0.0), 2) for k in (
        "prefill_seconds", "decode_seconds", "prefill_gpu_seconds", "decode_gpu_seconds",
        "capture_seconds")}


def profile_steps(eng: Generator, prompts, max_new, stop) -> str:
    """Top CUDA kernels over the decode steps of a short run (graphs replayed)."""
    from torch.profiler import ProfilerActivity, profile

    eng.generate(prompts, 16, stop_ids=stop)                 # capture outside the profile
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        eng.generate(prompts, 16, stop_ids=stop)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)


def attention_kernel(batch: int, long_rows: int, reps: int = 50) -> list[dict]:
    """The decode attention kernel alone (drafter.generation.paged) at SmolLM2's heads (9 query, 3
    key/value, 64 dims), pages of 64, the open stream's table width (128 pages): rows of a
    pool-like prompt plus 0-512 answer tokens, and `long_rows` of them 3,000-6,000 tokens (what
    a long prompt brings into a step), with its long rows split (drafter.generation.paged's setting
    first, then others) and without. Times 30 calls (a step's layers) in a CUDA graph, and checks
    each against the gather reference on the first 64 rows."""
    from drafter.generation import paged

    torch.manual_seed(0)
    dev = "cuda"
    P, W, nh, nkv, hd = 64, 128, 9, 3, 64
    g = torch.Generator().manual_seed(0)
    lens = (torch.distributions.LogNormal(4.3, 0.6).sample((batch,)).clamp(1, 2000)
            + torch.randint(0, 513, (batch,), generator=g)).int()
    rows = []
    for n_long in (0, long_rows):
        ln = lens.clone()
        ln[torch.randperm(batch, generator=g)[:n_long]] = torch.randint(3000, 6001, (n_long,),
                                                                        generator=g).int()
        need = (ln + P - 1) // P
        pages = int(need.sum()) + 1
        perm = torch.randperm(pages - 1, generator=g) + 1
        table = torch.zeros(batch, W, dtype=torch.int32)
        at = 0
        for b, k in enumerate(need.tolist()):
            table[b, :k] = perm[at:at + k]
            at += k
        kp = torch.randn(pages * P, nkv, hd, device=dev, dtype=torch.bfloat16)
        vp = torch.randn(pages * P, nkv, hd, device=dev, dtype=torch.bfloat16)
        q = torch.randn(batch, nh, hd, device=dev, dtype=torch.bfloat16)
        table, ln = table.to(dev), ln.to(dev)
        ref = paged.paged_attention_reference(q[:64].float(), kp.float(), vp.float(),
                                              table[:64], ln[:64], 0.125, P)
        for name, split in [("one program a row", None)] + [
                (f"long rows split ({r} rows, parts of {t} tokens)", (r, t)) for r, t in
                ((paged.SPLIT_ROWS, paged.SPLIT_TOKENS), (64, 512), (16, 512), (32, 1024))]:
            def layers():
                sp = paged.long_rows(ln, *split) if split else None
                for _ in range(30):
                    out = paged.paged_attention_triton(q, kp, vp, table, ln, 0.125, P, sp,
                                                       split[1] if split else 512)
                return out
            out = layers()
            err = (out[:64].float() - ref).abs().max().item()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                layers()
            graph.replay()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(reps):
                graph.replay()
            e1.record()
            torch.cuda.synchronize()
            rows.append({"attention": name, "rows": batch, "long_rows": n_long,
                         "max_tokens": int(ln.max()),
                         "mean_tokens": round(float(ln.float().mean()), 1),
                         "ms_per_30_layers": round(e0.elapsed_time(e1) / reps, 3),
                         "max_abs_err_vs_reference": round(err, 4)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--data", type=Path, default=QUICKSTART)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batches", default="256,512,1024,2048")
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--static", action="store_true", help="also the static decoder (batch 1)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--all-gpus", action="store_true",
                    help="also every visible GPU at the first batch size (LocalGenerator: one "
                         "engine per GPU draining one queue)")
    ap.add_argument("--step", action="store_true",
                    help="also the generate step (engine: drafter) on the same prompts at the "
                         "first batch size, and its tokens/s over the Generator call's")
    ap.add_argument("--writes", type=int, default=0,
                    help="also write this many synthetic user turns first (one Generator call at "
                         "the first batch size), and a row of writes + answers")
    ap.add_argument("--attention", type=int, metavar="LONG_ROWS",
                    help="only the decode attention kernel at the first batch size, with this "
                         "many rows of 3,000-6,000 tokens, its long rows split and not")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    if a.attention is not None:
        rows = attention_kernel(int(a.batches.split(",")[0]), a.attention)
        if a.json:
            Path(a.json).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                "rows": rows}, indent=2))
        return 0

    tcfg = TargetConfig(model=a.target, dtype=a.dtype)
    model, tok = load_model(tcfg), load_tokenizer(tcfg)
    stop = stop_ids_of(tok, model)
    t0 = time.perf_counter()
    prompts = read_prompts(a.data, a.prompts, tok)
    print(f"{len(prompts)} prompts of {a.data} rendered in {time.perf_counter() - t0:.1f}s, "
          f"prompt tokens mean {sum(map(len, prompts)) / len(prompts):.0f}, "
          f"max {max(map(len, prompts))}", flush=True)
    dev = next(model.parameters()).device
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    batches = [int(b) for b in a.batches.split(",")]
    rows, first = [], None
    if a.writes:
        rows.append(write_user_turns(model, tok, stop, batches[0], a.writes))
        print(json.dumps(rows[-1]), flush=True)
    for b in batches:
        eng = Generator(model, max_batch=b)
        t0 = time.perf_counter()
        res = eng.generate(prompts, a.max_new, stop_ids=stop)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        last = dict(eng.last)
        n = sum(len(r.tokens) for r in res)
        outs = [r.tokens for r in res]
        first = first or outs
        row = {"batch": b, "tokens": n, "seconds": round(wall, 2),
               "tokens_per_s": round(n / wall, 1),
               "tokens_per_s_without_capture": round(n / last["seconds"], 1),
               **seconds_of(last), "steps": last["steps"],
               "row_utilisation": round(n / max(1, last["steps"] * b), 3),
               "peak_gib": round(last.get("peak_bytes", 0) / 2**30, 2),
               "kv_pool_gib": round(last["pages"] * last["page_bytes"] / 2**30, 2),
               "length_capped": sum(r.finish == "length" for r in res),
               "too_long": last["too_long"], "triton": last["triton"],
               "same_as_first": sum(x == y for x, y in zip(outs, first)),
               **{k: last.get(k) for k in ("admissions", "prefill_groups", "prefill_tokens",
                                           "prefill_padded_tokens", "sampling_steps")}}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if a.profile and dev.type == "cuda" and b == batches[0]:
            print(profile_steps(eng, prompts[:b], 16, stop), flush=True)
        del eng
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if a.writes:
        w, ans = rows[0], rows[1]
        secs = w["seconds"] + ans["seconds"]
        rows.append({"batch": f"{batches[0]} (writes + answers)", "tokens": ans["tokens"],
                     "seconds": round(secs, 2), "tokens_per_s": round(ans["tokens"] / secs, 1),
                     "steps": w["steps"] + ans["steps"]})
        print(json.dumps(rows[-1]), flush=True)
    if a.all_gpus and torch.cuda.device_count() > 1:
        from drafter.generation.local import LocalGenerator

        gen = LocalGenerator(TargetConfig(model=a.target, dtype=a.dtype, device="auto"),
                             batch_size=batches[0])
        gen.generate(prompts[:64], 8)                         # load and capture, untimed
        t0 = time.perf_counter()
        res = gen.generate(prompts, a.max_new)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        n = sum(len(t) for t, _ in res)
        rows.append({"batch": f"{batches[0]} x {gen.replicas} GPUs", "tokens": n,
                     "seconds": round(wall, 2), "tokens_per_s": round(n / wall, 1),
                     "steps": sum(e.last.get("steps", 0) for e in gen.workers)})
        print(json.dumps(rows[-1]), flush=True)
        del gen
    if a.static:
        dec = Decoder(model, max_batch=batches[0])
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        t0 = time.perf_counter()
        outs = dec.generate([prompts[i] for i in order], a.max_new, stop_ids=stop)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        n = sum(len(o.tokens) for o in outs)
        rows.append({"batch": f"{batches[0]} (static decoder)", "tokens": n,
                     "seconds": round(wall, 2), "tokens_per_s": round(n / wall, 1),
                     "steps": dec.last["iterations"]})
        print(json.dumps(rows[-1]), flush=True)
    if a.step:
        rows.append(run_step(a, batches[0], f"cuda:{dev.index or 0}" if dev.type == "cuda"
                             else "cpu"))
        call = next(r for r in rows if r["batch"] == batches[0])
        ratio = rows[-1]["tokens_per_s"] / call["tokens_per_s"]
        rows[-1]["ratio_to_engine_call"] = round(ratio, 3)
        print(json.dumps(rows[-1]), flush=True)
        print(f"generate step / Generator call at batch {batches[0]}: {ratio:.3f} "
              f"({rows[-1]['tokens_per_s']:,.0f} / {call['tokens_per_s']:,.0f} tok/s)",
              flush=True)
    lengths = sorted(len(o) for o in first)
    print(f"\n{a.target} on {dev_name} ({next(model.parameters()).dtype}), torch "
          f"{torch.__version__}: {len(prompts)} prompts, max {a.max_new} new tokens; answer "
          f"lengths min {lengths[0]}, median {lengths[len(lengths) // 2]}, max {lengths[-1]}")
    print("| batch | tokens/s end to end | w/o capture | s | prefill s | steps | row util | "
          "peak GiB | KV pool GiB | capped | same |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['tokens_per_s']:,.0f} | "
              f"{r.get('tokens_per_s_without_capture', 0):,.0f} | {r['seconds']} | "
              f"{r.get('prefill_seconds', '')} | {r['steps']} | {r.get('row_utilisation', '')} | "
              f"{r.get('peak_gib', '')} | {r.get('kv_pool_gib', '')} | "
              f"{r.get('length_capped', '')} | {r.get('same_as_first', '')} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"target": a.target, "device": dev_name,
                                            "prompts": len(prompts), "max_new": a.max_new,
                                            "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
