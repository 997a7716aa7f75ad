"""`drafter plan`'s chunks (max_disk_gib; drafter/train/chunks.py, drafter/train/budget.py):
where the run's budget goes, the chunk size and count over every pass of the data, the engine's
loads between chunks, and the budgets the plan suggests. A suggestion comes from the function
that judges it, so that, applied, it draws the same warning no more:

    fig = figures(cfg, f, st, tm, mode)   # what does not depend on the budget
    at(fig, budget)                       # chunk bytes and count, reloads and their share, disk
    least(fig)                            # the smallest budget that holds one optimizer step
    for_reloads(fig)                      # the smallest whole GiB keeping reloads within
                                          # RELOAD_SHARE of extract + train
    chunks(cfg, f, st, tm, warnings, refused)   # the plan's "chunks" section

With the run dir's token files the figures are train's own (chunks.largest_step over the data
plan of plan.gpus ranks); before tokenize, estimates from the data counts.
"""
from __future__ import annotations

import math

from drafter.core.rundir import Run
from drafter.features import spool
from drafter.train import budget

GiB = 1 << 30
# GB/s per GPU at which a sleeping vLLM's weights come back from host memory: half a PCIe Gen5
# x16 link's pinned-copy rate, assumed, not measured (BENCHMARKS.md, Chunks within a disk budget)
WAKE_GBPS = 20.0
# The share of extract + train that engine loads between chunks may take before the plan warns.
RELOAD_SHARE = 0.05
# characters of a sample id when none is measured (source name, colon, a 9-digit number)
ID_CHARS = 24


def chunk_mode(cfg) -> str | None:
    """How the train split is stored: None (every shard at once), "one process" (extract a
    chunk, train it, delete it: `drafter run`), "spool" (a producer elsewhere fills
    extract.spool while `drafter train` empties it)."""
    if cfg.max_disk_gib is None or cfg.train.online:
        return None
    return "spool" if cfg.extract.spool else "one process"


def train_tokens(cfg, data: dict, gpus: int) -> int:
    """Tokens train trains on (train.max_steps wins over epochs); in chunks, the tokens
    extracted for it: a sample again in every pass over the data."""
    tc = cfg.train
    return data["train"]["tokens"] * tc.epochs if tc.max_steps is None else \
        tc.max_steps * tc.batch_tokens * tc.grad_accum * gpus


def vllm_gpus(cfg) -> int:
    """GPUs vLLM spreads the target over where a step runs it (extract.engine /
    evaluate.engine: vllm): tensor x pipeline parallel sizes of target.engine_args."""
    a = cfg.target.engine_args
    return max(1, int(a.get("tensor_parallel_size", 1))) * \
        max(1, int(a.get("pipeline_parallel_size", 1)))


def dur(s: float | None) -> str:
    if s is None:
        return "?"
    if s < 90:
        return f"{s:.0f}s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    if s < 3 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def figures(cfg, f: dict, st: dict, tm: list[dict] | None, mode: str) -> dict:
    """The budget-independent figures of a run in chunks of this `mode` (module docstring)."""
    ec, tc, data, gpus = cfg.extract, cfg.train, f["data"], f["gpus"]
    run = Run.of(cfg)
    bpt = next((o["bytes_per_token"] for o in st["options"]
                if (o["aux_dtype"], o["teacher"]) == (ec.aux_dtype, ec.teacher)))
    window = 2 if mode == "spool" else 1
    n_train = train_tokens(cfg, data, gpus)
    passes = n_train / max(data["train"]["tokens"], 1)
    exact = _measured(cfg, run, gpus, bpt) if run.tokens("train").exists() else None
    if exact is not None:
        step, steps, reserve, val_ids, data_bytes = exact
    else:
        per = max(data["tokens"] / max(data["samples"], 1), 1.0)
        step_tokens = tc.batch_tokens * tc.grad_accum * gpus
        n_step = math.ceil(step_tokens / per)
        step = spool.chunk_bytes(step_tokens, n_step, n_step * ID_CHARS, bpt, ec.shard_tokens)
        steps = math.ceil(n_train / max(step_tokens, 1))
        reserve = math.ceil(passes) * data["train"]["samples"] * (ID_CHARS + 3) + 160 * steps \
            + 8192
        val_ids = data["val"]["samples"] * ID_CHARS
        data_bytes = f["disk_data"]
    vt, vn = data["val"]["tokens"], data["val"]["samples"]
    val = spool.chunk_bytes(vt, vn, val_ids, bpt, ec.shard_tokens) if vt else 0
    head = budget.head_bound(f["vd"], f["ht"])
    held = budget.held(cfg, f["drafter"], data_bytes, steps, f["ht"])
    vllm = ec.engine == "vllm"
    eng = vllm_gpus(cfg) if vllm else 1
    p = cfg.plan
    t = {r["step"]: r for r in tm or []}
    return {"mode": mode, "window": window, "bytes_per_token": bpt, "val": val, "head": head,
            "held": held, "reserve": reserve, "step": step, "steps": steps,
            "fixed": val + head + held["total"] + reserve, "extracted": n_train * bpt,
            "passes": round(passes, 3), "vllm": vllm, "eng": eng,
            "work": sum((t.get(k) or {}).get("seconds") or 0 for k in ("extract", "train")),
            "load_s": f["weights"] / (p.load_gbps * 1e9),
            "wake_s": f["weights"] / eng / (WAKE_GBPS * 1e9), "measured": exact is not None,
            # drafter's capture on the CPU keeps the target loaded (ChunkProducer's release)
            "reload": vllm or f.get("on_gpu", True)}


