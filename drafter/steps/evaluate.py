"""The evaluate step: speculative decoding against the real target, with the acceptance length τ
measured the way engines measure it, losslessness verified, and the speedup over plain decoding.

Reads   the drafter (evaluate.drafter: `export` = this run's export/native/, or a checkpoint of
        any kind, EAGLE-3, DSpark or DFlash, a train, native or speculators dir), an optional
        baseline drafter, the prompt sets (evaluate.datasets: MT-bench with both turns,
        HumanEval, GSM8K, any prompt file)
Writes  evaluate/metrics.json, evaluate/report.md, evaluate/acceptance.png, evaluate/tau.png
Command drafter evaluate CONFIG            (`drafter report RUN_DIR` prints the report)

For each temperature, the target first decodes every prompt plainly (static cache, batches of
the same size, continuous by default): the reference for the lossless check, the baseline for
tokens/s, and the source of MT-bench's second turn (the model's own first answer goes back into
the conversation). Then each drafter x method (chain K, tree depth/topk/tokens) decodes the same
prompts speculatively (a block drafter, DSpark or DFlash: its own step, its chain its whole
block; docs/evaluate.md, "Block drafters").

τ = tokens per target forward after the prefill, the bonus token counted (plain decoding: 1.0) =
1 + accepted / verification steps, over the raw accepted counts (as vLLM and SGLang count them).
Per-position acceptance i = 1..D: unconditional P[a >= i] and conditional P[a >= i | a >= i-1]
over steps, a = accepted draft tokens of a step. c = one drafter forward (one drafting depth) /
one verification forward, timed on their own (graph-replayed on GPU).

Lossless check (temperature 0): each speculative output must equal the plain one token for token.
A 16-bit near-tie (a runner-up within `evaluate.tie_tolerance`) is counted as a tie; any other
16-bit mismatch is decoded again in float32, the mismatched prompts alone: identical there is
numerical drift, counted and reported; different there fails the step naming the prompt
(drafter/measure/lossless.py). In float32 any difference fails the step.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import shutil
import time
from pathlib import Path

from drafter import DrafterError
from drafter.core.rundir import Run, atomic_json, atomic_write, read_json
from drafter.measure.lossless import recheck_runs
from drafter.measure.report import plots, render_report
from drafter.measure.speedcheck import check as speed_check
from drafter.measure.speedcheck import interleaved, mark
from drafter.measure.summary import (
    best_row,
    best_tree,
    measured,
    overall,
    recommend_setting,
    summarize,
    with_parts,
    with_plain,
)
from drafter.measure.tuned import add_tuned_settings
from drafter.measure.vllm_eval import compare, render_vllm, vllm_acceptance

log = logging.getLogger("drafter")


class EvaluateError(DrafterError):
    pass


# ------------------------------------------------------------------------------------ the inputs
def _load_drafter(spec: str, what: str, run: Run, cfg, device, dtype):
    """-> (Drafter or a block drafter, DSpark, resolved path)."""
    from drafter.export.enginedir import load_drafter_dir
    from drafter.export.engines import target_info
    from drafter.train.dspark import is_block_config, load_model

    if spec == "export":
        path = run.require(run.export("native"), "export")
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise EvaluateError(f"evaluate.{what}: {path} not found (expected `export`, a "
                                f"checkpoint dir, a train dir, or a native/speculators dir)")
    ckpts = sorted(p for p in path.glob("step_[0-9]*") if (p / "COMPLETE").exists())
    if ckpts and not any((path / f).exists() for f in ("config.json", "drafter_config.json")):
        path = ckpts[-1]  # a train dir: its latest complete checkpoint
    own = path / "drafter_config.json"
    try:
        if own.exists() and is_block_config(read_json(own)):  # a DSpark or DFlash checkpoint
            model = load_model(path, device=device, dtype=dtype)
        else:
            model = load_drafter_dir(path, device=device, dtype=dtype,
                                     target=target_info(cfg.target.model, cfg.target))
    except DrafterError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        raise EvaluateError(f"evaluate.{what}: cannot load a drafter from {path}: {e}") from None
    return model, path


def _check_drafter(dr, model, what: str, path) -> None:
    from drafter.core.target import hidden_size, num_layers, vocab_size

    c, tc = dr.cfg, model.config
    problems = []
    if c.vocab_size != vocab_size(tc):
        problems.append(f"vocab_size {c.vocab_size} != the target's {vocab_size(tc)}")
    if c.target_hidden_size != hidden_size(tc):
        problems.append(f"target_hidden_size {c.target_hidden_size} != the target's "
                        f"{hidden_size(tc)}")
    n, ids = num_layers(tc), getattr(c, "aux_layer_ids", None) or c.target_layer_ids
    if any(not 0 <= k <= n for k in ids):
        problems.append(f"aux layer ids {ids} outside 0..{n}")
    if problems:
        raise EvaluateError(f"evaluate.{what} ({path}) was not trained for this target "
                            f"({tc.name_or_path}): " + "; ".join(problems))


def _datasets(ev) -> list[tuple[str, str, list[dict]]]:
    """[(name, path, records)]: records hold only system/user turns (drafter.data.sources)."""
    from drafter.data.sources import load_prompts

    out, seen = [], set()
    for i, ds in enumerate(ev.datasets):
        if not ds.path:
            raise EvaluateError(f"evaluate.datasets[{i}].path is empty")
        name = ds.name or Path(ds.path.split(":", 1)[-1]).name.split(".")[0]
        if name in seen or name == "overall":
            raise EvaluateError(f"evaluate.datasets[{i}].name '{name}' is used twice (or is "
                                f"reserved): give each dataset its own name")
        seen.add(name)
        recs = load_prompts(ds.path, ds.max_prompts, field=ds.field)
        out.append((name, ds.path, recs))
    if not out:
        raise EvaluateError("evaluate.datasets is empty")
    return out


def _methods(ev):
    from drafter.decoding.decode import TreeSpec

    out = []
    for m in ev.methods:
        if m == "chain":
            out.append(("chain", TreeSpec.chain(ev.k)))
        elif m == "tree":
            out.append(("tree", TreeSpec(ev.tree_depth, ev.tree_topk, ev.tree_tokens)))
        elif m == "block":  # the chain of K verified as a block (temperatures above 0)
            out.append(("block", TreeSpec.chain(ev.k)))
        else:
            raise EvaluateError(f"evaluate.methods: unknown method '{m}' (chain, tree or "
                                f"block)")
    if not out:
        raise EvaluateError("evaluate.methods is empty (chain, tree and/or block)")
    return out


def _drafter_methods(methods, dr, what: str):
    """One drafter's methods: a block drafter (DSpark, DFlash) drafts one chain, its block (K
    its block size, not evaluate.k: the tuner weighs every k <= K); no tree for it."""
    from drafter.decoding.decode import TreeSpec

    K = getattr(dr.cfg, "block_size", None)
    if K is None:
        return methods
    if any(m == "tree" for m, _ in methods):
        log.warning("evaluate: %s is a %s drafter, which drafts a chain: no tree run for it",
                    what, dr.cfg.method)
    return [(m, TreeSpec.chain(K)) for m, _ in methods if m != "tree"]


# ----------------------------------------------------------------------------------- decoding
class _Prompts:
    """Token ids of each turn of each record; MT-bench's later turns are built from the plain
    run's own answers (the conversation continues as the target wrote it)."""

    def __init__(self, tok, records, max_len: int, max_new: int):
        self.tok, self.records, self.max_len, self.max_new = tok, records, max_len, max_new
        self.rounds: list[list[tuple[int, list[int]]]] = []   # round -> [(record, ids)]
        self.truncated = 0

    def n_turns(self, rec) -> int:
        return sum(m["role"] == "user" for m in rec["messages"])

    def build(self, r: int, answers: dict[int, list[str]]) -> list[tuple[int, list[int]]]:
        out = []
        for i, rec in enumerate(self.records):
            if self.n_turns(rec) <= r:
                continue
            msgs, users = [], 0
            for m in rec["messages"]:
                if m["role"] == "user":
                    if users == r + 1:
                        break
                    if users > 0:
                        msgs.append({"role": "assistant", "content": answers[i][users - 1]})
                    users += 1
                msgs.append({"role": m["role"], "content": m["content"]})
            text = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            if len(ids) + self.max_new > self.max_len:  # keep the end: the question and header
                ids = ids[-(self.max_len - self.max_new):]
                self.truncated += 1
            out.append((i, ids))
        return out


