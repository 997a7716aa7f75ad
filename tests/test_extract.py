"""The extract step end to end on a tiny random Llama behind the real prepare/tokenize/vocab steps:
shards + index, the reader against online capture, every storage option, kill -9 and resume to
identical shard hashes, a corrupt shard redone, 2 gloo ranks under torchrun == 1 process, online
mode, and SmolLM2 (slow)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from drafter.core import config as C
from drafter.core.rundir import MissingInput, Run, read_json
from drafter.features import store
from drafter.run import pipeline
from drafter.steps import extract
from tests.tiny import make_tiny

REPO = Path(__file__).resolve().parents[1]
# torchrun gives each rank one thread; the single-process runs here use one too, so that float
# reductions happen in the same order and shard files can be compared byte for byte.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


pytestmark = pytest.mark.usefixtures("one_thread")


def write_config(path: Path, run_dir: Path, model: Path, shared_data: Path, **extract) -> Path:
    data = {
        "run_dir": str(run_dir),
        "target": {"model": str(model)},
        "prepare": {"sources": [{"path": str(shared_data
                                             / "train/sharegpt_dummy_conversation.json"),
                                 "max_samples": 24}], "val_fraction": 0.2},
        "generate": {"enabled": False},
        "tokenize": {"max_length": 80, "workers": 1},
        "vocab": {"draft_vocab_size": 512},
        "extract": {"shard_tokens": 128, "batch_tokens": 64, **extract},
    }
    path.write_text(yaml.safe_dump(data))
    return path


def shard_hashes(run: Run) -> dict[str, str]:
    return {f"{s}/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest()
            for s in ("train", "val") for p in sorted(run.shards(s).glob("shard_*.safetensors"))}


def copy_inputs(src: Path, dst: Path) -> None:
    """A run dir holding only the upstream steps' outputs of `src`."""
    dst.mkdir(parents=True, exist_ok=True)
    for step in ("prepare", "generate", "tokenize", "vocab"):
        shutil.copytree(src / step, dst / step)
    shutil.copy(src / "config.yaml", dst / "config.yaml")


@pytest.fixture(scope="module")
def base(tmp_path_factory, smollm2_dir, shared_data):
    """Tiny Llama (SmolLM2 tokenizer) -> prepare, tokenize, vocab, extract with defaults."""
    d = tmp_path_factory.mktemp("extract")
    model = make_tiny("llama", d, tokenizer_dir=smollm2_dir)
    cfg_path = write_config(d / "cfg.yaml", d / "run", model, shared_data)
    cfg = C.load(cfg_path)
    pipeline.run_all(cfg, steps=["prepare", "generate", "tokenize", "vocab", "extract"])
    return {"dir": d, "model": model, "cfg_path": cfg_path, "cfg": cfg, "run": Run(d / "run")}


def test_shards_index_and_manifest(base):
    run = base["run"]
    m = read_json(run.manifest("extract"))
    c = m["counts"]
    assert c["train_samples"] + c["val_samples"] == c["samples"] > 15
    assert c["shards"] == c["shards_written"] > 4 and c["shards_kept"] == c["shards_redone"] == 0
    info = m["info"]
    assert info["layer_ids"] == [1, 3, 4] and info["num_layers"] == 6 and info["hidden_size"] == 64
    assert info["teacher"] == "hidden" and info["aux_dtype"] == "bf16"
    assert info["target_dtype"] == "float32"
    assert m["tokens_per_s"] > 0 and m["self_check"]["tokens"] > 0
    assert m["formula_bytes_per_token"] == store.bytes_per_token(64)
    assert m["reference_bytes_per_token"] == 8 * 64 + 16
    assert m["formula_bytes_per_token"] <= m["bytes_per_token"] < m["formula_bytes_per_token"] * 1.1
    for split in ("train", "val"):
        ix = store.read_index(run.shard_index(split))
        assert ix["info"] == info
        assert all(e["num_tokens"] <= 128 or e["num_samples"] == 1 for e in ix["shards"])
        for i, e in enumerate(ix["shards"]):
            p = run.shard(split, i)
            assert e["file"] == p.name and e["sha256"] == store.file_sha256(p)
        # every tokenized sample is there, longest first within a shard
        from drafter.data import tokens
        rows = tokens.read_rows(run.tokens(split), list(range(tokens.num_rows(run.tokens(split)))))
        assert sorted(sid for e in ix["shards"] for sid in e["ids"]) \
            == sorted(r["id"] for r in rows)
        for e in ix["shards"]:
            assert e["lengths"] == sorted(e["lengths"], reverse=True)
    assert not list(run.step_dir("extract").rglob(".tmp*"))


