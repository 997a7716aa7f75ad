"""Surviving faults: `drafter run` killed (-9, SIGTERM, Ctrl-C) at randomised points inside
generate, extract and train, then rerun: the outputs equal an uninterrupted run's (the same ids
and tokens, the same shard hashes, the same final checkpoint). A corrupt shard is redone; a full
disk is a clear error that leaves no torn file; the engine lifecycle between steps (GPU memory
back at its baseline, PIDs named, nothing killed); one drafter process per run dir; torchrun ranks
wait for rank 0's decision on the step folder.

Everything runs on CPU with a tiny random Llama (the SmolLM2 tokenizer and chat template), real
subprocesses in their own process group, one thread each (float reductions in one order, so
files compare byte for byte). The default run has one chain of kills through the three steps;
`pytest -m slow tests/test_faults.py` runs the full matrix (>= 10 kill -9 points, each resumed
on its own, with `transformers serve` as the generation server too) whose results go to
BENCHMARKS.md ("Fault matrix")."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from drafter.core import config as C
from drafter.core import gpu
from drafter.core.rundir import Run, atomic_json, atomic_write, read_json, read_jsonl
from drafter.features import store
from drafter.run import gpu_release, lifecycle, pipeline
from drafter.train import checkpoint

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
       "TOKENIZERS_PARALLELISM": "false"}
UNTIL = "train"
N_SAMPLES, MAX_STEPS = 10, 12


# ---------------------------------------------------------------------------------- the setup
def write_cfg(path: Path, run_dir: Path, model: Path, engine: str = "drafter") -> Path:
    """A deterministic tiny run: greedy answers one request at a time (no batch-dependent
    floats), small shards, a float32 train of 12 steps with checkpoints every 3."""
    path.write_text(yaml.safe_dump({
        "run_dir": str(run_dir),
        "target": {"model": str(model), "dtype": "float32", "device": "cpu"},
        "prepare": {"sources": [{"path": "builtin:quickstart-prompts",
                                 "max_samples": N_SAMPLES}], "val_fraction": 0.2},
        "generate": {"concurrency": 1, "batch_size": 1, "max_tokens": 12,
                     "server": {"engine": engine, "startup_timeout": 300, "stop_timeout": 10}},
        "tokenize": {"max_length": 128, "workers": 1},
        "vocab": {"draft_vocab_size": 256},
        "extract": {"shard_tokens": 96, "batch_tokens": 48},
        "train": {"ttt_steps": 2, "max_steps": MAX_STEPS, "save_every": 3, "keep_checkpoints": 2,
                  "batch_tokens": 128, "max_length": 64, "eval_every": 0, "log_every": 1,
                  "lr": 1e-3, "dtype": "float32", "compile": False},
    }))
    return path


def start(cfg: Path, *over: str, log: Path, until: str = UNTIL) -> subprocess.Popen:
    """`drafter run CONFIG --until train` in its own process group (what a terminal or a
    scheduler would kill as a whole)."""
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "drafter.cli", "run", str(cfg),
                                 "--until", until, *over], cwd=REPO, env=ENV, stdout=f,
                                stderr=f, start_new_session=True)


def finish(cfg: Path, *over: str, log: Path, timeout: float = 600, until: str = UNTIL) -> None:
    p = start(cfg, *over, log=log, until=until)
    try:
        rc = p.wait(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert rc == 0, log.read_text()[-4000:]


def outputs(run: Run, until: str = UNTIL) -> dict:
    """What must not change across kills, for the steps up to `until`: conversations, token
    ids, the vocab, shard hashes and the final checkpoint's tensors."""
    import pyarrow.parquet as pq
    from safetensors.torch import load_file

    upto = pipeline.STEPS[: pipeline.STEPS.index(until) + 1]
    out = {"conversations": [json.dumps(r, sort_keys=True)
                             for r in read_jsonl(run.conversations("generate"))]}
    if "tokenize" in upto:
        for split in ("train", "val"):
            t = pq.read_table(str(run.tokens(split)), columns=["id", "input_ids", "loss_mask"])
            out[f"tokens_{split}"] = t.to_pylist()
    if "vocab" in upto:
        # tensors, not file bytes: safetensors writes several metadata keys in a per-process
        # random order (the shards keep one key, so their files compare whole)
        out["vocab"] = _tensor_hashes(load_file(str(run.vocab())))
    if "extract" in upto:
        out["shards"] = {f"{s}/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest()
                         for s in ("train", "val")
                         for p in sorted(run.shards(s).glob("shard_*.safetensors"))}
        out["index_shards"] = {s: [(e["file"], e["sha256"]) for e in
                                   store.read_index(run.shard_index(s))["shards"]]
                               for s in ("train", "val")}
    if "train" in upto:
        last = run.checkpoints()[-1]
        out["checkpoint"] = (last.name, _tensor_hashes(load_file(str(last / "model.safetensors"))))
    return out


