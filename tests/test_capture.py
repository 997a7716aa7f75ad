"""Capture: HS[k] and the teacher equal a plain forward's output_hidden_states / logits, for every
architecture in tests/tiny.py and SmolLM2; batching (padded or packed) changes nothing."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from drafter.features import capture as C
from tests.tiny import ARCHS, make_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def draft_vocab(V: int, vd: int = 2000, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(V, generator=g)[:vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(vd), t2d, ids


def samples(V: int, lengths, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g) for n in lengths]


def assert_close_rel(a, b, rel=1e-5):
    """fp32 agreement relative to the tensor's scale (hidden states carry channels of ~100s)."""
    d = (a.float() - b.float()).abs().max().item()
    assert d <= rel * max(b.float().abs().max().item(), 1.0), d


def reference(model, ids: torch.Tensor):
    """A plain forward of one sample: (hidden_states [N+1 x [T, Ht]], logits [T, V])."""
    with torch.no_grad():
        out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    return [h[0] for h in out.hidden_states], out.logits[0].float()


def check_exact(model, cap: C.Capture, ids: torch.Tensor, draft_ids: torch.Tensor,
                cache: dict | None = None):
    """One-sample capture == one-sample plain forward, bit for bit where the math is the same."""
    key = (id(model), tuple(ids.tolist()))
    if cache is None or key not in cache:
        ref = reference(model, ids)
        if cache is not None:
            cache[key] = ref
    hs, logits = cache[key] if cache is not None else ref
    n = cap.num_layers
    assert len(hs) == n + 1
    flat = cap.run([ids])
    for j, k in enumerate(cap.layer_ids):
        assert torch.equal(flat["aux"][:, j], hs[k]), f"HS[{k}]"
    if "teacher_hidden" in flat:
        assert torch.equal(flat["teacher_hidden"], hs[n])       # after the final norm
    assert torch.equal(flat["in_vocab"], cap.t2d[logits.argmax(-1)])
    if "teacher_topk_ids" in flat:
        lp = torch.log_softmax(logits[:, draft_ids], -1)
        v, i = lp.topk(cap.topk, -1)
        assert torch.equal(flat["teacher_topk_ids"], i)
        assert torch.allclose(flat["teacher_topk_logp"], v, atol=4e-3)  # fp16 rounding
    return flat


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return {a: make_tiny(a, d, tokenizer_dir=None) for a in ARCHS}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_hooks_equal_output_hidden_states(tiny_models, arch):
    model = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32).eval()
    V = model.config.vocab_size
    N = model.config.num_hidden_layers
    d2t, t2d, draft_ids = draft_vocab(V)
    lengths = [13, 5, 21, 1]
    seqs = samples(V, lengths)
    results, refs = {}, {}
    for teacher in ("hidden", "topk"):
        cap = C.Capture(model, list(range(N)), d2t, t2d, teacher=teacher, topk=16,
                        out_dtype=None, batch_tokens=40)
        singles = [check_exact(model, cap, s, draft_ids, refs) for s in seqs]
        for packing in ("padded", "packed"):
            cap = C.Capture(model, list(range(N)), d2t, t2d, teacher=teacher, topk=16,
                            out_dtype=None, packing=packing, batch_tokens=40)
            assert cap.packed == (packing == "packed")
            # several samples per forward (the budget of 40 tokens makes 2 forwards)
            got = cap([{"input_ids": s, "loss_mask": torch.ones_like(s)} for s in seqs])
            for one, many in zip(singles, got):
                assert set(many) == {k for k in one if k != "offsets"} | {"loss_mask"}
                for k, v in many.items():
                    if k == "teacher_topk_logp":  # fp16-rounded: one ulp may flip
                        torch.testing.assert_close(v, one[k], rtol=0, atol=8e-3)
                    elif v.is_floating_point():
                        assert_close_rel(v, one[k])
                    elif k != "loss_mask":
                        assert torch.equal(v, one[k]), k
            results[teacher, packing] = got
    # the packed and padded layouts give the same numbers
    for a, b in zip(results["hidden", "padded"], results["hidden", "packed"]):
        assert_close_rel(a["aux"], b["aux"])
    assert cap.self_check(seqs[2])["tokens"] == 21


