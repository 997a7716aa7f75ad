"""The run directory: the only code that knows paths. Also manifests and atomic writes.

    runs/NAME/
      config.yaml                 the resolved config of the last invocation
      prepare/conversations.jsonl canonical {id, source, split, messages}; rejects.jsonl
      generate/conversations.jsonl regenerated answers (same schema); errors.jsonl; server.log
      tokenize/{train,val}.parquet id, input_ids, loss_mask, num_tokens
      vocab/vocab.safetensors     d2t [Vd] int64, t2d [V] bool, counts [V] int64; vocab.json
      extract/{train,val}/        shard_NNNNN.safetensors + index.json
      extract/head.safetensors    lm_head rows of the draft vocab [Vd, Ht] (store.py)
      train/                      step_NNNNNN/ checkpoints, metrics.jsonl, tb/; online,
                                  precompile.log (train's graphs compiled ahead of it)
      chunks/                     with max_disk_gib (the spool, unless extract.spool
                                  names another folder): chunk_NNNNN/ (shard_NNNNN.safetensors,
                                  index.json, COMPLETE written last), plan.json (train's chunk
                                  plan), progress.json (the next chunk train needs),
                                  .producer.lock (held by the one process that fills it)
      export/{native,speculators}/
      evaluate/                   metrics.json, report.md, *.png; tuned.json (what the tuned
                                  section of the export READMEs was written from)
    each step folder ends with manifest.json (written by pipeline.py) and, after a crash,
    failed.json; started.json records the fingerprint a partial folder belongs to.

Steps ask this module for paths (`Run(cfg).tokens("train")`) and never build them themselves.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from drafter import DrafterError

STEPS = ["prepare", "generate", "tokenize", "vocab", "extract", "train", "export", "evaluate"]

# Which steps' outputs each step reads (their manifests' hashes go into its fingerprint).
INPUTS: dict[str, list[str]] = {
    "prepare": [],
    "generate": ["prepare"],
    "tokenize": ["prepare", "generate"],
    "vocab": ["tokenize"],
    "extract": ["tokenize", "vocab"],
    "train": ["tokenize", "vocab", "extract"],
    "export": ["train"],
    "evaluate": ["export"],
}


def step_inputs(cfg, step: str) -> list[str]:
    """The steps whose outputs `step` reads under this config: INPUTS[step], except that an
    evaluate of drafters named by path (`evaluate.drafter`, `evaluate.baseline`) reads nothing
    of the run, so that any drafter can be evaluated in a run dir of its own."""
    if step == "evaluate" and "export" not in (cfg.evaluate.drafter, cfg.evaluate.baseline):
        return []
    return INPUTS[step]


# Which config sections each step's result depends on (hashed into its fingerprint).
SECTIONS: dict[str, list[str]] = {
    "prepare": ["prepare"],
    "generate": ["target", "generate"],
    "tokenize": ["target", "tokenize"],
    "vocab": ["vocab"],
    "extract": ["target", "extract", "train.online"],
    "train": ["target", "train"],
    "export": ["export"],
    "evaluate": ["target", "evaluate"],
}

# Fields added after runs existed, left out of the hash while they hold these values: a new
# field at its neutral value must not make finished steps stale (a 4-minute generate redone
# because a later release added a security switch). Add every new hashed field here, with the
# value that reproduces the behaviour from before it existed.
NEUTRAL: dict[str, object] = {
    "generate.server.allow_remote": False,
    "generate.extra_temperatures": [],
    "train.loss_chunk": 0,
    "extract.precompile": True,
    # auto gives the Llama layer that runs had, except for MLA targets: set train.draft_layer
    # to mla to retrain those (docs/train.md)
    "train.draft_layer": "auto",
    "train.mla": {},
    "train.method": "eagle3",
    "train.dspark": {"block_size": 8, "layers": 5, "target_layers": 5, "markov_rank": 64,
                     "confidence_head": True, "anchors": 256, "mask_token_id": None},
    "prepare.sources.field": None,   # through a list: in each source (holders)
    "evaluate.datasets.field": None,
    # the loss and optimizer choices at today's behaviour (drafter/train/losses.py)
    "train.loss": None,
    "train.position_weight": "decay",
    "train.dpace_alpha": 0.5,
    "train.noise": 0.0,
    "train.optimizer": "adamw",
    "train.muon_lr": None,
}

# Fields removed after runs existed (config.REMOVED), with the value they held (what drafter now
# always does), and values renamed, as (new spelling, old): hashed as before, so that a step
# finished before the change is not redone for it. Removed fields that were NEUTRAL at that
# value need no entry: they were left out of the hash already.
RETIRED: dict[str, tuple[object, object]] = {
    "train.loader_threads": (None, 4),
    "extract.self_check": (None, True),
    "extract.packing": (None, "auto"),
    "evaluate.cuda_graphs": (None, True),
    "extract.engine": ("drafter", "transformers"),
    "generate.server.engine": ("drafter", "local"),
}

def holders(parts: dict, dotted: str) -> list[tuple[dict, str]]:
    """(dict, key) of each place a NEUTRAL or RETIRED key names in a config's sections (`parts`:
    {section: its dict}); through a list, in every item (`prepare.sources.field`)."""
    section, *path = dotted.split(".")
    ds = [parts.get(section)]
    for key in path[:-1]:
        ds = [x for d in ds if isinstance(d, dict)
              for x in (d.get(key) if isinstance(d.get(key), list) else [d.get(key)])]
    return [(d, path[-1]) for d in ds if isinstance(d, dict) and path]


# Fields no step's output depends on, left out of every hash: where the chunks of a run pass
# (drafter/features/spool.py) changes nothing they hold.
UNHASHED = ("extract.spool",)


class MissingInput(DrafterError, FileNotFoundError):
    """An input of a step is absent; the message names the step that produces it."""


class Damaged(DrafterError):
    """A finished output fails its checksum (or cannot be read): `step` redoes what is damaged
    and keeps the rest when it runs again. Raised by readers; the pipeline records it."""

    def __init__(self, message: str, step: str | None = None, path: str | Path | None = None):
        super().__init__(message)
        self.step, self.path = step, (str(path) if path is not None else None)


class DamagedInput(MissingInput):
    """An input of a step exists but is damaged; the message names the step that redoes it."""


class ForeignFolder(DrafterError):
    """A run dir holds a file or folder drafter did not write where it would write."""


# The first line of RUN_DIR/config.yaml: only a file that starts with it (or one in a run dir
# whose steps drafter ran) is ever overwritten; a user's own config.yaml there is not.
SNAPSHOT_HEADER = "# drafter: the resolved config of the last command run in this directory\n"
# Files only drafter's pipeline writes in a step folder: a folder with one of them is drafter's.
PIPELINE_FILES = ("started.json", "manifest.json", "failed.json", "damaged.json")
# What each step writes in its folder (besides temp names): a folder without a pipeline file
# that holds anything else is not drafter's, and is never cleared.
OUTPUTS: dict[str, tuple[str, ...]] = {
    "prepare": ("conversations.jsonl", "rejects.jsonl", ".staging-*"),
    "generate": ("conversations.jsonl", "errors.jsonl", "synthetic_rejects.jsonl", "server*.log"),
    "tokenize": ("train.parquet", "val.parquet"),
    "vocab": ("vocab.safetensors", "vocab.json"),
    "extract": ("train", "val", "head.safetensors", "precompile*.log"),
    "train": ("step_[0-9]*", "metrics.jsonl", "tb", "precompile*.log"),
    "export": ("native", "speculators"),
    "evaluate": ("metrics.json", "report.md", "*.png", "passes", "tuned.json"),
}
TEMP_NAMES = (".tmp-*", ".tmp*", ".old-*")


class Run:
    """Paths of one run directory."""

    def __init__(self, run_dir: str | Path, spool: str | Path | None = None):
        self.root = Path(run_dir)
        self._spool = Path(spool).expanduser() if spool else None

    @classmethod
    def of(cls, cfg) -> "Run":
        return cls(cfg.run_dir, cfg.extract.spool)

    # -- generic
    def step_dir(self, step: str) -> Path:
        assert step in STEPS, step
        return self.root / step

    def manifest(self, step: str) -> Path:
        return self.step_dir(step) / "manifest.json"

    def failed(self, step: str) -> Path:
        return self.step_dir(step) / "failed.json"

    def started(self, step: str) -> Path:
        return self.step_dir(step) / "started.json"

    def damaged(self, step: str) -> Path:
        """Written by the pipeline when a later step found this step's output damaged."""
        return self.step_dir(step) / "damaged.json"

    def config_snapshot(self) -> Path:
        return self.root / "config.yaml"

    def read_manifest(self, step: str) -> dict | None:
        """The step's manifest, None when there is none; Damaged when it cannot be read or
        fails its checksum (a torn or edited file: the step is then not done)."""
        p = self.manifest(step)
        if not p.exists():
            return None
        try:
            m = read_json(p)
        except (OSError, ValueError) as e:
            raise Damaged(f"{p} is unreadable ({e})", step, p) from None
        if not isinstance(m, dict) or not seal_ok(m):
            raise Damaged(f"{p} fails its checksum", step, p)
        return m

    def foreign(self, step: str) -> list[str]:
        """What in the step's folder drafter did not write (a user's own `train/`): [] for a
        missing folder, a folder holding one of the pipeline's files, or one holding only
        names the step writes (OUTPUTS)."""
        from fnmatch import fnmatch

        d = self.step_dir(step)
        if not d.is_dir():
            return [d.name] if d.exists() else []
        names = sorted(p.name for p in d.iterdir())
        if any(n in PIPELINE_FILES for n in names):
            return []
        return [n for n in names
                if not any(fnmatch(n, pat) for pat in OUTPUTS[step] + TEMP_NAMES)]

    def snapshot_is_ours(self) -> bool:
        """RUN_DIR/config.yaml may be overwritten: absent, written by drafter (its header), or
        in a run dir where drafter ran a step (snapshots from before the header)."""
        p = self.config_snapshot()
        if not p.exists():
            return True
        if p.is_file():
            with open(p, "rb") as f:
                if f.read(len(SNAPSHOT_HEADER)) == SNAPSHOT_HEADER.encode():
                    return True
        return p.is_file() and any((self.step_dir(s) / n).exists()
                                   for s in STEPS for n in PIPELINE_FILES)

    def lock(self) -> Path:
        """flock'ed by the drafter process working in this run dir; holds its PID."""
        return self.root / ".lock"

    def trash(self, step: str) -> Path:
        """Where a step folder is renamed before it is deleted (pipeline._clear)."""
        return self.root / f".trash-{step}-{os.getpid()}-{time.time_ns()}"

    def trash_dirs(self) -> list[Path]:
        return sorted(self.root.glob(".trash-*")) if self.root.exists() else []

    def require(self, path: Path, step: str) -> Path:
        """Return `path`, or raise MissingInput naming the step that makes it."""
        if not path.exists():
            raise MissingInput(f"{path} not found: run `drafter {step} CONFIG` first "
                               f"(or `drafter run CONFIG`)")
        return path

    # -- prepare
    def conversations(self, step: str = "prepare") -> Path:
        """prepare/conversations.jsonl or generate/conversations.jsonl."""
        assert step in ("prepare", "generate")
        return self.step_dir(step) / "conversations.jsonl"

    def rejects(self) -> Path:
        return self.step_dir("prepare") / "rejects.jsonl"

    # -- generate
    def generate_errors(self) -> Path:
        return self.step_dir("generate") / "errors.jsonl"

    def server_log(self) -> Path:
        return self.step_dir("generate") / "server.log"

    def synthetic_rejects(self) -> Path:
        return self.step_dir("generate") / "synthetic_rejects.jsonl"

    # -- tokenize
    def tokens(self, split: str) -> Path:
        assert split in ("train", "val")
        return self.step_dir("tokenize") / f"{split}.parquet"

    # -- vocab
    def vocab(self) -> Path:
        return self.step_dir("vocab") / "vocab.safetensors"

    def vocab_info(self) -> Path:
        return self.step_dir("vocab") / "vocab.json"

    # -- extract
    def shards(self, split: str) -> Path:
        assert split in ("train", "val")
        return self.step_dir("extract") / split

    def shard(self, split: str, i: int) -> Path:
        return self.shards(split) / f"shard_{i:05d}.safetensors"

    def shard_index(self, split: str) -> Path:
        return self.shards(split) / "index.json"

    def vllm_states(self) -> Path:
        """Where vLLM writes per-request hidden states for extract.engine=vllm (read, deleted)."""
        return self.step_dir("extract") / ".engine-states"

    def extract_head(self) -> Path:
        return self.step_dir("extract") / "head.safetensors"

    # -- chunks (max_disk_gib): the spool between extract and train
    def spool(self) -> Path:
        """extract.spool, else RUN_DIR/chunks."""
        return self._spool if self._spool is not None else self.root / "chunks"

    def chunk(self, c: int) -> Path:
        return self.spool() / f"chunk_{c:05d}"

    def chunk_shard(self, c: int, i: int) -> Path:
        return self.chunk(c) / f"shard_{i:05d}.safetensors"

    def chunk_index(self, c: int) -> Path:
        return self.chunk(c) / "index.json"

    def chunk_complete(self, c: int) -> Path:
        """Written last: the chunk's shards and index are all there."""
        return self.chunk(c) / "COMPLETE"

    def chunk_plan(self) -> Path:
        """Train's chunk plan: which steps and samples each chunk holds (train writes it)."""
        return self.spool() / "plan.json"

    def chunk_progress(self) -> Path:
        """The next chunk train needs (train writes it; the producer reads it)."""
        return self.spool() / "progress.json"

    def spool_lock(self) -> Path:
        """flock'ed by the one process that fills the spool."""
        return self.spool() / ".producer.lock"

    # -- train
    def checkpoint(self, step: int) -> Path:
        return self.step_dir("train") / f"step_{step:06d}"

    def checkpoints(self) -> list[Path]:
        d = self.step_dir("train")
        return sorted(p for p in d.glob("step_[0-9]*") if (p / "COMPLETE").exists()) \
            if d.exists() else []

    def train_metrics(self) -> Path:
        return self.step_dir("train") / "metrics.jsonl"

    def tensorboard(self) -> Path:
        return self.step_dir("train") / "tb"

    # -- export
    def export(self, fmt: str) -> Path:
        assert fmt in ("native", "speculators")
        return self.step_dir("export") / fmt

    # -- evaluate
    def eval_metrics(self) -> Path:
        return self.step_dir("evaluate") / "metrics.json"

    def eval_report(self) -> Path:
        return self.step_dir("evaluate") / "report.md"

    def eval_plot(self, name: str) -> Path:
        return self.step_dir("evaluate") / f"{name}.png"

    def eval_passes(self) -> Path:
        """The decoding passes an interrupted evaluate keeps (one JSON file each)."""
        return self.step_dir("evaluate") / "passes"

    def eval_tuned(self) -> Path:
        """What the tuned section of the export READMEs was written from (drafter.measure.tuned)."""
        return self.step_dir("evaluate") / "tuned.json"

    # -- learn (`drafter learn`, docs/learn.md): not a step; no manifest
    def learn(self, name: str = "") -> Path:
        """RUN_DIR/learn/NAME: traffic/ (the kept requests), serving.json, swaps.jsonl,
        proposal.json, rollback.json, learner.json, server.log, learner.log, .lock."""
        return self.root / "learn" / name if name else self.root / "learn"

    def learn_version(self, n: int) -> Path:
        """A drafter served or judged: native layout, without embed_tokens (vLLM shares the
        target's)."""
        return self.learn("versions") / f"v{n:04d}"

    def learn_round(self, n: int) -> Path:
        """A training round, a run dir of its own: train/ (checkpoints, metrics), train.parquet,
        round.json, judged.json."""
        return self.learn("rounds") / f"r{n:04d}"


