"""Plain and speculative decoding of a target over the static cache (drafter.decoding.static): the
loops that evaluate runs, one step captured per (batch, span bucket).

    dec = Decoder(model, max_batch=8)                                  # any HF causal LM
    plain = dec.generate(prompts, 128, stop_ids=[2])                   # list[Output]
    spec = dec.generate(prompts, 128, stop_ids=[2], proposer=EagleDraft(drafter),
                        tree=TreeSpec.chain(5))                        # or TreeSpec(6, 8, 48)

Shapes: B rows, T new tokens of a forward, S attention span (static cache slots read), V target
vocab, Vd draft vocab, A aux layers, Ht target hidden, H drafter hidden, D tree depth (chain: K),
k children per node (chain: 1), N draft nodes verified per step, E expanded nodes (1 + (D-1)·k).
Sampling temperature is `temperature` everywhere (never T, which counts tokens).

The drafter is an interface (`DraftModel`: observe/score), so that tests plug in oracle and always-
wrong drafters; `EagleDraft` wraps drafter.train.model.Drafter with its own static cache. The
drafting half (tree building, verification, `DraftModel`, `EagleDraft`) lives in
drafter.decoding.tree. A proposer with a `step` of its own, a block drafter (DSpark, DFlash:
drafter.decoding.dspark), runs the whole speculative step of a chain over this state.

The reasoning: docs/internals.md, "Module notes", decode.py.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from drafter.decoding.static import (
    Graphs,
    StaticTarget,
    capturable_experts,
    eager_attention,
    round_up,
    syncing_experts,
)

# the drafting half of speculative decoding; EagleDraft and the tree helpers are re-exported here
from drafter.decoding.tree import (  # noqa: F401
    DecodeError,
    DraftModel,
    DraftQ,
    EagleDraft,
    TreeSpec,
    ancestors,
    build_tree,
    pick,
    sampled_children,
    shape_acceptance,
    verify_chain_sample,
    verify_greedy,
    verify_sample,
)

log = logging.getLogger("drafter")
_ALLOC_SERIAL = itertools.count(1)  # each proposer allocation's number (Decoder._ensure)
# a graphed prefill's prompts are left-padded to a multiple of this (one graph per (B, length))
PREFILL_BUCKET = 64


# ------------------------------------------------------------------------------- the decoder
@dataclass
class Output:
    tokens: list[int]              # new tokens; the stop token is kept when it ended the text
    finish: str                    # "stop" or "length"
    steps: int                     # target forwards after the prefill
    hist: list[int] | None = None  # speculative: steps by accepted draft tokens (0..D)
    # plain greedy, per token: the NEAR runners-up (top 2.., best first) and top-1 minus each
    gaps: list[list[float]] | None = None
    second: list[list[int]] | None = None
    # greedy trees with tree_stats: [accepted, valid] [2][D][N], summed over the steps: what a
    # (depth D', same topk, N' nodes) tree would have accepted (tree.shape_acceptance)
    shapes: list | None = None
    # a proposer's own records of its steps (a block drafter's confidences: dspark.DSparkDraft)
    stats: list | None = None


NEAR = 8   # runners-up recorded per token for the lossless check (bf16 logits tie several ways)


def runners_up(lg: Tensor, picked: Tensor) -> tuple[Tensor, Tensor]:
    """The NEAR best tokens of logits lg [B, V] other than the picked one [B], best first, and
    the picked token's logit minus each: gaps [B, NEAR] float, ids [B, NEAR] long. The picked
    token is left out by id, not by rank: among exactly tied logits (frequent in bf16) topk's
    order need not put argmax's choice first, and a runner-up tied with it must stay listed."""
    top = lg.topk(NEAR + 1, dim=-1)                                      # [B, NEAR + 1]
    other = (top.indices != picked[:, None]).to(torch.int8)
    order = torch.argsort(other, dim=-1, descending=True, stable=True)[:, :NEAR]
    ids = top.indices.gather(1, order)                                   # [B, NEAR]
    return lg.gather(1, picked[:, None]) - top.values.gather(1, order), ids


class _State:
    """Persistent per-batch tensors (updated in place: captured graphs read them)."""

    def __init__(self, B: int, W: int, D: int, Vd: int, n_stop: int, dev, N: int = 0,
                 stats: tuple | None = None):
        z = dict(dtype=torch.long, device=dev)
        self.B, self.W = B, W
        self.start, self.L = torch.zeros(B, **z), torch.zeros(B, **z)
        self.pending, self.n_out, self.steps = (torch.zeros(B, **z) for _ in range(3))
        self.out, self.second = torch.zeros(B, W, **z), torch.zeros(B, W, NEAR, **z)
        self.gap = torch.zeros(B, W, NEAR, dtype=torch.float32, device=dev)
        self.finished = torch.zeros(B, dtype=torch.bool, device=dev)
        self.hist = torch.zeros(B, D + 1, **z)
        self.max_new = torch.zeros((), **z)
        self.stop = torch.full((n_stop,), -1, **z)
        self.root = torch.zeros(B, max(Vd, 1), dtype=torch.float32, device=dev)
        # tree_stats: [B, 2, D, N] accepted and valid steps by smaller (depth, nodes)
        self.shapes = torch.zeros(B, 2, D, N, **z) if N else None
        # the proposer's per-row records (its stats_shape), summed over the steps
        self.stats = torch.zeros(B, *stats, dtype=torch.float32, device=dev) if stats else None

    def tensors(self) -> list[Tensor]:
        return [self.start, self.L, self.pending, self.n_out, self.steps, self.out, self.second,
                self.gap, self.finished, self.hist, self.root] \
            + [t for t in (self.shapes, self.stats) if t is not None]


