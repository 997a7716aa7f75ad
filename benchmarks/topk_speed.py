"""The top-k searches of a tree step, timed alone (issue 16: topk was 0.93 ms of the 6/8/48 tree
step at batch 64 on the H200, 11 calls a step at 84 us each, decode_speed --profile).

    python benchmarks/topk_speed.py            # GPU: CUDA-graph replays, CUDA events
    python benchmarks/topk_speed.py --rows 4   # CPU smoke
    python benchmarks/topk_speed.py --parts    # + tree.top_indices' frontier search by part,
                                               # beside tree.fused_children's one kernel

For each shape a tree step searches (its rows at batch 64: the root's 64 and the frontier's
64 x 8 draft-vocab rows, the k·k candidates of a depth, the final top-N over all candidates)
it times torch.topk against tree.top_indices (each chunk's maximum, then the k best chunks'
values: what build_tree runs), a two-stage search (the top k of each chunk of C columns, then
the top k of those) and a full sort, and checks that each returns the same values as torch.topk.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter.engine.decode import _time_ms  # noqa: E402
from drafter.engine.tree import chunk_width, fused_children, greedy_children, top_indices  # noqa: E402


def two_stage(x: torch.Tensor, k: int, chunk: int) -> torch.Tensor:
    """Indices of the k largest of each row of x [R, V]: per chunk of `chunk` columns, then of
    the chunks' winners (V padded with -inf to a whole number of chunks)."""
    R, V = x.shape
    n = -(-V // chunk)
    if n * chunk != V:
        x = torch.nn.functional.pad(x, (0, n * chunk - V), value=float("-inf"))
    v, i = x.view(R, n, chunk).topk(k, dim=-1)                              # [R, n, k]
    i = i + (torch.arange(n, device=x.device) * chunk)[None, :, None]
    top = v.flatten(1).topk(k, dim=-1).indices                              # [R, k]
    return i.flatten(1).gather(1, top)


def eager_children(x: torch.Tensor, k: int):
    """tree.greedy_children by eager kernels (what runs where Triton does not)."""
    return greedy_children(x, k, fused=False)


def parts(x: torch.Tensor, k: int, dev: str) -> None:
    """--parts: tree.top_indices' search of x [R, V] one kernel group at a time (its chunk
    width from tree.TOP_CHUNKS), beside the float32 log_softmax that build_tree's greedy
    expansion reads the k log-probs from (the other full read of the frontier's logits)."""
    R, V = x.shape
    c = chunk_width(V, k)
    xc = x.view(R, V // c, c)
    best = xc.amax(-1).topk(k, dim=-1).indices
    cand = xc.gather(1, best[..., None].expand(R, k, c)).flatten(1)
    top = cand.topk(k, dim=-1).indices
    steps = {f"chunk maxima [{R}, {V // c}]": lambda: xc.amax(-1),
             "top k of the maxima": lambda: xc.amax(-1).topk(k, dim=-1).indices,
             f"gather the k chunks [{R}, {k * c}]": lambda: xc.gather(
                 1, best[..., None].expand(R, k, c)),
             "top k of their values": lambda: cand.topk(k, dim=-1).indices,
             "indices back": lambda: best.gather(1, top // c) * c + top % c,
             "whole search": lambda: top_indices(x, k),
             "log_softmax float32 + gather k": lambda: torch.nn.functional.log_softmax(
                 x, dim=-1, dtype=torch.float32).gather(-1, top),
             "search + log-probs, eager": lambda: eager_children(x, k)}
    if dev == "cuda":  # Inductor's fusion of the same, and tree.fused_children's kernel
        i0, l0 = eager_children(x, k)
        for label, fn in (("the same, torch.compile'd", torch.compile(eager_children,
                                                                        dynamic=False)),
                          ("tree.fused_children (one Triton kernel)", fused_children)):
            i1, l1 = fn(x, k)
            same = torch.equal(x.gather(1, i1), x.gather(1, i0)) \
                and torch.allclose(l1, l0, rtol=0, atol=1e-5)
            steps[label + ("" if same else " (DIFFERENT)")] = lambda fn=fn: fn(x, k)
    cells = [f"{label} {1000 * _time_ms(fn, True, 200) if dev == 'cuda' else float('nan'):.1f}"
             for label, fn in steps.items()]
    print(f"  by part (chunks of {c}; 'top k of the maxima' includes the maxima): "
          + "; ".join(cells), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=64, help="batch rows")
    ap.add_argument("--vocab", type=int, default=32000, help="draft vocab")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=48)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--parts", action="store_true",
                    help="also time tree.top_indices' frontier search by part")
    a = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    B, k = a.rows, a.k
    M = k + (a.depth - 1) * k * k
    shapes = [("root logits", B, a.vocab, k, torch.bfloat16),
              ("frontier logits", B * k, a.vocab, k, torch.bfloat16),
              ("a depth's k*k candidates", B, k * k, k, torch.float32),
              ("final top-N of all candidates", B, M, a.nodes, torch.float64)]
    print(f"topk_speed on {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}: microseconds a call")
    torch.manual_seed(0)
    for name, R, V, kk, dt in shapes:
        x = torch.randn(R, V, device=dev).to(dt)
        ref = x.topk(kk, dim=-1).values
        cands = {"torch.topk": lambda x=x, kk=kk: x.topk(kk, dim=-1).indices,
                 "tree.top_indices": lambda x=x, kk=kk: top_indices(x, kk),
                 **{f"tree.top_indices, chunks of {c}":
                    lambda x=x, kk=kk, c=c: top_indices(x, kk, (c,))
                    for c in (16, 32, 64, 256) if chunk_width(V, kk, (c,))},
                 "sort": lambda x=x, kk=kk: x.sort(dim=-1, descending=True).indices[:, :kk]}
        if V >= 4096:
            for c in (128, 256, 512, 1024, 2048):
                cands[f"two-stage, chunks of {c}"] = lambda x=x, kk=kk, c=c: two_stage(x, kk, c)
        if dev == "cuda" and chunk_width(V, kk):  # ids and log-probs: the eager pair is below
            cands["tree.fused_children (+ log-probs)"] = \
                lambda x=x, kk=kk: fused_children(x, kk)[0]
        cells = []
        for label, fn in cands.items():
            same = torch.equal(x.gather(1, fn()).sort(-1, descending=True).values, ref)
            us = 1000 * _time_ms(fn, True, 200) if dev == "cuda" else float("nan")
            cells.append(f"{label} {us:.1f}{'' if same else ' (DIFFERENT values)'}")
        print(f"{name} [{R}, {V}] {str(dt).replace('torch.', '')}, top {kk}: " + "; ".join(cells),
              flush=True)
        if a.parts and name == "frontier logits":
            parts(x, kk, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
