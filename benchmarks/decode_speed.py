"""Decode speed of drafter.decoding.decode: plain step and speculative step (evaluate's decoding).

Headline figure (BENCHMARKS.md, Decoding): the graph-captured steps on one H200 at SmolLM2-135M's
shape (random weights: the step time does not depend on them), each against its parts:

    python benchmarks/decode_speed.py --random-target --batches 1 --prefill-lengths 8
    python benchmarks/decode_speed.py --random-target --batches 64 --prefill-lengths 0

It prints a markdown table per batch size: the plain step, the chain K=5 and tree 6/8/48 steps
(ms), their prefills, the target forward / verification / drafter forward they are made of, c
and step / (verify + depth x drafter), and with --prefill-lengths the batch-1 prefills at new
prompt lengths, graphed and eager. Other uses:

    python benchmarks/decode_speed.py                      # SmolLM2-135M on the GPU (the goals)
    python benchmarks/decode_speed.py --tiny               # a tiny random target on CPU (smoke)
    python benchmarks/decode_speed.py --drafter runs/x/export/native --json out.json
    python benchmarks/decode_speed.py --eval-sets ../shared/data/eval --batches 64 --skip-steps
                                  # evaluate's own decoding and figures on its prompts (the
                                  # report's x parts), the drafter random unless --drafter
    python benchmarks/decode_speed.py --tiny --ops         # + aten ops per step (kernel count),
                                                           # and by part of the step
    python benchmarks/decode_speed.py --random-target --batches 1,64 --profile   # no model files:
                                              # SmolLM2-135M's shape, random weights; the steps'
                                              # time by part (drafting, verify, accept, commit)
    python benchmarks/decode_speed.py --random-target --batches 1,64 --prefill-lengths 0 \
        --temperature 1                       # the sampling steps (rejection sampling) against
                                              # the same parts as the greedy ones
    python benchmarks/decode_speed.py --random-target --batches 1,64 --prefill-lengths 0 \
        --kind dspark --k 7                   # a block drafter's step (a random DSpark of the
                                              # recipe's shape, block 7: one forward, the Markov
                                              # head, the chain verified) against its parts

Measures, on whatever device the target loads to (CUDA graphs on when there is a GPU):
  - plain decode step at batch 1 (ms per token);
  - one speculative step at batch 1, chain K and tree (depth/topk/tokens) (ms per step: drafting,
    verification, acceptance, cache commit, drafter re-read), and the parts: one target forward
    (1 token), one verification forward, one drafter forward, c = drafter / verification;
  - the prefill of the prompt (eager), which evaluate's step_ms counts and its decode_step_ms
    does not, and batch-1 prefills at prompt lengths new to each method (--prefill-lengths), as
    evaluate's are; with --profile-prefill, more of them under torch.profiler (GPU and CPU time
    of the target's forwards and the drafter's observe calls per prefill); with --ops, the
    prefill's kernel count, plain and speculative.
Goal (../shared/docs/REFERENCES.md): <= 10 ms per speculative step for SmolLM2. Batched
generation (the generate step's engine) is benchmarks/generate_throughput.py's.
A random drafter is used unless --drafter is given (step time does not depend on its quality).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from op_count import OpCount  # noqa: E402

from drafter.core.config import EvaluateConfig, TargetConfig  # noqa: E402
from drafter.core.target import load_model  # noqa: E402
from drafter.decoding.decode import (  # noqa: E402
    Decoder,
    TreeSpec,
    acceptance_stats,
    draft_parts,
)
from drafter.decoding.dspark import proposer_for  # noqa: E402


def tiny_target(out: Path) -> str:
    """A tiny random Llama with the embedded SmolLM2 tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from drafter.core.target import resolve

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048)
    LlamaForCausalLM(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(resolve("builtin:smollm2-135m-instruct")).save_pretrained(out)
    return str(out)


def random_smollm2(out: Path) -> str:
    """SmolLM2-135M-Instruct's shape (its config.json's sizes) with random weights and no
    tokenizer: step times need no trained weights, so a machine without the model files (the
    GGUF) measures them too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    return str(out)


def random_drafter(config, draft_vocab: int):
    from drafter.core.target import default_layer_ids, num_layers
    from drafter.train.model import Drafter, DrafterConfig

    torch.manual_seed(0)
    return Drafter(DrafterConfig.from_target(config, draft_vocab,
                                             default_layer_ids(num_layers(config))))


def random_block_drafter(config, draft_vocab: int, method: str, block: int):
    """A random DSpark (or DFlash) drafter of the published recipe's shape: 5 draft layers
    reading 5 target layers, a Markov head of rank 64 and a confidence head (DSpark)."""
    from drafter.core.target import default_block_layer_ids, num_layers, vocab_size
    from drafter.train.dspark import DSpark, DSparkConfig

    torch.manual_seed(0)
    return DSpark(DSparkConfig.from_target(
        config, method, draft_vocab, default_block_layer_ids(num_layers(config), 5), block,
        vocab_size(config) - 1, layers=5, markov_rank=64, confidence_head=True))


def step_parts(dec, P) -> list[tuple]:
    """The parts of a speculative step, (object, attribute, label): `build_tree` (the tree's
    construction, its drafter forwards nested in it), the drafter forwards, the verification
    forward, the ancestor matrix, the acceptance, the drafter's re-read of the committed tokens,
    the commit; what none of them runs is the step's setup and bookkeeping."""
    from drafter.decoding import decode

    return [(decode, "build_tree", "tree construction (build_tree)"),
            (P, "score", "drafter forwards"), (dec.target, "forward", "verify forward"),
            (decode, "ancestors", "ancestors"), (decode, "verify_greedy", "accept"),
            (decode, "verify_sample", "accept"), (decode, "verify_chain_sample", "accept"),
            (P, "observe", "drafter re-read"),
            (dec, "_commit", "commit")]


@contextlib.contextmanager
def marked(parts, enter):
    """Each (object, attribute, label) of `parts` wrapped so that its calls run inside
    enter(label) (a context manager); put back on exit."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in parts]

    def wrap(fn, label):
        def run(*args, **kw):
            with enter(label):
                return fn(*args, **kw)
        return run

    for (obj, name, fn), (_, _, label) in zip(saved, parts):
        setattr(obj, name, wrap(fn, label))
    try:
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def counts_per_step(dec, prompt, parts=(), **kw) -> dict[str, tuple[float, float]]:
    """{label: (aten ops, kernels)} per decode step, counted eagerly: the difference between
    generate calls of 8 and 24 new tokens (the prefill cancels), the calls of `parts` under their
    labels (the innermost), the rest as `step setup and bookkeeping`."""
    runs = []
    for n in (8, 24):
        with OpCount("step setup and bookkeeping") as c, marked(parts, c.label):
            dec.generate([prompt], n, **kw)
        runs.append((c, dec.last["iterations"]))
    (c1, i1), (c2, i2) = runs
    return {k: ((c2.ops[k] - c1.ops[k]) / (i2 - i1), (c2.kernels[k] - c1.kernels[k]) / (i2 - i1))
            for k in c2.ops}


def ops_rows(model, P, prompt, k: int, tree: TreeSpec, row, fold: bool | None = None,
             temperature: float = 0.0) -> None:
    """Aten ops dispatched per decode step, eagerly (graphs off): each is one kernel or more
    that a captured step replays, so the count is the launch-bound part of a step; for the tree
    and the chain also by part of the step (at batch 1 a captured step's time beyond its
    forwards is about its kernel count)."""
    dec = Decoder(model, max_batch=1, cuda_graphs=False, fold=fold)

    def total(**kw) -> int:
        return round(sum(ops for ops, _ in counts_per_step(dec, prompt, **kw).values()))

    row("aten ops per step: plain", total(), "ops")
    # the prefill runs eagerly (its shapes vary): launch-bound at batch 1 on a GPU
    for name, kw in (("plain", {}), ("speculative", {"proposer": P, "tree": TreeSpec.chain(k)})):
        with OpCount() as c, marked([(dec, "_prefill", "prefill")], c.label):
            dec.generate([prompt], 1, **kw)
        row(f"aten ops in the prefill of {len(prompt)} tokens: {name}",
            f"{c.ops['prefill']} / {c.kernels['prefill']}", "ops / kernels")
    for T in (0.0, 1.0):
        for fast in (False, True):
            dec.fast_chain = fast
            torch.manual_seed(0)
            row(f"aten ops per step: chain K={k}, T={T:g}, "
                f"{'chain step' if fast else 'general tree step'}",
                total(proposer=P, tree=TreeSpec.chain(k), temperature=T), "ops")
    T = temperature
    for tr in (tree, TreeSpec.chain(k)):
        by = counts_per_step(dec, prompt, step_parts(dec, P), proposer=P, tree=tr, temperature=T)
        if tr is tree:
            row(f"aten ops per step: {tree.label()}, T={T:g}",
                round(sum(o for o, _ in by.values())), "ops")
            if T == 0:
                stats = counts_per_step(dec, prompt, proposer=P, tree=tr, tree_stats=True)
                row(f"  {tree.label()}, T=0: kernels tree_stats adds (evaluate's tree counts)",
                    round(sum(k for _, k in stats.values()) - sum(k for _, k in by.values())),
                    "kernels")
        for part, (ops, kernels) in by.items():
            row(f"  {tr.label()}, T={T:g}: {part}", f"{ops:.0f} / {kernels:.0f}",
                "ops / kernels")


def phase_profile(model, P, prompts, tree: TreeSpec, steps: int = 16,
                  temperature: float = 0.0) -> str:
    """Where a speculative step's time goes: the step run eagerly (graphs off: the same kernels,
    launched one by one) under torch.profiler, its parts (step_parts) marked with
    record_function. Returns a table of GPU and CPU milliseconds per step by part (a part's time
    includes the parts nested in it: build_tree's, its drafter forwards), then the top kernels
    by GPU time."""
    from torch.profiler import ProfilerActivity, profile, record_function

    dec = Decoder(model, max_batch=len(prompts), cuda_graphs=False)
    dec.generate(prompts, 8, proposer=P, tree=tree, temperature=temperature)   # warm-up
    parts = step_parts(dec, P)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                     else [])
    with profile(activities=acts) as prof, marked(parts, record_function):
        with record_function("step (all)"):
            dec.generate(prompts, steps, proposer=P, tree=tree, temperature=temperature)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    n = max(dec.last["iterations"], 1)
    ka = prof.key_averages()
    labels = ["step (all)"] + list(dict.fromkeys(label for _, _, label in parts))
    lines = [f"{tree.label()}, T={temperature:g}, batch {len(prompts)}: ms per step over {n} "
             f"eager steps "
             f"(prefill included in 'step (all)')",
             "| part | GPU ms | CPU ms |", "|---|---:|---:|"]
    for e in sorted((e for e in ka if e.key in labels), key=lambda e: labels.index(e.key)):
        gpu = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0))
        lines.append(f"| {e.key} | {gpu / 1e3 / n:.3f} | {e.cpu_time_total / 1e3 / n:.3f} |")
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return "\n".join(lines) + "\n" + ka.table(sort_by=sort, row_limit=15)


def prefill_profile(dec, P, k: int, prompts: list) -> str:
    """Batch-1 prefills at prompt lengths new to each method, under torch.profiler: per prefill,
    the host's time (what evaluate's prefill_seconds counts), and the GPU and CPU time inside the
    prefill, the target model's forwards and (speculative) the drafter's observe calls; then each
    method's top ops by self CPU time. Where the speculative prefill's extra time goes (eager,
    23-27 ms a prompt more than the plain one on the H200, about 4 ms of it in extra kernels)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    half = len(prompts) // 2
    lines = ["| prefill, batch 1 | method | GPU ms | CPU ms |", "|---|---|---:|---:|"]
    tables = []
    for name, p, ps in (("plain", None, prompts[:half]), ("speculative", P, prompts[half:])):
        parts = [(dec, "_prefill", "prefill"), (dec.target.model, "forward", "target model")]
        parts += [(p, "observe", "drafter observe")] if p is not None else []
        with profile(activities=acts) as prof, marked(parts, record_function):
            dec.generate(ps, 1, proposer=p, tree=TreeSpec.chain(k) if p else None)
            if cuda:
                torch.cuda.synchronize()
        n = len(ps)
        lines.append(f"| host time (prefill_seconds) | {name} | | "
                     f"{1e3 * dec.last['prefill_seconds'] / n:.3f} |")
        ka = prof.key_averages()
        for e in ka:
            if e.key in ("prefill", "target model", "drafter observe"):
                gpu = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0))
                lines.append(f"| {e.key} | {name} | {gpu / 1e3 / n:.3f} | "
                             f"{e.cpu_time_total / 1e3 / n:.3f} |")
        tables.append(f"-- {name}: top ops by self CPU time over {n} prefills\n"
                      + ka.table(sort_by="self_cpu_time_total", row_limit=15))
    return "\n".join(lines) + "\n" + "\n".join(tables)


