"""`drafter plan CONFIG`: tokens, disk bytes, GPU memory and time of every step, before any load.

Reads   what drafter.run.counts counts: the target's config.json or GGUF metadata (never its
        weights), the run directory when it has something (token files, conversations, earlier
        manifests), else the sources and the `plan` section; and the GPUs (NVML) and free disk.
Writes  nothing.
Command drafter plan CONFIG [key=value ...] [--json]

Every figure names where it comes from: `measured` (this run directory), `config` (the `plan`
section) or `estimated` (the formulas below, documented in docs/operations.md):

- parameters (drafter.run.counts): the model built once on the meta device (target.meta_model,
  with target.trust_remote_code for a model that ships its own code); MoE active parameters =
  total - routed experts * (1 - k/E).
- weights: core.weights.weight_bytes: the Linear weights config.json's quantization_config covers at
  its stored bits (compressed-tensors groups with their scales, GPTQ, AWQ, FP8 blocks), the rest
  at the dtype the target loads at; the plan names the source of the figure.
- refused: what extract's check before loading refuses too (capture.transformers_refusal): a
  MoE under extract.tp (transformers' tensor parallelism leaves routed experts whole on every
  rank: this plan counts them whole) or weights per GPU above a GPU's memory.
- disk: store.bytes_per_token for each storage option times the tokens extract stores (train +
  val); the reference layout's 8*Ht+16 for comparison.
- GPU memory per rank: capture.estimate_gpu_bytes for the target steps; for train, the drafter's
  weights + grads + AdamW (16 bytes per trainable parameter, / GPUs under FSDP) + activations
  and the batch's token embeddings (+ the target and the micro-batches' captured features in
  flight, online). The frozen embedding table stays in host memory: its bytes are printed on
  train's line, outside the GPU figure (memory.train_gpu_bytes' host_embedding).
- time: tokens / tokens-per-second. Prefill and training: mfu * gpu_tflops over 2 (prefill) or 6 *
  ttt_steps (training) FLOPs per parameter and token. Extract adds the time of storing a token,
  bytes_per_token / store_gbps: the store does not overlap the forward
  (BENCHMARKS.md#kimi-k25-shape). Decoding is bandwidth bound: a step of batch B reads the dense
  weights and the share 1-(1-k/E)^B of the experts it touches. Weight loading: bytes / load_gbps.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path

from drafter.core import target
from drafter.core.rundir import Run, cache_dir
from drafter.core.weights import weight_bytes
from drafter.features import capture, store
from drafter.run import chunkplan
from drafter.run.chunkplan import chunk_mode, train_tokens, vllm_gpus
from drafter.run.chunkplan import dur as _dur
from drafter.run.counts import (
    CHARS_PER_TOKEN,
    data_counts,
    describe_target,
    dtype_bytes,
    measured_throughputs,
    param_counts,
    target_config,
)
from drafter.train import budget
from drafter.train.memory import drafter_shape, passes, train_gpu_bytes

log = logging.getLogger("drafter")

GiB = 1 << 30
# tokenize throughput per worker when nothing is measured (chat template + fast tokenizer):
# measured 51k tokens/s with one worker on a shared 2-core CPU (SmolLM2 tokenizer, 1.7 M tokens).
TOKENIZE_TOKENS_PER_S_PER_WORKER = 50_000
# Free space kept in reserve below which a disk warning fires.
DISK_MARGIN = 0.05
# Usable share of a GPU's memory (the CUDA context, NCCL buffers and the allocator take the rest).
GPU_USABLE = 0.95


# ---------------------------------------------------------------------------------- estimates
def decode_tokens_per_s(p, batch: int, params: dict, weights: dict, gpus: int) -> float:
    """Bandwidth-bound decoding: one step of `batch` sequences reads the dense weights and the
    experts that its tokens route to (share 1-(1-k/E)^batch), spread over `gpus`; `weights`:
    core.weights.weight_bytes (bytes as stored)."""
    routed = weights["routed_bytes"]
    dense = weights["bytes"] - routed
    e, k = params["experts"], params["experts_per_token"]
    touched = 1 - (1 - k / e) ** batch if e else 1.0
    step_bytes = (dense + routed * touched) / gpus
    step_s = step_bytes / (p.gpu_hbm_tbps * 1e12 * p.hbm_efficiency)
    return batch / step_s


def _pick(configured, measured: tuple | None, estimate, per_gpu: bool, gpus: int):
    """(tokens/s for the whole run, source): config > measured (scaled per GPU) > estimate."""
    if configured is not None:
        return configured * (gpus if per_gpu else 1), "config"
    if measured is not None:
        tps, world = measured
        return (tps / world * gpus if per_gpu else tps), "measured"
    if estimate is None:
        return None, "unknown"
    return estimate * (gpus if per_gpu else 1), "estimated"


def _free_bytes(path: Path) -> tuple[Path, int]:
    """Free bytes on the file system that holds `path` (its first existing ancestor)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return p, shutil.disk_usage(p).free


