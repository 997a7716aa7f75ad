"""Train's graphs precompiled for online runs (drafter/train/precompile.py): the decision (online
configs apply on a GPU), the child's micro-batches against what the online feeder builds from a
tiny random target (names, dtypes, devices, shapes: what Inductor's and aot's keys hold), its
set-up before the vocab step has run (the vocab's shape only), train waiting for the child the
pipeline started and keeping its log and figures, and the pipeline starting it before generate
(engine drafter) or before the first of tokenize, vocab that runs, the release wait counting it as
the pipeline's own, and stopping it when no train takes it. A CPU
cannot compile: these test the decision and the plumbing; the GPU test runs the real thing."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from drafter.core import config as C
from drafter.core.rundir import Run, read_json
from drafter.data import tokens
from drafter.features.capture import load_capture
from drafter.run import gpu_release, pipeline
from drafter.train import batches, precompile
from tests.tiny import make_tiny

VOCAB, VD = 512, 256

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama target (vocab 512), and a run dir with what an online train reads:
    the tokenize step's train split (random conversations) and a draft vocab of 256 ids."""
    root = tmp_path_factory.mktemp("precompile")
    tdir = make_tiny("llama", root, vocab_size=VOCAB, num_hidden_layers=4)
    run = Run(root / "run")
    run.step_dir("tokenize").mkdir(parents=True)
    run.step_dir("vocab").mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    w = tokens.TokenWriter(run.tokens("train"))
    for i in range(16):
        n, p = int(torch.randint(14, 40, (), generator=g)), int(torch.randint(3, 8, (),
                                                                              generator=g))
        w.write(f"s{i:03d}", torch.randint(0, VOCAB, (n,), generator=g).tolist(),
                [0] * p + [1] * (n - p))
    w.close()
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[torch.randperm(VOCAB, generator=g)[:VD]] = True
    d2t = t2d.nonzero().squeeze(-1) - torch.arange(VD)
    tokens.save_vocab(run.vocab(), d2t, t2d, torch.ones(VOCAB, dtype=torch.long))
    return SimpleNamespace(root=root, tdir=tdir, run=run)


def cfg_for(tiny, *overrides, run_dir=None):
    return C.load(None, [f"run_dir={run_dir or tiny.run.root}", f"target.model={tiny.tdir}",
                         f"vocab.draft_vocab_size={VD}", "train.online=true",
                         "train.max_length=64", "train.batch_tokens=128", "train.ttt_steps=3",
                         "train.log_every=1", "train.eval_every=0", "train.save_every=1000",
                         *overrides])


# ------------------------------------------------------------------------------- the decision
def test_online_runs_precompile_on_a_gpu(tiny):
    """Online configs precompile as offline ones do; train.compile=false and
    extract.precompile=false turn it off, and a CPU never compiles."""
    cuda = torch.device("cuda", 0)  # only its type is read: no GPU needed
    on, off = cfg_for(tiny), cfg_for(tiny, "train.online=false")
    assert precompile.applies(on, cuda) is None and precompile.applies(off, cuda) is None
    assert precompile.applies(on, torch.device("cpu")) == "train compiles only on a GPU"
    assert precompile.applies(cfg_for(tiny, "train.compile=false"), cuda) == \
        "train.compile=false"
    assert precompile.applies(cfg_for(tiny, "extract.precompile=false"), cuda) == \
        "extract.precompile=false"
    # the pipeline starts one ahead of train only for an online train among its steps
    gpu = cfg_for(tiny, "target.device=cuda")
    assert pipeline.precompiles_ahead(gpu, pipeline.STEPS)
    assert not pipeline.precompiles_ahead(gpu, pipeline.STEPS[:5])  # --until extract
    assert not pipeline.precompiles_ahead(cfg_for(tiny, "target.device=cuda",
                                                  "train.online=false"), pipeline.STEPS)
    assert not pipeline.precompiles_ahead(cfg_for(tiny, "target.device=cpu"), pipeline.STEPS)


