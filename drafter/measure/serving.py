"""The serving commands that reproduce what evaluate measured, one per temperature: a vLLM
`--speculative-config` whose K follows the batch size, and SGLang's flags where SGLang has the
equivalent (said plainly where it has not).

    cfg = vllm_config(drafter_dir, rec, temperature)   # rec: tuning.recommend's {batch: ...}
    cfg, row = fallback_config(drafter_dir, rec, temperature)  # where no batch size speculates
    sch = schedule(rec)                                 # [[start, end, K]], K = 0: plain decoding
    notes = sglang_notes(temperature, rec)

vLLM 0.32 (vllm/config/speculative.py, vllm/v1/spec_decode/dynamic/utils.py):
- `num_speculative_tokens_per_batch_size`: [[start, end, K], ...] inclusive batch ranges, the
  first starting at 1, K = 0 where speculation does not pay; a gap keeps the previous K, the
  batches past the last range keep its K, each K at most `num_speculative_tokens` (so that is
  the schedule's largest K).
- `draft_sample_method`: `greedy` (the default: the drafter's argmax proposed, q taken as
  one-hot) or `probabilistic` (drafts sampled, the drafter's whole q in the rejection test).
  drafter's evaluator samples its drafts at every temperature above 0, so the configs for those
  say `probabilistic`; at temperature 0 both draft the argmax and it is left out.
- `rejection_sample_method: block`: block verification (drafter/decoding/block.py), when the
  tuner found it best at some batch size. It is one setting for the whole server: where a
  standard chain was best, the schedule's K is then served with block verification, which
  accepts at least as much for the same drafts (Sun et al.'s optimality), so the expected
  speedup there is a lower bound. Only vLLM's V2 model runner implements it (the default on
  CUDA with Triton); the V1 runner (vLLM's CPU build, VLLM_USE_V2_MODEL_RUNNER=0) ignores it and
  then drafts greedily.

The schedule's ranges are cut between the batch sizes the tuner measured at the geometric mean
of each neighbouring pair (1 and 64: 1..8 and 9..64); the last range ends at the largest one
measured and vLLM carries its K on to max_num_seqs.

SGLang (its 2026 sources: python/sglang/srt/server_args.py, arg_groups/speculative_hook.py,
speculative/reject_sampling.py): `--speculative-use-rejection-sampling` drafts by sampling and
runs Leviathan et al.'s test with the drafter's q, for chains only (`--speculative-eagle-topk
1`, EAGLE/EAGLE3, accept thresholds left at 1.0); without it SGLang proposes the argmax and its
verification is target-only (q one-hot), as vLLM's greedy drafting. It has no batch-size schedule
(one K for all batches; `--speculative-adaptive` moves num_steps with the acceptance it sees, not
with the batch size), no block verification, and no sampled drafting for trees.
"""
from __future__ import annotations

import json
import math


def _vllm_rows(r: dict) -> list[dict]:
    """The settings vLLM can serve at one batch size: chains (standard or block)."""
    return [x for x in r["settings"] if x.get("k")]


def schedule(rec: dict) -> list[list[int]]:
    """[[start, end, K]] over the tuner's batch sizes (module doc): K of the best chain vLLM can
    serve at each, 0 where no setting beats plain decoding there."""
    batches = sorted(int(b) for b in rec)
    ks = []
    for b in batches:
        r = rec[str(b)]
        best = max(_vllm_rows(r), key=lambda x: x["speedup"], default=None)
        ks.append(best["k"] if best and best["speedup"] >= 1 and r["expected_speedup"] >= 1
                  else 0)
    out, start = [], 1
    for i, (b, k) in enumerate(zip(batches, ks)):
        end = batches[-1] if i == len(batches) - 1 else \
            max(b, int(math.sqrt(b * batches[i + 1])))
        if out and out[-1][2] == k:
            out[-1][1] = end
        else:
            out.append([start, end, k])
        start = end + 1
    return out


def uses_block(rec: dict) -> bool:
    """Whether block verification is the best vLLM setting at some batch size that speculates."""
    for r in rec.values():
        best = max(_vllm_rows(r), key=lambda x: x["speedup"], default=None)
        if best and best.get("block") and best["speedup"] >= 1:
            return True
    return False


