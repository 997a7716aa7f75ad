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

max_disk_gib (docs/extract.md, "Bounded disk"): the step stores val and the head only;
the train split goes a chunk of train's own steps at a time (drafter/train/chunks.py plans them,
drafter/features/spool.py is where they pass): ChunkProducer makes a chunk, in train's process
(`drafter run`) or, with extract.spool, after the step, for a train elsewhere
(drafter/run/chunked.py).

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
from pathlib import Path

import torch
from tqdm import tqdm

from drafter.core import gpu, target
from drafter.core.dist import Dist, all_gather, barrier, init_dist, read_env
from drafter.core.rundir import Run
from drafter.core.vllm import vllm_dtype, vllm_missing
from drafter.data import tokens
from drafter.features import capture as C
from drafter.features import spool, store
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
    path: Path | None = None                # extract/{split}/ or a chunk's folder

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
    return {"layer_ids": C.resolve_layer_ids(ec.layer_ids, n, C.layer_count(cfg)), "num_layers": n,
            "hidden_size": target.hidden_size(tconf), "vocab_size": target.vocab_size(tconf),
            "draft_vocab_size": vd, "teacher": ec.teacher,
            "topk": min(ec.topk, vd) if ec.teacher == "topk" else None,
            "target_dtype": str(dtype).replace("torch.", ""), "logit_scale": scale,
            "logit_softcap": softcap, "aux_dtype": ec.aux_dtype, "target": cfg.target.model}


def _read_table(path):
    import pyarrow as pa

    batches = list(tokens.iter_token_batches(path))
    return pa.Table.from_batches(batches, schema=tokens.SCHEMA)


def _clean_temp(folders: list[Path], shards: list[Shard], rank: int) -> None:
    """Remove the temp files a killed write of these shards left behind; rank 0 also those of
    safetensors' own save (.tmpXXXX) in `folders`. No rank writes yet: writing starts after a
    collective."""
    for s in shards:
        for tmp in s.path.parent.glob(f".tmp-{s.path.name}.*"):
            tmp.unlink(missing_ok=True)
    if rank == 0:
        for folder in folders:
            for tmp in folder.glob(".tmp*"):
                tmp.unlink(missing_ok=True)


def main(cfg) -> dict:
    """Extract every split; with max_disk_gib, val and the head only: the train split
    is extracted a chunk at a time (ChunkProducer, `produce`)."""
    t_main = time.perf_counter()
    run = Run.of(cfg)
    ec = cfg.extract
    splits = ("val",) if cfg.max_disk_gib is not None else SPLITS
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
        for split in splits:
            path = run.tokens(split)
            tables[split] = _read_table(path) if path.exists() else None
            plans[split] = plan_shards(split, tables[split].column("num_tokens").to_pylist(),
                                       ec.shard_tokens, ec.batch_tokens, packed) \
                if tables[split] is not None else []
            for s in plans[split]:
                s.path = run.shard(split, s.index)
            run.shards(split).mkdir(parents=True, exist_ok=True)
        every = [s for split in splits for s in plans[split]]
        # dp: rank r writes shards i % W == r; tp: every rank runs every forward, rank 0 writes
        mine = every if ec.tp else [s for s in every if s.index % d.world == d.rank]
        writes = not ec.tp or d.rank == 0
        kept, todo, redone = _done_shards(mine, tables, info, d, [
            run.shard_index(split) for split in SPLITS]) if writes else ({}, [], 0)
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
    for split in splits:
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
    if cfg.max_disk_gib is not None:  # the train split: a chunk at a time (ChunkProducer)
        out["mode"] = "chunked"
    return out


