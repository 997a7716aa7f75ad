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
