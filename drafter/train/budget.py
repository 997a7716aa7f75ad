"""The run's disk budget (max_disk_gib; docs/extract.md, "Bounded disk"): what a run in chunks
keeps besides its chunks, bounded from the config before anything loads.

    dshape = memory.drafter_shape(cfg, target_config)
    held = budget.held(cfg, dshape, data_bytes(run), total_steps, ht)  # {"data",
                    # "checkpoints", "checkpoint_bytes", "checkpoint_count", "export", "logs",
                    # "engine_states", "total"}

Everything the run stores lies within the budget: the data steps' folders (prepare, generate,
tokenize, vocab: measured, they are done before extract), extract's val shards and head
(spool.stored_bytes; bounded by spool.chunk_bytes and `head_bound` before extract ran), train's
checkpoints, the export, the logs, vLLM's states of one call (extract.engine vllm: read and
deleted as it goes), and the spool's chunks, which get what is left (drafter/train/chunks.py).
The checkpoints at once: train.keep_checkpoints regular ones, the best by validation, the
newest one at a chunk's end (what a resume needs: pruned once a newer one is written), and the
one being written. The target's weights (its cache, outside the run dir) are not in it.
"""
from __future__ import annotations

import math

from drafter import DrafterError
from drafter.core.rundir import dir_bytes

GiB = 1 << 30
# per checkpoint beyond its tensors: safetensors and pickle headers, rng, state.json (a few
# metric records), drafter_config.json, COMPLETE
CHECKPOINT_OVERHEAD = 1 << 20
# per exported folder beyond its weights: header, config, README, drafter.json
EXPORT_OVERHEAD = 1 << 20
# per metrics record (train/metrics.jsonl, TensorBoard): one JSON line of a few hundred bytes
RECORD_BYTES = 4096
# manifests, started.json, config.yaml, logs, evaluate's report and plots
LOG_SLACK = 16 << 20
# the steps whose folders hold the run's data when extract starts
DATA_STEPS = ("prepare", "generate", "tokenize", "vocab")


class BudgetError(DrafterError):
    """The budget cannot hold the run: the message names max_disk_gib and the value that can."""


def checkpoint_bytes(dshape: dict) -> int:
    """At most one checkpoint's bytes: fp32 trainable weights and their two AdamW moments, the
    frozen embedding at the dtype train holds it (drafter_shape's embed_bytes)."""
    frozen = dshape["total"] - dshape["trainable"]
    return dshape["trainable"] * 12 + frozen * dshape.get("embed_bytes", 4) + CHECKPOINT_OVERHEAD


def export_bytes(cfg, dshape: dict) -> int:
    """At most the export's bytes: native and speculators folders, each every weight at
    export.dtype with d2t (int64) and t2d (one byte per target token)."""
    per = {"float32": 4}.get(cfg.export.dtype, 2)
    vocab = (dshape["total"] - dshape["trainable"]) // max(dshape["hidden_size"], 1)
    one = dshape["total"] * per + dshape["draft_vocab_size"] * 8 + vocab + EXPORT_OVERHEAD
    return 2 * one


def logs_bytes(cfg, steps: int) -> int:
    tc = cfg.train
    records = steps // tc.log_every + (steps // tc.eval_every if tc.eval_every else 0) \
        + steps // tc.save_every + 2
    return records * RECORD_BYTES * (2 if tc.tensorboard else 1) + LOG_SLACK


def checkpoint_count(cfg) -> int:
    """Checkpoints on disk at once in a run in chunks (module docstring)."""
    return cfg.train.keep_checkpoints + 3


def data_bytes(run) -> int:
    """The data steps' folders as they are (fixed once those steps are done)."""
    return sum(dir_bytes(run.step_dir(s)) for s in DATA_STEPS)


def engine_states_bytes(cfg, n_aux: int, ht: int) -> int:
    """extract.engine vllm: at most one call's states as vLLM writes them under
    extract/.engine-states before drafter reads and deletes them ([T, layers + 1, Ht], float32
    at most, extract.batch_tokens tokens)."""
    return cfg.extract.batch_tokens * (n_aux + 1) * ht * 4 if cfg.extract.engine == "vllm" \
        else 0


def held(cfg, dshape: dict, data: int, steps: int, ht: int) -> dict:
    """What the run keeps besides extract's val and head and the spool (module docstring);
    `ht` the target's hidden size."""
    ck = checkpoint_bytes(dshape)
    out = {"data": int(data), "checkpoint_bytes": ck, "checkpoint_count": checkpoint_count(cfg),
           "checkpoints": ck * checkpoint_count(cfg), "export": export_bytes(cfg, dshape),
           "logs": logs_bytes(cfg, steps),
           "engine_states": engine_states_bytes(cfg, len(dshape["layer_ids"]), ht)}
    out["total"] = sum(out[k] for k in ("data", "checkpoints", "export", "logs",
                                        "engine_states"))
    return out


def held_of(cfg, run, steps: int) -> dict:
    """`held` of this config's run: its drafter's shape from the target's config, its data
    folders as they are."""
    from drafter.core import target
    from drafter.train.memory import drafter_shape

    tconf = target.load_config(cfg.target)
    return held(cfg, drafter_shape(cfg, tconf), data_bytes(run), steps, target.hidden_size(tconf))


def head_bound(draft_vocab: int, hidden: int) -> int:
    """At most head.safetensors: the draft vocab's lm_head rows (float32 at most) and its
    header."""
    return draft_vocab * hidden * 4 + (64 << 10)


def gib_at_least(n: float) -> str:
    """A max_disk_gib value of at least n bytes as the config reads it (int(value * GiB)):
    whole GiB from 10 up, else thousandths."""
    step = 1 if n >= 10 * GiB else 1000
    k = math.ceil(n / GiB * step)
    while int(k / step * GiB) < n:
        k += 1
    return f"{k:,}" if step == 1 else f"{k / step:g}"


def gib_at_most(n: float) -> str | None:
    """A max_disk_gib value of at most n bytes (gib_at_least's form), None below 0.001."""
    step = 1 if n >= 10 * GiB else 1000
    k = math.floor(n / GiB * step)
    while k > 0 and k / step * GiB > n:
        k -= 1
    return None if k <= 0 else f"{k:,}" if step == 1 else f"{k / step:g}"


def describe(budget: int, stored: int, h: dict, reserve: int) -> str:
    """Where the budget goes besides the chunks, for an error or the plan."""
    from drafter.features.spool import size

    return (f"{size(budget)} holds data {size(h['data'])}, val and head {size(stored)}, "
            f"{h['checkpoint_count']} checkpoints of {size(h['checkpoint_bytes'])} "
            f"(train.keep_checkpoints + the best + the newest at a chunk's end + one being "
            f"written), the export {size(h['export'])}, logs {size(h['logs'])}"
            + (f", vLLM's states of a call {size(h['engine_states'])}" if h["engine_states"]
               else "") + f" and the spool's own files {size(reserve)}")