def cache_dir() -> Path:
    """Where materialised targets live: $DRAFTER_CACHE, default ~/.cache/drafter."""
    return Path(os.environ.get("DRAFTER_CACHE") or Path.home() / ".cache" / "drafter")


# ----------------------------------------------------------------------------------- atomic writes
def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def pid_lock(path: Path):
    """(file, "") with `path` flock-ed and our PID written in it (the kernel releases the lock
    when the process dies, even by kill -9), or (None, the holder's PID or "?") when another
    process holds it. The caller keeps the file open while it holds the lock and hands it to
    pid_unlock."""
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        return None, holder
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f, ""


def pid_unlock(f) -> None:
    fcntl.flock(f, fcntl.LOCK_UN)
    f.close()


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", **kw) -> Iterator[Any]:
    """Write to a temp file beside `path`, fsync, then rename over it. A crash leaves either the
    old file or the new one, never a partial one. Temp names start with '.tmp-'."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        with open(tmp, mode, **kw) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write(path: str | Path, data: str | bytes) -> None:
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def atomic_json(path: str | Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2, default=str) + "\n")


def remove_dir(path: str | Path, trash: str | Path | None = None) -> None:
    """Delete a folder without ever leaving a half one under its name: rename it out of the way
    (atomic; by default to the sibling `.old-NAME.PID` that atomic_dir also uses), then delete
    that. A kill mid-delete leaves only the renamed folder, for its owner's cleanup."""
    path = Path(path)
    trash = Path(trash) if trash else path.with_name(f".old-{path.name}.{os.getpid()}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Build a directory under a temp name, then rename it into place (replacing an old one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}.", dir=path.parent))
    try:
        yield tmp
        for p in tmp.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        if path.exists():
            old = path.with_name(f".old-{path.name}.{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def safe_save_file(tensors: dict, path: str | Path, metadata: dict | None = None) -> None:
    """safetensors.save_file, atomically, and byte-identical for equal inputs (see below)."""
    from safetensors.torch import save

    atomic_write(path, canonical_safetensors(save(tensors, metadata=metadata)))


def canonical_safetensors(blob: bytes) -> bytes:
    """safetensors keeps header entries and metadata keys in a hash map whose order changes from
    one process to the next, so equal tensors can give different files (and different sha256s).
    Rewrite the JSON header with sorted keys; its length and the data offsets do not change."""
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    assert len(text) <= n, "canonical header longer than the original"
    return blob[:8] + text + b" " * (n - len(text)) + blob[8 + n:]


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


# ---------------------------------------------------------------------------------- checksums
def _seal_digest(body: dict) -> str:
    import hashlib

    # the JSON text as written and read back (int keys become strings, tuples lists), so that
    # the digest of a read-back file equals the one computed before writing it
    norm = json.loads(json.dumps(body, default=str))
    return hashlib.sha256(json.dumps(norm, sort_keys=True).encode()).hexdigest()


def sealed(obj: dict) -> dict:
    """`obj` with a "checksum" key: the sha256 of the rest. Manifests and shard indexes carry
    one; `seal_ok` verifies it when they are read."""
    body = {k: v for k, v in obj.items() if k != "checksum"}
    return {**body, "checksum": "sha256:" + _seal_digest(body)}


def seal_ok(obj: dict) -> bool:
    """The checksum matches; a file written before checksums existed (no key) passes."""
    c = obj.get("checksum")
    if c is None:
        return True
    return c == "sha256:" + _seal_digest({k: v for k, v in obj.items() if k != "checksum"})


# ------------------------------------------------------------------------------ append-only JSONL
def read_jsonl(path: str | Path, repair: bool = False, bad: list | None = None) -> list[dict]:
    """Records of a JSONL file written by `JsonlAppender`. A torn last line (a kill mid-write:
    no newline) is ignored, and cut off the file when `repair` is true, so that appending can
    resume. A damaged line inside the file (not JSON, not UTF-8, not an object) is skipped and
    the records after it are kept; `bad` receives its line number."""
    path = Path(path)
    if not path.exists():
        return []
    out, good_bytes = [], 0
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break  # torn tail: the only thing a kill leaves
            good_bytes += len(line)
            try:
                rec = json.loads(line)
            except ValueError:  # JSONDecodeError, UnicodeDecodeError
                rec = None
            if isinstance(rec, dict):
                out.append(rec)
            elif line.strip():
                if bad is not None:
                    bad.append(n)
    if repair and good_bytes != path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
            os.fsync(f.fileno())
    return out


class JsonlAppender:
    """Append records one line at a time, flushed and fsynced, so that a kill loses at most the
    line being written (which `read_jsonl(repair=True)` then cuts off)."""

    def __init__(self, path: str | Path, fsync: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.path, "ab")
        self.fsync = fsync

    def write(self, record: dict) -> None:
        self.f.write((json.dumps(record, ensure_ascii=False) + "\n").encode())
        self.f.flush()
        if self.fsync:
            os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0