def _done_shards(mine: list[Shard], tables: dict, info: dict, d: Dist, indexes: list[Path]):
    """(kept entries by (split, index), shards to do, how many were corrupt) among this rank's
    shards: a shard is kept when its file verifies (its sha256 in one of `indexes`, else its
    content hash) and holds the planned samples with these options; a corrupt or foreign one is
    deleted and redone."""
    _clean_temp([ip.parent for ip in indexes], mine, d.rank)
    old = {}
    for ip in indexes:
        if ip.exists():
            try:
                old.update({str(ip.parent / e["file"]): e for e in store.read_index(ip)["shards"]})
            except store.ShardError:
                pass
    present = [s for s in mine if s.path.exists()]

    def check(s: Shard):
        ids = tables[s.split].column("id").take(s.rows).to_pylist()
        return s, store.check_shard(s.path, ids, old.get(str(s.path)), info)

    kept, redone = {}, 0
    # hashing and reads release the GIL: verify several shards at once
    with ThreadPoolExecutor(max_workers=8) as pool:
        for s, e in tqdm(pool.map(check, present), total=len(present), desc="extract: verify",
                         unit=" shard", mininterval=1.0, disable=d.rank != 0 or not present):
            if e is not None:
                kept[(s.split, s.index)] = e
                continue
            log.warning("extract: %s is corrupt or from other options: redoing it", s.path)
            s.path.unlink()
            redone += 1
    todo = [s for s in mine if (s.split, s.index) not in kept]
    return kept, todo, redone


def _extract(cfg, run: Run, d: Dist, info: dict, d2t, t2d, tables, every: list[Shard],
             todo: list[Shard], writes: bool, n_kept: int):
    """Load the target, check the capture, write the head and the shards of `todo`.
    Returns (written entries by path, seconds of the forward+storage loop, self-check)."""
    t_load = time.time()
    cap = _load_capture(cfg, run, d, info, d2t, t2d,
                        max((n for s in every for n in s.lengths), default=1))
    try:
        return _capture_all(cfg, run, d, info, cap, tables, every, todo, writes, n_kept, t_load)
    finally:
        if isinstance(cap, VllmCapture):
            cap.close()


def _load_capture(cfg, run: Run, d: Dist, info: dict, d2t, t2d, longest: int):
    """The target loaded for capture: inside vLLM (extract.engine) or in transformers."""
    ec = cfg.extract
    if ec.engine == "vllm":
        return VllmCapture(cfg, d2t, t2d, longest, run.vllm_states())
    model = target.load_model(cfg.target, device=str(d.device),
                              **({"tp_plan": "auto"} if ec.tp else {}))
    return C.Capture(model, info["layer_ids"], d2t, t2d, teacher=ec.teacher, topk=ec.topk,
                     out_dtype=torch.bfloat16, batch_tokens=ec.batch_tokens)


def _capture_all(cfg, run: Run, d: Dist, info: dict, cap, tables, every: list[Shard],
                 todo: list[Shard], writes: bool, n_kept: int, t_load: float):
    ec = cfg.extract
    check = _check_capture(cap, info, tables, every)
    head = cap.head  # a collective under tp: every rank
    if d.rank == 0:
        store.save_head(run.extract_head(), head, info)
    log.info("extract: target loaded in %.0fs; layer ids %s (HS[k]) of %d, Ht %d, %s; %d "
             "shards to write, %d kept", time.time() - t_load, info["layer_ids"],
             info["num_layers"], info["hidden_size"], info["target_dtype"], len(todo), n_kept)
    written, seconds = _write_shards(cap, info, tables, todo, ec, writes, d)
    if isinstance(cap, VllmCapture):
        check = {**(check or {}), "engine_check": dict(cap.check)}
        log.info("extract: vLLM's next token = the teacher's argmax on %d of %d samples "
                 "(%d near-ties)", cap.check["same_next_token"], cap.check["samples"],
                 cap.check["near_ties"])
    return written, seconds, check


def _check_capture(cap, info: dict, tables, every: list[Shard]):
    """The loaded target is the configured one; its self-check on the first (longest)
    sample's first 64 tokens."""
    got = {k: v for k, v in cap.info().items() if k in info}
    if got != {k: info[k] for k in got}:
        raise C.CaptureError(f"extract: the loaded target differs from its config: {got} "
                             f"vs {info}")
    if every:
        first = every[0]
        return cap.self_check(tables[first.split].column("input_ids")[first.rows[0]].as_py())
    return None


def _write_shards(cap, info: dict, tables, todo: list[Shard], ec, writes: bool, d: Dist):
    """The shards of `todo` forwarded and written. -> (entries by path, seconds)."""
    writer = store.ShardWriter(info) if writes else None
    bar = tqdm(total=sum(s.tokens for s in todo), desc="extract", unit="tok", unit_scale=True,
               mininterval=1.0, disable=d.rank != 0, smoothing=0.1)
    t0 = time.time()
    written: dict = {}
    try:
        for s in todo:
            _extract_shard(cap, tables[s.split], s, ec, writer, bar)
        if writer is not None:
            written = writer.close()
    except BaseException:  # an error or a signal: the writer's threads end with the step
        if writer is not None:
            writer.stop()
        raise
    finally:
        bar.close()
    return written, time.time() - t0


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


