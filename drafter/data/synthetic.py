"""Synthetic prompts: the target writes the user turns itself, and what it writes is filtered.

    pq = PreQuery(tokenizer)                     # from the target's chat template
    text = pq.prefix(history)                    # rendered up to the start of the next user turn
    f = PromptFilter(min_chars=16, max_chars=2000)
    why = f.check(text, finish)                  # None: kept (and remembered), else the reason
    stats = diversity(texts)                     # distinct n-grams, near duplicates, lengths
    turns = UserTurns(cfg, tokenizer, run)       # the generate step's writer of user turns

The "pre-query template" (Magpie, Xu et al. 2024): an aligned chat model, given its template up to
where a user message begins, writes a plausible user message, because that is what followed such a
prefix in its training. Sampled at temperature ~1 with a seed, it yields prompts in the target's
own distribution of requests, without a dataset. The prefix is found by rendering a sentinel user
message and cutting the text there, so it works for any chat template; the text after the
sentinel gives the end-of-turn token, which stops the sample.

Steering (prepare.sources[i] of kind synthetic): a system prompt drawn per conversation from
`system_prompts`, or a topic from `topics` put into one ("The user asks about {topic}."). Later
user turns of a multi-turn conversation are written the same way with the history before them.

Filters, each rejection counted by its reason (REASONS): empty, truncated (the sample hit its token
cap), too_short / too_long (characters), not_text (mostly symbols, or U+FFFD), template (chat
markup leaked into the text), duplicate (exact, after NFKC and whitespace folding), near_duplicate
(MinHash LSH over word 3-grams at Jaccard >= `near_dup`; datasketch). Only first user turns go
through the duplicate filters; follow-ups depend on their conversation.
"""
from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Iterable

from drafter.core.rundir import JsonlAppender, read_jsonl

SENTINEL = "\u2063drafter-user-turn\u2063"
REASONS = ("empty", "truncated", "too_short", "too_long", "not_text", "template", "duplicate",
           "near_duplicate")
_MARKUP = re.compile(r"<\|[a-z_]+\|>|\[/?INST\]|<start_of_turn>|<end_of_turn>|<\|im_(?:start|end)")
_WORD = re.compile(r"\w+", re.UNICODE)


class PreQuery:
    """The target's chat template up to the start of a user message (module docstring)."""

    def __init__(self, tokenizer, template_kwargs: dict | None = None):
        self.tok, self.kw = tokenizer, dict(template_kwargs or {})
        self._seen: dict[str, str] = {}
        probe = self._render([{"role": "user", "content": SENTINEL}])
        if SENTINEL not in probe:
            raise ValueError("the chat template does not render a user message's content as is: "
                             "synthetic prompts need it")
        tail = probe[probe.index(SENTINEL) + len(SENTINEL):]
        ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail.strip() else []
        self.stop_ids = [int(ids[0])] if ids else []   # the end-of-turn token after a user text

    def _render(self, messages: list[dict]) -> str:
        return self.tok.apply_chat_template(messages, add_generation_prompt=False,
                                            tokenize=False, **self.kw)

    def prefix(self, history: list[dict]) -> str:
        """The rendered history (system, earlier turns) followed by an opened user turn. First
        turns share a few histories (none, or a steering system prompt): those are rendered
        once."""
        key = json.dumps(history, sort_keys=True) if len(history) <= 1 else None
        if key is not None and key in self._seen:
            return self._seen[key]
        text = self._render(list(history) + [{"role": "user", "content": SENTINEL}])
        text = text[:text.index(SENTINEL)]
        if key is not None and len(self._seen) < 4096:
            self._seen[key] = text
        return text

    def ids(self, history: list[dict]) -> list[int]:
        return self.tok(self.prefix(history), add_special_tokens=False)["input_ids"]