def _gpu_env(p) -> tuple[int, float | None, str]:
    from drafter.core import gpu

    devs = gpu.devices()
    n = p.gpus or (len(gpu.visible_indices(devs)) if devs else None) or 1
    if p.gpu_memory_gib is not None:
        return n, p.gpu_memory_gib * GiB, "config (plan.gpu_memory_gib)"
    if devs:
        return n, float(min(g.total for g in devs)), "measured (NVML)"
    return n, None, "unknown (no GPU here: set plan.gpu_memory_gib)"


# ------------------------------------------------------------------------------------ the plan
def storage(cfg, f: dict) -> dict:
    """Bytes per token and in total of every storage option over what extract stores."""
    ec, ht, tokens = cfg.extract, f["ht"], f["data"]["tokens"]
    options = []
    for aux in ("bf16", "fp8"):
        for teacher in ("hidden", "topk"):
            bpt = store.bytes_per_token(ht, f["n_aux"], aux, teacher, ec.topk, f["vd"])
            options.append({"aux_dtype": aux, "teacher": teacher, "bytes_per_token": bpt,
                            "bytes": bpt * tokens, "chosen": not cfg.train.online
                            and (aux, teacher) == (ec.aux_dtype, ec.teacher)})
    ref = store.reference_bytes_per_token(ht)
    return {"tokens": tokens, "hidden_size": ht, "n_aux": f["n_aux"], "topk": ec.topk,
            "draft_vocab_size": f["vd"], "options": options,
            "reference": {"bytes_per_token": ref, "bytes": ref * tokens},
            "online": cfg.train.online, "online_ok": online_ok(cfg)}


