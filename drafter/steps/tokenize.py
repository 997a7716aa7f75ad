"""The tokenize step: conversations -> input_ids + loss_mask through the target's chat template.

Reads   generate/conversations.jsonl when generate.enabled, else prepare/conversations.jsonl;
        the target's tokenizer and chat template (target.chat_template overrides it)
Writes  tokenize/train.parquet, tokenize/val.parquet (schema in drafter/data/tokens.py)
Command drafter tokenize CONFIG

loss_mask is 1 on exactly the tokens the assistant generates: its reasoning (as the template
renders reasoning_content), its answer and tool calls, and the end-of-turn token it emits; role
headers and whatever else the template adds stay 0. It is derived from the template itself, with
no separator strings written here:

1. Probe the template once: render [user, assistant "<probe>"]; the token the template puts right
   after the assistant's content is its end-of-turn token (the tokenizer's and generation config's
   eos tokens count too).
2. Render each conversation whole. For assistant message i, render messages[:i] with the
   generation prompt: the answer starts where that prompt stops matching the whole render, and
   ends after the first end-of-turn token from there.
3. Tokenize the text in segments cut at those points, the way the target meets it at inference
   (the prompt is tokenized, the answer is generated), and mark the answer segments. Tokenizers
   whose pieces do not concatenate losslessly (a SentencePiece dummy prefix) use the offsets of
   one whole-text encoding instead.

Conversations that cannot be used are skipped and counted by reason (the first ones are listed
in the manifest): no assistant turn (a prompt-only source with generate disabled, or a failed
generation), a template error, a template that renders history inconsistently, no end-of-turn.
Long conversations are truncated at max_length (or dropped), and counted. With drop_truncated,
conversations with an answer that generate cut at generate.max_tokens (meta.finish_reason
"length": mostly repetition loops) are skipped too (reason truncated_answer).

Repetition loops. A small target decoding greedily often ends an answer in a loop that repeats
to max_tokens (SmolLM2 on the scale run's data: many of its answers; what the cut below does
to a drafter's tau: BENCHMARKS.md, Quality, loops cut or kept). With tokenize.max_loop_tokens =
M, a conversation is cut inside an answer at the token where M + 1 of that answer's tokens have
closed a LOOP_NGRAM-token window seen tokenize.loop_copies - 1 times before in it, i.e. (default 3)
from a passage's third copy on: a passage said twice (code restated after a fix) is not a
loop. The loop's first M such tokens stay (the drafter still learns to follow a loop, which
the target also does at serving time), the rest of the loop and the turns after it go
(counted: loop_trimmed conversations, loop_trimmed_tokens).
"""
from __future__ import annotations

import bisect
import contextlib
import json
import logging
import multiprocessing as mp
import os
from collections import Counter, deque
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from drafter import DrafterError
from drafter.core import target
from drafter.core.rundir import Run, atomic_open
from drafter.data.tokens import TokenWriter

log = logging.getLogger("drafter")

PROBE_U, PROBE_A = "drafter probe question", "drafter probe answer"
PROBE_R = "drafter probe thought"
MAX_EXAMPLES = 20  # skipped conversations listed in the manifest
LOOP_NGRAM = 16    # tokens in the window whose repetition marks a loop (max_loop_tokens)


class TemplateError(DrafterError):
    """The chat template cannot be used to find assistant spans."""


