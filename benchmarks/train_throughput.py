"""Training throughput of the EAGLE-3 drafter: tokens/s, MFU and peak memory, beside SpecForge.

Headline figure (BENCHMARKS.md, Training): drafter's training step against SpecForge 0.2.0's own
EAGLE-3 model and step at the same shape, in the same process, on one H200:

    pip install --no-deps specforge==0.2.0                     # the anchor (or drafter[bench])
    python benchmarks/train_throughput.py --shape smollm2 --teacher topk,hidden
    python benchmarks/train_throughput.py --shape llama8b --seq 2048 --teacher topk,hidden
    python benchmarks/train_throughput.py --shape llama8b --seq 4096 --teacher topk,hidden
    python benchmarks/train_throughput.py --shape kimi --teacher topk,hidden
    python benchmarks/train_throughput.py --shape kimi --teacher topk --draft-layer mla
    python benchmarks/train_throughput.py --shape kimi --teacher topk --method dspark

It prints one line per run (tokens/s, ms a step, warm-up, the fast path's loss against the exact
path's), SpecForge's line, then a markdown table: tokens/s, step ms, GFLOP/token, MFU, peak GiB,
plan's GiB and peak / plan, the anchor's tokens/s, GiB and MFU (the same FLOP count at its
tokens/s), and x anchor (ours over SpecForge's tokens/s). Other uses:

    python benchmarks/train_throughput.py                       # shapes (a) and (b), one GPU
    python benchmarks/train_throughput.py --shape llama8b --seq 4096
    python benchmarks/train_throughput.py --shape smollm2 --data runs/quickstart   # real shards
    python benchmarks/train_throughput.py --real --shape smollm2   # 200 steps of chat-like rows
    python benchmarks/train_throughput.py --real --online          # online vs offline, SmolLM2
    torchrun --nproc-per-node 2 benchmarks/train_throughput.py --shape llama8b     # DDP scaling
    python benchmarks/train_throughput.py --tiny [--real [--online]]   # CPU: checks the script

Shapes, TTT 7 steps, one sample per row unless --data or --real:
    smollm2  (a) H = Ht = 576, 9 / 3 heads of 64, I 1536, V 49152, Vd 32000, batch 4 × 2048
    llama8b  (b) H = Ht = 4096, 32 / 8 heads of 128, I 14336, V 128256, Vd 32000, batch 1 × 2048
    kimi     H = Ht = 7168, 64 / 64 heads of 128, I 18432, V 163840, Vd 32000, batch 1 × 4096:
             the drafter drafter derives for Kimi-K2.5 (DrafterConfig.from_target: head_dim =
             v_head_dim for MLA targets), which is SpecForge's Kimi-K2.5 drafter shape
             (configs/kimi-k25-eagle3.json; its rope_theta 1e6 against our 50,000 costs the same).
             --online --target DIR trains it beside benchmarks/kimi_slice.py's target.
    kimi-tiny  H = Ht = 64, 4 / 4 heads of 128, I 128, V = Vd = 49152, batch 2 × 512, TTT 3: the
             drafter of benchmarks/kimi_slice.py --tiny (CPU: the draft layers compared)
    tiny     H = Ht = 64, 4 / 2 heads of 16, I 128, V 1024, Vd 512, batch 2 × 128, TTT 3

One timed step is exactly drafter train's (drafter/train/trainer.py; batches from
drafter/train/batches.py): the host batch (pinned, built once: collate, align, embedding lookup on
the CPU) goes to the device, the teacher is formed (`--teacher topk`: k=64 draft-vocab log-probs as
stored, never densified; `hidden`: the final hidden state through the draft-vocab head into dense
log-probs), then `train_step`: TTT forward + fused loss, backward, gradient scaling, clip, fused
AdamW. Random features: aux N(0, 1), all tokens in the loss. With --data RUN_DIR the batches
are real packed rows from the run's extract shards (the prefetch thread included).

--real (warm-up and recompiles on real runs). Samples of chat-like lengths (log-normal,
median 250 tokens, clipped to 50..2048: the reference run's regenerated data averaged 335), a
prompt of 10-50% of each out of the loss, packed first-fit into rows of --seq and grouped into
micro-batches exactly as train does, built on the prefetch thread; every micro-batch has its own
number of loss rows and its own packing. Features are views into one random pool (memory stays
that of the pool). It trains --steps (default 200) steps from a cold start and reports warm-up
(seconds to the end of step 10, compiles included), the average tokens/s over all steps, the
steady tokens/s (median of the per-step rates of the last half), their ratio (goal >= 0.85),
and the graphs torch.compile built (after warm-up: goal 0). Per-step times are CUDA events, so
the loop never waits on the GPU. As train does, both modes freeze what is alive out of Python's
garbage collections after the warm-up (--real: after the first step; trainer.GcClock); each
result holds `gc_s`, the collections' seconds in the timed steps.
--online trains the same way with the target in the loop (drafter/features/capture.py on the
prefetch thread, nothing stored) after the offline run, and prints the ratio (goal >= 0.7x offline
for SmolLM2): `--target random` (default) is a SmolLM2-135M-shaped Llama with random weights (its
lm_head rows outside the draft vocab zeroed, so that nearly every position is in the vocab, as the
synthetic offline rows are), or any target spec
(builtin:smollm2-135m-instruct, a path).

FLOPs per trained token, counted (multiply-add = 2 FLOPs; backward = 2 × forward):
    fc         3·Ht·H MACs forward; backward only the weight gradient      -> 12·Ht·H
    per TTT step i (K of them):
      layer    L = 2H·(nh + 2·nkv)·hd + nh·hd·H + 3·H·I MACs               -> 6·L
      lm_head  H·Vd MACs for each position in the loss (r_i of a token)    -> 6·H·Vd·r_i
      attention  QKᵀ and PV over the κ causal keys of a token in its sample + i diagonal keys:
               2·nh·hd·(κ + i) MACs                                        -> 12·nh·hd·(κ + i)
    --draft-layer mla (drafter/train/mla.py, latent sizes qr, kr, dn, dr, dv, dqk = dn + dr):
      layer    L = 2H·(qr + kr + dr) + qr·nh·dqk + kr·nh·(dn + dv) + nh·dv·H + 3·H·I
      attention  nh·(dqk + dv)·(κ + i) MACs                                -> 6·nh·(dqk+dv)·(κ+i)
    teacher (hidden only, not in MFU): Ht·Vd MACs forward                  -> 2·Ht·Vd
One sample per row with every token in the loss: κ = (T+1)/2, r_i = 1; --real measures the mean
κ and Σ r_i of its batches. MFU = model FLOPs per token × tokens/s / peak, against the H200's
datasheet bf16 dense 989 TFLOP/s (--peak-tflops) and its measured matmul rate 790
(--measured-tflops; ../shared/docs/REFERENCES.md). For (b) at 2048 this count gives
16.3 GFLOP/token, so the anchor's 23,300 tokens/s is 48% of 790.
Peak memory: torch.cuda.max_memory_allocated over the timed steps (reset after warm-up; --real:
the whole run), beside `drafter plan`'s estimate for the same train (drafter/train/memory.py
train_gpu_bytes over this drafter, batch and TTT; online, the target's part is not in it): the
`plan GiB` and `peak / plan` columns (goal 0.85-1.15). --json writes every row and the anchors.

The anchor (benchmarks/specforge_anchor.py): when `import specforge` works on a CUDA machine
(`pip install 'drafter[bench]'`), SpecForge's own model and training step run at the same shape
and features (one sample per row, its hidden teacher) and each table row shows the ratio to it;
otherwise a line says why it was skipped, and the ratio is to SpecForge's figures recorded
on an H200 before (ANCHOR).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import specforge_anchor  # noqa: E402
from op_count import OpCount  # noqa: E402

from drafter.core import config as C  # noqa: E402
from drafter.core.dist import close_dist, dist_env  # noqa: E402
from drafter.features.capture import Head  # noqa: E402
from drafter.train import (
    batches,  # noqa: E402
    trainer,
)
from drafter.train import merge as merge_mod  # noqa: E402
from drafter.train.dspark import DSpark, DSparkConfig  # noqa: E402
from drafter.train.losses import objective  # noqa: E402
from drafter.train.metrics import throughput  # noqa: E402
from drafter.train.model import Drafter, DrafterConfig, param_count  # noqa: E402

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, draft_vocab_size=32000,
                    target_hidden_size=576, rope_theta=100000.0, batch=4, seq=2048, ttt=7),
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, vocab_size=128256,
                    draft_vocab_size=32000, target_hidden_size=4096, rope_theta=500000.0,
                    batch=1, seq=2048, ttt=7),
    "kimi": dict(hidden_size=7168, intermediate_size=18432, num_attention_heads=64,
                 num_key_value_heads=64, head_dim=128, vocab_size=163840, draft_vocab_size=32000,
                 target_hidden_size=7168, rope_theta=50000.0, batch=1, seq=4096, ttt=7),
    # the drafter drafter derives for benchmarks/kimi_slice.py --tiny (head_dim = v_head_dim),
    # over its whole vocab: BENCHMARKS.md, "Draft layer: MLA against Llama"
    "kimi-tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=4, head_dim=128, vocab_size=49152,
                      draft_vocab_size=49152, target_hidden_size=64, rope_theta=50000.0,
                      batch=2, seq=512, ttt=3),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1024, draft_vocab_size=512,
                 target_hidden_size=64, batch=2, seq=128, ttt=3),
}
# --draft-layer mla: the MLA draft layer with its target's latent sizes (kimi: Kimi-K2.5's;
# kimi-tiny and tiny: benchmarks/kimi_slice.py --tiny's) and DeepSeek's YaRN of that target
MLA_SIZES = {
    "kimi": dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128, rope_scaling={"rope_type": "yarn", "factor": 64.0, "mscale": 1.0,
                                               "mscale_all_dim": 1.0, "beta_fast": 1.0,
                                               "beta_slow": 1.0,
                                               "original_max_position_embeddings": 4096}),
    "kimi-tiny": dict(q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128,
                      rope_scaling={"rope_type": "yarn", "factor": 16.0, "mscale": 1.0,
                                    "mscale_all_dim": 1.0, "beta_fast": 1.0, "beta_slow": 1.0,
                                    "original_max_position_embeddings": 64}),
    "tiny": dict(q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128, rope_scaling={"rope_type": "yarn", "factor": 16.0, "mscale": 1.0,
                                               "mscale_all_dim": 1.0, "beta_fast": 1.0,
                                               "beta_slow": 1.0,
                                               "original_max_position_embeddings": 64}),
}
# SpecForge, the widely used open-source trainer, recorded on an H200: (shape, seq) -> tokens/s,
# GiB;
# the ratio falls back to these when SpecForge cannot run here
ANCHOR = {("llama8b", 2048): (23_300, 9.1), ("llama8b", 4096): (24_900, 14.7),
          ("smollm2", 2048): (78_000, 18.3)}


def flops_per_token(c: DrafterConfig, T: int, K: int, teacher: str, keys: float | None = None,
                    head_rows: float | None = None) -> tuple[float, float]:
    """(model FLOPs, teacher FLOPs) per trained token: the count in the docstring. keys: κ, the
    mean causal keys of a token ((T+1)/2 by default); head_rows: Σ r_i (K by default)."""
    H, Ht, nh, nkv, hd = (c.hidden_size, c.target_hidden_size, c.num_attention_heads,
                          c.num_key_value_heads, c.head_dim)
    keys = (T + 1) / 2 if keys is None else keys
    head_rows = K if head_rows is None else head_rows
    layer = 2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * c.intermediate_size
    per_key = 2 * nh * hd                                     # QKᵀ and PV MACs for one key
    if c.draft_layer == "mla":
        qr, kr = c.q_lora_rank or 0, c.kv_lora_rank
        dn, dr, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q = 2 * H * qr + qr * nh * (dn + dr) if qr else 2 * H * nh * (dn + dr)
        layer = (q + 2 * H * (kr + dr) + kr * nh * (dn + dv) + nh * dv * H
                 + 3 * H * c.intermediate_size)
        per_key = nh * (dn + dr + dv)
    model = 12 * Ht * H * len(c.aux_layer_ids) / 3 + 6 * H * c.draft_vocab_size * head_rows
    for i in range(K):
        model += 6 * layer + 6 * per_key * (keys + i)
    return model, (2 * Ht * c.draft_vocab_size if teacher == "hidden" else 0.0)


def block_flops_per_token(d: DSparkConfig, T: int, anchors: int, teacher: str):
    """(model FLOPs, teacher FLOPs) per trained token of a block drafter (forward + backward,
    6 per multiply-add of a weight): fc and every layer's context keys and values once a
    token; anchors · Q / T block queries a token, each through every layer (projections, MLP,
    attention over about half a row of context plus its block); anchors · K / T drafts a token
    through lm_head (and the Markov columns)."""
    H, nh, nkv, hd, I = (d.hidden_size, d.num_attention_heads, d.num_key_value_heads,
                         d.head_dim, d.intermediate_size)
    n = len(d.layers) if hasattr(d, "layers") else d.num_hidden_layers
    ctx = 6 * H * d.target_hidden_size * len(d.target_layer_ids) + n * 6 * H * 2 * nkv * hd
    q_per_tok, drafts = anchors * d.queries / T, anchors * d.block_size / T
    layer = 6 * (H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * I)
    attn = 6 * 2 * nh * hd * (T / 2 + d.queries)
    model = ctx + q_per_tok * n * (layer + attn) \
        + 6 * (H + d.markov_rank) * d.draft_vocab_size * drafts
    return model, (2 * d.target_hidden_size * d.draft_vocab_size * drafts
                   if teacher == "hidden" else 0.0)


def block_config(c: DrafterConfig, args) -> DSparkConfig:
    """The block drafter --method trains at a shape: its heads and sizes, five target layers,
    train.dspark's defaults unless the command says otherwise."""
    bc = C.BlockDrafterConfig()
    return DSparkConfig(
        method=args.method, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=args.draft_layers or bc.layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, vocab_size=c.vocab_size, draft_vocab_size=c.draft_vocab_size,
        target_hidden_size=c.target_hidden_size, target_layer_ids=[2, 4, 6, 8, 10],
        block_size=args.block_size or bc.block_size, mask_token_id=c.vocab_size - 1,
        markov_rank=bc.markov_rank if args.method == "dspark" else 0,
        confidence_head=args.method == "dspark", anchor_predicts=args.method == "dspark",
        rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings)


