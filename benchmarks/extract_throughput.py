"""Extraction throughput and storage size, per storage option, against a raw forward.

Headline figure (BENCHMARKS.md, Data engine): tokens/s and bytes/token of each storage option
(bf16 or fp8 aux states, hidden or top-k teacher) for SmolLM2-135M-Instruct on one GPU:

    python benchmarks/extract_throughput.py --model builtin:smollm2-135m-instruct

It prints a markdown table (one row per mode: tokens/s, against the raw forward, bytes/token,
against 8*Ht+16, peak GiB), then the bytes/token formula at larger targets' hidden sizes. Other
uses:

    python benchmarks/extract_throughput.py                       # SmolLM2-135M on the GPU
    python benchmarks/extract_throughput.py --model meta-llama/Llama-3.1-8B --tokens 2000000
    python benchmarks/extract_throughput.py --tiny                # any machine, a minute on CPU
    torchrun --nproc-per-node 2 benchmarks/extract_throughput.py  # data parallel: rank r takes
                                                                  # the shards i % W == r
    python benchmarks/extract_throughput.py --model /data/kimi-slice --tokens 131072 \
        --options fp8/topk,bf16/hidden --fp8-error --json extract.json   # a Kimi-K2.5 slice
                                                # (benchmarks/kimi_slice.py; kimi_shape.sh extract)

For the same samples, cut into the same padded batches (extract's plan: longest first,
`--batch-tokens` per forward), it times
  raw forward     model(input_ids) of the causal LM in the target dtype: the decoder plus
                  lm_head over the full vocab (what "a forward" costs anyone)
  decoder only    the decoder without lm_head (a floor no extraction can beat)
  each option     the extract step's own loop (drafter.steps.extract._extract_shard): hooks,
                  chunked teacher, encoding on the device, copy to the host, and the background
                  writer (serialise, sha256, atomic write, fsync) until the last shard is on disk
and prints tokens/s, the ratio to the raw forward (goal >= 0.8), bytes/token from the files and
the ratio to the reference layout 8*Ht+16 (goal <= 0.4 for fp8 + top-k), then the same formula at
the hidden sizes of larger targets. Peak GiB: torch.cuda.max_memory_allocated over each option's
timed loop (the weights included), per rank, the largest.

--chunks MIB: the cost of a disk budget (max_disk_gib, docs/extract.md "Bounded disk"):
the extract and train steps of one SmolLM2 run (prepare, tokenize, vocab made once, copied into
both), first with every shard stored, then in chunks of MIB MiB (a budget of val, the head,
the rest of the run besides and MIB; `drafter run` in one process: each chunk made, trained,
deleted). It prints each run's step seconds and wall time, the chunks and target loads, the
overhead of chunks and where its seconds go (chunk_reasons), and the largest weight difference
between the two drafters:

    python benchmarks/extract_throughput.py --chunks 4 --samples 120      # CPU, a few minutes

--fp8-error: the error that fp8 storage adds to the aux states, at the target's own hidden size:
the first --fp8-error-tokens tokens (longest samples first, as extract orders them) captured at
the input of every decoder layer (HS[0..N-1], in bf16 as capture returns them), encoded to fp8
and decoded again (store.quantize_fp8 / dequantize_fp8: one scale per token and layer), and per
layer the relative L2 error ||fp8 - bf16|| / ||bf16|| over those tokens (and the largest one
token's). --json writes everything, with the load seconds and the GPU, for kimi_plan.py.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter.core import target
from drafter.core.config import ExtractConfig, TargetConfig  # noqa: E402
from drafter.core.dist import all_gather, dist_env  # noqa: E402
from drafter.core.rundir import Run  # noqa: E402
from drafter.data import tokens
from drafter.features import capture as C  # noqa: E402
from drafter.features import store  # noqa: E402
from drafter.steps import extract  # noqa: E402

OPTIONS = [("bf16", "hidden"), ("bf16", "topk"), ("fp8", "hidden"), ("fp8", "topk")]


def tiny_model(out: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=768,
                      num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Ranks:
    """torchrun's ranks (or one process): barriers, max/sum over ranks, rank 0's objects."""

    def __init__(self, device: str):
        self.d = dist_env(device)  # drafter.core.dist, as the extract step reads it
        self.rank, self.world, self.local = self.d.rank, self.d.world, self.d.local_rank
        self.device = str(self.d.device)

    def gather(self, obj) -> list:
        return all_gather(self.d, obj)

    def barrier(self) -> None:
        self.gather(None)

    def from_rank0(self, obj):
        return self.gather(obj)[0]


def make_samples(n_tokens: int, min_len: int, max_len: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out, total = [], 0
    while total < n_tokens:
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        out.append(torch.randint(0, vocab, (n,), generator=g))
        total += n
    return out


def write_tokens(run: Run, samples) -> None:
    path = run.tokens("train")
    path.parent.mkdir(parents=True, exist_ok=True)
    w = tokens.TokenWriter(path)
    for i, s in enumerate(samples):
        w.write(f"bench:{i}", s.tolist(), [1] * len(s))
    w.close()


def run_raw(model, batches, device: str, decoder_only: bool) -> None:
    """The plain forwards of these padded batches: the causal LM (logits over the full vocab)
    or its decoder alone."""
    fn = model.get_decoder() if decoder_only else model
    with torch.no_grad():
        for b in batches:
            out = fn(input_ids=b.to(device), use_cache=False)
            del out


def fp8_error(model, samples, order, d2t, t2d, n_tokens: int) -> dict:
    """Relative L2 error of fp8 storage of every decoder layer's input over the first n_tokens
    tokens of `order` (see the module docstring): {"tokens", "layers": {k: {"rel_l2",
    "max_token_rel_l2"}}}. One forward of those samples, all layers captured at once."""
    n = len(C.decoder_layers(model))
    cap = C.Capture(model, list(range(n)), d2t, t2d, teacher="hidden", batch_tokens=n_tokens)
    take, total = [], 0
    for i in order:
        if total >= n_tokens and take:
            break
        take.append(samples[i])
        total += len(samples[i])
    aux = cap.run(take)["aux"]                                               # [T, N, Ht] bf16
    q, scale = store.quantize_fp8(aux)
    diff = (store.dequantize_fp8(q, scale).float() - aux.float()).pow(2).sum(-1)   # [T, N]
    ref = aux.float().pow(2).sum(-1).clamp_min(1e-30)                              # [T, N]
    layers = {}
    for k in range(n):
        layers[k] = {"rel_l2": float((diff[:, k].sum() / ref[:, k].sum()).sqrt()),
                     "max_token_rel_l2": float((diff[:, k] / ref[:, k]).sqrt().max())}
    return {"tokens": total, "layers": layers}


def chunks_overhead(a) -> int:
    """--chunks (module docstring): the stored run against the chunked one, in this process."""
    import yaml

    from drafter.core import config as Cfg
    from drafter.features import spool
    from drafter.run import pipeline
    from drafter.train.budget import held_of

    work = Path(a.out or tempfile.mkdtemp(prefix="drafter-chunks-"))
    cfg = {"target": {"model": a.model, "dtype": a.dtype, "device": a.device},
           "prepare": {"sources": [{"path": a.data, "max_samples": a.samples}],
                       "val_fraction": 0.1},
           "generate": {"enabled": False},
           "tokenize": {"max_length": a.max_len or 256, "workers": 1},
           "vocab": {"draft_vocab_size": min(a.draft_vocab, 4096)},
           "extract": {"shard_tokens": a.shard_tokens or 2048, "teacher": "topk",
                       "topk": a.topk, "aux_dtype": "fp8",
                       "batch_tokens": a.batch_tokens or 2048},
           "train": {"epochs": 2, "batch_tokens": 1024, "max_length": a.max_len or 256,
                     "ttt_steps": 3, "eval_every": 0, "save_every": 10_000, "log_every": 10}}
    path = work / "stored.yaml"
    path.write_text(yaml.safe_dump({**cfg, "run_dir": str(work / "stored")}))
    stored = Cfg.load(path)
    pipeline.run_all(stored, steps=["prepare", "generate", "tokenize", "vocab"])
    rows, weights = {}, {}
    for name in ("stored", "chunked"):
        run = Run(work / name)
        if name == "chunked":
            for step in ("prepare", "generate", "tokenize", "vocab"):
                shutil.copytree(Run(work / "stored").step_dir(step), run.step_dir(step))
            ref = Run(work / "stored")
            steps = json.loads(ref.manifest("train").read_text())["counts"]["steps"]
            # chunks of MIB: the budget holds the rest of the run besides (budget.held)
            over = spool.stored_bytes(ref) + held_of(stored, ref, steps)["total"] + 64 * 1024 \
                + a.chunks * 2**20
            path = work / "chunked.yaml"
            path.write_text(yaml.safe_dump({**cfg, "run_dir": str(run.root),
                                            "max_disk_gib": over / 2**30}))
        c = Cfg.load(path)
        t0, cpu = time.time(), {}
        for step in ("extract", "train"):  # CPU seconds of this process (its threads): on a
            cpu0 = time.process_time()     # shared machine the work done, which wall time is not
            pipeline.run_all(c, steps=[step])
            cpu[step] = round(time.process_time() - cpu0, 1)
        wall = time.time() - t0
        m = {s: json.loads(run.manifest(s).read_text()) for s in ("extract", "train")}
        rows[name] = {"wall_s": round(wall, 1), "cpu_s": round(sum(cpu.values()), 1),
                      **{f"{s}_cpu_s": v for s, v in cpu.items()},
                      **{f"{s}_s": round(m[s]["seconds"], 1) for s in m},
                      "extracted_tokens": m["extract"]["counts"].get("tokens"),
                      "chunks": (m["train"].get("chunks") or {}).get("count"),
                      "producer": (m["train"].get("chunks") or {}).get("producer")}
        from safetensors.torch import load_file

        weights[name] = load_file(str(run.checkpoints()[-1] / "model.safetensors"))
    prod = rows["chunked"].pop("producer") or {}
    rows["chunked"].update(loads=prod.get("loads"), load_s=round(prod.get("load_s", 0), 1),
                           chunk_extract_s=round(prod.get("seconds", 0), 1),
                           chunk_extract_cpu_s=round(prod.get("cpu_s", 0), 1),
                           chunk_tokens=prod.get("tokens"))
    gap = max((weights["stored"][k].double() - weights["chunked"][k].double()).abs().max()
              .item() for k in weights["stored"])
    s, ch = rows["stored"], rows["chunked"]
    reasons = chunk_reasons(Cfg.load(path), Run(work / "stored"), Run(work / "chunked"), s, ch,
                            prod)
    rows["reasons"] = reasons
    print(json.dumps(rows, indent=2))
    print("| run | extract s | train s | wall s | chunks | loads |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| stored | {s['extract_s']} | {s['train_s']} | {s['wall_s']} | - | 1 |")
    print(f"| chunked ({a.chunks} MiB) | {ch['extract_s']} | {ch['train_s']} | {ch['wall_s']} | "
          f"{ch['chunks']} | 1 + {ch['loads']} |")
    print(f"CPU seconds: stored {s['cpu_s']}, chunked {ch['cpu_s']} "
          f"({ch['cpu_s'] / s['cpu_s'] - 1:+.1%})")
    print(f"overhead of chunks: {ch['wall_s'] / s['wall_s'] - 1:+.1%} of extract + train wall "
          f"time; tokens through the target {s['extracted_tokens']:,} stored, "
          f"{ch['extracted_tokens'] + ch['chunk_tokens']:,} chunked (val, then the chunks: "
          f"{ch['chunk_extract_s']} s, of which target loads {ch['load_s']} s); largest weight "
          f"difference {gap:.3g}")
    print("where the chunked run's extra CPU seconds go (priced at the stored run's CPU "
          "seconds per padded token):")
    for k, v in reasons["cpu_seconds"].items():
        print(f"  {k:<34} {v:>8.1f} s")
    print(f"padding: {reasons['padded_over_tokens_stored']:.3f} padded tokens per token stored, "
          f"{reasons['padded_over_tokens_chunked']:.3f} in chunks")
    if a.json:
        Path(a.json).write_text(json.dumps({**rows, "max_weight_diff": gap}, indent=2))
    if a.out is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def chunk_reasons(cfg, stored, chunked, s: dict, ch: dict, prod: dict) -> dict:
    """The chunked run's extra CPU seconds by reason, summing to the difference: the train
    split through the target again (each epoch: a sample in two chunks twice), the forwards'
    extra padding (a chunk's few samples batch with more padding than the whole split's), the
    rest of making the chunks (target loads, shards, hashes, index), the rest of train's own
    time (a checkpoint and a hash per chunk), and the extract step's (val and head only).
    Extraction is priced at the stored extract step's CPU seconds per padded token (a forward's
    rows times its longest sample)."""
    from drafter.data import tokens
    from drafter.features import spool
    from drafter.steps.extract import plan_shards

    ec = cfg.extract
    ids, lengths = tokens.ids_and_lengths(stored.tokens("train"))
    by_id = dict(zip(ids, lengths))
    _, vlens = tokens.ids_and_lengths(stored.tokens("val"))

    def padded(lens: list[int]) -> int:
        return sum(len(b) * max(sh.lengths[i] for i in b)
                   for sh in plan_shards("train", lens, ec.shard_tokens, ec.batch_tokens, False)
                   for b in sh.batches)

    plan = spool.read_plan(chunked)
    train_pad, val_pad = padded(list(lengths)), padded(list(vlens))
    parts = sum(padded([by_id[i] for i in c["ids"]]) for c in plan["chunks"])
    tokens_again = sum(c["tokens"] for c in plan["chunks"])
    per = s["extract_cpu_s"] / (train_pad + val_pad)  # CPU s per padded token, stored
    per_token = train_pad / sum(lengths) * per  # per train token at the whole split's padding
    made = prod.get("cpu_s", 0.0)
    out = {"train split extracted again": (tokens_again - sum(lengths)) * per_token,
           "padding of the chunks' forwards": parts * per - tokens_again * per_token,
           "making chunks, the rest (loads, writes)": made - parts * per,
           "train's own time, the rest": ch["train_cpu_s"] - made - s["train_cpu_s"],
           "extract step (val and head only)": ch["extract_cpu_s"] - s["extract_cpu_s"]
           + train_pad * per}
    return {"cpu_seconds": {k: round(v, 1) for k, v in out.items()},
            "padded_over_tokens_stored": round(train_pad / sum(lengths), 3),
            "padded_over_tokens_chunked": round(parts / max(tokens_again, 1), 3),
            "chunk_tokens": tokens_again, "stored_train_tokens": sum(lengths),
            "checkpoints_written": len(plan["chunks"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama, few tokens (CPU)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens to extract (default 1M; "
                    "tiny: 16k)")
    ap.add_argument("--min-len", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--batch-tokens", type=int, default=None, help="default: extract's 16384")
    ap.add_argument("--shard-tokens", type=int, default=None, help="default: extract's")
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="auto", help="auto = bf16 on GPU, fp32 on CPU")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--options", default="all", help="comma list like fp8/topk,bf16/hidden")
    ap.add_argument("--out", default=None, help="folder for the shards (default: a temp dir "
                    "on the same disk as /tmp; use the run dir's disk to measure it)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--fp8-error", action="store_true", help="also the fp8 storage error of "
                    "every layer's input states (module docstring)")
    ap.add_argument("--fp8-error-tokens", type=int, default=16384,
                    help="tokens the fp8 error is measured over (one forward)")
    ap.add_argument("--chunks", type=float, default=None, metavar="MIB",
                    help="the stored run against chunks within MIB MiB (module docstring)")
    ap.add_argument("--samples", type=int, default=120, help="--chunks: conversations")
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/"
                                          "train/codealpaca_2k.json"),
                    help="--chunks: the conversations (any source prepare reads)")
    a = ap.parse_args()
    if a.chunks is not None:
        return chunks_overhead(a)

    ex = ExtractConfig()
    n_tokens = a.tokens or (16384 if a.tiny else 1_000_000)
    min_len = a.min_len or (64 if a.tiny else 256)
    max_len = a.max_len or (512 if a.tiny else 2048)
    batch_tokens = a.batch_tokens or (2048 if a.tiny else ex.batch_tokens)
    shard_tokens = a.shard_tokens or (4096 if a.tiny else ex.shard_tokens)
    options = OPTIONS if a.options == "all" else \
        [tuple(o.split("/")) for o in a.options.split(",")]

    tcfg0 = TargetConfig(model="", dtype=a.dtype, device=a.device)
    R = Ranks(target.pick_device(tcfg0))
    device = R.device
    work = Path(R.from_rank0(a.out or tempfile.mkdtemp(prefix="drafter-bench-")))
    if a.tiny and R.rank == 0:
        tiny_model(work / "tiny-llama")
    R.barrier()
    model_spec = str(work / "tiny-llama") if a.tiny else a.model
    tcfg = TargetConfig(model=model_spec, dtype=a.dtype, device=a.device)
    t0 = time.time()
    model = target.load_model(tcfg, device=device)
    load_s = time.time() - t0
    conf = model.config
    V, Ht, N = target.vocab_size(conf), target.hidden_size(conf), target.num_layers(conf)
    vd = min(a.draft_vocab, V)
    g = torch.Generator().manual_seed(1)
    draft = torch.randperm(V, generator=g)[:vd].sort().values
    d2t, t2d = draft - torch.arange(vd), torch.zeros(V, dtype=torch.bool)
    t2d[draft] = True

    samples = make_samples(n_tokens, min_len, max_len, V)
    total = sum(len(s) for s in samples)
    # the extract step's plan: shards longest first, padded forwards of <= batch_tokens; under
    # torchrun this rank's shards, as in the step (i % W == rank)
    plans = extract.plan_shards("train", [len(s) for s in samples], shard_tokens, batch_tokens,
                                packed=False)
    mine = [p for p in plans if p.index % R.world == R.rank]
    order = [i for p in mine for i in p.rows]
    padded = []
    for p in mine:
        for b in p.batches:
            rows = [samples[p.rows[j]] for j in b]
            x = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
            for k, r in enumerate(rows):
                x[k, :len(r)] = r
            padded.append(x)
    padded_tokens = sum(R.gather(sum(x.numel() for x in padded)))
    if R.rank == 0:
        print(f"model {model_spec}: N={N} Ht={Ht} V={V} {str(model.dtype).replace('torch.', '')}"
              f" on {device} x{R.world} (loaded in {load_s:.0f}s); {len(samples)} samples, "
              f"{total:,} tokens ({padded_tokens / total - 1:.1%} padding), forwards of <= "
              f"{batch_tokens} tokens, {len(plans)} shards; Vd={vd} k={a.topk}", flush=True)

    def timed(fn) -> float:
        """Seconds of fn() on every rank at once: from a common start to the last rank's end."""
        R.barrier()
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        return max(R.gather(time.perf_counter() - t))

    rows = []
    run_raw(model, padded[:1], device, decoder_only=False)  # warm-up
    raw_s = timed(lambda: run_raw(model, padded, device, decoder_only=False))
    rows.append(("raw forward (logits)", total / raw_s, None, None, None))
    dec_s = timed(lambda: run_raw(model, padded, device, decoder_only=True))
    rows.append(("decoder only", total / dec_s, None, None, None))

    run = Run(work / "run")
    for p in plans:   # where the step writes them
        p.path = run.shard("train", p.index)
    if R.rank == 0:
        write_tokens(run, samples)
    R.barrier()
    table = extract._read_table(run.tokens("train"))
    results = {"model": model_spec, "device": device, "world_size": R.world,
               "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
               "gpu_memory_gib": torch.cuda.get_device_properties(device).total_memory / 2**30
               if device.startswith("cuda") else None,
               "dtype": str(model.dtype), "Ht": Ht, "N": N, "V": V, "Vd": vd, "topk": a.topk,
               "tokens": total, "samples": len(samples), "padded_tokens": padded_tokens,
               "batch_tokens": batch_tokens, "shard_tokens": shard_tokens, "load_s": load_s,
               "raw_tokens_per_s": total / raw_s, "decoder_tokens_per_s": total / dec_s,
               "options": {}}

    class Bar:
        def update(self, n):
            pass

    for aux_dtype, teacher in options:
        ecfg = ExtractConfig(aux_dtype=aux_dtype, teacher=teacher, topk=a.topk,
                             batch_tokens=batch_tokens, shard_tokens=shard_tokens)
        cap = C.Capture(model, None, d2t, t2d, teacher=teacher, topk=a.topk,
                        batch_tokens=batch_tokens)
        info = {"bench": True, "aux_dtype": aux_dtype, "teacher": teacher}
        if R.rank == 0:
            for old in run.shards("train").glob("shard_*"):
                old.unlink()
            run.shards("train").mkdir(parents=True, exist_ok=True)
        cap.run([samples[order[0]]] if order else [samples[0]])  # warm-up, outside the clock
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        entries: dict = {}

        def work_fn():
            writer = store.ShardWriter(info)
            for p in mine:
                extract._extract_shard(cap, table, p, ecfg, writer, Bar())
            entries.update(writer.close())  # the last shard is on disk

        secs = timed(work_fn)
        nbytes = sum(R.gather(sum(e["bytes"] for e in entries.values())))
        bpt = nbytes / total
        formula = store.bytes_per_token(Ht, len(cap.layer_ids), aux_dtype, teacher, a.topk, vd)
        ref = store.reference_bytes_per_token(Ht)
        peak = max(R.gather(torch.cuda.max_memory_allocated() / 2**30)) \
            if device.startswith("cuda") else None
        rows.append((f"{aux_dtype} + {teacher}", total / secs, bpt, bpt / ref, peak))
        results["options"][f"{aux_dtype}/{teacher}"] = {
            "tokens_per_s": total / secs, "vs_raw": raw_s / secs, "bytes_per_token": bpt,
            "formula_bytes_per_token": formula, "vs_reference": bpt / ref,
            "bytes": nbytes, "peak_gib": peak}
        if R.rank == 0:
            print(f"  {aux_dtype}+{teacher}: {total / secs:,.0f} tok/s, {bpt:.0f} B/tok",
                  flush=True)

    if a.fp8_error and R.rank == 0:
        err = fp8_error(model, samples, order or C.length_order([len(x) for x in samples]),
                        d2t, t2d, a.fp8_error_tokens)
        results["fp8_error"] = err
        print(f"fp8 aux error at Ht={Ht} over {err['tokens']:,} tokens, relative L2 per layer "
              f"input HS[k] (largest one token's): " + ", ".join(
                  f"{k}: {e['rel_l2']:.4f} ({e['max_token_rel_l2']:.4f})"
                  for k, e in err["layers"].items()), flush=True)
    R.barrier()
    if a.out is None and R.rank == 0:  # the shards of the last option: gigabytes at large Ht
        shutil.rmtree(work, ignore_errors=True)
    if R.rank != 0:
        return 0
    ref = store.reference_bytes_per_token(Ht)
    print(f"\n| mode | tokens/s | vs raw forward | bytes/token | vs 8*Ht+16 = {ref} | peak GiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, tps, bpt, rr, peak in rows:
        print(f"| {name} | {tps:,.0f} | {tps * raw_s / total:.2f} | "
              f"{'' if bpt is None else f'{bpt:,.0f}'} | {'' if rr is None else f'{rr:.3f}'} | "
              f"{'' if peak is None else f'{peak:.1f}'} |")
    print(f"\nbytes/token by formula (store.bytes_per_token, k={a.topk}, Vd={vd}) / (8*Ht+16):")
    sizes = sorted({Ht, 576, 4096, 7168})
    print("| option | " + " | ".join(f"Ht={h}" for h in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for aux_dtype, teacher in OPTIONS:
        bpt = [store.bytes_per_token(h, 3, aux_dtype, teacher, a.topk, vd) for h in sizes]
        cells = [f"{b:,} ({b / (8 * h + 16):.3f})" for b, h in zip(bpt, sizes)]
        print(f"| {aux_dtype} + {teacher} | " + " | ".join(cells) + " |")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{a.json}.tmp")
        tmp.write_text(json.dumps(results, indent=2))
        tmp.replace(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
