"""What one static-cache target forward costs by the number of tokens it takes, and why.

    python benchmarks/forward_kernels.py --random-target --batches 1,64   # GPU, no model files
    python benchmarks/forward_kernels.py --tiny                           # CPU smoke

Issue 16: at batch 1 a verification forward over 3-6 tokens costs ~0.5 ms more than a plain
step's forward over 1 token (3.40 against 2.84 ms on the H200), though both are launch-bound.
For each T (tokens a row, 1 = a plain step; aux capture on for T > 1, as in verification) this
prints the graph-captured forward's milliseconds and, from one eager forward under
torch.profiler, its kernel count and the kernels by name (count, GPU microseconds): a change of
kernel (a split-K GEMM and its reduction, another attention backend) shows there.

Then the prefill's first call at a new prompt length (evaluate's prefills are eager, one shape a
prompt): the mean milliseconds of prefills over N new lengths, then over the same lengths again,
with the default SDPA backends and with cuDNN attention disabled. A first pass far slower than
the second is a per-shape setup cost (a cuDNN graph built per shape) that evaluate's speedups
would charge to whichever method decodes a prompt first.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_speed import random_smollm2, tiny_target  # noqa: E402

from drafter.core.config import TargetConfig  # noqa: E402
from drafter.core.target import default_layer_ids, load_model, num_layers  # noqa: E402
from drafter.engine.decode import _time_ms  # noqa: E402
from drafter.engine.static import StaticTarget  # noqa: E402


def inputs(B: int, T: int, context: int, span: int, dev):
    """A forward over T new tokens a row after `context` cached ones: ids, slots, vis, start."""
    s = torch.arange(span, device=dev)
    slots = (context + torch.arange(T, device=dev)).expand(B, T)
    vis = s[None, None] <= slots[..., None]                                     # [B, T, S]
    return (torch.zeros(B, T, dtype=torch.long, device=dev), slots, vis,
            torch.zeros(B, dtype=torch.long, device=dev))


def kernels(fn) -> tuple[int, list[tuple[str, int, float]]]:
    """Kernels one eager fn() launches: their count and (name, count, GPU us) by name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by = {}
    for e in prof.key_averages():
        if "CUDA" in str(getattr(e, "device_type", "")):   # a kernel (or a memcpy / memset)
            us = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
            c, t = by.get(e.key[:90], (0, 0.0))
            by[e.key[:90]] = (c + e.count, t + us)
    n = sum(c for c, _ in by.values())
    rows = sorted(((k, c, us) for k, (c, us) in by.items()), key=lambda r: -r[2])
    return n, rows


def prefill_ms(tgt, lengths, dev) -> float:
    """Mean ms of an eager batch-1 prefill forward at each prompt length (GPU only)."""
    out = []
    for L in lengths:
        ids, slots, vis, start = inputs(1, L, 0, L, dev)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        tgt.forward(ids, slots, slots, vis, start, logits_to_keep=1)
        torch.cuda.synchronize(dev)
        out.append(1e3 * (time.perf_counter() - t0))
    return sum(out) / len(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--random-target", action="store_true", help="SmolLM2-135M's shape, random")
    ap.add_argument("--tiny", action="store_true", help="a tiny random target (CPU smoke)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--tokens", default="1,2,3,6,49", help="T: tokens a row in one forward")
    ap.add_argument("--context", type=int, default=256, help="cached tokens before the forward")
    ap.add_argument("--top", type=int, default=12, help="kernel names shown per forward")
    ap.add_argument("--prefills", type=int, default=20, help="new prompt lengths timed")
    a = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory()
    if a.tiny:
        a.target = tiny_target(Path(tmp.name) / "tiny")
    elif a.random_target:
        a.target = random_smollm2(Path(tmp.name) / "smollm2-random")
    model = load_model(TargetConfig(model=a.target))
    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    aux = default_layer_ids(num_layers(model.config))
    tgt = StaticTarget(model)
    batches = [int(b) for b in a.batches.split(",")]
    Ts = [int(t) for t in a.tokens.split(",")]
    span = -(-(a.context + max(Ts)) // 256) * 256
    tgt.allocate(max(batches), max(span, 1024))
    print(f"forward_kernels: {a.target} on {torch.cuda.get_device_name() if cuda else 'cpu'} "
          f"({next(model.parameters()).dtype}), torch {torch.__version__}", flush=True)
    for B in batches:
        for T in Ts:
            tgt.set_aux(aux if T > 1 else None)
            ids, slots, vis, start = inputs(B, T, a.context, span, dev)

            def fn():
                tgt.forward(ids, slots, slots, vis, start)
            ms = _time_ms(fn, cuda, 200) if cuda else float("nan")
            line = f"batch {B}, T {T} (aux {'on' if T > 1 else 'off'}): {ms:.3f} ms graph-captured"
            if cuda:
                n, rows = kernels(fn)
                print(f"{line}, {n} kernels eager", flush=True)
                for name, c, us in rows[: a.top]:
                    print(f"    {c:5d} x {us / c:7.2f} us  {name}")
            else:
                print(line)
    if not cuda:
        return 0
    tgt.set_aux(None)
    rng = random.Random(0)
    pool = rng.sample(range(40, 600), 2 * a.prefills)
    for setting, lengths in (("default SDPA backends", pool[: a.prefills]),
                             ("cuDNN attention off", pool[a.prefills:])):
        torch.backends.cuda.enable_cudnn_sdp(setting == "default SDPA backends")
        first = prefill_ms(tgt, lengths, dev)
        again = prefill_ms(tgt, lengths, dev)
        L = lengths[0]
        ids, slots, vis, start = inputs(1, L, 0, L, dev)
        _, rows = kernels(lambda: tgt.forward(ids, slots, slots, vis, start, logits_to_keep=1))
        att = [r[0] for r in rows if "attention" in r[0].lower() or "fmha" in r[0].lower()
               or "sdpa" in r[0].lower() or "cudnn" in r[0].lower()]
        print(f"prefill, batch 1, {setting}: first call at a new length {first:.1f} ms, the same "
              f"lengths again {again:.1f} ms (mean of {len(lengths)}); attention kernels: "
              f"{att[:3]}", flush=True)
    torch.backends.cuda.enable_cudnn_sdp(True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