def disk(cfg, f: dict, st: dict, ch: dict | None, warnings: list[str]) -> dict:
    """Bytes each step leaves in the run dir (in chunks, what the budget holds at most:
    chunkplan.at's need), and the target's weights in a cache; warns when the file systems
    have less free space, naming ways that fit it: a budget (max_disk_gib) of the free space
    when the budget or chunks would, storage options that alone fit, online training."""
    run, ds = Run.of(cfg), f["drafter"]
    out = {
        "data": f["disk_data"],
        "extract": next((o["bytes"] for o in st["options"] if o["chosen"]), 0),
        # kept checkpoints + the best one + the one being written
        "train": budget.checkpoint_bytes(ds) * (cfg.train.keep_checkpoints + 2),
        "export": budget.export_bytes(cfg, ds),
    }
    spooled = 0  # in chunks, what the spool holds: on its own file system where it has one
    if ch is not None:
        h = ch["held"]
        spooled = ch["reserve_bytes"] + ch["window"] * min(ch["chunk_bytes"],
                                                           ch["extracted_bytes"])
        out = {"data": h["data"], "extract": ch["val_bytes"] + ch["head_bytes"] + spooled
               + h["engine_states"], "train": h["checkpoints"] + h["logs"],
               "export": h["export"]}
    out["total"] = sum(out.values())
    run_fs, run_free = _free_bytes(run.root)
    spec, cache_path, cache_need = cfg.target.model, None, 0
    if spec.startswith("builtin:") or f["gguf_bytes"] is not None:
        cache_path, cache_need = cache_dir() / "models", f["params"]["total"] * 2  # bf16 folder
    elif not Path(os.path.expanduser(spec)).is_dir():  # an HF id: downloaded into the hub cache
        hf_home = os.environ.get("HF_HOME", "~/.cache/huggingface")
        cache_path = Path(os.environ.get("HF_HUB_CACHE") or f"{hf_home}/hub").expanduser()
        stored = str(getattr(f["config"], "torch_dtype", None) or "bfloat16")
        cache_need = weight_bytes(f["config"], 4 if "32" in stored else 2,
                                         f["meta"])["bytes"]
    cache_fs, cache_free = _free_bytes(cache_path) if cache_path else (None, None)
    same_fs = cache_fs is not None and _same_fs(cache_fs, run_fs)
    spool_fs, spool_free = _free_bytes(run.spool())
    apart = ch is not None and not _same_fs(spool_fs, run_fs)
    need = out["total"] - (spooled if apart else 0) + (cache_need if same_fs else 0)
    # the bytes the run may take on run_dir's file system
    room = run_free * (1 - DISK_MARGIN) - (cache_need if same_fs else 0)
    if need > run_free * (1 - DISK_MARGIN):
        big = max(("extract", "train", "data"), key=lambda k: out[k])
        if ch is not None:
            hint = budget_hint(ch, room) if not apart else \
                " Free space, or move run_dir to a larger file system."
        else:
            hint = storage_hint(cfg, f, st, room - (out["total"] - out["extract"]), room)
        warnings.append(f"disk: {run.root} needs ~{_size(need)} ({big} {_size(out[big])}), "
                        f"{_size(run_free)} free on {run_fs}.{hint}")
    if apart and spooled > spool_free * (1 - DISK_MARGIN):
        hint = budget_hint(ch, ch["fixed_bytes"] - ch["reserve_bytes"] + spool_free
                           * (1 - DISK_MARGIN), "extract.spool")
        warnings.append(f"disk: the spool {run.spool()} holds up to ~{_size(spooled)}, "
                        f"{_size(spool_free)} free on {spool_fs}.{hint}")
    if cache_need and not same_fs and cache_need > cache_free * (1 - DISK_MARGIN):
        warnings.append(f"disk: the target's weights need ~{_size(cache_need)} in {cache_path}, "
                        f"{_size(cache_free)} free on {cache_fs}")
    return {**out, "run_dir_free": run_free, "run_dir_fs": str(run_fs),
            "cache_path": str(cache_path) if cache_path else None, "cache_need": cache_need,
            "cache_free": cache_free, "spool_fs": str(spool_fs) if apart else None,
            "spool_free": spool_free if apart else None}


def _same_fs(a: Path, b: Path) -> bool:
    return os.stat(a).st_dev == os.stat(b).st_dev


def budget_hint(ch: dict, room: float, where: str = "run_dir") -> str:
    """A budget (max_disk_gib) within `room` bytes, when one holds an optimizer step (what
    `at` then needs is at most the budget); else the smallest budget that trains."""
    fit = budget.gib_at_most(room)
    if fit is not None and float(fit.replace(",", "")) * GiB >= ch["least_budget"]:
        return f" max_disk_gib={fit} fits the free space."
    return (f" The smallest budget that trains (max_disk_gib "
            f"{budget.gib_at_least(ch['least_budget'])}) is more than the free space: free "
            f"space, or move {where} to a larger file system.")


def online_ok(cfg) -> bool:
    """Whether the config takes train.online=true (configload refuses it with a vLLM extract
    or a disk budget)."""
    return cfg.extract.engine == "drafter" and cfg.max_disk_gib is None