class _Skip(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def _common_prefix(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))  # binary search on the longest equal prefix
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Renderer:
    """Renders conversations with a tokenizer's chat template and finds the assistant spans."""

    def __init__(self, tok, enable_thinking: bool | None = None,
                 template_kwargs: dict | None = None, stop_ids: tuple[int, ...] = (),
                 mode: str = "auto"):
        if not getattr(tok, "chat_template", None):
            raise TemplateError("the target's tokenizer has no chat template: set "
                                "target.chat_template to a Jinja file")
        self.tok = tok
        self.kw = dict(template_kwargs or {})
        if enable_thinking is not None:
            self.kw["enable_thinking"] = enable_thinking
        self.special_ids = set(getattr(tok, "added_tokens_decoder", {}) or {}) | \
            set(tok.all_special_ids)
        self.ends = self._probe_end(stop_ids)
        self.renders_reasoning = PROBE_R in self.render(
            [{"role": "user", "content": PROBE_U},
             {"role": "assistant", "content": PROBE_A, "reasoning_content": PROBE_R}])
        self.mode = self._pick_mode() if mode == "auto" else mode

    def render(self, messages: list[dict], tools=None, generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                            add_generation_prompt=generation_prompt, **self.kw)

    def _after_probe(self, messages: list[dict]) -> tuple[str, list[int]]:
        """The text a template renders after the probe answer's content, and its token ids."""
        try:
            text = self.render(messages)
        except Exception as e:
            raise TemplateError(f"the chat template fails on {[m['role'] for m in messages]}: "
                                f"{type(e).__name__}: {e}") from None
        k = text.find(PROBE_A)
        if k < 0:
            raise TemplateError("the chat template does not render the assistant's content")
        after = text[k + len(PROBE_A):]
        return after, self.tok(after, add_special_tokens=False)["input_ids"]

    def _probe_end(self, stop_ids) -> list[str]:
        """The end-of-turn strings: the special token a template puts right after an answer,
        and the stop tokens (eos) found there."""
        u, a = {"role": "user", "content": PROBE_U}, {"role": "assistant", "content": PROBE_A}
        stop_ids = [i for i in stop_ids if i is not None]
        after, ids = self._after_probe([u, a])
        cand = ([ids[0]] if ids and ids[0] in self.special_ids else []) + stop_ids
        ends = []
        for i in cand:
            s = self._text(i, after)
            if s and s not in ends:
                ends.append(s)
        self.open_end = False
        if not ends:
            # Templates like GLM's put nothing after an answer: the model stops by emitting the
            # next turn's header, which is one of its stop tokens. The last answer of a
            # conversation then runs to the end of the text.
            after2, ids2 = self._after_probe([u, a, u])
            if ids2 and ids2[0] in stop_ids and self._text(ids2[0], after2):
                ends, self.open_end = [self._text(ids2[0], after2)], True
            else:
                raise TemplateError(
                    f"the chat template puts no end-of-turn token after the assistant's content "
                    f"(it renders {after!r} there, {after2[:40]!r} before a next turn), so the "
                    f"end of an answer cannot be found. Use a template that ends assistant turns "
                    f"with the model's stop token (target.chat_template)")
        return ends

    def _text(self, i: int, where: str) -> str | None:
        """How token i is written in a rendered template (`where`), if it is there: the token's
        own string for added tokens, else its decoded text."""
        for s in (self.tok.convert_ids_to_tokens(i),
                  self.tok.decode([i], skip_special_tokens=False)):
            if isinstance(s, str) and s and s in where:
                return s
        return None

    def _pick_mode(self) -> str:
        """segments when encoding pieces and concatenating gives back the text, else offsets."""
        msgs = [{"role": "user", "content": PROBE_U}, {"role": "assistant", "content": PROBE_A},
                {"role": "user", "content": PROBE_U}, {"role": "assistant", "content": "\n x"}]
        text, spans = self.spans(msgs)
        cuts = sorted({0, len(text), *[c for s in spans for c in s]})
        segs = [text[a:b] for a, b in zip(cuts, cuts[1:])]
        ids = [i for seg in self.tok(segs, add_special_tokens=False)["input_ids"] for i in seg]
        whole = self.tok(text, add_special_tokens=False)["input_ids"]
        # Compared through the same decoder, so that only what the cuts changed can differ
        # (a SentencePiece dummy prefix adds a space at every cut).
        if self.tok.decode(ids, skip_special_tokens=False) == \
                self.tok.decode(whole, skip_special_tokens=False):
            return "segments"
        if getattr(self.tok, "is_fast", False):
            return "offsets"
        raise TemplateError("the tokenizer neither concatenates encoded pieces losslessly nor "
                            "gives character offsets: cannot align the loss mask")

    def spans(self, messages: list[dict], tools=None) -> tuple[str, list[tuple[int, int]]]:
        """(whole render, [(start, end) character span of each assistant message's tokens])."""
        try:
            full = self.render(messages, tools)
        except Exception as e:
            raise _Skip("template_error", f"{type(e).__name__}: {e}") from None
        out, prev = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            try:
                prompt = self.render(messages[:i], tools, generation_prompt=True)
            except Exception as e:
                raise _Skip("template_error", f"{type(e).__name__}: {e}") from None
            start = _common_prefix(prompt, full)
            if start < len(prompt):
                # The history renders differently from the generation prompt (R1-style templates
                # put '<think>\n' in the prompt only): the answer starts where they part, moved
                # back to the end of the last whole prompt token.
                start = self._token_floor(prompt, start)
            if start < prev:
                raise _Skip("template_mismatch",
                            f"message {i}: the generation prompt disagrees with the rendered "
                            f"history before the previous answer ends")
            found = [(p, s) for s in self.ends if (p := full.find(s, start)) >= 0]
            if found:
                p, s = min(found)
                end = p + len(s)
            elif self.open_end:
                end = len(full)
            else:
                raise _Skip("no_end_of_turn", f"message {i}: no end-of-turn token after it")
            out.append((start, end))
            prev = end
        return full, out

    def _token_floor(self, prompt: str, pos: int) -> int:
        if not getattr(self.tok, "is_fast", False):
            return pos
        offs = self.tok(prompt, add_special_tokens=False, return_offsets_mapping=True)
        ends = [e for _, e in offs["offset_mapping"] if e <= pos]
        return max(ends, default=0)

    def encode(self, items: list[tuple[str, list[tuple[int, int]]]]) -> list[tuple[list, list]]:
        """[(text, spans)] -> [(input_ids, loss_mask)], one tokenizer call per batch."""
        if not items:
            return []
        if self.mode == "offsets":
            enc = self.tok([t for t, _ in items], add_special_tokens=False,
                           return_offsets_mapping=True)
            out = []
            for (text, spans), ids, offs in zip(items, enc["input_ids"], enc["offset_mapping"]):
                starts = [s for s, _ in spans]
                mask = []
                for a, _ in offs:
                    k = bisect.bisect_right(starts, a) - 1
                    mask.append(1 if k >= 0 and spans[k][0] <= a < spans[k][1] else 0)
                out.append((ids, mask))
            return out
        segs, flags, owner = [], [], []
        for n, (text, spans) in enumerate(items):
            cuts = sorted({0, len(text), *[c for s in spans for c in s]})
            starts = {s for s, _ in spans}
            for a, b in zip(cuts, cuts[1:]):
                segs.append(text[a:b])
                flags.append(1 if a in starts else 0)
                owner.append(n)
        out = [([], []) for _ in items]
        enc = self.tok(segs, add_special_tokens=False)["input_ids"]
        for ids, flag, n in zip(enc, flags, owner):
            out[n][0].extend(ids)
            out[n][1].extend([flag] * len(ids))
        return out


