"""Hidden-state shards: encode, write (atomically, with sha256), index, verify, read.

Shapes: T tokens of a shard, S samples of a shard, L aux layers, Ht target hidden, k top-k.

    extract/{train,val}/shard_NNNNN.safetensors   one shard (names from rundir.Run)
        input_ids         [T] int32
        loss_mask         [T] uint8
        in_vocab          [T] bool      the target's argmax is in the draft vocab
        offsets           [S+1] int64   sample s = tokens offsets[s]:offsets[s+1]
        aux               [T, L, Ht] bf16, or float8_e4m3fn with
        aux_scale         [T, L] float32  (aux = fp8 * scale; scale = amax / 448 per token, layer)
        teacher_hidden    [T, Ht] bf16                      (teacher=hidden)
        teacher_topk_ids  [T, k] int16 (int32 if Vd > 32768) (teacher=topk: draft-vocab ids)
        teacher_topk_logp [T, k] float16                    (their log-probs over the draft vocab)
      metadata: one key "drafter" holding JSON {format, version, info (layer ids, Ht, N, dtype,
      options), ids (the sample ids), content_sha256 (of the tensors' bytes: a shard verifies
      itself even before the index exists, e.g. after a kill)}. One key, because safetensors
      writes several in a per-process random order, and equal shards must be equal files.
    extract/{train,val}/index.json   info + per shard: file, sha256 (of the file), bytes, ids,
                                     lengths; totals and bytes_per_token
    extract/head.safetensors         weight [Vd, Ht]: the target's lm_head rows of the draft vocab
                                     (teacher_logprobs needs it for teacher=hidden)

`Reader(run, split)` gives training the per-sample dicts of docs/internals.md whatever the options
(fp8 dequantised to bf16, ids int64, log-probs float32); `teacher_logprobs(sample, head)` turns
either teacher form into dense log-probs over the draft vocab. `bytes_per_token` is the storage
formula (`drafter plan` uses it too); the reference EAGLE-3 layout stores 8*Ht + 16 bytes.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import queue
import threading
from pathlib import Path
from typing import Sequence

import torch

from drafter import DrafterError
from drafter.core.rundir import Damaged, atomic_write, read_json, seal_ok, sealed
from drafter.features.capture import Head

log = logging.getLogger("drafter")

FORMAT = "drafter-hidden-states"
VERSION = 1
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class ShardError(DrafterError):
    """A shard or index is missing, corrupt, or from another format version."""


class CorruptShard(ShardError, Damaged):
    """A shard fails its sha256: extract redoes it (and keeps the others) when it runs again."""


# --------------------------------------------------------------------------------- the formula
def topk_id_bytes(draft_vocab_size: int) -> int:
    return 2 if draft_vocab_size <= 32768 else 4


def bytes_per_token(hidden_size: int, n_aux: int = 3, aux_dtype: str = "bf16",
                    teacher: str = "hidden", topk: int = 64, draft_vocab_size: int = 32000) -> int:
    """Shard bytes per token (per-sample offsets and headers excluded: < 0.1% at 100 tokens).

    6 (input_ids int32, loss_mask, in_vocab) + aux (L*Ht*2 for bf16; L*Ht + 4L for fp8 with a
    float32 scale per token and layer) + teacher (Ht*2 for hidden; k*(2 or 4 + 2) for top-k)."""
    b = 4 + 1 + 1
    b += n_aux * hidden_size * 2 if aux_dtype == "bf16" else n_aux * hidden_size + 4 * n_aux
    if teacher == "hidden":
        b += hidden_size * 2
    else:
        k = min(topk, draft_vocab_size)
        b += k * (topk_id_bytes(draft_vocab_size) + 2)
    return b


def reference_bytes_per_token(hidden_size: int) -> int:
    """The reference layout: 3 bf16 aux states + a bf16 final hidden + 16 bytes of ids/masks."""
    return 8 * hidden_size + 16


# -------------------------------------------------------------------------------- fp8 encoding
def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., Ht] -> (q [..., Ht] float8_e4m3fn, scale [...] float32), x ≈ q * scale."""
    amax = x.abs().amax(-1).float()                                         # [...]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x.float() / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (q.float() * scale[..., None].float()).to(torch.bfloat16)        # [..., Ht]


