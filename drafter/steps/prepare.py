"""The prepare step: every source in the config -> one canonical conversations file.

Reads   prepare.sources: JSON/JSONL(.gz)/Parquet files, folders, HF datasets, builtin:NAME
        (drafter/data/sources.py reads them and detects each one's format)
Writes  prepare/conversations.jsonl  {id, source, split: train|val, messages, meta?, tools?}
        prepare/rejects.jsonl        per malformed record: source, file, line, reason, detail
Command drafter prepare CONFIG

Order: read every source (malformed records -> rejects) -> seeded shuffle -> exact dedup on the
normalised first user turn (first occurrence wins) -> `max_samples` per source -> seeded
train/validation split. Every record read is accounted for in the counts:
    read = kept + rejected + duplicates + over_max_samples,  rejected = sum of rejected_<reason>.
A source whose share of malformed records exceeds `prepare.max_bad_fraction` fails the step.

Memory: records are staged in an anonymous temp file while reading; only a few numbers per record
(offset, length, source, hash of the dedup key) stay in memory, so 500k conversations are fine.
"""
from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import unicodedata
from array import array
from collections import Counter

import numpy as np
from tqdm import tqdm

from drafter import DrafterError
from drafter.core.config import ConfigError
from drafter.core.rundir import JsonlAppender, Run, atomic_open
from drafter.data.sources import Reject, read_source, source_name

log = logging.getLogger("drafter")


class PrepareError(DrafterError):
    pass


def dedup_key(messages: list[dict]) -> int:
    """64-bit hash of the first user turn, NFKC-normalised with whitespace collapsed."""
    text = next(m["content"] for m in messages if m["role"] == "user")
    norm = " ".join(unicodedata.normalize("NFKC", text).split())
    return int.from_bytes(hashlib.blake2b(norm.encode(), digest_size=8).digest(), "little")


def _check_bad_share(name: str, src_i: int, c: Counter, examples: list[Reject], limit: float,
                     rejects_path) -> None:
    bad, read = c["rejected"], c["read"]
    if read and bad / read > limit:
        lines = "\n".join(f"  {r.where}: {r.reason}: {r.detail}" for r in examples[:5])
        raise PrepareError(
            f"source '{name}' (prepare.sources[{src_i}]): {bad} of {read} records are malformed "
            f"({bad / read:.1%} > prepare.max_bad_fraction={limit}). First ones:\n{lines}\n"
            f"All of them: {rejects_path}")