# --------------------------------------------------------------------------------- the batches
def _usable(rec: dict, counts: Counter) -> list[dict]:
    """The messages to render: cut at the first missing answer, without trailing prompts."""
    msgs = rec["messages"]
    for i, m in enumerate(msgs):
        if m["role"] == "assistant" and not (m.get("content") or m.get("tool_calls")
                                             or m.get("reasoning_content")):
            counts["cut_at_missing_answer"] += 1
            msgs = msgs[:i]
            break
    last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=-1)
    if last < 0:
        raise _Skip("no_assistant", "no assistant answer")
    if last < len(msgs) - 1:
        counts["trailing_turns_dropped"] += len(msgs) - 1 - last
    # None fields confuse templates (`m.content.strip()`): content None -> "", others left out
    return [{k: ("" if v is None else v) for k, v in m.items() if v is not None or k == "content"}
            for m in msgs[:last + 1]]


def loop_cut(ids: list[int], mask: list[int], limit: int, copies: int = 3,
             n: int = LOOP_NGRAM) -> int | None:
    """Where to cut for tokenize.max_loop_tokens: the first position at which `limit + 1`
    tokens of one answer (a run of mask 1) have closed an n-token window seen `copies - 1`
    times or more earlier in that answer (a passage's `copies`-th copy on), so that ids[:cut]
    keeps `limit` looping tokens; None if none does. With copies=3 a passage said twice (code
    restated after a fix, a quoted answer) is not a loop."""
    seen: Counter = Counter()
    start = repeated = 0
    for t, m in enumerate(mask):
        if not m:
            start = t + 1
            continue
        if t == start:                                        # a new answer
            seen, repeated = Counter(), 0
        if t - start + 1 >= n:
            window = tuple(ids[t - n + 1:t + 1])
            if seen[window] >= copies - 1:
                repeated += 1
                if repeated > limit:
                    return t
            seen[window] += 1
    return None