def vllm_config(drafter_dir: str, rec: dict, temperature: float,
                block: tuple[str, int] | None = None) -> dict | None:
    """The `--speculative-config` that serves what evaluate measured at `temperature` (rec:
    tuning.recommend's per-batch result), or None when no batch size speculates. `block`: a
    block drafter's (method, trained block size): vLLM drafts its whole block, one K for every
    batch size (a shorter block attends over other queries than in training)."""
    sch = schedule(rec)
    kmax = max(k for _, _, k in sch)
    if kmax == 0:
        return None
    if block:
        cfg = {"method": block[0], "model": drafter_dir, "num_speculative_tokens": block[1]}
    else:
        cfg = {"method": "eagle3", "model": drafter_dir, "num_speculative_tokens": kmax}
    if len({k for _, _, k in sch}) > 1 and not block:
        cfg["num_speculative_tokens_per_batch_size"] = sch
    if temperature > 0:
        cfg["draft_sample_method"] = "probabilistic"
        if uses_block(rec):
            cfg["rejection_sample_method"] = "block"
    return cfg


def fallback_config(drafter_dir: str, rec: dict, temperature: float,
                    block: tuple[str, int] | None = None) -> tuple[dict, dict] | None:
    """Where no batch size speculates (vllm_config is None): the config of the best chain vLLM
    can serve at any batch size measured, and that row, for a user who serves the drafter
    anyway (sampled as evaluate sampled it); None without a chain. `block`: vllm_config's."""
    rows = [x for r in rec.values() for x in _vllm_rows(r)]
    if not rows:
        return None
    best = max(rows, key=lambda x: x["speedup"])
    method, k = block or ("eagle3", best["k"])
    cfg = {"method": method, "model": drafter_dir, "num_speculative_tokens": k}
    if temperature > 0:
        cfg["draft_sample_method"] = "probabilistic"
        if best.get("block"):
            cfg["rejection_sample_method"] = "block"
    return cfg, best


def vllm_flag(cfg: dict) -> str:
    """The command-line form (vLLM parses the JSON: vllm/engine/arg_utils.py)."""
    return "--speculative-config '" + json.dumps(cfg) + "'"


def sglang_flags(drafter_dir: str, k: int | None = None, tree: dict | None = None,
                 temperature: float = 0.0) -> str:
    """SGLang's flags for a chain of k or an EAGLE-2 tree; a chain at a temperature above 0
    samples its drafts (`--speculative-use-rejection-sampling`). Its draft tokens count the
    root: a chain of K is K + 1, a tree of N drafted nodes N + 1."""
    base = f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {drafter_dir} "
    if tree is not None:
        return base + (f"--speculative-num-steps {tree['depth']} --speculative-eagle-topk "
                       f"{tree['topk']} --speculative-num-draft-tokens {tree['tokens'] + 1}")
    return base + (f"--speculative-num-steps {k} --speculative-eagle-topk 1 "
                   f"--speculative-num-draft-tokens {k + 1}"
                   + (" --speculative-use-rejection-sampling" if temperature > 0 else ""))


def sglang_notes(temperature: float, rec: dict) -> list[str]:
    """What SGLang cannot reproduce of this temperature's setting, in plain words."""
    notes = ["SGLang has no batch-size schedule: one K serves every batch size (pick the line "
             "of the batch size you serve most; `--speculative-adaptive` moves the number of "
             "steps with the acceptance it observes, not with the batch size)."]
    if temperature > 0:
        notes.append("`--speculative-use-rejection-sampling` (SGLang's 2026 sources; chains "
                     "only, topk 1) samples the drafts as drafter's evaluator did; an SGLang "
                     "without it proposes the argmax and verifies against the target alone, "
                     "as vLLM's greedy drafting, and accepts what that row of evaluate's report "
                     "shows, not these figures. A tree at this temperature has no sampled "
                     "drafting in SGLang: its τ here is not what SGLang gives.")
    if temperature > 0 and uses_block(rec):
        notes.append("SGLang has no block verification: its lines are the standard chain's.")
    return notes