# ------------------------------------------------------------- the child's batches are online's
def _meta(hb: dict) -> dict:
    """name -> (dtype, device, shape) of every tensor of a batch (nested: the teacher's); the
    loss rows' count (rows, trows, weights, row_step) left out: a dynamic dimension."""
    out = {}
    for k, v in hb.items():
        for name, t in (v.items() if isinstance(v, dict) else [(k, v)]):
            if torch.is_tensor(t):
                dyn = k in ("rows", "trows", "weights", "row_step")
                out[f"{k}.{name}" if isinstance(v, dict) else k] = \
                    (t.dtype, t.device, tuple(t.shape)[1:] if dyn else tuple(t.shape))
    return out


@pytest.mark.parametrize("teacher", ["hidden", "topk"])
def test_online_precompile_batches_are_what_the_online_feeder_builds(tiny, teacher):
    """With train.online the child's micro-batches are the online feeder's: the target
    captured as train's online mode loads it (load_capture, Source.online over the tokenize
    step's file), batched by host_batches, and moved by device_batch, against the child's
    random ones from its own set-up: the same tensors by name, dtype, device and shape, before
    and after device_batch (sdpa's dense teacher, flex's top-k or dense)."""
    cfg = cfg_for(tiny, f"extract.teacher={teacher}", "extract.topk=8")
    dev = torch.device("cpu")
    S = precompile.setup(cfg, dev)
    cap = load_capture(cfg, device="cpu")
    src = batches.Source.online(tiny.run.tokens("train"), cap)
    rows = batches.pack(src.lengths, S["T"], 0)
    real = batches.host_batch(src, rows[: S["B"]], S["B"], S["T"], S["tc"],
                              S["drafter"].embed_tokens.weight)
    fake = precompile.random_batch(cfg, S, 0)
    assert _meta(real) == _meta(fake)
    assert real["aux"].dtype == torch.bfloat16  # capture's, not the target's float32
    for fused in (False, True):
        assert _meta(batches.device_batch(real, dev, cap.head, fused)) == \
            _meta(batches.device_batch(fake, dev, S["head"], fused))
    # the head as the target's: its rows' dtype and output transform
    assert (S["head"].weight.dtype, S["head"].scale, S["head"].softcap) == \
        (cap.head.weight.dtype, cap.head.scale, cap.head.softcap)


@pytest.mark.parametrize("teacher", ["hidden", "topk"])
def test_online_samples_keep_their_features_on_the_device(teacher):
    """random_samples(device=...) places what capture returns on the target's device there
    (aux, in_vocab, the teacher) and keeps the token fields on the host, as Capture.__call__
    does: host_batches then collates and aligns on the device, as online."""
    meta = torch.device("meta")
    for s in precompile.random_samples(2, 16, 3, 8, 64, 32, teacher, 4, device=meta):
        for k, v in s.items():
            assert v.device == (torch.device("cpu") if k in ("input_ids", "loss_mask")
                                else meta), k
    off = precompile.random_samples(2, 16, 3, 8, 64, 32, teacher, 4)
    assert all(v.device.type == "cpu" for s in off for v in s.values())


def test_precompile_needs_the_vocabs_shape_only(tiny, tmp_path):
    """An online run's child starts before the vocab step has written its file: it builds the
    drafter from the vocab's shape (min(draft_vocab_size, V) ids), the same modules as from
    the run's vocab."""
    cfg = cfg_for(tiny, run_dir=tmp_path / "run")
    assert not Run(tmp_path / "run").vocab().exists()
    S, ref = precompile.setup(cfg, torch.device("cpu")), precompile.setup(cfg_for(tiny),
                                                                          torch.device("cpu"))
    assert {k: v.shape for k, v in S["drafter"].state_dict().items()} == \
        {k: v.shape for k, v in ref["drafter"].state_dict().items()}
    assert S["vd"] == VD
    big = cfg_for(tiny, "vocab.draft_vocab_size=100000", run_dir=tmp_path / "run")
    d2t, t2d = precompile.shape_vocab(big, load_capture(cfg_for(tiny)).model.config)
    assert d2t.numel() == VOCAB and t2d.all()  # capped at the target vocab, as vocab does


