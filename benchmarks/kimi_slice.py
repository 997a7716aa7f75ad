"""A Kimi-K2.5-shaped target for GPU benchmarks, written without downloading anything: a
DeepSeek-V3 checkpoint with random weights, Kimi-K2.5's real sizes and fewer layers and experts.

    python benchmarks/kimi_slice.py /data/kimi-slice              # 6 layers, 64 experts: ~18B
                                                                  # params, ~35 GB of bf16
    python benchmarks/kimi_slice.py /data/kimi-slice-4 --layers 4 --experts 16
    python benchmarks/kimi_slice.py --dry-run                     # sizes only, writes nothing
    python benchmarks/kimi_slice.py /tmp/tiny-slice --tiny --layers 2 --experts 4   # CPU check
    python benchmarks/kimi_slice.py OUT --tokenizer DIR           # a tokenizer folder instead

Writes OUT_DIR as a normal HF folder that transformers, vLLM and drafter's target loader read:
config.json (model_type deepseek_v3, DeepseekV3ForCausalLM), bf16 safetensors shards in the hub's
DeepSeek-V3 layout (per-expert tensors, `model.safetensors.index.json`), and the tokenizer of
the embedded SmolLM2 (drafter.core.target.resolve("builtin:smollm2-135m-instruct"); its ids stay
below 49,152, so most of the 163,840 embedding rows are never read; the tokenizer only makes
the folder loadable, the sizes are Kimi's). --tokenizer takes any other tokenizer folder or spec
(a machine without the builtin's package: a folder of the SmolLM2 tokenizer saved beforehand,
as benchmarks/kimi_shape.sh pack does).

Kimi-K2.5's language model kept whole: hidden 7168, vocab 163,840, MLA (q_lora 1536, kv_lora
512, 64 heads, qk nope / rope 128 / 64, v 128), YaRN (theta 50,000, factor 64, mscale and
mscale_all_dim 1.0 over 4,096 positions), the first layer dense (intermediate 18,432), then MoE
layers of moe_intermediate 2048 with 1 shared expert and sigmoid routing; 61 layers and 384
routed experts become --layers (6) and --experts (64, 8 per token). A layer of 64 experts is
2.8B parameters: the default slice is one dense and five MoE layers plus the embeddings and
lm_head (1.2B each). --tiny shrinks every size (hidden 64 ...) for a CPU run of this script.

Weights are drawn on the GPU when there is one (N(0, 0.02), norms 1, routing biases 0; seeded)
and written shard by shard; the lm_head rows of ids the tokenizer does not have (49,152 and up)
are zeros (--live-vocab), so that the target's greedy tokens are ones the tokenizer can write
(evaluate turns MT-bench's first answers back into text) and the draft vocab, counted over
tokenized text, can hold them; the compute is the same. Shards are written one by one (each
about --shard-gb, atomically: a temp name, then a rename), so host memory holds one shard at a
time. The folder is complete only when its index is written; the index goes last.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter.core.rundir import atomic_json, safe_save_file  # noqa: E402

# Kimi-K2.5's text config (a DeepSeek-V3 one); num_hidden_layers and n_routed_experts are the
# slice's (the model has 61 and 384).
KIMI = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 6, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_routed_experts": 64, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.827,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "beta_fast": 1.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096},
    "attention_bias": False, "tie_word_embeddings": False, "initializer_range": 0.02,
    "bos_token_id": 163584, "eos_token_id": 163585, "torch_dtype": "bfloat16",
}
# --tiny: the structure (MLA, YaRN, dense then MoE layers) and the head sizes Kimi's (vLLM's MLA
# kernels take only kv_lora + rope = 576), every other size small
TINY = {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 32, "max_position_embeddings": 1024, "bos_token_id": 1, "eos_token_id": 2,
        "rope_scaling": {**KIMI["rope_scaling"], "factor": 16.0,
                         "original_max_position_embeddings": 64}}
BUILTIN_TOKENIZER = "builtin:smollm2-135m-instruct"


def slice_config(layers: int = 6, experts: int = 64, per_token: int = 8,
                 tiny: bool = False) -> dict:
    """config.json of the slice."""
    c = {**KIMI, **(TINY if tiny else {}), "num_hidden_layers": layers,
         "n_routed_experts": experts, "num_experts_per_tok": min(per_token, experts)}
    c["rope_scaling"] = dict(c["rope_scaling"])
    return c


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor, in the hub's DeepSeek-V3 layout, in file order."""
    H, V, nh = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (H,),
            p + "self_attn.q_a_proj.weight": (c["q_lora_rank"], H),
            p + "self_attn.q_a_layernorm.weight": (c["q_lora_rank"],),
            p + "self_attn.q_b_proj.weight": (nh * qk, c["q_lora_rank"]),
            p + "self_attn.kv_a_proj_with_mqa.weight": (c["kv_lora_rank"] + c["qk_rope_head_dim"],
                                                        H),
            p + "self_attn.kv_a_layernorm.weight": (c["kv_lora_rank"],),
            p + "self_attn.kv_b_proj.weight": (nh * (c["qk_nope_head_dim"] + c["v_head_dim"]),
                                               c["kv_lora_rank"]),
            p + "self_attn.o_proj.weight": (H, nh * c["v_head_dim"]),
            p + "post_attention_layernorm.weight": (H,),
        })
        if i < c["first_k_dense_replace"]:
            mlps = {"mlp.": c["intermediate_size"]}
        else:
            E, Im = c["n_routed_experts"], c["moe_intermediate_size"]
            out[p + "mlp.gate.weight"] = (E, H)
            out[p + "mlp.gate.e_score_correction_bias"] = (E,)
            mlps = {f"mlp.experts.{j}.": Im for j in range(E)}
            mlps["mlp.shared_experts."] = Im * c["n_shared_experts"]
        for m, I in mlps.items():
            out.update({p + m + "gate_proj.weight": (I, H), p + m + "up_proj.weight": (I, H),
                        p + m + "down_proj.weight": (H, I)})
    out["model.norm.weight"] = (H,)
    out["lm_head.weight"] = (V, H)
    return out


