"""Which format a record is in, and a raw record as canonical chat messages.

    fmt = detect_format(first_records, "data/chats.jsonl")   # or SourceConfig.format
    messages, tools = to_messages(record, fmt)                 # raises BadRecord
    messages = check_conversation(messages, require_assistant, stats)

drafter.data.sources reads the files and calls these for each record; a `BadRecord` becomes a
`Reject` there (file, line, reason code, detail).

Record formats, detected from the first records unless `SourceConfig.format` names one:
  sharegpt  {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}], "system"?}
  openai    {"messages": [{"role", "content", "reasoning_content"?, "tool_calls"?}], "tools"?}
  alpaca    {"instruction", "input"?, "output"}  (or "instances": [{"input", "output"}, ...])
  prompt    {"turns": [...]} (MT-bench: successive user turns), or one of "prompt", "question",
            "instruction" (+ "input"), "query"
Messages may use from/value or role/content in either list format. Content given as a list of
text parts is joined. `SourceConfig.field` names a field of the user's own (`Instruction`), read
where the format reads its prompt (`pick_field`).
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any

from drafter import DrafterError

FORMATS = ("sharegpt", "openai", "alpaca", "prompt")
ROLES = {"human": "user", "user": "user", "system": "system",
         "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
         "bing": "assistant", "model": "assistant",
         "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool"}
PROMPT_FIELDS = ("turns", "prompt", "question", "instruction", "query")
ID_FIELDS = ("id", "question_id", "task_id", "uid", "conversation_id")


class SourceError(DrafterError):
    """A source cannot be read at all (missing file, unknown format, broken JSON array)."""


class BadRecord(Exception):
    """One record that cannot be read or turned into messages: `reason` is the short code of its
    `Reject` (drafter.data.sources), `detail` the message."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


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


# --------------------------------------------------------------------------- a field of one's own
# Where each format reads what a source's `field` names (prompt: `prompt`, or `turns` for a list
# of strings). The other names any format reads first go, so that the named field is the one read.
FIELD_AS = {"openai": "messages", "sharegpt": "conversations", "alpaca": "instruction"}
_READ_FIRST = (*PROMPT_FIELDS, "messages", "conversations", "conversation")


def pick_field(obj: Any, field: str, fmt: str) -> Any:
    """The record with `field` (SourceConfig.field) under the name `fmt` reads: the prompt
    (format prompt; a list of strings: its turns; a list of messages: them), the messages
    (openai), the conversation (sharegpt) or the instruction (alpaca); auto: by its value (text:
    prompt, a list of strings: turns, a list of objects: messages). Raises BadRecord when the
    record lacks it."""
    if not isinstance(obj, dict):
        return obj  # to_messages says what it is
    if field not in obj:
        raise BadRecord("missing_field", f"no '{field}' field (the source's `field`; fields: "
                        f"{', '.join(map(str, obj))})")
    v = obj[field]
    listed = isinstance(v, list) and bool(v)
    key = FIELD_AS.get(fmt) or (
        "turns" if listed and all(isinstance(x, str) for x in v) else
        "messages" if fmt == "auto" and listed and all(isinstance(x, dict) for x in v) else
        "prompt")
    out = {k: x for k, x in obj.items() if k != field and k not in _READ_FIRST}
    out[key] = v
    return out


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
                raise BadRecord("non_string_content", f"{what}: content part of type "
                                f"{part.get('type')!r}; only text is supported")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRecord("non_string_content",
                    f"{what}: content is {type(x).__name__}, expected a string")


def _message(i: int, m: Any) -> dict | None:
    if not isinstance(m, dict):
        raise BadRecord("bad_message", f"message {i}: expected an object, got {type(m).__name__}")
    raw_role = m.get("role", m.get("from"))
    if raw_role is None:
        raise BadRecord("bad_message", f"message {i}: no 'role' or 'from' field "
                        f"(fields: {', '.join(map(str, m))})")
    role = ROLES.get(str(raw_role).lower())
    if role is None:
        raise BadRecord("unknown_role", f"message {i}: unknown role {raw_role!r} "
                        f"(known: {', '.join(ROLES)})")
    what = f"message {i} ({raw_role})"
    out = {"role": role, "content": _text(m.get("content", m.get("value")), what)}
    if role == "assistant":
        rc = m.get("reasoning_content", m.get("reasoning"))
        if rc is not None:
            if not isinstance(rc, str):
                raise BadRecord("non_string_content", f"{what}: reasoning_content is "
                                f"{type(rc).__name__}, expected a string")
            if rc.strip():
                out["reasoning_content"] = rc
        tc = m.get("tool_calls")
        if tc:
            if not isinstance(tc, list) or not all(isinstance(t, dict) for t in tc):
                raise BadRecord("bad_message", f"{what}: tool_calls must be a list of objects")
            out["tool_calls"] = tc
        if not out["content"].strip() and len(out) == 2:
            return {"role": "assistant", "content": "", "_empty": True}
    if role == "tool":
        for k in ("tool_call_id", "name"):
            if isinstance(m.get(k), str):
                out[k] = m[k]
    if not out["content"].strip() and role in ("user", "tool"):
        raise BadRecord("empty_content", f"{what}: empty content")
    if role == "system" and not out["content"].strip():
        return None  # an empty system prompt says nothing: leave it out
    return out