def _measured(cfg, run: Run, gpus: int, bpt: int):
    """(largest step's bytes, steps, the spool's own files, val's id characters, the data
    folders' bytes) from the run dir's token files, as train plans them; None when its data
    plan cannot be made (train says why)."""
    from drafter import DrafterError
    from drafter.data import tokens
    from drafter.train.batches import data_plan
    from drafter.train.chunks import largest_step

    ids, lengths = tokens.ids_and_lengths(run.tokens("train"))
    pairs = sorted((i, n) for i, n in zip(ids, lengths) if n > 0)
    ids, lengths = [i for i, _ in pairs], [n for _, n in pairs]
    try:
        dp = data_plan(lengths, cfg.train, gpus)
    except DrafterError:
        return None
    val_ids = sum(map(len, tokens.ids_and_lengths(run.tokens("val"))[0])) \
        if run.tokens("val").exists() else 0
    return (largest_step(ids, lengths, dp, bpt, cfg.extract.shard_tokens), dp.total,
            spool.plan_bytes(ids, dp.total, -(-dp.total // dp.steps_per_epoch)), val_ids,
            budget.data_bytes(run))


def at(fig: dict, total: int) -> dict:
    """A budget of `total` bytes: the chunk's bytes, whether one step fits, the chunks over
    every pass, the engine's reloads and their share of extract + train, and the disk the run
    takes (at most the budget)."""
    chunk = max(0, total - fig["fixed"]) // fig["window"]
    fits = chunk >= fig["step"] and chunk > 0
    n = math.ceil(fig["extracted"] / chunk) if fits else None
    one = fig["mode"] == "one process"
    # extract's step loads the target for val and the head; then in one process every chunk
    # loads it again (vLLM's sleep mode: the first loads, the rest wake), a producer once
    reloads = (n or 0) if one and fig["reload"] else 1
    reload_s = reloads * fig["load_s"]
    run_s = fig["work"] + fig["load_s"] + reload_s
    sleep_s = fig["load_s"] + max((n or 1) - 1, 0) * fig["wake_s"] if one and fig["vllm"] \
        else None
    return {"chunk": chunk, "fits": fits, "chunks": n, "reloads": reloads,
            "reload_seconds": reload_s, "reload_share": reload_s / run_s if run_s else None,
            "with_sleep_mode_seconds": sleep_s,
            "need": fig["fixed"] + fig["window"] * min(chunk, fig["extracted"])}


def least(fig: dict) -> int:
    return fig["fixed"] + fig["window"] * fig["step"]


def for_reloads(fig: dict) -> int | None:
    """The smallest whole GiB whose reloads stay within RELOAD_SHARE (one chunk the most),
    or None when even one chunk's reload takes more."""
    def ok(gib: int) -> bool:
        a = at(fig, gib * GiB)
        return a["fits"] and a["reload_share"] is not None and a["reload_share"] <= RELOAD_SHARE

    lo = max(1, math.ceil(least(fig) / GiB))
    hi = max(lo, math.ceil((fig["fixed"] + fig["window"] * max(fig["extracted"], fig["step"]))
                           / GiB))
    if not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def chunks(cfg, f: dict, st: dict, tm: list[dict], warnings: list[str],
           refused: list[str]) -> dict | None:
    """Features in chunks: the budget's parts, the chunk size and count, the engine loads
    between chunks and their share of extract + train, and where each process runs. Refuses
    what extract refuses before anything loads (a spool that cannot be written, a budget whose
    room holds no optimizer step: run/preflight.py); warns when reloads take over RELOAD_SHARE,
    naming the budget that keeps them under it."""
    from drafter.run.preflight import spool_problem

    mode = chunk_mode(cfg)
    if mode is None:
        return None
    ec = cfg.extract
    fig = figures(cfg, f, st, tm, mode)
    total = int(cfg.max_disk_gib * GiB)
    a = at(fig, total)
    held = fig["held"]
    out = {"mode": mode, "budget": total, "bytes_per_token": fig["bytes_per_token"],
           "val_bytes": fig["val"], "head_bytes": fig["head"], "held": held,
           "reserve_bytes": fig["reserve"], "window": fig["window"], "chunk_bytes": a["chunk"],
           "chunk_tokens": a["chunk"] // fig["bytes_per_token"], "step_bytes": fig["step"],
           "least_budget": least(fig), "fixed_bytes": fig["fixed"], "fits": a["fits"],
           "extracted_bytes": fig["extracted"],
           "chunks": a["chunks"], "passes": fig["passes"], "load_seconds": fig["load_s"],
           "reloads": a["reloads"], "reload_seconds": a["reload_seconds"],
           "reload_share": a["reload_share"], "with_sleep_mode_seconds":
           a["with_sleep_mode_seconds"], "wake_seconds": fig["wake_s"]
           if a["with_sleep_mode_seconds"] is not None else None, "need": a["need"],
           "spool": ec.spool, "train_gpus": f["gpus"],
           "source": "measured (the run dir's token files)" if fig["measured"] else "estimated"}
    where = f"vLLM over {fig['eng']} GPU(s)" if fig["vllm"] else \
        "drafter's capture (transformers)"
    if mode == "one process":
        how = (f"train it in a child on {f['gpus']} GPU(s) (torchrun)" if fig["vllm"] else
               "train it in the same process(es)")
        out["processes"] = (f"one process (`drafter run CONFIG`): extract a chunk ({where}), "
                            f"let the GPUs go, {how}, delete it, next; chunks in RUN_DIR/chunks")
    else:
        out["processes"] = (f"producer `drafter run CONFIG --until extract` where the target "
                            f"runs ({where}) fills {ec.spool}; consumer `torchrun "
                            f"--nproc-per-node {f['gpus']} -m drafter.cli train CONFIG` where "
                            f"the drafter trains empties it; the run dir on storage both reach")
    why = spool_problem(Run.of(cfg).spool())
    if why is not None:
        refused.append(f"extract.spool: {why}")
    if not a["fits"]:
        half = ", halved (a chunk trains while the next is made)" if fig["window"] > 1 else ""
        parts = budget.describe(total, fig["val"] + fig["head"], held, fig["reserve"])
        refused.append(
            f"max_disk_gib: {parts}{half}, leaving {spool.size(a['chunk'])} for a chunk; one "
            f"optimizer step needs ~{spool.size(fig['step'])}: "
            f"max_disk_gib={budget.gib_at_least(least(fig))} or more holds it")
    elif mode == "one process" and a["reload_share"] > RELOAD_SHARE:
        good = for_reloads(fig)
        warnings.append(
            f"chunks: {a['reloads']} engine loads of {dur(fig['load_s'])} take "
            f"{100 * a['reload_share']:.1f}% of extract + train (over "
            f"{100 * RELOAD_SHARE:.0f}%)" + (f": max_disk_gib={good:,} keeps them under it"
                                             if good else ": even one chunk's load does")
            + (f"; with vLLM's sleep mode (its CUDA builds) they are wakes of "
               f"~{dur(fig['wake_s'])}" if a["with_sleep_mode_seconds"] else ""))
    return out