def sizes(c: dict) -> dict:
    shapes = tensor_shapes(c)
    n = sum(torch.Size(s).numel() for s in shapes.values())
    return {"tensors": len(shapes), "params": n, "bytes_bf16": 2 * n}


def draw(name: str, shape: tuple[int, ...], g: torch.Generator, device,
         std: float | None = None) -> torch.Tensor:
    """A tensor as the model's own init would set it: norms 1, routing biases 0, the rest
    N(0, 0.02), or N(0, std)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    if name.endswith("e_score_correction_bias"):
        return torch.zeros(shape, dtype=torch.float32, device=device)  # fp32 in the hub files
    t = torch.empty(shape, dtype=torch.bfloat16, device=device)
    return t.normal_(0.0, std or KIMI["initializer_range"], generator=g)


def write(out: Path, c: dict, shard_bytes: int, device, seed: int = 0,
          tokenizer: str = BUILTIN_TOKENIZER, live_vocab: int | None = None,
          std: float | None = None) -> dict:
    """The checkpoint in `out` (an existing or new folder): shards, then config.json, the
    tokenizer and, last, the index. lm_head rows from live_vocab on are zeros (None: the
    tokenizer's length; 0: none). -> {"shards", "params", "bytes", "seconds"}."""
    from transformers import AutoTokenizer

    from drafter.core.target import resolve

    t0 = time.perf_counter()
    # a target spec (builtin:, .gguf) materialised, or a tokenizer folder as it is
    spec = resolve(tokenizer) if tokenizer.startswith("builtin:") or \
        tokenizer.endswith(".gguf") else tokenizer
    tok = AutoTokenizer.from_pretrained(spec)
    live = len(tok) if live_vocab is None else live_vocab
    out.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(c)
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        b = 2 * torch.Size(shape).numel()
        if groups[-1] and size + b > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += b
    g = torch.Generator(device=device).manual_seed(seed)
    weight_map, total = {}, 0
    for k, names in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for n in names:
            t = draw(n, shapes[n], g, device, std)
            if n == "lm_head.weight" and 0 < live < t.shape[0]:
                t[live:] = 0  # ids the tokenizer cannot write never win the argmax
            shard[n] = t.cpu()
        total += sum(t.numel() * t.element_size() for t in shard.values())
        safe_save_file(shard, out / fname, {"format": "pt"})
        weight_map.update({n: fname for n in names})
        del shard
        print(f"{fname}: {len(names)} tensors ({time.perf_counter() - t0:.0f}s)", flush=True)
    atomic_json(out / "config.json", c)
    tok.save_pretrained(out)
    atomic_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": weight_map})
    return {"shards": len(groups), "params": sum(torch.Size(s).numel() for s in shapes.values()),
            "bytes": total, "seconds": time.perf_counter() - t0}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", nargs="?", type=Path, help="the folder to write")
    p.add_argument("--layers", type=int, default=6, help="decoder layers (Kimi-K2.5: 61)")
    p.add_argument("--experts", type=int, default=64, help="routed experts (Kimi-K2.5: 384)")
    p.add_argument("--experts-per-token", type=int, default=8, help="routed experts per token")
    p.add_argument("--tiny", action="store_true", help="every size small (a CPU check)")
    p.add_argument("--shard-gb", type=float, default=5.0, help="about this many GB a shard")
    p.add_argument("--device", help="where weights are drawn (default: cuda when there is one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--live-vocab", type=int, default=None,
                   help="lm_head rows from this id on are zeros (default: the tokenizer's "
                        "length; 0: every row random)")
    p.add_argument("--tokenizer", default=BUILTIN_TOKENIZER,
                   help="the tokenizer saved with the slice: a target spec or tokenizer folder")
    p.add_argument("--std", type=float, default=None,
                   help="N(0, std) for the matrices (default: the config's 0.02). At 0.02 a "
                        "random target's next token is nearly one token whatever the context; "
                        "larger, it depends on the context (a drafter has something to learn)")
    p.add_argument("--dry-run", action="store_true", help="print the sizes, write nothing")
    args = p.parse_args(argv)
    c = slice_config(args.layers, args.experts, args.experts_per_token, args.tiny)
    s = sizes(c)
    print(f"DeepSeek-V3 slice: {c['num_hidden_layers']} layers, {c['n_routed_experts']} routed "
          f"experts ({c['num_experts_per_tok']} per token), hidden {c['hidden_size']}, vocab "
          f"{c['vocab_size']}: {s['tensors']} tensors, {s['params'] / 1e9:.2f}B params, "
          f"{s['bytes_bf16'] / 1e9:.1f} GB bf16", flush=True)
    if args.dry_run:
        print(json.dumps(c, indent=2))
        return
    if args.out is None:
        p.error("give the folder to write (or --dry-run)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    r = write(args.out, c, int(args.shard_gb * 1e9), device, args.seed, args.tokenizer,
              args.live_vocab, args.std)
    print(f"wrote {args.out}: {r['shards']} shards, {r['bytes'] / 1e9:.1f} GB in "
          f"{r['seconds']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