def _tensor_hashes(tensors: dict) -> dict:
    import torch

    return {k: (str(v.dtype), tuple(v.shape), hashlib.sha256(
        v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest())
        for k, v in sorted(tensors.items())}


def assert_same(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    assert got["conversations"] == ref["conversations"], "generate output differs"
    for key in ("tokens_train", "tokens_val", "vocab", "shards", "index_shards", "checkpoint"):
        if key in ref:
            assert got[key] == ref[key], f"{key} differs from the uninterrupted run"


@pytest.fixture(scope="module")
def world(tmp_path_factory, smollm2_dir):
    """The tiny target and an uninterrupted reference run (engine drafter)."""
    from tests.tiny import make_tiny

    root = tmp_path_factory.mktemp("faults")
    model = make_tiny("llama", root, tokenizer_dir=smollm2_dir)
    cfg = write_cfg(root / "ref.yaml", root / "ref", model)
    finish(cfg, log=root / "ref.log")
    ref = Run(root / "ref")
    return {"root": root, "model": model, "ref": ref, "outputs": outputs(ref)}


# ---------------------------------------------------------------------------------- kill points
@dataclass
class Point:
    step: str          # the step the kill aims at
    after: int         # progress reached in that step (conversations, shards, train steps)
    delay: float       # then wait this long (lands inside writes, loads, checkpoints)
    sig: int = signal.SIGKILL


def progress(run: Run, step: str) -> int:
    if step == "generate":
        p = run.conversations("generate")
        return p.read_bytes().count(b"\n") if p.exists() else 0
    if step == "extract":
        return sum(1 for s in ("train", "val") for _ in run.shards(s).glob("shard_*.safetensors")) \
            if run.step_dir("extract").exists() else 0
    return sum(1 for r in read_jsonl(run.train_metrics()) if r.get("split") == "train") \
        if run.train_metrics().exists() else 0


def server_pgids(run: Run) -> list[int]:
    p = run.server_log()
    return [int(x) for x in re.findall(r"pgid=(\d+)", p.read_text())] if p.exists() else []


def kill_at(cfg: Path, run: Run, point: Point, log: Path, until: str = UNTIL) -> dict:
    """Start `drafter run`, wait until `point` is reached inside its step, signal the whole
    process group. Returns where it landed: the step running then and its progress."""
    p = start(cfg, log=log, until=until)
    deadline = time.time() + 600
    try:
        while True:
            if p.poll() is not None:
                return {"landed": "finished before the kill", "rc": p.returncode}
            if run.started(point.step).exists() and not run.manifest(point.step).exists() \
                    and progress(run, point.step) >= point.after:
                break
            assert time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.02)
        time.sleep(point.delay)
        landed = next((s for s in reversed(pipeline.STEPS) if run.started(s).exists()
                       and not run.manifest(s).exists()), "between steps")
        where = {"landed": landed, "progress": progress(run, landed) if landed in
                 ("generate", "extract", "train") else None}
        os.killpg(p.pid, point.sig)
        where["rc"] = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return where


def assert_consistent_after_kill(run: Run, where: dict, sig: int) -> None:
    step = where["landed"]
    if step not in pipeline.STEPS:
        return
    assert not run.manifest(step).exists()
    state = {s["name"]: (s["state"], s["activity"]) for s in pipeline.status(run.root)["steps"]}
    assert state[step] == ("failed", "interrupted"), state
    if sig != signal.SIGKILL:
        # the handler unwound the step: failed.json says so and the exit status is 128 + signum
        assert where["rc"] == 128 + sig
        assert read_json(run.failed(step))["interrupted"] is True
    else:
        assert where["rc"] == -signal.SIGKILL
    # a server drafter started dies with it (PR_SET_PDEATHSIG), even after kill -9
    for pgid in server_pgids(run):
        t_end = time.time() + 60
        from drafter.serve.supervisor import group_alive
        while group_alive(pgid):
            assert time.time() < t_end, f"server group {pgid} outlived drafter"
            time.sleep(0.2)


# ------------------------------------------------------------------------------ the default run
def test_kill_chain_resumes_to_identical_outputs(world, tmp_path):
    """One run killed four times in a row (kill -9 of the group in generate, extract and train,
    and Ctrl-C's SIGINT in train; SIGTERM is in the slow matrix), with a finished shard corrupted
    while it lay killed; the last rerun finishes and every output equals the uninterrupted
    run's."""
    rng = random.Random(9)
    run = Run(tmp_path / "run")
    cfg = write_cfg(tmp_path / "cfg.yaml", run.root, world["model"])
    n_shards = len(world["outputs"]["shards"])
    points = [
        Point("generate", rng.randrange(1, 4), rng.uniform(0, 0.3)),
        Point("extract", rng.randrange(2, n_shards - 3), rng.uniform(0, 0.1)),
        # train resumes from its checkpoint every 3 steps and redoes the steps after it, so the
        # second train kill waits for steps beyond what the first one reached
        Point("train", rng.randrange(1, 5), rng.uniform(0, 0.1), signal.SIGINT),
        Point("train", rng.randrange(7, 10), rng.uniform(0, 0.1)),
    ]
    log = tmp_path / "drafter.log"
    matrix = []
    for pt in points:
        where = kill_at(cfg, run, pt, log)
        matrix.append((pt, where))
        assert where["landed"] == pt.step, (pt, where, log.read_text()[-3000:])
        assert_consistent_after_kill(run, where, pt.sig)
        if pt.step == "extract":
            # corrupt a shard the killed run had finished: its content hash catches it
            done = sorted(run.shards("train").glob("shard_*.safetensors"))
            victim = done[0]
            blob = bytearray(victim.read_bytes())
            blob[len(blob) // 2] ^= 0x5A
            victim.write_bytes(bytes(blob))
    finish(cfg, log=log)
    assert_same(outputs(run), world["outputs"])
    m = read_json(run.manifest("extract"))
    assert m["counts"]["shards_redone"] >= 1 and m["counts"]["shards_kept"] >= 1
    # the kill in generate landed after at least one finished conversation: kept, not redone
    # (how many depends on where the stream stood; the outputs above equal the reference's)
    assert read_json(run.manifest("generate"))["counts"]["resumed"] >= 1
    assert not list(run.root.rglob(".tmp-*")) and not run.trash_dirs()
    print("\n".join(f"{pt} -> {w}" for pt, w in matrix))


def _can_unshare() -> bool:
    if os.environ.get("DRAFTER_TEST_NO_UNSHARE"):  # exercise the RLIMIT_FSIZE path
        return False
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-Urm", "true"], capture_output=True).returncode == 0


def test_full_disk_is_a_clear_error_and_leaves_no_torn_file(world, tmp_path):
    """extract into a run dir on a tmpfs with room for about two shards (a real mount in a
    private namespace; where namespaces are off, RLIMIT_FSIZE makes a shard-sized write fail
    the same way): exit 2 with a message that says what to do, only complete files left, and
    after freeing space the rerun resumes to the reference shards."""
    ref = world["ref"]
    stage = tmp_path / "stage"
    for step in ("prepare", "generate", "tokenize", "vocab"):
        shutil.copytree(ref.step_dir(step), stage / step)
    shutil.copy(ref.config_snapshot(), stage / "config.yaml")
    shard_bytes = max(e["bytes"] for e in store.read_index(ref.shard_index("train"))["shards"])
    head_bytes = ref.extract_head().stat().st_size
    inputs = sum(p.stat().st_size for p in stage.rglob("*") if p.is_file())
    after = tmp_path / "after"
    cfg = write_cfg(tmp_path / "cfg.yaml", after, world["model"])
    cmd = [sys.executable, "-m", "drafter.cli", "run", str(cfg), "--until", "extract"]
    if _can_unshare():
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        # the inputs, extract's head, two shards, and pages for the small files
        size = (inputs + head_bytes + 2 * shard_bytes) // 4096 * 4096 + 16 * 4096
        script = (f"mount -t tmpfs -o size={size} tmpfs {mnt} && cp -a {stage}/. {mnt}/ && "
                  f"{' '.join(cmd)} run_dir={mnt} 2>{tmp_path}/err; echo $? > {tmp_path}/rc; "
                  f"cp -a {mnt}/. {after}/")
        after.mkdir()
        subprocess.run(["unshare", "-Urm", "sh", "-c", script], cwd=REPO, env=ENV, timeout=600)
        rc = int((tmp_path / "rc").read_text())
        how = "tmpfs"
    else:
        import resource

        shutil.copytree(stage, after)
        limit = shard_bytes * 3 // 4

        def cap():
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        with open(tmp_path / "err", "wb") as err:
            rc = subprocess.run(cmd, cwd=REPO, env=ENV, stderr=err, preexec_fn=cap,
                                timeout=600).returncode
        how = "RLIMIT_FSIZE"
    err = (tmp_path / "err").read_text()
    assert rc == 2, err[-3000:]
    assert re.search(r"drafter: error: (No space left on device|File too large)", err), err[-2000:]
    assert "rerun the same command to resume" in err and "Traceback" not in err
    run = Run(after)
    assert not run.manifest("extract").exists() and not run.shard_index("train").exists()
    assert not list(after.rglob(".tmp-*")), f"torn temp file left ({how})"
    kept = sorted(run.shards("train").glob("shard_*.safetensors"))
    for p in kept:   # every shard on disk is whole: its content hash verifies
        assert store.check_shard(p) is not None, p
    assert read_json(run.failed("extract"))["interrupted"] is False
    # space again: the same command resumes and gives the reference shards
    finish(cfg, log=tmp_path / "rerun.log", until="extract")
    got = {f"{s}/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest()
           for s in ("train", "val") for p in sorted(run.shards(s).glob("shard_*.safetensors"))}
    assert got == world["outputs"]["shards"]


# ------------------------------------------------------------- corruption of finished outputs
def _copy_run(ref: Run, dst: Path) -> Run:
    """The finished reference run at dst (file times kept, as `cp -a` or `mv` keep them)."""
    shutil.copytree(ref.root, dst)
    return Run(dst)


def _flip(path: Path, keep_mtime: bool = False) -> None:
    st = path.stat()
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x5A
    path.write_bytes(bytes(blob))
    if keep_mtime:  # bit rot: same size, same time; only the sha256 tells
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _states(run: Run) -> dict:
    return {s["name"]: (s["state"], s["activity"], s.get("error"))
            for s in pipeline.status(run.root)["steps"]}


def test_corrupt_shard_of_a_finished_run_is_redone_never_trained_on(world, tmp_path):
    """A flipped byte in a finished extract: status shows extract damaged (not done), `drafter
    train` refuses before touching train/ and names the shard; a shard rotted in place (same
    size and time, which only its sha256 tells) is caught when a run hashes the shards; the
    rerun redoes exactly those shards, keeps the others, and ends with the reference's shards
    and final checkpoint."""
    run = _copy_run(world["ref"], tmp_path / "run")
    cfg = write_cfg(tmp_path / "cfg.yaml", run.root, world["model"])
    bad = run.shard("train", 1)
    _flip(bad)
    st = _states(run)
    assert st["extract"][:2] == ("stale", "damaged") and bad.name in st["extract"][2]
    assert st["train"][0] == "stale" and st["tokenize"][0] == "done"
    train_before = {p: p.read_bytes() for p in run.step_dir("train").rglob("*") if p.is_file()}
    p = subprocess.run([sys.executable, "-m", "drafter.cli", "train", str(cfg)], cwd=REPO,
                       env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "which is damaged" in p.stderr and "drafter extract" in p.stderr
    assert {p: p.read_bytes() for p in run.step_dir("train").rglob("*") if p.is_file()} == \
        train_before
    rot = run.shard("val", 0)
    _flip(rot, keep_mtime=True)
    assert store.verify_extract(run) == [f"{bad} changed since extract wrote it"]
    assert f"{rot} fails its sha256" in store.verify_extract(run, full=True)
    finish(cfg, log=tmp_path / "rerun.log")
    m = read_json(run.manifest("extract"))["counts"]
    assert m["shards_redone"] == 2 and m["shards_kept"] == m["shards"] - 2
    assert_same(outputs(run), world["outputs"])
    assert [s for s, (state, _, _) in _states(run).items() if state != "done"] == \
        ["export", "evaluate"]


def test_truncated_last_checkpoint_resumes_from_the_last_intact_one(world, tmp_path):
    """A torn file in the newest checkpoint: status shows train damaged, the rerun warns and
    resumes from the checkpoint before it (with its optimizer, RNG and data position), ends
    on the reference's final weights, and counts every token in tokens_seen."""
    ref = world["ref"]
    run = _copy_run(ref, tmp_path / "run")
    cfg = write_cfg(tmp_path / "cfg.yaml", run.root, world["model"])
    last = run.checkpoints()[-1]
    f = last / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    st = _states(run)
    assert st["train"][:2] == ("stale", "damaged") and "model.safetensors" in st["train"][2]
    log = tmp_path / "rerun.log"
    finish(cfg, log=log)
    text = log.read_text()
    assert f"checkpoint {last.name} is damaged" in text and "resuming from the one before" in text
    assert_same(outputs(run), world["outputs"])
    got, want = read_json(run.manifest("train")), read_json(ref.manifest("train"))
    assert got["counts"]["tokens_seen"] == want["counts"]["tokens_seen"] > 0
    assert got["counts"]["steps"] == MAX_STEPS and got["train"]["step"] == MAX_STEPS
    # a byte rotted in place (same size and time): status cannot see it, a run hashes it
    last = run.checkpoints()[-1]
    _flip(last / "optimizer.pt", keep_mtime=True)
    assert _states(run)["train"][0] == "done"
    finish(cfg, log=log)
    assert "optimizer.pt fails its sha256" in log.read_text()
    assert_same(outputs(run), world["outputs"])
    assert checkpoint.verify_checkpoint(run.checkpoints()[-1]) is None


def test_damaged_generate_output_keeps_the_good_records_after_it(world, tmp_path):
    """A partial generate/conversations.jsonl with a line of garbage and a 0xff byte in the
    middle, and a torn last line: the rerun keeps every good record, before and after the
    damage, regenerates only the damaged ones, and ends with the reference's conversations."""
    ref = world["ref"]
    run_dir = tmp_path / "run"
    _prestate(ref, run_dir, "generate")
    run = Run(run_dir)
    cfg = write_cfg(tmp_path / "cfg.yaml", run_dir, world["model"])
    lines = ref.conversations("generate").read_bytes().splitlines(keepends=True)
    assert len(lines) == N_SAMPLES
    lines[2] = b'{"id": "not json\n'
    lines[5] = lines[5].replace(b'"content": "', b'"content": "\xff', 1)
    out = lines[:-1] + [lines[-1][:20]]            # the last one torn by a kill
    run.step_dir("generate").mkdir()
    run.conversations("generate").write_bytes(b"".join(out))
    fp = pipeline.fingerprint(C.load(cfg), run, "generate")
    atomic_json(run.started("generate"), {"fingerprint": fp, "time": time.time()})
    finish(cfg, log=tmp_path / "rerun.log", until="generate")
    m = read_json(run.manifest("generate"))["counts"]
    assert (m["resumed"], m["generated"], m["ok"]) == (N_SAMPLES - 3, 3, N_SAMPLES)
    assert run.conversations("generate").read_bytes() == ref.conversations("generate")\
        .read_bytes()


# ---------------------------------------------------------------- the lifecycle between steps
def _gpu(index=0, used=0, procs=()):
    total = 80 * gpu.GiB
    return gpu.Gpu(index, "H100", f"GPU-{index}", total, total - used, used,
                   [gpu.GpuProcess(pid, name, b, index) for pid, name, b in procs])


def test_gpu_wait_until_memory_is_back():
    """Memory held by a stopping server goes back over a few polls: the wait returns."""
    base = [_gpu(0, 1 * gpu.GiB, [(111, "other", 1 * gpu.GiB)])]
    snaps = iter([[_gpu(0, 70 * gpu.GiB, [(111, "other", gpu.GiB), (222, "vllm", 69 * gpu.GiB)])],
                  [_gpu(0, 30 * gpu.GiB, [(111, "other", gpu.GiB)])],
                  [_gpu(0, 1 * gpu.GiB + 300 * 2**20, [(111, "other", gpu.GiB)])]])
    slept = []
    rep = gpu_release.wait_gpu_released(base, timeout=60, snapshot=lambda: next(snaps), poll=2,
                                     sleep=slept.append, own={999}, started={222},
                                     session=lambda pid: pid)   # 222: the server drafter started
    assert rep == {"ok": True, "waited": 4, "others": []} and slept == [2, 2]


def test_gpu_wait_names_the_holders_and_kills_nothing():
    base = [_gpu(0, 0), _gpu(1, 0)]
    now = [_gpu(0, 0), _gpu(1, 40 * gpu.GiB, [(4242, "vllm-worker", 38 * gpu.GiB),
                                              (999, "drafter", 2 * gpu.GiB)])]
    slept = []
    with pytest.raises(gpu_release.GpuNotReleased) as e:
        gpu_release.wait_gpu_released(base, timeout=5, snapshot=lambda: now, poll=1,
                                   sleep=slept.append, own={999}, what="drafter extract",
                                   started={4000}, session={4242: 4000}.get)  # a server worker
    assert sum(slept) == 5                                      # a bounded wait
    msg = str(e.value)
    assert "GPU 1" in msg and "PID 4242 (vllm-worker) holds 38.0 GiB" in msg
    assert "appeared during generate" in msg and "drafter extract" in msg
    assert "PID 999" not in msg and "GPU 0" not in msg          # our own memory is not foreign
    assert "never kills" in msg


def test_gpu_wait_leaves_other_jobs_alone(caplog):
    """A process that started on the GPU during generate outside every session drafter started
    a server in (another job: seen on the H200 with three runs on one GPU) is named in a warning
    and its memory not counted; one NVML cannot size is still waited for, and a leftover of our
    server still fails the wait."""
    base = [_gpu(0, 1 * gpu.GiB, [(111, "other", 1 * gpu.GiB)])]
    neighbour = [_gpu(0, 18 * gpu.GiB, [(111, "other", gpu.GiB), (549, "python3", 13 * gpu.GiB),
                                        (1655, "python3", 4 * gpu.GiB)])]
    sessions = {549: 549, 1655: 1655, 7000: 6000}
    wait = functools.partial(gpu_release.wait_gpu_released, base, timeout=3, poll=1, own={999},
                             started={6000}, session=sessions.get, sleep=lambda s: None)
    with caplog.at_level("WARNING", logger="drafter"):
        rep = wait(snapshot=lambda: neighbour)
    assert rep == {"ok": True, "waited": 0, "others": [549, 1655]}
    assert "PID 549 (python3) started during generate and holds 13.0 GiB" in caplog.text
    unsized = [_gpu(0, 18 * gpu.GiB, [(111, "other", gpu.GiB), (549, "python3", None)])]
    with pytest.raises(gpu_release.GpuNotReleased, match="PID 549"):
        wait(snapshot=lambda: unsized)
    unknown = [_gpu(0, 14 * gpu.GiB, [(111, "other", gpu.GiB), (8000, "python3", 13 * gpu.GiB)])]
    with pytest.raises(gpu_release.GpuNotReleased, match="PID 8000"):   # its session unreadable
        wait(snapshot=lambda: unknown)
    leftover = [_gpu(0, 18 * gpu.GiB, [(111, "other", gpu.GiB), (549, "python3", 13 * gpu.GiB),
                                       (7000, "vllm-worker", 4 * gpu.GiB)])]
    with pytest.raises(gpu_release.GpuNotReleased) as e:
        wait(snapshot=lambda: leftover)
    assert "PID 7000 (vllm-worker) holds 4.0 GiB" in str(e.value)
    assert "PID 549" not in str(e.value)


def test_gpu_wait_counts_a_new_process_of_our_own_as_ours():
    """A process that appeared during generate in drafter's own session (an online run's
    precompile child, started before generate) whose PID is in `own` is neither waited for nor
    its memory counted; left out of `own` it is a leftover. Where NVML cannot size it, its
    memory counts, but polls are not timed while `own_running` says it still runs."""
    base = [_gpu(0, 1 * gpu.GiB, [(111, "other", 1 * gpu.GiB)])]
    child = [_gpu(0, 21 * gpu.GiB, [(111, "other", gpu.GiB), (999, "drafter", gpu.GiB),
                                    (5000, "python3", 19 * gpu.GiB)])]
    wait = functools.partial(gpu_release.wait_gpu_released, base, timeout=3, poll=1,
                             started={77}, session=lambda pid: 77, snapshot=lambda: child)
    slept = []
    rep = wait(own={999, 5000}, sleep=slept.append)
    assert rep == {"ok": True, "waited": 0, "others": []} and slept == []
    with pytest.raises(gpu_release.GpuNotReleased, match="PID 5000 .python3. holds 19.0 GiB"):
        wait(own={999}, sleep=slept.append)
    assert sum(slept) == 3
    # unsized: waited for while it runs (untimed), then back at the baseline once it has ended
    unsized = [_gpu(0, 21 * gpu.GiB, [(111, "other", gpu.GiB), (5000, "python3", None)])]
    snaps = iter([unsized] * 5 + [base])
    running = iter([True] * 5 + [False])
    slept.clear()
    rep = wait(own={999, 5000}, sleep=slept.append, snapshot=lambda: next(snaps),
               own_running=lambda: next(running))
    assert rep == {"ok": True, "waited": 5, "others": []} and sum(slept) == 5


def test_run_waits_for_the_gpu_before_loading_the_target(tmp_path, monkeypatch):
    """run_all takes the GPU baseline before generate and checks it before extract (the first
    step that loads the target), never before steps that do not; a held GPU stops the run
    before extract starts, and a rerun (generate done) goes on without a new baseline."""
    calls = []

    def fake(name):
        def main(cfg):
            calls.append(name)
            return {"counts": {"n": 1}}
        return main

    snaps = {"n": 0}

    def snapshot():
        snaps["n"] += 1
        calls.append("snapshot")
        # before generate: free; afterwards a foreign process keeps 30 GiB
        return [_gpu(0, 0)] if snaps["n"] == 1 else [_gpu(0, 30 * gpu.GiB, [(4242, "x", None)])]

    monkeypatch.setattr(pipeline, "_step_fn", fake)
    monkeypatch.setattr(gpu_release, "gpu_snapshot", snapshot)
    monkeypatch.setattr(pipeline.time, "sleep", lambda s: None)
    cfg = C.load(None, [f"run_dir={tmp_path}", "generate.server.stop_timeout=0"])
    with pytest.raises(gpu_release.GpuNotReleased, match="PID 4242"):
        pipeline.run_all(cfg, steps=["prepare", "generate", "tokenize", "vocab", "extract"])
    assert calls[:6] == ["prepare", "snapshot", "generate", "tokenize", "vocab", "snapshot"]
    assert "extract" not in calls
    # once the GPU is free the rerun skips what is done and runs extract without waiting
    calls.clear()
    monkeypatch.setattr(gpu_release, "gpu_snapshot", lambda: calls.append("snapshot") or [_gpu()])
    pipeline.run_all(cfg, steps=["prepare", "generate", "tokenize", "vocab", "extract"])
    assert calls == ["extract"]


def test_one_drafter_per_run_dir(tmp_path):
    """A second drafter in the same run dir is refused with the first one's PID; the lock goes
    with the process, even on kill -9; `drafter status` tells a running step from a killed one."""
    run = Run(tmp_path)
    cfg = C.load(None, [f"run_dir={tmp_path}"])
    atomic_write(run.config_snapshot(), C.dump(cfg))
    atomic_json(run.manifest("prepare"), {"step": "prepare",
                                          "fingerprint": pipeline.fingerprint(cfg, run, "prepare")})
    atomic_json(run.started("generate"), {"fingerprint": {}, "time": time.time()})
    code = textwrap.dedent(f"""
        import time
        from drafter.run import lifecycle
        from drafter.core.rundir import Run
        with lifecycle.run_lock(Run({str(tmp_path)!r})):
            print("locked", flush=True)
            time.sleep(120)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env=ENV, cwd=REPO)
    try:
        assert p.stdout.readline().strip() == "locked"
        assert lifecycle.lock_holder(run) == p.pid
        with pytest.raises(lifecycle.RunBusy, match=f"PID {p.pid}"):
            with lifecycle.run_lock(run):
                pass
        st = pipeline.status(tmp_path)
        assert st["running_pid"] == p.pid
        assert [s["state"] for s in st["steps"][:3]] == ["done", "pending", "pending"]
        assert [s["activity"] for s in st["steps"][:3]] == [None, "running", None]
    finally:
        p.kill()
        p.wait()
    assert lifecycle.lock_holder(run) is None
    st = pipeline.status(tmp_path)
    assert st["running_pid"] is None
    assert (st["steps"][1]["state"], st["steps"][1]["activity"]) == ("failed", "interrupted")
    with lifecycle.run_lock(run):
        with lifecycle.run_lock(run):  # reentrant: run_all holds it around run_step
            assert lifecycle.lock_holder(run) == os.getpid()


RANKS = """
import json, os, sys
import torch.distributed as td
from drafter.core import config
from drafter.run import pipeline
from drafter.core.rundir import Run

def step(cfg):
    run = Run.of(cfg)
    seen = sorted(p.name for p in run.step_dir("extract").iterdir())  # before any collective
    td.init_process_group("gloo")
    (run.step_dir("extract") / f"rank{td.get_rank()}.json").write_text(json.dumps(seen))
    td.barrier()
    td.destroy_process_group()
    return {"counts": {"ranks": 2}}

pipeline._step_fn = lambda name: step
m = pipeline.run_step(config.load(None, sys.argv[1:]), "extract")
# one write of the whole line: unbuffered (PYTHONUNBUFFERED), print writes its pieces apart and
# the two ranks' lines interleave ("RESULTRESULT 0 1 ...") when they end together
sys.stdout.write(f"RESULT {os.environ['RANK']} {json.dumps(m['counts'])}\\n")
"""


def test_torchrun_ranks_wait_for_rank0(tmp_path):
    """Under torchrun rank 0 alone clears a stale step folder and writes started.json and the
    manifest; rank 1 starts only after that (it never sees the stale files)."""
    run = Run(tmp_path / "run")
    for dep in ("tokenize", "vocab"):
        atomic_json(run.manifest(dep), {"step": dep})
    atomic_json(run.started("extract"), {"fingerprint": {"stale": 1}})
    (run.step_dir("extract") / "junk.bin").write_bytes(b"x" * 1000)
    runner = tmp_path / "ranks.py"
    runner.write_text(RANKS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(runner), f"run_dir={run.root}"]
    out = subprocess.run(cmd, env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    for r in (0, 1):
        seen = json.loads((run.step_dir("extract") / f"rank{r}.json").read_text())
        assert "junk.bin" not in seen and "started.json" in seen, (r, seen)
    m = read_json(run.manifest("extract"))
    assert m["counts"] == {"ranks": 2} and read_json(run.started("extract"))["fingerprint"] == \
        m["fingerprint"]
    assert sorted(re.findall(r"RESULT (\d)", out.stdout)) == ["0", "1"]


# -------------------------------------------------------------------------- the matrix (slow)
MATRIX_SEED = 20261130


def _prestate(ref: Run, dst: Path, step: str) -> None:
    """A run dir holding the reference's finished steps before `step`, and nothing of it."""
    dst.mkdir(parents=True)
    for s in pipeline.STEPS[: pipeline.STEPS.index(step)]:
        shutil.copytree(ref.step_dir(s), dst / s)
    shutil.copy(ref.config_snapshot(), dst / "config.yaml")


@pytest.fixture(scope="module")
def server_ref(world):
    """An uninterrupted run through tokenize with `transformers serve` as the server."""
    root = world["root"]
    cfg = write_cfg(root / "srv.yaml", root / "srvref", world["model"], engine="transformers")
    finish(cfg, log=root / "srvref.log", until="tokenize")
    return Run(root / "srvref")


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fault_matrix(world, server_ref, tmp_path):
    """>= 10 kill -9 points (plus a SIGTERM) drawn with a fixed seed inside generate (a real
    `transformers serve`, and the in-process engine), extract and train, each resumed on its
    own from the same state; every rerun ends identical to the uninterrupted run. The table
    goes to stdout and to $DRAFTER_FAULT_MATRIX (markdown) for BENCHMARKS.md."""
    rng = random.Random(MATRIX_SEED)
    n_shards = len(world["outputs"]["shards"])
    K = signal.SIGKILL
    cases = [("transformers", Point("generate", rng.randrange(0, N_SAMPLES), rng.uniform(0, 1), K))
             for _ in range(2)]
    cases += [("drafter", Point("generate", rng.randrange(0, N_SAMPLES - 2), rng.uniform(0, .5), K))
              for _ in range(2)]
    cases += [("drafter", Point("extract", rng.randrange(0, n_shards - 2), rng.uniform(0, .2), K))
              for _ in range(3)]
    cases += [("drafter", Point("train", rng.randrange(0, MAX_STEPS - 3), rng.uniform(0, .2), K))
              for _ in range(3)]
    cases.append(("transformers", Point("generate", rng.randrange(1, N_SAMPLES - 2),
                                        rng.uniform(0, .5), signal.SIGTERM)))
    rows = []
    for k, (engine, pt) in enumerate(cases):
        d = tmp_path / f"case{k:02d}"
        ref = server_ref if engine == "transformers" else world["ref"]
        until = "tokenize" if engine == "transformers" else UNTIL
        _prestate(ref, d / "run", pt.step)
        cfg = write_cfg(d / "cfg.yaml", d / "run", world["model"], engine=engine)
        run = Run(d / "run")
        where = kill_at(cfg, run, pt, d / "drafter.log", until=until)
        assert where["landed"] == pt.step, (pt, where, (d / "drafter.log").read_text()[-3000:])
        assert_consistent_after_kill(run, where, pt.sig)
        ckpts = [c.name for c in run.checkpoints()]
        t0 = time.time()
        finish(cfg, log=d / "drafter.log", until=until)
        rerun_s = time.time() - t0
        assert_same(outputs(run, until), outputs(ref, until))
        m = read_json(run.manifest(pt.step))["counts"]
        kept = {"generate": f"resumed {m.get('resumed')} of {m.get('input')} conversations",
                "extract": f"kept {m.get('shards_kept')}, wrote {m.get('shards_written')}, "
                           f"redid {m.get('shards_redone')} of {m.get('shards')} shards",
                "train": f"resumed from {ckpts[-1] if ckpts else 'scratch'}"}[pt.step]
        print(f"case {k + 1}/{len(cases)}: {pt} -> {where}; {kept}", flush=True)
        label = f"generate ({engine})" if pt.step == "generate" else pt.step
        rows.append(f"| {k + 1} | {label} | "
                    f"{signal.Signals(pt.sig).name} | after {pt.after} + {pt.delay:.2f}s | "
                    f"{where['landed']} at {where['progress']} | {kept} | identical | "
                    f"{rerun_s:.0f}s |")
    table = "\n".join(["| # | step (engine) | signal | aimed | landed (progress) | rerun kept "
                       "| outputs vs uninterrupted | rerun time |",
                       "|---|---|---|---|---|---|---|---|", *rows])
    print("\n" + table)
    if os.environ.get("DRAFTER_FAULT_MATRIX"):
        Path(os.environ["DRAFTER_FAULT_MATRIX"]).write_text(table + "\n")
    assert sum(1 for _, pt in cases if pt.sig == signal.SIGKILL) >= 10


def test_a_signal_that_surfaces_as_another_error_is_an_interruption(tmp_path):
    """Ctrl-C landing inside C code (a safetensors read in train, seen in the kill chain) can come
    out as a ValueError: failed.json still says interrupted, so status and the rerun treat the
    step as stopped, not broken."""
    run = Run(tmp_path / "run")
    run.step_dir("train").mkdir(parents=True)
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.getsignal(s) for s in sigs}
    try:
        lifecycle.install_signal_handlers()
        try:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            except KeyboardInterrupt:
                raise ValueError("could not determine the shape of object type") from None
        except ValueError as e:
            assert lifecycle.signalled() == signal.SIGINT
            pipeline._write_failed(run, "train", e)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        lifecycle._SIGNALLED.clear()
    f = read_json(run.failed("train"))
    assert f["interrupted"] is True
    assert "SIGINT" in f["error"] and "ValueError: could not determine" in f["error"]