class Decoder:
    """Batched static-cache decoding of one target, plain or speculative.

    max_batch rows decode together; `span_bucket` rounds the attention span (one graph per
    bucket); `prefill_tokens` bounds B x chunk of the (eager) prefill. A batch's prefill of at most
    `prefill_graph_tokens` (B x its prompts left-padded to a multiple of PREFILL_BUCKET) replays
    a CUDA graph as the steps do (0: eager prefills only; so for a target whose MoE experts sync
    with the host: static's `capturable_experts`): a small prefill is all kernel launches
    (BENCHMARKS.md, Decoding: prefills graphed and eager). `last` holds
    the timing of the latest generate call: seconds (without graph capture), capture_seconds,
    prefill_seconds, iterations (decode steps) and row_steps (their rows summed)."""

    def __init__(self, model, max_batch: int = 1, cuda_graphs: bool = True,
                 span_bucket: int = 256, prefill_tokens: int = 16384, sync_every: int = 4,
                 fold: bool | None = None, prefill_graph_tokens: int = 2048):
        # fold: batch-1 verifications as T rows of one token (StaticTarget; None: on a GPU)
        self.target = StaticTarget(model, fold=fold)
        # steps replayed between two reads of the batch's state: each read is a host sync that
        # leaves the GPU idle while Python decides; finished rows idle through the extra steps
        self.sync_every = max(1, sync_every)
        self.fast_chain = True  # chains take _chain_step (False: the general tree step)
        # a sampled chain's verification (None: tree.verify_chain_sample's rejection sampling;
        # block.verify_chain_block: block verification), same arguments and returns
        self.chain_verify = None
        self.max_batch = max_batch
        # MoE experts whose kernels sync with the host are captured as batched_mm
        # (capturable_experts), whose memory grows with the tokens: such prefills stay eager
        self.graphs = Graphs(cuda_graphs and self.target.device.type == "cuda",
                             context=lambda: capturable_experts(model))
        self.span_bucket, self.prefill_tokens = span_bucket, prefill_tokens
        self.prefill_graph_tokens = \
            0 if self.graphs.enabled and syncing_experts(model) else prefill_graph_tokens
        self._prefill_in: dict = {}  # (B, Tp) -> the graphed prefill's ids [B, Tp], start [B]
        self.cap = (0, 0)
        self._states: dict = {}
        # id -> (proposer, serial of the allocation this Decoder made): holds a reference, so
        # that an id (a graph key) is never reused; emptied when the capacity grows
        self._allocated: dict[int, tuple] = {}
        self.last: dict = {}
        self._parts: dict = {}  # (proposer, tree, "BxS") -> parts ms (parts_ms)

    @property
    def device(self):
        return self.target.device

    # -- capacity
    def _ensure(self, B: int, S: int, proposer) -> None:
        if B > self.cap[0] or S > self.cap[1]:
            cap = (max(B, self.cap[0]), round_up(max(S, self.cap[1]), self.span_bucket))
            self._reset_graphs()
            self.target.allocate(*cap)
            self.cap, self._allocated = cap, {}
        # A proposer shared by two Decoders (evaluate's and a benchmark's) is reallocated by the
        # other one: its serial tells, and this Decoder's graphs, captured on the old buffers,
        # go with them
        mine = self._allocated.get(id(proposer))
        if proposer is not None and (mine is None
                                     or mine[1] != getattr(proposer, "_alloc_serial", None)):
            try:
                proposer.allocate(*self.cap, self.device, self.target.dtype)
            except torch.cuda.OutOfMemoryError as e:
                raise DecodeError(f"drafter cache for {self.cap[0]} rows x {self.cap[1]} slots "
                                  f"does not fit: lower the batch size ({e})") from None
            proposer._alloc_serial = serial = next(_ALLOC_SERIAL)
            self._allocated[id(proposer)] = (proposer, serial)
            self._reset_graphs()

    @staticmethod
    def _extra(proposer, tree) -> int:
        """Slots a step may write past the sequence: the verified tree, the drafts' frontier."""
        if proposer is None:
            return 1
        D, k, N = tree.depth, tree.topk, tree.nodes
        # (a block drafter's queries write scratch slots past the sequence: extra_slots)
        return max(N + 1, (D - 1) * k, D + 1, getattr(proposer, "extra_slots", 0))

    def _slots(self, Tp: int, max_new: int, proposer, tree) -> int:
        """Cache slots a batch of prompts up to Tp tokens needs for max_new new tokens."""
        D = tree.depth if proposer is not None else 0
        return Tp + max_new + self._extra(proposer, tree) + D + 2

    def _reset_graphs(self):
        self.graphs.clear()

    @staticmethod
    def _graph_state(st, proposer) -> list:
        """The tensors a graph over state `st` writes (a capture's warm-up run restores them):
        the state's and the proposer's (a DraftModel's state_tensors, if it has any)."""
        return st.tensors() + (list(getattr(proposer, "state_tensors", list)())
                               if proposer is not None else [])

    def _graphed(self, B: int, Tp: int) -> bool:
        """Whether a whole batch's prefill of B prompts left-padded to Tp replays a graph."""
        return self.graphs.enabled and B * Tp <= self.prefill_graph_tokens

    def _prompt_len(self, B: int, Tp: int) -> int:
        """The length B prompts of up to Tp tokens are left-padded to: a multiple of
        PREFILL_BUCKET where their prefill replays a graph (one graph per length), else Tp."""
        Tb = round_up(Tp, PREFILL_BUCKET)
        return Tb if self._graphed(B, Tb) else Tp

    def _state(self, B, W, D, Vd, n_stop, N=0, stats=None) -> _State:
        key = (B, W, D, Vd, n_stop, N, stats)
        if key not in self._states:
            self._states[key] = _State(B, W, D, Vd, n_stop, self.device, N, stats)
        return self._states[key]

    # -- public
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 stop_ids: Sequence[int] = (), temperature: float = 0.0, top_p: float = 1.0,
                 proposer: DraftModel | None = None, tree: TreeSpec | None = None,
                 record_gaps: bool = False, tree_stats: bool = False,
                 continuous: bool = False, progress=None) -> list[Output]:
        """Decode each prompt (token ids) for up to max_new_tokens new tokens, stopping at a stop
        id. Plain decoding without a proposer; speculative decoding with one (tree: chain K=3 by
        default). `record_gaps` keeps the NEAR runners-up of plain greedy decoding and their
        margins (tie analysis). `tree_stats` (a greedy tree) counts, step by step, what trees of
        the same topk with fewer levels or nodes would have accepted (Output.shapes).
        `continuous`: more prompts than max_batch decode with continuous batching (a row whose
        answer has ended takes the next prompt, as serving engines do: `_continuous`); else in
        static batches of max_batch, each until its last row ends."""
        if max_new_tokens < 1:
            raise DecodeError("max_new_tokens must be >= 1")
        if any(len(p) == 0 for p in prompts):
            raise DecodeError("empty prompt: every prompt needs at least one token")
        if proposer is not None and tree is None:
            tree = TreeSpec.chain(3)
        self.target.claim()
        self.last = {"seconds": 0.0, "capture_seconds": 0.0, "prefill_seconds": 0.0,
                     "iterations": 0, "row_steps": 0, "spans": {}, "step_gpu_seconds": None}
        self._step_events = []
        # The caches for the longest prompt, before any batch is timed: grown batch by batch,
        # each growth would reallocate them and recapture every graph inside `seconds` (at batch
        # 1, a longer prompt every few prompts)
        if prompts:  # (the longest prompt as a batch of one pads it: no batch pads it more)
            self._ensure(min(self.max_batch, len(prompts)),
                         self._slots(self._prompt_len(1, max(len(p) for p in prompts)),
                                     max_new_tokens, proposer, tree), proposer)
        cap0 = self.graphs.capture_seconds
        t0 = time.perf_counter()
        prompts = [list(map(int, p)) for p in prompts]
        stop_ids = list(stop_ids)
        if continuous and 1 < self.max_batch < len(prompts):  # (batch 1: the same either way)
            outs = self._continuous(prompts, max_new_tokens, stop_ids, temperature, top_p,
                                    proposer, tree, record_gaps, tree_stats, progress)
        else:
            outs = []
            assign = getattr(proposer, "assign", None)  # optional: which prompt each row takes
            for b0 in range(0, len(prompts), self.max_batch):
                batch = prompts[b0:b0 + self.max_batch]
                if assign is not None:
                    assign(list(range(len(batch))), list(range(b0, b0 + len(batch))))
                outs += self._batch(batch, max_new_tokens, stop_ids, temperature, top_p,
                                    proposer, tree, record_gaps, tree_stats)
                if progress is not None:
                    progress.update(len(batch))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.last["seconds"] += time.perf_counter() - t0
        if self._step_events:  # the GPU's time in the steps' replays (the host's gaps left out)
            self.last["step_gpu_seconds"] = sum(a.elapsed_time(b) for a, b in
                                                self._step_events) / 1000
            self._step_events = []
        self.last["capture_seconds"] = self.graphs.capture_seconds - cap0
        self.last["seconds"] -= self.last["capture_seconds"]
        return outs

    # -- one batch
    def _begin(self, B, max_new, stop_ids, temperature, top_p, proposer, tree, record_gaps,
               tree_stats):
        """The state of B rows, zeroed, and the steps over it (each replayed from its CUDA graph
        per span): -> (state, steps(n, the longest row's length before them))."""
        spec = proposer is not None
        D = tree.depth if spec else 0
        self.target.set_aux(proposer.aux_layer_ids if spec else None)
        Vd = proposer.vocab_size if spec else 0
        stats = tree_stats and spec and temperature == 0 and not tree.is_chain
        own = getattr(proposer, "stats_shape", None) if spec else None
        if spec and hasattr(proposer, "check"):  # before any capture: what it cannot run
            proposer.check(self, tree, temperature)
        st = self._state(B, round_up(max_new + D + 2, 64), D, Vd, max(1, len(stop_ids)),
                         tree.nodes if stats else 0, own(D) if own else None)
        for t in st.tensors():
            t.zero_()
        st.max_new.fill_(max_new)
        st.stop.fill_(-1)
        if stop_ids:
            st.stop.copy_(torch.tensor(stop_ids, device=self.device))
        key = ("spec" if spec else "plain", id(st), temperature, top_p, tree, id(proposer),
               self.target.aux_ids, record_gaps, self.chain_verify)
        state = self._graph_state(st, proposer)
        if spec:
            def fn(span):
                self._spec_step(st, span, proposer, tree, temperature)
        else:
            def fn(span):
                self._plain_step(st, span, temperature, top_p, record_gaps)

        extra = self._extra(proposer, tree)

        def steps(n, lmax):  # n steps over a span that holds what they append (D + 1 tokens
            # each) past the longest row, lmax, read before them
            span = min(self.cap[1], round_up(lmax + extra + (self.sync_every - 1) * (D + 1),
                                             self.span_bucket))
            timed = self.device.type == "cuda"
            if timed:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
            for _ in range(n):
                self.graphs.run(key + (span,), lambda: fn(span), state)
            if timed:
                ev[1].record()
                self._step_events.append(ev)
            self.last["iterations"] += n
            self.last["row_steps"] += n * B  # rows the steps computed, ended ones included
            at = f"{B}x{span}"  # the steps by the shape they ran at: rows x attention span
            self.last["spans"][at] = self.last["spans"].get(at, 0) + n
        return st, steps

    def _batch(self, prompts, max_new, stop_ids, temperature, top_p, proposer, tree,
               record_gaps, tree_stats=False):
        B = len(prompts)
        Tp = self._prompt_len(B, max(len(p) for p in prompts))
        spec = proposer is not None
        self._ensure(B, self._slots(Tp, max_new, proposer, tree), proposer)
        st, step = self._begin(B, max_new, stop_ids, temperature, top_p, proposer, tree,
                               record_gaps, tree_stats)
        self._prefill(st, prompts, Tp, temperature, top_p, proposer, record_gaps)
        done, lmax = torch.stack([st.finished.all().long(), st.L.max()]).tolist()
        it = 0
        while not done and it < max_new:
            n = min(self.sync_every, max_new - it)
            step(n, lmax)
            it += n
            done, lmax = torch.stack([st.finished.all().long(), st.L.max()]).tolist()
        return self._collect(st, range(B), max_new, stop_ids, spec, record_gaps)

    def _continuous(self, prompts, max_new, stop_ids, temperature, top_p, proposer, tree,
                    record_gaps, tree_stats, progress) -> list[Output]:
        """Continuous batching over more prompts than rows: max_batch rows decode together, and
        once an eighth of them (or all the live ones) have ended, those rows take the next
        prompts (one eager prefill of the refilled rows alone; the other rows' caches and state
        untouched) while the rest go on, as a serving engine refills its batch. The steps are
        the static batch's (the same graphs); greedy outputs equal static batches'
        (tests/test_decode.py). Returns the outputs in prompt order."""
        n, spec = len(prompts), proposer is not None
        if spec and not hasattr(proposer, "rows"):
            raise DecodeError(f"{type(proposer).__name__} cannot refill cache rows (it has no "
                              f"`rows`, DraftModel): decode with continuous=False")
        B = min(self.max_batch, n)
        st, step = self._begin(B, max_new, stop_ids, temperature, top_p, proposer, tree,
                               record_gaps, tree_stats)
        assign = getattr(proposer, "assign", None)

        def fill(take, rows):  # prompts `take` into state rows `rows` (None: 0..B-1, all)
            if assign is not None:
                assign(list(range(len(take))) if rows is None else list(rows), list(take))
            Tp = max(len(prompts[i]) for i in take)
            self._prefill(st, [prompts[i] for i in take],
                          Tp if rows is not None else self._prompt_len(len(take), Tp),
                          temperature, top_p, proposer, record_gaps, rows)

        owner: list[int | None] = list(range(B))   # the prompt each row decodes
        queue = list(range(B, n))
        fill(owner, None)
        res: list = [None] * n
        need = max(1, B // 8)
        while True:
            *fin, lmax = torch.cat([st.finished.long(), st.L.max()[None]]).tolist()  # one sync
            done = [b for b in range(B) if fin[b] and owner[b] is not None]
            live = sum(o is not None for o in owner)
            if done and (len(done) >= need or len(done) == live):
                for b, o in zip(done, self._collect(st, done, max_new, stop_ids, spec,
                                                    record_gaps)):
                    res[owner[b]] = o
                    owner[b] = None
                if progress is not None:
                    progress.update(len(done))
                if queue:
                    take, queue = queue[:len(done)], queue[len(done):]
                    rows = done[:len(take)]
                    fill(take, rows)
                    for b, i in zip(rows, take):
                        owner[b] = i
                    lmax = max(lmax, max(len(prompts[i]) for i in take))
            if all(o is None for o in owner):
                return res
            step(self.sync_every, lmax)

    @torch.no_grad()
    def time_forwards(self, proposer: DraftModel | None, tree: TreeSpec | None, batch: int = 1,
                      context: int = 256, repeats: int | None = None,
                      span: int | None = None) -> dict:
        """Milliseconds of one target forward over 1 token (a plain step), over N+1 tokens (a
        verification), and of one drafter forward over k frontier tokens (one drafting depth),
        at `batch` rows with `context` tokens in the cache, attending over the span a step there
        reads (or `span`: the new tokens then sit at its end); graph-captured where decoding
        is. Without a proposer: the target forward alone."""
        k, N = (tree.topk, tree.nodes) if proposer is not None else (1, 0)
        extra = self._extra(proposer, tree)
        if span is not None:
            context = max(1, span - extra)
        self._ensure(batch, max(context + extra + 2, span or 0), proposer)
        self.target.set_aux(proposer.aux_layer_ids if proposer is not None else None)
        dev, B = self.device, batch
        span = min(self.cap[1], span or round_up(context + extra, self.span_bucket))
        s = torch.arange(span, device=dev)
        start = torch.zeros(B, dtype=torch.long, device=dev)

        def inputs(T):
            slots = (context + torch.arange(T, device=dev)).expand(B, T)
            return torch.zeros(B, T, dtype=torch.long, device=dev), slots, \
                s[None, None] <= slots[..., None]

        def target_fn(T):
            ids, slots, vis = inputs(T)
            return lambda: self.target.forward(ids, slots, slots, vis, start)

        fns = {"target_ms": target_fn(1)}
        if proposer is not None:
            fns["verify_ms"] = target_fn(N + 1)
            own = getattr(proposer, "time_fns", None)  # a block drafter: draft_ms, markov_ms
            if own is not None:
                fns.update(own(B, span, context, tree.depth))
            else:
                ids_d, slots_d, vis_d = inputs(k)
                fns["draft_ms"] = lambda: proposer.score(1, ids_d, torch.zeros_like(ids_d),
                                                         slots_d, slots_d, vis_d)
        return {name: _time_ms(fn, self.graphs.enabled, repeats) for name, fn in fns.items()}

    def parts_ms(self, proposer: DraftModel | None, tree: TreeSpec | None,
                 spans: dict[str, int], repeats: int | None = None) -> dict:
        """What the steps of a decoding must run, at the shapes they ran at: `spans` is
        last["spans"] ({"BxS": steps}, summed over calls). Each shape's parts are timed
        (time_forwards at its rows and span): a plain step's target forward; a speculative
        step's verification plus depth x one drafter forward. -> {"parts_ms": their mean over
        the steps, "by_shape": {"BxS": [steps, parts ms]}}. A step's time over parts_ms is its
        own logic's share (acceptance, commit, bookkeeping, the host's gaps between replays):
        timed at one context, the parts would leave the longer spans' attention in it. Each
        (proposer, tree, shape) is timed once per Decoder (evaluate meets the same shapes in
        every run of a method)."""
        by, total, n = {}, 0.0, 0
        for at, steps in sorted(spans.items(), key=lambda kv: [int(x) for x in
                                                               kv[0].split("x")]):
            key = (proposer, tree, at)
            if key not in self._parts:
                B, S = (int(x) for x in at.split("x"))
                t = self.time_forwards(proposer, tree, batch=B, span=S, repeats=repeats)
                self._parts[key] = round(t["target_ms"] if proposer is None else
                                         t["verify_ms"] + draft_parts(t, tree.depth), 4)
            ms = self._parts[key]
            by[at] = [steps, ms]
            total, n = total + steps * ms, n + steps
        return {"parts_ms": round(total / n, 4) if n else None, "by_shape": by}

    def _collect(self, st, rows, max_new, stop_ids, spec=False, record_gaps=False
                 ) -> list[Output]:
        """The outputs of state rows `rows` (a range for a whole batch): the tokens up to the
        first stop token (kept), at most max_new."""
        idx = torch.as_tensor(list(rows), device=self.device)
        n_out, out, steps = (t[idx].tolist() for t in (st.n_out, st.out, st.steps))
        hist = st.hist[idx].tolist() if spec else None
        stats = st.stats[idx].tolist() if spec and st.stats is not None else None
        shapes = st.shapes[idx].tolist() if spec and st.shapes is not None else None
        gaps, second = (st.gap[idx].tolist(), st.second[idx].tolist()) if record_gaps else \
            (None, None)
        stops = set(stop_ids)
        res = []
        for j in range(len(idx)):
            toks = out[j][: min(n_out[j], max_new)]
            cut = next((i for i, t in enumerate(toks) if t in stops), None)
            toks = toks if cut is None else toks[: cut + 1]
            n = len(toks)
            res.append(Output(toks, "stop" if cut is not None else "length", steps[j],
                              hist[j] if spec else None, gaps[j][:n] if record_gaps else None,
                              second[j][:n] if record_gaps else None,
                              shapes[j] if shapes is not None else None,
                              stats[j] if stats is not None else None))
        return res

    def _padded(self, prompts, Tp) -> tuple[Tensor, Tensor]:
        """Prompts left-padded to Tp: ids [B, Tp] and each row's first slot, start [B]."""
        ids = torch.tensor([[0] * (Tp - len(p)) + p for p in prompts]).to(self.device)
        return ids, torch.tensor([Tp - len(p) for p in prompts]).to(self.device)

    def _chunks(self, ids, start):
        """The prefill of left-padded ids [B, Tp] in chunks of about prefill_tokens / B tokens:
        yields (c0, c1, pos, slots [B, C], vis [B, C, c1]); pad queries see their own slot."""
        B, Tp = ids.shape
        s = torch.arange(Tp, device=ids.device)
        chunk = max(1, self.prefill_tokens // B)
        for c0 in range(0, Tp, chunk):
            c1 = min(Tp, c0 + chunk)
            slots = torch.arange(c0, c1, device=ids.device).expand(B, -1)            # [B, C]
            pos = (slots - start[:, None]).clamp(min=0)
            sk = s[None, None, :c1]
            vis = ((sk >= start[:, None, None]) & (sk <= slots[..., None])) \
                | (sk == slots[..., None])
            yield c0, c1, pos, slots, vis

    def _prefill(self, st, prompts, Tp, temperature, top_p, proposer, record_gaps, rows=None):
        """Left-padded chunks through the target (eager attention: the shapes vary); the first
        new token; the drafter reads the prompt too (position t: aux[t] and token t+1). `rows`:
        the state and cache rows these prompts take, the other rows untouched (continuous
        batching's refill, eager); None: rows 0..B-1, the whole batch (its state zeroed before),
        replayed from a graph per (B, Tp) where `_graphed`. Timed into last["prefill_seconds"]
        (to its end on the GPU; a graph's capture not counted, as the steps' is not)."""
        t0, cap0 = time.perf_counter(), self.graphs.capture_seconds
        B = len(prompts)
        ids, start = self._padded(prompts, Tp)                                       # [B, Tp]
        with eager_attention():
            if rows is None and self._graphed(B, Tp):
                if (B, Tp) not in self._prefill_in:
                    self._prefill_in[(B, Tp)] = (torch.zeros_like(ids), torch.zeros_like(start))
                ids_in, start_in = self._prefill_in[(B, Tp)]
                ids_in.copy_(ids)
                start_in.copy_(start)
                key = ("prefill", id(st), Tp, temperature, top_p, id(proposer),
                       self.target.aux_ids, record_gaps)
                self.graphs.run(key, lambda: self._prefill_rows(
                    st, ids_in, start_in, temperature, top_p, proposer, record_gaps, None),
                    self._graph_state(st, proposer))
            else:
                self._prefill_rows(st, ids, start, temperature, top_p, proposer, record_gaps,
                                   rows)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last["prefill_seconds"] += time.perf_counter() - t0 \
            - (self.graphs.capture_seconds - cap0)

    def _prefill_rows(self, st, ids, start, temperature, top_p, proposer, record_gaps, rows):
        """_prefill's work on left-padded ids [B, Tp] from slots start [B] (eager attention on,
        untimed)."""
        (B, Tp), dev, tgt = ids.shape, self.device, self.target
        r = None if rows is None else torch.as_tensor(rows, device=dev)
        if r is not None:
            for t in st.tensors():
                t.index_fill_(0, r, 0)

        def put(t, v):  # these rows of state tensor t <- v [B, ...]
            if r is None:
                t.copy_(v)
            else:
                t.index_copy_(0, r, v)

        put(st.start, start)
        put(st.L, torch.full_like(start, Tp))
        s = torch.arange(Tp, device=dev)
        last_aux = logits = None
        with self._rows(r, proposer):
            for c0, c1, pos, slots, vis in self._chunks(ids, start):
                logits, aux = tgt.forward(ids[:, c0:c1], pos, slots, vis, start,
                                          logits_to_keep=1)
                if proposer is not None:
                    e = min(c1, Tp - 1) - c0  # the last prompt position waits for the first token
                    if e > 0:
                        proposer.observe(ids[:, c0 + 1:c0 + 1 + e],
                                         None if aux is None else aux[:, :e],
                                         pos[:, :e], slots[:, :e], vis[:, :e], None)
                    last_aux = None if aux is None else aux[:, -1:]
            lg = logits[:, -1].float()                                              # [B, V]
            first = pick(lg, temperature, top_p)
            if record_gaps:
                gap, near = runners_up(lg, first)
                put(st.gap[:, 0], gap)   # a column: index_copy_ on its rows writes through
                put(st.second[:, 0], near)
            put(st.pending, first)
            put(st.out[:, 0], first)
            put(st.n_out, torch.ones_like(first))
            put(st.finished, (first[:, None] == st.stop).any(-1) | (st.max_new <= 1))
            if proposer is not None:
                slots = torch.full((B, 1), Tp - 1, device=dev)
                vis = ((s >= start[:, None]) | (s == Tp - 1))[:, None, :]            # [B, 1, Tp]
                root = proposer.observe(first[:, None], last_aux, slots - start[:, None], slots,
                                        vis, torch.zeros(B, dtype=torch.long, device=dev))
                put(st.root, root.float())

    @contextlib.contextmanager
    def _rows(self, r, proposer):
        """The target's and the drafter's caches write rows r only (None: rows 0..B-1)."""
        if r is None:
            yield
            return
        self.target.cache.rows = r
        if proposer is not None:
            proposer.rows = r
        try:
            yield
        finally:
            self.target.cache.rows = None
            if proposer is not None:
                proposer.rows = None

    def _commit(self, st, emitted, n_acc, bonus, root=None):
        """Shared tail of both steps: emitted [B, J] tokens of which n_acc + 1 are new."""
        B, J = emitted.shape
        active = ~st.finished
        j = torch.arange(J, device=emitted.device)
        new = j[None] <= n_acc[:, None]
        stop = (emitted[..., None] == st.stop).any(-1) & new                       # [B, J]
        has_stop = stop.any(1)
        n_emit = torch.where(has_stop, stop.int().argmax(1), n_acc) + 1
        col = st.n_out[:, None] + j
        col = torch.where((j[None] < n_emit[:, None]) & active[:, None], col, st.W - 1)
        st.out.scatter_(1, col, emitted)
        st.hist.scatter_add_(1, n_acc.clamp(max=st.hist.shape[1] - 1)[:, None],
                             active.long()[:, None])
        st.steps.add_(active.long())
        st.n_out.add_(n_emit * active)
        st.L.add_((n_acc + 1) * active)
        st.pending.copy_(torch.where(active, bonus, st.pending))
        if root is not None:
            st.root.copy_(torch.where(active[:, None], root.float(), st.root))
        st.finished.copy_(st.finished | (active & (has_stop | (st.n_out >= st.max_new))))

    def _plain_step(self, st, span, temperature, top_p, record_gaps):
        dev = self.device
        s = torch.arange(span, device=dev)
        L, start = st.L, st.start
        vis = ((s[None] >= start[:, None]) & (s[None] <= L[:, None]))[:, None]      # [B, 1, S]
        logits, _ = self.target.forward(st.pending[:, None], (L - start)[:, None], L[:, None],
                                        vis, start)
        lg = logits[:, -1].float()
        nxt = pick(lg, temperature, top_p)
        if record_gaps:
            gap, near = runners_up(lg, nxt)
            col = torch.where(st.finished, st.W - 1, st.n_out)[:, None, None].expand(-1, 1, NEAR)
            st.gap.scatter_(1, col, gap[:, None])
            st.second.scatter_(1, col, near[:, None])
        self._commit(st, nxt[:, None], torch.zeros_like(nxt), nxt)

    def _chain_step(self, st, span, P, K: int, temperature: float):
        """A chain of K (what engines serve and evaluate's first run): the tree step's
        arithmetic on TreeSpec.chain(K) with one child per node written out. The general step
        spends hundreds of small kernels a step on ancestor matrices, candidate top-k, sort and
        path gathers that a chain does not need. Greedy: the same drafts, cache
        writes and accepted tokens as the general step (tests/test_decode.py compares them);
        sampling: the same distribution (verify_chain_sample, or `chain_verify`: block
        verification), another draw of it."""
        dev, tgt, B = self.device, self.target, st.B
        L, start = st.L, st.start
        s = torch.arange(span, device=dev)
        committed = (s[None] >= start[:, None]) & (s[None] < L[:, None])            # [B, S]
        rel = (s[None] - L[:, None])[:, None]                                       # [B, 1, S]
        pos = (L - start)[:, None]                                                  # [B, 1]
        first = torch.zeros(B, 1, dtype=torch.long, device=dev)       # each node's parent: 0

        def draw(lg):  # [B, Vd] -> draft id [B, 1], the log-sum-exp [B] of lg / T (sampling)
            if temperature == 0:
                return lg.argmax(-1, keepdim=True), None
            ids, _, lse = sampled_children(lg, 1, temperature)
            return ids, lse

        # sampling: the rows drawn from, in the drafter's dtype (verification reads these)
        root = st.root if temperature == 0 else st.root.to(tgt.dtype)
        tok, lse = draw(root)
        drafts, rows, lses = [tok], [root[:, None]], [lse]
        for i in range(1, K):  # node i in the drafter's slot L + i - 1 sees the nodes before it
            lg = P.score(i, P.to_target(tok), first, pos + i - 1, L[:, None] + i - 1,
                         committed[:, None] | ((rel >= 0) & (rel < i)))             # [B, 1, Vd]
            tok, lse = draw(lg[:, 0] if temperature else lg[:, 0].float())
            drafts.append(tok)
            rows.append(lg)
            lses.append(lse)
        d_ids = torch.cat(drafts, 1)                                                # [B, K]
        toks = P.to_target(d_ids)
        j = torch.arange(K + 1, device=dev)
        vis = committed[:, None] | ((rel >= 0) & (rel <= j[None, :, None]))         # [B, K+1, S]
        logits, aux = tgt.forward(torch.cat([st.pending[:, None], toks], 1), pos + j,
                                  L[:, None] + j, vis, start)
        if temperature == 0:
            y = logits.argmax(-1)                                                   # [B, K+1]
            n_acc = (toks == y[:, :K]).long().cumprod(1).sum(1)                     # [B]
            bonus = y.gather(1, n_acc[:, None]).squeeze(1)
        else:
            q = DraftQ(torch.cat(rows, 1), torch.stack(lses, 1), temperature)  # [B, K, Vd]
            n_acc, bonus = (self.chain_verify or verify_chain_sample)(
                d_ids, logits, q, P.to_target(torch.arange(q.rows.shape[-1], device=dev)),
                temperature)
        emitted = torch.cat([toks, bonus[:, None]], 1).scatter(1, n_acc[:, None], bonus[:, None])
        # the drafter reads the committed tokens (past n_acc: slots the next step overwrites)
        root = P.observe(emitted, aux, pos + j, L[:, None] + j, vis, n_acc)
        self._commit(st, emitted, n_acc, bonus, root)

    def _spec_step(self, st, span, P, tree: TreeSpec, temperature):
        own = getattr(P, "step", None)  # a block drafter's step (drafter.decoding.dspark)
        if own is not None:
            return own(self, st, span, tree.depth, temperature)
        if tree.is_chain and self.fast_chain:
            return self._chain_step(st, span, P, tree.depth, temperature)
        dev, tgt = self.device, self.target
        B, D, k, N = st.B, tree.depth, tree.topk, tree.nodes
        L, start = st.L, st.start
        s = torch.arange(span, device=dev)
        committed = (s[None] >= start[:, None]) & (s[None] < L[:, None])            # [B, S]
        fvis = None
        slots1 = L[:, None] + torch.arange(k, device=dev)          # [B, k] depth 1's; then + k
        pos1 = (L - start)[:, None].expand(B, k)                   # depth 1's position; then + 1

        def scorer(i, ids, parent):  # frontier at depth i: slots L + (i-1)k + r, position L+i-1
            nonlocal fvis  # what each frontier node sees: the committed slots and its ancestors'
            slots = slots1 + (i - 1) * k if i > 1 else slots1                      # [B, k]
            own = s[None, None] == slots[..., None]                                 # [B, k, S]
            fvis = own | (committed[:, None] if i == 1 else
                          fvis.gather(1, parent[..., None].expand(B, k, span)))
            return P.score(i, P.to_target(ids), parent, pos1 + (i - 1) if i > 1 else pos1,
                           slots, fvis)

        # sampling: the root's logits in the drafter's dtype, as verification reads them
        draft = build_tree(st.root if temperature == 0 else st.root.to(tgt.dtype), scorer,
                           tree, temperature)
        toks = P.to_target(draft.tokens)                                            # [B, N]
        parent_full = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), draft.parent], 1)
        depth_full = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), draft.depth], 1)
        anc = ancestors(parent_full, D)                                             # [B, N+1, N+1]
        ids = torch.cat([st.pending[:, None], toks], 1)                             # [B, N+1]
        slots = L[:, None] + torch.arange(N + 1, device=dev)
        rel = s[None] - L[:, None]                                                  # [B, S]
        tree_vis = anc.gather(2, rel.clamp(0, N)[:, None].expand(B, N + 1, span)) \
            & ((rel >= 0) & (rel <= N))[:, None]
        logits, aux = tgt.forward(ids, (L - start)[:, None] + depth_full, slots,
                                  committed[:, None] | tree_vis, start)
        if temperature > 0:
            t_ids = P.to_target(torch.arange(draft.q.rows.shape[-1], device=dev))
            path, n_acc, bonus = verify_sample(draft.tokens, parent_full, draft.valid,
                                               depth_full, anc, logits, draft.q, draft.dist,
                                               t_ids, temperature, D, k)
        else:
            path, n_acc, bonus = verify_greedy(toks, parent_full, draft.valid, depth_full, anc,
                                               logits, D)
            if st.shapes is not None:  # tree_stats: this step's acceptance by smaller trees
                acc, ok = shape_acceptance(draft.rank, draft.depth, path, n_acc)
                ok = ok & ~st.finished[:, None, None]
                st.shapes.add_(torch.stack([acc * ok, ok.long()], 1))
        j = torch.arange(D + 1, device=dev)
        if not tree.is_chain:  # a chain's accepted tokens already sit in slots L..L+n_acc
            tgt.cache.copy_slots(L[:, None] + path, L[:, None] + j)
        emitted = torch.cat([ids.gather(1, path)[:, 1:], bonus[:, None]], 1)        # [B, D+1]
        emitted = emitted.scatter(1, n_acc[:, None], bonus[:, None])
        # the drafter reads the committed tokens with the target's own aux states
        slots_o = L[:, None] + j
        vis_o = committed[:, None] | ((s[None, None] >= L[:, None, None])
                                      & (s[None, None] <= slots_o[..., None]))
        a = aux.gather(1, path[:, :, None, None].expand(B, D + 1, *aux.shape[2:])) \
            if aux is not None else None
        root = P.observe(emitted, a, slots_o - start[:, None], slots_o, vis_o, n_acc)
        self._commit(st, emitted, n_acc, bonus, root)