def _decode(dec, prompts: _Prompts, rounds, max_new, stop, T, proposer=None, tree=None,
            desc: str = "", continuous: bool = False, record_gaps: bool = False):
    """Decode every round (building later rounds from these answers when `rounds` is None).
    record_gaps: plain greedy's runners-up for the lossless check (`_plain`'s second pass).
    Returns ([(record, round, Output)], stats): stats are Decoder.last's figures summed over the
    rounds (measure.summary: seconds with the prefills, the tokens/s a user waits for;
    iterations, decode steps only; row_steps, their rows summed: a batch's steps run at its
    rows; spans, the steps by shape; step_gpu_seconds, the GPU's time in them)."""
    from tqdm import tqdm

    from drafter.measure.summary import add_spans

    outs = []
    stats = {"seconds": 0.0, "iterations": 0, "prefill_seconds": 0.0, "row_steps": 0,
             "spans": {}, "step_gpu_seconds": None}
    answers: dict[int, list[str]] = {}
    r = 0
    bar = tqdm(total=sum(prompts.n_turns(rec) for rec in prompts.records), desc=desc,
               unit="prompt", leave=False)
    while True:
        batch = rounds[r] if rounds is not None else prompts.build(r, answers)
        if not batch:
            break
        if rounds is None:
            prompts.rounds.append(batch)
        res = dec.generate([ids for _, ids in batch], max_new, stop_ids=stop, temperature=T,
                           proposer=proposer, tree=tree, record_gaps=record_gaps,
                           tree_stats=True, continuous=continuous,
                           progress=bar)  # tree_stats: greedy trees' smaller shapes' taus
        last = dec.last
        for key in ("seconds", "iterations", "prefill_seconds", "row_steps"):
            stats[key] += last[key]
        stats["spans"] = add_spans(stats["spans"], last["spans"])
        if last.get("step_gpu_seconds") is not None:
            stats["step_gpu_seconds"] = (stats["step_gpu_seconds"] or 0.0) \
                + last["step_gpu_seconds"]
        for (i, _), o in zip(batch, res):
            outs.append((i, r, o))
            text = prompts.tok.decode(o.tokens, skip_special_tokens=True)
            answers.setdefault(i, []).append(text)
        r += 1
        if rounds is not None and r >= len(rounds):
            break
    bar.close()
    return outs, stats


