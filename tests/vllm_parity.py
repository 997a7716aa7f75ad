"""Run as a script by tests/test_vllm.py: drafter's transformers capture and its capture inside
vLLM on the same samples, in float32; prints one JSON line of the differences.

    python tests/vllm_parity.py CONFIG

A script, not a test: vLLM starts its engine in spawned processes, which re-import the main
module, so it runs under a `__main__` guard of its own."""
from __future__ import annotations

import json
import sys

import torch


def main(path: str) -> None:
    from drafter.core import config as C
    from drafter.core import target
    from drafter.core.rundir import Run
    from drafter.data import tokens
    from drafter.features.capture import Capture
    from drafter.features.vllm_capture import VllmCapture
    from drafter.steps.extract import _read_table

    cfg = C.load(path)
    run = Run.of(cfg)
    d2t, t2d, _ = tokens.load_vocab(run.vocab())
    table = _read_table(run.tokens("train"))
    samples = [list(x) for x in table.column("input_ids").to_pylist()]
    ec = cfg.extract
    ref = Capture(target.load_model(cfg.target, "cpu", torch.float32), ec.layer_ids, d2t, t2d,
                  teacher="topk", topk=ec.topk, out_dtype=torch.float32)
    want = ref.run(samples)
    cap = VllmCapture(cfg, d2t, t2d, max(map(len, samples)), run.vllm_states(),
                      out_dtype=torch.float32)
    try:
        got = cap.run(samples)
    finally:
        cap.close()
    a, b = got["aux"].float(), want["aux"].float()                              # [N, L, Ht]
    rel = [((a[:, j] - b[:, j]).norm() / b[:, j].norm()).item() for j in range(a.shape[1])]
    print(json.dumps({
        "tokens": int(a.shape[0]), "layer_ids": cap.layer_ids, "vllm_ids": cap.vllm_ids,
        "aux_rel_l2": rel,
        "aux_max_rel": ((a - b).abs().max() / b.abs().max()).item(),
        "topk_ids_same": (got["teacher_topk_ids"] == want["teacher_topk_ids"]).all(-1)
        .float().mean().item(),
        "topk_sets_same": (got["teacher_topk_ids"].sort(-1).values
                           == want["teacher_topk_ids"].sort(-1).values).all(-1)
        .float().mean().item(),
        # where the order differs: the log-prob gap between the swapped ids (a near-tie or not)
        "swap_max_gap": _swap_gap(got, want),
        "top1_same": (got["teacher_topk_ids"][:, 0] == want["teacher_topk_ids"][:, 0])
        .float().mean().item(),
        "logp_max_diff": (got["teacher_topk_logp"] - want["teacher_topk_logp"]).abs().max()
        .item(),
        "in_vocab_same": (got["in_vocab"] == want["in_vocab"]).float().mean().item(),
        "engine_check": cap.check}))


def _swap_gap(got: dict, want: dict) -> float:
    """Largest gap, in drafter's own log-probs, between adjacent top-k entries at the tokens
    whose top-k order vLLM's states changed (0 when none did)."""
    bad = (got["teacher_topk_ids"] != want["teacher_topk_ids"]).any(-1)
    if not bad.any():
        return 0.0
    lp = want["teacher_topk_logp"][bad]                                          # [n, k]
    diff = got["teacher_topk_ids"][bad] != want["teacher_topk_ids"][bad]
    gaps = (lp[:, :-1] - lp[:, 1:]).abs()
    near = diff[:, :-1] | diff[:, 1:]
    return gaps[near].max().item()


if __name__ == "__main__":
    main(sys.argv[1])