def process(renderer: Renderer, lines: list[tuple[int, bytes]], file: str, max_length: int,
            overflow: str, drop_truncated: bool = False, max_loop_tokens: int | None = None,
            loop_copies: int = 3) -> tuple[list[tuple], Counter, list[dict]]:
    """Raw JSONL lines -> ([(split, id, input_ids, loss_mask)], counts, skipped examples)."""
    counts, skipped, items, meta = Counter(), [], [], []
    for line_no, line in lines:
        try:
            rec = json.loads(line)
            rid, split = rec["id"], rec["split"]
        except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
            raise DrafterError(f"{file}:{line_no}: not a canonical conversation record "
                               f"({type(e).__name__}: {e})") from None
        if split not in ("train", "val"):
            raise DrafterError(f"{file}:{line_no}: split must be train or val, got {split!r}")
        counts["conversations"] += 1
        try:
            if drop_truncated and (rec.get("meta") or {}).get("finish_reason") == "length":
                raise _Skip("truncated_answer", "an answer reached generate.max_tokens")
            msgs = _usable(rec, counts)
            if not renderer.renders_reasoning and any(m.get("reasoning_content") for m in msgs):
                counts["reasoning_not_rendered"] += 1
            text, spans = renderer.spans(msgs, rec.get("tools"))
        except _Skip as e:
            counts[f"skipped_{e.reason}"] += 1
            if len(skipped) < MAX_EXAMPLES:
                skipped.append({"id": rid, "line": line_no, "reason": e.reason, "detail": e.detail})
            continue
        items.append((text, spans))
        meta.append((split, rid, line_no))
    rows = []
    for (split, rid, line_no), (ids, mask) in zip(meta, renderer.encode(items)):
        cut = loop_cut(ids, mask, max_loop_tokens, loop_copies) \
            if max_loop_tokens is not None else None
        if cut is not None:
            counts["loop_trimmed"] += 1
            counts["loop_trimmed_tokens"] += len(ids) - cut
            ids, mask = ids[:cut], mask[:cut]
        if len(ids) > max_length:
            if overflow == "drop":
                counts["skipped_too_long"] += 1
                continue
            ids, mask = ids[:max_length], mask[:max_length]
            counts["truncated"] += 1
        if not any(mask):
            counts["skipped_no_masked_tokens"] += 1
            if len(skipped) < MAX_EXAMPLES:
                skipped.append({"id": rid, "line": line_no, "reason": "no_masked_tokens",
                                "detail": f"no assistant token within max_length={max_length}"})
            continue
        rows.append((split, rid, ids, mask))
        counts[split] += 1
        counts["tokens"] += len(ids)
        counts["masked_tokens"] += sum(mask)
    return rows, counts, skipped


def _chunks(path: Path, size: int, bar) -> Iterator[list[tuple[int, bytes]]]:
    chunk = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            bar.update(len(line))
            if line.strip():
                chunk.append((n, line))
            if len(chunk) >= size:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def make_renderer(cfg) -> Renderer:
    tok = target.load_tokenizer(cfg.target)
    stop = [tok.eos_token_id]
    with contextlib.suppress(Exception):  # no generation_config.json is fine
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(target.resolve(cfg.target.model)).eos_token_id
        stop += eos if isinstance(eos, list) else [eos]
    tc = cfg.tokenize
    # Render with the variables the answers were generated under (generate's, when it ran), so
    # that e.g. enable_thinking agrees; tokenize's own settings win.
    kw = dict(getattr(cfg.generate, "chat_template_kwargs", None) or {}) \
        if cfg.generate.enabled else {}
    kw.update(tc.template_kwargs)
    return Renderer(tok, tc.enable_thinking, kw, tuple(stop))


# Worker processes. Forked where the OS can (they inherit the loaded renderer: no second start-up
# of transformers); spawned elsewhere, where each builds its own. Tokenize touches no GPU, so a
# fork is safe; each worker encodes single-threaded, the pool is the parallelism.
_W: dict = {}


def _init_worker(cfg) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if "r" not in _W:
        _W["r"] = make_renderer(cfg)
    _W["cfg"] = cfg


def _options(tc) -> dict:
    """process()'s settings from the tokenize config (workers and the main process alike)."""
    return {"max_length": tc.max_length, "overflow": tc.overflow,
            "drop_truncated": tc.drop_truncated, "max_loop_tokens": tc.max_loop_tokens,
            "loop_copies": tc.loop_copies}


def _work(args):
    lines, file = args
    tc = _W["cfg"].tokenize
    return process(_W["r"], lines, file, **_options(tc))


