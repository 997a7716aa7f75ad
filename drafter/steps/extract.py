"""The extract step: prefill-only target forwards -> aux hidden states + teacher, sharded on disk.

Reads   tokenize/{train,val}.parquet   input_ids, loss_mask (drafter/data/tokens.py)
        vocab/vocab.safetensors        d2t, t2d: the draft vocab (in_vocab, top-k ids)
Writes  extract/{train,val}/shard_NNNNN.safetensors + index.json
                                       (format: drafter/features/store.py)
        extract/head.safetensors       the target's lm_head rows of the draft vocab
Command drafter extract CONFIG [key=value ...]
        torchrun --nproc-per-node 8 -m drafter.cli extract CONFIG                 data parallel
        torchrun --nproc-per-node 8 -m drafter.cli extract CONFIG extract.tp=true  one target
                                                                        sharded over the GPUs

The plan is a pure function of the token files and the config, so ranks and reruns agree: samples
sorted longest first, cut into shards of `extract.shard_tokens` tokens, each shard cut into
forwards of `extract.batch_tokens` tokens (drafter/features/capture.py does the forward and the
hooks).
Data parallel: rank r of W writes the shards i with i % W == r; every shard is computed from the
same forwards whatever W, so the shard files are the same. Tensor parallel: every rank runs every
forward of one sharded target (transformers tp_plan="auto") and rank 0 writes.

Before any weights load: a target the transformers path cannot hold is refused in one line (a
MoE under extract.tp, whose routed experts transformers would copy whole to every rank, or
weights per GPU above a GPU's memory; capture.refuse_unfit, which `drafter plan` tells too), and
the GPU preflight (drafter/core/gpu.py) compares free memory with the estimated need and refuses
when other processes hold memory (extract.preflight). After loading,
`Capture.self_check` compares the hooks with a plain forward on one real sample.

Resume: a shard that exists and verifies (its sha256 in the index, else its own content hash;
and the planned sample ids and options) is kept; a missing or corrupt one is (re)done; temp files
of a killed write are removed. The index is written last. train.online=true: nothing is stored.

On a GPU, train's graphs compile in a process of their own, started just after the preflight, while
extract plans, loads the target and runs, when memory allows (drafter/train/precompile.py;
extract.precompile=false: off): extract waits for it before it returns (and stops it when every
shard was kept), and its figures are the manifest's "precompile". Online, extract starts none:
`drafter run` starts it ahead of train (drafter/run/pipeline.py), and train waits for it.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from drafter.core import gpu, target
from drafter.core.dist import Dist, all_gather, barrier, init_dist, read_env
from drafter.core.rundir import Run
from drafter.core.vllm import vllm_dtype, vllm_missing
from drafter.data import tokens
from drafter.features import capture as C
from drafter.features import store
from drafter.features.vllm_capture import VllmCapture
from drafter.train import precompile

log = logging.getLogger("drafter")

SPLITS = ("train", "val")


@dataclass
class Shard:
    split: str
    index: int
    rows: list[int]                         # token-file rows, longest first
    lengths: list[int]
    batches: list[list[int]] = field(default_factory=list)   # positions in rows, per forward

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def plan_shards(split: str, lengths: list[int], shard_tokens: int, batch_tokens: int,
                packed: bool) -> list[Shard]:
    """Samples longest first, in shards of <= shard_tokens tokens (a longer sample alone), each
    cut into forwards of <= batch_tokens tokens. Empty samples are skipped."""
    order = [i for i in C.length_order(lengths) if lengths[i] > 0]
    shards: list[Shard] = []
    cur: list[int] = []
    used = 0
    for i in order:
        if cur and used + lengths[i] > shard_tokens:
            shards.append(Shard(split, len(shards), cur, [lengths[j] for j in cur]))
            cur, used = [], 0
        cur.append(i)
        used += lengths[i]
    if cur:
        shards.append(Shard(split, len(shards), cur, [lengths[j] for j in cur]))
    for s in shards:
        s.batches = C.plan_batches(s.lengths, batch_tokens, packed)
    return shards


# ------------------------------------------------------------------------------------ the step
def _info(cfg, tconf, d2t: torch.Tensor, device: str) -> dict:
    """What the shards hold, from the config alone (the same as Capture.info() once loaded)."""
    n = target.num_layers(tconf)
    scale, softcap = C.logit_transform(tconf)
    ec = cfg.extract
    vd = d2t.numel()
    dtype = vllm_dtype(cfg.target, device) if ec.engine == "vllm" \
        else target.pick_dtype(cfg.target, device)
    return {"layer_ids": C.resolve_layer_ids(ec.layer_ids, n), "num_layers": n,
            "hidden_size": target.hidden_size(tconf), "vocab_size": target.vocab_size(tconf),
            "draft_vocab_size": vd, "teacher": ec.teacher,
            "topk": min(ec.topk, vd) if ec.teacher == "topk" else None,
            "target_dtype": str(dtype).replace("torch.", ""), "logit_scale": scale,
            "logit_softcap": softcap, "aux_dtype": ec.aux_dtype, "target": cfg.target.model}


def _read_table(path):
    import pyarrow as pa

    batches = list(tokens.iter_token_batches(path))
    return pa.Table.from_batches(batches, schema=tokens.SCHEMA)


def _clean_temp(run: Run, shards: list[Shard], rank: int) -> None:
    """Remove the temp files a killed write of these shards left behind; rank 0 also those of
    safetensors' own save (.tmpXXXX). No rank writes yet: writing starts after a collective."""
    for s in shards:
        p = run.shard(s.split, s.index)
        for tmp in p.parent.glob(f".tmp-{p.name}.*"):
            tmp.unlink(missing_ok=True)
    if rank == 0:
        for split in SPLITS:
            for tmp in run.shards(split).glob(".tmp*"):
                tmp.unlink(missing_ok=True)


