"""The generate step: re-answer every user turn with the target itself.

Reads   prepare/conversations.jsonl    canonical conversations (docs/internals.md)
Writes  generate/conversations.jsonl   same schema; every assistant turn is the target's answer
        generate/errors.jsonl          conversations that failed: {"id", "kind", "reason",
                                       "message", "turn", "time"}
        generate/server.log            the output of the server drafter started
Command drafter generate CONFIG [key=value ...]     (one process; the server batches requests)

Drafters accept far more tokens when trained on what the target writes, so each conversation
keeps only its system and user turns, and each user turn (a run of consecutive user turns counts
as one) is answered in order with the regenerated history before it. Reasoning is stored in
`reasoning_content` (from the `reasoning_content` or `reasoning` fields of the answer, or split
off inline `<think>...</think>`), never inline, so that tokenize renders it through the chat
template as the model produced it. `meta` records finish_reason and token usage per turn.

Temperatures: every conversation is answered at generate.temperature under its own id, and once
more at each generate.extra_temperatures entry T as a copy with id `ID@tT` (its temperature in
meta.generate_temperature; the same split). Greedy answers alone give a drafter greedy contexts
only; sampled copies beside them raised its T=1 acceptance (BENCHMARKS.md, "Quality").

Engines: a server drafter starts (transformers, vllm, sglang: drafter/serve/servers.py),
external URLs (load-balanced), or `drafter` (in-process: drafter.generation.local.LocalGenerator,
paged KV cache and continuous batching, fed one open request stream; the manifest's phases_s
splits its seconds by phase, docs/generate.md). The conversation being answered turn by turn is
drafter.data.conversations.Conversation.

Resume: finished conversations are appended to conversations.jsonl as they complete (one line
each, flushed), keyed by id. A rerun skips finished ids and ids whose error is permanent (HTTP
4xx, an answer dropped as truncated, a conversation without a user turn), and retries ids whose
error is transient (connection errors, 5xx and timeouts that outlasted the retries). A kill at any
moment loses at most the conversations in flight; a torn last line is cut off on restart. At the
end the file is rewritten in input order (atomically) and the step fails if transient errors are
left, so that `drafter generate CONFIG` again retries them. ok + errors + skipped == input.

Errors: each failed conversation's line in errors.jsonl holds a short `reason` shared by every
conversation that failed the same way ("prompt too long", "HTTP 400: context length exceeded",
"timeout", ...) and the full `message`; the manifest counts them by reason (`errors_by_reason`)
and the step's log line names them.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from drafter import DrafterError
from drafter.core.rundir import JsonlAppender, Run, atomic_open, read_jsonl
from drafter.data.conversations import (
    TEMPERATURE_KEY,
    Conversation,
    Permanent,
    request_seed,
    split_reasoning,
)
from drafter.data.synthetic import UserTurns, synthetic_stats

log = logging.getLogger("drafter")

FSYNC_EVERY = 2.0  # seconds between fsyncs of the output; flushes happen on every line


class GenerateError(DrafterError):
    pass


class _Transient(Exception):
    """A failure that outlasted the retries but may pass later (server down, 5xx, timeouts)."""


class _Failed(Permanent):
    """A permanent failure whose short reason is known where it is raised."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def error_reason(message: str) -> str:
    """The short reason of an error message that came without one (a record drafter.data's
    Conversation refuses, an errors.jsonl line written before reasons were kept): the message up
    to its first colon, parenthesis or sentence end, numbers as N, at most 60 characters."""
    head = re.split(r"[:;(\n]|\. ", str(message).strip(), maxsplit=1)[0]
    return re.sub(r"\d+(\.\d+)?", "N", head).strip()[:60].rstrip() or "unknown"


