"""Can FlexAttention's compiled graph be saved whole and loaded in another process, as train's
layer pieces are (drafter/train/aot.py)? Its block mask is rebuilt every batch around a new closure
(ttt.doc_causal over the batch's sample ids): the question is whether a loaded function's
guards take a new closure's mask, and what its first call then costs against torch.compile's
trace from a warm Inductor cache (0.34-0.88 s of train's first step on the H200, issue 18).

    python benchmarks/flex_aot_probe.py save DIR    # compile ahead of time, save DIR/flex.bin;
                                                    # also fills Inductor's cache (torch.compile)
    python benchmarks/flex_aot_probe.py load DIR    # a fresh process: load it, call it on a new
                                                    # batch's mask, forward and backward
    python benchmarks/flex_aot_probe.py trace DIR   # a fresh process: torch.compile from the cache

Each prints one JSON line: the first call's seconds (load included), and for load and trace the
output's and gradients' largest difference from uncompiled FlexAttention on the same batch. The
SmolLM2 drafter's attention shape: 8 rows x 2,048 tokens, 9 query heads, 3 key/value heads of
64, bf16. Needs a CUDA GPU (FlexAttention has no backward on the CPU).

On the H200 with torch 2.11 (nineteenth session, BENCHMARKS.md): the save took 20.1 s (5.8 MB),
but the loading process failed ("RuntimeError: TracingContext.get() must be called within an
ongoing trace."): FlexAttention cannot be loaded whole there, so train traces it.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import flex_attention as fa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from drafter.train.aot import _aot_enabled  # noqa: E402
from drafter.train.ttt import doc_causal  # noqa: E402

B, NH, NKV, T, HD = 8, 9, 3, 2048, 64


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    seq = torch.zeros(B, T, dtype=torch.long)  # 6 samples a row, cut at random places
    for b in range(B):
        for c in sorted(torch.randint(1, T, (5,), generator=g).tolist()):
            seq[b, c:] += 1
    seq = seq.cuda()
    q = torch.randn(B, NH, T, HD, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    k = torch.randn(B, NKV, T, HD, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    v = torch.randn(B, NKV, T, HD, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    mask = fa.create_block_mask(doc_causal(seq), B, None, T, T, device="cuda")
    return q, k, v, mask


def attend(q, k, v, block_mask):
    o, aux = fa.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True,
                               return_aux=fa.AuxRequest(lse=True))
    return o, aux.lse


def run(fn, q, k, v, mask):
    o, lse = fn(q, k, v, mask)
    (o.float().square().mean() + lse.mean()).backward()
    torch.cuda.synchronize()
    return o.detach(), lse.detach(), [t.grad.detach().clone() for t in (q, k, v)]


def diff(a, b) -> float:
    o1, l1, g1 = a
    o2, l2, g2 = b
    return max(float((x.float() - y.float()).abs().max()) for x, y in
               zip([o1, l1, *g1], [o2, l2, *g2]))


def main(mode: str, folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "flex.bin"
    out: dict = {"mode": mode, "torch": torch.__version__}
    t = time.perf_counter()
    if mode == "save":
        q, k, v, mask = batch(0)
        with _aot_enabled():  # torch 2.11 offers aot_compile only under dynamo's flag
            aot = torch.compile(attend, fullgraph=True, dynamic=False).aot_compile(
                ((q, k, v, mask), {}))
        run(aot, q, k, v, mask)
        aot.save_compiled_function(str(path))
        out["save_s"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        run(torch.compile(attend, dynamic=False), *batch(0))  # Inductor's cache for `trace`
        out["traced_cold_s"] = round(time.perf_counter() - t, 2)
        out["bytes"] = path.stat().st_size
        return out
    q, k, v, mask = batch(1)  # another batch: another closure, other sample ids
    if mode == "load":
        with open(path, "rb") as f:
            fn = torch.compiler.load_compiled_function(f)
        out["load_s"] = round(time.perf_counter() - t, 2)
    else:
        fn = torch.compile(attend, dynamic=False)
    got = run(fn, q, k, v, mask)
    out["first_call_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    got2 = run(fn, *batch(2))
    out["second_call_s"] = round(time.perf_counter() - t, 3)
    ref = run(attend, *batch(1))                       # uncompiled FlexAttention
    ref2 = run(attend, *batch(2))
    out["max_diff_vs_eager"] = round(max(diff(got, ref), diff(got2, ref2)), 4)
    from torch._dynamo.utils import counters
    out["dynamo_graphs"] = int(counters["stats"]["unique_graphs"])
    return out


if __name__ == "__main__":
    try:
        res = main(sys.argv[1], Path(sys.argv[2]))
    except Exception as e:  # noqa: BLE001 - the probe's answer
        res = {"mode": sys.argv[1], "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    print(json.dumps(res), flush=True)