def storage_hint(cfg, f: dict, st: dict, extract_room: float, room: float) -> str:
    """Ways that fit, among what the config accepts (`extract_room`: the bytes left for
    extract's features, `room`: for the whole run): each smaller storage option that alone
    fits (or the two together), chunks within the room (max_disk_gib, when one optimizer step
    fits it), online training where the target runs in transformers (the config refuses it with
    extract.engine vllm or chunks). None: free space, or a larger file system."""
    ec, ways = cfg.extract, []
    now = next(o["bytes"] for o in st["options"]
               if (o["aux_dtype"], o["teacher"]) == (ec.aux_dtype, ec.teacher))
    for o in st["options"]:  # each smaller one that fits; both only where neither alone does
        change = [f"extract.{k}={o[k]}" for k in ("aux_dtype", "teacher")
                  if o[k] != getattr(ec, k)]
        if change and o["bytes"] < now and o["bytes"] <= extract_room:
            ways.append(change)
    ways = [w for w in ways if not any(set(x) < set(w) for x in ways)]
    texts = [" + ".join(w) for w in sorted(ways, key=len)]
    least = None
    if cfg.max_disk_gib is None and not cfg.train.online:
        least = chunkplan.least(chunkplan.figures(cfg, f, st, None, "one process"))
        fit = budget.gib_at_most(room)
        if fit is not None and float(fit.replace(",", "")) * GiB >= least:
            texts.append(f"chunks within the room, max_disk_gib={fit} (docs/extract.md)")
            least = None
    if online_ok(cfg) and extract_room >= 0:
        texts.append("none at all with train.online=true")
    if not texts:
        return " Free space, or move run_dir to a larger file system" + (
            f" (chunks within a budget, max_disk_gib, need {_size(least)} at the least)"
            if least else "") + "."
    return f" Ways that fit: {', '.join(texts[:-1])}{' or ' if len(texts) > 1 else ''}" \
        f"{texts[-1]}."


def where_steps_run(cfg, draft_layer: str = "llama draft layer") -> dict:
    """Where each step runs, for the plan's reader (train: which drafter)."""
    s = cfg.generate.server
    eng = vllm_gpus(cfg)
    return {"generate": "skipped" if not cfg.generate.enabled else "drafter's data engine"
            if s.engine == "drafter" else f"{s.engine} server",
            "extract": "online (inside train)" if cfg.train.online else
            f"vLLM over {eng} GPU(s)" if cfg.extract.engine == "vllm" else
            "drafter's capture (transformers)" + (" (tp under torchrun)" if cfg.extract.tp
                                                  else ""),
            "train": f"drafter, {draft_layer}" + (
                " beside the target in transformers" if cfg.train.online
                else ", a chunk at a time" if chunk_mode(cfg) else ", from the stored shards"),
            "evaluate": {"vllm": f"vLLM over {eng} GPU(s)", "both": "drafter's evaluator and "
                         f"vLLM over {eng} GPU(s)", "drafter": "drafter's evaluator "
                         "(transformers)"}[cfg.evaluate.engine]}