def main(cfg) -> dict:
    t_main = time.perf_counter()
    run = Run.of(cfg)
    ec = cfg.extract
    if cfg.train.online:
        log.info("extract: train.online=true, the target runs beside the drafter: nothing stored")
        return {"counts": {"online": 1, "samples": 0, "tokens": 0, "shards": 0, "bytes": 0},
                "mode": "online"}
    d = read_env(target.pick_device(cfg.target))
    tconf = target.load_config(cfg.target)
    # a MoE under extract.tp, or weights above a GPU's memory: refused before anything loads
    # (vLLM spreads and quantises the target itself)
    weights = C.refuse_unfit(cfg.target, tconf, ec.tp, d) if ec.engine == "drafter" \
        else None
    d2t, t2d, _ = tokens.load_vocab(run.require(run.vocab(), "vocab"))
    run.require(run.tokens("train"), "tokenize")
    info = _info(cfg, tconf, d2t, str(d.device))
    est = {"total": 0}
    if ec.engine == "vllm":
        _vllm_preflight(cfg, d)
    elif d.device.type == "cuda":  # before this process touches CUDA or loads any weights
        dtype_bytes = torch.finfo(target.pick_dtype(cfg.target, str(d.device))).bits // 8
        est = C.estimate_gpu_bytes(tconf, dtype_bytes, ec.batch_tokens, len(info["layer_ids"]),
                                   tp=d.world if ec.tp else 1, weights=weights)
        visible = gpu.visible_indices()
        use = [visible[d.local_rank]] if d.local_rank < len(visible) else None
        gpu.preflight(est["total"], use=use, policy=ec.preflight, what="drafter extract")
    init_dist(d)
    # train's graphs compile in a process of their own from here on, while extract plans,
    # loads the target and runs (its imports and set-up overlap this process's); stopped at
    # once when there is nothing to extract
    pre = precompile.start(cfg, run, d.device, tconf, est["total"], d.rank) \
        if ec.engine == "drafter" else None  # vLLM takes most of every GPU it runs on
    written, tokens_done, seconds, check, compiled = {}, 0, 0.0, None, None
    need_model, ok = False, False
    try:
        attn = str(getattr(tconf, "_attn_implementation", "") or "")
        packed = ec.engine == "vllm" or "flash" in attn  # vLLM pads nothing
        tables, plans = {}, {}
        for split in SPLITS:
            path = run.tokens(split)
            tables[split] = _read_table(path) if path.exists() else None
            plans[split] = plan_shards(split, tables[split].column("num_tokens").to_pylist(),
                                       ec.shard_tokens, ec.batch_tokens, packed) \
                if tables[split] is not None else []
            run.shards(split).mkdir(parents=True, exist_ok=True)
        every = [s for split in SPLITS for s in plans[split]]
        # dp: rank r writes shards i % W == r; tp: every rank runs every forward, rank 0 writes
        mine = every if ec.tp else [s for s in every if s.index % d.world == d.rank]
        writes = not ec.tp or d.rank == 0
        kept, todo, redone = _done_shards(run, mine, tables, info, d) if writes \
            else ({}, [], 0)
        if ec.tp and d.on:
            keys = {tuple(k) for k in all_gather(d, [(s.split, s.index) for s in todo])[0]}
            todo = [s for s in mine if (s.split, s.index) in keys]
        # every rank loads when any rank has work: tp needs them all, and dp ranks meet at the
        # end
        need_model = any(all_gather(d, bool(todo) or not run.extract_head().exists()))
        if need_model:
            written, seconds, check = _extract(cfg, run, d, info, d2t, t2d, tables, every, todo,
                                               writes, len(kept))
            tokens_done = sum(s.tokens for s in todo) if writes else 0
        ok = True
    finally:  # waited for after a run; stopped after a failure or with nothing extracted
        compiled = precompile.finish(pre, ok=ok and need_model)
    if compiled is not None:
        compiled["started_s"] = round(pre.t0 - t_main, 2)  # into extract (its imports aside)
        if not need_model:
            compiled["stopped"] = "nothing to extract: every shard was kept"
            log.info("extract: every shard was kept: train's graphs were not precompiled")

    # -- the index: every rank's entries, written by rank 0 after all shards are on disk
    entries = dict(kept)
    for p, e in written.items():
        entries[(p.parent.name, int(p.stem.split("_")[1]))] = e
    mine_stats = {"tokens": tokens_done, "seconds": seconds, "written": len(written),
                  "kept": len(kept), "redone": redone}
    gathered = all_gather(d, (entries, mine_stats))
    all_entries = {k: v for ents, _ in gathered for k, v in ents.items()}
    head_sha = store.file_sha256(run.extract_head()) if d.rank == 0 else None
    indexes = {}
    for split in SPLITS:
        ents = [all_entries[(split, s.index)] for s in plans[split]]
        if d.rank == 0:
            indexes[split] = store.write_index(run.shard_index(split), info, ents, head_sha)
        else:
            indexes[split] = {"num_samples": sum(e["num_samples"] for e in ents),
                              "num_tokens": sum(e["num_tokens"] for e in ents),
                              "bytes": sum(e["bytes"] for e in ents), "shards": ents}
    barrier(d)
    stats = {k: sum(g[1][k] for g in gathered) for k in ("tokens", "written", "kept", "redone")}
    stats["seconds"] = max(g[1]["seconds"] for g in gathered)
    out = _result(info, indexes, stats, d, ec, check)
    if compiled is not None:
        out["precompile"] = compiled
    return out