def _ordered(pool, tasks, window: int):
    """Results of _work in task order with at most `window` chunks in flight (Pool.imap would
    read the whole input into its queue)."""
    pending: deque = deque()
    tasks = iter(tasks)
    for task in tasks:
        pending.append(pool.apply_async(_work, (task,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def main(cfg) -> dict:
    tc = cfg.tokenize
    run = Run.of(cfg)
    src_step = "generate" if cfg.generate.enabled else "prepare"
    src = run.require(run.conversations(src_step), src_step)
    renderer = make_renderer(cfg)
    log.info("tokenize: %s -> end-of-turn %s, reasoning %s, %s encoding", src,
             renderer.ends, "rendered" if renderer.renders_reasoning else "not rendered",
             renderer.mode)
    workers = tc.workers or min(32, os.cpu_count() or 1)
    if tc.workers == 0 and os.path.getsize(src) < (8 << 20):
        workers = 1  # auto: a pool costs seconds to start, not worth it for a small file
    counts, skipped = Counter(), []
    with contextlib.ExitStack() as stack:
        writers = {}
        for split in ("train", "val"):
            f = stack.enter_context(atomic_open(run.tokens(split), "wb"))
            # TokenWriter writes the temp file atomic_open made; atomic_open fsyncs and renames it.
            writers[split] = TokenWriter(f.name)
            stack.callback(writers[split].writer.close)  # also on errors: free the file handle
        bar = stack.enter_context(tqdm(total=os.path.getsize(src), unit="B", unit_scale=True,
                                       desc="tokenize", mininterval=1.0))
        chunks = ((c, str(src)) for c in _chunks(src, tc.batch_size, bar))
        if workers > 1:
            fork = "fork" in mp.get_all_start_methods()
            if fork:
                _W["r"] = renderer
            pool = stack.enter_context(mp.get_context("fork" if fork else "spawn").Pool(
                workers, initializer=_init_worker, initargs=(cfg,)))
            stack.callback(_W.clear)
            results = _ordered(pool, chunks, 2 * workers)
        else:
            results = (process(renderer, c, f, **_options(tc)) for c, f in chunks)
        for rows, c, sk in results:
            for split, rid, ids, mask in rows:
                writers[split].write(rid, ids, mask)
            counts.update(c)
            skipped.extend(sk[: MAX_EXAMPLES - len(skipped)])
            bar.set_postfix(ok=counts["train"] + counts["val"],
                            skipped=sum(v for k, v in counts.items() if k.startswith("skipped_")),
                            refresh=False)
        if workers > 1:
            # Done: the workers take their sentinels and exit. Pool.__exit__'s terminate() (kept
            # for errors) SIGTERMs them instead, and a worker that misses the signal (one still
            # starting up: Python clears a new child's pending signals) then waits forever on
            # the task queue's lock, which terminate holds. Seen once: a full test run hung in
            # test_workers_give_the_same_files, the worker blocked in SimpleQueue.get.
            pool.close()
            pool.join()
        for w in writers.values():
            w.close()
        usable = counts["train"] + counts["val"]
        if counts["train"] == 0:
            hint = ""
            if counts["skipped_no_assistant"]:
                hint = (" Conversations have no assistant answers: set generate.enabled=true to "
                        "answer the prompts with the target, or use sources with answers.")
            raise DrafterError(f"tokenize: no usable training conversation in {src} "
                               f"({dict(counts)}).{hint} First skipped: {skipped[:3]}")
    if usable < counts["conversations"]:
        log.warning("tokenize: skipped %d of %d conversations: %s",
                    counts["conversations"] - usable, counts["conversations"],
                    {k: v for k, v in counts.items() if k.startswith("skipped_")})
    if counts["reasoning_not_rendered"]:
        log.warning("tokenize: %d conversations carry reasoning_content that the chat template "
                    "does not render: their reasoning is not trained on",
                    counts["reasoning_not_rendered"])
    order = ["conversations", "train", "val", "tokens", "masked_tokens", "truncated"]
    counts = {k: counts[k] for k in order} | {k: v for k, v in sorted(counts.items())
                                              if k not in order}
    return {"counts": counts, "source": src_step, "end_of_turn": renderer.ends,
            "encoding": renderer.mode, "renders_reasoning": renderer.renders_reasoning,
            "tokenizer_size": len(renderer.tok), "skipped_examples": skipped}