def gpu_memory(cfg, f: dict, warnings: list[str], refused: list[str]) -> dict:
    """Bytes per GPU of each step that uses one; warns when above the GPUs' memory, and says
    what extract's check before loading would refuse (capture.transformers_refusal)."""
    gpus, weights, w = f["gpus"], f["weights"], f["w"]
    tp = gpus if cfg.extract.tp else 1  # extract, online train and evaluate shard alike
    ext = capture.estimate_gpu_bytes(f["config"], f["nbytes"], cfg.extract.batch_tokens,
                                     f["n_aux"], tp=tp, weights=w)
    ev = capture.estimate_gpu_bytes(f["config"], f["nbytes"], cfg.evaluate.max_new_tokens + 2048,
                                    f["n_aux"], tp=tp, weights=w)
    tr = train_gpu_bytes(cfg, f["drafter"], gpus, f["ht"], f["n_aux"])
    online = cfg.train.online
    gen_tp = f["gen_tp"]
    mem = {
        "generate": {"total": weights // gen_tp if gen_tp else 0, "tp": gen_tp,
                     "note": "weights; the engine fills the rest with KV cache" if gen_tp
                     else "external server"},
        "extract": {**ext, "tp": tp} if not online else {"total": 0, "tp": 0, "note": "online"},
        "train": {**tr, "target": ext["total"] if online else 0, "tp": tp if online else 1,
                  "total": tr["total"] + (ext["total"] if online else 0),
                  "note": f"+ {_size(tr['host_embedding'])} host memory: the frozen embedding "
                          f"table (not on the GPU)"},
        "evaluate": {**ev, "tp": tp, "total": ev["total"] + f["drafter"]["total"] * 2},
    }
    eng = vllm_gpus(cfg)
    if cfg.extract.engine == "vllm" and not online:
        # inside vLLM: tensor/expert/pipeline parallelism spreads every weight, experts
        # included, and vLLM fills what is left with its KV cache (as generate's server);
        # drafter's side holds one call's captured states and a logits chunk
        mem["extract"] = {"weights": weights // eng, "capture": ext["capture"],
                          "logits": ext["logits"], "tp": eng,
                          "total": weights // eng + ext["capture"] + ext["logits"],
                          "note": f"inside vLLM over {eng} GPU(s) (target.engine_args); "
                                  f"vLLM fills the rest with KV cache"}
    if cfg.evaluate.engine == "vllm":
        mem["evaluate"] = {"total": weights // eng + f["drafter"]["total"], "tp": eng,
                           "note": f"inside vLLM over {eng} GPU(s), the drafter beside it"}
    have = f["gpu_memory"]
    loads = (cfg.extract.engine == "drafter" and not online) or online \
        or cfg.evaluate.engine != "vllm"  # a step that loads the target in transformers
    why = capture.transformers_refusal(f["config"], w, cfg.extract.tp, tp, have) \
        if loads else None
    if why:
        refused.append(why)
    if have is None:
        return mem
    usable = have * GPU_USABLE
    n_need = math.ceil(weights * 1.25 / usable)
    moe = f["params"]["experts"] > 1
    for step, m in mem.items():
        if m["total"] <= usable or (why and (step == "extract" or step == "train" and online)):
            continue  # the refusal says it for the steps that load the target
        if weights / max(m.get("tp") or 1, 1) > usable / 2 and moe and step != "generate":
            fix = (f" The weights alone need >= {n_need} GPUs of this size, and transformers' "
                   f"tensor parallelism (extract.tp) shards no routed experts: only a smaller "
                   f"(quantised) checkpoint fits this step.")
        elif weights / max(m.get("tp") or 1, 1) > usable / 2:
            how = ("generate.server.extra_args, e.g. --tensor-parallel-size" if step == "generate"
                   else "extract.tp=true under torchrun")
            fix = (f" The weights alone need >= {n_need} GPUs of this size: shard the target "
                   f"over more GPUs ({how}; {gpus} planned), or use a smaller dtype or a "
                   f"quantised checkpoint.")
        else:
            fix = " Lower extract.batch_tokens or train.batch_tokens."
        warnings.append(f"GPU memory: {step} needs ~{_size(m['total'])} per GPU, "
                        f"{_size(have)} per GPU.{fix}")
    return mem