def _done_shards(run: Run, mine: list[Shard], tables: dict, info: dict, d: Dist):
    """(kept entries, shards to do, how many were corrupt) among this rank's shards: a shard is
    kept when its file verifies (index sha256, else its content hash) and holds the planned
    samples with these options; a corrupt or foreign one is deleted and redone."""
    _clean_temp(run, mine, d.rank)
    old = {}
    for split in SPLITS:
        p = run.shard_index(split)
        if p.exists():
            try:
                old.update({(split, e["file"]): e for e in store.read_index(p)["shards"]})
            except store.ShardError:
                pass
    present = [s for s in mine if run.shard(s.split, s.index).exists()]

    def check(s: Shard):
        p = run.shard(s.split, s.index)
        ids = tables[s.split].column("id").take(s.rows).to_pylist()
        return s, store.check_shard(p, ids, old.get((s.split, p.name)), info)

    kept, redone = {}, 0
    # hashing and reads release the GIL: verify several shards at once
    with ThreadPoolExecutor(max_workers=8) as pool:
        for s, e in tqdm(pool.map(check, present), total=len(present), desc="extract: verify",
                         unit=" shard", mininterval=1.0, disable=d.rank != 0 or not present):
            if e is not None:
                kept[(s.split, s.index)] = e
                continue
            p = run.shard(s.split, s.index)
            log.warning("extract: %s is corrupt or from other options: redoing it", p)
            p.unlink()
            redone += 1
    todo = [s for s in mine if (s.split, s.index) not in kept]
    return kept, todo, redone


