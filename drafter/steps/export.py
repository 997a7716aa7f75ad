"""The export step: the chosen training checkpoint as the directories the serving engines load.

Reads   train/step_NNNNNN/ (model.safetensors + drafter_config.json, state.json, COMPLETE)
        the target's config.json (layer count, hidden and vocab size, context, architectures)
Writes  export/native/       LlamaForCausalLMEagle3, midlayer.*  (SGLang, vLLM, llama.cpp)
        export/speculators/  Eagle3Speculator, layers.0.*        (`vllm serve DIR`)
        a block drafter (train.method dflash / dspark): export/native/ only, DFlashDraftModel or
        Qwen3DSparkModel as vLLM loads it (drafter/export/dsparkdir.py)
        each with config.json, model.safetensors, README.md (serving commands, layer ids in
        each engine's meaning) and drafter.json; each dir is built under a temp name and
        renamed into place, then linted with `drafter check` (a failed check fails the step).
        A README.md gets evaluate's tuned serving settings back when evaluate measured these
        very weights (drafter/measure/tuned.py; evaluate writes that section after it runs).
Command drafter export CONFIG [export.checkpoint=best] [--force]

Layouts, names and id conventions live in drafter/export/engines.py (contract: ENGINES.md).
"""
from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

from drafter import DrafterError
from drafter.core.rundir import MissingInput, Run, atomic_dir, dir_bytes, read_json
from drafter.export import dsparkdir
from drafter.export import engines as E
from drafter.export.check import format_report, run_checks
from drafter.export.support import c_engine_support
from drafter.export.trained import readme_section, record
from drafter.measure import tuned
from drafter.train.checkpoint import intact, verify_checkpoint
from drafter.train.dspark import DSpark, load_model
from drafter.train.model import param_count

log = logging.getLogger("drafter")


class ExportError(DrafterError):
    pass


def choose_checkpoint(run: Run, which: str) -> tuple[Path, dict]:
    """'last', 'best' (highest state.json val.sim_tau) or a checkpoint path -> (dir, state)."""
    if which not in ("last", "best"):
        p = Path(which).expanduser()
        for f in ("model.safetensors", "drafter_config.json"):
            if not (p / f).is_file():
                raise ExportError(f"export.checkpoint: {p / f} not found")
        why = verify_checkpoint(p) if (p / "COMPLETE").exists() else None
        if why is not None:
            raise ExportError(f"export.checkpoint: {why}")
        state = read_json(p / "state.json") if (p / "state.json").exists() else {}
        return p, state
    ckpts = intact(run, full=True)  # a damaged one is skipped with a warning
    if not ckpts:
        raise MissingInput(f"no complete checkpoint that verifies in {run.step_dir('train')}: "
                           "run `drafter train CONFIG` first (or `drafter run CONFIG`)")
    states = [read_json(p / "state.json") if (p / "state.json").exists() else {} for p in ckpts]
    if which == "last":
        return ckpts[-1], states[-1]
    scored = []
    for i, s in enumerate(states):
        tau = (s.get("val") or {}).get("sim_tau") if isinstance(s.get("val"), dict) else None
        if isinstance(tau, (int, float)) and not math.isnan(tau):
            scored.append((tau, i))
    if not scored:
        raise ExportError(f"export.checkpoint=best: none of the {len(ckpts)} checkpoints in "
                          f"{run.step_dir('train')} has val.sim_tau in state.json (set "
                          "train.eval_every, or use export.checkpoint=last)")
    _, i = max(scored)  # ties: the later checkpoint
    return ckpts[i], states[i]


def _check_fits(c, t: E.TargetInfo) -> None:
    problems = []
    if c.target_hidden_size != t.hidden_size:
        problems.append(f"target_hidden_size {c.target_hidden_size} != {t.hidden_size}")
    if c.vocab_size != t.vocab_size:
        problems.append(f"vocab_size {c.vocab_size} != {t.vocab_size}")
    # a block drafter's layers are written as layer outputs (HS - 1): HS[0] has no such id
    ids, low = (c.target_layer_ids, 1) if hasattr(c, "target_layer_ids") else \
        (c.aux_layer_ids, 0)
    bad = [k for k in ids if not low <= k < t.num_hidden_layers]
    if bad:
        problems.append(f"aux layer ids {bad} outside [{low}, {t.num_hidden_layers})")
    if problems:
        raise ExportError(f"the checkpoint does not fit target {t.name_or_path}: "
                          + "; ".join(problems))