def _messages(lst: list) -> list[dict]:
    return [m for m in (_message(i, x) for i, x in enumerate(lst)) if m is not None]


def _field(obj: dict, key: str) -> Any:
    if key not in obj:
        raise BadRecord("missing_field", f"no '{key}' field (fields: {', '.join(map(str, obj))})")
    return obj[key]


def _user(x: Any, what: str) -> dict:
    text = _text(x, what)
    if not text.strip():
        raise BadRecord("empty_content", f"{what}: empty")
    return {"role": "user", "content": text}


def _join(instruction: str, inp: Any) -> str:
    # The Alpaca convention: instruction, blank line, input (when there is one).
    inp = _text(inp, "'input'")
    return f"{instruction}\n\n{inp}" if inp.strip() else instruction


def to_messages(obj: Any, fmt: str) -> tuple[list[dict], list | None]:
    """A raw record -> (canonical messages, tools or None). Raises BadRecord."""
    if not isinstance(obj, dict):
        raise BadRecord("not_an_object", f"expected a JSON object, got {type(obj).__name__}")
    tools = None
    if fmt == "sharegpt":
        key = "conversations" if "conversations" in obj else "conversation"
        lst = _field(obj, key)
        if not isinstance(lst, list):
            raise BadRecord("missing_field", f"'{key}' is {type(lst).__name__}, expected a list")
        msgs = _messages(lst)
    elif fmt == "openai":
        lst = _field(obj, "messages")
        if not isinstance(lst, list):
            raise BadRecord("missing_field", f"'messages' is {type(lst).__name__}, expected a list")
        msgs = _messages(lst)
        tools = obj.get("tools")
        if isinstance(tools, str):  # datasets often store the tool schemas as a JSON string
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError:
                raise BadRecord("bad_message", "'tools' is a string that is not JSON") from None
        if tools is not None and not isinstance(tools, list):
            raise BadRecord("bad_message", f"'tools' is {type(tools).__name__}, expected a list")
    elif fmt == "alpaca":
        ins = _text(_field(obj, "instruction"), "'instruction'")
        if not ins.strip():
            raise BadRecord("empty_content", "'instruction' is empty")
        src = obj
        inst = obj.get("instances")
        if "output" not in obj and "response" not in obj and isinstance(inst, list) and inst \
                and isinstance(inst[0], dict):
            src = inst[0]  # self-instruct seed tasks: the first worked instance
        if "output" not in src and "response" not in src:
            raise BadRecord("missing_field",
                            f"no 'output' field (fields: {', '.join(map(str, obj))})")
        out = _text(src.get("output", src.get("response")), "'output'")
        msgs = [{"role": "user", "content": _join(ins, src.get("input"))},
                {"role": "assistant", "content": out} if out.strip()
                else {"role": "assistant", "content": "", "_empty": True}]
    elif fmt == "prompt":
        if "turns" in obj:
            turns = obj["turns"]
            if not isinstance(turns, list) or not turns:
                raise BadRecord("missing_field", "'turns' must be a non-empty list of strings")
            msgs = [_user(t, f"turn {i}") for i, t in enumerate(turns)]
        else:
            key = next((k for k in PROMPT_FIELDS if k in obj), None)
            if key is None:
                raise BadRecord("missing_field", f"none of {', '.join(PROMPT_FIELDS)} "
                                f"(fields: {', '.join(map(str, obj))}; the source's `field` "
                                f"names another)")
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


def check_conversation(msgs: list[dict], require_assistant: bool, stats: dict) -> list[dict]:
    """Check the conversation as a whole: a user turn; answers when they are required."""
    if require_assistant and any(m.get("_empty") for m in msgs):
        i = next(i for i, m in enumerate(msgs) if m.get("_empty"))
        raise BadRecord("empty_content", f"message {i} (assistant): empty content")
    if any(m.get("_empty") for m in msgs):
        # Without required answers an empty one is just an unanswered turn: generate answers it.
        stats["dropped_empty_answers"] = stats.get("dropped_empty_answers", 0) + \
            sum(1 for m in msgs if m.get("_empty"))
        msgs = [m for m in msgs if not m.get("_empty")]
    first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
    if first_user is None:
        raise BadRecord("no_user_turn", "no user turn")
    lead = [i for i, m in enumerate(msgs[:first_user]) if m["role"] in ("assistant", "tool")]
    if lead:
        # Answers before any question (scraped ShareGPT often starts with the bot): no prompt
        # produced them, so generate could not redo them and training would learn noise.
        stats["dropped_leading_assistant"] = stats.get("dropped_leading_assistant", 0) + len(lead)
        msgs = [m for i, m in enumerate(msgs) if i not in set(lead)]
    if require_assistant and not any(m["role"] == "assistant" for m in msgs):
        raise BadRecord("no_assistant_turn", "no assistant turn (prepare.require_assistant is "
                        "true: the data's own answers are trained on when generate.enabled is "
                        "false)")
    return msgs


def record_meta(obj: Any) -> dict:
    """The `meta` of a canonical record: the raw record's own id and category, when it has them."""
    meta = {}
    if isinstance(obj, dict):
        oid = next((obj[k] for k in ID_FIELDS if isinstance(obj.get(k), (str, int))), None)
        if oid is not None:
            meta["orig_id"] = oid
        if isinstance(obj.get("category"), str):
            meta["category"] = obj["category"]
    return meta