def mfu(model_flops: float, tok_s: float | None, tflops: float, world: int, on: bool):
    return model_flops * tok_s / (tflops * 1e12 * world) if on and tok_s else None


# ----------------------------------------------------------------------- the drafter, as train
def shape_config(name: str, args, layer_ids: list[int] | None = None):
    """(drafter config, B, T, K) of a shape under the command's overrides."""
    shape = dict(SHAPES[name])
    B, T, K = args.batch or shape.pop("batch"), args.seq or shape.pop("seq"), shape.pop("ttt")
    shape.pop("batch", None), shape.pop("seq", None)
    K = args.ttt or K
    if getattr(args, "draft_layer", "llama") == "mla":  # the target's latent sizes (MLA_SIZES)
        m = MLA_SIZES[name]
        shape.update(draft_layer="mla", **m, num_key_value_heads=shape["num_attention_heads"],
                     head_dim=m["qk_nope_head_dim"] + m["qk_rope_head_dim"])
    c = DrafterConfig(aux_layer_ids=layer_ids or [2, 16, 29],
                      max_position_embeddings=max(8192, T + K), **shape)
    return c, B, T, K


def setup(c: DrafterConfig, B: int, T: int, K: int, args, dist, attention: str) -> dict:
    """The drafter, a random draft-vocab head, and the model and optimizer as train sets them
    up (drafter/train/trainer.py)."""
    cuda = dist.device.type == "cuda"
    block = [f"train.method={args.method}", f"train.dspark.anchors={args.anchors}"]
    cfg = C.load(None, [*(block if args.method != "eagle3" else ()),
                        f"train.ttt_steps={K}", f"train.max_length={T}",
                        f"train.batch_tokens={B * T}", f"train.attention={attention}",
                        f"train.compile={str(not args.no_compile).lower()}",
                        f"train.loss_chunk={args.loss_chunk}", f"extract.topk={args.topk}"])
    tc = cfg.train
    attention = trainer.pick_attention(tc, dist.device)
    torch.manual_seed(0)
    drafter = Drafter(c) if args.method == "eagle3" else DSpark(block_config(c, args))
    drafter.embed_tokens.to(torch.bfloat16)
    head = Head((torch.randn(c.draft_vocab_size, c.target_hidden_size) * 0.05)
                .to(torch.bfloat16)).to(dist.device)
    ttt, model, opt = trainer.setup_model(drafter, tc, dist, attention, objective(cfg))
    amp = torch.autocast(dist.device.type, dtype=torch.bfloat16) if cuda else \
        torch.autocast("cpu", enabled=False)
    return dict(cfg=cfg, tc=tc, attention=attention, drafter=drafter, head=head, model=model,
                opt=opt, obj=ttt.obj,
                params=[p for p in ttt.parameters() if p.requires_grad], amp=amp, cuda=cuda,
                fused=attention == "flex")


