"""Features stored in chunks (max_disk_gib), as each command runs them
(docs/extract.md, "Bounded disk: chunks and the spool"):

- `drafter run CONFIG` with train among its steps: one process. Extract's step stores val and
  the head; train's step then makes each chunk itself before training it (`in_process`: the
  spool's producer lock, and steps/extract.py's ChunkProducer with `release`, so that the target
  lets the GPUs go while the drafter trains), deletes it once a checkpoint covers it, and goes on.
- `drafter train CONFIG`: the same in one process when extract.spool is null; with a spool,
  train consumes the chunks another process makes (drafter/train/chunks.py waits for each).
- `drafter extract CONFIG` (or `drafter run CONFIG --until extract`) with extract.spool: after
  the step, this process fills the spool for that train (`produce`), outside the run dir's lock
  (train holds it: both share the run dir) and under the spool's own.
"""
from __future__ import annotations

import contextlib
import logging
import time

from drafter.core.dist import rank_world
from drafter.core.rundir import Run
from drafter.features import spool

log = logging.getLogger("drafter")


def chunked(cfg) -> bool:
    return cfg.max_disk_gib is not None and not cfg.train.online


@contextlib.contextmanager
def in_process(cfg):
    """`produce(chunk, plan_id)` for train's step: makes a chunk in this process; the target
    is loaded at the first chunk and closed at the end."""
    from drafter.steps import extract

    prod = None

    def produce(chunk: dict, plan_id: str) -> None:
        nonlocal prod
        if prod is None:
            prod = extract.ChunkProducer(cfg, release=True)
            produce.stats = prod.stats  # train's manifest: loads, wakes, their seconds
        prod.make(chunk, plan_id)

    produce.stats = {}

    lock = spool.producer_lock(Run.of(cfg)) if rank_world()[0] == 0 \
        else contextlib.nullcontext()
    with lock:
        try:
            yield produce
        finally:
            if prod is not None:
                prod.close()


@contextlib.contextmanager
def train_here(cfg, step: str, here: bool):
    """run_step's keyword arguments for `step`: train's `produce` (in_process) where this
    process makes train's chunks (`here`), none otherwise."""
    if step != "train" or not here or not chunked(cfg):
        yield {}
        return
    from drafter.run.preflight import preflight

    preflight(cfg, Run.of(cfg), step)  # before the lock makes the spool (run_step's own: after)
    with in_process(cfg) as produce:
        yield {"produce": produce}


def produces_after(cfg, steps: list[str]) -> bool:
    """Whether a command whose last step is extract goes on filling the spool."""
    return chunked(cfg) and cfg.extract.spool is not None and steps[-1] == "extract"


def produce(cfg) -> dict:
    """The spool's producer: every chunk a `drafter train` with the same config needs, in its
    order, while the spool has room (spool.serve), until train has them all; the target stays
    loaded meanwhile. Returns the figures: chunks made and removed, loads, seconds waited."""
    from drafter.steps import extract

    t0 = time.time()
    run = Run.of(cfg)
    prod = extract.ChunkProducer(cfg, release=False)
    try:
        with spool.producer_lock(run) if prod.d.main else contextlib.nullcontext():
            log.info("extract: filling %s for train (budget %s)", run.spool(),
                     spool.size(cfg.max_disk_gib * spool.GiB))
            out = spool.serve(run, prod.make, int(cfg.max_disk_gib * spool.GiB), prod.d)
    finally:
        prod.close()
    out.update(prod.stats, seconds_total=round(time.time() - t0, 1))
    log.info("extract: the spool's producer is done: %d chunks made, %d removed, %d loads, "
             "waited %.0f s", len(out["made"]), len(out["removed"]), out["loads"],
             out["waited_s"])
    return out