def _extract_shard(cap: C.Capture, table, s: Shard, ec, writer, bar) -> None:
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
        writer.submit(s.path, parts, rows.column("id").to_pylist())


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


# ------------------------------------------------------------------ chunks (max_disk_gib)
def vllm_sleep_mode() -> bool:
    """vLLM keeps its weights in host memory while it sleeps (LLM(enable_sleep_mode=True),
    sleep(level=1), wake_up()) on the platforms that have it: its CUDA, ROCm and XPU builds;
    the CPU build refuses enable_sleep_mode."""
    try:
        from vllm.platforms import current_platform
        return bool(current_platform.is_sleep_mode_available())
    except Exception:  # noqa: BLE001 - no vLLM, or one without the call: reload instead
        return False


class ChunkProducer:
    """Makes the chunks of train's plan (drafter/train/chunks.py; the spool's files:
    drafter/features/spool.py): chunk c's samples extracted as a split is, longest first, into
    run.chunk(c)/, its index, then COMPLETE. A kill keeps every shard that verifies, as the
    step's own resume does. The target stays loaded from one chunk to the next unless
    `release` (one process: train needs the GPUs between chunks; drafter's capture on the CPU
    keeps it): then vLLM sleeps where its platform has sleep mode (weights in host memory,
    woken for the next chunk), and otherwise the target is closed after each chunk and loaded
    again for the next. `stats`: loads,
    wakes and their seconds, chunks, tokens, seconds and CPU seconds making them."""

    def __init__(self, cfg, release: bool):
        import dataclasses

        self.run, ec = Run.of(cfg), cfg.extract
        self.d = read_env(target.pick_device(cfg.target))
        # drafter's capture on the CPU holds no GPU that train needs: it stays loaded (a load
        # and the first forwards after it, per chunk, saved); vLLM lets its engine go as before
        self.release = release and (ec.engine == "vllm" or self.d.device.type != "cpu")
        init_dist(self.d)
        tconf = target.load_config(cfg.target)
        self.d2t, self.t2d, _ = tokens.load_vocab(self.run.require(self.run.vocab(), "vocab"))
        self.info = _info(cfg, tconf, self.d2t, str(self.d.device))
        self.tables = {"train": _read_table(self.run.require(self.run.tokens("train"),
                                                             "tokenize"))}
        self.row = {sid: i for i, sid in enumerate(self.tables["train"].column("id").to_pylist())}
        self.lengths = self.tables["train"].column("num_tokens").to_pylist()
        attn = str(getattr(tconf, "_attn_implementation", "") or "")
        self.packed = ec.engine == "vllm" or "flash" in attn  # vLLM pads nothing
        self.sleep = release and ec.engine == "vllm" and vllm_sleep_mode()
        if self.sleep:  # set at the engine's start: sleep and wake_up need it
            args = {**cfg.target.engine_args, "enable_sleep_mode": True}
            cfg = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target,
                                                                      engine_args=args))
        self.cfg, self.cap, self.asleep, self.checked = cfg, None, False, False
        self.stats = {"loads": 0, "load_s": 0.0, "wakes": 0, "wake_s": 0.0, "sleep_mode":
                      self.sleep, "chunks": 0, "tokens": 0, "seconds": 0.0, "shards_kept": 0,
                      "cpu_s": 0.0}

    def make(self, chunk: dict, plan_id: str) -> None:
        """Chunk `chunk` of plan `plan_id` into its folder, whole (COMPLETE last); every rank."""
        run, d, ec, c = self.run, self.d, self.cfg.extract, chunk["index"]
        t0, cpu0 = time.time(), time.process_time()
        missing = [sid for sid in chunk["ids"] if sid not in self.row]
        if missing:
            raise C.CaptureError(f"chunk {c} of the plan in {run.chunk_plan()} names samples "
                                 f"that {run.tokens('train')} lacks ({missing[:3]}): the plan "
                                 f"is another run's; start its train again")
        rows = [self.row[sid] for sid in chunk["ids"]]
        shards = plan_shards("train", [self.lengths[r] for r in rows], ec.shard_tokens,
                             ec.batch_tokens, self.packed)
        for s in shards:
            s.rows = [rows[i] for i in s.rows]
            s.path = run.chunk_shard(c, s.index)
        run.chunk(c).mkdir(parents=True, exist_ok=True)
        if d.main:  # shards no longer planned (another plan's chunk of this number)
            names = {s.path.name for s in shards}
            for p in run.chunk(c).glob("shard_*.safetensors"):
                if p.name not in names:
                    p.unlink()
        barrier(d)
        mine = shards if ec.tp else [s for s in shards if s.index % d.world == d.rank]
        writes = not ec.tp or d.rank == 0
        kept, todo, _ = _done_shards(mine, self.tables, self.info, d, [run.chunk_index(c)]) \
            if writes else ({}, [], 0)
        if ec.tp and d.on:
            keys = set(all_gather(d, [s.index for s in todo])[0])
            todo = [s for s in mine if s.index in keys]
        written = {}
        if any(all_gather(d, bool(todo))):
            self._wake(shards)
            written, _ = _write_shards(self.cap, self.info, self.tables, todo, ec, writes, d)
        entries = {i: e for (_, i), e in kept.items()}
        entries.update({int(p.stem.split("_")[1]): e for p, e in written.items()})
        every = {k: v for part in all_gather(d, entries) for k, v in part.items()}
        if d.main:
            index = store.write_index(run.chunk_index(c), self.info,
                                      [every[s.index] for s in shards],
                                      store.file_sha256(run.extract_head()))
            spool.mark_complete(run, c, plan_id, index)
            log.info("extract: chunk %d (steps %d-%d): %d samples, %d tokens, %s in %.0f s "
                     "(%d shards kept)", c, chunk["start"], chunk["end"] - 1,
                     index["num_samples"], index["num_tokens"], spool.size(index["bytes"]),
                     time.time() - t0, len(kept))
        barrier(d)
        self.stats["chunks"] += 1
        self.stats["tokens"] += sum(s.tokens for s in todo)
        self.stats["shards_kept"] += len(kept)
        self.stats["seconds"] += time.time() - t0
        self.stats["cpu_s"] += time.process_time() - cpu0  # this process's, all its threads
        if self.release:
            self.idle()

    def _wake(self, shards: list[Shard]) -> None:
        """The target ready: woken from sleep, else loaded (checked at its first load)."""
        if self.cap is not None and not self.asleep:
            return
        t = time.time()
        if self.asleep:
            try:
                self.cap.llm.wake_up()
                self.asleep = False
                self.stats["wakes"] += 1
                self.stats["wake_s"] += time.time() - t
                log.info("extract: vLLM woken in %.1f s", time.time() - t)
                return
            except Exception as e:  # noqa: BLE001 - an engine that cannot wake is loaded again
                log.warning("extract: vLLM's wake_up failed (%s): loading it again", e)
                self._close()
        self.cap = _load_capture(self.cfg, self.run, self.d, self.info, self.d2t, self.t2d,
                                 max(self.lengths, default=1))
        if not self.checked:
            _check_capture(self.cap, self.info, self.tables, shards)
            self.checked = True
        self.stats["loads"] += 1
        self.stats["load_s"] += time.time() - t
        log.info("extract: target loaded in %.0f s (load %d)", time.time() - t,
                 self.stats["loads"])

    def idle(self) -> None:
        """Let the GPUs go until the next chunk: vLLM sleeps (level 1: its weights to host
        memory, its KV cache dropped) where it can, else the target is closed."""
        if self.cap is None or self.asleep:
            return
        if self.sleep:
            try:
                self.cap.llm.sleep(level=1)
                self.asleep = True
                return
            except Exception as e:  # noqa: BLE001 - closed instead, loaded again next time
                log.warning("extract: vLLM's sleep failed (%s): closing it", e)
        self._close()

    def _close(self) -> None:
        import gc

        cap, self.cap, self.asleep = self.cap, None, False
        if isinstance(cap, VllmCapture):
            cap.close()
        del cap
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def close(self) -> None:
        self._close()