def encode(flat: dict, loss_mask: torch.Tensor, aux_dtype: str, draft_vocab_size: int) -> dict:
    """Capture output (capture.Capture.run) -> the shard tensors, on flat's device."""
    t = {"input_ids": flat["input_ids"].to(torch.int32),
         "loss_mask": loss_mask.to(flat["input_ids"].device, torch.uint8),
         "in_vocab": flat["in_vocab"].bool(),
         "offsets": flat["offsets"].long()}
    if aux_dtype == "fp8":
        t["aux"], t["aux_scale"] = quantize_fp8(flat["aux"])
    elif aux_dtype == "bf16":
        t["aux"] = flat["aux"].to(torch.bfloat16)
    else:
        raise ShardError(f"extract.aux_dtype: must be bf16 or fp8, got {aux_dtype!r}")
    if "teacher_hidden" in flat:
        t["teacher_hidden"] = flat["teacher_hidden"].to(torch.bfloat16)
    else:
        id_dtype = torch.int16 if topk_id_bytes(draft_vocab_size) == 2 else torch.int32
        t["teacher_topk_ids"] = flat["teacher_topk_ids"].to(id_dtype)
        t["teacher_topk_logp"] = flat["teacher_topk_logp"].to(torch.float16)
    return t


def concat(parts: Sequence[dict]) -> dict:
    """Concatenate encoded batches into one shard (offsets rebased)."""
    out = {}
    for k in parts[0]:
        if k == "offsets":
            base, offs = 0, [parts[0]["offsets"][:1]]
            for p in parts:
                offs.append(p["offsets"][1:] + base)
                base += int(p["offsets"][-1])
            out[k] = torch.cat(offs)
        else:
            out[k] = torch.cat([p[k] for p in parts])
    return out


def decode(t: dict) -> dict:
    """Stored tensors (a shard or a slice of it) -> the contract's dtypes."""
    return {"input_ids": t["input_ids"].long(), "loss_mask": t["loss_mask"].long(),
            "in_vocab": t["in_vocab"].bool(), **decode_features(t)}


def decode_features(t: dict) -> dict:
    """The features of stored tensors -> the contract's dtypes, where they are (a sample on the
    host, or a training batch on the GPU: batches.widen): aux bfloat16 (fp8 times aux_scale),
    teacher_hidden bfloat16, or teacher_topk_ids int64 and teacher_topk_logp float32."""
    out = {"aux": dequantize_fp8(t["aux"], t["aux_scale"]) if "aux_scale" in t
           else t["aux"].to(torch.bfloat16)}
    if "teacher_hidden" in t:
        out["teacher_hidden"] = t["teacher_hidden"].to(torch.bfloat16)
    else:
        out["teacher_topk_ids"] = t["teacher_topk_ids"].long()
        out["teacher_topk_logp"] = t["teacher_topk_logp"].float()
    return out


# ------------------------------------------------------------------------------- shard files
def content_sha256(tensors: dict) -> str:
    """sha256 over name, dtype, shape and raw bytes of each tensor, in name order."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].detach().contiguous().cpu()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def write_shard(path: Path, tensors: dict, info: dict, ids: list[str]) -> dict:
    """Write one shard atomically (temp name, fsync, rename) and hash it. Returns its index
    entry. safetensors' save_file writes straight from the tensors' memory (no bytes copy)."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    meta = {"format": FORMAT, "version": VERSION, "info": info, "ids": list(ids),
            "content_sha256": content_sha256(tensors)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        save_file(tensors, str(tmp), metadata={"drafter": json.dumps(meta, sort_keys=True)})
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    offsets = tensors["offsets"].tolist()
    return {"file": path.name, "sha256": file_sha256(path), "bytes": path.stat().st_size,
            "num_samples": len(ids), "num_tokens": offsets[-1], "ids": list(ids),
            "lengths": [b - a for a, b in zip(offsets[:-1], offsets[1:])]}


def fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_shard(path: Path, ids: list[str] | None = None, entry: dict | None = None,
                info: dict | None = None) -> dict | None:
    """The index entry of a good shard, or None when it is missing, corrupt, or not the planned
    one. The header must name these sample `ids` and options `info`; then the file's sha256 must
    match `entry` (from the index), or without an entry (a kill before the index was written)
    the tensors must match the content hash in the header."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            meta = json.loads(json.loads(f.read(n))["__metadata__"]["drafter"])
        if meta.get("format") != FORMAT:
            return None
        if ids is not None and meta["ids"] != list(ids):
            return None
        if info is not None and meta["info"] != json.loads(json.dumps(info, sort_keys=True)):
            return None
        if entry is not None:
            return entry if file_sha256(path) == entry["sha256"] else None
        from safetensors.torch import load

        blob = path.read_bytes()           # one read for both the tensors and the file hash
        tensors = load(blob)
        if content_sha256(tensors) != meta["content_sha256"]:
            return None
    except Exception:  # noqa: BLE001 - unreadable, truncated, not safetensors, not ours
        return None
    offsets = tensors["offsets"].tolist()
    return {"file": path.name, "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob),
            "num_samples": len(meta["ids"]), "num_tokens": offsets[-1], "ids": meta["ids"],
            "lengths": [b - a for a, b in zip(offsets[:-1], offsets[1:])]}


_copy_streams: dict = {}


def to_host(tensors: dict) -> tuple[dict, object]:
    """Start copying device tensors to pinned host memory on a side stream, so that the next
    forward runs while they travel. Returns (host tensors, event to wait on before reading them;
    None for CPU tensors, which are returned as they are)."""
    devs = {v.device for v in tensors.values() if v.is_cuda}
    if not devs:
        return tensors, None
    dev = next(iter(devs))
    stream = _copy_streams.get(dev)
    if stream is None:
        stream = _copy_streams[dev] = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    out = {}
    with torch.cuda.stream(stream):
        for k, v in tensors.items():
            if not v.is_cuda:  # capture's offsets are made on the host and stay there
                out[k] = v
                continue
            h = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
            h.copy_(v, non_blocking=True)
            v.record_stream(stream)  # the allocator keeps v until the copy is done
            out[k] = h
        event = torch.cuda.Event()
        event.record(stream)
    return out, event


class ShardWriter:
    """Writes shards on background threads, so that the target's next forwards overlap copying
    to the host, concatenating, hashing (hashlib releases the GIL), the disk and fsync.

    submit(path, parts, ids): parts = [(encoded batch tensors, event or None)] from `to_host`.
    At most `depth` shards wait beyond the `threads` being written; an error in a thread is
    raised by the next `submit` or by `close`."""

    def __init__(self, info: dict, threads: int = 3, depth: int = 2):
        self.info = info
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.entries: dict[Path, dict] = {}
        self.error: BaseException | None = None
        self.threads = [threading.Thread(target=self._loop, name=f"shard-writer-{i}",
                                         daemon=True) for i in range(threads)]
        for t in self.threads:
            t.start()

    def _loop(self):
        while True:
            job = self.q.get()
            if job is None:
                return
            path, parts, ids = job
            try:
                if self.error is None:
                    for _, event in parts:
                        if event is not None:
                            event.synchronize()
                    tensors = concat([t for t, _ in parts])
                    self.entries[path] = write_shard(path, tensors, self.info, ids)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                self.error = e

    def _raise(self):
        if self.error is not None:
            raise self.error

    def submit(self, path: Path, parts: list, ids: list[str]) -> None:
        self._raise()
        self.q.put((Path(path), parts, ids))

    def close(self) -> dict[Path, dict]:
        for _ in self.threads:
            self.q.put(None)
        for t in self.threads:
            t.join()
        self._raise()
        return self.entries

    def stop(self) -> None:
        """After an error or a signal: the shards being written finish (each is complete or
        absent), those waiting are dropped, and the threads end here: a thread still in torch
        when the interpreter exits aborts the process instead of its exit status."""
        self.error = self.error or _Stopped()  # the threads take the queued jobs, unwritten
        for t in self.threads:
            while t.is_alive():
                with contextlib.suppress(queue.Full):
                    self.q.put_nowait(None)
                t.join(0.05)


class _Stopped(Exception):
    """ShardWriter.stop: the jobs still queued are not written."""


# ---------------------------------------------------------------------------------- the index
def write_index(path: Path, info: dict, entries: list[dict], head_sha256: str | None) -> dict:
    """The split's index (sealed with its own checksum). `mtime_ns` records each shard's
    modification time beside its size, so that a shard rewritten in place since (same size)
    is seen without hashing it (`verify_extract`)."""
    path = Path(path)
    n_tok = sum(e["num_tokens"] for e in entries)
    n_bytes = sum(e["bytes"] for e in entries)
    index = {"format": FORMAT, "version": VERSION, "info": info,
             "num_samples": sum(e["num_samples"] for e in entries), "num_tokens": n_tok,
             "bytes": n_bytes, "bytes_per_token": round(n_bytes / n_tok, 2) if n_tok else None,
             "head_sha256": head_sha256, "shards": entries,
             "mtime_ns": {e["file"]: (path.parent / e["file"]).stat().st_mtime_ns
                          for e in entries if (path.parent / e["file"]).exists()}}
    index = sealed(index)
    atomic_write(path, json.dumps(index, indent=1) + "\n")
    return index


def read_index(path: Path) -> dict:
    try:
        index = read_json(path)
    except (OSError, ValueError) as e:
        raise ShardError(f"{path}: unreadable index ({e}): rerun `drafter extract CONFIG`") \
            from None
    if not isinstance(index, dict) or not seal_ok(index):
        raise ShardError(f"{path}: the index fails its checksum: rerun `drafter extract "
                         f"CONFIG`")
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ShardError(f"{path}: format {index.get('format')} v{index.get('version')}, this "
                         f"drafter reads {FORMAT} v{VERSION}: rerun `drafter extract --force`")
    return index


_VERIFIED: set = set()   # (path, size, mtime_ns, sha256) hashed in full by this process


def verify_extract(run, full: bool = False, splits=("train", "val")) -> list[str]:
    """What is wrong with extract's finished output, one line each ([] when intact): an index
    that is unreadable or fails its checksum; a shard missing, of another size, or modified
    since the index was written. `full` also hashes every shard and the head (sha256, several
    files at once; a file already hashed by this process unchanged since is not read again).
    `splits`: ("val",) for a chunked extract, whose train split lives in chunks."""
    problems, todo = [], []
    for split in splits:
        ip = run.shard_index(split)
        if not ip.exists():
            if split == "train":
                problems.append(f"{ip} missing")
            continue
        try:
            index = read_index(ip)
        except ShardError as e:
            problems.append(str(e))
            continue
        times = index.get("mtime_ns") or {}
        for e in index["shards"]:
            p = ip.parent / e["file"]
            try:
                st = p.stat()
            except OSError:
                problems.append(f"{p} missing")
                continue
            if st.st_size != e["bytes"] or times.get(e["file"], st.st_mtime_ns) != st.st_mtime_ns:
                problems.append(f"{p} changed since extract wrote it")
            elif full:
                todo.append((p, st, e["sha256"]))
        head = run.extract_head()
        if full and index.get("head_sha256") and head.exists():
            todo.append((head, head.stat(), index["head_sha256"]))
    return problems + [f"{p} fails its sha256" for p in failing_sha256(todo)]


def failing_sha256(todo: list) -> list[Path]:
    """The files of `todo` [(path, stat, sha256)] whose sha256 differs, hashed several at once
    (hashlib releases the GIL); a file this process hashed before, unchanged since, is not read
    again."""
    from concurrent.futures import ThreadPoolExecutor

    todo = list({str(p): (p, st, sha) for p, st, sha in todo}.values())

    def ok(item) -> bool:
        p, st, sha = item
        key = (str(p), st.st_size, st.st_mtime_ns, sha)
        if key not in _VERIFIED:
            if file_sha256(p) != sha:
                return False
            _VERIFIED.add(key)
        return True

    with ThreadPoolExecutor(max_workers=8) as pool:
        return [p for (p, _, _), good in zip(todo, pool.map(ok, todo)) if not good]


def save_head(path: Path, head: Head, info: dict) -> str:
    """Write the draft-vocab lm_head rows; returns the file's sha256."""
    from safetensors.torch import save

    blob = save({"weight": head.weight.detach().contiguous().cpu()},
                metadata={"drafter": json.dumps({"format": FORMAT, "logit_scale": head.scale,
                                                 "logit_softcap": head.softcap, "info": info},
                                                sort_keys=True)})
    atomic_write(path, blob)
    return hashlib.sha256(blob).hexdigest()