def plan_bytes(S: dict, teacher: str, online: bool, world: int) -> dict:
    """`drafter plan`'s GPU bytes for this train by part, and their total (drafter/train/
    memory.py), the target's own memory left out."""
    from drafter.train.memory import train_gpu_bytes

    d, c, cfg = S["drafter"], S["drafter"].cfg, S["cfg"]
    cfg.train.online, cfg.extract.teacher = online, teacher
    shape = {"trainable": sum(p.numel() for p in d.parameters() if p.requires_grad),
             "total": sum(p.numel() for p in d.parameters()), "hidden_size": c.hidden_size,
             "intermediate_size": c.intermediate_size, "draft_vocab_size": c.draft_vocab_size,
             "draft_layers": getattr(c, "num_hidden_layers", 1)}
    ids = c.target_layer_ids if isinstance(c, DSparkConfig) else c.aux_layer_ids
    return train_gpu_bytes(cfg, shape, world, c.target_hidden_size, len(ids))


def row(name: str, args, dist, S: dict, B, T, K, teacher: str, tok_s, model_f,
        online: bool = False) -> dict:
    on = S["cuda"] or args.peak_tflops_cpu
    mem = torch.cuda.max_memory_allocated(dist.device) / 2**30 if S["cuda"] else None
    parts = plan_bytes(S, teacher if teacher in ("topk", "hidden") else "topk", online,
                       dist.world)
    plan = parts["total"] / 2**30
    return {"shape": name, "seq": T, "batch": B, "ttt": K, "attention": S["attention"],
            "compile": not args.no_compile and S["cuda"], "teacher": teacher,
            "world": dist.world, "params": param_count(S["drafter"]), "tok_s": tok_s,
            "gflop_tok": model_f / 1e9,
            "mfu": mfu(model_f, tok_s, args.peak_tflops, dist.world, on),
            "mfu_measured": mfu(model_f, tok_s, args.measured_tflops, dist.world, on),
            "mem_gib": mem, "plan_gib": plan, "mem_over_plan": mem / plan if mem else None,
            "plan_parts_gib": {k: v / 2**30 for k, v in parts.items()}}


