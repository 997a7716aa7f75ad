"""A conversation re-answered by the target turn by turn: the canonical record in (its system
and user turns kept, its assistant turns dropped), the messages to send for the next turn, the
answers appended, and the record written back with per-turn meta. The generate step drives it
through a server or drafter's data engine.
    conv = Conversation(record)              # Permanent if the record cannot be answered
    while not conv.done:
        content, reasoning = split_reasoning(answer_text, answer_reasoning_field)
        conv.add(content, reasoning, finish_reason, usage)   # after sending conv.next_messages()
    out = conv.record(model_name)
"""
from __future__ import annotations

import zlib

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class Permanent(Exception):
    """A failure that a retry will not fix (HTTP 4xx, truncated answer dropped, bad record)."""


def split_reasoning(content: str | None, reasoning: str | None = None) -> tuple[str, str]:
    """(content, reasoning) of an answer. A separate reasoning field wins; otherwise inline
    <think>...</think> is split off the way Qwen3 / DeepSeek-R1 chat templates parse it (the
    generation prompt may already hold <think>, so the answer can start inside the reasoning)."""
    content = content or ""
    if reasoning:
        return content, reasoning
    if THINK_CLOSE in content:
        head, _, tail = content.partition(THINK_CLOSE)
        return tail.lstrip("\n"), head.rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n")
    if content.lstrip().startswith(THINK_OPEN):  # cut inside the reasoning (finish_reason=length)
        return "", content.lstrip()[len(THINK_OPEN):].lstrip("\n")
    return content, ""


def request_seed(seed: int, conv_id: str, turn: int) -> int:
    """A per-request seed, stable across resumes, different per conversation and turn (one seed
    for all requests would correlate the sampling of every conversation on vLLM/SGLang)."""
    return zlib.crc32(f"{seed}:{conv_id}:{turn}".encode()) & 0x7FFFFFFF


# meta key of a copy's temperature (generate.extra_temperatures), in the input and output records
TEMPERATURE_KEY = "generate_temperature"


class Conversation:
    """One conversation being regenerated: the system/user turns, the answers so far. A synthetic
    one (prepare: `synthetic` source) starts without user turns: the target writes each of its
    `turns` user turns (`needs_user`, `add_user`) before answering it."""

    def __init__(self, rec: dict):
        self.rec = rec
        self.id = rec["id"]
        # a copy for generate.extra_temperatures answers at its own temperature (None: the
        # configured generate.temperature)
        t = (rec.get("meta") or {}).get(TEMPERATURE_KEY)
        self.temperature = None if t is None else float(t)
        msgs = rec.get("messages")
        if not isinstance(msgs, list):
            raise Permanent("record has no messages list")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
            raise Permanent("a message is not an object with a role")
        self.synthetic = int((rec.get("synthetic") or {}).get("turns") or 0)
        self.attempts = 0  # synthetic: rejected samples of the user turn being written
        self.kept: list[dict] = []
        self.points: list[int] = []  # indices in `kept` of the user turns to answer, in order
        for i, m in enumerate(msgs):
            if m["role"] not in ("system", "user"):
                continue
            self.kept.append({"role": m["role"], "content": m.get("content") or ""})
            # A user turn is answered where the original has an answer (or nothing) after it;
            # consecutive user turns get one answer, as in the original.
            after = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
            if m["role"] == "user" and after in (None, "assistant", "tool"):
                self.points.append(len(self.kept) - 1)
        if self.synthetic and self.points:
            raise Permanent("a synthetic record already has user turns")
        self.tools = rec.get("tools") or None  # offered to the model, as tokenize renders them
        self.history: list[dict] = []
        self.consumed = 0
        self.turns: list[dict] = []

    @property
    def turn(self) -> int:
        return len(self.turns)

    @property
    def done(self) -> bool:
        if self.synthetic:
            return self.turn == self.synthetic
        return self.turn == len(self.points)

    @property
    def needs_user(self) -> bool:
        """Synthetic: the next answer's user turn is not written yet."""
        return bool(self.synthetic) and len(self.points) == self.turn and not self.done

    def user_history(self) -> list[dict]:
        """What the target sees before writing the next user turn (system and earlier turns)."""
        return [{"role": m["role"], "content": m["content"]}
                for m in self.history + self.kept[self.consumed:]]

    def add_user(self, text: str) -> None:
        self.kept.append({"role": "user", "content": text})
        self.points.append(len(self.kept) - 1)
        self.attempts = 0

    def next_messages(self) -> list[dict]:
        """The messages to send for the next answer (the regenerated history + the next turns)."""
        end = self.points[self.turn] + 1
        self.history.extend(self.kept[self.consumed:end])
        self.consumed = end
        # The server sees role and content only: earlier reasoning is not sent back (chat
        # templates drop it from past turns anyway).
        return [{"role": m["role"], "content": m["content"]} for m in self.history]

    def add(self, content: str, reasoning: str, finish_reason: str | None, usage: dict,
            tool_calls: list | None = None) -> None:
        msg = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if tool_calls:
            msg["tool_calls"] = tool_calls
        self.history.append(msg)
        self.turns.append({"finish_reason": finish_reason,
                           "prompt_tokens": int(usage.get("prompt_tokens") or 0),
                           "completion_tokens": int(usage.get("completion_tokens") or 0)})

    def record(self, model: str) -> dict:
        out = {k: v for k, v in self.rec.items() if k not in ("messages", "meta")}
        out["messages"] = self.history + self.kept[self.consumed:]
        meta = dict(self.rec.get("meta") or {})
        reasons = [t["finish_reason"] for t in self.turns]
        meta.update({
            "finish_reason": "length" if "length" in reasons else reasons[-1],
            "usage": {"prompt_tokens": sum(t["prompt_tokens"] for t in self.turns),
                      "completion_tokens": sum(t["completion_tokens"] for t in self.turns)},
            "turns": self.turns,
            "generated_by": model,
        })
        out["meta"] = meta
        return out
