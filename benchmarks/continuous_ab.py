"""Static batches against continuous batching (Decoder.generate(continuous=...)), alternating, on
one decoder: steps, prefill seconds, the decode step's milliseconds and the attention spans used.
Greedy outputs are checked equal. CPU or GPU; SmolLM2 with a drafter directory (native export).

    python3 benchmarks/continuous_ab.py --drafter runs/quickstart/export/native --prompts 24 \\
        --batch 8 --new 64 --k 3 --rounds 2
"""
import argparse
import collections
import time

import torch


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafter.core.config import load
    from drafter.core.target import resolve
    from drafter.data.sources import load_prompts
    from drafter.engine.decode import Decoder, EagleDraft, TreeSpec
    from drafter.export.enginedir import load_drafter_dir
    from drafter.export.engines import target_info

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = load("configs/quickstart.yaml", [])
    d = resolve(cfg.target.model)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(dev).eval()
    prompts = [tok(tok.apply_chat_template(r["messages"], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)["input_ids"]
               for r in load_prompts("builtin:humaneval", a.prompts)]
    P = EagleDraft(load_drafter_dir(a.drafter, device=dev, dtype=dtype,
                                    target=target_info(cfg.target.model, cfg.target)))
    dec = Decoder(model, max_batch=a.batch)
    spans: collections.Counter = collections.Counter()
    real = dec._spec_step

    def spy(st, span, *args):
        spans[span] += 1
        return real(st, span, *args)
    dec._spec_step = spy
    tokens = {}
    for _ in range(a.rounds):
        for cont in (False, True):
            spans.clear()
            t = time.perf_counter()
            out = dec.generate(prompts, a.new, stop_ids=[tok.eos_token_id], proposer=P,
                               tree=TreeSpec.chain(a.k), continuous=cont)
            tokens.setdefault(cont, [o.tokens for o in out])
            L = dec.last
            step = 1000 * (L["seconds"] - L["prefill_seconds"]) / L["iterations"]
            print(f"continuous={cont}: {time.perf_counter() - t:.1f} s, {L['iterations']} steps, "
                  f"prefills {L['prefill_seconds']:.1f} s, step {step:.1f} ms, spans "
                  f"{dict(sorted(spans.items()))}", flush=True)
    same = tokens[True] == tokens[False]
    print(f"outputs equal: {same}" + ("" if same or dtype == torch.float32 else " (bf16)"))


if __name__ == "__main__":
    main()