def test_reader_equals_online_capture(base):
    """What training reads offline is what online capture hands it (same batches: exact)."""
    from drafter.features.capture import load_capture, split

    run, cfg = base["run"], base["cfg"]
    cap = load_capture(cfg)
    r = store.Reader(run, "train", verify=True)
    ix = r.index
    from drafter.data import tokens
    by_id = {row["id"]: row for row in tokens.iter_samples(run.tokens("train"))}
    shard = ix["shards"][0]
    rows = [by_id[i] for i in shard["ids"]]
    plan = extract.plan_shards("train", [len(x["input_ids"]) for x in rows], 10**9,
                               cfg.extract.batch_tokens, False)[0]
    online = []
    for batch in plan.batches:
        online += split(cap.run([rows[p]["input_ids"] for p in batch]))
    for i, o in enumerate(online):
        s = r[i]
        assert r.ids[i] == shard["ids"][i]
        assert torch.equal(s["input_ids"], o["input_ids"])
        assert torch.equal(s["loss_mask"], torch.tensor(rows[i]["loss_mask"]))
        assert torch.equal(s["aux"], o["aux"]) and torch.equal(s["in_vocab"], o["in_vocab"])
        assert torch.equal(s["teacher_hidden"], o["teacher_hidden"])
    head = r.head()
    assert torch.equal(head.weight, cap.head.weight)
    lp = store.teacher_logprobs(r[0], head)
    assert lp.shape == (r.lengths[0], 512)
    assert torch.allclose(lp.exp().sum(-1), torch.ones(r.lengths[0]), atol=1e-4)


@pytest.mark.parametrize("aux_dtype,teacher", [("fp8", "hidden"), ("bf16", "topk")])
def test_storage_options_read_back_alike(base, tmp_path, aux_dtype, teacher):
    ref = store.Reader(base["run"], "train")
    copy_inputs(base["run"].root, tmp_path / "run")
    cfg = C.load(base["cfg_path"], [f"run_dir={tmp_path / 'run'}", f"extract.aux_dtype={aux_dtype}",
                                    f"extract.teacher={teacher}", "extract.topk=16"])
    out = extract.main(cfg)
    r = store.Reader(Run(tmp_path / "run"), "train", verify=True)
    assert r.ids == ref.ids and r.lengths == ref.lengths
    assert out["info"]["aux_dtype"] == aux_dtype and out["info"]["teacher"] == teacher
    formula = store.bytes_per_token(64, 3, aux_dtype, teacher, 16, 512)
    assert out["formula_bytes_per_token"] == formula
    assert formula <= out["bytes_per_token"] < formula * 1.15
    assert out["bytes_per_token"] < base_bytes_per_token(base)
    head = r.head()
    for i in range(0, len(r), 5):
        a, b = r[i], ref[i]
        assert set(a) - {"teacher_topk_ids", "teacher_topk_logp", "teacher_hidden"} == \
            {"input_ids", "loss_mask", "aux", "in_vocab"}
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["in_vocab"],
                                                                           b["in_vocab"])
        assert a["aux"].dtype == torch.bfloat16
        err = (a["aux"].float() - b["aux"].float()).abs().amax(-1)
        scale = b["aux"].float().abs().amax(-1)
        assert (err <= scale * (2 ** -4 if aux_dtype == "fp8" else 0)).all()
        # the teacher: top-k = the dense teacher's top-k (of the exact hidden state)
        dense_ref = store.teacher_logprobs(b, head)
        dense = store.teacher_logprobs(a, head)
        assert dense.shape == dense_ref.shape
        if teacher == "topk":
            assert (a["teacher_topk_ids"][:, 0] == dense_ref.argmax(-1)).float().mean() > 0.95
            top = dense_ref.gather(1, a["teacher_topk_ids"])
            assert (top - a["teacher_topk_logp"]).abs().max() < 0.05   # bf16 hidden vs exact
        else:
            assert torch.equal(dense, dense_ref)