# ------------------------------------------------------------- fixed rows: one sample per row
def random_samples(c: DrafterConfig, B: int, T: int, teacher: str, k: int, seed: int,
                   n_aux: int = 3):
    """B per-sample dicts (docs/internals.md) of T tokens with random features."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(B):
        s = {"input_ids": torch.randint(0, c.vocab_size, (T,), generator=g),
             "loss_mask": torch.ones(T, dtype=torch.long),
             "in_vocab": torch.ones(T, dtype=torch.bool),
             "aux": torch.randn(T, n_aux, c.target_hidden_size, generator=g)
             .to(torch.bfloat16)}
        if teacher == "hidden":
            s["teacher_hidden"] = torch.randn(T, c.target_hidden_size, generator=g) \
                .to(torch.bfloat16)
        else:
            s["teacher_topk_ids"] = torch.rand(T, c.draft_vocab_size, generator=g) \
                .topk(k, -1).indices
            s["teacher_topk_logp"] = (torch.randn(T, k, generator=g) * 2).log_softmax(-1) \
                .sort(-1, descending=True).values.half().float() - 0.05
        out.append(s)
    return out


def bench(name: str, args, dist, attention: str, teacher: str) -> dict:
    c, B, T, K = shape_config(name, args)
    S = setup(c, B, T, K, args, dist, attention)
    tc, cuda, fused, drafter, head = S["tc"], S["cuda"], S["fused"], S["drafter"], S["head"]
    if args.data:  # real rows, through the prefetch thread as in training
        from drafter.core.rundir import Run
        from drafter.features import store
        src = batches.Source.offline(store.Reader(Run(args.data), "train"))
        rows = batches.pack(src.lengths, T, 0)
        mbs = batches.epoch_micro_batches(rows, B, 0, 0)
        n = args.warmup + args.steps
        mbs = [mbs[(j * dist.world + dist.rank) % len(mbs)] for j in range(n)]
        feed = batches.Prefetch(lambda r: [batches.host_batch(src, r, B, T, tc,
                                                              drafter.embed_tokens.weight)], mbs,
                                threads=args.loader_threads)
        next_host = feed.next
    else:
        n_aux = len(drafter.cfg.target_layer_ids) if args.method != "eagle3" else 3
        src = batches.Source.memory(random_samples(c, B, T, teacher, args.topk,
                                                   seed=dist.rank, n_aux=n_aux))
        hb = batches.host_batch(src, [[i] for i in range(B)], B, T, tc,
                                drafter.embed_tokens.weight)
        next_host = lambda: hb  # noqa: E731

    def step() -> int:
        hb = next_host()
        micro = iter([batches.device_batch(hb, dist.device, head, fused)])
        trainer.train_step(S["model"], S["params"], S["opt"], micro, tc, dist, S["amp"])
        return hb["tokens"]  # real tokens (padding excluded)

    check = None
    if fused and not args.no_check:  # the fast path against the exact one: same batch and
        # loss (the method's, as train's), no grad
        from drafter.train.dspark_objective import BlockTrain
        from drafter.train.ttt import TTT
        hb = next_host()
        exact = TTT(drafter, attention="sdpa", obj=S["obj"]) if args.method == "eagle3" else \
            BlockTrain(drafter, obj=S["obj"])
        with torch.no_grad(), S["amp"]:
            fast = S["model"](**batches.model_inputs(batches.device_batch(hb, dist.device, head,
                                                                          True)))
            exact = exact.to(dist.device)(
                **batches.model_inputs(batches.device_batch(hb, dist.device, head, False)))
        check = float((fast["loss"] - exact["loss"]).abs() / exact["loss"].abs())

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    trainer.sync_device(dist.device)
    warm_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats(dist.device)
    clock = trainer.GcClock()  # as train: frozen after the warm-up
    clock.freeze()
    t0 = time.perf_counter()
    tokens = sum(step() for _ in range(args.steps))
    trainer.sync_device(dist.device)
    dt = time.perf_counter() - t0
    gc_s = clock.summary()["seconds"]
    clock.close()
    t = torch.tensor([dt], device=dist.device)
    if dist.world > 1:
        import torch.distributed as td
        td.all_reduce(t, op=td.ReduceOp.MAX)
    dt = float(t)
    tok_s = tokens * dist.world / dt  # ranks see equal shares of random or packed rows
    if args.profile:  # after the timed steps, the timed figures carry no profiler cost
        prof = Profile(args.profile, f"{name}-{teacher}-T{T}-fixed", 0, 3, dist.device)
        prof.step(0)
        for _ in range(3):
            step()
        prof.close()
    if args.memory_peak and cuda:  # after the timed steps too: the peak's owners, one step
        print(f"{name} {teacher} T{T}: " + memory_peak(step, dist.device), flush=True)
    flops = flops_per_token(c, T, K, teacher)[0] if args.method == "eagle3" else \
        block_flops_per_token(drafter.cfg, T, args.anchors, teacher)[0]
    r = row(name, args, dist, S, B, T, K, "real" if args.data else teacher, tok_s, flops)
    return {**r, "step_ms": 1e3 * dt / args.steps, "warmup_s": warm_s, "check": check,
            "gc_s": gc_s}


def memory_peak(step, device, top: int = 14) -> str:
    """--memory-peak: run one step under the CUDA allocator's history, replay its allocations
    and frees to the step's peak, and name what was alive then by the innermost drafter/ (or
    torch autograd) frame that allocated it: -> one line per owner, largest first."""
    trainer.sync_device(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, context="alloc",
                                             stacks="python")
    step()
    trainer.sync_device(device)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live, cur, peak, at_peak = {}, 0, 0, {}
    for e in snap["device_traces"][torch.cuda.current_device() if device.index is None
                                   else device.index]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]

    def owner(e) -> str:
        frames = [f for f in e.get("frames", []) if "/drafter/" in f["filename"]
                  or "/benchmarks/" in f["filename"]]
        f = frames[0] if frames else (e.get("frames") or [None])[0]
        return f"{Path(f['filename']).name}:{f['line']} {f['name']}" if f else \
            "(no Python frame: autograd's C++ engine)"

    by: dict[str, list] = {}
    for e in at_peak.values():
        o = by.setdefault(owner(e), [0, 0])
        o[0] += e["size"]
        o[1] += 1
    rows = sorted(by.items(), key=lambda x: -x[1][0])[:top]
    return (f"peak {(base + peak) / 2**30:.2f} GiB = {base / 2**30:.2f} before the step + "
            f"{peak / 2**30:.2f} in it; alive at the peak, by allocating frame:\n" + "\n".join(
                f"  {b / 2**20:9.1f} MiB {n:5d} x  {o}" for o, (b, n) in rows))


# --------------------------------------------------------------- --real and --online: chat rows
def chat_lengths(tokens: int, seed: int) -> list[int]:
    """Sample lengths like regenerated chat data until they hold `tokens`: log-normal, median
    250, clipped to 50..2048 (the reference run's 15,002 conversations: 5.03M tokens, 335 a
    sample)."""
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while sum(out) < tokens:
        x = torch.exp(torch.randn(1024, generator=g) * 0.8 + math.log(250))
        out += x.clamp(50, 2048).round().long().tolist()
    return out


def prompt_lengths(lengths: list[int], seed: int) -> list[int]:
    """10-50% of each sample is its prompt, out of the loss (the reference data had 74% of its
    tokens in the loss)."""
    g = torch.Generator().manual_seed(seed + 1)
    share = torch.rand(len(lengths), generator=g) * 0.4 + 0.1
    return [int(n * f) for n, f in zip(lengths, share.tolist())]


def chat_samples(c: DrafterConfig, lengths: list[int], teacher: str, k: int, seed: int):
    """Per-sample dicts of these lengths (docs/internals.md): random token ids, the prompt out
    of the loss, every target argmax in the draft vocab, aux and teacher rows as views into one
    random pool of 4096 positions (its memory is all there is)."""
    g = torch.Generator().manual_seed(seed)
    P, Ht, Vd = 4096, c.target_hidden_size, c.draft_vocab_size
    pool = {"aux": torch.randn(P, 3, Ht, generator=g).to(torch.bfloat16)}
    if teacher == "hidden":
        pool["teacher_hidden"] = torch.randn(P, Ht, generator=g).to(torch.bfloat16)
    else:
        pool["teacher_topk_ids"] = torch.cat([torch.rand(256, Vd, generator=g).topk(k, -1)
                                              .indices for _ in range(P // 256)])
        pool["teacher_topk_logp"] = (torch.randn(P, k, generator=g) * 2).log_softmax(-1) \
            .sort(-1, descending=True).values.half().float() - 0.05
    out = []
    for n, p in zip(lengths, prompt_lengths(lengths, seed)):
        o = int(torch.randint(0, P - n + 1, (1,), generator=g))
        s = {key: v[o:o + n] for key, v in pool.items()}
        s.update(input_ids=torch.randint(0, c.vocab_size, (n,), generator=g),
                 loss_mask=(torch.arange(n) >= p).long(),
                 in_vocab=torch.ones(n, dtype=torch.bool))
        out.append(s)
    return out


def load_target(name: str, args, device):
    """--online's target and the drafter config shaped from it (aux ids: drafter's default).
    `random`: a Llama of the shape's size with random weights (no download): SmolLM2-135M's
    config for smollm2 (30 layers), 6 for kimi (the layers of benchmarks/kimi_slice.py's
    default slice, which --target DIR loads instead), 4 for tiny; its lm_head rows outside the
    draft vocab (the first Vd ids) zeroed, so the argmax nearly always lies in it, as in the
    synthetic rows.
    Otherwise the target spec (builtin:smollm2-135m-instruct, a path) loaded as train does."""
    from drafter.core import target
    from drafter.features.capture import decoder_layers
    c0, _, T, K = shape_config(name, args)
    if args.target == "random":
        from transformers import AutoModelForCausalLM, LlamaConfig
        tcfg = LlamaConfig(
            hidden_size=c0.target_hidden_size, intermediate_size=c0.intermediate_size,
            num_attention_heads=c0.num_attention_heads, head_dim=c0.head_dim,
            num_key_value_heads=c0.num_key_value_heads, vocab_size=c0.vocab_size,
            num_hidden_layers={"smollm2": 30, "kimi": 6, "tiny": 4}.get(name, 32),
            rope_theta=c0.rope_theta, tie_word_embeddings=False,
            max_position_embeddings=c0.max_position_embeddings)
        torch.manual_seed(0)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_config(tcfg, dtype=dtype).to(device).eval()
        model.requires_grad_(False)
        with torch.no_grad():
            model.get_output_embeddings().weight[c0.draft_vocab_size:] = 0
    else:
        model = target.load_model(C.TargetConfig(model=args.target), device=str(device))
    ids = target.default_layer_ids(len(decoder_layers(model)))
    c = DrafterConfig.from_target(model.config, c0.draft_vocab_size, ids,
                                  max_position_embeddings=max(8192, T + K))
    return model, c


def online_source(model, c: DrafterConfig, lengths: list[int], teacher: str, k: int):
    """The samples as train.online sees them: token rows through the target (Capture), so
    every micro-batch runs the target's forward; nothing stored. -> (Source, teacher head,
    the capture's lock: held while torch.compile compiles, as train holds it)."""
    from drafter.features.capture import Capture
    d2t = torch.zeros(c.draft_vocab_size, dtype=torch.long)        # draft id j = target id j
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[:c.draft_vocab_size] = True
    cap = Capture(model, c.aux_layer_ids, d2t, t2d, teacher=teacher, topk=k)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, c.vocab_size, (n,), generator=g).tolist(),
             "loss_mask": [0] * p + [1] * (n - p)}
            for n, p in zip(lengths, prompt_lengths(lengths, 0))]
    return batches.Source([f"{i:09d}" for i in range(len(rows))], lengths,
                          lambda idx: cap([rows[j] for j in idx])), cap.head, cap.lock


