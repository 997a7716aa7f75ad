"""The train step: an EAGLE-3 drafter with training-time test (TTT), or a block drafter
(train.method: dspark, dflash; drafter/train/dspark_objective.py), offline or online.

Reads   vocab/vocab.safetensors (d2t, t2d), the target's config and input embeddings, and
        offline: extract/{train,val}/ shards and extract/head.safetensors (store.Reader);
        online (train.online): tokenize/{train,val}.parquet and the target itself (capture);
        in chunks (max_disk_gib): SPOOL/chunk_NNNNN/, a chunk of its steps at a time,
        with extract/val/ and the head (drafter/train/chunks.py; docs/extract.md)
Writes  train/step_NNNNNN/  model.safetensors + drafter_config.json (model.save_drafter),
                            optimizer.pt, rng.safetensors, state.json, COMPLETE (written last)
        train/metrics.jsonl one record per log interval ("train") and validation ("val")
        train/tb/           TensorBoard events (train.tensorboard)

    drafter train CONFIG [train.lr=3e-4 ...]
    torchrun --nproc-per-node 8 -m drafter.cli train CONFIG [train.fsdp=true]

This file is the loop, top to bottom. What it calls: drafter/train/batches.py (the data pipeline),
trainer.py (the model set up for the ranks, one optimizer step), ttt.py (the K-step unroll and
its loss; merge.py its later steps' attention), checkpoint.py, metrics.py, and dist.py
(torchrun's environment).

How samples become rows and micro-batches, the loss and metrics it logs, and the precompile
process it waits for: docs/internals.md, "Module notes".
"""
from __future__ import annotations

import contextlib
import logging
import math
import shutil
import time

import torch

from drafter import DrafterError  # noqa: F401 - the step's errors (tests name it here)
from drafter.core import target
from drafter.core.config import ConfigError
from drafter.core.dist import Dist, all_sum, close_dist, dist_env
from drafter.core.rundir import JsonlAppender, Run, read_jsonl
from drafter.core.weights import target_embeddings
from drafter.data import tokens
from drafter.features import spool, store
from drafter.train import precompile
from drafter.train.batches import (
    Prefetch,
    Source,
    data_plan,
    device_batch,
    grouped,
    host_batch,
    host_batches,
    model_inputs,
    pack,
)
from drafter.train.checkpoint import (
    best_checkpoint,
    checkpoint_step,
    load_checkpoint,
    prune_checkpoints,
    resume_from,
    save_checkpoint,
    tokens_seen,
)
from drafter.train.chunks import Chunks, conduct, plan_run, trains_apart
from drafter.train.losses import objective
from drafter.train.metrics import (
    Meter,
    atomic_json_lines,
    fmt_line,
    tb_write,
    tensorboard_writer,
    throughput,
)
from drafter.train.model import Drafter, param_count
from drafter.train.trainer import (
    LOADER_THREADS,
    WARMUP_STEPS,
    GcClock,
    Phases,
    build_drafter,
    compile_stats,
    compiled_graphs,
    compiles_hold,
    device_setup,
    pick_attention,
    positions,
    setup_model,
    sync_device,
    train_step,
    trained_with,
)

log = logging.getLogger("drafter")


def lr_lambda(tc, total: int):
    warm = max(1, round(tc.warmup_ratio * total)) if tc.warmup_ratio > 0 else 0

    def f(step: int) -> float:  # linear warmup, then cosine down to min_lr_ratio
        if step < warm:
            return (step + 1) / warm
        x = min(1.0, (step - warm) / max(1, total - warm))
        return tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * x))
    return f


# -------------------------------------------------------------------------------------- loop
def _check(tc) -> None:
    for key, ok in (("ttt_steps", tc.ttt_steps >= 1), ("grad_accum", tc.grad_accum >= 1),
                    ("max_length", tc.max_length >= 4), ("log_every", tc.log_every >= 1),
                    ("save_every", tc.save_every >= 1), ("keep_checkpoints",
                                                         tc.keep_checkpoints >= 1),
                    ("ttt_decay", tc.ttt_decay > 0), ("epochs", tc.epochs >= 1),
                    ("loss_chunk", tc.loss_chunk >= 0)):
        if not ok:
            raise ConfigError(f"train.{key}: invalid value {getattr(tc, key)!r}")
    if tc.batch_tokens < tc.max_length:
        raise ConfigError(f"train.batch_tokens ({tc.batch_tokens}) must be at least "
                          f"train.max_length ({tc.max_length}): a micro-batch holds whole rows")


