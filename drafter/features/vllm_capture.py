"""Hidden states captured inside vLLM: for targets that transformers cannot hold (extract.engine).

    cap = VllmCapture(cfg, d2t, t2d, max_len)    # vLLM loads the target with its own
                                                 # parallelism and quantisation (target.engine_args)
    flat = cap.run([ids0, ids1, ...])            # the fields of Capture.run, from vLLM's states
    cap.close()

A 1T-parameter INT4 MoE fits a node only as vLLM (or SGLang) runs it: experts spread by expert
parallelism, INT4 kernels, MLA. drafter does not grow a second distributed runtime: vLLM's
`extract_hidden_states` speculative method keeps the requested layers' states of every prompt
token, and its hidden-states connector writes them per request ([T, layers, Ht]); this module
asks for one new token per sample (the prefill is the work), reads the files back, and computes
the rest on drafter's side exactly as `Capture` does:

- layer ids keep drafter's meaning (id k = HS[k], the input of layer k; vLLM's ids mean the
  same). vLLM sorts and de-duplicates the ids it is given; the columns are put back in the
  configured order, repeats included.
- the teacher: vLLM also returns id N, the last layer's output before the final norm. The
  target's own final-norm module (built from its config, weights read from its safetensors) and
  lm_head rows turn it into the teacher in chunks (`Capture._teacher`, inherited), so the shards
  are the ones the transformers path writes.
- a check on every call: vLLM's own greedy next token after each sample must be the argmax of
  drafter's logits at the sample's last token (a missing norm, a wrong lm_head or a shifted layer
  fails here). Figures in `engine_check`; a disagreement beyond a near-tie raises.

vLLM writes the states under `extract/.engine-states/` and each file is deleted once read; a
killed run leaves only those, removed at the next start (shards are atomic: resume is extract's).
On a machine without CUDA the connector is drafter/features/vllm_connector.py (the stock one
copies through pinned memory and CUDA streams).
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from drafter.core import target
from drafter.core.vllm import (
    llm_kwargs,
    quiet_cpu_triton,
    shutdown_llm,
    vllm_dtype,
    vllm_missing,
)
from drafter.core.weights import read_weight, weight_files
from drafter.features.capture import (
    Capture,
    CaptureError,
    _transform,
    host_samples,
    layer_count,
    logit_transform,
    resolve_layer_ids,
)

log = logging.getLogger("drafter")

# a greedy disagreement whose top-2 logit margin is below this is a numerical tie (16-bit
# kernels add in another order than drafter's head), not a capture error
TIE_MARGIN = {torch.float32: 1e-3}
TIE_MARGIN_16BIT = 0.5


def _no_expandable_segments() -> None:
    """vLLM refuses any KV connector under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (a
    remapped page would move the states under the connector): drop that one setting for the
    vLLM's processes, saying so."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    parts = [p for p in conf.split(",") if p.strip()]
    keep = [p for p in parts if p.strip() != "expandable_segments:True"]
    if keep != parts:
        log.info("extract: PYTORCH_CUDA_ALLOC_CONF without expandable_segments:True for vLLM "
                 "(its hidden-states connector refuses it)")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(keep)


# ------------------------------------------------------------------------- the target's head
def _find(weight_map: dict, name: str, suffix: str) -> str:
    """A module's tensor in the checkpoint: its own name, else the one name ending in `suffix`
    outside vision towers and MTP layers (checkpoints that prefix their text model)."""
    if name in weight_map:
        return name
    cands = [k for k in weight_map if k.endswith(suffix) and ".layers." not in k
             and not any(s in k for s in ("vision", "visual", "mtp", "audio"))]
    if len(cands) != 1:
        raise CaptureError(f"the target's checkpoint has no tensor {name!r} (candidates ending "
                           f"in {suffix!r}: {cands or 'none'})")
    return cands[0]