def test_smollm2_default_ids_and_contract_dtypes(smollm2_dir):
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    V, N = model.config.vocab_size, model.config.num_hidden_layers
    d2t, t2d, draft_ids = draft_vocab(V, 8000)
    texts = ["The quick brown fox jumps over the lazy dog.",
             "def add(a, b):\n    return a + b\n"]
    seqs = [torch.tensor(tok(t)["input_ids"]) for t in texts]
    cap = C.Capture(model, None, d2t, t2d, teacher="topk", topk=8, out_dtype=None)
    assert cap.layer_ids == [2, N // 2, N - 3] == [2, 15, 27]
    got = cap([{"input_ids": s, "loss_mask": torch.ones_like(s)} for s in seqs])  # one forward
    refs = [reference(model, s) for s in seqs]
    for o, (hs, logits) in zip(got, refs):
        for j, k in enumerate(cap.layer_ids):
            assert_close_rel(o["aux"][:, j], hs[k])
        assert torch.equal(o["in_vocab"], t2d[logits.argmax(-1)])
        v, i = torch.log_softmax(logits[:, draft_ids], -1).topk(8, -1)
        assert torch.equal(o["teacher_topk_ids"], i)
        torch.testing.assert_close(o["teacher_topk_logp"], v, rtol=0, atol=8e-3)
    # the training contract: bf16 aux, int64 ids and masks, bool in_vocab
    cap = C.Capture(model, None, d2t, t2d, teacher="hidden")
    out = cap([{"input_ids": s.tolist(), "loss_mask": [1] * len(s)} for s in seqs])
    for s, o, (hs, _) in zip(seqs, out, refs):
        T = len(s)
        assert o["input_ids"].dtype == torch.int64 and torch.equal(o["input_ids"], s)
        assert o["loss_mask"].dtype == torch.int64 and o["loss_mask"].shape == (T,)
        assert o["aux"].dtype == torch.bfloat16 and o["aux"].shape == (T, 3, 576)
        assert o["teacher_hidden"].dtype == torch.bfloat16 and o["teacher_hidden"].shape == (T, 576)
        assert o["in_vocab"].dtype == torch.bool
        torch.testing.assert_close(o["teacher_hidden"], hs[N].to(torch.bfloat16))
    info = cap.info()
    assert info["layer_ids"] == [2, 15, 27] and info["num_layers"] == 30
    assert info["hidden_size"] == 576 and info["draft_vocab_size"] == 8000
    # the head: lm_head rows of the draft vocab; teacher_logprobs from it = the model's
    head = cap.head
    assert torch.equal(head.weight, model.lm_head.weight[draft_ids])
    lp = torch.log_softmax(head.logits(out[0]["teacher_hidden"]), -1)
    ref = torch.log_softmax(refs[0][1][:, draft_ids], -1)
    assert (lp.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9   # bf16 teacher hidden
    assert (lp.exp() - ref.exp()).abs().sum(-1).max() < 0.1


def test_self_check_catches_an_off_by_one_and_a_missing_softcap(tiny_models):
    model = AutoModelForCausalLM.from_pretrained(tiny_models["gemma2"], dtype=torch.float32)
    V = model.config.vocab_size
    d2t, t2d, _ = draft_vocab(V)
    assert model.config.final_logit_softcapping  # Gemma 2 softcaps its logits
    seq = samples(V, [30])[0]
    cap = C.Capture(model.eval(), [1, 2, 4], d2t, t2d)
    cap.self_check(seq)
    # the classic bug: "layer k" read as the output of layer k (HS[k+1])
    shifted = C.Capture(model, [1, 2, 4], d2t, t2d)
    shifted.layers = torch.nn.ModuleList(list(shifted.layers)[1:] + [shifted.layers[0]])
    with pytest.raises(C.CaptureError, match="layer 1 does not see output_hidden_states"):
        shifted.self_check(seq)
    nocap = C.Capture(model, [1, 2, 4], d2t, t2d)
    nocap.softcap = None
    nocap.scale = 3.0
    with pytest.raises(C.CaptureError, match="output transform"):
        nocap.self_check(seq)


def test_layer_ids_and_vocab_errors(tiny_models):
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    d2t, t2d, _ = draft_vocab(model.config.vocab_size)
    with pytest.raises(C.CaptureError, match=r"\[6\] out of range.*valid: 0..5"):
        C.Capture(model, [1, 3, 6], d2t, t2d)
    with pytest.raises(C.CaptureError, match="vocab step ran on another target"):
        C.Capture(model, None, d2t, t2d[:100])
    assert C.resolve_layer_ids(None, 61) == [2, 30, 58]          # Kimi-K2.5's 61 layers


def test_plan_batches_respects_the_budget():
    lengths = [50, 40, 40, 30, 10, 10, 10, 200, 5]
    order = C.length_order(lengths)
    assert order == [7, 0, 1, 2, 3, 4, 5, 6, 8]
    sorted_lens = [lengths[i] for i in order]
    padded = C.plan_batches(sorted_lens, 100)
    assert sorted(i for b in padded for i in b) == list(range(9))
    for b in padded:
        cost = len(b) * max(sorted_lens[i] for i in b)
        assert cost <= 100 or len(b) == 1                # only a lone long sample exceeds it
    assert padded[0] == [0]                              # 200 tokens: alone
    packed = C.plan_batches(sorted_lens, 100, packed=True)
    for b in packed:
        assert sum(sorted_lens[i] for i in b) <= 100 or len(b) == 1
    assert len(packed) <= len(padded)


def test_param_count_and_memory_estimate(tiny_models):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_models["deepseek_v3"])
    model = AutoModelForCausalLM.from_pretrained(tiny_models["deepseek_v3"])
    n = sum(p.numel() for p in model.parameters())
    assert C.param_count(cfg) == n
    # the routed experts: 5 MoE layers (first_k_dense_replace 1) of 4 experts, each a fused
    # gate_up [2 x 32, 64] and down [64, 32]
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert routed == 5 * 4 * (64 * 64 + 64 * 32)
    est = C.estimate_gpu_bytes(cfg, 2, 4096, tp=2)
    # transformers' tp plan shards all but the routed experts, which each rank holds whole
    assert est["weights"] == (n - routed) * 2 // 2 + routed * 2
    assert est["total"] > est["weights"] + est["activations"] + est["capture"]
    dense = AutoConfig.from_pretrained(tiny_models["llama"])
    n_dense = C.param_count(dense)
    assert C.estimate_gpu_bytes(dense, 2, 4096, tp=2)["weights"] == n_dense * 2 // 2


def test_a_remote_code_wrapper_captures_its_language_model(tmp_path):
    """Kimi-K2.5's shape (tests/remote_code.py): get_decoder() of the wrapper is its whole
    DeepSeek-V3 causal LM; the capture goes on down to that model's decoder, finds the lm_head
    with or without the wrapper's own get_output_embeddings, and equals the wrapper's plain
    forward bit for bit."""
    from drafter.core import config as cfg_mod
    from drafter.core import target
    from tests.remote_code import make_kimi_like

    folder = make_kimi_like(tmp_path, quantization=None)
    model = target.load_model(cfg_mod.TargetConfig(model=str(folder), trust_remote_code=True),
                              device="cpu")
    lm = model.language_model
    assert model.get_decoder() is lm                     # what transformers answers: a whole LM
    assert C.text_decoder(model) is lm.model and C.decoder_layers(model) is lm.model.layers
    assert C.output_head(model) is lm.lm_head
    V = lm.config.vocab_size
    d2t, t2d, draft_ids = draft_vocab(V)
    for teacher in ("hidden", "topk"):
        cap = C.Capture(model, [0, 2, 5], d2t, t2d, teacher=teacher, topk=8, out_dtype=None)
        for s in samples(V, [19, 7]):
            check_exact(model, cap, s, draft_ids)
    assert cap.self_check(samples(V, [30])[0])["tokens"] == 30
    assert cap.info()["num_layers"] == 6 and cap.info()["hidden_size"] == 64
    model.get_output_embeddings = lambda: None            # a wrapper that does not delegate
    assert C.output_head(model) is lm.lm_head
    assert torch.equal(C.Capture(model, None, d2t, t2d).head.weight, lm.lm_head.weight[draft_ids])


OTHER = {  # layouts beyond model.layers and output transforms beyond plain lm_head
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=5, n_head=4, bos_token_id=0,
                                eos_token_id=0)),                  # transformer.h: the fallback
    "opt": ("OPTConfig", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=4,
                              num_attention_heads=4, word_embed_proj_dim=64)),  # decoder.layers
    "cohere": ("CohereConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    logit_scale=0.25, eos_token_id=0)),  # logits * logit_scale
    "gemma3": ("Gemma3TextConfig", dict(hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=6, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16,
                                        final_logit_softcapping=20.0)),  # softcap, sliding window
}


@pytest.mark.parametrize("arch", list(OTHER))
def test_other_layouts_pass_the_self_check(arch):
    import transformers

    cls, kw = OTHER[arch]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(getattr(transformers, cls)(vocab_size=1000, **kw))
    d2t, t2d, draft_ids = draft_vocab(1000, 300)
    cap = C.Capture(model.eval(), [0, 1, 3], d2t, t2d, teacher="topk", topk=8, out_dtype=None)
    seqs = samples(1000, [17, 6])
    assert cap.self_check(seqs[0])["tokens"] == 17
    for s in seqs:
        check_exact(model, cap, s, draft_ids)