def base_bytes_per_token(base) -> float:
    return read_json(base["run"].manifest("extract"))["bytes_per_token"]


def test_kill9_then_resume_gives_identical_shards(base, tmp_path):
    """SIGKILL mid-extract (the process we started), rerun the same command: the shards
    written before the kill are kept, the rest written, and every file equals the
    uninterrupted run's, byte for byte."""
    copy_inputs(base["run"].root, tmp_path / "run")
    cfg = write_config(tmp_path / "cfg.yaml", tmp_path / "run", base["model"],
                       REPO.parent / "shared" / "data")
    run = Run(tmp_path / "run")
    expected = shard_hashes(base["run"])
    cmd = [sys.executable, "-m", "drafter.cli", "extract", str(cfg)]
    p = subprocess.Popen(cmd, env=ENV, cwd=REPO, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 240
        while not run.shard("train", 1).exists():
            assert p.poll() is None, p.stderr.read().decode()[-3000:]
            assert time.time() < deadline
            time.sleep(0.005)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait()
    partial = shard_hashes(run)
    assert 2 <= len(partial) < len(expected), "the kill came too late to test a resume"
    assert all(expected[k] == v for k, v in partial.items())       # complete files only
    assert not run.shard_index("train").exists() and not run.manifest("extract").exists()
    # the pipeline resumes in the same folder (same fingerprint, no manifest)
    out = subprocess.run(cmd, env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    m = read_json(run.manifest("extract"))
    assert m["counts"]["shards_kept"] == len(partial)
    assert m["counts"]["shards_written"] == len(expected) - len(partial)
    assert shard_hashes(run) == expected
    for split in ("train", "val"):
        assert store.read_index(run.shard_index(split))["shards"] == \
            store.read_index(base["run"].shard_index(split))["shards"]
    assert not list(run.step_dir("extract").rglob(".tmp*"))


def test_corrupt_shard_is_detected_and_redone(base, tmp_path):
    shutil.copytree(base["run"].root, tmp_path / "run")
    run = Run(tmp_path / "run")
    cfg = C.load(base["cfg_path"], [f"run_dir={run.root}"])
    expected = shard_hashes(base["run"])
    p1, p2 = run.shard("train", 1), run.shard("train", 2)
    for p in (p1, p2):
        blob = bytearray(p.read_bytes())
        blob[len(blob) // 2] ^= 0x5A
        p.write_bytes(bytes(blob))
    assert store.Reader(run, "train").verify() == [p1, p2]
    with pytest.raises(store.ShardError, match="corrupt shards"):
        store.Reader(run, "train", verify=True)
    # the user's way back: drop the manifest, rerun the step (it resumes in place)
    run.manifest("extract").unlink()
    m = pipeline.run_step(cfg, "extract")
    assert m["counts"]["shards_redone"] == 2 and m["counts"]["shards_written"] == 2
    assert m["counts"]["shards_kept"] == m["counts"]["shards"] - 2
    assert shard_hashes(run) == expected
    assert store.Reader(run, "train").verify() == []
    # without an index, a shard verifies itself (content hash in its header)
    run.shard_index("train").unlink()
    blob = bytearray(p2.read_bytes())
    blob[-50] ^= 0x01
    p2.write_bytes(bytes(blob))
    out = extract.main(cfg)
    assert out["counts"]["shards_redone"] == 1 and shard_hashes(run) == expected


def test_torchrun_two_gloo_ranks_write_the_same_shards(base, tmp_path):
    copy_inputs(base["run"].root, tmp_path / "run")
    cfg = write_config(tmp_path / "cfg.yaml", tmp_path / "run", base["model"],
                       REPO.parent / "shared" / "data")
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "drafter.cli",
                          "extract", str(cfg)], env=ENV, cwd=REPO, capture_output=True,
                         text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-4000:]
    run = Run(tmp_path / "run")
    assert shard_hashes(run) == shard_hashes(base["run"])
    for split in ("train", "val"):
        a = store.read_index(run.shard_index(split))
        b = store.read_index(base["run"].shard_index(split))
        assert a["shards"] == b["shards"] and a["info"] == b["info"]
    m = read_json(run.manifest("extract"))
    assert m["world_size"] == 2
    assert m["counts"]["samples"] == read_json(base["run"].manifest("extract"))["counts"]["samples"]


def test_online_mode_stores_nothing(base, tmp_path):
    cfg = C.load(base["cfg_path"], [f"run_dir={tmp_path / 'run'}", "train.online=true"])
    out = extract.main(cfg)
    assert out["counts"]["online"] == 1 and out["counts"]["tokens"] == 0
    assert not (tmp_path / "run").exists()


_CHILD = """
import json, sys, time
if sys.argv[2] == "sleep":
    time.sleep(60)
json.dump({"graphs": 4}, open(sys.argv[1], "w"))
"""


def test_extract_starts_its_precompile_child_first_and_stops_it_with_nothing_to_do(
        base, tmp_path, monkeypatch):
    """Extract starts train's precompile process (a GPU's, drafter/train/precompile.py; here a real
    process in its place) before it plans, loads the target or writes a shard, waits for it
    and puts its figures in the manifest; with every shard kept it stops the process at once
    and says so (the process's set-up overlaps extract's own)."""
    from drafter.train import precompile
    mode = {}

    def start(cfg, run, device, tconf, extract_bytes, rank=0):
        d = tmp_path / f"child-{mode['run']}"
        d.mkdir()
        (d / "config.yaml").write_text("{}")
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(d / "result.json"),
                                 mode["run"]])
        mode.setdefault("started", time.time())  # extract called start (the child's own
        # interpreter may take seconds to start on a loaded machine)
        return precompile.Handle(proc, d / "config.yaml", d / "result.json", d / "log",
                                 time.perf_counter())

    monkeypatch.setattr(precompile, "start", start)
    copy_inputs(base["run"].root, tmp_path / "run")
    run = Run(tmp_path / "run")
    cfg = C.load(base["cfg_path"], [f"run_dir={run.root}"])
    mode["run"] = "write"
    out = extract.main(cfg)
    pc = out["precompile"]
    assert pc["exit"] == 0 and pc["graphs"] == 4 and "stopped" not in pc
    assert 0 <= pc["started_s"] < 30 and pc["wall_s"] > 0
    first_shard = min(p.stat().st_mtime for p in run.shards("train").glob("shard_*"))
    assert mode["started"] < first_shard             # started before any shard was written
    assert shard_hashes(run) == shard_hashes(base["run"])
    # a second extract finds every shard kept: the process is stopped, not waited for
    mode["run"] = "sleep"
    t = time.perf_counter()
    out = extract.main(cfg)
    assert out["counts"]["shards_kept"] == out["counts"]["shards"]
    pc = out["precompile"]
    assert pc["stopped"].startswith("nothing to extract") and pc["exit"] != 0
    assert "graphs" not in pc and time.perf_counter() - t < 30


