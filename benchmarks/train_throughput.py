"""Training throughput of the EAGLE-3 drafter: tokens/s, MFU and peak memory, one command.

    python benchmarks/train_throughput.py                       # shapes (a) and (b), one GPU
    python benchmarks/train_throughput.py --shape llama8b --seq 4096
    python benchmarks/train_throughput.py --shape smollm2 --data runs/quickstart   # real shards
    torchrun --nproc-per-node 2 benchmarks/train_throughput.py --shape llama8b     # DDP scaling
    python benchmarks/train_throughput.py --tiny                # CPU: checks the script itself

Shapes (issue 6), TTT 7 steps, one sample per row unless --data:
    smollm2  (a) H = Ht = 576, 9 / 3 heads of 64, I 1536, V 49152, Vd 32000, batch 4 × 2048
    llama8b  (b) H = Ht = 4096, 32 / 8 heads of 128, I 14336, V 128256, Vd 32000, batch 1 × 2048
    tiny     H = Ht = 64, 4 / 2 heads of 16, I 128, V 1024, Vd 512, batch 2 × 128, TTT 3

One timed step is exactly drafter train's (drafter/trainer.py; batches from
drafter/batches.py): the host batch (pinned, built once: collate, align, embedding lookup on the
CPU) goes to the device, the teacher is formed (`--teacher topk`: k=64 draft-vocab log-probs as
stored, never densified; `hidden`: the final hidden state through the draft-vocab head into dense
log-probs), then `train_step`: TTT forward + fused loss, backward, gradient scaling, clip, fused
AdamW. Random features: aux N(0, 1), all tokens in the loss. With --data RUN_DIR the batches
are real packed rows from the run's extract shards (the prefetch thread included).

FLOPs per trained token, counted (multiply-add = 2 FLOPs; backward = 2 × forward):
    fc         3·Ht·H MACs forward; backward only the weight gradient      -> 12·Ht·H
    per TTT step i (K of them):
      layer    L = 2H·(nh + 2·nkv)·hd + nh·hd·H + 3·H·I MACs               -> 6·L
      lm_head  H·Vd MACs                                                  -> 6·H·Vd
      attention  QKᵀ and PV over (T+1)/2 causal keys + i diagonal keys:
               2·nh·hd·((T+1)/2 + i) MACs                                  -> 12·nh·hd·((T+1)/2 + i)
    teacher (hidden only, not in MFU): Ht·Vd MACs forward                  -> 2·Ht·Vd
MFU = model FLOPs per token × tokens/s / peak, peak = 790 TFLOP/s (the H200's measured bf16 dense
matmul rate, ../shared/docs/REFERENCES.md; --peak-tflops to change). For (b) at 2048 this count
gives 16.3 GFLOP/token, so the anchor's 23,300 tokens/s is 48% MFU.
Peak memory: torch.cuda.max_memory_allocated over the timed steps (reset after warm-up).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from drafter import batches  # noqa: E402
from drafter import config as C  # noqa: E402
from drafter.capture import Head  # noqa: E402
from drafter.dist import close_dist, dist_env  # noqa: E402
from drafter.model import Drafter, DrafterConfig, param_count  # noqa: E402
from drafter import trainer  # noqa: E402

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, draft_vocab_size=32000,
                    target_hidden_size=576, rope_theta=100000.0, batch=4, seq=2048, ttt=7),
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, vocab_size=128256,
                    draft_vocab_size=32000, target_hidden_size=4096, rope_theta=500000.0,
                    batch=1, seq=2048, ttt=7),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1024, draft_vocab_size=512,
                 target_hidden_size=64, batch=2, seq=128, ttt=3),
}
# The widely used open-source trainer on the same H200 (issue 6): (shape, seq) -> tokens/s, GiB
ANCHOR = {("llama8b", 2048): (23_300, 9.1), ("llama8b", 4096): (24_900, 14.7),
          ("smollm2", 2048): (78_000, 18.3)}


def flops_per_token(c: DrafterConfig, T: int, K: int, teacher: str) -> tuple[float, float]:
    """(model FLOPs, teacher FLOPs) per trained token: the count in the docstring."""
    H, Ht, nh, nkv, hd = (c.hidden_size, c.target_hidden_size, c.num_attention_heads,
                          c.num_key_value_heads, c.head_dim)
    layer = 2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * c.intermediate_size
    model = 12 * Ht * H * len(c.aux_layer_ids) / 3
    for i in range(K):
        model += 6 * layer + 6 * H * c.draft_vocab_size + 12 * nh * hd * ((T + 1) / 2 + i)
    return model, (2 * Ht * c.draft_vocab_size if teacher == "hidden" else 0.0)


def random_samples(c: DrafterConfig, B: int, T: int, teacher: str, k: int, seed: int):
    """B per-sample dicts (docs/internals.md) of T tokens with random features."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(B):
        s = {"input_ids": torch.randint(0, c.vocab_size, (T,), generator=g),
             "loss_mask": torch.ones(T, dtype=torch.long),
             "in_vocab": torch.ones(T, dtype=torch.bool),
             "aux": torch.randn(T, 3, c.target_hidden_size, generator=g).to(torch.bfloat16)}
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
    shape = dict(SHAPES[name])
    B, T, K = args.batch or shape.pop("batch"), args.seq or shape.pop("seq"), shape.pop("ttt")
    shape.pop("batch", None), shape.pop("seq", None)
    K = args.ttt or K
    c = DrafterConfig(aux_layer_ids=[2, 16, 29], max_position_embeddings=max(8192, T + K),
                      **shape)
    cuda = dist.device.type == "cuda"
    cfg = C.load(None, [f"train.ttt_steps={K}", f"train.max_length={T}",
                        f"train.batch_tokens={B * T}", f"train.attention={attention}",
                        f"train.compile={str(not args.no_compile).lower()}"])
    tc = cfg.train
    attention = trainer.pick_attention(tc, dist.device)
    torch.manual_seed(0)
    drafter = Drafter(c)
    drafter.embed_tokens.to(torch.bfloat16)
    head = Head((torch.randn(c.draft_vocab_size, c.target_hidden_size) * 0.05)
                .to(torch.bfloat16)).to(dist.device)
    ttt, model, opt = trainer.setup_model(drafter, tc, dist, attention)
    params = [p for p in ttt.parameters() if p.requires_grad]
    amp = torch.autocast(dist.device.type, dtype=torch.bfloat16) if cuda else \
        torch.autocast("cpu", enabled=False)
    fused = attention == "flex"

    if args.data:  # real rows, through the prefetch thread as in training
        from drafter import store
        from drafter.rundir import Run
        src = batches.Source.offline(store.Reader(Run(args.data), "train"))
        rows = batches.pack(src.lengths, T, 0)
        mbs = batches.epoch_micro_batches(rows, B, 0, 0)
        n = args.warmup + args.steps
        mbs = [mbs[(j * dist.world + dist.rank) % len(mbs)] for j in range(n)]
        feed = batches.Prefetch(lambda r: batches.host_batch(src, r, B, T, tc,
                                                             drafter.embed_tokens.weight), mbs)
        next_host = feed.next
    else:
        src = batches.Source.memory(random_samples(c, B, T, teacher, args.topk,
                                                   seed=dist.rank))
        hb = batches.host_batch(src, [[i] for i in range(B)], B, T, tc,
                                drafter.embed_tokens.weight)
        next_host = lambda: hb  # noqa: E731

    def step() -> int:
        hb = next_host()
        micro = iter([batches.device_batch(hb, dist.device, head, fused)])
        trainer.train_step(model, params, opt, micro, tc, dist, amp)
        return hb["tokens"]  # real tokens (padding excluded)

    def sync():
        if cuda:
            torch.cuda.synchronize(dist.device)

    check = None
    if fused and not args.no_check:  # the fast path against the exact one, same batch, no grad
        from drafter.ttt import TTT
        hb = next_host()
        with torch.no_grad(), amp:
            fast = model(**batches.model_inputs(batches.device_batch(hb, dist.device, head, True)))
            exact = TTT(drafter, attention="sdpa").to(dist.device)(
                **batches.model_inputs(batches.device_batch(hb, dist.device, head, False)))
        check = float((fast["loss"] - exact["loss"]).abs() / exact["loss"].abs())

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync()
    warm_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats(dist.device)
    t0 = time.perf_counter()
    tokens = sum(step() for _ in range(args.steps))
    sync()
    dt = time.perf_counter() - t0
    t = torch.tensor([dt], device=dist.device)
    if dist.world > 1:
        import torch.distributed as td
        td.all_reduce(t, op=td.ReduceOp.MAX)
    dt = float(t)
    tok_s = tokens * dist.world / dt  # ranks see equal shares of random or packed rows
    model_f, teacher_f = flops_per_token(c, T, K, teacher)
    peak = args.peak_tflops * 1e12 * dist.world if (cuda or args.peak_tflops_cpu) else None
    mem = torch.cuda.max_memory_allocated(dist.device) / 2**30 if cuda else None
    anchor = ANCHOR.get((name, T)) if B == SHAPES[name]["batch"] else None
    return {"shape": name, "seq": T, "batch": B, "ttt": K, "attention": attention,
            "compile": not args.no_compile and cuda, "teacher": "real" if args.data else
            teacher, "world": dist.world, "params": param_count(drafter),
            "tok_s": tok_s, "step_ms": 1e3 * dt / args.steps, "warmup_s": warm_s,
            "gflop_tok": model_f / 1e9, "mfu": model_f * tok_s / peak if peak else None,
            "mem_gib": mem, "anchor": anchor, "check": check,
            "speedup": tok_s / (anchor[0] * dist.world) if anchor else None}