def groups(args) -> list[int]:
    """--online-group as a list of group sizes (train.online_group)."""
    return [int(g) for g in str(args.online_group).split(",")]


def producer_ops(name: str, args, model, c: DrafterConfig) -> list[dict]:
    """--producer-ops: the aten ops the prefetch thread dispatches per online micro-batch (the
    target's forwards, the teacher, collate, align) when it captures --online-group
    micro-batches in one call, counted eagerly over the first group: on a GPU each that is not
    a view is a kernel launch the thread makes while the training thread launches its own (the
    GIL is shared). Needs no GPU: the count is the device's too."""
    _, B, T, K = shape_config(name, args)
    out = []
    for G in groups(args):
        lengths = chat_lengths(int(1.15 * (G + 2) * B * T), seed=0)
        src, _, _ = online_source(model, c, lengths, "topk", args.topk)
        jobs = batches.epoch_micro_batches(batches.pack(src.lengths, T, 0), B, 0, 0)[:G]
        tc = C.TrainConfig(ttt_steps=K)
        emb = torch.zeros(c.vocab_size, c.hidden_size)
        with OpCount() as m:
            batches.host_batches(src, jobs, B, T, tc, emb)
        attn = sum(v for k, v in m.names.items() if "attention" in k)
        layers = model.config.num_hidden_layers
        out.append({"group": G, "samples": sum(len(x) for r in jobs for x in r) / G,
                    "ops": m.ops["rest"] / G, "kernels": m.kernels["rest"] / G,
                    "forwards": attn / layers / G, "top": m.names.most_common(12)})
    return out


def batch_stats(hb: dict) -> dict:
    """Per micro-batch: real tokens, Σ causal keys of them, and loss rows (for the FLOP count),
    counted on the thread that built it, so the training loop never waits for them."""
    return {"tokens": hb["tokens"], "keys": hb["keys"], "head_rows": int(hb["rows"].numel())}


