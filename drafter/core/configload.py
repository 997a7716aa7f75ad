"""The machinery behind `drafter.core.config.load`: from plain YAML values to a checked config.

- `Where`: the YAML line table, so an error names the file:line (or the override) of a key.
- `build`: plain values into the annotated dataclass fields, refusing unknown keys and wrong
  types (`_coerce` follows the annotations: unions, Literal, list, dict, nested sections).
- `retire`: keys removed and values renamed, each an error naming what drafter does now.
- `parse_override`, `apply_override`: dotted overrides (`train.lr=3e-4`, `prepare.sources[0].x=1`).
- `derive`: values computed from others (generate.extra_temperatures: evaluate).
- `check_values`: every value's range and the rules between fields.

It knows the schema only through the dataclasses it is handed and the dotted keys its rules
name; the schema itself and the entry points (`load`, `where`, `dump`, ...) are in config.py.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from drafter import DrafterError


class ConfigError(DrafterError, ValueError):
    """A bad config: the message names the file, line and dotted key."""


# ------------------------------------------------------------------------------ types and overrides
class Where:
    """Maps dotted keys to 'file:line' from the YAML node marks."""

    def __init__(self, file: str | None, node: yaml.Node | None):
        self.file = file or "<overrides>"
        self.lines: dict[str, int] = {}
        self.overrides: dict[str, str] = {}   # dotted key -> the override that set it
        if node is not None:
            self._walk(node, "")

    def _walk(self, node, prefix):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}{k.value}"
                self.lines[key] = k.start_mark.line + 1
                self._walk(v, key + ".")
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                key = f"{prefix.rstrip('.')}[{i}]"
                self.lines[key] = v.start_mark.line + 1
                self._walk(v, key + ".")

    def __call__(self, key: str) -> str:
        # the last override that set this key or a section above it wins over the file
        for k in sorted(self.overrides, key=len, reverse=True):
            if key == k or key.startswith((k + ".", k + "[")):
                return f"override '{self.overrides[k]}'"
        # a key the file does not set: the nearest section or list item above it that it does
        parts = key
        while parts and parts not in self.lines:
            cut = max(parts.rfind("."), parts.rfind("["))
            parts = parts[:cut] if cut > 0 else ""
        line = self.lines.get(parts)
        return f"{self.file}:{line}" if line else self.file


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, where: Where) -> Any:
    """Check `value` against the annotation `tp`; return it converted (dicts -> dataclasses)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key, where)
            except ConfigError as e:
                errors.append(e)
        raise errors[0] if len(errors) == 1 else ConfigError(
            f"{where(key)}: {key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where(key)}: {key}: must be one of {list(args)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where(key)}: {key}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]", where) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where(key)}: {key}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if dataclasses.is_dataclass(value):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where(key)}: {key}: expected a mapping, got {value!r}")
        return build(tp, value, key, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where(key)}: {key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where(key)}: {key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where(key)}: {key}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{where(key)}: {key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where(key)}: {key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where(key)}: {key}: unsupported type {tp}")