def test_missing_inputs_name_the_step(base, tmp_path):
    cfg = C.load(base["cfg_path"], [f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(MissingInput, match="drafter vocab"):
        extract.main(cfg)
    with pytest.raises(MissingInput, match="tokenize"):
        pipeline.run_step(cfg, "extract")


def test_plan_is_deterministic_and_covers_every_sample():
    lengths = [5, 300, 0, 40, 40, 120, 7, 90]
    a = extract.plan_shards("train", lengths, 128, 64, packed=False)
    b = extract.plan_shards("train", lengths, 128, 64, packed=False)
    assert [s.rows for s in a] == [s.rows for s in b]
    assert sorted(r for s in a for r in s.rows) == [0, 1, 3, 4, 5, 6, 7]  # the empty one skipped
    assert a[0].rows == [1] and a[0].lengths == [300]                      # alone: too long
    for s in a:
        assert s.tokens <= 128 or len(s.rows) == 1
        assert sorted(p for bt in s.batches for p in bt) == list(range(len(s.rows)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_extract_on_gpu_bf16(base, tmp_path):
    """On a GPU: the step in bf16 (self-check at bf16 tolerances, async host copies), read
    back close to the fp32 CPU run."""
    copy_inputs(base["run"].root, tmp_path / "run")
    cfg = C.load(base["cfg_path"], [f"run_dir={tmp_path / 'run'}", "target.device=cuda",
                                    "target.dtype=bfloat16", "extract.aux_dtype=fp8",
                                    "extract.teacher=topk", "extract.topk=16"])
    out = extract.main(cfg)
    assert out["info"]["target_dtype"] == "bfloat16" and out["self_check"]["tokens"] > 0
    a, b = store.Reader(Run(tmp_path / "run"), "train", verify=True), store.Reader(base["run"],
                                                                                   "train")
    assert a.ids == b.ids
    for i in range(0, len(a), 3):
        x, y = a[i], b[i]
        rel = (x["aux"].float() - y["aux"].float()).norm() / y["aux"].float().norm()
        assert rel < 0.1                                   # fp8 of a bf16 forward vs fp32
        assert (x["in_vocab"] == y["in_vocab"]).float().mean() > 0.9


@pytest.mark.slow
def test_smollm2_fp8_topk_end_to_end(tmp_path, smollm2_dir, shared_data):
    cfg_path = write_config(tmp_path / "cfg.yaml", tmp_path / "run", smollm2_dir, shared_data,
                            aux_dtype="fp8", teacher="topk", topk=32)
    data = yaml.safe_load(cfg_path.read_text())
    data["prepare"]["sources"][0]["max_samples"] = 8
    data["tokenize"]["max_length"] = 64
    cfg_path.write_text(yaml.safe_dump(data))
    cfg = C.load(cfg_path)
    pipeline.run_all(cfg, steps=["prepare", "generate", "tokenize", "vocab", "extract"])
    m = read_json(Run(tmp_path / "run").manifest("extract"))
    assert m["info"]["layer_ids"] == [2, 15, 27] and m["info"]["hidden_size"] == 576
    assert m["ratio_to_reference"] < 0.5
    r = store.Reader(Run(tmp_path / "run"), "train", verify=True)
    s = r[0]
    assert s["aux"].shape == (r.lengths[0], 3, 576) and s["teacher_topk_ids"].shape[1] == 32
    print(json.dumps({k: m[k] for k in ("tokens_per_s", "bytes_per_token",
                                        "ratio_to_reference")}))


@pytest.mark.slow
def test_torchrun_tensor_parallel_matches(base, tmp_path):
    """extract.tp=true: one target sharded over 2 gloo ranks (transformers tp_plan) gives the
    single-process values up to the order of the row-parallel sums."""
    copy_inputs(base["run"].root, tmp_path / "run")
    cfg = write_config(tmp_path / "cfg.yaml", tmp_path / "run", base["model"],
                       REPO.parent / "shared" / "data", tp=True)
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "drafter.cli",
                          "extract", str(cfg)], env=ENV, cwd=REPO, capture_output=True,
                         text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-4000:]
    a, b = store.Reader(Run(tmp_path / "run"), "train"), store.Reader(base["run"], "train")
    assert a.ids == b.ids
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"])
        err = (x["aux"].float() - y["aux"].float()).abs().max()
        assert err <= 2 ** -7 * y["aux"].float().abs().max()                 # bf16 ulps
        assert (x["in_vocab"] == y["in_vocab"]).float().mean() > 0.95


def test_the_throughput_benchmark_runs_the_steps_own_loop(tmp_path):
    """benchmarks/extract_throughput.py --tiny (the GPU chain's kimi-extract at a tiny size):
    the extract step's own shard loop, each option's files at the bytes per token the store's
    formula gives, and the fp8 error of every layer."""
    out = tmp_path / "et.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks/extract_throughput.py"), "--tiny",
                        "--options", "fp8/topk,bf16/hidden", "--fp8-error", "--fp8-error-tokens",
                        "256", "--tokens", "1024", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    for name, o in res["options"].items():
        assert abs(o["bytes_per_token"] / o["formula_bytes_per_token"] - 1) < 0.01, name
    assert len(res["fp8_error"]["layers"]) == res["N"]
    assert all(0 < e["rel_l2"] < 0.05 for e in res["fp8_error"]["layers"].values())
