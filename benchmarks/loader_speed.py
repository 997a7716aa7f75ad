"""How fast offline training's batches are built from a store, on the host (issue 18).

    python benchmarks/loader_speed.py                      # SmolLM2's shape: fp8 aux, top-k 64
    python benchmarks/loader_speed.py --teacher hidden --aux-dtype bf16 --batches 40
    python benchmarks/loader_speed.py --intra-op 0,1 --contend 20000  # what building costs the step

A real run (store-fp8, 500 steps on an H200) waited 2.4-5.6 s for batches in every 50 steps of
~10 s: the train step outran the thread that builds them. This writes a store of chat-like
samples at a target's shape (the extract's shard format, through store.encode and ShardWriter),
then builds micro-batches of B rows x T tokens as train does (store.Reader -> Source.offline ->
host_batches), and reports batches/s and tokens/s, with one builder thread and with
`train.loader_threads` of them (batches.Prefetch), and the time per part of one build (read,
collate, align, embed). --decoded also times the samples decoded on the host (store.Reader[i]:
bf16 aux, int64 ids, float32 log-probs), as train built its batches before the stored dtypes
went to the device. --intra-op times the builders with that many intra-op threads each (0:
torch's default, a team per core; 1: what Prefetch sets); --contend OPS also times a stand-in for
train's host-bound step on the main thread (OPS tiny torch ops) alone and while the builders
keep the queue full.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_throughput import chat_lengths, prompt_lengths  # noqa: E402

from drafter.core.rundir import Run  # noqa: E402
from drafter.features import store
from drafter.features.capture import Head  # noqa: E402
from drafter.train import batches  # noqa: E402

SHAPES = {"smollm2": (576, 49152, 32000), "llama8b": (4096, 128256, 32000)}  # Ht, V, Vd


def write_store(root: Path, lengths: list[int], Ht: int, Vd: int, aux_dtype: str, teacher: str,
                k: int, shard_tokens: int = 1 << 20) -> Run:
    """A train split of these sample lengths: random features, the extract's format."""
    run = Run(root)
    g = torch.Generator().manual_seed(0)
    info = {"layer_ids": [1, 2, 3], "hidden_size": Ht, "aux_dtype": aux_dtype,
            "teacher": teacher, "topk": k, "num_layers": 4}
    writer, parts, entries, shard, n_ids = store.ShardWriter(info), [], [], 0, 0
    prompts = prompt_lengths(lengths, 0)

    def flush():
        nonlocal parts, shard, n_ids
        ids = [f"train:{n_ids + j:09d}" for j in range(sum(len(p[0]["offsets"]) - 1
                                                          for p in parts))]
        n_ids += len(ids)
        writer.submit(run.shard("train", shard), parts, ids)
        entries.append(run.shard("train", shard))
        parts, shard = [], shard + 1

    tokens = 0
    for a in range(0, len(lengths), 64):
        ls, ps = lengths[a:a + 64], prompts[a:a + 64]
        n = sum(ls)
        flat = {"input_ids": torch.randint(0, Vd, (n,), generator=g),
                "offsets": torch.tensor([0] + ls).cumsum(0),
                "aux": torch.randn(n, 3, Ht, generator=g).to(torch.bfloat16),
                "in_vocab": torch.ones(n, dtype=torch.bool)}
        if teacher == "hidden":
            flat["teacher_hidden"] = torch.randn(n, Ht, generator=g).to(torch.bfloat16)
        else:
            flat["teacher_topk_ids"] = torch.randint(0, Vd, (n, k), generator=g)
            flat["teacher_topk_logp"] = -torch.rand(n, k, generator=g).sort(-1).values * 9
        mask = torch.cat([(torch.arange(m) >= p).long() for m, p in zip(ls, ps)])
        parts.append(store.to_host(store.encode(flat, mask, aux_dtype, Vd)))
        tokens += n
        if tokens >= shard_tokens:
            flush()
            tokens = 0
    if parts:
        flush()
    done = writer.close()
    head = Head(torch.randn(Vd, Ht).to(torch.bfloat16), 1.0, None)
    sha = store.save_head(run.extract_head(), head, info)
    store.write_index(run.shard_index("train"), info, [done[p] for p in entries], sha)
    return run


def parts_of_one_build(src, rows, B, T, tc, emb) -> dict:
    """Seconds of each part of host_batches for one micro-batch (the same code, taken apart;
    read: loading the samples, which decodes them for a decoded source)."""
    t0 = time.perf_counter()
    samples = src.load([i for r in rows for i in r])
    t1 = time.perf_counter()
    it = iter(samples)
    hb = batches.collate([[next(it) for _ in r] for r in rows], B, T)
    t2 = time.perf_counter()
    batches.align(hb["seq_id"], hb["loss_mask"], hb["in_vocab"], tc.ttt_steps, tc.ttt_decay)
    t3 = time.perf_counter()
    batches.embed(emb, hb["input_ids"])
    t4 = time.perf_counter()
    return {"read": t1 - t0, "collate": t2 - t1, "align": t3 - t2, "embed": t4 - t3}