def _plain(dec, prompts: _Prompts, max_new, stop, T, desc: str, continuous: bool):
    """Plain decoding, the reference every speedup divides by: timed as a user would run it.
    At T=0 the same rounds are decoded again, untimed, recording each token's runners-up for
    the lossless check (recording them in the timed pass made its step slower: BENCHMARKS.md,
    The user's path). The two passes run the same batches and give the same tokens;
    should bf16 differ, the recording pass's tokens are the ones checked (with a warning)."""
    outs, stats = _decode(dec, prompts, None, max_new, stop, T, desc=desc, continuous=continuous)
    if T != 0:
        return outs, stats
    again, _ = _decode(dec, prompts, prompts.rounds, max_new, stop, T,
                       desc=f"{desc} (runners-up)", continuous=continuous, record_gaps=True)
    differ = sum(a.tokens != b.tokens for (_, _, a), (_, _, b) in zip(outs, again))
    if differ:
        log.warning("evaluate: %s: %d of %d answers differ between the timed pass and the one "
                    "recording runners-up; the lossless check reads the latter", desc, differ,
                    len(outs))
    return again, stats


def _warm_up(dec, prompts: _Prompts, stop) -> dict:
    """A short untimed plain decoding of the first round's first batch, before any timed pass.
    The process's first decoding pays one-off start-up costs (kernels loaded on first use, the
    library handles); without it they count against the first dataset's plain pass alone (its
    prefills then took several times those of each speculative pass)."""
    batch = [ids for _, ids in prompts.build(0, {})[:dec.max_batch]]
    t0 = time.perf_counter()
    if batch:
        dec.generate(batch, 2, stop_ids=stop)
    return {"prompts": len(batch), "new_tokens": 2, "seconds": _r(time.perf_counter() - t0)}