def load_head(path: Path) -> Head:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        w = f.get_tensor("weight")
    meta = json.loads(meta["drafter"])
    return Head(w, float(meta["logit_scale"]), meta["logit_softcap"])


# -------------------------------------------------------------------------------- the reader
class Reader:
    """The samples of one split, as the per-sample dicts of docs/internals.md.

        r = Reader(run, "train")
        len(r), r.lengths[i], r.ids[i], r[i] -> {"input_ids", "loss_mask", "aux", "in_vocab",
                                                 "teacher_hidden" | "teacher_topk_*"}
        r.info   layer_ids, num_layers, hidden_size, teacher, topk, aux_dtype, ...
        r.head() -> capture.Head (lm_head rows of the draft vocab)

    Reads only the rows of one sample (safetensors slices over mmap). Safe to pass to DataLoader
    workers: open files are not pickled."""

    MAX_OPEN = 32

    def __init__(self, run, split: str, verify: bool = False, chunk: int | None = None):
        """chunk: the shards of one chunk of the train split (max_disk_gib), in
        run.chunk(chunk)/ instead of extract/{split}/."""
        self.run, self.split = run, split
        if chunk is None:
            path = run.require(run.shard_index(split), "extract")
        else:
            path = run.chunk_index(chunk)
        self.index = read_index(path)
        self.info = self.index["info"]
        self.paths = [run.shard(split, i) if chunk is None else run.chunk_shard(chunk, i)
                      for i in range(len(self.index["shards"]))]
        for p, e in zip(self.paths, self.index["shards"]):
            if p.name != e["file"]:
                raise ShardError(f"{path}: shard {e['file']} is out of order")
        self.lengths: list[int] = []
        self.ids: list[str] = []
        self._where: list[tuple[int, int, int]] = []     # (shard, first token, end token)
        for s, e in enumerate(self.index["shards"]):
            a = 0
            for n, sid in zip(e["lengths"], e["ids"]):
                self._where.append((s, a, a + n))
                self.lengths.append(n)
                self.ids.append(sid)
                a += n
        self._open: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._head: Head | None = None
        if verify:
            bad = self.verify()
            if bad:
                raise CorruptShard(f"corrupt shards (sha256 mismatch): "
                                   f"{', '.join(map(str, bad))}; rerun `drafter extract CONFIG`: "
                                   f"it redoes them and keeps the others", "extract", bad[0])

    def __len__(self) -> int:
        return len(self._where)

    @property
    def num_tokens(self) -> int:
        return self.index["num_tokens"]

    def verify(self) -> list[Path]:
        """Shards (and the head) whose sha256 does not match the index."""
        bad = [p for p, e in zip(self.paths, self.index["shards"])
               if not p.is_file() or file_sha256(p) != e["sha256"]]
        head = self.run.extract_head()
        if self.index.get("head_sha256") and (not head.is_file()
                                              or file_sha256(head) != self.index["head_sha256"]):
            bad.append(head)
        return bad

    def _file(self, s: int):
        from safetensors import safe_open

        with self._lock:  # batches are built on several threads (batches.Prefetch)
            f = self._open.get(s)
            if f is None:
                if not self.paths[s].is_file():
                    raise ShardError(f"{self.paths[s]} missing: rerun `drafter extract CONFIG`")
                f = safe_open(str(self.paths[s]), "pt")
                self._open[s] = f
                if len(self._open) > self.MAX_OPEN:
                    self._open.popitem(last=False)
            else:
                self._open.move_to_end(s)
            return f

    def stored(self, i: int) -> dict:
        """Sample i in the dtypes it is stored in (`encode`'s: int32 ids, fp8 aux + aux_scale or
        bf16 aux, int16/int32 top-k ids and float16 log-probs): training's batches carry these
        to the device, which widens them (batches.widen). Safe from several threads."""
        s, a, b = self._where[i]
        f = self._file(s)
        return {k: f.get_slice(k)[a:b] for k in f.keys() if k != "offsets"}

    def __getitem__(self, i: int) -> dict:
        return decode(self.stored(i))

    def head(self) -> Head:
        if self._head is None:
            self._head = load_head(self.run.require(self.run.extract_head(), "extract"))
        return self._head

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_open"] = collections.OrderedDict()
        del d["_lock"]
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._lock = threading.Lock()