# ------------------------------------------------------------------ train waits, keeps its log
def test_online_train_waits_for_the_child_started_ahead_and_keeps_its_log(tiny, tmp_path):
    """The child the pipeline started (here the real `drafter precompile` of this config: on
    the CPU it has nothing to do and says so) is taken by train's loop before its first step
    and waited for there: its figures are train's manifest's `precompile` (with the step it
    started before), the wait is setup_parts_s's `precompile`, and its log is in train's
    folder."""
    from drafter.steps import train

    run = Run(tmp_path / "run")
    for step in ("tokenize", "vocab"):
        (run.root / step).mkdir(parents=True)
        for f in (tiny.run.step_dir(step)).iterdir():
            (run.step_dir(step) / f.name).write_bytes(f.read_bytes())
    run.step_dir("train").mkdir()
    cfg = cfg_for(tiny, "train.max_steps=2", run_dir=run.root)
    h = precompile._spawn_child(cfg, "cpu", None, "train")
    h.before = "tokenize"
    precompile._ahead = h
    out = train.main(cfg)
    assert precompile._ahead is None and h.proc.returncode == 0
    pc = out["precompile"]
    assert pc["exit"] == 0 and pc["skipped"] == "train compiles only on a GPU", pc
    assert pc["started_before"] == "tokenize" and pc["wall_s"] >= pc["waited_s"] >= 0
    assert pc["log"] == str(run.step_dir("train") / "precompile.log")
    assert "precompile: nothing to do" in Path(pc["log"]).read_text()
    assert "precompile" in out["setup_parts_s"] and out["final_step"] == 2
    assert not h.config.parent.exists()  # its temp folder went with its files


# ---------------------------------------------------------------- the pipeline starts and stops
_CHILD = ("import json, sys, time; time.sleep(float(sys.argv[2])); "
          "json.dump({'graphs': 4}, open(sys.argv[1], 'w'))")


@pytest.fixture
def ahead(tmp_path, monkeypatch):
    """The pipeline with stand-in steps (real manifests) on a pretend GPU: start_ahead spawns a
    stand-in child that sleeps, and the stand-in train takes it and waits for it as train
    does. `calls` lists the steps and the child's start, in order."""
    calls, children = [], []

    def spawn(cfg, device, log_path, who):
        d = Path(tempfile.mkdtemp(dir=tmp_path))
        nap = os.environ.get("_TEST_NAP", "0.2")
        with open(d / "log", "ab") as f:
            proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(d / "result.json"), nap],
                                    stdout=f, stderr=subprocess.STDOUT)
        (d / "config.yaml").write_text("{}")
        calls.append("child")
        children.append(proc)
        return precompile.Handle(proc, d / "config.yaml", d / "result.json", d / "log",
                                 time.perf_counter(), who, False)

    def fake(name):
        def main(cfg):
            calls.append(name)
            if name == "vocab" and os.environ.get("_TEST_FAIL_VOCAB"):
                raise RuntimeError("vocab failed")
            if name == "train":
                h = precompile.take_ahead()
                out = precompile.finish(h, log_to=Run.of(cfg).step_dir("train") / "p.log")
                return {"counts": {}, "precompile": out, "before": h and h.before}
            return {"counts": {}, **({"mode": "online"} if name == "extract" else {})}
        return main

    monkeypatch.setattr(pipeline, "_step_fn", fake)
    monkeypatch.setattr(precompile, "applies", lambda cfg, device: None)
    monkeypatch.setattr(precompile, "ahead_bytes", lambda cfg: 0)
    monkeypatch.setattr(precompile, "_free_bytes", lambda rank: None)
    monkeypatch.setattr(precompile, "_spawn_child", spawn)
    monkeypatch.setattr(gpu_release, "gpu_snapshot", lambda: [])
    yield SimpleNamespace(calls=calls, children=children)
    for p in children:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_pipeline_starts_the_online_precompile_before_tokenize_and_train_waits(
        ahead, tiny, tmp_path):
    """`drafter run` of an online config starts the child before tokenize (after generate: the
    GPU is back) and train waits for it; a rerun whose steps are all done starts nothing, nor
    does one whose train alone is stale (nothing to overlap); one whose vocab is stale starts
    it before vocab; an offline run never does."""
    cfg = cfg_for(tiny, run_dir=tmp_path / "run")
    out = pipeline.run_all(cfg)
    assert ahead.calls == ["prepare", "generate", "child", "tokenize", "vocab", "extract",
                           "train", "export", "evaluate"]
    m = read_json(Run(tmp_path / "run").manifest("train"))
    assert m["precompile"]["exit"] == 0 and m["precompile"]["graphs"] == 4
    assert m["before"] == "tokenize" and out[5]["precompile"]["graphs"] == 4
    assert (tmp_path / "run" / "train" / "p.log").exists()
    assert precompile._ahead is None and ahead.children[0].returncode == 0
    ahead.calls.clear()
    pipeline.run_all(cfg)
    assert ahead.calls == []
    pipeline.run_all(cfg_for(tiny, "train.lr=1e-4", run_dir=tmp_path / "run"),
                     steps=pipeline.STEPS[:6])
    assert ahead.calls == ["train"]
    ahead.calls.clear()
    pipeline.run_all(cfg_for(tiny, "vocab.draft_vocab_size=128", run_dir=tmp_path / "run"),
                     steps=pipeline.STEPS[:6])
    assert ahead.calls == ["child", "vocab", "extract", "train"]
    ahead.calls.clear()
    pipeline.run_all(cfg_for(tiny, "train.online=false", run_dir=tmp_path / "off"),
                     steps=pipeline.STEPS[:6])
    assert "child" not in ahead.calls and ahead.calls[-1] == "train"


