"""The train step on CPU with a tiny random Llama target: the alignment at the assistant boundary,
packing, loss falling on a few samples, resume == uninterrupted, checkpoints and metrics,
2 gloo ranks × batch b == 1 rank × accumulation 2 (DDP and FSDP2 under torchrun), and online
capture == the same samples captured beforehand (offline)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from drafter import config as C
from drafter import target, tokens
from drafter.capture import Capture
from drafter.rundir import Run, read_json, read_jsonl
from drafter.steps import train

from tests.tiny import make_tiny

VOCAB, VD = 512, 256


# ------------------------------------------------------------------------------- the alignment
def test_alignment_trains_the_first_assistant_token():
    """docs/internals.md: position t sees aux[t] and token t+1 and learns the teacher at t+1 (the
    distribution of token t+2); it counts when loss_mask[t+2] == 1. So the first assistant token
    a is a target (position a-2), and a prompt token never is."""
    lm = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 0]])        # prompt 0..3, assistant 4..6, then 7
    seq = torch.zeros(1, 8, dtype=torch.long)
    a = train.align(seq, lm, torch.ones(1, 8, dtype=torch.bool), steps=3, decay=0.8)
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
    inv[0, 5] = False                                     # teacher argmax at 5 not in the draft vocab
    a = train.align(seq, lm, inv, steps=2, decay=0.5)
    rows = [(s, r % 10) for r, s in zip(a["rows"].tolist(), a["row_step"].tolist())]
    # step 0: sample 0 positions 0,1 (targets 2,3); sample 1 positions 4,5 but 4 uses teacher 5
    assert rows == [(0, 0), (0, 1), (0, 5), (1, 0), (1, 4)]
    assert a["n_lm"].tolist() == [4, 2] and a["n_valid"].tolist() == [3, 2]


def test_pack_and_collate_restart_positions():
    lengths = [5, 3, 7, 2, 8]
    rows = train.pack(lengths, 8, seed=0)
    assert sorted(i for r in rows for i in r) == list(range(5))
    assert all(sum(min(lengths[i], 8) for i in r) <= 8 for r in rows)
    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.arange(n) + 10 * j, "loss_mask": torch.ones(n, dtype=torch.long),
                "in_vocab": torch.ones(n, dtype=torch.bool),
                "aux": torch.randn(n, 3, 4, generator=g).to(torch.bfloat16),
                "teacher_hidden": torch.zeros(n, 4, dtype=torch.bfloat16)}
               for j, n in enumerate([3, 4, 12])]
    b = train.collate([[samples[0], samples[1]], [samples[2]]], B=3, T=8)
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
        out.append({"id": f"s{seed}-{i:03d}", "input_ids": ids, "loss_mask": [0] * p + [1] * (L - p)})
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


def make_run_dir(world, path: Path) -> Path:
    """A run directory with what online training reads: token files and the vocab file."""
    run = Run(path)
    for split, rows in world.rows.items():
        run.tokens(split).parent.mkdir(parents=True, exist_ok=True)
        w = tokens.TokenWriter(run.tokens(split))
        for r in rows:
            w.write(r["id"], r["input_ids"], r["loss_mask"])
        w.close()
    run.vocab().parent.mkdir(parents=True, exist_ok=True)
    tokens.save_vocab(run.vocab(), world.d2t, world.t2d, torch.zeros(VOCAB, dtype=torch.long))
    return path


def cfg_for(world, run_dir, *overrides):
    return C.load(None, [f"run_dir={run_dir}", f"target.model={world.tdir}",
                         "train.max_length=64", "train.batch_tokens=128", "train.ttt_steps=3",
                         "train.lr=3e-3", "train.warmup_ratio=0.1", "train.log_every=1",
                         "train.eval_every=0", "train.save_every=1000", *overrides])


def fit(world, cfg, n_train=None):
    samples = world.captured["train"][:n_train]
    drafter = train.build_drafter(cfg, world.model.config, world.layer_ids, world.d2t,
                                  world.t2d, world.model.get_input_embeddings().weight.detach())
    return train.fit(cfg, Run.of(cfg), train.Dist(), drafter, train.Source.memory(samples),
                     train.Source.memory(world.captured["val"]), world.cap.head)


def losses(run_dir, split="train"):
    return [(r["step"], r["loss"]) for r in read_jsonl(Run(run_dir).train_metrics())
            if r["split"] == split]


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
    from drafter.model import load_drafter
    d = load_drafter(ck)
    assert d.cfg.aux_layer_ids == world.layer_ids
    assert torch.equal(d.embed_tokens.weight, world.model.get_input_embeddings().weight)
    assert int(d.t2d.sum()) == VD
    assert not list(Path(tmp_path, "train").glob(".tmp-*"))


def test_resume_reproduces_the_uninterrupted_run(world, tmp_path):
    """Run 8 steps (4 per epoch) with a checkpoint at step 3; then, in a second run directory
    holding only that checkpoint and the first run's full metrics file, resume: steps 4..8
    (mid-epoch, then across the epoch boundary) give the same losses and the same weights."""
    a, b = tmp_path / "a", tmp_path / "b"
    over = ["train.epochs=2", "train.save_every=3", "train.keep_checkpoints=5",
            "train.batch_tokens=192"]
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


# ------------------------------------------------------------------ ranks, online and offline
RUNNER = """
import sys
from drafter import config
from drafter.cli import setup_logging
from drafter.steps import train
setup_logging()
out = train.main(config.load(sys.argv[1], sys.argv[2:]))
import json, os
if int(os.environ.get("RANK", "0")) == 0:
    print("RESULT " + json.dumps({"final_step": out["final_step"], "world": out["world_size"]}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_main(tmp_path, cfg_path, overrides, nproc=1):
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
    if nproc == 1:
        cmd = [sys.executable, str(runner)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--master-addr=127.0.0.1", f"--master-port={_free_port()}", str(runner)]
    p = subprocess.run(cmd + [str(cfg_path), *overrides], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads(p.stdout.split("RESULT ")[-1])


def write_cfg(world, path, run_dir, **train_kw):
    import yaml
    t = {"online": True, "max_length": 64, "batch_tokens": 64, "ttt_steps": 3, "lr": 3e-3,
         "log_every": 1, "eval_every": 0, "save_every": 1000, "max_steps": 5, **train_kw}
    path.write_text(yaml.safe_dump({"run_dir": str(run_dir), "target": {"model": str(world.tdir)},
                                    "train": t}))
    return path


@pytest.fixture(scope="module")
def one_rank(world, tmp_path_factory):
    """The reference: 1 process, grad_accum 2, online."""
    tmp = tmp_path_factory.mktemp("one-rank")
    one = make_run_dir(world, tmp / "run")
    r = run_main(tmp, write_cfg(world, tmp / "one.yaml", one, grad_accum=2), [])
    assert r == {"final_step": 5, "world": 1}
    return one


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_ranks_equal_one_rank_with_accumulation(world, one_rank, tmp_path, fsdp):
    """torchrun, 2 gloo ranks × 1 row each == 1 process × grad_accum 2: same losses, metrics
    and final weights (online mode: each rank captures its own micro-batches)."""
    two = make_run_dir(world, tmp_path / "two")
    r2 = run_main(tmp_path, write_cfg(world, tmp_path / "two.yaml", two, fsdp=fsdp), [], nproc=2)
    assert r2 == {"final_step": 5, "world": 2}
    m1 = [r for r in read_jsonl(Run(one_rank).train_metrics()) if r["split"] == "train"]
    m2 = [r for r in read_jsonl(Run(two).train_metrics()) if r["split"] == "train"]
    assert len(m1) == len(m2) == 5
    assert [r["tokens"] for r in m1] == [r["tokens"] for r in m2]
    for a, b in zip(m1, m2):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["acc"] == pytest.approx(b["acc"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    from safetensors.torch import load_file
    w1 = load_file(str(Run(one_rank).checkpoint(5) / "model.safetensors"))
    w2 = load_file(str(Run(two).checkpoint(5) / "model.safetensors"))
    assert w1.keys() == w2.keys()
    for k in w1:
        assert torch.allclose(w1[k].float(), w2[k].float(), rtol=1e-4, atol=1e-6), k
