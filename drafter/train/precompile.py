"""Compile the train step's graphs before train runs, while extract runs.

    drafter precompile CONFIG [key=value ...] [--device cuda:N]

A cold train spent about 20 of its first seconds compiling (torch.compile: the layer pieces,
FlexAttention, the loss chunk; forward and backward), a quarter of a 500-step SmolLM2 run on an
H200. Inductor keeps what it compiles in its caches on disk (TORCHINDUCTOR_CACHE_DIR, default
/tmp/torchinductor_$USER), keyed by the graphs and their inputs' shapes, dtypes and devices,
not by their values: a process that runs the same train step on random batches of the same
shapes fills them, and train's warm-up then loads instead of compiling.

extract starts this (`drafter precompile`, with --result for its figures) in a process of its own
(`start`) right after its GPU preflight, before it plans or loads the target, when the GPU has
room for both (extract's estimate plus memory.train_gpu_bytes), and waits for it before it returns
(`finish`; stopped when extract fails or keeps every shard); extract.precompile=false turns it
off. Its log is extract/precompile.log and
its figures are in extract's manifest ("precompile"). It writes nothing else in the run dir.

What it runs: the drafter this config trains, shaped from the target's config, the run's draft
vocab (vocab/vocab.safetensors) and extract's layer ids, set up as train sets it up
(trainer.setup_model, trainer.device_setup), with random weights, two optimizer steps on random
micro-batches of train's shape (B = batch_tokens // max_length rows of max_length tokens) in the
store contract's dtypes (docs/internals.md), then one no-grad forward (validation's graphs).
Nothing applies on the CPU (train compiles only on a GPU) or online (nothing to overlap).
The layer pieces (pre, post) and the loss chunk's statistics are compiled whole here (torch's
aot_compile, drafter/train/aot.py) and saved beside Inductor's cache, dynamo's guards and bytecode
included; train loads them instead of tracing them again (train.saved_graphs). FlexAttention
and validation's no-grad graphs go through torch.compile and Inductor's cache as before.
"""
from __future__ import annotations

import json
import logging
import os
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
    if cfg.train.online:
        return "train.online: the target runs beside the drafter, nothing to overlap"
    if not cfg.train.compile:
        return "train.compile=false"
    if getattr(device, "type", str(device)) != "cuda":
        return "train compiles only on a GPU"
    return None