def rate(src, mbs, B, T, tc, emb, threads: int, warm: int,
         intra_op: int = 1) -> tuple[float, float]:
    """(batches/s, tokens/s) of a Prefetch with `threads` builders, their ops on `intra_op`
    intra-op threads each (0: torch's default), drained as fast as it goes, after `warm` untimed
    batches (a GPU host's pinned-memory cache fills with the first ones)."""
    feed = batches.Prefetch(lambda job: batches.host_batches(src, job, B, T, tc, emb),
                            ([m] for m in mbs), depth=2 * threads, threads=threads,
                            intra_op=intra_op)
    tokens = 0
    try:
        for _ in range(warm):
            feed.next()
        t = time.perf_counter()
        for _ in mbs[warm:]:
            tokens += feed.next()["tokens"]
    finally:
        feed.close()
    dt = time.perf_counter() - t
    return (len(mbs) - warm) / dt, tokens / dt


def host_step(ops: int, x: torch.Tensor) -> float:
    """A stand-in for train's host-bound step on the main thread: `ops` tiny torch ops (the
    dispatcher and Python, as launching kernels is). Returns its seconds."""
    t = time.perf_counter()
    for _ in range(ops):
        x.add_(1.0)
    return time.perf_counter() - t


def contention(src, mbs, B, T, tc, emb, threads: int, intra_op: int, ops: int) -> float:
    """The main thread's host step (host_step) in ms, one per batch taken, while `threads`
    builders keep the queue full (train's loop): what building batches costs the step that
    waits on no batch."""
    x = torch.zeros(16)
    feed = batches.Prefetch(lambda job: batches.host_batches(src, job, B, T, tc, emb),
                            ([m] for m in mbs), depth=2, threads=threads, intra_op=intra_op)
    spent = []
    try:
        feed.next()
        for _ in mbs[1:]:
            spent.append(host_step(ops, x))
            feed.next()
    finally:
        feed.close()
    return 1e3 * sorted(spent)[len(spent) // 2]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--aux-dtype", default="fp8", choices=["fp8", "bf16"])
    p.add_argument("--teacher", default="topk", choices=["topk", "hidden"])
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batches", type=int, default=30, help="micro-batches built per setting")
    p.add_argument("--warm", type=int, default=0,
                   help="of them, untimed first (the H200 runs of the ninth session: 0)")
    p.add_argument("--threads", default="1,4", help="builder threads to time, comma-separated")
    p.add_argument("--dir", help="keep the store here (default: a temporary folder)")
    p.add_argument("--intra-op", default="1",
                   help="builder threads' intra-op threads to time, comma-separated (0: torch's "
                        "default, as train ran before; 1: as train runs)")
    p.add_argument("--contend", type=int, default=0, metavar="OPS",
                   help="also time a main-thread step of OPS tiny torch ops, alone and while "
                        "the builders run (the GIL and the cores they share with train's step)")
    p.add_argument("--decoded", action="store_true",
                   help="also time samples decoded on the host (the path before)")
    a = p.parse_args(argv)
    Ht, V, Vd = SHAPES[a.shape]
    T, B = a.seq, a.batch_tokens // a.seq
    tc = SimpleNamespace(ttt_steps=7, ttt_decay=0.8)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.dir or tmp)
        lengths = chat_lengths(int(1.1 * (a.batches + 4) * B * T), seed=0)
        t = time.perf_counter()
        run = write_store(root, lengths, Ht, Vd, a.aux_dtype, a.teacher, a.topk)
        print(f"store: {len(lengths)} samples, {sum(lengths):,} tokens, "
              f"{store.read_index(run.shard_index('train'))['bytes_per_token']} bytes/token, "
              f"written in {time.perf_counter() - t:.1f} s")
        reader = store.Reader(run, "train")
        src = batches.Source.offline(reader)
        mbs = batches.epoch_micro_batches(batches.pack(src.lengths, T, 0), B, 0, 0)[:a.batches]
        emb = torch.randn(V, Ht)                      # the frozen table, float32 as train has it
        print(f"{a.shape}: Ht {Ht}, aux {a.aux_dtype}, teacher {a.teacher}"
              f"{f' k={a.topk}' if a.teacher == 'topk' else ''}, {B} rows x {T} tokens, "
              f"{len(mbs)} micro-batches, torch {torch.__version__}, "
              f"{torch.get_num_threads()} intra-op threads")
        decoded = batches.Source(reader.ids, reader.lengths,
                                 lambda idx: [reader[j] for j in idx])
        for name, s in [("stored", src)] + [("decoded", decoded)] * a.decoded:
            parts = [parts_of_one_build(s, m, B, T, tc, emb) for m in mbs[:5]]
            print(f"{name} samples, one build, mean of 5: " + ", ".join(
                f"{k} {1e3 * sum(d[k] for d in parts) / len(parts):.1f} ms" for k in parts[0]))
            for n in [int(x) for x in a.threads.split(",")]:
                for io in [int(x) for x in a.intra_op.split(",")]:
                    bps, tps = rate(s, mbs, B, T, tc, emb, n, a.warm, io)
                    print(f"{name} samples, threads {n}, intra-op {io or 'default'}: "
                          f"{bps:.2f} micro-batches/s, {tps:,.0f} tokens/s")
        if a.contend:
            x = torch.zeros(16)
            alone = sorted(host_step(a.contend, x) for _ in range(len(mbs)))[len(mbs) // 2]
            print(f"main-thread step of {a.contend} ops, alone: {1e3 * alone:.1f} ms (median)")
            for n in [int(x) for x in a.threads.split(",")]:
                for io in [int(x) for x in a.intra_op.split(",")]:
                    ms = contention(src, mbs, B, T, tc, emb, n, io, a.contend)
                    print(f"main-thread step while threads {n}, intra-op {io or 'default'} "
                          f"build: {ms:.1f} ms (median, {ms / (1e3 * alone):.2f}x alone)")


if __name__ == "__main__":
    main()
