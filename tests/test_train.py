"""The train step on CPU: the alignment at the assistant boundary, packing, loss falling on a few
samples, resume == uninterrupted, checkpoints and metrics (tiny random Llama, samples captured in
memory); then on SmolLM2 behind the real prepare/tokenize/vocab/extract steps: `torchrun` with
2 gloo ranks × batch b == 1 rank × accumulation 2 (DDP and FSDP2), and offline == online."""
from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from drafter.core import config as C
from drafter.core import target
from drafter.core.dist import Dist
from drafter.core.rundir import Run, read_json, read_jsonl
from drafter.core.weights import target_embeddings
from drafter.features.capture import Capture
from drafter.steps import train
from drafter.train import batches
from drafter.train.losses import objective
from tests.tiny import make_tiny

VOCAB, VD = 512, 256


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------- the alignment
def test_alignment_trains_the_first_assistant_token():
    """docs/internals.md: position t sees aux[t] and token t+1 and learns the teacher at t+1 (the
    distribution of token t+2); it counts when loss_mask[t+2] == 1. So the first assistant token
    a is a target (position a-2), and a prompt token never is."""
    lm = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 0]])        # prompt 0..3, assistant 4..6, then 7
    seq = torch.zeros(1, 8, dtype=torch.long)
    a = batches.align(seq, lm, torch.ones(1, 8, dtype=torch.bool), steps=3, decay=0.8)
    step0 = [r for r, s in zip(a["rows"].tolist(), a["row_step"].tolist()) if s == 0]
    assert step0 == [2, 3, 4]                             # predicts tokens 4, 5, 6
    assert a["src"][0, 0, 2] == 3 and a["trows"][0] == 3  # embeds token 3, teacher row 3
    # step i shifts tokens and targets by i more: step 1 at position 2 predicts token 5
    step1 = [r - 8 for r, s in zip(a["rows"].tolist(), a["row_step"].tolist()) if s == 1]
    assert step1 == [1, 2, 3] and a["src"][1, 0, 2] == 4
    assert a["weights"].tolist() == pytest.approx([1.0] * 3 + [0.8] * 3 + [0.64] * 3)
    assert a["n_valid"].tolist() == [3, 3, 3] and a["n_lm"].tolist() == [3, 3, 3]


def test_alignment_respects_samples_and_vocab():
    seq = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, -1, -1]])
    lm = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 0, 0]])
    inv = torch.ones(1, 10, dtype=torch.bool)
    inv[0, 5] = False                                # teacher argmax at 5 not in the draft vocab
    a = batches.align(seq, lm, inv, steps=2, decay=0.5)
    rows = [(s, r % 10) for r, s in zip(a["rows"].tolist(), a["row_step"].tolist())]
    # step 0: sample 0 positions 0,1 (targets 2,3); sample 1 positions 4,5 but 4 uses teacher 5
    assert rows == [(0, 0), (0, 1), (0, 5), (1, 0), (1, 4)]
    assert a["n_lm"].tolist() == [4, 2] and a["n_valid"].tolist() == [3, 2]


