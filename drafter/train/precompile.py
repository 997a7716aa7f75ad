"""Compile the train step's graphs before train runs: beside extract (offline), ahead of an
online train from the pipeline (online).

    drafter precompile CONFIG [key=value ...] [--device cuda:N]

A cold train spends most of its warm-up compiling (torch.compile: the layer pieces,
FlexAttention, the loss chunk; forward and backward), a large share of a short run
(BENCHMARKS.md, Training: `extract.precompile=false`). Inductor keeps what it compiles in its
caches on disk (TORCHINDUCTOR_CACHE_DIR, default /tmp/torchinductor_$USER), keyed by the graphs
and their inputs' shapes, dtypes and devices, not by their values: a process that runs the same
train step on random batches of the same shapes fills them, and train's warm-up then loads
instead of compiling.

Offline: extract starts this (`drafter precompile`, with --result for its figures) in a process
of its own (`start`) right after its GPU preflight, before it plans or loads the target, when the
GPU has room for both (extract's estimate plus memory.train_gpu_bytes), and waits for it before it
returns (`finish`; stopped when extract fails or keeps every shard). Its log is
extract/precompile.log and its figures are in extract's manifest ("precompile").

Online (train.online: extract stores nothing, the target runs in train): `drafter run` starts it
(`start_ahead`, drafter/run/pipeline.py) when the GPU has room for it and for the online train
beside it (`ahead_bytes`: the target and two train steps): before generate when generate runs in
this process and will run (engine drafter: the data engine sizes its KV pool from a share of the
free memory it finds, so the child fits beside it), else before tokenize (before vocab when
tokenize is done), once generate has given the GPU back (why: pipeline.AHEAD_OF_TRAIN). The
pipeline's GPU release wait counts it as its own (`ahead_pid`,
`ahead_running`). It is this process's until train's loop takes it (`take_ahead`) and waits for
it before its first step, with its set-up done and the online feeder capturing the first batches
meanwhile. Its log moves to train/precompile.log and its figures are train's manifest's
"precompile" (with `started_before`, the step). A run that fails or ends before train stops it
(`stop_ahead`). Neither a run whose generate (local), tokenize and vocab are done nor `drafter
train` alone starts one: started at train's own start it would overlap only train's set-up, and
train would wait longer for it than compiling takes; `drafter precompile CONFIG` by hand first
does it (and a rerun finds the caches its first train filled).

train.compile=false or extract.precompile=false turns both off. The child writes nothing else
in the run dir, and it gets SIGTERM from the kernel when its parent dies (`spawn`).

What it runs: the drafter this config trains, shaped from the target's config, the run's draft
vocab (vocab/vocab.safetensors; before the vocab step has written it, its shape: `shape_vocab`)
and extract's layer ids, set up as train sets it up (trainer.setup_model, trainer.device_setup),
with random weights, two optimizer steps on random micro-batches of train's shape (B =
batch_tokens // max_length rows of max_length tokens) in the store contract's dtypes
(docs/internals.md; online, with the features on the GPU as capture returns them, so that the
batches take the online feeder's path: `random_samples`), then one no-grad forward
(validation's graphs). Nothing applies on the CPU (train compiles only on a GPU).
The layer pieces (pre, post) and the loss chunk's statistics are compiled whole here (torch's
aot_compile, drafter/train/aot.py) and saved beside Inductor's cache, dynamo's guards and bytecode
included; train loads them instead of tracing them again (not under FSDP). FlexAttention
and validation's no-grad graphs go through torch.compile and Inductor's cache as before.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("drafter")

# torchrun's variables: the child is one process of its own, never a rank of the launcher's group
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
             "MASTER_PORT")
OPTIMIZER_STEPS = 2


def applies(cfg, device) -> str | None:
    """Why precompiling does not apply to this config on this device, or None when it does."""
    if not cfg.extract.precompile:
        return "extract.precompile=false"
    if not cfg.train.compile:
        return "train.compile=false"
    if cfg.train.method != "eagle3":
        return f"train.method={cfg.train.method} trains without compiled pieces"
    if getattr(device, "type", str(device)) != "cuda":
        return "train compiles only on a GPU"
    return None


# ---------------------------------------------------------------------------- the child: main
def random_samples(B: int, T: int, n_aux: int, ht: int, vocab: int, vd: int, teacher: str,
                   k: int, seed: int = 0, device=None) -> list[dict]:
    """B samples of T tokens (docs/internals.md, the contract's dtypes), one per row, a prompt
    out of the loss at the start of each. Their features are one random set, shared: only the
    shapes and dtypes reach the compiled graphs' keys. `device` (online training): the
    features (aux, in_vocab, the teacher) are there, as capture returns them (Capture.__call__:
    bf16 aux and hidden teacher, int64 top-k ids, float32 log-probs rounded to fp16), and the
    token fields on the host; then host_batches collates and aligns them there, as it does
    online. None (offline): all on the host, as store.Reader's samples are once widened."""
    import torch

    from drafter.features.capture import TOPK_LOGP_DTYPE

    g = torch.Generator().manual_seed(seed)
    feats = {"aux": torch.randn(T, n_aux, ht, generator=g).to(torch.bfloat16)}
    if teacher == "hidden":
        feats["teacher_hidden"] = torch.randn(T, ht, generator=g).to(torch.bfloat16)
    else:
        feats["teacher_topk_ids"] = torch.randint(0, vd, (T, k), generator=g)
        feats["teacher_topk_logp"] = torch.randn(T, k, generator=g).log_softmax(-1) \
            .to(TOPK_LOGP_DTYPE).float()
    if device is not None:
        feats = {n: v.to(device) for n, v in feats.items()}
    out = []
    for _ in range(B):
        mask = torch.ones(T, dtype=torch.long)
        mask[: int(torch.randint(1, max(2, T // 2), (), generator=g))] = 0
        in_vocab = torch.rand(T, generator=g) < 0.9
        out.append({"input_ids": torch.randint(0, vocab, (T,), generator=g), "loss_mask": mask,
                    "in_vocab": in_vocab if device is None else in_vocab.to(device), **feats})
    return out


def main(cfg, device: str | None = None) -> dict:
    """`drafter precompile`: compile train's graphs on `device` (default: the configured one,
    as a rank-0 train would use it; this process alone, no ranks). -> compile figures
    (trainer.compile_stats) and seconds, or {"skipped": why}."""
    import torch

    from drafter.core import target
    from drafter.core.dist import read_env

    dev = torch.device(device) if device else read_env(target.pick_device(cfg.target)).device
    why = applies(cfg, dev)
    if why is not None:
        log.info("precompile: nothing to do (%s)", why)
        return {"skipped": why}
    torch.cuda.set_device(dev)
    return run_steps(cfg, dev)


def shape_vocab(cfg, tconf):
    """(d2t, t2d) of the run's vocab (vocab/vocab.safetensors), or, before the vocab step has
    written it (an online run's precompile starts before generate or tokenize), maps of its
    shapes: the vocab step makes min(vocab.draft_vocab_size, V) ids whatever the counts, and
    the maps' values reach no graph (the drafter keeps them as buffers for export)."""
    import torch

    from drafter.core import target
    from drafter.core.rundir import Run
    from drafter.data import tokens

    path = Run.of(cfg).vocab()
    if path.exists():
        d2t, t2d, _ = tokens.load_vocab(path)
        return d2t, t2d
    V = target.vocab_size(tconf)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[: min(cfg.vocab.draft_vocab_size, V)] = True
    return torch.zeros(int(t2d.sum()), dtype=torch.long), t2d


def setup(cfg, dev) -> dict:
    """What train sets up, from the run's vocab (or its shape: shape_vocab) and the target's
    config alone: the drafter (random weights; a zero embedding table: train embeds on the host
    and casts, so neither its values nor its dtype reach a graph), a zero head, the model and
    optimizer (trainer.setup_model), autocast, and the shapes of train's batches."""
    import torch

    from drafter.core import target
    from drafter.core.dist import Dist
    from drafter.features import capture
    from drafter.train.losses import objective
    from drafter.train.trainer import build_drafter, device_setup, pick_attention, setup_model

    tc = cfg.train
    tconf = target.load_config(cfg.target)
    d2t, t2d = shape_vocab(cfg, tconf)
    layer_ids = capture.resolve_layer_ids(cfg.extract.layer_ids, target.num_layers(tconf),
                                         capture.layer_count(cfg))
    ht, vocab, vd = target.hidden_size(tconf), target.vocab_size(tconf), d2t.numel()
    drafter = build_drafter(cfg, tconf, layer_ids, d2t, t2d,
                            torch.zeros(vocab, ht, dtype=torch.bfloat16))
    dist = Dist(device=dev)
    amp = device_setup(tc, dev)
    attention = pick_attention(tc, dev)
    ttt, model, opt = setup_model(drafter, tc, dist, attention, saved="save",
                                  obj=objective(cfg))  # train's loss chunk: the same key
    # the target's own head: its rows' dtype, its logit scale and softcap (capture.Head)
    head = capture.Head(torch.zeros(vd, ht, dtype=target.pick_dtype(cfg.target, str(dev))),
                        *capture.logit_transform(tconf))
    return {"tc": tc, "dist": dist, "drafter": drafter, "ttt": ttt, "model": model, "opt": opt,
            "params": [p for p in ttt.parameters() if p.requires_grad], "head": head.to(dev),
            "attention": attention, "fused": attention == "flex",
            "autocast": torch.autocast(dev.type, dtype=amp) if amp
            else torch.autocast(dev.type, enabled=False),
            "B": tc.batch_tokens // tc.max_length, "T": tc.max_length, "n_aux": len(layer_ids),
            "ht": ht, "vocab": vocab, "vd": vd, "k": min(cfg.extract.topk, vd)}


def random_batch(cfg, S: dict, seed: int) -> dict:
    """One host micro-batch of train's shape (batches.host_batch) from random_samples: online
    (train.online) with its features on the device, as the online feeder builds it."""
    from drafter.train.batches import Source, host_batch

    B, T = S["B"], S["T"]
    src = Source.memory(random_samples(B, T, S["n_aux"], S["ht"], S["vocab"], S["vd"],
                                       cfg.extract.teacher, S["k"], seed=seed,
                                       device=S["dist"].device if S["tc"].online else None))
    return host_batch(src, [[i] for i in range(B)], B, T, S["tc"],
                      S["drafter"].embed_tokens.weight)


def run_steps(cfg, dev) -> dict:
    """OPTIMIZER_STEPS train steps on random batches, then one no-grad forward."""
    import torch

    from drafter.train import aot
    from drafter.train.batches import device_batch, model_inputs
    from drafter.train.trainer import compile_stats, sync_device, train_step

    t0 = time.perf_counter()
    log.info("precompile: setting up on %s", dev)  # extract's log has the process's start
    S = setup(cfg, dev)
    log.info("precompile: %s attention, %d rows × %d tokens, K=%d, Vd=%d, %s teacher, on %s",
             S["attention"], S["B"], S["T"], S["tc"].ttt_steps, S["vd"], cfg.extract.teacher,
             dev)
    for s in range(OPTIMIZER_STEPS):  # two loss-row counts: the loss chunk's dynamic graph
        hb = random_batch(cfg, S, seed=s)
        micro = iter([device_batch(hb, dev, S["head"], S["fused"])])
        train_step(S["model"], S["params"], S["opt"], micro, S["tc"], S["dist"], S["autocast"])
        sync_device(dev)
        log.info("precompile: step %d done at %.1f s", s + 1, time.perf_counter() - t0)
    with torch.no_grad(), S["autocast"]:  # validation's forward: its own graphs
        S["model"](**model_inputs(device_batch(hb, dev, S["head"], S["fused"])))
    sync_device(dev)
    c = compile_stats()  # process-wide: the child is a fresh process, so they are its own
    out = {"seconds": round(time.perf_counter() - t0, 2), "steps": s + 1, "device": str(dev),
           "cache_dir": aot.inductor_cache_dir(), "graphs": c["graphs"], "compile_s": c["seconds"],
           "fx_graph_cache": c["fx_graph_cache"], "aot_autograd_cache": c.get("aot_autograd_cache"),
           "saved": c["saved"]}
    log.info("precompile: done in %.1f s: %d graphs, %.1f s compiling, Inductor's cache %d hits "
             "/ %d misses", out["seconds"], c["graphs"], c["seconds"],
             c["fx_graph_cache"]["hits"], c["fx_graph_cache"]["misses"])
    if c["saved"]:
        log.info("precompile: saved whole (train loads them without tracing): %s", ", ".join(
            f"{r['graph']} {r['result']} {r['seconds']:.1f} s" for r in c["saved"]))
    return out


# ---------------------------------------------------------------------- the parent: start, finish
@dataclass
class Handle:
    proc: subprocess.Popen
    config: Path        # the resolved config, a temp file the child reads
    result: Path        # the child's figures (JSON), a temp file
    log_path: Path
    t0: float
    who: str = "extract"  # the step that waits for it (its log lines' prefix)
    keep_log: bool = True  # False: the log is a temp file too (finish's log_to moves it)
    before: str | None = None  # online: the step the pipeline started it before


def start(cfg, run, device, tconf, extract_bytes: int, rank: int = 0) -> Handle | None:
    """Start `drafter precompile` on this process's GPU, when it applies and the GPU has room
    for both extract (`extract_bytes`, its estimate) and a train step (memory.train_gpu_bytes
    for the target config `tconf`). None otherwise (logged when memory is the reason)."""
    why = applies(cfg, device)
    if why is not None:
        log.debug("extract: train's graphs are not precompiled: %s", why)
        return None
    try:
        return _start(cfg, run, device, tconf, extract_bytes, rank)
    except Exception as e:  # noqa: BLE001 - an aid to train: never the reason extract fails
        log.warning("extract: could not start precompiling train's graphs (%s: %s): train "
                    "compiles them in its warm-up", type(e).__name__, e)
        return None


def _start(cfg, run, device, tconf, extract_bytes: int, rank: int) -> Handle | None:
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    need = train_bytes(cfg, tconf)
    if free - extract_bytes < need:
        log.info("extract: train's graphs are not precompiled beside it: the GPU has %.1f GiB "
                 "free, extract needs ~%.1f GiB and a train step ~%.1f GiB (train compiles "
                 "them in its warm-up)", free / 2**30, extract_bytes / 2**30, need / 2**30)
        return None
    log_path = run.step_dir("extract") / log_name(rank)
    h = _spawn_child(cfg, device, log_path, "extract")
    log.info("extract: compiling train's graphs beside it (PID %d on %s, log %s)", h.proc.pid,
             device, log_path)
    return h


def train_bytes(cfg, tconf) -> int:
    """GPU bytes of one train step of this config (memory.train_gpu_bytes, one GPU)."""
    from drafter.core import target
    from drafter.train import memory

    dshape = memory.drafter_shape(cfg, tconf)
    return memory.train_gpu_bytes(cfg, dshape, 1, target.hidden_size(tconf),
                                  len(dshape["layer_ids"]))["total"]


def log_name(rank: int) -> str:
    return "precompile.log" if rank == 0 else f"precompile-rank{rank}.log"


def _spawn_child(cfg, device, log_path: Path | None, who: str) -> Handle:
    """`drafter precompile` of the resolved `cfg` on `device`, its config and figures in a
    temp folder of their own, its output appended to `log_path` (None: a temp log there too)."""
    from drafter.core import config as C

    tmp = Path(tempfile.mkdtemp(prefix="drafter-precompile-"))
    cfg_path, result = tmp / "config.yaml", tmp / "result.json"
    cfg_path.write_text(C.dump(cfg))
    keep = log_path is not None
    log_path = log_path if keep else tmp / "precompile.log"
    proc = spawn([sys.executable, "-m", "drafter.cli", "precompile", str(cfg_path), "--device",
                  str(device), "--result", str(result)], log_path)
    return Handle(proc, cfg_path, result, log_path, time.perf_counter(), who, keep)


def spawn(cmd: list[str], log_path: Path) -> subprocess.Popen:
    """`cmd` as a process of its own: output appended to `log_path`, no torchrun variables (it
    is never a rank of the launcher's group), and SIGTERM from the kernel when this process
    dies, even by kill -9 (supervisor._die_with, as for servers), so nothing outlives its
    parent (extract, or the pipeline of an online run) on the GPU."""
    from drafter.serve.supervisor import _die_with

    env = {k: v for k, v in os.environ.items()
           if k not in _DIST_ENV and not k.startswith("TORCHELASTIC_")}
    with open(log_path, "ab") as f:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                env=env, preexec_fn=_die_with(os.getpid()))


def finish(h: Handle | None, timeout: float = 900.0, ok: bool = True,
           log_to: Path | None = None) -> dict | None:
    """Wait for the child (at most `timeout` s; `ok` False, its step failed: stop it now) and
    return its figures for the waiting step's manifest: the child's own (run_steps: seconds
    from its setup to its end, compile_s, graphs, the caches' hits and misses) with exit,
    wall_s (from its start: imports included) and waited_s (how long the step waited for it).
    `log_to`: where a temp log goes (train's folder, for a child started ahead of it)."""
    if h is None:
        return None
    t = time.perf_counter()
    try:
        if not ok:
            _stop(h.proc)
        else:
            try:
                h.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s: precompiling still runs after %.0f s: stopped (train compiles "
                            "what is missing; see %s)", h.who, timeout, log_to or h.log_path)
                _stop(h.proc)
    except BaseException:  # interrupted while waiting (Ctrl-C, SIGTERM): nothing outlives it
        _stop(h.proc)
        raise
    out = {"exit": h.proc.returncode, "wall_s": round(time.perf_counter() - h.t0, 2),
           "waited_s": round(time.perf_counter() - t, 2), "log": str(h.log_path)}
    try:
        out.update(json.loads(h.result.read_text()))
    except (OSError, ValueError):
        pass
    if not h.keep_log and log_to is not None:
        try:
            shutil.move(str(h.log_path), str(log_to))
            out["log"] = str(log_to)
        except OSError as e:
            log.warning("%s: could not keep precompile's log (%s)", h.who, e)
    if ok and out["exit"] == 0:
        log.info("%s: train's graphs precompiled: %s graphs, %s s compiling, the process "
                 "%.1f s from its start (%s waited %.1f s for it)", h.who,
                 out.get("graphs", "?"), out.get("compile_s", "?"), out["wall_s"], h.who,
                 out["waited_s"])
    elif ok:
        log.warning("%s: precompiling failed (exit %s, see %s): train compiles its graphs "
                    "in its warm-up", h.who, out["exit"], out["log"])
    for p in (h.result, h.config) + (() if h.keep_log else (h.log_path,)):
        p.unlink(missing_ok=True)
    try:
        h.config.parent.rmdir()
    except OSError:
        pass
    return out


def _stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ------------------------------------------------- online: started by the pipeline, ahead of train
# The child an online `drafter run` started for this process's train step (start_ahead), until
# train takes it (take_ahead) or the pipeline stops it (stop_ahead).
_ahead: Handle | None = None


def start_ahead(cfg, before: str) -> Handle | None:
    """An online run's precompile: `drafter precompile` started by the pipeline before the step
    `before`, on the GPU this process's train uses, when it applies and the GPU has room for it
    and for the online train beside it (the target by extract's estimate, and two train steps).
    `before`: generate when generate runs in this process, else tokenize or vocab
    (pipeline.starts_precompile). Kept for train (take_ahead); None when it does not start
    (said in the log)."""
    global _ahead
    from drafter.core import target
    from drafter.core.dist import read_env

    stop_ahead()
    try:
        d = read_env(target.pick_device(cfg.target))
        why = applies(cfg, d.device)
        if why is not None:
            log.debug("train's graphs are not precompiled ahead of it: %s", why)
            return None
        need, free = ahead_bytes(cfg), _free_bytes(d.device.index or 0)
        if free is not None and free < need:
            log.info("train's graphs are not precompiled ahead of it: the GPU has %.1f GiB "
                     "free, the target and two train steps need ~%.1f GiB (train compiles them "
                     "in its warm-up)", free / 2**30, need / 2**30)
            return None
        _ahead = _spawn_child(cfg, d.device, None, "train")
        _ahead.before = before
    except Exception as e:  # noqa: BLE001 - an aid to train: never the reason a run fails
        log.warning("could not start precompiling train's graphs (%s: %s): train compiles them "
                    "in its warm-up", type(e).__name__, e)
        return None
    log.info("%s: train's graphs compile in a process of their own from here until train's "
             "first step (PID %d on %s; its log goes to train's folder)", before, _ahead.proc.pid,
             d.device)
    return _ahead


def ahead_bytes(cfg) -> int:
    """GPU bytes an online run's precompile needs free: its own train step, and the online
    train that loads the target and starts capturing beside it (extract's estimate for the
    target, plus that train's step with its features in flight)."""
    import torch

    from drafter.core import target
    from drafter.features import capture

    tconf = target.load_config(cfg.target)
    dev = target.pick_device(cfg.target)
    dtype_bytes = torch.finfo(target.pick_dtype(cfg.target, dev)).bits // 8
    tgt = capture.estimate_gpu_bytes(tconf, dtype_bytes, cfg.extract.batch_tokens,
                                     len(capture.resolve_layer_ids(cfg.extract.layer_ids,
                                                                   target.num_layers(tconf),
                                                                   capture.layer_count(cfg))))
    return tgt["total"] + 2 * train_bytes(cfg, tconf)


def _free_bytes(index: int) -> int | None:
    """Free bytes of CUDA device `index` by NVML (None when unknown). Not torch.cuda: the
    pipeline process must not set up CUDA before tokenize forks its workers."""
    from drafter.core import gpu

    gpus = gpu.devices()
    visible = gpu.visible_indices(gpus)
    if index >= len(visible):
        return None
    return next((g.free for g in gpus if g.index == visible[index]), None)


def ahead_pid() -> int | None:
    """The PID of the child start_ahead started, while it runs (None otherwise): one of this
    process's own for the GPU release wait (gpu_release.wait_gpu_released's `own`)."""
    h = _ahead
    return h.proc.pid if h is not None and h.proc.poll() is None else None


def ahead_running(limit: float = 900.0) -> bool:
    """Whether the child start_ahead started still runs, for at most `limit` s from its start
    (finish's own limit): the release wait does not time its polls meanwhile, so this bounds
    it."""
    h = _ahead
    return h is not None and h.proc.poll() is None and time.perf_counter() - h.t0 < limit


def take_ahead() -> Handle | None:
    """The child start_ahead started in this process, now the caller's (train waits for it with
    finish), or None."""
    global _ahead
    h, _ahead = _ahead, None
    return h


def stop_ahead() -> None:
    """Stop a child that no train took (the run failed or stopped before train): the pipeline's
    last word."""
    h = take_ahead()
    if h is not None:
        log.info("train's graphs: the precompile started before %s is stopped (no train took "
                 "it)", h.before)
        finish(h, ok=False)