def build(cls, data: dict, prefix: str, where: Where):
    """An instance of the dataclass `cls` from a plain dict, each value checked against its
    field's annotation; an unknown key is an error that suggests the closest field name."""
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            close = difflib.get_close_matches(str(k), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            section = f"section '{prefix}'" if prefix else "the top level"
            raise ConfigError(f"{where(key)}: unknown key '{key}' in {section}{hint}")
        kwargs[k] = _coerce(v, hints[k], key, where)
    return cls(**kwargs)


def retire(data: dict, removed: dict[str, str], renamed: dict[tuple[str, str], tuple[str, str]],
           where: Where, strict: bool, moved: dict[str, tuple[str, str]] | None = None) -> dict:
    """`data` (a config's plain values) without the `removed` keys ({dotted key: why}), the
    `renamed` values ({(dotted key, old value): (new value, what it names)}) and the `moved`
    keys ({old dotted key: (new dotted key, why)}): an error naming the first one and where it
    is set when `strict`, else (a run dir's snapshot an older drafter wrote) the key dropped,
    the value read as the new one, the moved key's value set at its new place."""
    def section(dotted):
        *path, name = dotted.split(".")
        d = data
        for part in path:
            d = d.get(part) if isinstance(d, dict) else None
        return (d, name) if isinstance(d, dict) else (None, name)

    for dotted, why in removed.items():
        d, name = section(dotted)
        if d is not None and name in d:
            if strict:
                raise ConfigError(f"{where(dotted)}: {dotted}: no longer a key, leave it out: "
                                  f"{why}")
            del d[name]
    for dotted, (new, why) in (moved or {}).items():
        d, name = section(dotted)
        if d is not None and name in d:
            if strict:
                raise ConfigError(f"{where(dotted)}: {dotted}: moved to {new}: set {new} "
                                  f"instead ({why})")
            value = d.pop(name)
            dest, new_name = section(new)
            if dest is not None and new_name not in dest:
                dest[new_name] = value
    for (dotted, old), (new, what) in renamed.items():
        d, name = section(dotted)
        if d is not None and d.get(name) == old:
            if strict:
                raise ConfigError(f"{where(dotted)}: {dotted}: {old} is now called {new} "
                                  f"({what})")
            d[name] = new
    return data


def apply_override(data: dict, keys: list[str], value: Any, text: str) -> dict:
    """Apply one override to the plain-dict config. A key part `name[i]` indexes a list
    (`prepare.sources[0].max_samples=10`); plain parts create or replace mapping entries."""
    node: Any = data
    for n, part in enumerate(keys):
        m = re.fullmatch(r"([^\[\]]+)\[(\d+)\]", part)
        last = n == len(keys) - 1
        name = m.group(1) if m else part
        if not isinstance(node, dict):
            raise ConfigError(f"override '{text}': '{'.'.join(keys[:n])}' is not a section")
        if m:
            seq = node.get(name)
            i = int(m.group(2))
            if not isinstance(seq, list) or i >= len(seq):
                size = len(seq) if isinstance(seq, list) else 0
                raise ConfigError(f"override '{text}': {name} has {size} item(s), no [{i}]")
            if last:
                seq[i] = value
            else:
                node = seq[i]
        elif last:
            node[name] = value
        else:
            if not isinstance(node.get(name), dict):
                node[name] = {}
            node = node[name]
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """'train.lr=3e-4' -> (['train', 'lr'], 0.0003). Values are parsed as YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected key=value, e.g. train.lr=3e-4")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}': empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{text}': value is not valid YAML: {e}") from None
    # YAML reads 3e-4 as a string (no dot): read such numbers as floats.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value.lower() for c in ".e") else value
        except ValueError:
            pass
    return key.split("."), value


def derive(cfg) -> None:
    """Values derived from others, computed once after the overrides (the run dir's snapshot
    and the steps' fingerprints hold the result): generate.extra_temperatures: evaluate ->
    every temperature of evaluate.temperatures but generate.temperature's, in their order."""
    g = cfg.generate
    if g.extra_temperatures == "evaluate":
        own = f"{g.temperature:g}"
        g.extra_temperatures = [float(t) for t in dict.fromkeys(
            f"{t:g}" for t in cfg.evaluate.temperatures) if t != own]


# --------------------------------------------------------------------------- ranges and cross-field
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
_DEVICE = re.compile(r"auto|cpu|mps|(cuda|xpu)(:\d+)?")


def check_values(cfg, where: Where | None = None) -> None:
    """Every value's range and the rules between fields of a `Config`, before anything touches
    a run dir. Raises ConfigError naming the dotted key, where it was set (file:line or the
    override), the value and what it must be. Paths that only a step can judge (a checkpoint, a
    source file) are checked by pipeline.preflight before that step's folder is touched."""
    where = where or Where(None, None)

    def bad(key: str, value: Any, want: str) -> None:
        raise ConfigError(f"{where(key)}: {key}: {want}, got {value!r}")

    def check(key: str, value: Any, ok: bool, want: str) -> None:
        if value is not None and not ok:
            bad(key, value, want)

    def ge(key, value, low):  # None passes: the field's "not set"
        check(key, value, value is None or value >= low, f"must be >= {low}")

    def gt(key, value, low):
        check(key, value, value is None or value > low, f"must be > {low}")

    def within(key, value, low, high, lo_open=False, hi_open=False):
        ok = value is None or ((value > low if lo_open else value >= low)
                               and (value < high if hi_open else value <= high))
        span = f"{'(' if lo_open else '['}{low}, {high}{')' if hi_open else ']'}"
        check(key, value, ok, f"must be in {span}")

    if not cfg.run_dir.strip():
        bad("run_dir", cfg.run_dir, "must name the run directory (an empty one would write "
            "into the current folder)")
    t = cfg.target
    if not t.model.strip():
        bad("target.model", t.model, "must name the target (HF id, folder, .gguf or "
            "builtin:NAME)")
    check("target.device", t.device, bool(_DEVICE.fullmatch(t.device)),
          "must be auto, cpu, cuda or cuda:N")

    p = cfg.prepare
    if not p.sources:
        bad("prepare.sources", p.sources, "must list at least one source")
    for i, src in enumerate(p.sources):
        k = f"prepare.sources[{i}]"
        if src.synthetic is None and not src.path.strip():
            bad(f"{k}.path", src.path, "must name a file, folder, HF dataset or builtin:NAME "
                "(or give the source a `synthetic` section)")
        ge(f"{k}.max_samples", src.max_samples, 1)
        if src.name is not None and not src.name.strip():
            bad(f"{k}.name", src.name, "must not be empty (leave it out for the default)")
        sc = src.synthetic
        if sc is not None:
            for f in ("count", "turns", "max_tokens", "max_attempts"):
                ge(f"{k}.synthetic.{f}", getattr(sc, f), 1)
            ge(f"{k}.synthetic.temperature", sc.temperature, 0)
            within(f"{k}.synthetic.near_dup", sc.near_dup, 0, 1, lo_open=True)
            within(f"{k}.synthetic.min_chars", sc.min_chars, 0, sc.max_chars)
    within("prepare.val_fraction", p.val_fraction, 0, 1, hi_open=True)
    within("prepare.max_bad_fraction", p.max_bad_fraction, 0, 1)

    g, s = cfg.generate, cfg.generate.server
    for f in ("concurrency", "max_tokens", "batch_size"):
        ge(f"generate.{f}", getattr(g, f), 1)
    ge("generate.temperature", g.temperature, 0)
    for i, temp in enumerate(g.extra_temperatures):
        ge(f"generate.extra_temperatures[{i}]", temp, 0)
    temps = [g.temperature, *g.extra_temperatures]
    if len({f"{t:g}" for t in temps}) != len(temps):
        bad("generate.extra_temperatures", g.extra_temperatures,
            f"must differ from each other and from generate.temperature ({g.temperature:g}): "
            f"each temperature answers every conversation once")
    within("generate.top_p", g.top_p, 0, 1, lo_open=True)
    ge("generate.max_retries", g.max_retries, 0)
    ge("generate.retry_backoff", g.retry_backoff, 0)
    gt("generate.request_timeout", g.request_timeout, 0)
    within("generate.server.port", s.port, 0, 65535)
    gt("generate.server.startup_timeout", s.startup_timeout, 0)
    ge("generate.server.stop_timeout", s.stop_timeout, 0)
    ge("generate.server.max_restarts", s.max_restarts, 0)
    ge("generate.server.replicas", s.replicas, 1)
    if g.enabled and s.engine == "external" and not s.urls:
        bad("generate.server.urls", s.urls, "must list the server URLs when "
            "generate.server.engine is external")
    for i, u in enumerate(s.urls):
        check(f"generate.server.urls[{i}]", u, u.startswith(("http://", "https://")),
              "must be an http:// or https:// URL")
    if not is_local_host(s.host) and not s.allow_remote:
        bad("generate.server.host", s.host, "is not localhost: a server bound there serves the "
            "target to anyone who can reach it. Set generate.server.allow_remote: true to mean "
            "it, or use 127.0.0.1")

    ge("tokenize.max_length", cfg.tokenize.max_length, 4)
    ge("tokenize.max_loop_tokens", cfg.tokenize.max_loop_tokens, 0)
    ge("tokenize.loop_copies", cfg.tokenize.loop_copies, 2)
    ge("tokenize.batch_size", cfg.tokenize.batch_size, 1)
    ge("tokenize.workers", cfg.tokenize.workers, 0)
    ge("vocab.draft_vocab_size", cfg.vocab.draft_vocab_size, 1)

    e = cfg.extract
    if e.layer_ids is not None:
        if not e.layer_ids:
            bad("extract.layer_ids", e.layer_ids, "must list layer ids, or be null for the "
                "default [2, N//2, N-3]")
        for i, k in enumerate(e.layer_ids):
            ge(f"extract.layer_ids[{i}]", k, 0)
        if list(e.layer_ids) != sorted(set(e.layer_ids)):
            bad("extract.layer_ids", e.layer_ids, "must be ascending and distinct (vLLM and "
                "SGLang capture each layer once, in layer order: a drafter trained on another "
                "order or on a repeat would read its features permuted)")
    for f in ("topk", "batch_tokens", "shard_tokens"):
        ge(f"extract.{f}", getattr(e, f), 1)
    if e.engine == "vllm" and e.tp:
        bad("extract.tp", e.tp, "must be false with extract.engine=vllm (vLLM shards the "
            "target itself: set target.engine_args.tensor_parallel_size)")
    if e.engine == "vllm" and cfg.train.online:
        bad("train.online", cfg.train.online, "must be false with extract.engine=vllm (online "
            "training runs the target in transformers beside the drafter; vLLM's states are "
            "stored as shards)")
    gt("max_disk_gib", cfg.max_disk_gib, 0)
    if cfg.max_disk_gib is not None and cfg.train.online:
        bad("train.online", cfg.train.online, "must be false with max_disk_gib (chunks store "
            "the features a chunk at a time; online training stores none: drop max_disk_gib)")
    if e.spool is not None and not e.spool.strip():
        bad("extract.spool", e.spool, "must name a folder, or be null for RUN_DIR/chunks")
    if e.spool is not None and cfg.max_disk_gib is None:
        bad("extract.spool", e.spool, "needs max_disk_gib: the spool carries chunks, and their "
            "size follows from the budget")
    owned = {"model", "speculative_config", "kv_transfer_config"} & set(t.engine_args)
    if owned:
        bad(f"target.engine_args.{sorted(owned)[0]}", t.engine_args[sorted(owned)[0]],
            "is set by drafter itself (target.model, the drafter, the hidden-states connector)")

    tr = cfg.train
    for f in ("ttt_steps", "epochs", "grad_accum", "log_every", "save_every", "keep_checkpoints",
              "batch_tokens", "max_steps", "eval_batches", "intermediate_size", "online_group"):
        ge(f"train.{f}", getattr(tr, f), 1)
    ge("train.max_length", tr.max_length, 4)
    gt("train.ttt_decay", tr.ttt_decay, 0)
    gt("train.lr", tr.lr, 0)
    within("train.min_lr_ratio", tr.min_lr_ratio, 0, 1)
    within("train.warmup_ratio", tr.warmup_ratio, 0, 1, hi_open=True)
    ge("train.weight_decay", tr.weight_decay, 0)
    gt("train.grad_clip", tr.grad_clip, 0)
    ge("train.eval_every", tr.eval_every, 0)
    if tr.batch_tokens < tr.max_length:
        bad("train.batch_tokens", tr.batch_tokens, f"must be at least train.max_length "
            f"({tr.max_length}): a micro-batch holds whole rows")
    if tr.loss is not None and not tr.loss:
        bad("train.loss", tr.loss, "must list at least one term, e.g. [{kind: kl}], or be null "
            "for the method's")
    for i, term in enumerate(tr.loss or []):
        k = f"train.loss[{i}]"
        gt(f"{k}.weight", term.weight, 0)
        ge(f"{k}.temperature", term.temperature, 0)
        ge(f"{k}.eta", term.eta, 0)
        if term.kind == "ce" and term.temperature not in (None, 0):
            bad(f"{k}.temperature", term.temperature, "must be left out for ce (the teacher's "
                "argmax: temperature 0); kl at a temperature is the soft cross-entropy there")
    within("train.dpace_alpha", tr.dpace_alpha, 0, 1)
    ge("train.noise", tr.noise, 0)
    gt("train.muon_lr", tr.muon_lr, 0)
    if isinstance(tr.resume, str) and not tr.resume.strip():
        bad("train.resume", tr.resume, "must be auto, off, or a checkpoint path")

    x = cfg.export
    if x.checkpoint not in ("last", "best") and not _looks_like_path(x.checkpoint):
        close = difflib.get_close_matches(x.checkpoint, ["last", "best"], n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        bad("export.checkpoint", x.checkpoint, "must be last, best, or a checkpoint folder "
            f"(a path){hint}")
    ge("export.speculative_tokens", x.speculative_tokens, 1)
    ge("export.max_position_embeddings", x.max_position_embeddings, 1)

    v = cfg.evaluate
    if not v.datasets:
        bad("evaluate.datasets", v.datasets, "must list at least one prompt set")
    for i, d in enumerate(v.datasets):
        if not d.path.strip():
            bad(f"evaluate.datasets[{i}].path", d.path, "must name a JSONL file or builtin:NAME")
        ge(f"evaluate.datasets[{i}].max_prompts", d.max_prompts, 1)
    if not v.methods:
        bad("evaluate.methods", v.methods, "must list chain, tree and/or block")
    for i, m in enumerate(v.methods):
        check(f"evaluate.methods[{i}]", m, m in ("chain", "tree", "block"),
              "must be chain, tree or block")
    for f in ("max_new_tokens", "k", "tree_depth", "tree_topk", "tree_tokens", "batch_size"):
        ge(f"evaluate.{f}", getattr(v, f), 1)
    if not v.temperatures:
        bad("evaluate.temperatures", v.temperatures, "must list at least one temperature")
    for i, temp in enumerate(v.temperatures):
        ge(f"evaluate.temperatures[{i}]", temp, 0)
    ge("evaluate.tie_tolerance", v.tie_tolerance, 0)
    ge("evaluate.prefill_graph_tokens", v.prefill_graph_tokens, 0)
    if not v.drafter.strip():
        bad("evaluate.drafter", v.drafter, "must be export or a drafter folder")

    lc = cfg.learn
    if not lc.drafter.strip():
        bad("learn.drafter", lc.drafter, "must be export or a drafter folder")
    within("learn.sample_rate", lc.sample_rate, 0, 1)
    within("learn.holdout", lc.holdout, 0, 1, lo_open=True, hi_open=True)
    for f in ("max_samples", "round_samples", "eval_prompts"):
        ge(f"learn.{f}", getattr(lc, f), 2 if f == "eval_prompts" else 1)
    gt("learn.max_age_hours", lc.max_age_hours, 0)

    pl = cfg.plan
    for f in ("samples", "tokens_per_sample", "answer_tokens_per_sample", "gpus"):
        ge(f"plan.{f}", getattr(pl, f), 1)
    for f in ("gpu_memory_gib", "gpu_tflops", "gpu_hbm_tbps", "load_gbps", "store_gbps",
              "generate_tokens_per_s", "tokenize_tokens_per_s", "extract_tokens_per_s",
              "train_tokens_per_s", "evaluate_tokens_per_s"):
        gt(f"plan.{f}", getattr(pl, f), 0)
    within("plan.mfu", pl.mfu, 0, 1, lo_open=True)
    within("plan.hbm_efficiency", pl.hbm_efficiency, 0, 1, lo_open=True)


def _looks_like_path(text: str) -> bool:
    """A value meant as a path: it has a separator or names something that exists. A bare
    word such as 'lats' is a typo of a keyword, not a folder next to the current one."""
    return bool(text.strip()) and ("/" in text or text.startswith(("~", ".")) or
                                   Path(text).expanduser().exists())


def is_local_host(host: str) -> bool:
    return host.strip().lower().strip("[]") in LOCAL_HOSTS