def eval_rows(model, P, a, row, graphs: bool, fold) -> None:
    """Evaluate's own decoding (drafter.steps.evaluate._decode: continuous batching, plain
    timed without runners-up and again recording them, greedy trees' shape counts) on the eval
    sets under --eval-sets, and its figures (drafter.measure.summary, Decoder.parts_ms): per
    batch size, plain and each method's decode step, its GPU time, its parts at the shapes its
    steps ran at and the ratio, as evaluate's report gives them for the same prompts and
    drafter."""
    from drafter.core.target import load_tokenizer
    from drafter.data.sources import load_prompts
    from drafter.decoding.decode import stop_ids_of
    from drafter.measure.summary import overall, summarize, with_parts
    from drafter.steps.evaluate import _decode, _Prompts

    d = Path(a.eval_sets)
    sets = [("mt_bench", d / "mt_bench_questions.jsonl"), ("humaneval", d / "humaneval.jsonl.gz"),
            ("gsm8k", d / "gsm8k_test.jsonl")]
    tok = load_tokenizer(TargetConfig(model=a.target))
    stop = stop_ids_of(tok, model)
    depth, topk, tokens = (int(x) for x in a.tree.split(","))
    for B in (int(x) for x in a.batches.split(",")):
        dec = Decoder(model, max_batch=B, cuda_graphs=graphs, fold=fold)
        prompts = {n: _Prompts(tok, load_prompts(str(p), a.eval_prompts), 8192, a.new_tokens)
                   for n, p in sets}
        first = prompts["mt_bench"].build(0, {})[:B]
        dec.generate([ids for _, ids in first], 2, stop_ids=stop)          # warm-up
        for label, prop, tree, gaps in [  # plain as evaluate times it, and its recording pass
                ("plain", None, None, False), ("plain recording runners-up", None, None, True),
                ("chain", P, TreeSpec.chain(a.k), False),
                ("tree", P, TreeSpec(depth, topk, tokens), False)][:4 if a.kind == "eagle3"
                                                                   else 3]:
            per = {}
            for n, pr in prompts.items():
                outs, stats = _decode(dec, pr, pr.rounds or None, a.new_tokens, stop, 0.0,
                                      prop, tree, continuous=True, record_gaps=gaps)
                per[n] = summarize(outs, stats, tree)
            o = overall(per, tree)
            o = with_parts(o, dec.parts_ms(prop, tree, o["spans"]))
            name = label if tree is None else tree.label()
            row(f"evaluate's decoding, {name}, batch {B}, {o['prompts']} prompts: decode step / "
                f"GPU / parts ms; x parts; GPU x parts; tau",
                f"{o['decode_step_ms']} / {o.get('step_gpu_ms')} / {o['parts_ms']}; "
                f"{o['x_parts']}; {o.get('gpu_x_parts')}; {_r2(o.get('tau'))}", "")
        del dec