def main(cfg) -> dict:
    pc = cfg.prepare
    run = Run.of(cfg)
    if not pc.sources:
        raise ConfigError("prepare.sources is empty: list at least one source")
    if not 0.0 <= pc.val_fraction < 1.0:
        raise ConfigError(f"prepare.val_fraction must be in [0, 1), got {pc.val_fraction}")
    names = [source_name(s) for s in pc.sources]
    for i, n in enumerate(names):
        if names.index(n) != i:
            raise ConfigError(f"prepare.sources[{names.index(n)}] and [{i}] are both named '{n}': "
                              f"set `name` on one of them (record ids must be unique)")

    counts: Counter = Counter()
    formats: dict[str, str | None] = {}
    per_source: dict[str, Counter] = {n: Counter() for n in names}
    # Staged records: one JSON line each, cut in two where "split" goes in at the end.
    offsets, lengths, cuts, src_of, keys = (array("q"), array("q"), array("l"), array("l"),
                                            array("Q"))
    answered = array("b")  # the record has an assistant answer
    run.step_dir("prepare").mkdir(parents=True, exist_ok=True)
    staging = tempfile.TemporaryFile(dir=run.step_dir("prepare"), prefix=".staging-")
    pos = 0
    with JsonlAppender(run.rejects(), fsync=False) as rejects, staging:
        for si, (src, name) in enumerate(zip(pc.sources, names)):
            c = per_source[name]
            examples: list[Reject] = []
            notes: Counter = Counter()
            bar = tqdm(read_source(src, pc.require_assistant, notes, name=name),
                       desc=f"prepare {name}", unit=" rec", mininterval=1.0, leave=False)
            for item in bar:
                c["read"] += 1
                if isinstance(item, Reject):
                    c["rejected"] += 1
                    c[f"rejected_{item.reason}"] += 1
                    rejects.write(item.to_dict())
                    if len(examples) < 5:
                        examples.append(item)
                    continue
                head = json.dumps({"id": item.pop("id"), "source": item.pop("source")},
                                  ensure_ascii=False)[:-1].encode()
                tail = json.dumps(item, ensure_ascii=False)[1:].encode()  # '"messages": ...}'
                line = head + b", " + tail + b"\n"
                staging.write(line)
                offsets.append(pos)
                lengths.append(len(line))
                cuts.append(len(head))
                src_of.append(si)
                # synthetic placeholders have no user turn yet: generate dedups what it writes
                keys.append(dedup_key(item["messages"]) if "synthetic" not in item
                            else dedup_key([{"role": "user", "content": head.decode()}]))
                answered.append(any(m["role"] == "assistant" for m in item["messages"]))
                pos += len(line)
            bar.close()
            formats[name] = notes.pop("format", None)
            c.update(notes)
            rejects.f.flush()
            _check_bad_share(name, si, c, examples, pc.max_bad_fraction, run.rejects())
            log.info("prepare: %s: %d read, %d malformed", name, c["read"], c["rejected"])

        n = len(offsets)
        order = np.random.default_rng(pc.seed).permutation(n) if pc.shuffle else np.arange(n)
        seen: set[int] = set()
        kept_per_src = Counter()
        kept = []
        for j in order.tolist():
            name = names[src_of[j]]
            if pc.dedup:
                if keys[j] in seen:
                    per_source[name]["duplicates"] += 1
                    continue
                seen.add(keys[j])
            cap = pc.sources[src_of[j]].max_samples
            if cap is not None and kept_per_src[name] >= cap:
                per_source[name]["over_max_samples"] += 1
                continue
            kept_per_src[name] += 1
            kept.append(j)
        del seen, keys
        if not kept:
            raise PrepareError("prepare: no conversations left after rejects, dedup and "
                               "max_samples; see the counts in the log and " + str(run.rejects()))

        # Exactly round(val_fraction * n) validation records, chosen with their own seeded stream
        # so that toggling the shuffle does not move the split; at least one when asked for any.
        n_val = round(pc.val_fraction * len(kept))
        if pc.val_fraction > 0 and len(kept) >= 2:
            n_val = min(max(n_val, 1), len(kept) - 1)
        val = np.zeros(len(kept), dtype=bool)
        val[np.random.default_rng([pc.seed, 1]).choice(len(kept), n_val, replace=False)] = True

        with atomic_open(run.conversations("prepare"), "wb") as out:
            for k, j in enumerate(tqdm(kept, desc="prepare write", unit=" rec", mininterval=1.0,
                                       leave=False)):
                staging.seek(offsets[j])
                line = staging.read(lengths[j])
                split = b', "split": "val"' if val[k] else b', "split": "train"'
                out.write(line[:cuts[j]] + split + line[cuts[j]:])
                c = per_source[names[src_of[j]]]
                c["val" if val[k] else "train"] += 1
                c["without_answers"] += not answered[j]

    for name, c in per_source.items():
        c["kept"] = kept_per_src[name]
        counts.update(c)
    counts = {k: counts[k] for k in sorted(counts, key=_count_order)}
    assert counts["read"] == counts["kept"] + counts.get("rejected", 0) + \
        counts.get("duplicates", 0) + counts.get("over_max_samples", 0), counts
    if counts.get("without_answers") and not cfg.generate.enabled:
        log.warning("prepare: %d of %d conversations have no assistant answer and "
                    "generate.enabled is false: tokenize will skip them (enable generate, or set "
                    "prepare.require_assistant to reject them here)", counts["without_answers"],
                    counts["kept"])
    log.info("prepare: %d conversations (%d train, %d val) from %d records; %d malformed, "
             "%d duplicates, %d over max_samples", counts["kept"], counts.get("train", 0),
             counts.get("val", 0), counts["read"], counts.get("rejected", 0),
             counts.get("duplicates", 0), counts.get("over_max_samples", 0))
    sources = {}
    for n, s in zip(names, pc.sources):
        c = per_source[n]
        sources[n] = {"path": s.path, "format": formats.get(n),
                      **{k: c[k] for k in sorted(c, key=_count_order)}}
    return {"counts": counts, "sources": sources}


_ORDER = ["read", "kept", "train", "val", "rejected", "duplicates", "over_max_samples",
          "without_answers"]


def _count_order(k: str):
    return (_ORDER.index(k), k) if k in _ORDER else (len(_ORDER), k)
