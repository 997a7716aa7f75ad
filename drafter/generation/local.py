"""Generation for the generate step's `engine: drafter`: one Generator
(drafter.generation.generator) per visible GPU, all draining one request stream, each in its own
thread; the static decoder for models the paged generator does not support.

    gen = LocalGenerator(cfg.target, batch_size=1024)
    gen.generate(prompts, 512, temperature=0.0, top_p=1.0, seed=0)   # [(token_ids, finish)]
    feed = gen.start(on_result, max_len, max_new)    # an open stream: feed.put(...) while
    feed.close(); feed.join()                          # the generators decode (Feed)
    feed.stop()                                        # or: abort, and wait for them to end
"""
from __future__ import annotations

import logging
import threading
from contextlib import nullcontext
from typing import Sequence

import torch

from drafter.decoding.tree import DecodeError
from drafter.generation.generator import (
    Generator,
    GeneratorUnsupported,
    Request,
    Result,
    Stream,
    requests,
)

log = logging.getLogger("drafter")


class LocalGenerator:
    """In-process generation for `generate.server.engine: drafter`: one Generator per visible GPU
    (`target.device: auto`), all draining one queue, each in its own thread (a graph replay leaves
    the GIL free); the static decoder for models the paged generator does not support.

        gen = LocalGenerator(cfg.target, batch_size=cfg.generate.batch_size)
        for token_ids, finish_reason in gen.generate(prompts, 512, 0.0, 1.0, seed=0): ...

    token_ids exclude the stop token (as OpenAI-compatible servers return text); finish_reason is
    "stop", "length" or "too_long" (the prompt and max_new_tokens do not fit: nothing generated).
    """

    def __init__(self, target_cfg, batch_size: int = 64, cuda_graphs: bool = True, **generator_kw):
        from drafter.core.target import load_model, load_tokenizer
        from drafter.decoding.decode import Decoder, stop_ids_of

        n = torch.cuda.device_count() if target_cfg.device == "auto" else 1
        devices = [f"cuda:{i}" for i in range(n)] if n > 1 else [None]
        self.models = [load_model(target_cfg, device=d) for d in devices]
        self.model = self.models[0]
        self.tokenizer = load_tokenizer(target_cfg)
        self.stop_ids = stop_ids_of(self.tokenizer, self.model)
        self.batch_size = batch_size
        try:
            self.workers = [Generator(m, max_batch=batch_size, cuda_graphs=cuda_graphs,
                                      **generator_kw) for m in self.models]
        except GeneratorUnsupported as e:
            log.info("generate (local): %s; decoding in static batches", e)
            self.workers = [Decoder(m, max_batch=batch_size, cuda_graphs=cuda_graphs)
                            for m in self.models]
        self.replicas = len(self.workers)

    def generate(self, prompts: list[list[int]], max_new_tokens: int | Sequence[int],
                 temperature: float | Sequence[float] = 0.0, top_p: float = 1.0,
                 seed: int = 0, stop_ids: Sequence[int] | None = None
                 ) -> list[tuple[list[int], str]]:
        """max_new_tokens and temperature: one value, or one per prompt; stop_ids: the model's
        end-of-text ids by default. Every request is put into one closed stream."""
        from tqdm import tqdm

        reqs = requests(prompts, max_new_tokens, temperature)
        n = len(reqs)
        stop = list(self.stop_ids if stop_ids is None else stop_ids)
        bar = tqdm(total=n, desc="generate (local)", unit="prompt", disable=n <= self.batch_size)
        if not isinstance(self.workers[0], Generator):
            outs = self._static(reqs, top_p, seed, bar, stop)
        else:
            results: list = [None] * n

            def put(q: Request, res: Result) -> None:
                results[q.index] = res
            stream = Stream(reqs)
            stream.close()
            try:
                self._drain(stream, put, stop, top_p, seed, bar, None)
            finally:
                bar.close()
            outs = results
        return [(o.tokens[:-1] if o.finish == "stop" else o.tokens, o.finish) for o in outs]

    def _drain(self, stream: Stream, on_result, stop, top_p, seed, bar, sampling) -> None:
        """Every worker drains `stream`, each in its own thread when there are several."""
        from concurrent.futures import ThreadPoolExecutor

        def work(i):
            w = self.workers[i]
            with torch.cuda.device(w.device) if w.device.type == "cuda" else nullcontext():
                torch.manual_seed(seed + i)
                try:
                    w.run(stream, on_result, stop, top_p, bar, sampling)
                except BaseException:
                    stream.abort()           # the other replicas stop too
                    raise
        try:
            if len(self.workers) == 1:
                work(0)
            else:
                with ThreadPoolExecutor(len(self.workers)) as ex:
                    list(ex.map(work, range(len(self.workers))))
        except torch.cuda.OutOfMemoryError as e:
            raise DecodeError(f"generate (local): out of GPU memory at batch "
                              f"{self.batch_size}: lower generate.batch_size ({e})") from None

    def start(self, on_result, max_len: int, max_new: int, *, top_p: float = 1.0,
              seed: int = 0, stop_ids: Sequence[int] | None = None,
              sampling: bool = False) -> "Feed":
        """Start the generators on an open stream (paged generator only) and return its Feed:
        feed.put(prompts, max_new, temperature, tags) while they decode, feed.close(),
        feed.join(). on_result(tag, token_ids, finish) is called on a generator's thread as each
        row ends (token_ids without the stop token, as `generate` returns them). max_len bounds
        prompt + max_new of any request (the memory plan; one over it is "too_long"), max_new
        their new tokens. One seeded sampling stream per generator for the whole feed: sampled
        answers depend on which requests share a batch, greedy ones do not."""
        if not isinstance(self.workers[0], Generator):
            raise DecodeError("generate (local): the static decoder has no streaming path")
        stop = list(self.stop_ids if stop_ids is None else stop_ids)

        def put(q: Request, res: Result) -> None:
            on_result(q.tag, res.tokens[:-1] if res.finish == "stop" else res.tokens,
                      res.finish)
        feed = Feed(Stream(bound=(int(max_len), int(max_new))))
        feed.thread = threading.Thread(target=feed.target, name="drafter-generator", daemon=True,
                                       args=(lambda: self._drain(feed.stream, put, stop, top_p,
                                                                 seed, None, sampling),))
        feed.thread.start()
        return feed

    def stats(self) -> list[dict]:
        """Each worker's `last` (the figures of its latest run)."""
        return [dict(getattr(e, "last", {})) for e in self.workers]

    def _static(self, reqs: list[Request], top_p, seed, bar, stop) -> list[Result]:
        """The static decoder (one device): batches of equal max_new and temperature."""
        dec = self.workers[0]
        res: list = [None] * len(reqs)
        groups: dict = {}
        for q in reqs:
            groups.setdefault((q.max_new, q.temperature), []).append(q.index)
        torch.manual_seed(seed)
        try:
            for (m, t), idx in groups.items():
                outs = dec.generate([reqs[i].ids for i in idx], m, stop_ids=stop,
                                    temperature=t, top_p=top_p, progress=bar)
                for i, o in zip(idx, outs):
                    res[i] = Result(o.tokens, o.finish)
        finally:
            bar.close()
        return res


class Feed:
    """An open stream and the thread its generators run in (LocalGenerator.start)."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def target(self, fn) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller by join()/check()
            self.error = e
            self.stream.abort()

    def put(self, prompts, max_new, temperature, tags, first: bool = False) -> None:
        """first: ahead of every request put without it (Stream.put)."""
        self.check()
        self.stream.put(requests(prompts, max_new, temperature, tags, self.stream.count), first)

    def __len__(self) -> int:
        return len(self.stream)

    def check(self) -> None:
        """Raise the generators' error, if they failed."""
        if self.error is not None:
            raise self.error

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def close(self) -> None:
        self.stream.close()

    def abort(self) -> None:
        self.stream.abort()

    def stop(self, timeout: float = 120.0) -> None:
        """Abort, and wait for the generators' thread to end (each ends its step in hand): a
        thread still in torch when the interpreter exits aborts the process ("terminate called
        without an active exception") instead of its exit status."""
        self.stream.abort()
        if self.thread is not None:
            self.thread.join(timeout)

    def join(self) -> None:
        self.stream.close()
        if self.thread is not None:
            self.thread.join()
        self.check()
