"""What `drafter plan` starts from, counted before any weights load: the target's shape and
parameters, the samples and tokens of each split, and the throughputs earlier steps measured.

Reads   the target's config.json (an HF folder or id, through target.load_config, with
        target.trust_remote_code), or a GGUF file's metadata without its tensors (a .gguf or
        builtin target is never materialised);
        the run directory when it has something: tokenize/{train,val}.parquet (measured tokens),
        generate/ or prepare/conversations.jsonl (measured samples), earlier manifests (measured
        tokens/s); else the sources themselves (records and characters) and the `plan` section.
Writes  nothing.

Each count names its source: `measured` (this run directory), `config` (the `plan` section) or
`estimated` (characters / CHARS_PER_TOKEN, generate.max_tokens, tokenize.max_length).
drafter.run.plan turns the counts into bytes, GPU memory and seconds.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from drafter import DrafterError
from drafter.core import target
from drafter.core.rundir import STEPS, Run, read_json

# ~4 characters per token for English text with BPE vocabularies of 32k-160k ids (OpenAI's rule
# of thumb; SmolLM2 measures 4.3 on the shared gsm8k answers). Used only before tokenize ran.
CHARS_PER_TOKEN = 4.0


class PlanError(DrafterError):
    pass


# ---------------------------------------------------------------------------------- the target
def target_config(tcfg):
    """(config, description, gguf file size or None) from config.json or GGUF metadata only."""
    from transformers import AutoConfig

    spec = tcfg.model
    gguf = None
    if spec.startswith("builtin:"):
        gguf = target.builtin_file(spec.split(":", 1)[1])
    elif Path(os.path.expanduser(spec)).suffix == ".gguf":
        gguf = Path(os.path.expanduser(spec))
        if not gguf.is_file():
            raise PlanError(f"target.model: GGUF file not found: {gguf}")
    if gguf is not None:
        # transformers reads the GGUF header (load_gguf_checkpoint(return_tensors=False)): no
        # tensor is read or dequantised.
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                            trust_remote_code=tcfg.trust_remote_code)
        return config, f"{gguf} (GGUF metadata)", gguf.stat().st_size
    config = target.load_config(tcfg)
    where = target.resolve(spec)
    return config, f"{where} (config.json)", None


def param_counts(config, model) -> dict:
    """total, routed-expert, embedding and per-token active parameters of the meta model
    (target.meta_model)."""
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if target.is_routed_expert(n))
    emb = model.get_input_embeddings().weight.numel()
    out = model.get_output_embeddings()
    if out is None and hasattr(model, "get_decoder"):  # a wrapper: its language model's head
        out = getattr(model.get_decoder(), "get_output_embeddings", lambda: None)()
    tied = out is not None and out.weight is model.get_input_embeddings().weight
    e, k = target.moe_shape(config)
    active = total - (routed - routed * k // e if e else 0)
    # FLOPs per token touch every active weight but the input embedding (a lookup)
    return {"total": total, "routed_experts": routed, "experts": e, "experts_per_token": k,
            "active": active, "embedding": emb, "flop_params": active - (0 if tied else emb)}


def describe_target(config) -> dict:
    tc = target.text_config(config)
    e, k = target.moe_shape(config)
    return {"architecture": (getattr(config, "architectures", None) or [type(config).__name__])[0],
            "model_type": getattr(config, "model_type", ""),
            "num_layers": tc.num_hidden_layers, "hidden_size": tc.hidden_size,
            "vocab_size": tc.vocab_size, "experts": e, "experts_per_token": k,
            "mla": bool(getattr(tc, "kv_lora_rank", None))}


def dtype_bytes(cfg, on_gpu: bool) -> tuple[str, int]:
    """The dtype the target loads at on the run's machine (target.pick_dtype's rule: auto =
    bfloat16 on GPU, float32 on CPU)."""
    name = cfg.target.dtype
    if name == "auto":
        name = "bfloat16" if on_gpu and cfg.target.device != "cpu" else "float32"
    return name, {"bfloat16": 2, "float16": 2, "float32": 4}[name]


# ------------------------------------------------------------------------------------ the data
def _conversation_stats(records) -> dict:
    """samples per split, characters of prompts (system/user/tool) and answers, user turns."""
    n = val = turns = prompt_chars = answer_chars = 0
    for r in records:
        n += 1
        val += r.get("split") == "val"
        for m in r.get("messages", []):
            text = len(m.get("content") or "") + len(m.get("reasoning_content") or "")
            if m.get("role") == "assistant":
                answer_chars += text
            else:
                prompt_chars += text
                turns += m.get("role") == "user"
    return {"samples": n, "val": val, "user_turns": turns, "prompt_chars": prompt_chars,
            "answer_chars": answer_chars}


def _iter_jsonl(path: Path):
    with open(path, "rb") as f:
        for line in f:
            if line.endswith(b"\n"):
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    return


def _read_sources(cfg) -> dict | None:
    """Record counts and characters of the configured sources (local and builtin only: a hub
    dataset would be a download)."""
    from drafter.data.sources import Reject, read_source

    total = None
    for src in cfg.prepare.sources:
        local = src.path.startswith("builtin:") or Path(os.path.expanduser(src.path)).exists()
        if not local:
            return None
        recs = []
        for item in read_source(src):
            if isinstance(item, Reject):
                continue
            recs.append(item)
            if src.max_samples is not None and len(recs) >= src.max_samples:
                break
        st = _conversation_stats(recs)
        total = st if total is None else {k: total[k] + st[k] for k in total}
    return total


def data_counts(cfg, run: Run) -> dict:
    """Samples and tokens per split: measured from tokenize output when it exists, else from
    the conversations (run dir, then sources) and the plan section."""
    if run.tokens("train").exists():
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        out = {"source": f"measured ({run.step_dir('tokenize')})"}
        for split in ("train", "val"):
            p = run.tokens(split)
            if not p.exists():
                out[split] = {"samples": 0, "tokens": 0, "masked_tokens": 0}
                continue
            t = pq.read_table(str(p), columns=["num_tokens", "loss_mask"])
            out[split] = {"samples": t.num_rows,
                          "tokens": int(pc.sum(t.column("num_tokens")).as_py() or 0),
                          "masked_tokens": int(pc.sum(pc.list_flatten(
                              t.column("loss_mask"))).as_py() or 0)}
        return _totals(out)

    p, g = cfg.plan, cfg.generate
    st, where = None, None
    for step in ("generate", "prepare"):
        path = run.conversations(step)
        if path.exists():
            st, where = _conversation_stats(_iter_jsonl(path)), f"measured ({path})"
            break
    if p.samples is not None:
        n, val = p.samples, round(p.samples * cfg.prepare.val_fraction)
        samples_src = "config (plan.samples)"
    elif st is not None:
        n, val, samples_src = st["samples"], st["val"], where
    else:
        st = _read_sources(cfg)
        if st is None or not st["samples"]:
            raise PlanError("plan: no prepare output in the run directory and the sources are "
                            "not local files: set plan.samples (and plan.tokens_per_sample)")
        n, val = st["samples"], round(st["samples"] * cfg.prepare.val_fraction)
        samples_src = "measured (sources, before dedup)"

    # generate.extra_temperatures: every conversation answered once more per extra temperature
    copies = 1 + len(g.extra_temperatures) if g.enabled else 1
    if copies > 1 and not (where and "generate" in where):  # generate's output has them already
        n, val = n * copies, val * copies
        samples_src += f" x {copies} (generate.extra_temperatures)"
    turns = st["user_turns"] / max(st["samples"], 1) if st else 1.0
    if p.answer_tokens_per_sample is not None:
        answer = float(p.answer_tokens_per_sample)
        answer_src = "config (plan.answer_tokens_per_sample)"
    elif st is not None and (not g.enabled or where and "generate" in where):
        answer, answer_src = st["answer_chars"] / CHARS_PER_TOKEN / max(st["samples"], 1), \
            f"estimated ({CHARS_PER_TOKEN:g} chars/token)"
    else:
        answer, answer_src = g.max_tokens * max(turns, 1.0), \
            "estimated (generate.max_tokens per user turn: an upper bound)"
    if p.tokens_per_sample is not None:
        per, tok_src = float(p.tokens_per_sample), "config (plan.tokens_per_sample)"
    elif st is not None:
        prompt = st["prompt_chars"] / CHARS_PER_TOKEN / max(st["samples"], 1)
        per = min(float(cfg.tokenize.max_length), prompt + answer)
        tok_src = f"estimated (prompt chars / {CHARS_PER_TOKEN:g} + answer tokens)"
    else:
        per, tok_src = float(cfg.tokenize.max_length), "estimated (tokenize.max_length)"
    answer = min(answer, per)
    out = {"source": f"samples: {samples_src}; tokens: {tok_src}; answers: {answer_src}",
           "generated_tokens": round(n * answer) if g.enabled else 0}
    for split, k in (("train", n - val), ("val", val)):
        out[split] = {"samples": k, "tokens": round(k * per), "masked_tokens": round(k * answer)}
    return _totals(out)


def _totals(out: dict) -> dict:
    for key in ("samples", "tokens", "masked_tokens"):
        out[key] = out["train"][key] + out["val"][key]
    out.setdefault("generated_tokens", out["masked_tokens"])
    return out


# ------------------------------------------------------------------------------- measurements
def measured_throughputs(run: Run) -> dict:
    """tokens/s recorded by earlier manifests in this run dir: {step: (tokens/s, world size)}."""
    out = {}
    for step in STEPS:
        p = run.manifest(step)
        if not p.exists():
            continue
        try:
            m = read_json(p)
        except (OSError, json.JSONDecodeError):
            continue
        tps = None
        if step == "generate":
            tps = (m.get("throughput") or {}).get("completion_tokens_per_s")
        elif step == "tokenize" and m.get("seconds"):
            tps = (m.get("counts") or {}).get("tokens", 0) / m["seconds"]
        else:
            tps = m.get("tokens_per_s")
        if tps:
            out[step] = (float(tps), int(m.get("world_size") or 1))
    return out