def _extract(cfg, run: Run, d: Dist, info: dict, d2t, t2d, tables, every: list[Shard],
             todo: list[Shard], writes: bool, n_kept: int):
    """Load the target, check the capture, write the head and the shards of `todo`.
    Returns (written entries by path, seconds of the forward+storage loop, self-check)."""
    ec = cfg.extract
    t_load = time.time()
    if ec.engine == "vllm":
        longest = max((n for s in every for n in s.lengths), default=1)
        cap = VllmCapture(cfg, d2t, t2d, longest, run.vllm_states())
    else:
        model = target.load_model(cfg.target, device=str(d.device),
                                  **({"tp_plan": "auto"} if ec.tp else {}))
        cap = C.Capture(model, info["layer_ids"], d2t, t2d, teacher=ec.teacher, topk=ec.topk,
                        out_dtype=torch.bfloat16, batch_tokens=ec.batch_tokens)
    try:
        return _capture_all(cfg, run, d, info, cap, tables, every, todo, writes, n_kept, t_load)
    finally:
        if isinstance(cap, VllmCapture):
            cap.close()


def _capture_all(cfg, run: Run, d: Dist, info: dict, cap, tables, every: list[Shard],
                 todo: list[Shard], writes: bool, n_kept: int, t_load: float):
    ec = cfg.extract
    got = {k: v for k, v in cap.info().items() if k in info}
    if got != {k: info[k] for k in got}:
        raise C.CaptureError(f"extract: the loaded target differs from its config: {got} "
                             f"vs {info}")
    check = None
    if every:  # the longest sample's first 64 tokens
        first = every[0]
        check = cap.self_check(tables[first.split].column("input_ids")[first.rows[0]].as_py())
    head = cap.head  # a collective under tp: every rank
    if d.rank == 0:
        store.save_head(run.extract_head(), head, info)
    log.info("extract: target loaded in %.0fs; layer ids %s (HS[k]) of %d, Ht %d, %s; %d "
             "shards to write, %d kept", time.time() - t_load, info["layer_ids"],
             info["num_layers"], info["hidden_size"], info["target_dtype"], len(todo), n_kept)
    writer = store.ShardWriter(info) if writes else None
    bar = tqdm(total=sum(s.tokens for s in todo), desc="extract", unit="tok", unit_scale=True,
               mininterval=1.0, disable=d.rank != 0, smoothing=0.1)
    t0 = time.time()
    written: dict = {}
    try:
        for s in todo:
            _extract_shard(cap, tables[s.split], s, ec, writer, run, bar)
        if writer is not None:
            written = writer.close()
    finally:
        bar.close()
    if isinstance(cap, VllmCapture):
        check = {**(check or {}), "engine_check": dict(cap.check)}
        log.info("extract: vLLM's next token = the teacher's argmax on %d of %d samples "
                 "(%d near-ties)", cap.check["same_next_token"], cap.check["samples"],
                 cap.check["near_ties"])
    return written, time.time() - t0, check