def table(rows: list[dict]) -> str:
    head = ("shape", "seq", "batch", "attn", "teacher", "world", "params", "tokens/s",
            "step ms", "GFLOP/tok", "MFU", "peak GiB", "anchor tok/s", "x anchor")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | | | {r['attention']} | {r['teacher']} | | | "
                         f"failed: {r['error']} |" + " |" * 6)
            continue
        a = r["anchor"]
        lines.append("| " + " | ".join([
            r["shape"], str(r["seq"]), str(r["batch"]),
            r["attention"] + ("+compile" if r["compile"] else ""), r["teacher"], str(r["world"]),
            f"{r['params'] / 1e6:.1f}M", f"{r['tok_s']:,.0f}", f"{r['step_ms']:.1f}",
            f"{r['gflop_tok']:.2f}", f"{r['mfu']:.1%}" if r["mfu"] else "-",
            f"{r['mem_gib']:.1f}" if r["mem_gib"] is not None else "-",
            f"{a[0] * r['world']:,} ({a[1]} GiB)" if a else "-",
            f"{r['speedup']:.2f}" if r["speedup"] else "-"]) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=["smollm2", "llama8b", "both"], default="both")
    p.add_argument("--tiny", action="store_true", help="the tiny shape (CPU check)")
    p.add_argument("--seq", type=int, help="tokens per row (default: the shape's)")
    p.add_argument("--batch", type=int, help="rows per micro-batch (default: the shape's)")
    p.add_argument("--ttt", type=int, help="TTT steps (default: the shape's)")
    p.add_argument("--attention", default="auto",
                   help="auto (flex on a GPU, sdpa on the CPU), sdpa, flex, or a list: flex,sdpa")
    p.add_argument("--no-compile", action="store_true", help="eager fast path")
    p.add_argument("--teacher", default="topk", help="topk, hidden, or both: topk,hidden")
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--data", help="a run dir with extract shards: real packed rows (smollm2)")
    p.add_argument("--no-check", action="store_true",
                   help="skip comparing the fast path's loss with the exact path's first")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compile)")
    p.add_argument("--peak-tflops", type=float, default=790.0)
    p.add_argument("--peak-tflops-cpu", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    dist = dist_env()
    if args.tiny:
        names = ["tiny"]
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    else:
        names = ["smollm2", "llama8b"] if args.shape == "both" else [args.shape]
    rows = []
    for name in names:
        for attention in args.attention.split(","):
            for teacher in args.teacher.split(","):
                try:
                    r = bench(name, args, dist, attention, teacher)
                    msg = (f"{r['tok_s']:,.0f} tokens/s, {r['step_ms']:.1f} ms/step, "
                           f"warm-up {r['warmup_s']:.1f}s")
                    if r["check"] is not None:
                        msg += f"; loss flex vs sdpa: relative difference {r['check']:.1e}"
                except Exception as e:  # noqa: BLE001 - one failed setting must not hide others
                    if dist.world > 1:
                        raise
                    r = {"shape": name, "attention": attention, "teacher": teacher,
                         "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
                    msg = r["error"]
                rows.append(r)
                if dist.main:
                    print(f"{name} {attention} {teacher}: {msg}", flush=True)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    if dist.main:
        print("\n" + table(rows))
    close_dist()


if __name__ == "__main__":
    main()
