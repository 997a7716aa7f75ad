"""`drafter plan` against a measured extract on a slice of a large target, and the slice's rates
rescaled to the whole model (Kimi-K2.5 from benchmarks/kimi_slice.py's slice).

    python benchmarks/kimi_plan.py OUT/extract.json --json OUT/plan.json
    python benchmarks/kimi_plan.py OUT/extract.json --full configs/kimi-k2.5 \
        --full-config configs/plan-kimi-k2.5.yaml

Reads   extract_throughput.py's --json (the slice's folder, its tokens, batch_tokens, each
        storage option's tokens/s and peak GiB, the decoder-only rate, the load seconds), the
        slice's config.json and the whole model's (configs/kimi-k2.5: config.json only);
        no weights, no GPU.
Writes  --json: the comparison below (and prints it).

1. Plan against measured, on the slice. `drafter.run.plan.make_plan` for the slice as target
   (one GPU of the measured GPU's memory, extract's batch_tokens, the measured tokens, nothing in
   its run directory: every figure `estimated`), once per storage option measured: extract's
   tokens/s (the forward's FLOPs, then the stored bytes at plan.store_gbps), seconds and load
   seconds, and its GPU memory per rank, each over the measured figure (measured / plan: 1.0 is
   exact; the memory goal is within 0.85-1.15).
2. The slice's rates rescaled to the whole model (plan has no path that measures one model and
   plans another; its `plan.extract_tokens_per_s` takes the result). Two rules, both printed:
   - per layer (the one used): a token's time on the slice, t = 1 / tokens/s of the option,
     holds the embedding, lm_head, the teacher, the storage and the decoder's layers; only the
     layers grow. t_full = t + t_decoder * (A_full / A_slice - 1), where t_decoder is 1 / the
     decoder-only rate and A is the decoder's active parameters per token (plan's
     flop_params less lm_head): the first dense layer, then MoE layers of 8 routed + 1 shared
     experts whatever the expert count, so A grows with the layer count only.
   - per active parameter (plan's own FLOP model, `mfu * gpu_tflops / (2 * flop_params)`):
     tokens/s * flop_params_slice / flop_params_full; the same as running plan with the mfu
     the slice measured (printed as `extract_mfu`). It scales lm_head and the teacher with the
     layers, so it is lower than the per-layer rule for a slice of few layers.
   Both hold the transformers path's efficiency per layer fixed: at 384 routed experts a
   prefill of batch_tokens gives each expert 1/6 of the tokens a 64-expert slice gives it
   (smaller grouped matmuls), so the whole model's real rate is at most these figures.
   Then make_plan for --full-config with plan.extract_tokens_per_s set to the per-layer rate
   (per GPU: plan multiplies it by plan.gpus), beside plan's own estimate for it.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter.core import config as C  # noqa: E402
from drafter.core import target  # noqa: E402
from drafter.run.counts import param_counts  # noqa: E402
from drafter.run.plan import make_plan  # noqa: E402

GiB = 1 << 30
REPO = Path(__file__).resolve().parents[1]


def counts(model_dir: str) -> dict:
    """Parameters of a target folder's config (meta device): plan's counts, and the decoder's
    active parameters per token (flop_params less an untied lm_head)."""
    conf = target.load_config(C.TargetConfig(model=model_dir))
    meta = target.meta_model(conf, False)
    p = param_counts(conf, meta)
    head = meta.get_output_embeddings()
    tied = head is not None and head.weight is meta.get_input_embeddings().weight
    p["decoder_active"] = p["flop_params"] - (0 if tied or head is None else head.weight.numel())
    p["layers"] = target.num_layers(conf)
    return p


def slice_plan(m: dict, run_dir: str, gpu_gib: float, option: str = "fp8/topk") -> dict:
    """make_plan for the measured slice: its extract figures as plan estimates them for one
    storage option ("fp8/topk": extract.aux_dtype / extract.teacher)."""
    aux, teacher = option.split("/")
    cfg = C.load(None, [f"run_dir={run_dir}", f"target.model={m['model']}",
                        f"extract.aux_dtype={aux}", f"extract.teacher={teacher}",
                        "target.dtype=bfloat16", "train.online=false",
                        f"extract.batch_tokens={m['batch_tokens']}", f"extract.topk={m['topk']}",
                        f"vocab.draft_vocab_size={m['Vd']}", "plan.gpus=1",
                        f"plan.gpu_memory_gib={gpu_gib}", "plan.samples=1",
                        f"plan.tokens_per_sample={m['tokens']}", "prepare.val_fraction=0"])
    plan = make_plan(cfg)
    t = next(r for r in plan["time"] if r["step"] == "extract")
    return {"tokens_per_s": t["tokens_per_s"], "seconds": t["seconds"],
            "load_seconds": t["load_seconds"], "source": t["source"],
            "gpu_bytes": plan["gpu_memory"]["extract"]["total"],
            "gpu_parts": {k: v for k, v in plan["gpu_memory"]["extract"].items()
                          if k not in ("total", "tp")},
            "mfu": cfg.plan.mfu, "gpu_tflops": cfg.plan.gpu_tflops,
            "load_gbps": cfg.plan.load_gbps, "store_gbps": cfg.plan.store_gbps}


def full_plan(config_yaml: str, full_dir: str, tps: float | None) -> dict:
    """make_plan for the whole model's config with full_dir as its target: its extract time,
    estimated and (tps given) from the rescaled rate."""
    out = {}
    for key, over in (("estimated", []),
                      ("rescaled", [f"plan.extract_tokens_per_s={tps}"] if tps else None)):
        if over is None:
            continue
        cfg = C.load(config_yaml, [f"target.model={full_dir}", "train.online=false", *over])
        with tempfile.TemporaryDirectory() as d:  # nothing measured in a run dir
            cfg.run_dir = d
            plan = make_plan(cfg)
        t = next(r for r in plan["time"] if r["step"] == "extract")
        out[key] = {"tokens_per_s": t["tokens_per_s"], "tokens": t["tokens"],
                    "seconds": t["seconds"], "source": t["source"], "gpus": plan["gpus"]["count"],
                    "runs_in": plan["runs_in"]["extract"]}
    return out


def compare(m: dict, full_dir: str | None, full_yaml: str | None) -> dict:
    gpu_gib = m.get("gpu_memory_gib") or 139.8  # the H200's, where the figure has no GPU
    with tempfile.TemporaryDirectory() as d:
        per_option = {name: slice_plan(m, d, gpu_gib, name) for name in m["options"]}
    p = next(iter(per_option.values()))
    sl = counts(m["model"])
    out = {"slice": {"model": m["model"], "params": sl, "tokens": m["tokens"],
                     "batch_tokens": m["batch_tokens"], "gpu": m.get("gpu")},
           "plan": p, "options": {}}
    out["load"] = {"measured_s": m.get("load_s"), "plan_s": p["load_seconds"],
                   "measured_over_plan": m["load_s"] / p["load_seconds"]
                   if m.get("load_s") and p["load_seconds"] else None}
    full = counts(full_dir) if full_dir else None
    if full:
        out["full"] = {"model": full_dir, "params": full,
                       "decoder_active_ratio": full["decoder_active"] / sl["decoder_active"],
                       "flop_params_ratio": full["flop_params"] / sl["flop_params"]}
    t_dec = 1 / m["decoder_tokens_per_s"]
    for name, o in m["options"].items():
        tps, peak, po = o["tokens_per_s"], o.get("peak_gib"), per_option[name]
        r = {"measured_tokens_per_s": tps, "plan_tokens_per_s": po["tokens_per_s"],
             "measured_over_plan": tps / po["tokens_per_s"],
             "measured_seconds": m["tokens"] / tps, "plan_seconds": po["seconds"],
             # the MFU that plan's FLOP model would need to give the measured rate
             "extract_mfu": tps * 2 * sl["flop_params"] / (p["gpu_tflops"] * 1e12),
             "measured_peak_gib": peak, "plan_gib": po["gpu_bytes"] / GiB,
             "peak_over_plan": peak * GiB / po["gpu_bytes"] if peak else None}
        if full:
            t_full = 1 / tps + t_dec * (out["full"]["decoder_active_ratio"] - 1)
            r["full_tokens_per_s_per_layer"] = 1 / t_full
            r["full_tokens_per_s_per_param"] = tps / out["full"]["flop_params_ratio"]
        out["options"][name] = r
    if full and full_yaml:
        best = max(out["options"].values(), key=lambda r: r["measured_tokens_per_s"])
        out["full_plan"] = full_plan(full_yaml, full_dir, best["full_tokens_per_s_per_layer"])
        out["full_plan"]["rescaled_from"] = max(out["options"],
                                                key=lambda k: out["options"][k]
                                                ["measured_tokens_per_s"])
    return out


def render(r: dict) -> str:
    p, sl = r["plan"], r["slice"]
    lines = [f"slice {sl['model']}: {sl['params']['layers']} layers, "
             f"{sl['params']['total'] / 1e9:.2f}B params, {sl['params']['flop_params'] / 1e9:.2f}B "
             f"active per token (decoder {sl['params']['decoder_active'] / 1e9:.2f}B); "
             f"{sl['tokens']:,} tokens in forwards of <= {sl['batch_tokens']:,}",
             f"plan (mfu {p['mfu']}, {p['gpu_tflops']} TFLOP/s, load {p['load_gbps']} GB/s, "
             f"store {p['store_gbps']} GB/s): extract of the first option "
             f"{p['tokens_per_s']:,.0f} tokens/s, {p['gpu_bytes'] / GiB:.1f} GiB "
             f"(" + ", ".join(f"{k} {v / GiB:.1f}" for k, v in p["gpu_parts"].items()
                              if isinstance(v, (int, float))) + ")"]
    ld = r["load"]
    if ld["measured_s"] is not None:
        lines.append(f"load: measured {ld['measured_s']:.0f} s, plan {ld['plan_s']:.0f} s "
                     f"(measured / plan {ld['measured_over_plan']:.2f})")
    head = ["option", "tokens/s", "plan tokens/s", "measured / plan", "seconds (plan)",
            "extract MFU", "peak GiB", "plan GiB", "peak / plan"]
    if "full" in r:
        head += ["full: tokens/s per layer", "per active param"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, o in r["options"].items():
        cells = [name, f"{o['measured_tokens_per_s']:,.0f}", f"{o['plan_tokens_per_s']:,.0f}",
                 f"{o['measured_over_plan']:.2f}",
                 f"{o['measured_seconds']:.1f} ({o['plan_seconds']:.1f})",
                 f"{o['extract_mfu']:.1%}",
                 "-" if o["measured_peak_gib"] is None else f"{o['measured_peak_gib']:.1f}",
                 f"{o['plan_gib']:.1f}",
                 "-" if o["peak_over_plan"] is None else f"{o['peak_over_plan']:.2f}"]
        if "full" in r:
            cells += [f"{o['full_tokens_per_s_per_layer']:,.0f}",
                      f"{o['full_tokens_per_s_per_param']:,.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if "full" in r:
        f = r["full"]
        lines.append(f"\nfull {f['model']}: {f['params']['layers']} layers, "
                     f"{f['params']['flop_params'] / 1e9:.1f}B active per token (decoder "
                     f"{f['params']['decoder_active'] / 1e9:.1f}B): "
                     f"x{f['decoder_active_ratio']:.2f}"
                     f" the slice's decoder, x{f['flop_params_ratio']:.2f} its active params")
    for key, t in r.get("full_plan", {}).items():
        if isinstance(t, dict):
            lines.append(f"plan of the full model, extract ({key}): {t['tokens_per_s']:,.0f} "
                         f"tokens/s over {t['gpus']} GPU(s) [{t['source']}], {t['tokens']:,} "
                         f"tokens in {t['seconds'] / 60:.1f} min; runs in {t['runs_in']}")
    if "full_plan" in r:
        lines.append(f"(rescaled from {r['full_plan']['rescaled_from']}, per layer; "
                     f"drafter plan CONFIG plan.extract_tokens_per_s=<that rate> gives the same)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("measured", help="extract_throughput.py --json output on the slice")
    ap.add_argument("--full", default=str(REPO / "configs/kimi-k2.5"),
                    help="the whole model's folder (config.json is enough); '' skips rescaling")
    ap.add_argument("--full-config", default=str(REPO / "configs/plan-kimi-k2.5.yaml"),
                    help="a drafter config planning the whole model; '' skips its plan")
    ap.add_argument("--json", help="write the comparison here")
    a = ap.parse_args(argv)
    m = json.loads(Path(a.measured).read_text())
    r = compare(m, a.full or None, a.full_config or None)
    print(render(r))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{a.json}.tmp")
        tmp.write_text(json.dumps(r, indent=2, default=str))
        tmp.replace(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
