"""The data engine's requests and the stream its replicas drain (drafter.generation.generator):

    reqs = requests(prompts, max_new=512, temperature=0.0)     # one Request per prompt
    stream = Stream(reqs); stream.close()                      # or open: put() while decoding
    Generator.run(stream, on_result, ...)                         # on_result(Request, Result)
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

from drafter.decoding.tree import DecodeError


@dataclass
class Result:
    tokens: list[int]   # new tokens; the stop token is kept when it ended the text
    finish: str         # "stop", "length", or "too_long" (never started: it cannot fit)


@dataclass
class Request:
    index: int
    ids: list[int]
    max_new: int
    temperature: float
    tag: object = None  # the caller's (a conversation, say): handed back with the result


def requests(prompts, max_new, temperature, tags=None, start: int = 0) -> list[Request]:
    """One request per prompt; max_new and temperature: one value, or one per prompt."""
    n = len(prompts)
    mx = list(max_new) if isinstance(max_new, Sequence) else [max_new] * n
    tp = list(temperature) if isinstance(temperature, Sequence) else [temperature] * n
    tg = list(tags) if tags is not None else [None] * n
    reqs = [Request(start + i, list(map(int, p)), int(m), float(t), g)
            for i, (p, m, t, g) in enumerate(zip(prompts, mx, tp, tg))]
    if any(not q.ids for q in reqs):
        raise DecodeError("empty prompt: every prompt needs at least one token")
    if any(q.max_new < 1 for q in reqs):
        raise DecodeError("max_new must be >= 1")
    return reqs


class Stream:
    """The requests the replicas of one Generator.run drain, thread-safe. Open while the caller may
    still `put` requests; `close()` says no more will come (a replica then ends once the stream
    is empty and its rows are done); `abort()` also drops what is queued and stops the replicas
    at their next check. Each `put` is queued longest prompt first; `put(..., first=True)` goes
    ahead of every request put without it (the generate step's synthetic user turns: each is
    short, and its conversation's answer waits for it).

    `bound` = (max prompt + max_new tokens, max_new) of any request that may still come: the
    memory plan of a replica that starts while the stream is open. Without it (or once the
    stream is closed before the run starts) the plan is sized by the requests themselves."""

    def __init__(self, reqs: Sequence[Request] = (), bound: tuple[int, int] | None = None):
        self.reqs: list[Request] = sorted(reqs, key=lambda r: -len(r.ids))
        self.head = 0
        self.n_first = 0             # requests put with first=True, at the head of the queue
        self.bound = bound
        self.closed = self.aborted = False
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.count = len(self.reqs)  # requests ever put (the next index)

    def __len__(self) -> int:
        return len(self.reqs) - self.head

    def put(self, reqs: Sequence[Request], first: bool = False) -> None:
        with self.cond:
            if self.closed:
                raise DecodeError("put on a closed stream")
            if self.head > 4096 and self.head * 2 > len(self.reqs):   # drop the taken ones
                self.reqs, self.head = self.reqs[self.head:], 0
            new = sorted(reqs, key=lambda r: -len(r.ids))
            if first:
                at = self.head + self.n_first
                self.reqs[at:at] = new
                self.n_first += len(new)
            else:
                self.reqs += new
            self.count += len(reqs)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def abort(self) -> None:
        with self.cond:
            self.closed = self.aborted = True
            self.head, self.n_first = len(self.reqs), 0
            self.cond.notify_all()

    def pending(self) -> list[Request]:
        with self.lock:
            return self.reqs[self.head:]

    def wait(self, timeout: float) -> bool:
        """Wait until a request is queued or the stream is closed; False when it is closed and
        empty (nothing more will come)."""
        with self.cond:
            if self.head >= len(self.reqs) and not self.closed:
                self.cond.wait(timeout)
            return self.head < len(self.reqs) or not self.closed

    def peek(self) -> Request | None:
        with self.lock:
            return self.reqs[self.head] if self.head < len(self.reqs) else None

    def take_if(self, req: Request) -> bool:
        """Take `req` if it is still the head (another replica may have taken it)."""
        with self.lock:
            if self.head < len(self.reqs) and self.reqs[self.head] is req:
                self.head += 1
                self.n_first = max(0, self.n_first - 1)
                return True
            return False