def _pass(run: Run, key: str, prompts: _Prompts, fn):
    """One decoding pass (fn() -> _decode's result), kept in evaluate/passes/ so that a killed
    evaluate resumes after the passes it finished. A plain pass also keeps the prompt rounds it
    built (MT-bench's second turns carry its answers)."""
    from drafter.decoding.decode import Output

    name = hashlib.sha256(key.encode()).hexdigest()[:16]
    p = run.eval_passes() / f"{name}.json"
    if p.exists():
        d = read_json(p)
        if d.get("key") == key and "stats" in d:
            if d.get("rounds") is not None:
                prompts.rounds[:] = [[(i, ids) for i, ids in b] for b in d["rounds"]]
                prompts.truncated = d["truncated"]
            log.info("evaluate: %s: kept from the interrupted run", key)
            return [(i, r, Output(**o)) for i, r, o in d["outs"]], d["stats"]
    built = not prompts.rounds
    outs, stats = fn()
    atomic_json(p, {"key": key, "stats": stats,
                    "rounds": prompts.rounds if built else None, "truncated": prompts.truncated,
                    "outs": [(i, r, dataclasses.asdict(o)) for i, r, o in outs]})
    return outs, stats


def _r(x, n=3):
    return None if x is None else round(x, n)


# ------------------------------------------------------------------------------------- the step
def main(cfg) -> dict:
    import torch

    from drafter.core.target import load_model, load_tokenizer, pick_device, pick_dtype, text_config
    from drafter.decoding.block import verify_chain_block
    from drafter.decoding.decode import Decoder, draft_parts, stop_ids_of
    from drafter.decoding.dspark import proposer_for

    ev, run = cfg.evaluate, Run.of(cfg)
    if ev.engine == "vllm":
        return _main_vllm(cfg)
    if 0.0 not in [float(t) for t in ev.temperatures]:
        raise EvaluateError("evaluate.temperatures must include 0 (the lossless check runs at "
                            "temperature 0)")
    if ev.max_new_tokens < 1 or ev.batch_size < 1:
        raise EvaluateError("evaluate.max_new_tokens and evaluate.batch_size must be >= 1")
    methods = _methods(ev)
    device = pick_device(cfg.target)
    dtype = pick_dtype(cfg.target, device)
    tol = ev.tie_tolerance if ev.tie_tolerance is not None else \
        (0.0 if dtype == torch.float32 else 0.5)
    drafters = [("drafter", *_load_drafter(ev.drafter, "drafter", run, cfg, device, dtype))]
    if ev.baseline:
        drafters.append(("baseline", *_load_drafter(ev.baseline, "baseline", run, cfg, device,
                                                     dtype)))
    datasets = _datasets(ev)
    log.info("evaluate: loading the target %s (%s, %s)", cfg.target.model, device, dtype)
    model = load_model(cfg.target, device, dtype)
    tok = load_tokenizer(cfg.target)
    for what, dr, path in drafters:
        _check_drafter(dr, model, what, path)
    stop = stop_ids_of(tok, model)
    max_len = int(getattr(text_config(model.config), "max_position_embeddings", 0) or 1 << 20)
    # decoding steps replayed from CUDA graphs on a GPU (the Decoder's default): a step of a
    # small target is kernel launches, not GPU work (BENCHMARKS.md#decoding)
    dec = Decoder(model, max_batch=ev.batch_size, prefill_graph_tokens=ev.prefill_graph_tokens)
    proposers = [(what, proposer_for(dr), path, _drafter_methods(methods, dr, what))
                 for what, dr, path in drafters]

    runs, plain_all, ds_info, timings, checks = [], {}, {}, {}, {}
    warm = _warm_up(dec, _Prompts(tok, datasets[0][2], max_len, ev.max_new_tokens), stop) \
        if datasets else None
    log.info("evaluate: warm-up: %s", warm)
    cal = None  # the batch the steps run at (rows_per_step), decided by the first plain passes
    greedy, run_parts = None, []  # T=0's (plain outs, plain summaries, prompts); (Drafter, tree)
    decoded = {}                  # the same per temperature

    def parts(m: dict, prop, tree) -> dict:  # what m's steps must run at the shapes they ran at
        return with_parts(m, dec.parts_ms(prop, tree, m["spans"])) if m.get("spans") else m

    def method_run(what, prop, dr, path, method, tree, T, plain, ps, prompts) -> dict:
        """One drafter x method x temperature over every dataset (its passes resumable)."""
        key = (what, tree)
        cut = getattr(prop, "cut", None)  # a block drafter's confidence cut
        label = tree.label() + (" block" if method == "block" else "") \
            + (f" cut={cut:g}" if cut is not None else "")
        verify = verify_chain_block if method == "block" else None
        if key not in timings:
            # c at batch min(B, 8); the costs at batch 1 and at the batch evaluated for the
            # serving setting (each batch size timed once)
            small = min(ev.batch_size, 8)
            by = {b: {k: _r(v) for k, v in dec.time_forwards(prop, tree, batch=b).items()}
                  for b in sorted({1, small, cal, ev.batch_size})}
            t = by[small]  # c: the drafting's share (a block drafter's forward and Markov pass)
            timings[key] = {**t, "c": _r(draft_parts(t, tree.depth if "markov_ms" in t else 1)
                                         / t["verify_ms"], 4),
                            "by_batch": {b: by[b] for b in sorted({1, cal, ev.batch_size})}}
        per = {}
        for name, _, _ in datasets:
            torch.manual_seed(ev.seed)
            desc = f"{what} {label} T={T:g} {name}"
            pr = prompts[name]
            dec.chain_verify = verify
            try:
                outs, stats = _pass(run, desc, pr, lambda: _decode(
                    dec, pr, pr.rounds, ev.max_new_tokens, stop, T, prop, tree, desc=desc,
                    continuous=ev.continuous))
            finally:
                dec.chain_verify = None
            m = summarize(outs, stats, tree, plain[name][0] if T == 0 else None, tol,
                          pr.records)
            per[name] = with_plain(m, ps[name])
            log.info("evaluate: %s %s T=%g %s: tau %.3f, %.1f tokens/s (plain %.1f)", what,
                     label, T, name, m["tau"] or 0, m["tokens_per_s"] or 0,
                     ps[name]["tokens_per_s"] or 0)
        per["overall"] = parts(with_plain(overall(per, tree), ps["overall"]), prop, tree)
        run_parts.append((dr, tree))
        name = f"{what}: {label}, T={T:g}"
        turns.append((name, prop, tree, verify))
        return {"name": name, "drafter": what, "path": str(path), "method": method,
                "kind": getattr(dr.cfg, "method", "eagle3"), "temperature": T,
                **_tree_settings(tree), **({"cut": cut} if cut is not None else {}),
                "timing": timings[key], "datasets": per}

    for T in [float(t) for t in ev.temperatures]:
        plain, prompts = {}, {}
        for name, path, recs in datasets:
            torch.manual_seed(ev.seed)
            prompts[name] = pr = _Prompts(tok, recs, max_len, ev.max_new_tokens)
            outs, stats = _pass(run, f"plain T={T:g} {name}", pr, lambda: _plain(
                dec, pr, ev.max_new_tokens, stop, T, f"plain T={T:g} {name}", ev.continuous))
            plain[name] = (outs, summarize(outs, stats))
            ds_info[name] = {"path": path, "records": len(recs),
                             "prompts": sum(len(r) for r in prompts[name].rounds),
                             "truncated_prompts": prompts[name].truncated}
            log.info("evaluate: plain T=%g %s: %d prompts, %.1f tokens/s", T, name, len(outs),
                     plain[name][1]["tokens_per_s"] or 0)
        ps = {n: s for n, (_, s) in plain.items()}
        ps["overall"] = parts(overall(ps, None), None, None)
        plain_all[str(T)] = ps
        decoded[T] = (plain, ps, prompts)
        if T == 0:
            greedy = decoded[T]
        if cal is None:  # below batch_size when a dataset has fewer prompts (or a last partial
            # batch): the costs are timed there too, and the serving setting calibrated there
            rows = ps["overall"].get("rows_per_step")
            cal = max(1, round(rows)) if rows else ev.batch_size
        turns = []  # (run name, proposer, tree, chain_verify) of this temperature's runs
        for (what, prop, path, mine), (_, dr, _) in zip(proposers, drafters):
            for method, tree in mine:
                if method == "block" and T == 0:  # greedy: block verification is the chain's
                    continue
                runs.append(method_run(what, prop, dr, path, method, tree, T, plain, ps,
                                       prompts))
        # the same prompts decoded by every setting in turns: whether the speedups hold up
        first = [ids for name, _, _ in datasets for _, ids in prompts[name].rounds[0]][:cal]
        timed = interleaved(dec, first, [("plain", None, None, None)] + turns, T, stop,
                            min(ev.max_new_tokens, 24), seed=ev.seed)
        checks[str(T)] = speed_check([r for r in runs if r["temperature"] == T], ps["overall"],
                                     timed)
        mark([r for r in runs if r["temperature"] == T], checks[str(T)])
        for reason in checks[str(T)]["reasons"]:
            log.warning("evaluate: T=%g: speed figures unreliable: %s", T, reason)

    # per temperature, the tuner's setting for the batch evaluated, run too when no run above
    # was it: the speedup it promises, measured
    recs = {}
    for T in decoded:
        if not checks[str(T)]["reliable"]:  # no recommendation from unreliable step times
            continue
        rec = recommend_setting(runs, plain_all, cal, str(drafters[0][2]), T)
        best = best_tree(rec, cal) if rec else None
        if best is not None and ev.run_recommended:
            row = best_row(rec, cal)
            method = "block" if row.get("block") else "chain" if best.is_chain else "tree"
            same = next((r for r, (_, tree) in zip(runs, run_parts) if r["drafter"] == "drafter"
                         and r["temperature"] == T and tree == best
                         and (r["method"] == "block") == (method == "block")
                         and r.get("cut") == row.get("cut")), None)
            if same is None:
                log.info("evaluate: the recommended setting at batch %d, T=%g: %s", cal, T,
                         row["setting"])
                prop = proposers[0][1] if row.get("cut") is None else \
                    proposer_for(drafters[0][1], row["cut"])
                same = method_run("drafter", prop, drafters[0][1], drafters[0][2],
                                  method, best, T, *decoded[T])
                runs.append(same)
            same["recommended"] = True
            rec["measured"] = measured(rec, same)
        if rec:
            recs[str(T)] = rec
    drift = recheck_runs(model, runs, run_parts, {n: p.rounds for n, p in greedy[2].items()},
                         ev.max_new_tokens, stop) \
        if dtype != torch.float32 else 0
    primary = runs[0]
    settings = {
        "target": cfg.target.model, "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "drafter": str(drafters[0][2]),
        "baseline": str(drafters[1][2]) if len(drafters) > 1 else None,
        "methods": [t.label() for _, t in methods],
        "temperatures": [float(t) for t in ev.temperatures],
        "max_new_tokens": ev.max_new_tokens, "batch_size": ev.batch_size,
        "continuous": bool(ev.continuous and ev.batch_size > 1),
        "cuda_graphs": bool(dec.graphs.enabled),
        "prefill_graph_tokens": ev.prefill_graph_tokens if dec.graphs.enabled else 0,
        "tie_tolerance": tol, "seed": ev.seed, "warm_up": warm,
        "float32_recheck": dtype != torch.float32, "drift": drift,
        "primary": {k: primary[k] for k in ("name", "drafter", "method", "temperature",
                                            "depth", "topk", "tokens", "k")
                    if k in primary},
        "datasets": ds_info,
    }
    settings["speed_check"] = checks
    if recs:  # the greedy one's keys at the top, as the export READMEs and older readers read
        settings["recommended"] = {**recs.get("0.0", {}), "by_temperature": recs}
    in_vllm = None
    if ev.engine == "both":  # at every temperature, on the prompt ids decoded here
        rec0 = recs.get("0.0")
        best0 = best_tree(rec0, cal) if rec0 else None
        chains = {T: {r.get("k") for r in runs if r["drafter"] == "drafter"
                      and r["method"] == "chain" and r["temperature"] == T} for T in decoded}
        k = best0.depth if best0 is not None and best0.is_chain and ev.run_recommended \
            and all(best0.depth in ks for ks in chains.values()) else ev.k
        in_vllm = compare(vllm_acceptance(
            cfg, drafters[0][2], k,
            {T: [(n, decoded[T][2][n].rounds) for n, _, _ in datasets] for T in decoded}, stop,
            ev.max_new_tokens, temperatures=list(decoded)), runs)
    try:
        metrics = finish(run, settings, runs, plain_all, in_vllm)
    finally:
        shutil.rmtree(run.eval_passes(), ignore_errors=True)
    return {"counts": {"prompts": sum(d["prompts"] for d in ds_info.values()), "runs": len(runs),
                       "new_tokens": primary["datasets"]["overall"]["new_tokens"],
                       "mismatches": metrics["mismatches"], "ties": metrics["ties"],
                       "drift": metrics["drift"]},
            "tau": {n: _r(d.get("tau"), 4) for n, d in primary["datasets"].items()},
            "lossless": metrics["lossless"]}