def load_final_norm_and_head(tcfg, config, device, dtype) -> tuple[nn.Module, nn.Linear]:
    """The target's final-norm module (its own class, so Gemma's 1 + w and the like hold) and
    lm_head [V, Ht], with weights read from its safetensors: no other weight is loaded."""
    meta = target.meta_model(config, tcfg.trust_remote_code)
    names = {id(m): n for n, m in meta.named_modules()}
    n_layers, ht = target.num_layers(config), target.hidden_size(config)
    norms = [(n, m) for n, m in meta.named_modules()
             if n.split(".")[-1] in ("norm", "final_layernorm", "ln_f", "norm_f")
             and ".layers." not in n and not any(s in n for s in ("vision", "visual", "mtp"))
             and getattr(m, "weight", None) is not None and tuple(m.weight.shape) == (ht,)]
    if len(norms) != 1:
        raise CaptureError(f"{type(meta).__name__}: cannot tell its final norm (candidates: "
                           f"{[n for n, _ in norms] or 'none'}; {n_layers} layers)")
    norm_name, norm = norms[0]
    folder, weight_map = weight_files(tcfg)
    if not weight_map:
        raise CaptureError(f"{tcfg.model}: no model.safetensors or its index: the vLLM path "
                           f"reads the final norm and lm_head from safetensors")
    norm = norm.to_empty(device=device)
    for pname, p in norm.named_parameters():
        key = _find(weight_map, f"{norm_name}.{pname}", f"norm.{pname}")
        p.data.copy_(read_weight(tcfg, folder, weight_map, key))
    norm.to(dtype).eval().requires_grad_(False)
    head_mod = meta.get_output_embeddings()
    head_name = names.get(id(head_mod), "lm_head") + ".weight"
    tied = getattr(target.text_config(config), "tie_word_embeddings", False) \
        or getattr(config, "tie_word_embeddings", False)
    if head_name not in weight_map and tied:
        emb = names[id(meta.get_input_embeddings())] + ".weight"
        key = _find(weight_map, emb, "embed_tokens.weight")
    else:
        key = _find(weight_map, head_name, "lm_head.weight")
    w = read_weight(tcfg, folder, weight_map, key)                                # [V, Ht]
    head = nn.Linear(w.shape[1], w.shape[0], bias=False, device=device, dtype=dtype)
    head.weight.data.copy_(w)
    head.requires_grad_(False)
    return norm, head