# ---------------------------------------------------------------------------- the child: main
def random_samples(B: int, T: int, n_aux: int, ht: int, vocab: int, vd: int, teacher: str,
                   k: int, seed: int = 0) -> list[dict]:
    """B samples of T tokens (docs/internals.md, the contract's dtypes), one per row, a prompt
    out of the loss at the start of each. Their features are one random set, shared: only the
    shapes and dtypes reach the compiled graphs' keys."""
    import torch

    g = torch.Generator().manual_seed(seed)
    feats = {"aux": torch.randn(T, n_aux, ht, generator=g).to(torch.bfloat16)}
    if teacher == "hidden":
        feats["teacher_hidden"] = torch.randn(T, ht, generator=g).to(torch.bfloat16)
    else:
        feats["teacher_topk_ids"] = torch.randint(0, vd, (T, k), generator=g)
        feats["teacher_topk_logp"] = torch.randn(T, k, generator=g).log_softmax(-1)
    out = []
    for b in range(B):
        mask = torch.ones(T, dtype=torch.long)
        mask[: int(torch.randint(1, max(2, T // 2), (), generator=g))] = 0
        out.append({"input_ids": torch.randint(0, vocab, (T,), generator=g), "loss_mask": mask,
                    "in_vocab": torch.rand(T, generator=g) < 0.9, **feats})
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


def setup(cfg, dev) -> dict:
    """What train sets up, from the run's vocab and the target's config alone: the drafter
    (random weights; a zero embedding table: train embeds on the host and casts, so neither
    its values nor its dtype reach a graph), a zero head, the model and optimizer
    (trainer.setup_model), autocast, and the shapes of train's batches."""
    import torch

    from drafter.core import target
    from drafter.core.dist import Dist
    from drafter.core.rundir import Run
    from drafter.data import tokens
    from drafter.features import capture
    from drafter.train.trainer import build_drafter, device_setup, pick_attention, setup_model

    run, tc = Run.of(cfg), cfg.train
    d2t, t2d, _ = tokens.load_vocab(run.require(run.vocab(), "vocab"))
    tconf = target.load_config(cfg.target)
    layer_ids = capture.resolve_layer_ids(cfg.extract.layer_ids, target.num_layers(tconf))
    ht, vocab, vd = target.hidden_size(tconf), target.vocab_size(tconf), d2t.numel()
    drafter = build_drafter(cfg, tconf, layer_ids, d2t, t2d,
                            torch.zeros(vocab, ht, dtype=torch.bfloat16))
    dist = Dist(device=dev)
    amp = device_setup(tc, dev)
    attention = pick_attention(tc, dev)
    ttt, model, opt = setup_model(drafter, tc, dist, attention, saved="save")
    head = capture.Head(torch.zeros(vd, ht, dtype=target.pick_dtype(cfg.target, str(dev))))
    return {"tc": tc, "dist": dist, "drafter": drafter, "ttt": ttt, "model": model, "opt": opt,
            "params": [p for p in ttt.parameters() if p.requires_grad], "head": head.to(dev),
            "attention": attention, "fused": attention == "flex",
            "autocast": torch.autocast(dev.type, dtype=amp) if amp
            else torch.autocast(dev.type, enabled=False),
            "B": tc.batch_tokens // tc.max_length, "T": tc.max_length, "n_aux": len(layer_ids),
            "ht": ht, "vocab": vocab, "vd": vd, "k": min(cfg.extract.topk, vd)}


def random_batch(cfg, S: dict, seed: int) -> dict:
    """One host micro-batch of train's shape (batches.host_batch) from random_samples."""
    from drafter.train.batches import Source, host_batch

    B, T = S["B"], S["T"]
    src = Source.memory(random_samples(B, T, S["n_aux"], S["ht"], S["vocab"], S["vd"],
                                       cfg.extract.teacher, S["k"], seed=seed))
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

    from drafter.core import config as C
    from drafter.core import target
    from drafter.train import memory

    dshape = memory.drafter_shape(cfg, tconf)
    need = memory.train_gpu_bytes(cfg, dshape, 1, target.hidden_size(tconf),
                                len(dshape["layer_ids"]))["total"]
    free, _ = torch.cuda.mem_get_info(device)
    if free - extract_bytes < need:
        log.info("extract: train's graphs are not precompiled beside it: the GPU has %.1f GiB "
                 "free, extract needs ~%.1f GiB and a train step ~%.1f GiB (train compiles "
                 "them in its warm-up)", free / 2**30, extract_bytes / 2**30, need / 2**30)
        return None
    tmp = Path(tempfile.mkdtemp(prefix="drafter-precompile-"))
    cfg_path, result = tmp / "config.yaml", tmp / "result.json"
    cfg_path.write_text(C.dump(cfg))
    log_path = run.step_dir("extract") / ("precompile.log" if rank == 0
                                          else f"precompile-rank{rank}.log")
    proc = spawn([sys.executable, "-m", "drafter.cli", "precompile", str(cfg_path), "--device",
                  str(device), "--result", str(result)], log_path)
    log.info("extract: compiling train's graphs beside it (PID %d on %s, log %s)", proc.pid,
             device, log_path)
    return Handle(proc, cfg_path, result, log_path, time.perf_counter())


def spawn(cmd: list[str], log_path: Path) -> subprocess.Popen:
    """`cmd` as a process of its own: output appended to `log_path`, no torchrun variables (it
    is never a rank of the launcher's group), and SIGTERM from the kernel when this process
    dies, even by kill -9 (supervisor._die_with, as for servers), so nothing outlives extract
    on the GPU."""
    from drafter.serve.supervisor import _die_with

    env = {k: v for k, v in os.environ.items()
           if k not in _DIST_ENV and not k.startswith("TORCHELASTIC_")}
    with open(log_path, "ab") as f:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                env=env, preexec_fn=_die_with(os.getpid()))


def finish(h: Handle | None, timeout: float = 900.0, ok: bool = True) -> dict | None:
    """Wait for the child (at most `timeout` s; `ok` False, extract failed: stop it now) and
    return its figures for extract's manifest: the child's own (run_steps: seconds from its
    setup to its end, compile_s, graphs, the caches' hits and misses) with exit, wall_s (from
    its start: imports included) and waited_s (how long extract waited for it at its end)."""
    if h is None:
        return None
    t = time.perf_counter()
    if not ok:
        _stop(h.proc)
    else:
        try:
            h.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("extract: precompiling still runs after %.0f s: stopped (train compiles "
                        "what is missing; see %s)", timeout, h.log_path)
            _stop(h.proc)
    out = {"exit": h.proc.returncode, "wall_s": round(time.perf_counter() - h.t0, 2),
           "waited_s": round(time.perf_counter() - t, 2), "log": str(h.log_path)}
    try:
        out.update(json.loads(h.result.read_text()))
    except (OSError, ValueError):
        pass
    if ok and out["exit"] == 0:
        log.info("extract: train's graphs precompiled: %s graphs, %s s compiling, the process "
                 "%.1f s from its start (extract waited %.1f s for it at its end)",
                 out.get("graphs", "?"), out.get("compile_s", "?"), out["wall_s"],
                 out["waited_s"])
    elif ok:
        log.warning("extract: precompiling failed (exit %s, see %s): train compiles its graphs "
                    "in its warm-up", out["exit"], h.log_path)
    for p in (h.result, h.config):
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