# ------------------------------------------------------------------------- the teacher, dense
def teacher_logprobs(sample: dict, head: Head | torch.Tensor | int) -> torch.Tensor:
    """Dense teacher log-probs over the draft vocab, [..., T, Vd] float32, from either form.

    teacher=hidden: log_softmax(head.logits(teacher_hidden)), head = the draft-vocab lm_head rows
    [Vd, Ht] (a capture.Head, or a plain tensor: no scale or softcap).
    teacher=topk: the k stored log-probs at their ids; the rest of the mass (1 - Σ exp) spread
    evenly over the other Vd - k ids (floored at the smallest normal float, never -inf), so that
    the k most likely tokens keep the target's exact probabilities. `head` gives Vd (an int works).
    Works on one sample [T, ...] or a batch [B, T, ...]."""
    if "teacher_hidden" in sample:
        if isinstance(head, int):
            raise ShardError("teacher_logprobs: teacher=hidden needs the lm_head rows, not Vd")
        h = head if isinstance(head, Head) else Head(head)
        return torch.log_softmax(h.logits(sample["teacher_hidden"]), -1)
    vd = head if isinstance(head, int) else (head.weight if isinstance(head, Head)
                                             else head).shape[0]
    ids, logp = sample["teacher_topk_ids"], sample["teacher_topk_logp"].float()   # [..., T, k]
    k = ids.shape[-1]
    rest = (1.0 - logp.exp().sum(-1)).clamp_min(0.0)                              # [..., T]
    tiny = torch.finfo(torch.float32).tiny
    tail = torch.log(rest.clamp_min(tiny) / max(vd - k, 1))                       # [..., T]
    out = tail[..., None].expand(*tail.shape, vd).clone()                          # [..., T, Vd]
    return out.scatter_(-1, ids.long(), logp)
