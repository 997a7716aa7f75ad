"""What only the files can tell about a config, checked before a step touches the run dir.

    preflight(cfg, run, "export")              # raises ConfigError naming the key, or returns

`config.load` checks types, ranges and the rules between fields; this checks what needs the
disk: sources, templates, checkpoints and prompt sets exist, source names are unique, layer ids
fit the target, the engine fits the sources, the target fits the transformers path (extract's
own refusal, capture.refuse_unfit, said before the first step). The pipeline calls it for a
step before its folder, the run dir's config.yaml or its lock is touched, and `drafter run` for
every step before the first one runs (docs/operations.md, "Bad input and damaged files").
"""
from __future__ import annotations

import os
from pathlib import Path

from drafter.core.config import ConfigError, where
from drafter.core.rundir import Run


def preflight(cfg, run: Run, step: str, upfront: bool = False) -> None:
    """Check `step`'s part of the config against the disk; ConfigError names the key and where
    it was set. `upfront` (`drafter run`, before the first step): paths inside the run dir that
    an earlier step of this run makes are not required yet."""
    def bad(key: str, msg: str) -> None:
        raise ConfigError(f"{where(cfg, key)}: {key}: {msg}")

    def later(path: Path) -> bool:  # made by an earlier step of this `drafter run`
        return upfront and run.root.resolve() in path.resolve().parents

    if step == "prepare":
        from drafter.data.sources import BUILTINS, DATA_SUFFIXES, source_name

        names = [source_name(src) for src in cfg.prepare.sources]
        for i, (src, name) in enumerate(zip(cfg.prepare.sources, names)):
            key = f"prepare.sources[{i}]"
            if names.index(name) != i:
                bad(f"{key}.name", f"'{name}' is also the name of prepare.sources"
                    f"[{names.index(name)}]: set `name` on one of them (record ids must be "
                    f"unique)")
            if src.synthetic is not None:
                continue
            if src.path.startswith("builtin:"):
                if src.path.split(":", 1)[1] not in BUILTINS:
                    bad(f"{key}.path", f"unknown builtin '{src.path}'; known: "
                        + ", ".join(f"builtin:{k}" for k in BUILTINS))
                continue
            path = Path(src.path).expanduser()
            local = src.path.startswith((".", "/", "~")) or src.path.endswith(DATA_SUFFIXES) \
                or src.path.count("/") != 1  # org/name is a hub dataset
            if local and not path.exists():
                bad(f"{key}.path", f"{path} not found (a file, a folder, an HF dataset org/name "
                    f"or builtin:NAME)")
    if step == "generate" and cfg.generate.enabled and cfg.generate.server.engine != "drafter":
        for i, src in enumerate(cfg.prepare.sources):
            if src.synthetic is not None:
                bad("generate.server.engine", f"prepare.sources[{i}] is synthetic: the target "
                    f"writes its user turns in-process, which needs engine drafter (now "
                    f"{cfg.generate.server.engine!r})")
    if step in ("generate", "tokenize", "evaluate") and cfg.target.chat_template:
        if not Path(cfg.target.chat_template).expanduser().is_file():
            bad("target.chat_template", f"{cfg.target.chat_template} is not a file")
    if step == "extract" and not cfg.train.online and cfg.extract.engine == "drafter" \
            or step == "train" and cfg.train.online:
        from drafter.core import target
        from drafter.core.dist import read_env
        from drafter.features import capture

        # what extract (or an online train) refuses before loading, said before a run's first
        # step: a MoE under extract.tp, weights above a GPU's memory (UnfitTarget)
        capture.refuse_unfit(cfg.target, target.load_config(cfg.target), cfg.extract.tp,
                             read_env(target.pick_device(cfg.target)))
    if step == "extract" and cfg.extract.layer_ids and not cfg.train.online:
        from drafter.core import target

        n = target.num_layers(target.load_config(cfg.target))
        out = [k for k in cfg.extract.layer_ids if not 0 <= k < n]
        if out:
            bad("extract.layer_ids", f"{out} outside 0..{n - 1} for this {n}-layer target (id "
                f"k = HS[k], the input of layer k)")
    if step in ("extract", "train") and cfg.max_disk_gib is not None and not cfg.train.online:
        for key, msg in chunk_refusals(cfg, run, step, upfront):
            bad(key, msg)
    if step == "train":
        tc = cfg.train
        if tc.attention == "flex":
            import torch

            if not torch.cuda.is_available():
                bad("train.attention", "flex needs a CUDA GPU (FlexAttention has no backward "
                    "on the CPU): use sdpa or auto")
        if isinstance(tc.resume, str) and tc.resume not in ("auto", "off"):
            ckpt = Path(tc.resume).expanduser()
            if not later(ckpt):
                from drafter.train.checkpoint import verify_checkpoint

                why = verify_checkpoint(ckpt, full=False)
                if why is not None:
                    bad("train.resume", f"{ckpt} is not a usable checkpoint ({why})")
    if step == "export" and cfg.export.checkpoint not in ("last", "best"):
        ckpt = Path(cfg.export.checkpoint).expanduser()
        missing = [f for f in ("model.safetensors", "drafter_config.json")
                   if not (ckpt / f).is_file()]
        if missing and not later(ckpt):
            bad("export.checkpoint", f"{ckpt} is not a checkpoint folder (no "
                f"{' or '.join(missing)}); use last, best or a train/step_NNNNNN folder")
    if step == "evaluate":
        ev = cfg.evaluate
        for i, ds in enumerate(ev.datasets):
            if not ds.path.startswith("builtin:") and not Path(ds.path).expanduser().exists():
                bad(f"evaluate.datasets[{i}].path", f"{ds.path} not found")
        for key, spec in (("drafter", ev.drafter), ("baseline", ev.baseline)):
            if spec and spec != "export" and not Path(spec).expanduser().exists() \
                    and not later(Path(spec).expanduser()):
                bad(f"evaluate.{key}", f"{spec} not found (export, a checkpoint, a train dir, "
                    f"or a native/speculators dir)")