# ----------------------------------------------------------------------------- the capture
class VllmCapture(Capture):
    """`Capture`'s outputs from vLLM's extract_hidden_states method (module docstring)."""

    def __init__(self, cfg, d2t: torch.Tensor, t2d: torch.Tensor, max_len: int,
                 states_dir: Path, out_dtype: torch.dtype | None = torch.bfloat16):
        missing = vllm_missing()
        if missing:
            raise CaptureError(f"extract.engine=vllm: {missing}")
        tcfg, ec = cfg.target, cfg.extract
        config = target.load_config(tcfg)
        self.device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        self.model_dtype = vllm_dtype(tcfg, str(self.device))
        self.out_dtype = out_dtype or self.model_dtype
        self.num_layers = target.num_layers(config)
        self.layer_ids = resolve_layer_ids(ec.layer_ids, self.num_layers, layer_count(cfg))
        self.hidden_size = target.hidden_size(config)
        self.vocab_size = target.vocab_size(config)
        self.scale, self.softcap = logit_transform(config)
        self.teacher = ec.teacher
        self.packed = True           # vLLM pads nothing: forwards are planned by ΣT
        self._vocab(d2t, t2d, ec.topk, ec.batch_tokens)
        self.norm, self.lm_head = load_final_norm_and_head(tcfg, config, self.device,
                                                           self.model_dtype)
        # vLLM's ids: sorted, unique, with N (the last layer's output, pre-norm) for the teacher
        self.vllm_ids = sorted(set(self.layer_ids) | {self.num_layers})
        self.columns = [self.vllm_ids.index(k) for k in self.layer_ids]
        self.check = {"samples": 0, "same_next_token": 0, "near_ties": 0}
        self.states_dir = Path(states_dir)
        shutil.rmtree(self.states_dir, ignore_errors=True)  # a killed run's leftovers
        self.states_dir.mkdir(parents=True)
        self.llm = self._start(cfg, max_len)

    def _start(self, cfg, max_len: int):
        quiet_cpu_triton()
        from vllm import LLM, SamplingParams
        from vllm.platforms import current_platform

        tcfg = cfg.target
        if current_platform.is_cpu():
            conn = {"kv_connector": "HostHiddenStatesConnector",
                    "kv_connector_module_path": "drafter.features.vllm_connector"}
        else:
            conn = {"kv_connector": "ExampleHiddenStatesConnector"}
        kw = llm_kwargs(tcfg, self.model_dtype, max_model_len=max_len + 1,
                        # a cached prefix is not recomputed: its states would be another batch's
                        enable_prefix_caching=False)
        kw["speculative_config"] = {
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {
                "eagle_aux_hidden_state_layer_ids": self.vllm_ids}}}
        kw["kv_transfer_config"] = {**conn, "kv_role": "kv_producer", "kv_connector_extra_config": {
            "shared_storage_path": str(self.states_dir)}}
        log.info("extract: starting vLLM on %s (layer ids %s as vLLM's %s; %s)", kw["model"],
                 self.layer_ids, self.vllm_ids,
                 ", ".join(f"{k}={v}" for k, v in tcfg.engine_args.items()) or "its defaults")
        self.params = SamplingParams(max_tokens=1, temperature=0.0)
        _no_expandable_segments()
        return LLM(**kw)

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            shutdown_llm(llm)
        shutil.rmtree(self.states_dir, ignore_errors=True)

    def info(self) -> dict:
        return {**super().info(), "engine": "vllm", "engine_layer_ids": self.vllm_ids}

    @torch.no_grad()
    def run(self, input_ids: Sequence[torch.Tensor | Sequence[int]]) -> dict:
        """The fields of `Capture.run` for these samples, from one vLLM generate call."""
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        ids, _, offsets = host_samples(input_ids)
        n_tok = int(offsets[-1])
        with self.lock:
            outs = self.llm.generate([{"prompt_token_ids": x.tolist()} for x in ids],
                                     self.params, use_tqdm=False)
        aux = torch.empty(n_tok, len(self.layer_ids), self.hidden_size, dtype=self.out_dtype,
                          device=self.device)                                   # [N, L, Ht]
        last = torch.empty(n_tok, self.hidden_size, dtype=self.model_dtype,
                           device=self.device)                                  # [N, Ht]
        vllm_next = []
        for b, (x, o) in enumerate(zip(ids, outs)):
            path = (o.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise CaptureError("vLLM returned no hidden-states file: is this vLLM's "
                                   "extract_hidden_states method available (vLLM >= 0.17)?")
            got = load_hidden_states(path)
            cleanup_hidden_states(path)
            hs, tok = got["hidden_states"], got["token_ids"]                   # [T, Lv, Ht]
            if tok.tolist() != x.tolist() or tuple(hs.shape[1:]) != (len(self.vllm_ids),
                                                                     self.hidden_size):
                raise CaptureError(f"vLLM's states for sample {b} do not match its tokens "
                                   f"({tuple(hs.shape)} for {len(x)} tokens, ids "
                                   f"{self.vllm_ids})")
            a, e = int(offsets[b]), int(offsets[b + 1])
            hs = hs.to(self.device)
            aux[a:e] = hs[:, self.columns].to(self.out_dtype)
            last[a:e] = hs[:, -1].to(self.model_dtype)
            vllm_next.append(o.outputs[0].token_ids[0])
        h = self.norm(last)                                                      # [N, Ht]
        out = {"input_ids": self._to_device(torch.cat(ids)), "offsets": offsets, "aux": aux}
        out.update(self._teacher(h))
        self._check_next(h[offsets[1:] - 1], torch.tensor(vllm_next, device=self.device))
        return out

    def _check_next(self, h_last: torch.Tensor, vllm_next: torch.Tensor) -> None:
        """vLLM's greedy token after each sample = the argmax of drafter's logits there."""
        z = _transform(self.lm_head(h_last), self.scale, self.softcap)            # [B, V]
        ours = z.argmax(-1)
        top2 = z.topk(2, -1).values
        margin = top2[:, 0] - top2[:, 1]
        same = ours == vllm_next
        tol = TIE_MARGIN.get(self.model_dtype, TIE_MARGIN_16BIT)
        ties = (~same) & (margin <= tol)
        self.check["samples"] += len(same)
        self.check["same_next_token"] += int(same.sum())
        self.check["near_ties"] += int(ties.sum())
        bad = int(((~same) & ~ties).sum())
        if bad:
            raise CaptureError(f"vLLM's next token differs from the argmax of drafter's teacher "
                               f"logits on {bad} of {len(same)} samples, beyond a near-tie: the "
                               f"final norm, lm_head or the layer ids ({self.vllm_ids}) are "
                               f"not what vLLM runs")

    def self_check(self, input_ids: Sequence[int]) -> dict:
        """One sample through vLLM: its states' shape and the next-token check (`run`)."""
        ids = list(input_ids)[:64]
        self.run([ids])
        return {"tokens": len(ids), "engine_check": dict(self.check)}