def finish(run: Run, settings: dict, runs: list[dict], plain: dict,
           in_vllm: dict | None = None) -> dict:
    """Write metrics.json (with `in_vllm`, vLLM's acceptance, under "engine"), the plots and
    report.md; then fail (EvaluateError) if any greedy speculative output differs from the plain
    one beyond a numerical tie or float32-checked drift."""
    lossless_runs = [r for r in runs if r["temperature"] == 0]
    verdicts = [(r, n, d) for r in lossless_runs for n, d in r["datasets"].items()
                if n != "overall"]
    for _, _, d in verdicts:  # mismatches first, then drift, then ties; the first 20 kept
        order = {"mismatch": 0, "drift": 1, "tie": 2}
        d["lossless"]["divergences"] = sorted(d["lossless"]["divergences"],
                                              key=lambda x: order[x["verdict"]])[:20]
    mismatches = sum(d["lossless"]["mismatch"] for _, _, d in verdicts)
    ties = sum(d["lossless"]["tie"] for _, _, d in verdicts)
    drift = sum(d["lossless"].get("drift", 0) for _, _, d in verdicts)
    metrics = {"lossless": mismatches == 0, "settings": settings,
               "datasets": runs[0]["datasets"], "plain": plain, "runs": runs,
               "ties": ties, "drift": drift, "mismatches": mismatches}
    if in_vllm is not None:
        metrics["engine"] = in_vllm
    atomic_json(run.eval_metrics(), metrics)
    plots(run, runs)
    atomic_write(run.eval_report(), render_report(metrics) + (
        render_vllm(in_vllm) if in_vllm else ""))
    log.info("evaluate: wrote %s", run.eval_report())
    add_tuned_settings(run, metrics)  # the export READMEs: the serving flags measured here
    if mismatches:
        first = next((dict(run=r["name"], dataset=n, **x) for r, n, d in verdicts
                      for x in d["lossless"]["divergences"] if x["verdict"] == "mismatch"), {})
        raise EvaluateError(
            f"evaluate: speculative decoding is NOT lossless: {mismatches} prompt(s) differ from "
            f"plain greedy decoding of the target (first: {first}); see {run.eval_report()}")
    return metrics