def count_reasons(errors) -> dict[str, int]:
    """{reason: conversations} over errors.jsonl records, the most frequent first."""
    out: dict[str, int] = {}
    for e in errors:
        r = e.get("reason") or "unknown"
        out[r] = out.get(r, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


# --------------------------------------------------------------------------------------- the sink
class _Sink:
    """Appends results as they complete; counts; the progress bar."""

    def __init__(self, run: Run, total: int, model: str):
        from tqdm import tqdm

        self.model = model
        # Flushed on every line (a kill -9 loses nothing written); fsynced every FSYNC_EVERY s
        # (an fsync per answer would stall the event loop on slow disks).
        self.out = JsonlAppender(run.conversations("generate"), fsync=False)
        self.err = JsonlAppender(run.generate_errors(), fsync=True)
        self.bar = tqdm(total=total, desc="generate", unit="conv", dynamic_ncols=True,
                        mininterval=1.0, smoothing=0.05, file=sys.stderr)
        self.t0 = self.last_sync = time.time()
        self.seconds = 0.0
        self.ok = 0
        self.failed = {"permanent": 0, "transient": 0}
        self.completion_tokens = 0

    def restart(self) -> None:
        """Start the clock again (engine=drafter: after the target has loaded)."""
        self.t0 = self.last_sync = time.time()

    def add_ok(self, conv: Conversation) -> None:
        self.out.write(conv.record(self.model))
        if time.time() - self.last_sync > FSYNC_EVERY:
            os.fsync(self.out.f.fileno())
            self.last_sync = time.time()
        self.ok += 1
        self.completion_tokens += sum(t["completion_tokens"] for t in conv.turns)
        self._tick()

    def add_error(self, conv_id: str, kind: str, reason: str, message: str, turn: int) -> None:
        self.err.write({"id": conv_id, "kind": kind, "reason": reason, "message": message[:2000],
                        "turn": turn, "time": round(time.time(), 3)})
        self.failed[kind] += 1
        self._tick()

    def _tick(self) -> None:
        dt = max(time.time() - self.t0, 1e-6)
        self.bar.set_postfix_str(f"ok={self.ok} failed={sum(self.failed.values())} "
                                 f"tok/s={self.completion_tokens / dt:.0f}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.seconds = time.time() - self.t0
        self.bar.close()
        os.fsync(self.out.f.fileno())
        self.out.close()
        self.err.close()


# ------------------------------------------------------------------------------ HTTP generation
def request_body(g, model: str, messages: list[dict], seed: int,
                 tools: list | None = None, temperature: float | None = None) -> dict:
    """The chat completion request of one turn: sampling settings from the config (the
    temperature from a copy's own when given)."""
    body = {"model": model, "messages": messages, "max_tokens": g.max_tokens,
            "temperature": g.temperature if temperature is None else temperature,
            "top_p": g.top_p, "seed": seed, "stream": False}
    if tools:
        body["tools"] = tools
    if g.chat_template_kwargs:
        body["chat_template_kwargs"] = g.chat_template_kwargs
    return body


def _parse(resp: dict) -> dict:
    try:
        choice = resp["choices"][0]
        msg = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise _Failed("a response without choices[0].message",
                      f"a response without choices[0].message: {str(resp)[:500]}") from None
    content, reasoning = split_reasoning(msg.get("content"),
                                         msg.get("reasoning_content") or msg.get("reasoning"))
    return {"content": content, "reasoning": reasoning,
            "finish_reason": choice.get("finish_reason"), "usage": resp.get("usage") or {},
            "tool_calls": msg.get("tool_calls")}


TOO_LONG = "prompt too long"  # the reason of a prompt that cannot fit (counted as too_long)


class _Fits:
    """The HTTP engines' guard on the target's context: a request whose prompt (rendered with
    the target's chat template) + generate.max_tokens exceeds max_position_embeddings is a
    permanent error of its record, never sent (one 60,000-word prompt kills a `transformers
    serve` worker, and every later request gets 503). Without the target's tokenizer or
    context length the server is left to judge."""

    def __init__(self, cfg):
        from drafter.core import target

        self.tok, self.ctx = None, None
        self.max_tokens, self.kw = cfg.generate.max_tokens, cfg.generate.chat_template_kwargs
        try:
            tconf = target.text_config(target.load_config(cfg.target))
            self.ctx = getattr(tconf, "max_position_embeddings", None)
            if self.ctx:
                self.tok = target.load_tokenizer(cfg.target)
        except Exception as e:  # noqa: BLE001 - an external server's model may not be local
            log.warning("generate: cannot read the target's tokenizer or context (%s): prompt "
                        "lengths are not checked before sending", e)

    def __call__(self, messages: list[dict], tools) -> str | None:
        """Why the request cannot fit, or None."""
        if self.tok is None:
            return None
        budget = self.ctx - self.max_tokens
        try:
            text = self.tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                                add_generation_prompt=True, **self.kw)
        except Exception:  # noqa: BLE001 - the server renders (and judges) it then
            return None
        if len(text.encode()) <= budget:  # a token holds at least one byte: it fits
            return None
        n = len(self.tok(text, add_special_tokens=False)["input_ids"])
        if n <= budget:
            return None
        return (f"{TOO_LONG}: {n} tokens + generate.max_tokens {self.max_tokens} exceed the "
                f"target's context of {self.ctx} tokens (max_position_embeddings); not sent")


def _reason(e: Permanent) -> str:
    return e.reason if isinstance(e, _Failed) else error_reason(str(e))


async def _answer(conv: Conversation, client, model: str, g, sink: _Sink,
                  fits: _Fits | None = None) -> None:
    from drafter.serve.client import RequestError

    try:
        if not conv.points:
            raise _Failed("no user turn", "no user turn to answer")
        while not conv.done:
            body = request_body(g, model, conv.next_messages(),
                                request_seed(g.seed, conv.id, conv.turn), conv.tools,
                                conv.temperature)
            why = fits(body["messages"], conv.tools) if fits is not None else None
            if why is not None:
                raise _Failed(TOO_LONG, why)
            try:
                out = _parse(await client.chat(body))
            except RequestError as e:
                if e.permanent:
                    raise _Failed(e.reason, str(e)) from None
                raise _Transient(e.reason, str(e)) from None
            if out["finish_reason"] == "length" and g.drop_truncated:
                raise _Failed("truncated", f"truncated: the answer reached generate.max_tokens="
                              f"{g.max_tokens} (generate.drop_truncated is true)")
            conv.add(out["content"], out["reasoning"], out["finish_reason"], out["usage"],
                     out["tool_calls"])
    except Permanent as e:
        sink.add_error(conv.id, "permanent", _reason(e), str(e), conv.turn)
    except _Transient as e:
        sink.add_error(conv.id, "transient", *e.args, conv.turn)
    else:
        sink.add_ok(conv)


async def _run_http(g, pool, records: Iterator[dict], sink: _Sink,
                    fits: _Fits | None = None) -> None:
    from drafter.serve.client import ChatClient

    client = ChatClient(pool, g.request_timeout, g.max_retries, g.retry_backoff,
                        concurrency=g.concurrency)
    n_workers = max(1, g.concurrency * len(pool.endpoints))
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * n_workers)

    async def producer():
        for rec in records:
            await queue.put(rec)
        for _ in range(n_workers):
            await queue.put(None)

    async def worker():
        while (rec := await queue.get()) is not None:
            try:
                conv = Conversation(rec)
            except Permanent as e:
                sink.add_error(rec["id"], "permanent", _reason(e), str(e), 0)
                continue
            await _answer(conv, client, pool.model, g, sink, fits)

    tasks = [asyncio.create_task(producer())] + [asyncio.create_task(worker())
                                                 for _ in range(n_workers)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()


# ----------------------------------------------------------------------------- local generation
class _Phases:
    """Seconds per phase of one thread's timeline: `with ph("write"): ...`."""

    def __init__(self):
        self.s: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t0


class _Local:
    """engine=drafter: the conversations' side (templates, tokens, bookkeeping) of both paths."""

    def __init__(self, cfg, sink: _Sink, run: Run, ph: _Phases):
        from drafter.core.target import load_tokenizer
        from drafter.generation.local import LocalGenerator

        self.g, self.sink, self.ph = cfg.generate, sink, ph
        self.tok = load_tokenizer(cfg.target)
        self.gen = LocalGenerator(cfg.target, self.g.batch_size)
        self.syn = UserTurns(cfg, self.tok, run) if any(s.synthetic for s in
                                                         cfg.prepare.sources) else None
        self.stop = sorted(set(self.gen.stop_ids) | set(self.syn.pq.stop_ids if self.syn
                                                         else ()))

    def take(self, records: Iterator[dict], n: int) -> tuple[list[Conversation], bool]:
        """Up to n conversations admitted from records (bad ones go to the sink as errors), and
        whether records ran out."""
        convs: list[Conversation] = []
        while len(convs) < n:
            rec = next(records, None)
            if rec is None:
                return convs, True
            conv = self.admit(rec)
            if conv is not None:
                convs.append(conv)
        return convs, False

    def admit(self, rec: dict) -> Conversation | None:
        try:
            conv = Conversation(rec)
            if conv.synthetic and self.syn is None:
                raise _Failed("synthetic record without a synthetic source",
                              "a synthetic record, but no synthetic source in prepare.sources "
                              "(rerun `drafter prepare`)")
            if not conv.points and not conv.synthetic:
                raise _Failed("no user turn", "no user turn to answer")
        except Permanent as e:
            with self.ph("write"):
                self.sink.add_error(rec["id"], "permanent", _reason(e), str(e), 0)
            return None
        return conv

    def prompts(self, convs: list[Conversation]) -> tuple[list, list, list, list]:
        """The next request of each conversation: its user turn (synthetic, the pre-query
        prefix) or its answer (the chat template); rendered, then tokenized in one batch."""
        g, syn = self.g, self.syn
        texts, caps, temps, users = [], [], [], []
        with self.ph("templates_tokenize"):
            for conv in convs:
                if conv.needs_user:
                    sc = syn.settings(conv)
                    texts.append(syn.pq.prefix(conv.user_history()))
                    caps.append(sc.max_tokens)
                    temps.append(sc.temperature)
                else:
                    texts.append(self.tok.apply_chat_template(
                        conv.next_messages(), tools=conv.tools, add_generation_prompt=True,
                        tokenize=False, **g.chat_template_kwargs))
                    caps.append(g.max_tokens)
                    temps.append(g.temperature if conv.temperature is None else conv.temperature)
                users.append(conv.needs_user)
            ids = self.tok(texts, add_special_tokens=False)["input_ids"] if texts else []
        return ids, caps, temps, users

    def finish(self, done: list[tuple]) -> list[Conversation]:
        """Bookkeeping of finished requests, (conv, prompt_len, cap, user, ids, finish) each:
        errors and finished conversations to the sink; the conversations that go on."""
        g, syn, sink, ph = self.g, self.syn, self.sink, self.ph
        with ph("detokenize"):
            texts = self.tok.batch_decode([d[4] for d in done], skip_special_tokens=True)
        still = []
        for (conv, n_prompt, cap, user, ids, finish_reason), text in zip(done, texts):
            if finish_reason == "too_long":
                with ph("write"):
                    sink.add_error(conv.id, "permanent", TOO_LONG,
                                   f"{TOO_LONG}: {n_prompt} tokens + {cap} new do not fit the "
                                   f"target's context or the KV cache", conv.turn)
                continue
            if user:
                with ph("synthetic"):
                    why = syn.accept_text(conv, text, finish_reason)
                if why is not None and conv.attempts >= syn.settings(conv).max_attempts:
                    with ph("write"):
                        sink.add_error(conv.id, "permanent", f"synthetic: no usable user turn "
                                       f"({why})", f"synthetic: no usable user turn in "
                                       f"{conv.attempts} samples (last: {why})", conv.turn)
                    continue
                still.append(conv)
                continue
            if finish_reason == "length" and g.drop_truncated:
                with ph("write"):
                    sink.add_error(conv.id, "permanent", "truncated", f"truncated: the answer "
                                   f"reached generate.max_tokens={g.max_tokens}", conv.turn)
                continue
            with ph("detokenize"):
                content, reasoning = split_reasoning(text)
            conv.add(content, reasoning, finish_reason,
                     {"prompt_tokens": n_prompt, "completion_tokens": len(ids)})
            if conv.done:
                with ph("write"):
                    sink.add_ok(conv)
            else:
                still.append(conv)
        return still


# Requests queued per GPU beyond its rows: the generator refills from them at once, while the host
# renders the next ones; a kill loses at most these and the rows' conversations.
QUEUED_PER_ROW = 2
PUT_CHUNK = 256          # conversations rendered per put: the first rows start after one chunk


def _run_local(cfg, records: Iterator[dict], sink: _Sink, run: Run) -> tuple[dict, dict]:
    """engine=drafter: one open request stream (drafter.generation.local.LocalGenerator.start)
    decoded while this thread feeds it. Conversations are admitted while fewer than
    QUEUED_PER_ROW x batch_size x GPUs requests are queued; as each row ends (the generator's
    thread hands it over) its conversation's bookkeeping runs here, and its next request (the
    next user turn, a synthetic user turn or its answer) goes straight back into the stream.
    The static decoder (models the paged generator does not run) decodes pools in calls instead.
    Returns (phases_s, engine_counts): load, then the seconds of this thread (host) and of the
    generators' threads (`engine`: the mean over GPUs), each split by phase and summing to the
    step's seconds; and what the generators did, summed (empty for the static decoder's
    calls)."""
    from drafter.generation.generator import Generator

    t0 = time.perf_counter()
    ph = _Phases()
    loc = _Local(cfg, sink, run, ph)
    load = time.perf_counter() - t0
    sink.restart()                       # throughput counts from the first request
    t1 = time.perf_counter()
    try:
        if isinstance(loc.gen.workers[0], Generator):
            _stream_local(loc, records)
        else:
            _pools_local(loc, records)
    finally:
        if loc.syn is not None:
            loc.syn.close()
    total = time.perf_counter() - t1
    host = {k: round(v, 3) for k, v in sorted(ph.s.items())}
    host["other"] = round(total - sum(ph.s.values()), 3)
    out = {"load": round(load, 3), "host": host}
    stats = [s for s in loc.gen.stats() if "decode_seconds" in s]
    if stats:
        eng = {k: sum(s[f"{k}_seconds"] for s in stats) / len(stats)
               for k in ("prefill", "decode", "wait", "capture")}
        eng["wait_requests"] = eng.pop("wait")
        eng = {k: round(v, 3) for k, v in eng.items()}
        eng["other"] = round(total - sum(eng.values()), 3)
        out["engine"] = eng
        # of engine.prefill and .decode, what the GPU's timeline spans (the rest: the GPU
        # waiting on the host between them)
        out["engine_gpu"] = {k: round(sum(s.get(f"{k}_gpu_seconds", 0.0) for s in stats)
                                      / len(stats), 3) for k in ("prefill", "decode")}
    # what the generators did, summed over GPUs: admissions and their packed prefills (prompt
    # tokens, and the tokens the forwards ran), decode steps, those that sampled (any live row
    # at T > 0)
    counts = {k: sum(s[k] for s in stats)
              for k in ("requests", "admissions", "prefill_groups", "prefill_tokens",
                        "prefill_padded_tokens", "steps", "sampling_steps", "tokens")} \
        if stats else {}
    return out, counts


def _stream_local(loc: _Local, records: Iterator[dict]) -> None:
    import queue as queue_mod

    g, syn, gen, ph = loc.g, loc.syn, loc.gen, loc.ph
    max_new = max([g.max_tokens] + ([syn.default.max_tokens] + [sc.max_tokens for sc in
                                                                 syn.cfgs.values()]
                                    if syn else []))
    # The plan covers any prompt the model takes; without a context length, prompts of up to
    # 32,768 tokens (a longer one is "too_long": a permanent error of its conversation).
    max_len = gen.workers[0].max_positions or max_new + 32768
    results: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
    feed = gen.start(lambda tag, ids, finish: results.put((*tag, ids, finish)), max_len,
                     max_new, top_p=g.top_p, seed=g.seed, stop_ids=loc.stop)
    target = QUEUED_PER_ROW * g.batch_size * gen.replicas
    in_flight = 0

    def put(convs: list[Conversation]) -> None:
        nonlocal in_flight
        if not convs:
            return
        ids, caps, temps, users = loc.prompts(convs)
        for user in (True, False):   # user turns to write first: each answer waits for its own
            k = [i for i, u in enumerate(users) if u == user]
            if k:
                feed.put([ids[i] for i in k], [caps[i] for i in k], [temps[i] for i in k],
                         [(convs[i], len(ids[i]), caps[i], user) for i in k], first=user)
        in_flight += len(convs)

    # The generator's thread gives up the GIL in every torch call and waits to take it back while
    # this thread renders templates or checks user turns: a switch interval of 0.1 ms (Python's:
    # 5 ms) bounds each such wait, of which a prefill or a sync has tens.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, 0.0001))
    it = iter(records)
    exhausted = False
    try:
        while True:
            feed.check()
            if not exhausted and len(feed) < target:
                convs, exhausted = loc.take(it, min(PUT_CHUNK, target - len(feed)))
                put(convs)
            if exhausted and in_flight == 0:
                break
            done = []
            if exhausted or len(feed) >= target:   # nothing to admit: wait for a result
                with ph("wait_results"):
                    try:
                        done.append(results.get(timeout=0.1))
                    except queue_mod.Empty:
                        if not feed.alive():
                            feed.check()
                            raise GenerateError("generate (local): the generator stopped with "
                                                f"{in_flight} requests in flight (a bug)"
                                                ) from None
            while True:
                try:
                    done.append(results.get_nowait())
                except queue_mod.Empty:
                    break
            if done:
                in_flight -= len(done)
                put(loc.finish(done))
        feed.join()
    except BaseException:
        feed.stop()  # no generator thread outlives the step (a signal's stop included)
        raise
    finally:
        sys.setswitchinterval(interval)


def _pools_local(loc: _Local, records: Iterator[dict]) -> None:
    """The static decoder: the next turn of a pool of 8 x batch_size conversations in one
    call, the finished ones written, the pool refilled, repeat (seed: generate.seed + call)."""
    g, gen, ph = loc.g, loc.gen, loc.ph
    pool_size = 8 * g.batch_size * getattr(gen, "replicas", 1)
    active: list[Conversation] = []
    it = iter(records)
    exhausted, call = False, 0
    while True:
        if not exhausted and len(active) < pool_size:
            more, exhausted = loc.take(it, pool_size - len(active))
            active += more
        if not active:
            break
        prompts, caps, temps, users = loc.prompts(active)
        with ph("engine_calls"):
            outs = gen.generate(prompts, max_new_tokens=caps, temperature=temps, top_p=g.top_p,
                                seed=g.seed + call, stop_ids=loc.stop)
        call += 1
        active = loc.finish([(c, len(p), m, u, [int(i) for i in ids], f) for c, p, m, u, (ids, f)
                             in zip(active, prompts, caps, users, outs)])


# ------------------------------------------------------------------------------------ the files
def _input_ids(src: Path) -> list[str]:
    """The ids of the input in order; errors name file and line."""
    ids, seen = [], {}
    with open(src, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rid = json.loads(line)["id"]
            except (ValueError, KeyError, TypeError):  # not JSON, not UTF-8, no id
                raise GenerateError(f"{src}:{n}: not a conversation record with an 'id' "
                                    f"(rerun `drafter prepare CONFIG --force`)") from None
            if rid in seen:
                raise GenerateError(f"{src}:{n}: id {rid!r} already used at line {seen[rid]}")
            seen[rid] = n
            ids.append(rid)
    return ids


def copies(g) -> list[tuple[str, float | None]]:
    """(id suffix, temperature) of the answers every conversation gets: itself at
    generate.temperature, then one copy per generate.extra_temperatures entry, ID@tT."""
    return [("", None)] + [(f"@t{t:g}", float(t)) for t in g.extra_temperatures]


def _iter_records(src: Path, wanted: set[str], versions=(("", None),)) -> Iterator[dict]:
    """The input records whose ids (with a copy's suffix) are wanted; a copy carries its
    temperature in meta (TEMPERATURE_KEY), which the output record keeps."""
    with open(src, "rb") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                for suffix, temp in versions:
                    if rec["id"] + suffix in wanted:
                        if not suffix:
                            yield rec
                            continue
                        meta = {**(rec.get("meta") or {}), TEMPERATURE_KEY: temp}
                        yield {**rec, "id": rec["id"] + suffix, "meta": meta}


def _scan_output(path: Path, repair: bool, bad: list | None = None
                 ) -> list[tuple[str, int, int, dict]]:
    """(id, offset, length, meta) per good line of the output, in file order. Like
    rundir.read_jsonl(repair=True), a torn last line (a kill mid-write) is cut off, and a
    damaged line inside the file (not JSON, not UTF-8, no id) is skipped, keeping the records
    after it (`bad` gets its line number; its conversation is generated again); records are not
    all kept in memory (the output can hold many GB of answers)."""
    out, good, damaged = [], 0, []
    if not path.exists():
        return out
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break  # torn tail: the only thing a kill leaves
            try:
                rec = json.loads(line)
            except ValueError:  # JSONDecodeError, UnicodeDecodeError
                rec = None
            if isinstance(rec, dict) and isinstance(rec.get("id"), str):
                meta = rec.get("meta")
                out.append((rec["id"], good, len(line), meta if isinstance(meta, dict) else {}))
            elif line.strip():
                damaged.append(n)
            good += len(line)
    if damaged:
        log.warning("generate: %s: line(s) %s damaged (not a conversation record): skipped, "
                    "their conversations are generated again", path,
                    ", ".join(map(str, damaged[:10])) + (" ..." if len(damaged) > 10 else ""))
        if bad is not None:
            bad.extend(damaged)
    if repair and good != path.stat().st_size:
        log.info("generate: cutting a torn last line off %s (interrupted write)", path)
        with open(path, "r+b") as f:
            f.truncate(good)
            os.fsync(f.fileno())
    return out


def _errors(path: Path) -> dict[str, dict]:
    """Last error per id (a retried id may have several lines). A line without a `message`
    (written before errors kept a short reason) has its message in `reason`: read as both."""
    out = {}
    for e in read_jsonl(path, repair=True):
        if "id" not in e:
            continue
        if "message" not in e:
            e = {**e, "reason": error_reason(e.get("reason", "")), "message": e.get("reason", "")}
        out[e["id"]] = e
    return out


def _finalise(run: Run, ids: list[str]) -> dict:
    """Rewrite the output in input order without duplicates (atomically, only when needed),
    compact errors.jsonl to the ids still failed, and sum the stats of the whole output."""
    out_path, err_path = run.conversations("generate"), run.generate_errors()
    damaged: list[int] = []
    rows = _scan_output(out_path, repair=True, bad=damaged)
    order = {rid: i for i, rid in enumerate(ids)}
    first: dict[str, tuple[int, int, dict]] = {}
    for rid, off, n, meta in rows:
        if rid in order and rid not in first:
            first[rid] = (off, n, meta)
    kept = sorted(first, key=order.__getitem__)
    if damaged or [r[0] for r in rows] != kept:  # the rewrite drops damaged lines too
        with open(out_path, "rb") as src, atomic_open(out_path, "wb") as dst:
            for rid in kept:
                off, n, _ = first[rid]
                src.seek(off)
                dst.write(src.read(n))
    errors = {k: v for k, v in _errors(err_path).items() if k in order and k not in first}
    if err_path.exists():
        with atomic_open(err_path, "w") as f:
            for e in sorted(errors.values(), key=lambda e: order[e["id"]]):
                f.write(json.dumps(e, ensure_ascii=False) + "\n")
    stats = {"prompt_tokens": 0, "completion_tokens": 0, "turns": 0, "truncated": 0}
    for _off, _n, meta in first.values():
        usage = meta.get("usage") or {}
        stats["prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
        stats["completion_tokens"] += int(usage.get("completion_tokens") or 0)
        stats["turns"] += len(meta.get("turns") or [])
        stats["truncated"] += meta.get("finish_reason") == "length"
    return {"ok": len(first), "errors": errors, "stats": stats}


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


# ------------------------------------------------------------------------------------------- main
def main(cfg) -> dict:
    run = Run.of(cfg)
    g = cfg.generate
    src = run.require(run.conversations("prepare"), "prepare")
    if not g.enabled:
        # tokenize reads prepare's conversations then; nothing is regenerated.
        n = _count_lines(src)
        log.info("generate: disabled (generate.enabled=false); %d conversations keep their "
                 "own answers", n)
        return {"counts": {"input": n, "ok": 0, "errors": 0, "skipped": n}, "enabled": False}

    versions = copies(g)
    ids = [rid + suffix for rid in _input_ids(src) for suffix, _ in versions]
    done = {r[0] for r in _scan_output(run.conversations("generate"), repair=True)}
    old_errors = _errors(run.generate_errors())
    final = {k for k, e in old_errors.items() if e.get("kind") == "permanent" and k not in done}
    pending = set(ids) - done - final
    retried = len(pending & set(old_errors))
    log.info("generate: %d conversations: %d done, %d failed for good, %d to generate%s",
             len(ids), len(done & set(ids)), len(final), len(pending),
             f" ({retried} retried after transient errors)" if retried else "")

    synthetic = [i for i, s in enumerate(cfg.prepare.sources) if s.synthetic is not None]
    if synthetic and pending and g.server.engine != "drafter":
        raise GenerateError(
            f"prepare.sources[{synthetic[0]}] is synthetic: the target writes its user turns "
            f"in-process, which needs generate.server.engine=drafter (now "
            f"{g.server.engine!r})")
    server: dict = {"engine": g.server.engine}
    phases: dict = {}
    engine_counts: dict = {}
    generated = 0
    completion_tokens = 0
    if pending:
        records = _iter_records(src, pending, versions)
        if g.server.engine == "drafter":
            sink = _Sink(run, len(pending), model=cfg.target.model)
            try:
                phases, engine_counts = _run_local(cfg, records, sink, run)
            finally:
                sink.close()
        else:
            from drafter.serve import servers as serve

            fits = _Fits(cfg)
            with serve.servers(cfg, run.server_log()) as pool:
                server.update(urls=pool.urls, model=pool.model)
                sink = _Sink(run, len(pending), model=pool.model)
                try:
                    asyncio.run(_run_http(g, pool, records, sink, fits))
                finally:
                    sink.close()
                    server["restarts"] = sum(e.restarts for e in pool.endpoints)
        generated, completion_tokens = sink.ok, sink.completion_tokens
        # Throughput counts from the first request (server start-up is in the manifest's total).
        seconds = sink.seconds
    else:
        seconds = 0.0

    fin = _finalise(run, ids)
    errors = fin["errors"]
    kinds = {"permanent": 0, "transient": 0}
    for e in errors.values():
        kinds["transient" if e.get("kind") == "transient" else "permanent"] += 1
    counts = {"input": len(ids), "ok": fin["ok"], "errors": len(errors), "skipped": 0,
              "generated": generated, "resumed": fin["ok"] - generated, "retried": retried,
              "truncated": fin["stats"]["truncated"], "turns": fin["stats"]["turns"],
              "too_long": sum(e.get("reason") == TOO_LONG for e in errors.values())}
    reasons = count_reasons(errors.values())
    if counts["ok"] + counts["errors"] + counts["skipped"] != counts["input"]:
        raise GenerateError(f"generate: ok {counts['ok']} + errors {counts['errors']} != input "
                            f"{counts['input']} (a bug: please report it with {run.root})")
    log.info("generate: %d ok, %d errors (%d permanent, %d transient%s), %d answers truncated; "
             "%d completion tokens in %.1fs (%.0f tok/s)", counts["ok"], counts["errors"],
             kinds["permanent"], kinds["transient"],
             (": " + ", ".join(f"{n} {r}" for r, n in reasons.items())
              + f"; each in {run.generate_errors()}") if reasons else "",
             counts["truncated"], completion_tokens, seconds,
             completion_tokens / max(seconds, 1e-9))
    if phases:
        log.info("generate: seconds by phase: load %.1f; host %s; engine %s", phases["load"],
                 ", ".join(f"{k} {v:.1f}" for k, v in phases["host"].items()),
                 ", ".join(f"{k} {v:.1f}" for k, v in phases.get("engine", {}).items()) or "-")
    if kinds["transient"]:
        raise GenerateError(
            f"generate: {kinds['transient']} conversations failed after "
            f"{g.max_retries} retries (server trouble; reasons in {run.generate_errors()}, server "
            f"output in {run.server_log()}). Rerun `drafter generate CONFIG` to retry only them.")
    return {
        "counts": counts,
        "tokens": {"prompt": fin["stats"]["prompt_tokens"],
                   "completion": fin["stats"]["completion_tokens"]},
        "throughput": {"seconds": round(seconds, 3), "conversations": generated,
                       "completion_tokens": completion_tokens,
                       "completion_tokens_per_s": round(completion_tokens / max(seconds, 1e-9), 1)},
        **({"phases_s": phases} if phases else {}),
        **({"engine_counts": engine_counts} if engine_counts else {}),
        "errors_by_kind": kinds,
        "errors_by_reason": reasons,
        **({"synthetic": synthetic_stats(run)} if synthetic else {}),
        "server": server,
        "sampling": {"temperature": g.temperature, "extra_temperatures": g.extra_temperatures,
                     "top_p": g.top_p, "max_tokens": g.max_tokens, "seed": g.seed},
        "enabled": True,
    }