def fit(cfg, run: Run, dist: Dist, drafter: Drafter, train_src: Source,
        val_src: Source | None, head, t0: float | None = None,
        setup: Phases | None = None, chunks: Chunks | None = None) -> dict:
    """The training loop: plain PyTorch, top to bottom. Returns the manifest extras. t0: when
    train started setting up (perf_counter; default: now): setup_s, its seconds to the loop;
    setup: the caller's clock of the setup's parts (setup_parts_s), continued here. chunks
    (max_disk_gib): train_src is chunks.source, the steps' samples come from the chunk
    each step belongs to, and each chunk's last step is checkpointed, then the chunk deleted."""
    t0 = time.perf_counter() if t0 is None else t0
    tc = cfg.train
    _check(tc)
    dev, cuda = dist.device, dist.device.type == "cuda"
    setup = setup if setup is not None else Phases({}, dev)
    amp = device_setup(tc, dev)
    attention = pick_attention(tc, dev)
    fused = attention == "flex"
    K, T = positions(tc), tc.max_length
    B = tc.batch_tokens // T
    head = head.to(dev)
    setup.tick("device")  # the head on the device
    fsdp = tc.fsdp and dist.world > 1

    # data plan, and the step a resume starts at: known before the model, so that the loader
    # builds the first batches while the model is set up (without that, the first step waited
    # for its batch: BENCHMARKS.md, Figures behind design choices)
    dp = data_plan(train_src.lengths, tc, dist.world)
    n_micro, steps_per_epoch, total = dp.n_micro, dp.steps_per_epoch, dp.total
    per_step = dist.world * tc.grad_accum
    ckpt = resume_from(run, tc)
    step = checkpoint_step(ckpt) if ckpt is not None else 0
    stop = total
    if chunks is not None:  # the chunk of the first step: made here (one process) or awaited
        chunks.begin(step, total)
        stop = chunks.stop  # a child of chunks.conduct trains one chunk
    setup.tick("plan")

    def jobs(from_step):  # this rank's micro-batches from a step on (the data position)
        for s in range(from_step, stop):
            for a in range(tc.grad_accum):
                mb = dp.micro_batch(s, a, dist.rank)
                yield mb if chunks is None else chunks.tag(s, mb)

    # the frozen table on the CPU: TTT leaves it there, so the model's set-up does not touch it
    make = lambda g: host_batches(train_src, g, B, T, tc, drafter.embed_tokens.weight)  # noqa
    # online, the thread runs the target too: on a stream of its own on a GPU, over the samples
    # of online_group micro-batches at once; with two groups queued, one being built
    # and one batch in use, memory.train_gpu_bytes counts 3 x online_group + 1 in flight
    group = tc.online_group if tc.online else 1
    feed = Prefetch(make, grouped(jobs(step), group, step * tc.grad_accum), depth=2 * group,
                    device=dev if tc.online else None,
                    threads=1 if tc.online else LOADER_THREADS)
    setup.tick("loader")
    metrics, tb, gc_clock, compiled = None, None, None, None
    try:
        obj = objective(cfg)  # the loss and the temperatures its metrics show (losses.py)
        ttt, model, opt = setup_model(drafter, tc, dist, attention, obj)
        params = [p for p in ttt.parameters() if p.requires_grad]
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(tc, total))
        setup.tick("model")

        # resume: the metrics of steps after the checkpoint are redone
        metrics_path, state0, seen0 = run.train_metrics(), {}, 0
        if ckpt is not None:
            state0 = load_checkpoint(ckpt, dist, ttt, opt, sched, fsdp)  # its step: `step`
            log.info("train: resumed from %s (step %d)", ckpt, step)
        # chunk ends saved only for a resume: pruned once a newer checkpoint is written
        transient = {e for e in chunks.ends if e % tc.save_every and e != total} \
            if chunks is not None else set()
        history = list(state0.get("invocations") or [])  # the earlier ones, to the checkpoint
        if dist.main:
            for pattern in (".tmp-step_*", ".old-step_*"):  # a kill in a save or prune left it
                for junk in run.step_dir("train").glob(pattern):
                    shutil.rmtree(junk, ignore_errors=True)
            prune_checkpoints(run, tc.keep_checkpoints, transient, also=ckpt)  # a kill's extra
            kept = [r for r in read_jsonl(metrics_path, repair=True) if r.get("step", 0) <= step]
            seen0 = tokens_seen(state0, kept) if ckpt is not None else 0  # before this run
            atomic_json_lines(metrics_path, kept)
            metrics = JsonlAppender(metrics_path)
            tb = tensorboard_writer(run, step) if tc.tensorboard else None
            log.info("train: drafter %s trainable params, H=%d, Vd=%d, K=%d, %s attention, "
                     "%d rows/micro-batch × %d tokens, %d micro-batches/epoch, %d steps "
                     "(%d/epoch), world %d%s", f"{param_count(drafter):,}",
                     drafter.cfg.hidden_size, drafter.cfg.draft_vocab_size, K, attention, B, T,
                     n_micro, total, steps_per_epoch, dist.world, " fsdp" if fsdp else "")
        meter, val, last_val, last_train = Meter(K, dev, obj), None, None, None
        autocast = torch.autocast(dev.type, dtype=amp) if amp else contextlib.nullcontext()
        setup.tick("resume")
        # an online run's precompile, started by the pipeline before generate (engine drafter),
        # tokenize or vocab (precompile.start_ahead): the first step loads what it compiled, so
        # it is waited for here, with the model set up and the feeder capturing the first
        # batches meanwhile
        ahead = precompile.take_ahead()
        if ahead is not None:
            compiled = precompile.finish(ahead, log_to=run.step_dir("train")
                                         / precompile.log_name(dist.rank))
            compiled["started_before"] = ahead.before
            setup.tick("precompile")
        first, t_start, tokens_total = step, time.perf_counter(), 0
        setup_s = t_start - t0  # the store, the target's config and embeddings, the model, resume
        setup_parts = {k: round(v, 3) for k, v in setup.into.items()}
        if dist.main:
            log.info("train: set up in %.1f s (%s)", setup_s,
                     ", ".join(f"{k} {v:.2f}" for k, v in setup_parts.items()))
        # Time in train steps only (validation and checkpoints set aside), so that tokens_per_s,
        # elapsed_s and warmup_s measure training: avg_over_steady compares the whole run with
        # steady state.
        aside, train_s_log, warmup_s, warmup_wait_s, rates = 0.0, 0.0, None, None, []
        warmup_compile = None  # compile_stats() when the warm-up ends (compiled path)
        warmup_steps = []  # each warm-up step's seconds, waited for on the device: where it goes
        first_step = {}  # this process's first step in parts (batch, forward, backward, optimizer)
        # seconds this thread blocked on the prefetch thread: since the last log, and in all
        waited = [0.0, 0.0]
        gc_clock = GcClock()  # Python's collections: per interval, in all
        gc_warmup = None

        def take() -> dict:
            t = time.perf_counter()
            hb = feed.next()
            dt = time.perf_counter() - t
            waited[0] += dt
            waited[1] += dt
            return hb

        while step < stop:
            t_step = time.perf_counter()
            micro = (device_batch(take(), dev, head, fused) for _ in range(tc.grad_accum))
            gnorm = train_step(model, params, opt, micro, tc, dist, autocast, meter,
                               phases=first_step if step == first else None)
            sched.step()
            step += 1
            if step - first <= WARMUP_STEPS:  # a sync a step: compiles and first steps, apart
                sync_device(dev)
                warmup_steps.append(time.perf_counter() - t_step)
            if step - first == 1:  # imports, the model, the compiled graphs: kept from now on
                gc_clock.freeze()  # (between steps: its count walks every object)
            if step - first == WARMUP_STEPS:
                warmup_s = time.perf_counter() - t_start - aside
                warmup_wait_s = waited[1]  # of it, waiting for batches (online: the target)
                if ttt.compiled:
                    warmup_compile = compile_stats()
                gc_warmup = gc_clock.summary()
                if dist.main:
                    log_warmup(warmup_s, warmup_steps, warmup_compile, first_step, gc_warmup)

            if step % tc.log_every == 0 or step == total:
                m = meter.read(dist, tc.ttt_decay)
                now = time.perf_counter()
                train_s = now - t_start - aside
                tok_s = m["tokens"] / max(train_s - train_s_log, 1e-9)
                tokens_total += m["tokens"]
                train_s_log = train_s
                rates.append(tok_s)
                m.update(step=step, epoch=step / steps_per_epoch, split="train",
                         lr=sched.get_last_lr()[0], grad_norm=float(gnorm),
                         tokens_per_s=round(tok_s, 1), elapsed_s=round(train_s, 3),
                         data_wait_s=round(waited[0], 3), gc_s=round(gc_clock.interval(), 3),
                         time=time.time())
                waited[0] = 0.0
                if ttt.compiled:  # a recompilation storm shows as a count that keeps rising
                    m["graphs"] = compiled_graphs()
                if cuda:
                    m["mem_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
                    # the caching allocator's cudaMalloc calls so far: still rising mid-run, the
                    # steps still wait on new memory (later intervals ran faster)
                    m["cuda_mallocs"] = torch.cuda.memory_stats(dev).get("segment.all.allocated")
                if dist.main:
                    eta = (total - step) * (now - t_start) / max(step - first, 1)
                    log.info("%s", fmt_line("train", step, total, m,
                                            f" | lr {m['lr']:.2e} | gnorm {m['grad_norm']:.2f} "
                                            f"| {tok_s / 1e3:.1f}k tok/s | eta {eta / 60:.1f}m"))
                    metrics.write(m)
                    if tb:
                        tb_write(tb, "train", step, m)
                last_train = m
            # a chunk's last step is saved too (its shards go once a checkpoint covers them),
            # for a resume only: validation keeps the configured cadence
            boundary = chunks is not None and step in chunks.ends
            regular = step % tc.save_every == 0 or step == total
            save = regular or boundary
            evaluating = val_src is not None and ((tc.eval_every and step % tc.eval_every == 0)
                                                  or regular)
            if evaluating or save:  # the steps queued so far count as training time
                sync_device(dev)
            t_aside = time.perf_counter()
            if evaluating:
                val = evaluate(model, val_src, dist, drafter, head, tc, B, T, fused, autocast,
                               obj)
                val.update(step=step, split="val", time=time.time())
                last_val = val
                if dist.main:
                    log.info("%s", fmt_line("val", step, total, val))
                    metrics.write(val)
                    if tb:
                        tb_write(tb, "val", step, val)
            if save:
                state = {"step": step, "epoch": step // steps_per_epoch,
                         "epoch_step": step % steps_per_epoch, "micro_batch": step * per_step,
                         "val": val if val is not None and val["step"] == step else None,
                         "train": last_train, "scheduler": sched.state_dict(),
                         "world_size": dist.world, "grad_accum": tc.grad_accum,
                         "drafter_config": drafter.cfg.to_dict(),
                         "objective": trained_with(tc, obj),  # + tokens not logged yet:
                         "tokens_seen": seen0 + tokens_total + int(all_sum(
                             meter.sums[5, 0].clone(), dist))}
                state["invocations"] = history + [invocation(
                    first, step, t0, time.perf_counter() - t_start - aside,
                    state["tokens_seen"] - seen0, chunks)]
                save_checkpoint(run, dist, step, drafter, ttt, opt, fsdp, state)
                if dist.main:
                    prune_checkpoints(run, tc.keep_checkpoints, transient)
            if boundary:  # every rank is past the chunk: delete it, make or await the next
                sync_device(dev)
                chunks.finished(step)
            aside += time.perf_counter() - t_aside
    finally:
        if gc_clock is not None:
            gc_clock.close()
        if chunks is not None:  # a loader waiting for a chunk stops waiting
            chunks.close()
        feed.close()  # its threads end here, not at the interpreter's exit
        if metrics:
            metrics.close()
        if tb:
            tb.close()
    elapsed = time.perf_counter() - t_start
    best = best_checkpoint(run)
    runs = history + [invocation(first, step, t0, train_s_log, tokens_total, chunks)]
    return {
        "invocations": runs, "totals": {k: round(sum(r.get(k) or 0 for r in runs), 1) for k in
                                        ("seconds", "train_s", "tokens", "chunks_made", "loads")},
        "counts": {"steps": step, "epochs": round(step / steps_per_epoch, 3),
                   "train_samples": len(train_src), "train_tokens": sum(train_src.lengths),
                   "val_samples": len(val_src) if val_src is not None else 0,
                   "tokens_seen": seen0 + tokens_total,
                   "truncated_samples": sum(n > T for n in train_src.lengths),
                   "dropped_micro_batches_per_epoch": n_micro - steps_per_epoch * per_step},
        "final_step": step, "train": last_train if step > first else None, "val": last_val,
        "tokens_per_s": round(tokens_total / max(elapsed, 1e-9), 1) if step > first else None,
        **throughput(tokens_total, train_s_log, rates, warmup_s),
        "warmup_data_wait_s": round(warmup_wait_s, 2) if warmup_wait_s is not None else None,
        "warmup_compile": warmup_compile,
        "warmup_steps_s": [round(t, 3) for t in warmup_steps] or None,
        "warmup_first_step_s": {k: round(v, 3) for k, v in first_step.items()} or None,
        "warmup_gc": gc_warmup, "gc": gc_clock.summary(), "setup_s": round(setup_s, 3),
        "setup_parts_s": setup_parts,
        "drafter_config": drafter.cfg.to_dict(), "attention": attention,
        "objective": trained_with(tc, obj),
        "world_size": dist.world, "fsdp": fsdp, **({"precompile": compiled} if compiled else {}),
        "last_checkpoint": str(run.checkpoints()[-1]) if run.checkpoints() else None,
        "best_checkpoint": str(best) if best else None,
    }


def invocation(first: int, step: int, t0: float, train_s: float, tokens: int, chunks) -> dict:
    """One invocation of train in the manifest's "invocations" (kept in each checkpoint, so a
    resumed train reports every one up to its checkpoint): its steps, seconds since it started
    (set-up included), seconds of train steps, tokens, and the chunks it made and target loads
    it took (in one process)."""
    made = getattr(getattr(chunks, "produce", None), "stats", None) or {}
    return {"from_step": first, "to_step": step, "seconds": round(time.perf_counter() - t0, 1),
            "train_s": round(train_s, 1), "tokens": int(tokens),
            "chunks_made": made.get("chunks", 0), "loads": made.get("loads", 0)}


def log_warmup(seconds: float, steps: list[float], c: dict | None, first: dict,
               gcs: dict | None = None) -> None:
    """The warm-up in the log (where it goes): its seconds, each step's, the first
    step's parts, Python's garbage collections in it (GcClock), and on the compiled path what
    compiling took, graph by graph (compile_stats)."""
    log.info("train: warm-up (the first %d steps) %.1f s%s", WARMUP_STEPS, seconds,
             "" if c is None else f", of it compiling {c['seconds']:.1f} s: {c['graphs']} "
             f"graphs, Inductor's cache {c['fx_graph_cache']['hits']} hits / "
             f"{c['fx_graph_cache']['misses']} misses")
    log.info("train: warm-up steps (s): %s", " ".join(f"{t:.2f}" for t in steps))
    if first:
        log.info("train: first step (s): %s", ", ".join(f"{k} {v:.2f}" for k, v in first.items()))
    if gcs is not None:
        log.info("train: garbage collections in the warm-up: %.2f s (%d / %d / %d by generation, "
                 "full ones %.2f s)%s", gcs["seconds"], *gcs["collections"],
                 gcs["seconds_by_generation"][2],
                 f", {gcs['frozen_objects']:,} objects frozen after the first step"
                 if gcs["freeze"] else ", nothing frozen")
    frames = [f for f in (c or {}).get("frames", ())  # a loaded graph's first run: ~0 s
              if f["pass"] != "first run" or f["seconds"] >= 0.005]
    if frames:
        log.info("train: compiles (s): %s", ", ".join(
            f"{f['graph']}{'' if f['pass'] == 'forward' else ' ' + f['pass']} {f['seconds']:.2f}"
            for f in frames))
    if c is not None and c.get("saved"):
        log.info("train: saved graphs (s): %s", ", ".join(
            f"{r['graph']} {r['result']} {r['seconds']:.2f}" for r in c["saved"]))


@torch.no_grad()
def evaluate(model, src: Source, dist: Dist, drafter, head, tc, B, T, fused, autocast,
             obj) -> dict:
    """Metrics over the validation split (capped by train.eval_batches), spread over ranks;
    every rank runs the same number of forwards (FSDP needs it), the spare ones empty."""
    rows = pack(src.lengths, T, tc.seed)
    mbs = [rows[a:a + B] for a in range(0, len(rows), B)][:tc.eval_batches or None]
    meter = Meter(positions(tc), dist.device, obj)
    for j in range(math.ceil(len(mbs) / dist.world)):
        i = j * dist.world + dist.rank  # past the end: a repeat whose numbers are dropped
        hb = host_batch(src, mbs[min(i, len(mbs) - 1)], B, T, tc, drafter.embed_tokens.weight)
        d = device_batch(hb, dist.device, head, fused)
        with autocast:
            out = model(**model_inputs(d))
        if i < len(mbs):
            meter.add(out, d)
    return meter.read(dist, tc.ttt_decay)


# -------------------------------------------------------------------------------------- main
def main(cfg, produce=None, chunk: int | None = None) -> dict:
    """Features in chunks (max_disk_gib; drafter/train/chunks.py): `produce` makes a
    chunk in this process (drafter/run/chunked.py hands it over), and with the target in vLLM
    here each chunk trains in a child process on every GPU (chunks.conduct); without, a
    producer elsewhere fills the spool. `chunk`: such a child, which trains up to the end of
    that chunk."""
    if produce is not None and trains_apart(cfg):
        return _producer_stats(conduct(cfg, produce), produce)
    dist = dist_env()
    try:
        return _producer_stats(_main(cfg, dist, produce, chunk), produce)
    finally:
        close_dist()


def _producer_stats(out: dict, produce) -> dict:
    """The figures of the chunks this process made (ChunkProducer.stats: target loads, vLLM's
    wakes, their seconds), in the manifest's "chunks"."""
    if "chunks" in out and getattr(produce, "stats", None):
        out["chunks"]["producer"] = dict(produce.stats)
    return out


def _chunked(cfg, run: Run, dist: Dist, produce, chunk: int | None):
    """Features stored a chunk at a time (drafter/train/chunks.py): val and the head from
    extract/, the chunk plan written to the spool. -> (layer ids, head, train source, val
    source, Chunks)."""
    vr = store.Reader(run, "val")
    window = 1 if produce is not None or chunk is not None else 2  # one process at a time
    plan, ids, lengths = plan_run(cfg, run, vr.info, dist.world, window)
    if dist.main:
        spool.write_plan(run, plan)
    feed = Chunks(run, plan, ids, lengths, dist, vr.info, produce, only=chunk)
    return vr.info["layer_ids"], vr.head(), feed.source, \
        Source.offline(vr) if len(vr) else None, feed


def _main(cfg, dist: Dist, produce=None, chunk: int | None = None) -> dict:
    t0 = time.perf_counter()
    setup = Phases({}, dist.device)  # where the setup goes: setup_parts_s
    run, tc = Run.of(cfg), cfg.train
    _check(tc)
    d2t, t2d, _ = tokens.load_vocab(run.require(run.vocab(), "vocab"))
    setup.tick("vocab")
    target_config = target.load_config(cfg.target)
    setup.tick("target_config")
    chunks = None
    if tc.online:
        from drafter.features.capture import load_capture
        cap = load_capture(cfg, device=str(dist.device))
        layer_ids, head = cap.layer_ids, cap.head
        train_src = Source.online(run.require(run.tokens("train"), "tokenize"), cap)
        val_path = run.tokens("val")
        val_src = Source.online(val_path, cap) if val_path.exists() and \
            tokens.num_rows(val_path) else None
    elif cfg.max_disk_gib is not None:
        layer_ids, head, train_src, val_src, chunks = _chunked(cfg, run, dist, produce, chunk)
    else:
        reader = store.Reader(run, "train")
        layer_ids, head = reader.info["layer_ids"], reader.head()
        train_src = Source.offline(reader)
        val_src = None
        if run.shard_index("val").exists():
            vr = store.Reader(run, "val")
            val_src = Source.offline(vr) if len(vr) else None
    setup.tick("capture" if tc.online else "store")
    # from the target's files in both modes: the same table
    embeddings = target_embeddings(cfg.target)
    setup.tick("embeddings")
    drafter = build_drafter(cfg, target_config, layer_ids, d2t, t2d, embeddings, head)
    setup.tick("drafter")
    try:
        with compiles_hold(cap.lock) if tc.online else contextlib.nullcontext():
            out = fit(cfg, run, dist, drafter, train_src, val_src, head, t0, setup, chunks)
    finally:
        if chunks is not None:
            chunks.close()
    out["target"] = target.resolve(cfg.target.model)
    if chunks is not None:
        p = chunks.plan
        out["chunks"] = {"count": chunks.n, "plan": p["id"], "window": p["window"],
                         "chunk_limit_bytes": p["limit"], "spool": str(run.spool()),
                         "made_here": sorted(chunks.made)}
    return out