# ----------------------------------------------------------------------- chunks (max_disk_gib)
def chunk_refusals(cfg, run: Run, step: str, upfront: bool = False) -> list[tuple[str, str]]:
    """[(key, why)] that a run in chunks refuses before anything loads or is removed: a spool
    that is a file or cannot be written or made, and a budget that cannot hold val, the head,
    the checkpoints, the export and one optimizer step's chunk (chunks.make_plan, with bounds
    for what extract has not written yet). Before tokenize ran (`upfront`, or no token file)
    only what the config alone fixes is checked: the head, checkpoints, export and logs.
    `drafter plan` lists them too."""
    out = []
    why = spool_problem(run.spool())
    if why is not None:
        out.append(("extract.spool", why + ("" if cfg.extract.spool else
                                            " (extract.spool null: the run dir's chunks/)")))
    why = budget_problem(cfg, run, step, upfront)
    if why is not None:
        out.append(("max_disk_gib", why))
    return out


def spool_problem(path: Path) -> str | None:
    """Why the spool cannot be used, or None: it must be a folder this process can write, or
    one it can make (its first existing ancestor a writable folder)."""
    path = Path(path).absolute()
    if path.exists() and not path.is_dir():
        return f"{path} is a file, not a folder: name a folder (made when missing)"
    if path.is_dir():
        return None if os.access(path, os.W_OK | os.X_OK) else (
            f"{path} is a folder this process cannot write (its permissions or a read-only "
            f"file system): name one it can")
    up = path.parent
    while not up.exists() and up != up.parent:
        up = up.parent
    if not up.is_dir():
        return f"{path} cannot be made: {up} is a file, not a folder"
    if not os.access(up, os.W_OK | os.X_OK):
        return (f"{path} cannot be made: {up} is not writable by this process (its permissions "
                f"or a read-only file system): name a folder it can write")
    return None


def train_world(cfg, step: str) -> tuple[int, int]:
    """(ranks, window) of the train that plans the chunks: this process's torchrun world (its
    GPUs when vLLM runs here and a child trains each chunk); for a spool's producer, the
    consumer's elsewhere, plan.gpus (else 1). Window 2 through a spool, else 1."""
    from drafter.core.dist import rank_world
    from drafter.train.chunks import trains_apart

    spooled = cfg.extract.spool is not None
    if spooled and step == "extract":
        return cfg.plan.gpus or 1, 2
    if not spooled and trains_apart(cfg):
        import torch

        return (torch.cuda.device_count() if torch.cuda.is_available() else 1) or 1, 1
    return rank_world()[1], 2 if spooled else 1


def budget_problem(cfg, run: Run, step: str, upfront: bool = False) -> str | None:
    """Why max_disk_gib cannot hold the run (chunk_refusals), or None."""
    from drafter.core import target
    from drafter.data import tokens
    from drafter.features import capture, spool, store
    from drafter.train import budget
    from drafter.train.chunks import plan_run
    from drafter.train.memory import drafter_shape

    tconf = target.load_config(cfg.target)
    dshape = drafter_shape(cfg, tconf)
    ht, vd = target.hidden_size(tconf), dshape["draft_vocab_size"]
    head = budget.head_bound(vd, ht)
    total = int(cfg.max_disk_gib * budget.GiB)
    if upfront or not run.tokens("train").exists():
        h = budget.held(cfg, dshape, budget.data_bytes(run), 0, ht)
        if total >= head + h["total"]:
            return None
        return (f"{budget.describe(total, head, h, 0)}, before any data, val or chunk: set "
                f"max_disk_gib={budget.gib_at_least(head + h['total'])} or more (val and one "
                f"optimizer step's chunk come on top), or lower train.keep_checkpoints")
    ids = capture.resolve_layer_ids(cfg.extract.layer_ids, target.num_layers(tconf))
    ec = cfg.extract
    info = {"hidden_size": ht, "layer_ids": ids, "aux_dtype": ec.aux_dtype,
            "teacher": ec.teacher, "topk": min(ec.topk, vd) if ec.teacher == "topk" else None,
            "draft_vocab_size": vd}
    bpt = store.bytes_per_token(ht, len(ids), ec.aux_dtype, ec.teacher, info["topk"] or 0, vd)
    val = 0
    if run.tokens("val").exists():
        vids, vlens = tokens.ids_and_lengths(run.tokens("val"))
        vlens = [n for n in vlens if n > 0]
        val = spool.chunk_bytes(sum(vlens), len(vlens), sum(map(len, vids)), bpt,
                                ec.shard_tokens) if vlens else 0
    world, window = train_world(cfg, step)
    try:
        plan_run(cfg, run, info, world, window, stored=val + head)
    except budget.BudgetError as e:
        return str(e).removeprefix("max_disk_gib: ")
    return None