def test_pack_and_collate_restart_positions():
    lengths = [5, 3, 7, 2, 8]
    rows = batches.pack(lengths, 8, seed=0)
    assert sorted(i for r in rows for i in r) == list(range(5))
    assert all(sum(min(lengths[i], 8) for i in r) <= 8 for r in rows)
    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.arange(n) + 10 * j, "loss_mask": torch.ones(n, dtype=torch.long),
                "in_vocab": torch.ones(n, dtype=torch.bool),
                "aux": torch.randn(n, 3, 4, generator=g).to(torch.bfloat16),
                "teacher_hidden": torch.zeros(n, 4, dtype=torch.bfloat16)}
               for j, n in enumerate([3, 4, 12])]
    b = batches.collate([[samples[0], samples[1]], [samples[2]]], B=3, T=8)
    assert b["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert b["seq_id"][0].tolist() == [0, 0, 0, 1, 1, 1, 1, -1]
    assert b["input_ids"][1].tolist() == list(range(20, 28))   # a long sample keeps its head
    assert (b["seq_id"][2] == -1).all()                         # a missing row is padding
    assert torch.equal(b["aux"][0, 3:7], samples[1]["aux"])


# ----------------------------------------------------------------------------- a tiny world
def _token_rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(14, 40, (1,), generator=g))
        p = int(torch.randint(3, 8, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (L,), generator=g).tolist()
        out.append({"id": f"s{seed}-{i:03d}", "input_ids": ids,
                    "loss_mask": [0] * p + [1] * (L - p)})
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny random Llama target (8 layers, vocab 512) saved as an HF folder, a draft vocab of
    its 256 lowest ids, token files with random conversations, and the per-sample dicts
    captured from the target (offline samples)."""
    root = tmp_path_factory.mktemp("train-world")
    # a large init range gives peaked next-token distributions: something to learn
    tdir = make_tiny("llama", root, vocab_size=VOCAB, num_hidden_layers=8, initializer_range=0.6)
    rows = {"train": _token_rows(24, 0), "val": _token_rows(6, 1)}
    d2t = torch.zeros(VD, dtype=torch.long)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[:VD] = True
    tcfg = C.TargetConfig(model=str(tdir))
    model = target.load_model(tcfg, device="cpu")
    cap = Capture(model, None, d2t, t2d, teacher="hidden")
    captured = {s: cap(r) for s, r in rows.items()}
    return SimpleNamespace(tdir=tdir, rows=rows, d2t=d2t, t2d=t2d, model=model, cap=cap,
                           captured=captured, layer_ids=cap.layer_ids)


def cfg_for(world, run_dir, *overrides):
    return C.load(None, [f"run_dir={run_dir}", f"target.model={world.tdir}",
                         "train.max_length=64", "train.batch_tokens=128", "train.ttt_steps=3",
                         "train.lr=3e-3", "train.warmup_ratio=0.1", "train.log_every=1",
                         "train.eval_every=0", "train.save_every=1000", *overrides])


def drafter_for(world, cfg):
    return train.build_drafter(cfg, world.model.config, world.layer_ids, world.d2t, world.t2d,
                               world.model.get_input_embeddings().weight.detach())


def fit(world, cfg, n_train=None):
    samples = world.captured["train"][:n_train]
    return train.fit(cfg, Run.of(cfg), Dist(), drafter_for(world, cfg),
                     batches.Source.memory(samples),
                     batches.Source.memory(world.captured["val"]), world.cap.head)


def losses(run_dir, split="train"):
    return [(r["step"], r["loss"]) for r in read_jsonl(Run(run_dir).train_metrics())
            if r["split"] == split]


def test_online_groups_capture_in_fewer_forwards_and_give_the_same_batches(world):
    """train.online_group: the samples of several micro-batches go through the target in one
    capture call, whose padded forwards sort them by length across the micro-batches: fewer
    forwards, and each micro-batch is the one a call of its own builds. Groups are cut at
    run-wide micro-batch numbers, so a resumed run groups as the uninterrupted one did."""
    rows, cap = world.rows["train"], world.cap
    src = batches.Source([r["id"] for r in rows], [len(r["input_ids"]) for r in rows],
                         lambda idx: cap([rows[j] for j in idx], batch_tokens=100))
    jobs = batches.epoch_micro_batches(batches.pack(src.lengths, 64, 0), 2, 0, 0)[:4]
    tc, emb = C.TrainConfig(ttt_steps=3), world.model.get_input_embeddings().weight.detach()
    forwards = []
    hook = cap.decoder.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        alone = [batches.host_batch(src, j, 2, 64, tc, emb) for j in jobs]
        n_alone = len(forwards)
        together = batches.host_batches(src, jobs, 2, 64, tc, emb)
    finally:
        hook.remove()
    assert len(forwards) - n_alone < n_alone, (n_alone, len(forwards) - n_alone)
    assert len(together) == 4
    for a, b in zip(alone, together):
        assert a.keys() == b.keys() and a["tokens"] == b["tokens"] > 0
        for k, v in a.items():
            if torch.is_tensor(v) and v.is_floating_point():
                # bf16 features: a rounding apart where another padded shape summed otherwise
                x, y = v.float(), b[k].float()
                assert torch.allclose(x, y, rtol=2 ** -7, atol=1e-4 * x.abs().max()), k
            elif torch.is_tensor(v):
                assert torch.equal(v, b[k]), k
    assert list(batches.grouped(range(10), 4)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert list(batches.grouped(range(6, 10), 4, start=6)) == [[6, 7], [8, 9]]   # resumed at 6


def test_prefetch_threads_hand_batches_over_in_order():
    """trainer.LOADER_THREADS: several threads build the jobs, finishing out of order (the later
    ones here sooner); next() hands them over in the jobs' order, a list per job flattened; an
    error in a job surfaces at its turn, after the batches before it; close() stops early."""
    import random
    import threading
    import time

    built = set()

    def make(job):
        time.sleep(0.002 * (5 - job % 5) + 0.001 * random.random())
        built.add(threading.current_thread().name)
        if job == 13:
            raise ValueError("job 13 is bad")
        return [(job, 0), (job, 1)]

    feed = batches.Prefetch(make, iter(range(20)), depth=3, threads=4)
    got = [feed.next() for _ in range(26)]
    assert got == [(j, h) for j in range(13) for h in (0, 1)]
    with pytest.raises(ValueError, match="job 13"):
        feed.next()
    feed.close()
    assert len(built) > 1 and all(n.startswith("train-build") for n in built)
    one = batches.Prefetch(make, iter(range(10)), threads=1)
    assert [one.next() for _ in range(20)] == [(j, h) for j in range(10) for h in (0, 1)]
    one.close()
    endless = batches.Prefetch(lambda j: [j], iter(range(10 ** 9)), depth=2, threads=3)
    assert [endless.next() for _ in range(5)] == [0, 1, 2, 3, 4]
    endless.close()
    endless.thread.join(timeout=5)
    assert not endless.thread.is_alive()


def test_prefetch_builders_keep_to_one_intra_op_thread():
    """Host builders run their torch ops on one intra-op thread each (a team per core in each
    took the cores the step needs); the main thread's count is left as it was; 0
    leaves what a new thread gets (torch's count set last)."""
    before = torch.get_num_threads()  # one: this module runs under the one_thread fixture
    torch.set_num_threads(2)
    try:
        for threads in (1, 3):
            feed = batches.Prefetch(lambda j: [torch.get_num_threads()], iter(range(6)),
                                    threads=threads)
            assert [feed.next() for _ in range(6)] == [1] * 6
            feed.close()
        assert torch.get_num_threads() == 2
        torch.set_num_threads(2)  # what a new thread takes: the count set last, by any thread
        feed = batches.Prefetch(lambda j: [torch.get_num_threads()], iter(range(2)), intra_op=0)
        assert [feed.next() for _ in range(2)] == [2] * 2
        feed.close()
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------------- learning
def test_loss_falls_when_overfitting(world, tmp_path):
    cfg = cfg_for(world, tmp_path, "train.epochs=40", "train.save_every=60")
    out = fit(world, cfg, n_train=6)
    ls = losses(tmp_path)
    first, last = sum(x for _, x in ls[:3]) / 3, sum(x for _, x in ls[-3:]) / 3
    assert last < 0.5 * first, (first, last)
    recs = [r for r in read_jsonl(Run(tmp_path).train_metrics()) if r["split"] == "train"]
    assert recs[-1]["acc"][0] > recs[0]["acc"][0] + 0.2
    assert len(recs[-1]["acc"]) == 3 and 1.0 <= recs[-1]["sim_tau"] <= 4.0
    # the manifest extras
    assert out["final_step"] == out["counts"]["steps"] == recs[-1]["step"]
    assert out["drafter_config"]["draft_vocab_size"] == VD
    assert out["val"]["sim_tau"] >= 1.0 and out["tokens_per_s"] > 0
    assert Path(out["last_checkpoint"]).name == f"step_{out['final_step']:06d}"
    # seconds of train steps only, growing; warm-up and whole run against steady state
    elapsed = [r["elapsed_s"] for r in recs]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0 and "graphs" not in recs[0]
    assert out["final_step"] >= 10 and 0 < out["warmup_s"] < elapsed[-1]
    assert 0 <= out["warmup_data_wait_s"] < out["warmup_s"]    # waiting for batches, of it
    assert out["setup_s"] > 0                                   # fit's own, before the loop
    # in parts, in the order they ran: the loader starts before the model is set up
    parts = out["setup_parts_s"]
    assert list(parts) == ["device", "plan", "loader", "model", "resume"]
    assert min(parts.values()) >= 0 and sum(parts.values()) <= out["setup_s"] + 0.005
    steps = out["warmup_steps_s"]                               # each warm-up step, apart
    assert len(steps) == 10 and min(steps) > 0
    # (steps rounded to 1 ms, warmup_s to 10 ms: the sum may pass it by 10 x 0.5 + 5 ms; a
    # busy machine may spend the rest of the warm-up between the steps)
    assert 0 < sum(steps) <= out["warmup_s"] + 0.01
    first = out["warmup_first_step_s"]                          # the first step, in parts
    assert list(first) == ["batch", "forward", "backward", "optimizer"]
    # the batch part is rounded to 1 ms and is under 0.5 ms when the loader is ahead
    assert first["batch"] >= 0 and min(first[k] for k in ("forward", "backward", "optimizer")) > 0
    # the parts lie within the step (a busy machine may spend the rest between them)
    assert 0 < sum(first.values()) <= steps[0] + 1e-3
    assert out["avg_tokens_per_s"] == pytest.approx(
        sum(r["tokens"] for r in recs) / elapsed[-1], rel=1e-2)
    assert out["avg_over_steady"] == pytest.approx(
        out["avg_tokens_per_s"] / out["steady_tokens_per_s"], rel=1e-2)
    # Python's garbage collections: per log interval, in the warm-up and in all; what was alive
    # after the first step frozen out of them, and thawed when train ends
    assert all(r["gc_s"] >= 0 for r in recs)
    assert out["gc"]["freeze"] and out["gc"]["frozen_objects"] > 10_000
    assert len(out["gc"]["collections"]) == 3   # (whether any ran depends on the allocations)
    assert sum(out["gc"]["collections"]) >= sum(out["warmup_gc"]["collections"]) >= 0
    assert out["gc"]["seconds"] >= out["warmup_gc"]["seconds"] >= 0
    from drafter.train.trainer import GcClock
    assert gc.get_freeze_count() == 0 and not any(
        isinstance(getattr(cb, "__self__", None), GcClock) for cb in gc.callbacks)


def test_gc_clock_times_collections_and_freezes_what_is_alive():
    """GcClock (train's garbage-collection figures): a full collection is counted and
    timed, an interval read resets, freeze() moves what is alive into the permanent
    generation and close() thaws it; with freeze off nothing is frozen."""
    from drafter.train.trainer import GcClock

    clock = GcClock(freeze=True)
    try:
        junk = [[] for _ in range(1000)]
        for a, b in zip(junk, junk[1:]):  # cycles only a collection frees
            a.append(b), b.append(a)
        del junk, a, b
        gc.collect()
        first = clock.summary()
        assert first["collections"][2] >= 1 and first["seconds_by_generation"][2] > 0
        assert clock.interval() > 0 and clock.interval() == 0
        clock.freeze()
        assert clock.summary()["frozen_objects"] == gc.get_freeze_count() > 1000
    finally:
        clock.close()
    assert gc.get_freeze_count() == 0 and clock._callback not in gc.callbacks
    off = GcClock(freeze=False)
    off.freeze()
    assert gc.get_freeze_count() == 0 and off.summary()["freeze"] is False
    off.close()


def test_loss_chunk_reaches_the_ttt(world, tmp_path):
    """train.loss_chunk (rows of the fast path's loss chunks; 0 sizes them by memory) is what
    the TTT runs with (fewer compiled calls a step), and a negative one is refused
    by name before any step."""
    from drafter.train import trainer

    cfg = cfg_for(world, tmp_path / "a", "train.loss_chunk=4096")
    ttt, _, _ = trainer.setup_model(drafter_for(world, cfg), cfg.train, Dist(), "sdpa",
                                   objective(cfg))
    assert ttt.loss_chunk == 4096
    with pytest.raises(C.ConfigError, match=r"train\.loss_chunk: invalid value -1"):
        fit(world, cfg_for(world, tmp_path / "b", "train.loss_chunk=-1"))


def test_throughput_summary():
    """Warm-up counted in the whole run's average, steady state = the median of the last half."""
    from drafter.train.metrics import throughput
    rates = [100.0, 900.0, 1000.0, 1100.0, 1000.0, 990.0]        # per interval; the first warms up
    out = throughput(tokens=6000, seconds=7.5, rates=rates, warmup_s=2.5)
    assert out == {"warmup_s": 2.5, "avg_tokens_per_s": 800.0, "steady_tokens_per_s": 1000.0,
                   "avg_over_steady": 0.8}
    assert throughput(0, 0.0, [], None)["avg_tokens_per_s"] is None


def test_checkpoint_layout_and_pruning(world, tmp_path):
    cfg = cfg_for(world, tmp_path, "train.max_steps=7", "train.save_every=2",
                  "train.keep_checkpoints=2")
    out = fit(world, cfg)
    run = Run(tmp_path)
    done = run.checkpoints()
    best = Path(out["best_checkpoint"])
    # the newest two, plus the best by validation sim_tau when it is older
    assert done[-2:] == [run.checkpoint(6), run.checkpoint(7)]
    assert set(done) == {run.checkpoint(6), run.checkpoint(7), best}
    vals = {p: read_json(p / "state.json")["val"]["sim_tau"] for p in done}
    assert vals[best] == max(vals.values())
    ck = run.checkpoint(7)
    assert sorted(p.name for p in ck.iterdir()) == sorted(
        ["COMPLETE", "drafter_config.json", "model.safetensors", "optimizer.pt",
         "rng.safetensors", "state.json"])
    state = read_json(ck / "state.json")
    assert state["step"] == 7 and state["val"]["step"] == 7 and len(state["val"]["acc"]) == 3
    from drafter.train.model import load_drafter
    d = load_drafter(ck)
    assert d.cfg.aux_layer_ids == world.layer_ids
    assert torch.equal(d.embed_tokens.weight, world.model.get_input_embeddings().weight)
    assert int(d.t2d.sum()) == VD
    assert not list(Path(tmp_path, "train").glob(".tmp-*"))


def test_tensorboard_is_optional(world, tmp_path):
    """train.tensorboard: events under train/tb/ when the package is there, else a clear
    error naming the extra to install (before any training)."""
    import importlib.util
    cfg = cfg_for(world, tmp_path, "train.max_steps=2", "train.tensorboard=true")
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(train.DrafterError, match=r"drafter\[tensorboard\]"):
            fit(world, cfg)
        assert not Run(tmp_path).checkpoints()
    else:
        fit(world, cfg)
        assert list(Run(tmp_path).tensorboard().glob("events.out.tfevents.*"))


@pytest.mark.parametrize("extra", [[], ["train.optimizer=muon", "train.noise=0.05"]],
                         ids=["adamw", "muon-noise"])
def test_resume_reproduces_the_uninterrupted_run(world, tmp_path, extra):
    """Run 8 steps (4 per epoch) with a checkpoint at step 3; then, in a second run directory
    holding only that checkpoint and the first run's full metrics file, resume: steps 4..8
    (mid-epoch, then across the epoch boundary) give the same losses and the same weights.
    With Muon (its momentum and AdamW's moments in one optimizer.pt) and noise on the aux
    states (drawn from the RNG the checkpoint restores) too."""
    a, b = tmp_path / "a", tmp_path / "b"
    over = ["train.epochs=2", "train.save_every=3", "train.keep_checkpoints=5",
            "train.batch_tokens=192", *extra]
    fit(world, cfg_for(world, a, *over), n_train=20)
    assert len(losses(a)) == 8 and Run(a).checkpoints()[0].name == "step_000003"
    Run(b).step_dir("train").mkdir(parents=True)
    shutil.copytree(Run(a).checkpoint(3), Run(b).checkpoint(3))
    shutil.copy(Run(a).train_metrics(), Run(b).train_metrics())  # steps 4..8 must be redone
    out = fit(world, cfg_for(world, b, *over), n_train=20)
    assert out["final_step"] == 8
    assert losses(b) == losses(a)                                    # bitwise, on CPU
    from safetensors.torch import load_file
    wa = load_file(str(Run(a).checkpoint(8) / "model.safetensors"))
    wb = load_file(str(Run(b).checkpoint(8) / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_muon_takes_the_matrices_and_adamw_the_rest(world, tmp_path):
    """train.optimizer=muon: torch's Muon on the layer's and fc's 2-D weights, AdamW on the
    norms and lm_head, in one optimizer whose state_dict round-trips (resume) and whose groups
    the LR schedule drives; muon_lr sets the Muon groups' peak."""
    from drafter.train import trainer

    cfg = cfg_for(world, tmp_path, "train.optimizer=muon", "train.muon_lr=0.02")
    ttt, _, opt = trainer.setup_model(drafter_for(world, cfg), cfg.train, Dist(), "sdpa",
                                   objective(cfg))
    names = {id(p): n for n, p in ttt.named_parameters()}
    muon = {names[id(p)] for g in opt.muon.param_groups for p in g["params"]}
    adamw = {names[id(p)] for g in opt.adamw.param_groups for p in g["params"]}
    trainable = {n for n, p in ttt.named_parameters() if p.requires_grad}
    assert muon | adamw == trainable and not muon & adamw
    assert "fc.weight" in muon and "lm_head.weight" in adamw and "norm.weight" in adamw
    assert all(ttt.get_parameter(n).ndim == 2 for n in muon)
    assert {g["lr"] for g in opt.muon.param_groups} == {0.02}
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    assert {g["lr"] for g in opt.muon.param_groups} == {0.01}       # the schedule reaches it
    for p in ttt.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    assert sum("momentum_buffer" in v for v in sd["state"].values()) == len(muon)
    assert sum("exp_avg" in v for v in sd["state"].values()) == len(adamw)
    _, _, opt2 = trainer.setup_model(drafter_for(world, cfg), cfg.train, Dist(), "sdpa",
                                   objective(cfg))
    opt2.load_state_dict(sd)
    assert opt2.muon.state is opt2.state and opt2.muon.param_groups[0] is opt2.param_groups[0]
    assert sched.get_last_lr()[0] == 0.01


def test_noise_reaches_training_only(world, tmp_path):
    """train.noise perturbs the aux states in training forwards (grad enabled), by its level
    times each state's RMS; validation (no grad) sees them as captured."""
    from drafter.train import trainer
    from drafter.train.ttt import noisy

    aux = torch.randn(2, 5, 3, 16).bfloat16() * torch.tensor([1.0, 10.0, 100.0])[:, None]
    rel = ((noisy(aux, 0.1) - aux).float().pow(2).mean((0, 1, 3)).sqrt()
           / aux.float().pow(2).mean((0, 1, 3)).sqrt())
    assert torch.allclose(rel, torch.full((3,), 0.1), rtol=0.25)   # relative, per layer
    out = {}
    for level in (0.0, 0.5):
        cfg = cfg_for(world, tmp_path / str(level), f"train.noise={level}")
        ttt, _, _ = trainer.setup_model(drafter_for(world, cfg), cfg.train, Dist(), "sdpa",
                                   objective(cfg))
        d = batches.device_batch(batches.host_batch(
            batches.Source.memory(world.captured["train"]), [[0], [1]], 2, 64, cfg.train,
            world.model.get_input_embeddings().weight.detach()), torch.device("cpu"),
            world.cap.head, False)
        torch.manual_seed(0)
        train_loss = ttt(**batches.model_inputs(d))["loss"]
        with torch.no_grad():
            val_loss = ttt(**batches.model_inputs(d))["loss"]
        out[level] = float(train_loss.detach()), float(val_loss)
    assert out[0.5][0] != out[0.0][0] and out[0.5][1] == out[0.0][1] == out[0.0][0]


def test_train_log_shows_acceptance_at_each_served_temperature(world, tmp_path, caplog):
    """With evaluate.temperatures [0, 0.7, 1] and a loss at T = 0.5, every train and val record
    holds the acceptance per TTT step at 0.5 and 0.7 and the simulated tau at each temperature
    (0 and 1 being acc and accept, as before); the log line shows them; the checkpoints and the
    manifest say what the drafter was trained with."""
    import logging
    cfg = cfg_for(world, tmp_path, "train.max_steps=4", "train.eval_every=2",
                  "evaluate.temperatures=[0.0, 0.7, 1.0]",
                  "train.loss=[{kind: kl, weight: 0.1}, {kind: tv, temperature: 0.5}]")
    with caplog.at_level(logging.INFO, logger="drafter"):
        out = fit(world, cfg)
    recs = read_jsonl(Run(tmp_path).train_metrics())
    assert {r["split"] for r in recs} == {"train", "val"}
    for r in recs:
        assert list(r["accept_t"]) == ["0.5", "0.7"] and all(len(x) == 3
                                                             for x in r["accept_t"].values())
        assert list(r["sim_tau_t"]) == ["0", "0.5", "0.7", "1"]
        assert r["sim_tau_t"]["0"] == r["sim_tau"] and r["sim_tau_t"]["1"] == r["sim_tau_p"]
        assert all(0 <= x <= 1 for x in r["accept_t"]["0.5"])
    assert "| T=0.5 accept " in caplog.text and "| T=0.7 accept " in caplog.text
    want = {"loss": [{"kind": "kl", "weight": 0.1, "temperature": 1.0},
                     {"kind": "tv", "weight": 1.0, "temperature": 0.5}],
            "position_weight": "decay", "optimizer": "adamw", "noise": 0.0}
    for got in (out["objective"], read_json(Run(tmp_path).checkpoint(4) / "state.json")
                ["objective"]):
        assert {k: got[k] for k in want} == want
        assert got["describe"] == "0.1·kl@T1 + tv@T0.5"


# ------------------------------------------------------------------ ranks, online and offline
REPO = Path(__file__).resolve().parents[1]


def write_pipe_config(path: Path, run_dir: Path, shared_data: Path, **train_kw) -> Path:
    import yaml
    t = {"max_length": 96, "batch_tokens": 96, "ttt_steps": 3, "lr": 1e-3, "log_every": 1,
         "eval_every": 2, "save_every": 1000, "max_steps": 4, **train_kw}
    path.write_text(yaml.safe_dump({
        "run_dir": str(run_dir),
        "prepare": {"sources": [{"path": str(shared_data / "train/sharegpt_dummy_conversation"
                                             ".json"), "max_samples": 40}], "val_fraction": 0.2},
        "generate": {"enabled": False},
        "tokenize": {"max_length": 96, "workers": 1},
        "vocab": {"draft_vocab_size": 1024},
        "extract": {"shard_tokens": 1024, "batch_tokens": 512},
        "train": t}))
    return path


@pytest.fixture(scope="module")
def pipe(tmp_path_factory, smollm2_dir, shared_data):
    """SmolLM2 through the real prepare (ShareGPT file), tokenize, vocab and extract steps."""
    from drafter.run import pipeline
    d = tmp_path_factory.mktemp("train-pipe")
    cfg = C.load(write_pipe_config(d / "cfg.yaml", d / "run", shared_data))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipeline.run_all(cfg, steps=["prepare", "generate", "tokenize", "vocab", "extract"])
    finally:
        torch.set_num_threads(threads)
    return SimpleNamespace(dir=d, run=d / "run", shared=shared_data)


def copy_run(pipe, dst: Path, steps=("prepare", "generate", "tokenize", "vocab", "extract")):
    dst.mkdir(parents=True)
    for step in steps:
        shutil.copytree(pipe.run / step, dst / step)
    return dst


def train_records(run_dir, split="train"):
    return [r for r in read_jsonl(Run(run_dir).train_metrics()) if r["split"] == split]


def pythonpath() -> str:
    """The repo first, then the caller's PYTHONPATH (where a GPU machine stages wheels)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)


def cli(args, nproc=1, env=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}), "PYTHONPATH": pythonpath()}
    cmd = [sys.executable, "-m", "drafter.cli", *args] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1", f"--master-port={_free_port()}", "-m", "drafter.cli", *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# past the warm-up (10 steps), which only the main rank logs
TWO_RANK_STEPS = {"max_steps": 12, "eval_every": 6}


@pytest.fixture(scope="module")
def one_rank(pipe, tmp_path_factory):
    """The reference: `drafter train` in 1 process with grad_accum 2 (offline shards)."""
    d = tmp_path_factory.mktemp("one-rank")
    run = copy_run(pipe, d / "run")
    cfg = write_pipe_config(d / "cfg.yaml", run, pipe.shared, grad_accum=2, **TWO_RANK_STEPS)
    cli(["train", str(cfg)])
    return run


@pytest.mark.parametrize("fsdp", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["ddp", "fsdp"])
def test_two_ranks_equal_one_rank_with_accumulation(pipe, one_rank, tmp_path, fsdp):
    """`torchrun --nproc-per-node 2 -m drafter.cli train`, 2 gloo ranks × 1 row each == 1
    process × grad_accum 2: same losses, metrics and final weights; DDP and FSDP2. Both run
    past the warm-up, which only the main rank logs."""
    run = copy_run(pipe, tmp_path / "run")
    cfg = write_pipe_config(tmp_path / "cfg.yaml", run, pipe.shared, fsdp=fsdp,
                            **TWO_RANK_STEPS)
    cli(["train", str(cfg)], nproc=2)
    # the process's setup before the loop (the store, the target's files, the model) timed
    assert all(Run(r).read_manifest("train")["setup_s"] > 0 for r in (one_rank, run))
    parts = Run(run).read_manifest("train")["setup_parts_s"]  # the step's own parts first
    assert list(parts)[:5] == ["vocab", "target_config", "store", "embeddings", "drafter"]
    m1, m2 = train_records(one_rank), train_records(run)
    assert len(m1) == len(m2) == 12
    assert [r["tokens"] for r in m1] == [r["tokens"] for r in m2]
    assert [r["positions"] for r in m1] == [r["positions"] for r in m2]
    for a, b in zip(m1, m2):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["acc"] == pytest.approx(b["acc"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    v1, v2 = train_records(one_rank, "val"), train_records(run, "val")
    assert [r["step"] for r in v1] == [r["step"] for r in v2] == [6, 12]
    assert v1[-1]["loss"] == pytest.approx(v2[-1]["loss"], rel=1e-5)
    from safetensors.torch import load_file
    w1 = load_file(str(Run(one_rank).checkpoint(12) / "model.safetensors"))
    w2 = load_file(str(Run(run).checkpoint(12) / "model.safetensors"))
    assert w1.keys() == w2.keys()
    for k in w1:
        assert torch.allclose(w1[k].float(), w2[k].float(), rtol=1e-4, atol=1e-6), k
    m = read_json(Run(run).manifest("train"))
    assert m["world_size"] == 2 and m["fsdp"] == fsdp and m["final_step"] == 12
    assert len(m["warmup_steps_s"]) == 10


def test_offline_equals_online(pipe, tmp_path):
    """The same config trained from extract's shards and with the target running beside the
    drafter (train.online: extract stores nothing) gives the same losses, metrics and weights."""
    from drafter.run import pipeline
    off = copy_run(pipe, tmp_path / "off")
    on = copy_run(pipe, tmp_path / "on", steps=("prepare", "generate", "tokenize", "vocab"))
    cfg_off = C.load(write_pipe_config(tmp_path / "off.yaml", off, pipe.shared))
    cfg_on = C.load(write_pipe_config(tmp_path / "on.yaml", on, pipe.shared, online=True))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m_off = pipeline.run_step(cfg_off, "train")
        pipeline.run_step(cfg_on, "extract")
        assert not list(Run(on).step_dir("extract").glob("*/shard_*"))
        m_on = pipeline.run_step(cfg_on, "train")
    finally:
        torch.set_num_threads(threads)
    a, b = train_records(off), train_records(on)
    assert len(a) == len(b) == 4 and sum(r["positions"] for r in a) > 40
    for x, y in zip(a + train_records(off, "val"), b + train_records(on, "val")):
        assert (x["step"], x["tokens"], x["positions"]) == (y["step"], y["tokens"], y["positions"])
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4)
        assert x["acc"] == pytest.approx(y["acc"], abs=1e-3)
    assert m_off["drafter_config"] == m_on["drafter_config"]
    assert m_off["counts"]["train_tokens"] == m_on["counts"]["train_tokens"]
    from safetensors.torch import load_file
    w_off = load_file(str(Run(off).checkpoint(4) / "model.safetensors"))
    w_on = load_file(str(Run(on).checkpoint(4) / "model.safetensors"))
    # capture batches samples differently online than extract did, so the features can differ
    # by a bf16 rounding here and there; Adam turns that into a visible step only where the
    # gradient is ~0: under 0.1% of the elements, each by less than one lr-sized step (1e-3;
    # the largest measured: 5e-4 in fc.weight, torch 2.13 CPU, 2026-12-01).
    for k in w_off:
        d = (w_off[k].float() - w_on[k].float()).abs()
        assert d.max() < 1e-3 and (d > 1e-5).float().mean() < 1e-3, k


# -------------------------------------------------- precompile: train's graphs before train
def _meta(d: dict) -> dict:
    """name -> (dtype, shape) of a batch's model inputs; the loss rows' count (N, dim 0 of rows,
    trows, weights) is left out: it differs from batch to batch, and its graph is dynamic."""
    out = {}
    for k, v in batches.model_inputs(d).items():
        for name, t in (v.items() if isinstance(v, dict) else [(k, v)]):
            dyn = k in ("rows", "trows", "weights")
            out[name if k != "teacher" else f"teacher.{name}"] = \
                (t.dtype, t.device, tuple(t.shape)[1:] if dyn else tuple(t.shape), t.ndim)
    return out


def test_precompile_batches_look_like_trains_batches(pipe):
    """The precompile process's random micro-batches reach the model as the real ones do: the
    same names, dtypes, devices and shapes (Inductor's cache keys hold these, not the values),
    from a store of extract's shards; and its steps run (on the CPU, nothing compiles)."""
    from drafter.features import store
    from drafter.train import precompile
    cfg = C.load(write_pipe_config(pipe.dir / "cfg.yaml", pipe.run, pipe.shared))
    dev = torch.device("cpu")
    S = precompile.setup(cfg, dev)
    src = batches.Source.offline(store.Reader(Run(pipe.run), "train"))
    rows = batches.pack(src.lengths, S["T"], 0)
    real = batches.host_batch(src, rows[: S["B"]], S["B"], S["T"], S["tc"],
                              S["drafter"].embed_tokens.weight)
    for fused in (False, True):  # sdpa's dense teacher, flex's top-k or dense
        a = _meta(batches.device_batch(real, dev, S["head"], fused))
        b = _meta(batches.device_batch(precompile.random_batch(cfg, S, 0), dev, S["head"],
                                       fused))
        assert a == b
    assert precompile.applies(cfg, dev) == "train compiles only on a GPU"
    from drafter.train.trainer import compiled_graphs
    before = compiled_graphs()  # process-wide: other tests in this process may have compiled
    out = precompile.run_steps(cfg, dev)
    assert out["graphs"] == before and out["steps"] == precompile.OPTIMIZER_STEPS
    # the modules it trained are the drafter this config trains: the same shapes
    m = train.build_drafter(cfg, target.load_config(cfg.target),
                            store.Reader(Run(pipe.run), "train").info["layer_ids"],
                            *_vocab(pipe.run),
                            target_embeddings(cfg.target))
    assert {k: v.shape for k, v in m.state_dict().items()} == \
        {k: v.shape for k, v in S["drafter"].state_dict().items()}


def test_precompile_topk_batches_look_like_captured_ones(world, tmp_path):
    """The same for a top-k teacher, against samples the capture made in memory (the contract's
    dtypes, as train's offline batches are once widened): the fused loss's ids and log-probs."""
    from drafter.data import tokens
    from drafter.train import precompile
    cfg = cfg_for(world, tmp_path / "run", "extract.teacher=topk", "extract.topk=8")
    tokens.save_vocab(Run(tmp_path / "run").vocab(), world.d2t, world.t2d,
                      torch.ones(VOCAB, dtype=torch.long))
    dev = torch.device("cpu")
    S = precompile.setup(cfg, dev)
    cap = Capture(world.model, None, world.d2t, world.t2d, teacher="topk", topk=8)
    src = batches.Source.memory(cap(world.rows["train"][:8]))
    rows = batches.pack(src.lengths, S["T"], 0)
    real = batches.host_batch(src, rows[: S["B"]], S["B"], S["T"], S["tc"],
                              S["drafter"].embed_tokens.weight)
    for fused in (False, True):
        assert _meta(batches.device_batch(real, dev, S["head"], fused)) == _meta(
            batches.device_batch(precompile.random_batch(cfg, S, 1), dev, S["head"], fused))


def _vocab(run_dir):
    from drafter.data import tokens
    d2t, t2d, _ = tokens.load_vocab(Run(run_dir).vocab())
    return d2t, t2d


def test_extract_waits_for_its_precompile_child_and_stops_it_when_extract_fails(tmp_path):
    """finish(): a finished child's figures join extract's manifest; a child of a failed extract
    is stopped at once; one still running at the timeout is stopped and reported."""
    from drafter.train import precompile

    def handle(code: str) -> precompile.Handle:  # in a temp folder of its own, as start's
        d = Path(tempfile.mkdtemp(dir=tmp_path))
        cfg_path, result = d / "config.yaml", d / "result.json"
        cfg_path.write_text("{}")
        proc = subprocess.Popen([sys.executable, "-c", code, str(result)])
        return precompile.Handle(proc, cfg_path, result, tmp_path / "precompile.log",
                                 time.perf_counter())

    out = precompile.finish(handle(
        "import json, sys; json.dump({'graphs': 4, 'seconds': 1.5}, open(sys.argv[1], 'w'))"))
    assert out["exit"] == 0 and out["graphs"] == 4 and out["seconds"] == 1.5
    assert list(tmp_path.iterdir()) == []  # its temp folder went with its files
    t = time.perf_counter()
    out = precompile.finish(handle("import time; time.sleep(60)"), ok=False)
    assert out["exit"] != 0 and time.perf_counter() - t < 15
    out = precompile.finish(handle("import time; time.sleep(60)"), timeout=1)
    assert out["exit"] != 0 and 1 <= out["waited_s"] < 15 and "graphs" not in out
    assert precompile.finish(None) is None


_SPAWNER = """
import sys, time
from pathlib import Path
from drafter.train.precompile import spawn
p = spawn([sys.executable, "-c", "import time; time.sleep(120)"], Path(sys.argv[1]))
print(p.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie that no init has reaped yet counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_precompile_child_dies_with_extract_and_reports_on_the_cpu(tmp_path):
    """The process extract spawns (precompile.spawn) gets SIGTERM from the kernel when extract
    dies, even by kill -9: nothing it started stays on the GPU. `drafter precompile --result R`
    (extract's child) on the CPU has nothing to do, says so, and writes that into R."""
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    parent = subprocess.Popen([sys.executable, "-c", _SPAWNER, str(tmp_path / "child.log")],
                              env=env, stdout=subprocess.PIPE, text=True, cwd=REPO)
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.kill()
    parent.wait()
    for _ in range(100):
        if not _alive(child):
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the spawned process outlived its parent")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"run_dir: {tmp_path / 'run'}\n")
    p = cli(["precompile", str(cfg), "--result", str(tmp_path / "result.json")])
    if not torch.cuda.is_available():
        assert "nothing to do (train compiles only on a GPU)" in p.stderr
        assert read_json(tmp_path / "result.json") == {"skipped": "train compiles only on a GPU"}


@pytest.mark.gpu
def test_train_after_precompile_compiles_nothing(pipe, tmp_path):
    """On a GPU: extract started a precompile beside the target (its manifest's figures);
    `drafter precompile` into an empty Inductor cache, then `drafter train` in another process
    (other imports, other batches): train's warm-up finds every graph in the cache, none
    compiled again (a cold run spent 19.6 s compiling), and the layer pieces and the
    loss chunk loaded whole, not traced (drafter/train/aot.py): only FlexAttention's graphs and
    validation's no-grad ones (within this short run's warm-up) go through dynamo."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    m = Run(pipe.run).read_manifest("extract")
    assert m["precompile"]["exit"] == 0 and m["precompile"]["graphs"] >= 4, m["precompile"]
    run = copy_run(pipe, tmp_path / "run")
    cfg = write_pipe_config(tmp_path / "cfg.yaml", run, pipe.shared, **TWO_RANK_STEPS)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    cli(["precompile", str(cfg)], env=env)
    # the merge's Triton kernels (drafter/train/ttt.py: forward, backward) where Inductor keeps its
    # own (aot.share_triton_cache), and train compiles no Triton kernel at all (a first train
    # after an extract compiled the merge again: about 1 s on the H200)
    kernels = Path(os.environ.get("TRITON_CACHE_DIR") or tmp_path / "inductor" / "triton")
    compiled = {p.parent.name for p in kernels.rglob("*.json")}
    assert {p.name for p in kernels.rglob("*.json")} >= {"forward.json", "backward.json"}
    cli(["train", str(cfg)], env=env)
    assert {p.parent.name for p in kernels.rglob("*.json")} == compiled
    c = Run(run).read_manifest("train")["warmup_compile"]
    assert c["fx_graph_cache"]["misses"] == 0 and c["fx_graph_cache"]["hits"] >= 1, c
    assert [(r["graph"], r["result"]) for r in c["saved"]] == [
        ("pre", "loaded"), ("post", "loaded"), ("chunk_stats", "loaded")], c["saved"]
    assert not [f for f in c["frames"]
                if f["pass"] == "backward" and f["graph"] != "flex_attention"]


def test_drafters_triton_kernels_share_inductors_cache(tmp_path, monkeypatch):
    """share_triton_cache (trainer.device_setup on a GPU, in train and precompile alike):
    TRITON_CACHE_DIR, when unset, is Inductor's per-device Triton cache under
    TORCHINDUCTOR_CACHE_DIR; one the user set is kept; the CPU's setup leaves it alone."""
    from drafter.train import aot
    from drafter.train.trainer import device_setup
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert device_setup(SimpleNamespace(dtype="auto"), torch.device("cpu")) is None
    assert "TRITON_CACHE_DIR" not in os.environ
    aot.share_triton_cache(3)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "ind" / "triton" / "3")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    aot.share_triton_cache(0)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


def test_prune_keeps_the_newest_and_the_best(tmp_path):
    """keep_checkpoints=2 over five complete checkpoints: the two newest and the best by val
    sim_tau stay; the others are gone, leftovers included."""
    import json

    run = Run(tmp_path / "run")
    taus = {1: 1.2, 2: 1.9, 3: 1.5, 4: 1.4, 5: None}
    for step, tau in taus.items():
        d = run.checkpoint(step)
        d.mkdir(parents=True)
        (d / "state.json").write_text(json.dumps({"step": step, "val": tau and {"sim_tau": tau}}))
        (d / "COMPLETE").write_text("ok\n")
    train.prune_checkpoints(run, 2)
    assert [p.name for p in run.checkpoints()] == ["step_000002", "step_000004", "step_000005"]
    assert sorted(p.name for p in run.step_dir("train").iterdir()) == \
        ["step_000002", "step_000004", "step_000005"]
    assert train.best_checkpoint(run).name == "step_000002"


def test_compile_stats_count_what_a_compile_cost():
    """compile_stats (train's warmup_compile: where a warm-up goes) counts a new
    graph, its forward's compile seconds and then its backward's (compiled at the first
    backward), and nothing for a call that reuses the graph; the compile caches' counts are
    whole numbers (aot_eager here: no Inductor)."""
    from drafter.train.trainer import compile_stats

    def g(x):
        for _ in range(12):
            x = torch.tanh(x @ x.T) * x.sin() + x.cos()
        return x.sum()

    torch._dynamo.reset()
    before = compile_stats()
    f = torch.compile(g, backend="aot_eager")
    x = torch.randn(8, 8, requires_grad=True)
    y = f(x)
    fwd = compile_stats()
    y.backward()
    after = compile_stats()
    assert after["graphs"] == fwd["graphs"] == before["graphs"] + 1
    assert after["seconds"] > fwd["seconds"] > before["seconds"]
    # each compile by name: g's forward, then its backward
    assert [(r["graph"], r["pass"]) for r in fwd["frames"][-1:]] == [("g", "forward")]
    assert [(r["graph"], r["pass"]) for r in after["frames"][-2:]] == [
        ("g", "forward"), ("g", "backward")]
    assert len(after["frames"]) == len(before["frames"]) + 2
    assert all(r["seconds"] > 0 for r in after["frames"][-2:])
    f(x).backward()
    assert compile_stats() == after
    for cache in ("fx_graph_cache", "aot_autograd_cache"):
        assert all(isinstance(v, int) and v >= 0 for v in after[cache].values())
    # Work at a graph's first run (on a GPU, Triton autotuning its kernels) is a runtime
    # record of that graph, with no function name: the frames name it after the graph and
    # keep the next graph's names. Made as Inductor makes it: a runtime-timed span of the
    # graph, which its compiled graph's first call then records (finish).
    from torch._dynamo.utils import (
        dynamo_timed,
        get_compilation_metrics,
        get_runtime_metrics_context,
    )
    from torch._guards import CompileId

    cid = str(list(get_compilation_metrics())[-2].compile_id)                      # g's
    with dynamo_timed("CachingAutotuner.benchmark_all_configs", compile_id=CompileId
                      .from_string(cid), is_backward=False,
                      dynamo_compile_column_us="runtime_triton_autotune_time_us"):
        time.sleep(0.02)
    get_runtime_metrics_context().finish()
    h = torch.compile(lambda x: (x @ x.T).cos().sum(), backend="aot_eager")
    h(x).backward()
    frames = compile_stats()["frames"][-3:]
    assert [(r["graph"], r["pass"]) for r in frames] == [
        ("g", "first run"), ("<lambda>", "forward"), ("<lambda>", "backward")]
    assert frames[0]["seconds"] >= 0.02
    torch._dynamo.reset()


_AOT_PROBE = """
import json, torch
from drafter.train.trainer import compile_stats
from drafter.train.ttt import TTT
from tests.test_model import batch_of, make_drafter, packed_rows, run_ttt
d = make_drafter()
ttt = TTT(d, attention="sdpa", compile=True)  # inductor: pre and post hold _RMSNormFn
run_ttt(ttt, d, batch_of(packed_rows(), 24, head=torch.randn(40, 24) * 0.3))["loss"].backward()
print(json.dumps(compile_stats()["aot_autograd_cache"]))
"""


@pytest.mark.slow  # two processes compiling with Inductor on the CPU: ~75 s on two cores
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor's CPU kernels need a C++ compiler")
def test_a_second_process_reads_pre_and_post_from_aotautograds_cache(tmp_path):
    """pre and post hold a custom autograd.Function (_RMSNormFn), which AOTAutograd's on-disk
    cache refuses unless TTT allows it: a second process (a second `drafter train` on one
    machine) then reads both graphs' traced forward and backward from the cache instead of
    tracing them again (a warm warm-up's 13.5 s of compiling became 3.5 s). Train
    traces them only under FSDP now (drafter/train/aot.py)."""
    import json

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD", None)
    runs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", _AOT_PROBE], env=env, capture_output=True,
                           text=True, timeout=600, cwd=REPO, check=False)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    assert runs[0] == {"hits": 0, "misses": 2}
    assert runs[1] == {"hits": 2, "misses": 0}


# ------------------------------------------- online: target forwards and torch.compile's tracers
def _trace_while_a_module_runs(hold: bool) -> list:
    """A torch.compile backend traces with torch.fx (as inductor's subgraph lowering does) and,
    inside that trace, lets another thread run an nn.Linear (as online training's prefetch
    thread runs the target) under `lock`, waiting for it at most 0.5 s. Returns what the
    other thread's forward gave: a tensor, or the exception it raised."""
    import threading

    from drafter.train import trainer

    lock, layer, out = threading.RLock(), torch.nn.Linear(4, 4), []
    ran = threading.Event()

    def forward():
        try:
            with lock, torch.no_grad():
                out.append(layer(torch.ones(1, 4)))
        except Exception as e:  # noqa: BLE001 - what the test looks at
            out.append(e)
        ran.set()

    def traced(x):
        t = threading.Thread(target=forward)
        t.start()
        ran.wait(0.5)  # with the hold, the forward waits for the lock: the trace goes on
        return x + 1

    def backend(gm, inputs):
        torch.fx.symbolic_trace(traced)   # patches nn.Module.__call__ process-wide meanwhile
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(lambda x: x * 2, backend=backend)
    with trainer.compiles_hold(lock) if hold else contextlib.nullcontext():
        f(torch.ones(3))
    assert ran.wait(5)
    torch._dynamo.reset()
    return out


def test_a_module_called_during_an_fx_trace_fails_on_another_thread():
    """Why compiles_hold exists: torch.fx's tracer patches nn.Module.__call__ for every thread."""
    out = _trace_while_a_module_runs(hold=False)
    assert isinstance(out[0], NameError) and "not installed as a submodule" in str(out[0])


def test_compiles_hold_keeps_target_forwards_out_of_compiles():
    """With the capture's lock held over every compile, the forward waits and then runs."""
    out = _trace_while_a_module_runs(hold=True)
    assert torch.is_tensor(out[0]) and out[0].shape == (1, 4)