def bench_real(name: str, args, dist, attention: str, teacher: str,
               c: DrafterConfig | None = None, target_model=None, group: int = 1) -> dict:
    """--steps train steps from a cold start on chat-like packed rows, each step timed; online
    (the target in the loop, on the prefetch thread as train runs it, `group` micro-batches
    per capture call: train.online_group) with target_model."""
    c0, B, T, K = shape_config(name, args)
    c = c or c0
    lengths = chat_lengths(int(1.15 * (args.steps + 2) * B * T * dist.world), seed=0)
    graphs0 = trainer.compiled_graphs()
    S = setup(c, B, T, K, args, dist, attention)
    tc, cuda, fused, head = S["tc"], S["cuda"], S["fused"], S["head"]
    emb = S["drafter"].embed_tokens.weight
    online = target_model is not None
    hold = contextlib.nullcontext()
    if online:
        src, head, lock = online_source(target_model, c, lengths, teacher, args.topk)
        hold = trainer.compiles_hold(lock)
    else:
        src = batches.Source.memory(chat_samples(c, lengths, teacher, args.topk, seed=0))
    mbs = batches.epoch_micro_batches(batches.pack(src.lengths, T, tc.seed), B, tc.seed, 0)
    jobs = [mbs[j * dist.world + dist.rank] for j in range(args.steps)]

    group = group if online else 1

    def make(g):
        t = time.perf_counter()
        hbs = batches.host_batches(src, g, B, T, tc, emb)
        make_s = (time.perf_counter() - t) / len(g)
        return [{**hb, "stats": {**batch_stats(hb), "make_s": make_s}} for hb in hbs]

    feed = batches.Prefetch(make, batches.grouped(jobs, group), depth=2 * group,
                            device=dist.device if online else None)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dist.device)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
        marks[0].record()
    t0, wall, stats, graphs_warm, waited = time.perf_counter(), [], [], None, 0.0
    waited_warm = None
    clock = trainer.GcClock()  # as train: frozen after the first step
    prof = Profile(args.profile, f"{name}-{teacher}-{'online' if online else 'offline'}",
                   start=min(30, args.steps // 2), steps=5, device=dist.device)
    with hold:
        try:
            for j in range(args.steps):
                prof.step(j)
                t_wait = time.perf_counter()
                hb = feed.next()
                waited += time.perf_counter() - t_wait
                stats.append(hb.pop("stats"))
                micro = iter([batches.device_batch(hb, dist.device, head, fused)])
                trainer.train_step(S["model"], S["params"], S["opt"], micro, tc, dist, S["amp"])
                if cuda:
                    marks[j + 1].record()  # no wait: the GPU stamps the end of each step
                else:
                    wall.append(time.perf_counter() - t0)
                if j == 0:
                    clock.freeze()
                if j + 1 == trainer.WARMUP_STEPS:
                    graphs_warm, waited_warm = trainer.compiled_graphs(), waited
        finally:
            feed.close()
            prof.close()
            gc_s = clock.summary()["seconds"]
            clock.close()
    trainer.sync_device(dist.device)
    if cuda:
        wall = [marks[0].elapsed_time(m) / 1e3 for m in marks[1:]]  # seconds since the start
    tokens = [s["tokens"] * dist.world for s in stats]  # ranks see equal shares
    step_s = [wall[0]] + [b - a for a, b in zip(wall, wall[1:])]
    summary = throughput(sum(tokens), wall[-1], [n / max(dt, 1e-9) for n, dt in
                                                  zip(tokens, step_s)],
                         wall[min(trainer.WARMUP_STEPS, args.steps) - 1])
    n_tok = sum(s["tokens"] for s in stats)
    model_f, _ = flops_per_token(c, T, K, teacher, keys=sum(s["keys"] for s in stats) / n_tok,
                                 head_rows=sum(s["head_rows"] for s in stats) / n_tok)
    graphs = trainer.compiled_graphs()
    if args.compile_times:
        compile_report(name, step_s[:trainer.WARMUP_STEPS])
    r = row(name, args, dist, S, B, T, K, teacher, summary["steady_tokens_per_s"], model_f,
            online)
    return {**r, **summary, "source": f"online, group {group}" if online else "offline",
            "steps": args.steps,
            "step_ms": 1e3 * statistics.median(step_s[len(step_s) // 2:]),
            "fill": n_tok / (len(stats) * B * T), "graphs": graphs - graphs0,
            # the training thread's seconds blocked on the next batch (the prefetch thread
            # behind: online, the target's forward and the batch's assembly)
            "feed_wait_s": waited, "run_s": time.perf_counter() - t0, "gc_s": gc_s,
            "warmup_wait_s": waited_warm,  # of the warm-up: as train's warmup_data_wait_s
            # the prefetch thread's seconds per batch (online: the target's forward included)
            "make_ms": 1e3 * statistics.median(s["make_s"] for s in stats[len(stats) // 2:]),
            "graphs_after_warmup": graphs - graphs_warm if graphs_warm is not None else None}


def compile_report(name: str, warm_steps: list[float]) -> None:
    """--compile-times: where a cold warm-up goes (goal: warm-up <= 30 s). The warm-up steps'
    seconds, then torch's own compile timers (torch._dynamo.utils.compilation_time_metrics,
    seconds per call, in call order: one entry per graph that dynamo, AOTAutograd or Inductor
    compiled, forward and backward)."""
    from torch._dynamo.utils import compilation_time_metrics

    print(f"{name}: warm-up steps (s): " + ", ".join(f"{t:.1f}" for t in warm_steps))
    for key, times in sorted(compilation_time_metrics.items(), key=lambda kv: -sum(kv[1])):
        if sum(times) >= 0.5:
            print(f"  {sum(times):6.1f} s in {len(times):3d} calls  {key}: "
                  + " ".join(f"{t:.1f}" for t in times[:24]), flush=True)


class Profile:
    """--profile PREFIX: torch.profiler over `steps` train steps from step `start` (a --real run;
    fixed rows: three steps after the timed ones): the training thread's CPU ops (the profiler
    sees the thread that starts it) and the GPU kernels of every stream, so the prefetch
    thread's target forward shows on a stream of its own beside the training step.
    PREFIX-NAME.txt gets the top ops by GPU and by CPU time, PREFIX-NAME.json.gz the trace
    (chrome://tracing, Perfetto)."""

    def __init__(self, prefix: str | None, name: str, start: int, steps: int, device):
        self.prefix, self.name, self.device = prefix, name, device
        self.start, self.end, self.prof = start, start + steps, None

    def step(self, j: int) -> None:
        if self.prefix is None:
            return
        if j == self.start:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.start()
        elif j == self.end:
            self.close()

    def close(self) -> None:
        if self.prof is None:
            return
        trainer.sync_device(self.device)
        prof, self.prof = self.prof, None
        prof.stop()
        base = f"{self.prefix}-{self.name}"
        Path(base).parent.mkdir(parents=True, exist_ok=True)
        ka = prof.key_averages()
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        Path(f"{base}.txt").write_text(f"{self.name}: steps {self.start}..{self.end - 1}\n"
                                       + ka.table(sort_by=sort, row_limit=30)
                                       + ka.table(sort_by="self_cpu_time_total", row_limit=30))
        prof.export_chrome_trace(f"{base}.json.gz")
        print(f"{self.name}: profile of steps {self.start}..{self.end - 1} in {base}.txt and "
              f"{base}.json.gz", flush=True)


# ------------------------------------------------------------------------------- the anchor
def bench_anchor(name: str, args, dist) -> dict | None:
    """SpecForge's own step at the shape (benchmarks/specforge_anchor.py), or None after a line
    that says why it did not run."""
    why = specforge_anchor.unavailable(dist.device) if dist.world == 1 else \
        "it runs in one process (not under torchrun)"
    why = "--no-anchor" if args.no_anchor else why
    if why:
        if dist.main:
            print(f"{name}: SpecForge anchor skipped: {why}", flush=True)
        return None
    shape = dict(SHAPES[name])
    B, T, K = args.batch or shape["batch"], args.seq or shape["seq"], args.ttt or shape["ttt"]
    try:
        r = specforge_anchor.bench(shape, B, T, K, args.anchor_steps, args.anchor_warmup,
                                   dist.device)
    except Exception as e:  # noqa: BLE001 - the anchor failing must not hide our figures
        print(f"{name}: SpecForge anchor failed: {type(e).__name__}: "
              f"{(str(e).splitlines() or [''])[0][:200]}", flush=True)
        return None
    finally:
        torch.cuda.empty_cache()
    print(f"{name} SpecForge flex hidden: {r['tok_s']:,.0f} tokens/s, {r['step_ms']:.1f} "
          f"ms/step, {r['mem_gib']:.1f} GiB, warm-up {r['warmup_s']:.1f}s", flush=True)
    return r


# -------------------------------------------------------------------------------- the report
def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(rows: list[dict], anchors: dict) -> str:
    """One markdown row per setting; x anchor: tokens/s over SpecForge's at the same shape
    (measured here, or its recorded figure when it could not run)."""
    real = any("source" in r for r in rows)
    head = ["shape", "seq", "batch", "attn", "teacher", "world", "params", "tokens/s",
            "step ms", "GFLOP/tok", "MFU 989", "MFU 790", "peak GiB", "plan GiB",
            "peak / plan", "anchor", "x anchor"]
    if real:
        head[7:7] = ["source", "steps", "warm-up s", "avg tok/s"]
        head[13:13] = ["avg/steady", "graphs (after warm-up)"]
        head[7 + 4] = "steady tok/s"
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | | | {r['attention']} | {r['teacher']} | | | "
                         f"failed: {r['error']} |" + " |" * (len(head) - 8))
            continue
        a = anchors.get((r["shape"], r["seq"], r["batch"]))
        cells = [r["shape"], str(r["seq"]), str(r["batch"]),
                 r["attention"] + ("+compile" if r["compile"] else ""), r["teacher"],
                 str(r["world"]), f"{r['params'] / 1e6:.1f}M"]
        if real:
            cells += [r["source"], str(r["steps"]), _f(r["warmup_s"], ".1f"),
                      _f(r["avg_tokens_per_s"], ",.0f")]
        cells += [_f(r["tok_s"], ",.0f"), f"{r['step_ms']:.1f}"]
        if real:
            cells += [_f(r["avg_over_steady"], ".2f"),
                      f"{r['graphs']} ({_f(r['graphs_after_warmup'], 'd')})"]
        cells += [f"{r['gflop_tok']:.2f}", _f(r["mfu"], ".1%"), _f(r["mfu_measured"], ".1%"),
                  _f(r["mem_gib"], ".1f"), _f(r.get("plan_gib"), ".1f"),
                  _f(r.get("mem_over_plan"), ".2f"),
                  f"{a[0] * r['world']:,.0f} ({a[1]:.1f} GiB, MFU {_f(a[3], '.1%')}, {a[2]})"
                  if a else "-",
                  f"{r['tok_s'] / (a[0] * r['world']):.2f}" if a and r["tok_s"] else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(r: dict) -> str:
    if "error" in r:
        return r["error"]
    if "source" in r:
        return (f"{r['source']}: warm-up {_f(r['warmup_s'], '.1f')}s (waiting for batches "
                f"{_f(r['warmup_wait_s'], '.1f')}s of it), average "
                f"{_f(r['avg_tokens_per_s'], ',.0f')} tokens/s, steady {_f(r['tok_s'], ',.0f')} "
                f"(avg/steady {_f(r['avg_over_steady'], '.2f')}), {r['graphs']} graphs, "
                f"{_f(r['graphs_after_warmup'], 'd')} after warm-up, rows "
                f"{r['fill']:.0%} full, waited for batches {r['feed_wait_s']:.1f} of "
                f"{r['run_s']:.1f} s, {r['make_ms']:.0f} ms a batch on the prefetch thread")
    msg = (f"{r['tok_s']:,.0f} tokens/s, {r['step_ms']:.1f} ms/step, "
           f"warm-up {r['warmup_s']:.1f}s")
    if r["check"] is not None:
        msg += f"; loss flex vs sdpa: relative difference {r['check']:.1e}"
    return msg


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=["smollm2", "llama8b", "kimi", "kimi-tiny", "both"],
                   default="both",
                   help="both: smollm2 and llama8b")
    p.add_argument("--tiny", action="store_true", help="the tiny shape (CPU check)")
    p.add_argument("--draft-layer", choices=["llama", "mla"], default="llama",
                   help="the draft layer's attention (kimi and tiny shapes; train.draft_layer)")
    p.add_argument("--method", choices=["eagle3", "dflash", "dspark"], default="eagle3",
                   help="the drafter kind (train.method); dflash and dspark: five target "
                   "layers, train.dspark's shape unless the next three say otherwise")
    p.add_argument("--block-size", type=int, help="dflash/dspark: tokens a block drafts")
    p.add_argument("--draft-layers", type=int, help="dflash/dspark: backbone layers")
    p.add_argument("--anchors", type=int, default=C.BlockDrafterConfig().anchors,
                   help="dflash/dspark: blocks trained per row")
    p.add_argument("--seq", type=int, help="tokens per row (default: the shape's)")
    p.add_argument("--batch", type=int, help="rows per micro-batch (default: the shape's)")
    p.add_argument("--ttt", type=int, help="TTT steps (default: the shape's)")
    p.add_argument("--attention", default="auto",
                   help="auto (flex on a GPU, sdpa on the CPU), sdpa, flex, or a list: flex,sdpa")
    p.add_argument("--no-compile", action="store_true", help="eager fast path")
    p.add_argument("--teacher", default="topk", help="topk, hidden, or both: topk,hidden")
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--data", help="a run dir with extract shards: real packed rows (smollm2)")
    p.add_argument("--loader-threads", type=int, default=trainer.LOADER_THREADS,
                   help="--data: threads building batches from the store (train's: "
                   "trainer.LOADER_THREADS)")
    p.add_argument("--real", action="store_true",
                   help="chat-like packed rows from a cold start: warm-up, average vs steady")
    p.add_argument("--online", action="store_true",
                   help="--real offline, then with the target in the loop (train.online)")
    p.add_argument("--producer-ops", action="store_true",
                   help="--online's prefetch thread: aten ops (and kernels) to build one "
                   "micro-batch, and the target forwards in it (no timing; runs on the CPU)")
    p.add_argument("--online-group", default=str(C.TrainConfig().online_group),
                   help="online: micro-batches per capture call (train.online_group), or a "
                   "list, one online run each: 1,4,8")
    p.add_argument("--compile-times", action="store_true",
                   help="--real: the warm-up steps' seconds and torch's compile timers per "
                        "graph (run with a fresh TORCHINDUCTOR_CACHE_DIR for a cold start)")
    p.add_argument("--skip-offline", action="store_true",
                   help="--online without the offline run first: the online run's warm-up "
                   "then compiles cold, as a real online run's does")
    p.add_argument("--target", default="random",
                   help="--online's target: random (SmolLM2-135M-shaped) or a target spec")
    p.add_argument("--no-check", action="store_true",
                   help="skip comparing the fast path's loss with the exact path's first")
    p.add_argument("--steps", type=int, help="timed steps (default 20; --real: 200)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compile)")
    p.add_argument("--no-anchor", action="store_true", help="skip SpecForge even if installed")
    p.add_argument("--anchor-steps", type=int, default=20, help="SpecForge's timed steps")
    p.add_argument("--anchor-warmup", type=int, default=5, help="SpecForge's untimed steps")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="datasheet peak for MFU (H200 bf16 dense)")
    p.add_argument("--measured-tflops", type=float, default=790.0,
                   help="measured matmul rate for the second MFU (H200 bf16)")
    p.add_argument("--peak-tflops-cpu", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile", metavar="PREFIX",
                   help="torch.profiler over 5 steady steps of each --real run (3 steps after "
                   "the timed ones otherwise): PREFIX-NAME.txt (top ops by GPU and CPU time) "
                   "and PREFIX-NAME.json.gz (the trace)")
    p.add_argument("--memory-peak", action="store_true",
                   help="fixed rows: after the timed steps, one step under the allocator's "
                   "history: what is alive at its peak, by the frame that allocated it")
    p.add_argument("--loss-chunk", type=int, default=0,
                   help="rows per fused-loss chunk (0: the automatic size, drafter/train/ttt.py)")
    p.add_argument("--no-fused-merge", action="store_true",
                   help="the diagonal merge as eager ops (merge._MergeDiagonal), not its two "
                   "Triton kernels (drafter.train.merge.FUSED_MERGE)")
    p.add_argument("--json", help="also write the rows and the anchors here (rank 0)")
    p.add_argument("--switch-interval", type=float,
                   help="sys.setswitchinterval seconds (Python's default 0.005): how long a "
                   "thread keeps the GIL while the other waits (online: the prefetch thread "
                   "runs the target's Python while the training thread launches kernels)")
    args = p.parse_args(argv)
    merge_mod.FUSED_MERGE = not args.no_fused_merge
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    args.online = args.online or args.producer_ops
    args.real = args.real or args.online
    args.steps = args.steps or (200 if args.real else 20)
    dist = dist_env()
    if args.tiny:
        names = ["tiny"]
        args.warmup, args.anchor_steps = min(args.warmup, 1), min(args.anchor_steps, 3)
        args.steps = min(args.steps, 30 if args.real else 3)
        # a busy 2-core machine: OpenMP threads spinning against each other make tiny shapes
        # 10x slower (tests/test_train.py pins one thread for the same reason)
        torch.set_num_threads(1)
    else:
        names = ["smollm2", "llama8b"] if args.shape == "both" else [args.shape]
    rows, anchors = [], {}
    for name in names:
        target_model, c = load_target(name, args, dist.device) if args.online else (None, None)
        if args.producer_ops:
            for po in producer_ops(name, args, target_model, c):
                print(f"{name}: an online micro-batch ({po['samples']:g} samples), "
                      f"{po['group']} per capture call, dispatches {po['ops']:,.0f} aten ops, "
                      f"{po['kernels']:,.0f} of them kernels, in {po['forwards']:.2f} target "
                      f"forwards; most (whole group): {po['top']}", flush=True)
            continue
        for attention in args.attention.split(","):
            for teacher in args.teacher.split(","):
                off = None
                for online in ([] if args.skip_offline else [0]) + \
                        (groups(args) if args.online else []):
                    try:
                        if args.real:
                            r = bench_real(name, args, dist, attention, teacher, c,
                                           target_model if online else None, group=online)
                        else:
                            r = bench(name, args, dist, attention, teacher)
                    except Exception as e:  # noqa: BLE001 - one failed setting must not hide
                        if dist.world > 1:  # the others
                            raise
                        r = {"shape": name, "attention": attention, "teacher": teacher,
                             "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
                    rows.append(r)
                    if dist.main:
                        print(f"{name} {attention} {teacher}: {describe(r)}", flush=True)
                    if not online:
                        off = r
                    elif off is not None and "error" not in r and "error" not in off:
                        if dist.main and off["tok_s"] and r["tok_s"]:
                            print(f"{name} {attention} {teacher}: online (group {online}) / "
                                  f"offline {r['tok_s'] / off['tok_s']:.2f} steady, "
                                  f"{r['avg_tokens_per_s'] / off['avg_tokens_per_s']:.2f} "
                                  f"average (goal >= 0.7)", flush=True)
                    # the last run's model, optimizer and batches: not in the next peak
                    gc.collect()
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
        del target_model
        # SpecForge after ours: our warm-up is measured cold (no kernels it compiled before)
        shape = SHAPES[name]
        B, T = args.batch or shape["batch"], args.seq or shape["seq"]
        a = bench_anchor(name, args, dist)
        if a:
            anchors[(name, T, B)] = (a["tok_s"], a["mem_gib"], "SpecForge here")
        elif (name, T) in ANCHOR and B == shape["batch"]:
            anchors[(name, T, B)] = (*ANCHOR[(name, T)], "recorded")
        if (name, T, B) in anchors:  # its MFU by the same count (its teacher: the hidden one)
            c, _, _, K = shape_config(name, args)
            anchors[(name, T, B)] += (mfu(flops_per_token(c, T, K, "hidden")[0],
                                          anchors[(name, T, B)][0], args.peak_tflops, 1,
                                          torch.cuda.is_available()),)
    if dist.main and rows:
        print("\n" + table(rows, anchors))
    if dist.main and args.json:
        write_json(args.json, rows, anchors)
    close_dist()


def write_json(path: str, rows: list[dict], anchors: dict) -> None:
    """--json: the rows, SpecForge's figures per (shape, seq, batch), and each row's tokens/s
    over SpecForge's at its shape (atomically: a temp name, then a rename)."""
    import json

    out = {"rows": rows, "anchors": [{"shape": k[0], "seq": k[1], "batch": k[2],
                                      "tok_s": v[0], "mem_gib": v[1], "source": v[2],
                                      "mfu": v[3]} for k, v in anchors.items()]}
    for r in rows:
        a = anchors.get((r.get("shape"), r.get("seq"), r.get("batch")))
        r["x_anchor"] = r["tok_s"] / a[0] / r["world"] if a and r.get("tok_s") else None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(out, indent=2, default=str))
    tmp.replace(path)


if __name__ == "__main__":
    main()