def times(cfg, f: dict) -> list[dict]:
    """Tokens, tokens/s (config > measured > estimated) and seconds of each long step, plus the
    target's load time where the step loads it."""
    p, tc, ec, data, gpus = cfg.plan, cfg.train, cfg.extract, f["data"], f["gpus"]
    params, online, gen_tp = f["params"], cfg.train.online, f["gen_tp"]
    configured = {"generate": p.generate_tokens_per_s, "tokenize": p.tokenize_tokens_per_s,
                  "extract": p.extract_tokens_per_s, "train": p.train_tokens_per_s,
                  "evaluate": p.evaluate_tokens_per_s}
    flops = p.mfu * p.gpu_tflops * 1e12
    stored = store.bytes_per_token(f["ht"], f["n_aux"], ec.aux_dtype, ec.teacher, ec.topk, f["vd"])
    estimate = {
        "generate": decode_tokens_per_s(p, cfg.generate.concurrency, params, f["w"], gen_tp)
        if gen_tp else None,
        "tokenize": TOKENIZE_TOKENS_PER_S_PER_WORKER * (cfg.tokenize.workers
                                                        or min(8, os.cpu_count() or 1)),
        "extract": 1 / (2 * params["flop_params"] / flops + stored / (p.store_gbps * 1e9)),
        "train": flops / (6 * passes(tc) * f["drafter"]["trainable"]
                          + (2 * params["flop_params"] if online else 0)),
        "evaluate": decode_tokens_per_s(p, cfg.evaluate.batch_size, params, f["w"],
                                        gpus if cfg.extract.tp else 1),
    }
    per_gpu = {"extract", "train"}  # the others: one server / one process
    # train.max_steps wins over epochs (train then runs as many epochs as it takes)
    n_train = train_tokens(cfg, data, gpus)
    # in chunks, a sample is extracted again in every pass over the data (drafter/train/chunks.py)
    n_extract = data["val"]["tokens"] + n_train if chunk_mode(cfg) else data["tokens"]
    prompts = sum(d.max_prompts or 80 for d in cfg.evaluate.datasets)
    work = {
        "generate": data["generated_tokens"] if cfg.generate.enabled else 0,
        "tokenize": data["tokens"],
        "extract": 0 if online else n_extract,
        "train": n_train,
        # every prompt decoded by the target alone and with each method, at each temperature
        "evaluate": prompts * cfg.evaluate.max_new_tokens * len(cfg.evaluate.temperatures)
        * (len(cfg.evaluate.methods) + 1),
    }
    load_s = f["weights"] / (p.load_gbps * 1e9)
    loads = {"generate": bool(gen_tp), "extract": not online, "train": online, "evaluate": True}
    out = []
    for step in configured:
        tps, src = _pick(configured[step], f["measured"].get(step), estimate[step],
                         step in per_gpu, gpus)
        n = work[step]
        secs = 0.0 if not n else (n / tps if tps else None)
        load = load_s if loads.get(step) and n else 0.0
        out.append({"step": step, "tokens": n, "tokens_per_s": tps, "source": src,
                    "seconds": secs, "load_seconds": load,
                    "total_seconds": None if secs is None else secs + load})
    return out


def make_plan(cfg) -> dict:
    """The whole plan as a JSON-able dict (what `--json` prints)."""
    run = Run.of(cfg)
    config, where, gguf_bytes = target_config(cfg.target)
    info = describe_target(config)
    meta = target.meta_model(config, cfg.target.trust_remote_code)
    params = param_counts(config, meta)
    gpus, gpu_mem, gpu_mem_src = _gpu_env(cfg.plan)
    # a machine with GPUs, or a plan for one (plan.gpus / plan.gpu_memory_gib set)
    on_gpu = gpu_mem is not None or cfg.plan.gpus is not None
    dname, nbytes = dtype_bytes(cfg, on_gpu)
    w = weight_bytes(config, nbytes, meta)
    engine = cfg.generate.server.engine
    dshape = drafter_shape(cfg, config)
    f = {"config": config, "meta": meta, "params": params, "nbytes": nbytes,
         "gguf_bytes": gguf_bytes, "w": w, "weights": w["bytes"], "ht": info["hidden_size"],
         "vd": min(cfg.vocab.draft_vocab_size, info["vocab_size"]),
         "n_aux": len(dshape["layer_ids"]), "data": data_counts(cfg, run), "drafter": dshape,
         "gpus": gpus, "gpu_memory": gpu_mem, "measured": measured_throughputs(run),
         # vLLM / SGLang shard the target over the GPUs (--tensor-parallel-size in extra_args);
         # transformers serve and the data engine use one device; an external server none here
         "gen_tp": {"vllm": gpus, "sglang": gpus, "transformers": 1, "drafter": 1}.get(engine, 0),
         "on_gpu": on_gpu and cfg.target.device != "cpu"}
    # JSONL conversations (prepare + generate, ~CHARS_PER_TOKEN bytes a token each) and the
    # token file (int32 id + int8 mask)
    f["disk_data"] = int(f["data"]["tokens"] * (2 * CHARS_PER_TOKEN + 5))
    warnings: list[str] = []
    refused: list[str] = []
    st = storage(cfg, f)
    mem = gpu_memory(cfg, f, warnings, refused)
    tm = times(cfg, f)
    ch = chunkplan.chunks(cfg, f, st, tm, warnings, refused)
    dk = disk(cfg, f, st, ch, warnings)
    for r in tm if ch else ():  # extract loads the target again between chunks
        if r["step"] == "extract" and r["total_seconds"] is not None:
            r["load_seconds"] += ch["reload_seconds"]
            r["total_seconds"] += ch["reload_seconds"]
    return {
        "run_dir": str(run.root),
        "target": {**info, "source": where, "params": params["total"],
                   "active_params": params["active"],
                   "routed_expert_params": params["routed_experts"],
                   "dtype": dname, "weights_bytes": w["bytes"],
                   "weights_source": w["source"], "quantised_params": w["quantised_params"],
                   "routed_expert_bytes": w["routed_bytes"], "gguf_bytes": gguf_bytes},
        "data": f["data"], "storage": st, "disk": dk, "drafter": f["drafter"],
        "gpus": {"count": gpus, "memory": gpu_mem, "memory_source": gpu_mem_src},
        "gpu_memory": mem, "time": tm, "chunks": ch,
        "runs_in": where_steps_run(cfg, f["drafter"]["describe"]),
        "total_seconds": sum(t["total_seconds"] for t in tm if t["total_seconds"] is not None),
        "refused": refused, "warnings": warnings,
    }