def test_pipeline_starts_the_child_before_a_local_generate(ahead, tiny, tmp_path):
    """With generate in this process (engine drafter: the data engine leaves room beside it) the
    child starts before generate, so its compile overlaps the answers; with a server engine
    (transformers serve, vLLM) or generate off, before tokenize as before."""
    cfg = cfg_for(tiny, "generate.server.engine=drafter", run_dir=tmp_path / "local")
    pipeline.run_all(cfg, steps=pipeline.STEPS[:6])
    assert ahead.calls == ["prepare", "child", "generate", "tokenize", "vocab", "extract",
                           "train"]
    assert read_json(Run(tmp_path / "local").manifest("train"))["before"] == "generate"
    assert precompile._ahead is None and ahead.children[0].returncode == 0
    for name, engine in (("serve", "transformers"), ("vllm", "vllm")):
        ahead.calls.clear()
        pipeline.run_all(cfg_for(tiny, f"generate.server.engine={engine}",
                                 run_dir=tmp_path / name), steps=pipeline.STEPS[:6])
        assert ahead.calls == ["prepare", "generate", "child", "tokenize", "vocab", "extract",
                               "train"], engine
        assert read_json(Run(tmp_path / name).manifest("train"))["before"] == "tokenize"
    ahead.calls.clear()
    pipeline.run_all(cfg_for(tiny, "generate.server.engine=drafter", "generate.enabled=false",
                             run_dir=tmp_path / "off"), steps=pipeline.STEPS[:6])
    assert ahead.calls == ["prepare", "generate", "child", "tokenize", "vocab", "extract",
                           "train"]