def main(cfg) -> dict:
    run = Run.of(cfg)
    ec = cfg.export
    ckpt, state = choose_checkpoint(run, ec.checkpoint)
    model = load_model(ckpt)
    block = isinstance(model, DSpark)
    target = E.target_info(cfg.target.model, cfg.target)
    _check_fits(model.cfg, target)
    mpe = ec.max_position_embeddings or target.max_position_embeddings \
        or model.cfg.max_position_embeddings
    template = str(Path(cfg.target.chat_template).resolve()) if cfg.target.chat_template else None
    meta = {"checkpoint": str(ckpt.resolve()), "step": state.get("step"),
            "val": state.get("val"), "chat_template": template,
            "max_position_embeddings_source": ("export.max_position_embeddings"
                                               if ec.max_position_embeddings else "target"),
            "training": record(state, run.read_manifest("generate"))}
    trained = readme_section(meta["training"], state.get("val"), state.get("step"))
    dtype = E.DTYPES[ec.dtype]
    log.info("export: %s (step %s, val sim_tau %s) for %s", ckpt.name, state.get("step"),
             (state.get("val") or {}).get("sim_tau"), target.name_or_path)
    counts, checks = {}, {}
    formats = dsparkdir.FORMATS if block else E.formats_for(model.cfg)
    for fmt in E.FORMATS:
        if fmt not in formats:      # an MLA layer or a block drafter: native only
            if run.export(fmt).exists():        # a layout of an earlier drafter: not this one
                shutil.rmtree(run.export(fmt))
            continue
        final = run.export(fmt)
        with atomic_dir(final) as tmp:
            if block:
                dsparkdir.write_dir(model, tmp, target=target, dtype=dtype,
                                    max_position_embeddings=mpe, embed_tokens=ec.embed_tokens,
                                    chat_template=template, final_dir=final, meta=meta,
                                    trained=trained)
            else:
                E.write_dir(model, tmp, fmt, target=target, dtype=dtype,
                            max_position_embeddings=mpe, speculative_tokens=ec.speculative_tokens,
                            embed_tokens=ec.embed_tokens, chat_template=template,
                            final_dir=final, meta=meta, trained=trained)
            # the engine rule judges the machine's engines, not the dir: said below, never
            # a reason to withhold the export (SGLang may serve what vLLM cannot)
            report = run_checks(tmp, target, serving_context=mpe, engines=False)
            if not report.ok:
                # The temp dir is removed: a drafter that fails its own lint is never shipped.
                raise ExportError(f"the {fmt} export fails `drafter check`:\n"
                                  + format_report(report))
            # a re-export of the weights evaluate measured: its tuned flags stay in the README
            if tuned.carry_over(run, fmt, tmp, final):
                log.info("export %s: README.md carries evaluate's tuned serving settings", fmt)
        for c in report.checks:
            if c.status != "pass":
                log.warning("export %s: %s %s: %s", fmt, c.status, c.name, c.reason)
        if fmt == E.NATIVE:
            for c in c_engine_support(target):
                if c.status == "fail":
                    log.warning("export: %s: %s", c.name, c.reason)
        counts[f"{fmt}_bytes"] = dir_bytes(final)
        checks[fmt] = report.counts
        log.info("export: wrote %s (%.1f MiB)", final, counts[f"{fmt}_bytes"] / 2**20)
    c = model.cfg
    ids = {"hs": list(c.target_layer_ids), "vllm": dsparkdir.to_vllm(c.target_layer_ids)} \
        if block else {"hs": E.from_hs(c.aux_layer_ids, "hs"),
                       "layer_output": E.from_hs(c.aux_layer_ids, "layer_output")}
    return {
        "counts": {"params": param_count(model, trainable_only=False),
                   "trainable_params": param_count(model), **counts},
        "checkpoint": str(ckpt), "step": state.get("step"),
        "sim_tau": (state.get("val") or {}).get("sim_tau"),
        "target": target.name_or_path, "dtype": ec.dtype, "max_position_embeddings": mpe,
        "aux_layer_ids": ids, **({"method": c.method, "block_size": c.block_size}
                                 if block else {}),
        "checks": checks,
    }