# ---------------------------------------------------------------------------------- rendering
def _size(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def _count(n: int) -> str:
    return f"{n / 1e9:,.1f} B" if n >= 1e9 else f"{n / 1e6:,.1f} M"


def render(plan: dict) -> str:
    t, d, s = plan["target"], plan["data"], plan["storage"]
    moe = (f", MoE {t['experts']} experts ({t['experts_per_token']} per token)"
           if t["experts"] else "")
    lines = [
        f"drafter plan for {plan['run_dir']} (nothing loaded)",
        f"target   {t['source']}",
        f"         {t['architecture']}: {t['num_layers']} layers, hidden {t['hidden_size']:,}, "
        f"vocab {t['vocab_size']:,}{moe}{', MLA' if t['mla'] else ''}",
        f"         {t['params']:,} parameters ({_count(t['params'])}; "
        f"{_count(t['active_params'])} active per token); loads at {t['dtype']}",
        f"         weights {_size(t['weights_bytes'])}: {t['weights_source']}",
        f"data     {d['samples']:,} samples (train {d['train']['samples']:,}, val "
        f"{d['val']['samples']:,}), {d['tokens']:,} tokens, {d['masked_tokens']:,} "
        f"assistant tokens",
        f"         {d['source']}",
        f"storage  extract stores {s['tokens']:,} tokens (Ht {s['hidden_size']}, {s['n_aux']} "
        f"aux layers, draft vocab {s['draft_vocab_size']:,}, top-k {s['topk']})",
    ]
    for o in s["options"]:
        mark = "*" if o["chosen"] else " "
        lines.append(f"       {mark} aux {o['aux_dtype']:<4} teacher {o['teacher']:<6} "
                     f"{o['bytes_per_token']:>9,} B/token {_size(o['bytes']):>10}  "
                     f"({o['bytes_per_token'] / s['reference']['bytes_per_token']:.2f}x reference)")
    r = s["reference"]
    lines.append(f"         reference 8*Ht+16     {r['bytes_per_token']:>9,} B/token "
                 f"{_size(r['bytes']):>10}")
    lines.append(f"       {'*' if s['online'] else ' '} train.online=true     "
                 f"{0:>9,} B/token {_size(0):>10}  " + (
                     "(the target runs beside the drafter)" if s["online_ok"] else
                     "(not with extract.engine vllm or max_disk_gib: the target "
                     "must run in transformers beside the drafter)"))
    c = plan["chunks"]
    if c:
        h = c["held"]
        lines += [
            f"chunks   budget {_size(c['budget'])} (max_disk_gib) for the whole run: data "
            f"{_size(h['data'])}, val {_size(c['val_bytes'])} + head {_size(c['head_bytes'])}, "
            f"{h['checkpoint_count']} checkpoints of {_size(h['checkpoint_bytes'])}, export "
            f"{_size(h['export'])}, logs {_size(h['logs'])}"
            + (f", vLLM's states {_size(h['engine_states'])}" if h["engine_states"] else ""),
            (f"         then chunks of <= {_size(c['chunk_bytes'])} ({c['chunk_tokens']:,} "
             f"tokens at {c['bytes_per_token']:,} B/token)" + (
                 ", two at a time (one trains while the next is written)" if c["window"] > 1
                 else "") if c["fits"] else
             f"         no chunk fits: one optimizer step needs ~{_size(c['step_bytes'])}, "
             f"the smallest budget that trains is {_size(c['least_budget'])} (refused below)")]
        if c["fits"]:
            lines += [
                f"         {c['passes']:g} pass(es) over "
                f"{_size(c['extracted_bytes'] / max(c['passes'], 1e-9))} of train features: "
                f"{_size(c['extracted_bytes'])} extracted in {c['chunks']:,} chunk(s), each "
                f"sample once per pass",
                f"         engine: {_dur(c['load_seconds'])} a load; {c['reloads']} reload(s) "
                f"= {_dur(c['reload_seconds'])}, {100 * (c['reload_share'] or 0):.1f}% of "
                f"extract + train" + (
                    f"; with vLLM's sleep mode 1 load + {max((c['chunks'] or 1) - 1, 0)} "
                    f"wake(s) of ~{_dur(c['wake_seconds'])} = "
                    f"{_dur(c['with_sleep_mode_seconds'])}"
                    if c["with_sleep_mode_seconds"] is not None else "")]
        lines.append(f"         runs as: {c['processes']}")
    k = plan["disk"]
    lines.append(f"disk     run dir {_size(k['total'])}: data {_size(k['data'])}, extract "
                 f"{_size(k['extract'])}, train checkpoints {_size(k['train'])}, export "
                 f"{_size(k['export'])}; {_size(k['run_dir_free'])} free on {k['run_dir_fs']}")
    if k["cache_path"]:
        lines.append(f"         target weights in {k['cache_path']}: {_size(k['cache_need'])}, "
                     f"{_size(k['cache_free'])} free")
    g = plan["gpus"]
    lines.append(f"GPU      {g['count']} GPU(s) of {_size(g['memory'])} "
                 f"[{g['memory_source']}]; per GPU:")
    for step, m in plan["gpu_memory"].items():
        tp = f" (tp {m['tp']})" if m.get("tp", 1) > 1 else ""
        note = f"  {m['note']}" if m.get("note") else ""
        lines.append(f"         {step:<9}{_size(m['total']):>10}{tp}{note}")
    lines.append("runs in  " + "; ".join(f"{k}: {v}" for k, v in plan["runs_in"].items()))
    lines.append("time     step         tokens     tokens/s   source     compute + load")
    for r in plan["time"]:
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "?"
        load = f" + {_dur(r['load_seconds'])} load" if r["load_seconds"] >= 1 else ""
        lines.append(f"         {r['step']:<9}{r['tokens']:>13,} {tps:>12}   {r['source']:<10} "
                     f"{_dur(r['seconds'])}{load}")
    lines.append(f"         total ~{_dur(plan['total_seconds'])} (steps with a known time)")
    if plan["refused"]:
        lines.append("refused  (extract refuses it too, before any weight loads)")
        lines += [f"  x {r}" for r in plan["refused"]]
    if plan["warnings"]:
        lines.append("warnings")
        lines += [f"  ! {w}" for w in plan["warnings"]]
    elif not plan["refused"]:
        lines.append("no warnings: disk and GPU memory suffice")
    return "\n".join(lines)


def main(cfg, as_json: bool = False) -> int:
    plan = make_plan(cfg)
    if as_json:
        print(json.dumps(plan, indent=2, default=str))
    else:
        print(render(plan))
    return 0