def _r2(x):
    return None if x is None else round(x, 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--drafter", help="drafter dir (checkpoint, native or speculators)")
    ap.add_argument("--tiny", action="store_true", help="tiny random target, small sizes (CPU)")
    ap.add_argument("--random-target", action="store_true",
                    help="SmolLM2-135M's shape with random weights instead of --target (no model "
                    "files needed; the step times are the real model's, tau is not)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=5, help="chain length K (a block drafter's block)")
    ap.add_argument("--kind", choices=["eagle3", "dspark", "dflash"], default="eagle3",
                    help="the random drafter's kind (a block drafter: chains only)")
    ap.add_argument("--tree", default="6,8,48", help="depth,topk,tokens")
    ap.add_argument("--batches", default="1", help="rows decoded together, e.g. 1,64")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="decode the step rows (plain, chain, tree; --profile and --ops by "
                         "part) at this temperature: > 0 samples, verified by rejection "
                         "sampling; the parts (the forwards) are the greedy steps' own")
    ap.add_argument("--profile", action="store_true",
                    help="top CUDA kernels of a chain step (graphs on), and per batch size the "
                    "chain's and the tree's time by part (eager steps, record_function ranges)")
    ap.add_argument("--no-graphs", action="store_true", help="disable CUDA graphs")
    ap.add_argument("--fold", choices=["auto", "on", "off"], default="auto",
                    help="batch-1 verifications as T rows of one token (StaticTarget's fold): "
                         "auto (the default: on a GPU only), on, or off (for an A/B)")
    ap.add_argument("--ops", action="store_true",
                    help="aten ops per step (plain; chain at T=0 and T=1: general tree step "
                         "and its chain step; tree), and the tree's and the chain's by part of "
                         "the step: the kernels a graph replays, counted eagerly")
    ap.add_argument("--prefill-lengths", type=int, default=8,
                    help="time batch-1 prefills at this many prompt lengths new to each method "
                         "(evaluate's prefills; 0: skip)")
    ap.add_argument("--profile-prefill", action="store_true",
                    help="with --prefill-lengths N: N more prefills per method under "
                         "torch.profiler (where the speculative prefill's time goes)")
    ap.add_argument("--eval-sets", metavar="DIR",
                    help="also run evaluate's own decoding (continuous batching, its figures) on "
                    "the eval sets in DIR (MT-bench both turns, HumanEval, GSM8K), at --batches, "
                    "--new-tokens, --k and --tree; needs a target with a tokenizer")
    ap.add_argument("--eval-prompts", type=int, default=200,
                    help="with --eval-sets: at most this many records a set")
    ap.add_argument("--skip-steps", action="store_true",
                    help="leave out the fixed-prompt step rows (with --eval-sets)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--top-chunks", type=int,
                    help="the tree's top-k searches in chunks of this many columns "
                         "(drafter.decoding.tree.TOP_CHUNKS; default: its own)")
    ap.add_argument("--no-fused-search", action="store_true",
                    help="a greedy tree's expansion by eager kernels (top_indices, log_softmax), "
                         "not tree.fused_children's one Triton kernel "
                         "(drafter.decoding.tree.FUSED_SEARCH)")
    a = ap.parse_args(argv)
    from drafter.decoding import tree as tree_mod  # build_tree reads these settings every expansion
    if a.top_chunks:
        tree_mod.TOP_CHUNKS = (a.top_chunks,)
    tree_mod.FUSED_SEARCH = not a.no_fused_search
    fold = {"auto": None, "on": True, "off": False}[a.fold]
    tmp = None
    if a.tiny:
        tmp = tempfile.TemporaryDirectory()
        a.target = tiny_target(Path(tmp.name) / "tiny")
        a.prompt_tokens, a.new_tokens = 16, 8
    elif a.random_target:
        tmp = tempfile.TemporaryDirectory()
        a.target = random_smollm2(Path(tmp.name) / "smollm2-random")
    depth, topk, tokens = (int(x) for x in a.tree.split(","))
    graphs = not a.no_graphs

    model = load_model(TargetConfig(model=a.target))
    dev, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    if a.drafter:
        from drafter.export.enginedir import load_drafter_dir
        from drafter.train.dspark import is_block_config
        from drafter.train.dspark import load_model as load_block

        own = Path(a.drafter) / "drafter_config.json"
        dr = load_block(a.drafter, device=dev, dtype=dtype) \
            if own.exists() and is_block_config(json.loads(own.read_text())) \
            else load_drafter_dir(a.drafter, device=dev, dtype=dtype)
    elif a.kind != "eagle3":
        dr = random_block_drafter(model.config, 32000 if not a.tiny else 1024, a.kind, a.k)
    else:
        dr = random_drafter(model.config, 32000 if not a.tiny else 1024)
    a.kind = getattr(dr.cfg, "method", "eagle3")
    if a.kind != "eagle3" and (a.ops or a.profile):
        ap.error("--ops and --profile mark an EAGLE-3 step's parts: not a block drafter's")
    V = model.config.get_text_config().vocab_size
    torch.manual_seed(1)
    prompt = torch.randint(100, V, (a.prompt_tokens,)).tolist()
    rows = []

    def row(name, value, unit, goal=None, ok=None):
        rows.append({"measurement": name, "value": value, "unit": unit, "goal": goal,
                     "ok": ok})

    # -- plain and speculative steps at each batch size (every row decodes the same prompt)
    P = proposer_for(dr)
    n1 = a.new_tokens
    if a.eval_sets:
        eval_rows(model, P, a, row, graphs, fold)
    for B in (int(x) for x in a.batches.split(",") if not a.skip_steps):
        dec = Decoder(model, max_batch=B, cuda_graphs=graphs, fold=fold)
        prompts = [prompt] * B
        T = a.temperature
        at_t = f", T={T:g}" if T else ""
        dec.generate(prompts, 8, temperature=T)  # warm-up (kernels, allocator)
        dec.generate(prompts, n1, temperature=T)
        plain_ms = 1000 * (dec.last["seconds"] - dec.last["prefill_seconds"]) \
            / dec.last["iterations"]
        row(f"plain decode step, batch {B}{at_t}", round(plain_ms, 3), "ms")
        at = dec.parts_ms(None, None, dict(dec.last["spans"]))["parts_ms"]
        row("  step / a target forward at the spans its steps ran at (evaluate's x parts)",
            f"{plain_ms / at:.3f}", "")
        # evaluate's step_ms counts the prefills (its decode_step_ms does not): at batch 1 one
        # prompt's prefill is spread over that prompt's steps only
        row(f"  prefill of {a.prompt_tokens} tokens x {B} (plain)",
            round(1000 * dec.last["prefill_seconds"], 3), "ms")
        for tree in (TreeSpec.chain(a.k), TreeSpec(depth, topk, tokens))[
                :2 if a.kind == "eagle3" else 1]:
            dec.generate(prompts, 8, proposer=P, tree=tree, temperature=T)
            outs = dec.generate(prompts, n1, proposer=P, tree=tree, temperature=T)
            step = 1000 * (dec.last["seconds"] - dec.last["prefill_seconds"]) \
                / dec.last["iterations"]
            spans = dict(dec.last["spans"])
            tau = acceptance_stats(outs[0].hist)["tau"]
            row(f"speculative step, {tree.label()}, batch {B}{at_t}", round(step, 3), "ms",
                "<= 10" if B == 1 else None, step <= 10 if B == 1 else None)
            pre = 1000 * dec.last["prefill_seconds"]
            t = dec.time_forwards(P, tree, batch=B, context=a.prompt_tokens)
            row(f"  prefill of {a.prompt_tokens} tokens x {B} (the target and the drafter)",
                round(pre, 3), "ms")
            row(f"  target forward 1 token / verify {tree.nodes + 1} tokens / "
                + ("the block's forward / a Markov position" if "markov_ms" in t else
                   f"drafter forward {tree.topk} tokens"),
                " / ".join(f"{t[k]:.3f}" for k in ("target_ms", "verify_ms", "draft_ms",
                                                   "markov_ms") if k in t), "ms")
            drafting = draft_parts(t, tree.depth)
            parts = t["verify_ms"] + drafting
            row("  c = drafting / verification; step / (verify + drafting); tau",
                f"{drafting / t['verify_ms']:.4f}; {step / parts:.2f}; {tau:.2f}", "")
            at = dec.parts_ms(P, tree, spans)["parts_ms"]
            row("  step / its parts at the spans its steps ran at (evaluate's x parts)",
                f"{step / at:.3f}", "")
            if a.profile and dev.type == "cuda" and tree.is_chain:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    dec.generate(prompts, 32, proposer=P, tree=tree, temperature=T)
                    torch.cuda.synchronize()
                print(f"-- chain step, batch {B}: top kernels over "
                      f"{dec.last['iterations']} steps")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))
            if a.profile:
                print(phase_profile(model, P, prompts, tree, temperature=T))
        del dec

    if a.prefill_lengths:
        # evaluate prefills each prompt once, one shape per prompt length: eager, a backend with
        # a per-shape setup cost (cuDNN attention's plans) charges it to the first method to
        # meet a length; graphed (evaluate's default, prefill_graph_tokens), each padded length
        # is captured once, the capture not counted. Each method here meets lengths new to it.
        n = a.prefill_lengths
        lens = random.Random(0).sample(range(a.prompt_tokens // 2, 4 * a.prompt_tokens), 2 * n)
        for how, pgt in (("graphed", EvaluateConfig().prefill_graph_tokens), ("eager", 0)):
            dec = Decoder(model, max_batch=1, cuda_graphs=graphs, fold=fold,
                          prefill_graph_tokens=pgt)
            for name, p, ls in (("plain", None, lens[:n]), ("speculative", P, lens[n:])):
                dec.generate([torch.randint(100, V, (L,)).tolist() for L in ls], 1, proposer=p,
                             tree=TreeSpec.chain(a.k) if p else None)
                row(f"prefill at {n} new prompt lengths, batch 1, {name}, {how}: ms each",
                    round(1000 * dec.last["prefill_seconds"] / n, 3), "ms")
        if a.profile_prefill:  # eager prefills, lengths new to this decoder, half each method
            lens = random.Random(1).sample(sorted(set(range(a.prompt_tokens // 2,
                                                            4 * a.prompt_tokens)) - set(lens)),
                                           2 * n)
            print(prefill_profile(dec, P, a.k, [torch.randint(100, V, (L,)).tolist()
                                                for L in lens]))
        del dec

    if a.ops:
        ops_rows(model, P, prompt, a.k, TreeSpec(depth, topk, tokens), row, fold, a.temperature)

    dev_name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"\ndecode speed: {a.target} on {dev_name} ({dtype}), CUDA graphs "
          f"{'on' if graphs and dev.type == 'cuda' else 'off'}, torch {torch.__version__}")
    w = max(len(r["measurement"]) for r in rows)
    print(f"| {'measurement'.ljust(w)} | value | unit | goal | ok |")
    print(f"|{'-' * (w + 2)}|---|---|---|---|")
    for r in rows:
        ok = "" if r["ok"] is None else ("yes" if r["ok"] else "NO")
        print(f"| {r['measurement'].ljust(w)} | {r['value']} | {r['unit']} | {r['goal'] or ''} "
              f"| {ok} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"target": a.target, "device": dev_name,
                                            "rows": rows}, indent=2))
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