def _main_vllm(cfg) -> dict:
    """evaluate.engine=vllm: the target only vLLM runs. vLLM decodes the prompts plainly and
    with the export at chain K=evaluate.k, at each of evaluate.temperatures
    (drafter/measure/vllm_eval.py); nothing loads the target in this process."""
    from drafter.core.target import load_tokenizer
    from drafter.core.vllm import vllm_missing
    from drafter.decoding.decode import stop_ids_of

    ev, run = cfg.evaluate, Run.of(cfg)
    missing = vllm_missing()
    if missing:
        raise EvaluateError(f"evaluate.engine=vllm: {missing}")
    if ev.drafter == "export":
        path = run.require(run.export("native"), "export")
    else:
        path = Path(ev.drafter).expanduser()
    if not (path / "config.json").exists():
        raise EvaluateError(f"evaluate.drafter: {path} is not an export dir (vLLM serves "
                            f"export/native or export/speculators; a checkpoint needs `drafter "
                            f"export` first)")
    tok = load_tokenizer(cfg.target)
    stop = stop_ids_of(tok)
    sets = []
    for name, _, recs in _datasets(ev):
        pr = _Prompts(tok, recs, 1 << 30, ev.max_new_tokens)
        sets.append((name, pr.build))
    temps = sorted({float(t) for t in ev.temperatures})
    in_vllm = vllm_acceptance(cfg, path, ev.k, sets, stop, ev.max_new_tokens, tokenizer=tok,
                              temperatures=temps)
    metrics = {"engine": in_vllm, "settings": {
        "target": cfg.target.model, "drafter": str(path), "engine_args": cfg.target.engine_args,
        "max_new_tokens": ev.max_new_tokens, "temperatures": temps}}
    atomic_json(run.eval_metrics(), metrics)
    atomic_write(run.eval_report(), f"# Evaluation of {path}\n" + render_vllm(in_vllm))
    log.info("evaluate: wrote %s", run.eval_report())
    ov = in_vllm["overall"]
    return {"counts": {"prompts": ov.get("prompts", 0),
                       "same_as_plain": ov.get("same_as_plain", 0)},
            "tau": {n: d["tau"] for n, d in {**in_vllm["datasets"], "overall": ov}.items()},
            "engine": "vllm"}


def _tree_settings(tree) -> dict:
    if tree.is_chain:
        return {"k": tree.depth}
    return {"depth": tree.depth, "topk": tree.topk, "tokens": tree.nodes}
