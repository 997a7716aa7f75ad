"""Run as a script by tests/test_vllm.py: vLLM's CPU build's rejection sampler on a case whose
answer is known, before and after drafter/core/vllm_cpu.py's repair; prints one JSON line.

    python tests/vllm_cpu_sampler.py

Two requests of three drafts each, at temperature 1 and 0.5, the target's logits 10 at the
drafted token and -10 elsewhere: every draft has probability ~1 and must be accepted, then the
bonus token. A script (a process of its own): registering the CPU platform's kernel overrides
rebinds vLLM's modules for the process."""
from __future__ import annotations

import dataclasses
import json

import torch


def main() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler as R
    from vllm.v1.sample.metadata import SamplingMetadata

    current_platform.import_kernels()
    current_platform.register_triton_kernel_overrides()   # what vLLM's CPU workers run
    V, B, K = 16, 2, 3
    draft = torch.tensor([3, 5, 7, 3, 5, 7], dtype=torch.int32)
    logits = torch.full((B * K, V), -10.0)
    logits[torch.arange(B * K), draft.long()] = 10.0
    cu = torch.tensor([3, 6], dtype=torch.int32)
    bonus = torch.tensor([[1], [1]], dtype=torch.int64)
    temps = torch.tensor([1.0, 0.5])
    fields = {f.name: None for f in dataclasses.fields(SamplingMetadata)}
    md = SamplingMetadata(**{**fields, "temperature": temps, "all_greedy": False,
                             "all_random": True, "generators": {}, "no_penalties": True,
                             "output_token_ids": [[], []], "bad_words_token_ids": {}})

    def run() -> dict:
        expanded = R.expand_batch_to_tokens(temps, cu, B * K, replace_from=0, replace_to=1)
        target = R.apply_sampling_constraints(logits.clone(), cu, md)
        out = R.rejection_sample(draft, [K, K], K, cu, None, target, bonus, md)
        return {"temperatures": expanded.tolist(), "tokens": out.tolist()}

    torch.manual_seed(0)
    before = run()
    from drafter.core import vllm_cpu  # its import repairs, as in a vLLM worker

    repaired = vllm_cpu.REPAIRED
    torch.manual_seed(0)
    print(json.dumps({"before": before, "repaired": repaired, "after": run(),
                      "want": [[3, 5, 7, 1], [3, 5, 7, 1]]}))


if __name__ == "__main__":
    main()