def _vllm_preflight(cfg, d: Dist) -> None:
    """extract.engine=vllm: one process (vLLM spreads the target itself), vLLM importable, and
    no GPU memory held by another process (reported with its PID, never killed). vLLM sizes its
    own memory: there is no weights estimate to check here."""
    if d.world > 1:
        raise C.CaptureError(f"extract.engine=vllm runs in one process, not {d.world} torchrun "
                             f"ranks: vLLM spreads the target over the GPUs itself (set "
                             f"target.engine_args.tensor_parallel_size)")
    missing = vllm_missing()
    if missing:
        raise C.CaptureError(f"extract.engine=vllm: {missing}")
    if d.device.type == "cuda":
        gpu.preflight(0, policy=cfg.extract.preflight, what="drafter extract (vLLM)")


def _extract_shard(cap: C.Capture, table, s: Shard, ec, writer, run: Run, bar) -> None:
    """Forward the shard's batches, encode on the device, start the copies to the host, and
    hand the shard to the writer threads."""
    rows = table.take(s.rows)
    flat_ids = torch.from_numpy(rows.column("input_ids").combine_chunks().flatten()
                                .to_numpy().astype("int64"))                      # [T]
    flat_mask = torch.from_numpy(rows.column("loss_mask").combine_chunks().flatten()
                                 .to_numpy().astype("int64"))                     # [T]
    off = [0]
    for n in s.lengths:
        off.append(off[-1] + n)
    parts = []
    for batch in s.batches:
        a, b = off[batch[0]], off[batch[-1] + 1]
        flat = cap.run([flat_ids[off[p]:off[p + 1]] for p in batch])
        if writer is not None:
            enc = store.encode(flat, flat_mask[a:b], ec.aux_dtype, cap.draft_vocab_size)
            parts.append(store.to_host(enc))
        bar.update(b - a)
    if writer is not None:
        writer.submit(run.shard(s.split, s.index), parts, rows.column("id").to_pylist())


def _result(info, indexes, stats, d: Dist, ec, check) -> dict:
    tokens_total = sum(ix["num_tokens"] for ix in indexes.values())
    bytes_total = sum(ix["bytes"] for ix in indexes.values())
    ht, n_aux = info["hidden_size"], len(info["layer_ids"])
    formula = store.bytes_per_token(ht, n_aux, ec.aux_dtype, ec.teacher, ec.topk,
                                    info["draft_vocab_size"])
    ref = store.reference_bytes_per_token(ht)
    bpt = bytes_total / tokens_total if tokens_total else 0.0
    counts = {"samples": sum(ix["num_samples"] for ix in indexes.values()),
              "tokens": tokens_total, "bytes": bytes_total,
              "shards": sum(len(ix["shards"]) for ix in indexes.values()),
              "shards_written": stats["written"], "shards_kept": stats["kept"],
              "shards_redone": stats["redone"]}
    for split, ix in indexes.items():
        counts[f"{split}_samples"] = ix["num_samples"]
        counts[f"{split}_tokens"] = ix["num_tokens"]
    # tokens/s of this invocation's forwards + storage (model load excluded), all ranks together
    tps = stats["tokens"] / stats["seconds"] if stats["seconds"] > 0 else None
    out = {"counts": counts, "info": info, "tokens_per_s": round(tps, 1) if tps else None,
           "bytes_per_token": round(bpt, 2), "formula_bytes_per_token": formula,
           "reference_bytes_per_token": ref,
           "ratio_to_reference": round(bpt / ref, 4) if bpt else None,
           "world_size": d.world, "tp": ec.tp, "engine": ec.engine, "self_check": check}
    if d.rank == 0:
        log.info("extract: %d samples, %d tokens, %.1f MiB, %.0f bytes/token (%.2fx the "
                 "reference 8*Ht+16 = %d)%s", counts["samples"], tokens_total,
                 bytes_total / 2**20, bpt, bpt / ref, ref,
                 f", {tps:,.0f} tokens/s" if tps else "")
    return out