def test_the_release_wait_counts_the_child_started_before_generate_as_ours(
        ahead, tiny, tmp_path, monkeypatch):
    """The child started before a local generate is a new process in this process's session
    holding GPU memory when the pipeline checks the GPU before train: the wait counts it as
    this process's own (its PID in `own`), so it neither waits for it nor counts its memory."""
    from drafter.core import gpu

    def one(used=0, procs=()):
        return [gpu.Gpu(0, "H200", "GPU-0", 140 * gpu.GiB, 140 * gpu.GiB - used, used,
                        [gpu.GpuProcess(pid, "python3", b, 0) for pid, b in procs])]

    def snapshot():  # before generate: nothing; then the child holds 20 GiB while it runs
        if not ahead.children:
            return one()
        return one(20 * gpu.GiB, [(ahead.children[0].pid, 20 * gpu.GiB)])

    real, seen, slept = gpu_release.wait_gpu_released, [], []

    def wait(baseline, **kw):
        seen.append(kw)
        return real(baseline, sleep=slept.append, **kw)

    monkeypatch.setattr(gpu_release, "gpu_snapshot", snapshot)
    monkeypatch.setattr(gpu_release, "wait_gpu_released", wait)
    monkeypatch.setenv("_TEST_NAP", "5")  # still running when the pipeline reaches train
    cfg = cfg_for(tiny, "generate.server.engine=drafter", run_dir=tmp_path / "run")
    pipeline.run_all(cfg, steps=pipeline.STEPS[:6])
    assert ahead.calls == ["prepare", "child", "generate", "tokenize", "vocab", "extract",
                           "train"]
    assert len(seen) == 1 and seen[0]["what"] == "drafter train" and slept == []
    assert ahead.children[0].pid in seen[0]["own"] and os.getpid() in seen[0]["own"]
    assert ahead.children[0].returncode == 0  # train waited for it, as before


def test_pipeline_stops_the_child_when_the_run_fails_before_train(ahead, tiny, tmp_path,
                                                                  monkeypatch):
    """A step failing between the child's start and train stops the child at once (the
    pipeline's finally), and nothing is left for a later train in this process."""
    monkeypatch.setenv("_TEST_FAIL_VOCAB", "1")
    monkeypatch.setenv("_TEST_NAP", "60")
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match="vocab failed"):
        pipeline.run_all(cfg_for(tiny, run_dir=tmp_path / "run"))
    assert ahead.calls == ["prepare", "generate", "child", "tokenize", "vocab"]
    assert ahead.children[0].poll() is not None and time.perf_counter() - t < 30
    assert precompile._ahead is None


def test_sigterm_while_train_waits_for_the_child_stops_it(ahead, tiny, tmp_path, monkeypatch):
    """A SIGTERM while train waits for the child started ahead of it (finish): the child is
    stopped at once, nothing is left for a later train, and train's failed.json says it was
    interrupted, naming the signal."""
    import signal
    import threading

    from drafter.run import lifecycle

    monkeypatch.setenv("_TEST_NAP", "60")
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.getsignal(s) for s in sigs}
    run = Run(tmp_path / "run")

    def term_in_train():  # once train waits for the child
        t_end = time.time() + 60
        while not run.started("train").exists() and time.time() < t_end:
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=term_in_train, daemon=True).start()
    t = time.perf_counter()
    try:
        with pytest.raises(lifecycle.Interrupted):
            pipeline.run_all(cfg_for(tiny, run_dir=run.root))
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        lifecycle._SIGNALLED.clear()
    assert ahead.calls[-1] == "train" and ahead.children[0].poll() is not None
    assert time.perf_counter() - t < 30 and precompile._ahead is None
    f = read_json(run.failed("train"))
    assert f["interrupted"] is True and "SIGTERM" in f["error"]


# --------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_online_run_trains_with_the_graphs_precompiled_ahead(smollm2_dir, shared_data, tmp_path):
    """On a GPU: `drafter run` of an online config into an empty Inductor cache: the child
    started before tokenize compiled train's graphs, train waited for it, and its first step
    loaded the layer pieces and the loss chunk whole and compiled nothing Inductor had not."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    from tests.test_train import cli, write_pipe_config
    cfg = write_pipe_config(tmp_path / "cfg.yaml", tmp_path / "run", shared_data, online=True,
                            max_steps=12, eval_every=6)
    cli(["run", str(cfg), "--until", "train"],
        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    m = Run(tmp_path / "run").read_manifest("train")
    assert m["precompile"]["exit"] == 0 and m["precompile"]["graphs"] >= 4, m["precompile"]
    assert m["precompile"]["started_before"] == "tokenize"
    c = m["warmup_compile"]
    assert c["fx_graph_cache"]["misses"] == 0, c
    assert [(r["graph"], r["result"]) for r in c["saved"]] == [
        ("pre", "loaded"), ("post", "loaded"), ("chunk_stats", "loaded")], c["saved"]
    assert "precompile: done" in (tmp_path / "run" / "train" / "precompile.log").read_text()