def normalise(text: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def shingles(text: str, n: int = 3) -> set[str]:
    words = _WORD.findall(normalise(text))
    if len(words) < n:
        return {" ".join(words)} if words else set()
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


def _minhash(text: str, num_perm: int):
    from datasketch import MinHash

    m = MinHash(num_perm=num_perm, seed=1)
    m.update_batch([s.encode() for s in shingles(text)])
    return m


class PromptFilter:
    """Checks a written user turn and remembers the kept ones (exact and near duplicates).
    `counts` holds kept and each rejection reason."""

    def __init__(self, min_chars: int = 16, max_chars: int = 4000, near_dup: float = 0.8,
                 num_perm: int = 64):
        from datasketch import MinHashLSH

        self.min_chars, self.max_chars, self.num_perm = min_chars, max_chars, num_perm
        self.near_dup = near_dup
        self.exact: set[bytes] = set()
        self.lsh = MinHashLSH(threshold=near_dup, num_perm=num_perm) if near_dup < 1 else None
        self.counts: Counter = Counter()

    def basic(self, text: str, finish: str) -> str | None:
        """Why a user turn is unusable on its own (None: it is fine)."""
        t = text.strip()
        if not t:
            return "empty"
        if finish == "length":
            return "truncated"
        if len(t) < self.min_chars:
            return "too_short"
        if len(t) > self.max_chars:
            return "too_long"
        if "\ufffd" in t or sum(c.isalnum() or c.isspace() for c in t) < 0.6 * len(t):
            return "not_text"
        if _MARKUP.search(t):
            return "template"
        return None

    def remember(self, text: str, minhash=None) -> None:
        """Count a kept text as seen (a resumed run re-reads the finished ones)."""
        key = hashlib.blake2b(normalise(text).encode(), digest_size=8).digest()
        self.exact.add(key)
        if self.lsh is not None:
            self.lsh.insert(str(len(self.exact)) + "/" + key.hex(),
                            minhash or _minhash(text, self.num_perm), check_duplication=False)

    def check(self, text: str, finish: str, dedup: bool = True) -> str | None:
        why = self.basic(text, finish)
        if why is None and dedup:
            key = hashlib.blake2b(normalise(text).encode(), digest_size=8).digest()
            m = _minhash(text, self.num_perm) if self.lsh is not None else None
            if key in self.exact:
                why = "duplicate"
            elif m is not None and self.lsh.query(m):
                why = "near_duplicate"
            else:
                self.remember(text, m)
        self.counts[why or "kept"] += 1
        return why


def diversity(texts: Iterable[str], near_dup: float = 0.8, num_perm: int = 64) -> dict:
    """Diversity of a prompt set: distinct 1-/2-/3-gram ratios (distinct / total over the set),
    near-duplicate rate (share of prompts with an earlier one at MinHash Jaccard >= near_dup),
    exact-duplicate rate, and the word-length distribution."""
    from datasketch import MinHashLSH

    texts = [t for t in texts if t and t.strip()]
    grams = {n: (set(), 0) for n in (1, 2, 3)}
    lengths, exact, near = [], set(), 0
    dup = 0
    lsh = MinHashLSH(threshold=near_dup, num_perm=num_perm)
    for i, t in enumerate(texts):
        words = _WORD.findall(normalise(t))
        lengths.append(len(words))
        for n in grams:
            seen, total = grams[n]
            g = [tuple(words[j:j + n]) for j in range(len(words) - n + 1)]
            seen.update(g)
            grams[n] = (seen, total + len(g))
        key = normalise(t)
        if key in exact:
            dup += 1
        exact.add(key)
        m = _minhash(t, num_perm)
        if lsh.query(m):
            near += 1
        lsh.insert(str(i), m, check_duplication=False)
    lengths.sort()

    def q(p):
        return lengths[min(len(lengths) - 1, int(p * len(lengths)))] if lengths else 0

    n = max(1, len(texts))
    return {"prompts": len(texts),
            **{f"distinct_{k}gram": round(len(s) / max(1, tot), 4)
               for k, (s, tot) in grams.items()},
            "exact_duplicate_rate": round(dup / n, 4), "near_duplicate_rate": round(near / n, 4),
            "words_p10": q(0.1), "words_p50": q(0.5), "words_p90": q(0.9),
            "words_mean": round(sum(lengths) / n, 1)}


# ------------------------------------------------------------ the generate step's side
class UserTurns:
    """The generate step's writer of synthetic user turns: the pre-query prompt, the filter of
    each synthetic source, the rejected samples (generate/synthetic_rejects.jsonl). A
    conversation is the step's (`rec`, `id`, `turn`, `attempts`, `user_history()`,
    `add_user(text)`)."""

    def __init__(self, cfg, tok, run):
        from drafter.core.config import SyntheticConfig
        from drafter.data.sources import source_name

        self.cfgs = {source_name(s): s.synthetic for s in cfg.prepare.sources if s.synthetic}
        self.default = SyntheticConfig()
        self.pq = PreQuery(tok, cfg.generate.chat_template_kwargs)
        self.filters = {n: PromptFilter(sc.min_chars, sc.max_chars, sc.near_dup)
                        for n, sc in self.cfgs.items()}
        self.tok = tok
        self.rejects = JsonlAppender(run.synthetic_rejects(), fsync=False)
        self._remember(run.conversations("generate"))

    def _remember(self, path: Path) -> None:
        """A resumed run: the first user turns already kept count as seen."""
        if not path.exists():
            return
        with open(path, "rb") as f:
            for line in f:
                if b'"synthetic"' not in line or not line.endswith(b"\n"):
                    continue
                rec = json.loads(line)
                user = next((m["content"] for m in rec["messages"] if m["role"] == "user"), None)
                if user is not None:
                    self.filter(rec["source"]).remember(user)

    def settings(self, conv):
        return self.cfgs.get(conv.rec.get("source"), self.default)

    def filter(self, source: str):
        if source not in self.filters:
            self.filters[source] = PromptFilter()
        return self.filters[source]

    def request(self, conv) -> tuple[list[int], int, float]:
        sc = self.settings(conv)
        return self.pq.ids(conv.user_history()), sc.max_tokens, sc.temperature

    def accept(self, conv, ids: list[int], finish: str) -> str | None:
        """Keep the written user turn (None) or say why not (and log the rejected sample)."""
        return self.accept_text(conv, self.tok.decode(ids, skip_special_tokens=True), finish)

    def accept_text(self, conv, text: str, finish: str) -> str | None:
        """accept() on the sample already decoded (the generate step decodes in batches)."""
        text = text.strip()
        why = self.filter(conv.rec.get("source")).check(text, finish, dedup=conv.turn == 0)
        if why is None:
            conv.add_user(text)
            return None
        conv.attempts += 1
        self.rejects.write({"id": conv.id, "turn": conv.turn, "attempt": conv.attempts,
                            "reason": why, "text": text[:500]})
        return why

    def close(self) -> None:
        self.rejects.close()


def synthetic_stats(run) -> dict:
    """Synthetic conversations in the output, the user turns the target wrote for them, and the
    samples rejected by reason over the whole run (a sample resumed after a kill counts once)."""
    convs = turns = 0
    path = run.conversations("generate")
    if path.exists():
        with open(path, "rb") as f:
            for line in f:
                if b'"synthetic"' in line:
                    try:
                        rec = json.loads(line)
                    except ValueError:  # a damaged line (_scan_output skips it too)
                        continue
                    if isinstance(rec, dict) and rec.get("synthetic"):
                        convs += 1
                        turns += sum(m["role"] == "user" for m in rec["messages"])
    seen = {(e["id"], e["turn"], e["attempt"]): e["reason"]
            for e in read_jsonl(run.synthetic_rejects(), repair=True) if "reason" in e}
    by = Counter(seen.values())
    return {"conversations": convs, "user_turns_kept": turns, "rejected": sum(by.values()),
            "rejected_by_reason": dict(sorted(by.items()))}