def _time_ms(fn, graphs: bool, repeats: int | None) -> float:
    """Mean milliseconds of fn(): replayed from a CUDA graph when `graphs`."""
    if torch.cuda.is_available() and graphs:
        repeats = repeats or 50
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run = g.replay
        except Exception:  # noqa: BLE001  (timed eagerly instead)
            torch.cuda.synchronize()
            run = fn
        run()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(repeats):
            run()
        t1.record()
        torch.cuda.synchronize()
        return t0.elapsed_time(t1) / repeats
    repeats = repeats or (50 if torch.cuda.is_available() else 1)
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1000 / repeats


def draft_parts(t: dict, depth: int) -> float:
    """A step's drafting from time_forwards' figures t: depth drafter forwards, or a block
    drafter's one forward and depth Markov positions."""
    if "markov_ms" in t:
        return t["draft_ms"] + depth * t["markov_ms"]
    return depth * t["draft_ms"]


def acceptance_stats(hist: Sequence[int]) -> dict:
    """From hist[a] = speculative steps that accepted a draft tokens (a = 0..D): tau (tokens per
    target forward, bonus counted), accepted, per-position acceptance unconditional (P[a >= i])
    and conditional (P[a >= i | a >= i-1]), i = 1..D."""
    steps = int(sum(hist))
    D = len(hist) - 1
    reached = [int(sum(hist[i:])) for i in range(D + 1)]                           # a >= i
    accepted = int(sum(a * n for a, n in enumerate(hist)))
    return {
        "steps": steps,
        "accepted": accepted,
        "tau": (accepted + steps) / steps if steps else None,
        "acceptance": [reached[i] / steps if steps else None for i in range(1, D + 1)],
        "acceptance_conditional": [reached[i] / reached[i - 1] if reached[i - 1] else None
                                   for i in range(1, D + 1)],
    }


def stop_ids_of(tokenizer, model=None) -> list[int]:
    """End-of-text ids: the tokenizer's eos plus the generation config's eos ids."""
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    for e in ([eos] if isinstance(eos, int) else list(eos or [])):
        ids.add(int(e))
    return sorted(ids)
