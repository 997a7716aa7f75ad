"""The drafter model and its training-time test (TTT): shapes, the TTT unroll against the drafter
drafting step by step with its KV cache (what inference does), the exact SDPA path against the
fast path (FlexAttention part emulated where CPU flex has no backward, and the real CPU flex
forward), the fused loss against the plain one (dense and top-k teachers), save/load."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drafter.features import store
from drafter.train.batches import align, collate
from drafter.train.losses import DEFAULT, Objective, Term, head_loss
from drafter.train.merge import merge_diagonal
from drafter.train.model import (
    Drafter,
    DrafterConfig,
    draft_layer_for,
    load_drafter,
    save_drafter,
)
from drafter.train.ttt import TTT, dense_mask, doc_causal, flex_part0

V, VD, HT = 96, 40, 24


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(**kw) -> DrafterConfig:
    base = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=V, draft_vocab_size=VD,
                target_hidden_size=HT, aux_layer_ids=[1, 2, 3], max_position_embeddings=256)
    return DrafterConfig(**{**base, **kw})


# An MLA draft layer (drafter/train/mla.py) whose widths all differ (dqk 12, dv 6, dr 4), with
# DeepSeek's YaRN: its score scale is not dqk^-1/2, and positions pass the original context (16).
MLA = dict(draft_layer="mla", q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
           qk_rope_head_dim=4, v_head_dim=6, head_dim=12,
           rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32.0,
                         "beta_slow": 1.0})
LAYERS = {"llama": {}, "mla": MLA}


def make_drafter(seed=0, **kw) -> Drafter:
    torch.manual_seed(seed)
    d = Drafter(tiny_config(**kw))
    # non-trivial norms so that a wrong norm placement shows
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return d


def make_sample(n: int, g: torch.Generator, prompt: int = 0, teacher: str = "hidden") -> dict:
    """A per-sample dict exactly as docs/internals.md specifies (random values)."""
    s = {"input_ids": torch.randint(0, V, (n,), generator=g),
         "loss_mask": (torch.arange(n) >= prompt).long(),
         "aux": torch.randn(n, 3, HT, generator=g).to(torch.bfloat16),
         "in_vocab": torch.ones(n, dtype=torch.bool)}
    if teacher == "hidden":
        s["teacher_hidden"] = torch.randn(n, HT, generator=g).to(torch.bfloat16)
    else:
        lp = (3 * torch.randn(n, VD, generator=g)).log_softmax(-1)
        v, i = lp.topk(8, -1)
        s["teacher_topk_ids"], s["teacher_topk_logp"] = i, v.half().float()
    return s


def batch_of(rows, T, K=3, decay=0.8, teacher="hidden", head=None):
    """Packed rows -> the TTT's inputs, through train's own collate and align."""
    b = collate(rows, len(rows), T)
    b.update(align(b["seq_id"], b["loss_mask"], b["in_vocab"], K, decay))
    B = len(rows)
    if teacher == "hidden":
        b["teacher"] = {"logp": store.teacher_logprobs(
            {"teacher_hidden": b["teacher_hidden"].reshape(B * T, -1)}, head)}
    else:
        b["teacher"] = {"ids": b["teacher_topk_ids"].reshape(B * T, -1),
                        "logp": b["teacher_topk_logp"].reshape(B * T, -1)}
    return b


def run_ttt(ttt, drafter, b, part0=None):
    emb = drafter.embed_tokens(b["input_ids"])
    return ttt(b["aux"], emb, b["position_ids"], b["seq_id"], b["src"], b["rows"], b["trows"],
               b["weights"], b["teacher"], part0=part0)


def emulated_flex(seq_id):
    """What flex_part0 computes, in plain PyTorch: attention over the step-0 keys under the same
    mask_mod (doc_causal), returning the output and the log-sum-exp (CPU flex has no backward).
    The output is laid out in memory as q is, as FlexAttention's is."""
    mask = dense_mask(seq_id)                                            # [B, 1, T, T]

    def part0(q, k, v, scale=None):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = (q @ k.transpose(-1, -2)) * (scale or 1 / math.sqrt(q.shape[-1]))
        s = s.masked_fill(~mask, float("-inf"))
        return torch.empty_like(q).copy_(s.softmax(-1) @ v), s.logsumexp(-1)
    return part0


@pytest.fixture
def head():
    return torch.randn(VD, HT, generator=torch.Generator().manual_seed(5)) * 0.3


def packed_rows(teacher="hidden"):
    """Two rows of 24 tokens: row 0 packs samples of 9 and 11 tokens (4 pad), row 1 one of 24."""
    g = torch.Generator().manual_seed(1)
    return [[make_sample(9, g, 2, teacher), make_sample(11, g, 3, teacher)],
            [make_sample(24, g, 5, teacher)]]


@pytest.fixture
def packed():
    return packed_rows()


# ---------------------------------------------------------------------------------- shapes
def test_shapes_and_names():
    d = make_drafter(fc_norm=True)
    sd = d.state_dict()
    assert sd["fc.weight"].shape == (32, 3 * HT)
    assert sd["fc_norm.weight"].shape == (3, HT)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (4 * 8, 64)       # input is 2H
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (2 * 8, 64)
    assert sd["lm_head.weight"].shape == (VD, 32)
    assert sd["d2t"].dtype == torch.long and sd["d2t"].shape == (VD,)
    assert sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (V,)
    assert not d.embed_tokens.weight.requires_grad
    ttt = TTT(d)
    names = {n for n, _ in ttt.named_parameters()}
    assert "embed_tokens.weight" not in names and "lm_head.weight" in names
    aux = torch.randn(2, 7, 3, HT)
    h = d.fuse(aux)
    assert h.shape == (2, 7, 32)
    pos = torch.arange(7).expand(2, 7)
    h_out, logits, (k, v) = d(torch.randint(0, V, (2, 7)), h, pos)
    assert h_out.shape == (2, 7, 32) and logits.shape == (2, 7, VD) and k.shape == (2, 2, 7, 8)


def test_from_target_shapes_the_drafter_like_the_target():
    from transformers import LlamaConfig

    tc = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, num_hidden_layers=32,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                      "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192})
    c = DrafterConfig.from_target(tc, 32000, [2, 16, 29])
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size, c.draft_vocab_size) == (4096, 14336, 32, 8, 128, 128256,
                                                              32000)
    assert c.rope_theta == 500000.0 and c.rope_scaling["rope_type"] == "llama3"


# --------------------------------------------------------------- TTT against step-by-step drafting
@pytest.mark.parametrize("norm_output, layer", [(False, "llama"), (True, "llama"),
                                                 (False, "mla")])
def test_ttt_equals_drafting_step_by_step(packed, head, norm_output, layer):
    """Every (step i, position t) of the TTT unroll equals the drafter drafting i tokens after
    position t with its KV cache: prefill the sample up to t, then feed back its own output with
    the true next tokens, one token at a time (the naive reference; nothing shared with the
    unroll but the layer)."""
    torch.manual_seed(0)
    d = make_drafter(norm_output=norm_output, **LAYERS[layer])
    K, T = 4, 24
    b = batch_of(packed, T, K=K, head=head)
    ttt = TTT(d, attention="sdpa")
    with torch.no_grad():
        out = run_ttt(ttt, d, b)
    # the reference: for each sample and position u, prefill up to u, then draft K-1 more
    ref = {}
    B = len(packed)
    for bb, row in enumerate(packed):
        o = 0
        for sample in row:
            ids, aux, n = sample["input_ids"], sample["aux"].float(), len(sample["input_ids"])
            for u in range(n - 2):
                with torch.no_grad():
                    h_out, logits, kv = d(ids[None, 1:u + 2], d.fuse(aux[None, :u + 1]),
                                          torch.arange(u + 1)[None])
                    last, z = h_out[:, -1:], logits[0, -1]
                    for i in range(K):
                        if u + 2 + i >= n:
                            break
                        if i:
                            last, lg, kv = d(ids[None, u + 1 + i:u + 2 + i], d.feedback(last),
                                             torch.tensor([[u + i]]), past_kv=kv)
                            z = lg[0, -1]
                        p = store.teacher_logprobs(
                            {"teacher_hidden": sample["teacher_hidden"][u + 1 + i]}, head).exp()
                        ref[i * B * T + bb * T + o + u] = -(p * z.log_softmax(-1)).sum().item()
            o += n
    checked = 0
    for r, got in zip(b["rows"].tolist(), out["ce"].tolist()):
        assert abs(ref[r] - got) < 1e-4 * max(1.0, abs(got)), divmod(r, T)
        checked += 1
    # every position whose predicted token is a loss token inside its sample, at every step
    lm = sum(int(s["loss_mask"][2 + i:].sum()) for row in packed for s in row for i in range(K))
    assert checked == lm > 50


# ---------------------------------------------------------------- exact path == fast path
# a loss of every kind at several temperatures, D-PACE weighted (drafter/train/losses.py)
MIXED = Objective((Term("ce", 0.1, 0.0), Term("tv", 0.9, 0.7), Term("lk", 0.5, 1.0),
                   Term("nla", 0.3, 1.5)), position="dpace", temperatures=(0.7,))


@pytest.mark.parametrize("teacher, layer, obj", [("hidden", "llama", DEFAULT),
                                                 ("topk", "llama", DEFAULT),
                                                 ("hidden", "mla", DEFAULT),
                                                 ("hidden", "llama", MIXED),
                                                 ("topk", "llama", MIXED)],
                         ids=["hidden-llama", "topk-llama", "hidden-mla", "hidden-mixed",
                              "topk-mixed"])
def test_sdpa_and_fast_path_same_loss_and_grads(head, teacher, layer, obj):
    """The exact path (all keys, dense mask, materialised logits) and the fast path (step-0
    attention by the flex part + diagonal merged by log-sum-exp, fused chunked loss, top-k teacher
    never densified) give the same loss, per-row metrics and gradients; for today's loss and
    for a sum of every kind under D-PACE's weights."""
    K, T = 4, 24
    packed = packed_rows(teacher)
    b = batch_of(packed, T, K=K, teacher=teacher, head=head)
    dense = b["teacher"] if teacher == "hidden" else {"logp": store.teacher_logprobs(
        {"teacher_topk_ids": b["teacher"]["ids"], "teacher_topk_logp": b["teacher"]["logp"]},
        VD)}
    res = {}
    for path in ("sdpa", "flex"):
        d = make_drafter(fc_norm=True, **LAYERS[layer])
        ttt = TTT(d, attention=path, loss_chunk=7, obj=obj)  # chunks, a ragged last one
        bt = dict(b, teacher=dense if path == "sdpa" else b["teacher"])
        out = run_ttt(ttt, d, bt, part0=emulated_flex(b["seq_id"]) if path == "flex" else None)
        out["loss"].backward()
        res[path] = out, {n: p.grad for n, p in ttt.named_parameters()}
    (a, ga), (f, gf) = res["sdpa"], res["flex"]
    assert torch.allclose(a["loss"], f["loss"], rtol=1e-5)
    for key in ("value", "ce", "accept", "accept_t"):
        assert torch.allclose(a[key], f[key], atol=1e-4), key
    assert torch.equal(a["correct"], f["correct"])
    assert ga.keys() == gf.keys() and len(ga) == (14 if layer == "llama" else 17)
    for n in ga:
        assert torch.allclose(ga[n], gf[n], rtol=1e-4, atol=1e-6 * ga[n].abs().max()), n


@pytest.mark.parametrize("layer", ["llama", "mla"])
def test_flex_forward_on_cpu_matches_emulation(packed, head, layer):
    """The real FlexAttention forward (uncompiled, CPU: forward only) with the block mask built
    from doc_causal gives what the emulation used for gradients gives."""
    T = 24
    b = batch_of(packed, T, K=3, head=head)
    d = make_drafter(**LAYERS[layer])
    ttt = TTT(d, attention="flex")
    with torch.no_grad():
        real = run_ttt(ttt, d, b, part0=flex_part0(b["seq_id"], compiled=False))
        emu = run_ttt(ttt, d, b, part0=emulated_flex(b["seq_id"]))
    assert torch.allclose(real["ce"], emu["ce"], atol=1e-5)
    assert torch.allclose(real["loss"], emu["loss"], rtol=1e-6)


def test_merge_diagonal_is_attention_over_all_keys():
    torch.manual_seed(0)
    B, nh, nkv, T, hd = 2, 4, 2, 5, 8
    q = torch.randn(B, nh, T, hd)
    ks = [torch.randn(B, nkv, T, hd) for _ in range(3)]
    vs = [torch.randn(B, nkv, T, hd) for _ in range(3)]
    seq = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]])
    o0, lse0 = emulated_flex(seq)(q, ks[0], vs[0])
    got = merge_diagonal(q, o0, lse0, ks[1:], vs[1:], 1 / math.sqrt(hd))
    # reference: for every query, softmax over [its sample's earlier step-0 keys, k1[t], k2[t]]
    g = nh // nkv
    for bb in range(B):
        for h in range(nh):
            for t in range(T):
                keys = [ks[0][bb, h // g, s] for s in range(t + 1) if seq[bb, s] == seq[bb, t]]
                vals = [vs[0][bb, h // g, s] for s in range(t + 1) if seq[bb, s] == seq[bb, t]]
                keys += [ks[1][bb, h // g, t], ks[2][bb, h // g, t]]
                vals += [vs[1][bb, h // g, t], vs[2][bb, h // g, t]]
                w = (torch.stack(keys) @ q[bb, h, t] / math.sqrt(hd)).softmax(0)
                assert torch.allclose(got[bb, h, t], w @ torch.stack(vals), atol=1e-5)



def _merge_cases(device: str):
    """(q, o0, lse0, ks, vs) for merge_diagonal: q laid out [B, T, nh, hd] in memory as pre
    makes it (or contiguous), o0 as flex makes it; g = nh / nkv of 1, 2, 3 (not a power of 2)
    and 4, head dims of 8 to 128 (48: padded), 1 to 6 diagonal keys, float32 and bf16."""
    g = torch.Generator().manual_seed(0)
    for B, nh, nkv, T, hd, n, dt, blhd in [
            (2, 4, 2, 5, 8, 2, torch.float32, False), (2, 9, 3, 37, 64, 6, torch.float32, True),
            (1, 8, 2, 20, 48, 3, torch.bfloat16, True), (2, 6, 6, 9, 16, 1, torch.float32, True),
            (1, 32, 8, 70, 128, 4, torch.bfloat16, True)]:
        def r(*shape, scale=1.0, dtype=dt):
            return (torch.randn(*shape, generator=g) * scale).to(device, dtype)
        q = r(B, T, nh, hd).transpose(1, 2) if blhd else r(B, nh, T, hd)
        o0 = r(B, T, nh, hd).transpose(1, 2)
        lse0 = r(B, nh, T, scale=2.0, dtype=torch.float32) + 3
        yield (q, o0, lse0, [r(B, nkv, T, hd) for _ in range(n)],
               [r(B, nkv, T, hd) for _ in range(n)])


def _check_fused_merge(device: str) -> None:
    """merge._FusedMerge (its two Triton kernels) against _MergeDiagonal's eager ops, forward
    and backward: the output in o0's layout, values and every input's gradient within float32
    rounding (bf16 inputs: bf16 rounding)."""
    from drafter.train import merge as merge_mod
    for q, o0, lse0, ks, vs in _merge_cases(device):
        ins = [t.requires_grad_() for t in (q, o0, lse0, *ks, *vs)]
        res = {}
        for fused in (True, False):
            merge_mod.FUSED_MERGE = fused
            out = merge_diagonal(q, o0, lse0, ks, vs, 1 / math.sqrt(q.shape[-1]))
            assert ("Fused" in type(out.grad_fn).__name__) == fused
            assert out.stride() == o0.stride() and out.dtype == o0.dtype
            go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
            res[fused] = [out.detach()] + list(torch.autograd.grad(out, ins, go))
        merge_mod.FUSED_MERGE = True
        tol = 1e-5 if q.dtype == torch.float32 else 1e-2
        for name, a, b in zip(["out", "q", "o0", "lse0"] + ["k"] * len(ks) + ["v"] * len(vs),
                              res[True], res[False]):
            err = (a.float() - b.float()).abs().max() / b.float().abs().max()
            assert err < tol, (name, q.shape, len(ks), q.dtype, float(err))


def test_fused_merge_in_the_interpreter():
    """merge_diagonal's Triton kernels (merge._FusedMerge), run by Triton's interpreter on the
    CPU (skipped without Triton; the GPU test runs them compiled), equal the eager merge."""
    pytest.importorskip("triton")
    code = "from tests.test_model import _check_fused_merge; _check_fused_merge('cpu'); print('ok')"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


@pytest.mark.gpu
def test_fused_merge_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _check_fused_merge("cuda")

def test_memory_lean_functions_have_exact_gradients():
    """The hand-written backwards (RMSNorm, SwiGLU + down_proj, the diagonal merge) that keep
    fewer tensors than autograd would: gradcheck in float64."""
    from drafter.train.model import _RMSNormFn, _SwiGLUDown
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.double).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: _RMSNormFn.apply(x, w, 1e-6), (r(3, 5, 8), r(8)))
    assert torch.autograd.gradcheck(_SwiGLUDown.apply, (r(2, 4, 6), r(2, 4, 6), r(5, 6)))
    B, nh, nkv, T, hd = 2, 4, 2, 3, 5
    assert torch.autograd.gradcheck(
        lambda q, o0, lse, k1, k2, v1, v2: merge_diagonal(q, o0, lse, [k1, k2], [v1, v2], 0.4),
        (r(B, nh, T, hd), r(B, nh, T, hd), r(B, nh, T), *[r(B, nkv, T, hd) for _ in range(4)]))


def test_mask_mod_is_causal_within_samples():
    seq = torch.tensor([[0, 0, 1, 1, 1, -1]])
    m = dense_mask(seq)[0, 0]
    assert m[1, 0] and not m[0, 1]                # causal
    assert not m[2, 1] and m[4, 2]                # not across samples
    assert m[5, 5] and not m[5, 4]                # padding attends to itself only here
    assert doc_causal(seq)(0, 0, torch.tensor(3), torch.tensor(2))


# ------------------------------------------------------------------------------ the loss
@pytest.mark.parametrize("teacher", ["dense", "topk"])
def test_fused_loss_equals_plain_loss(teacher):
    """The fused chunked loss (gradients formed in the forward) equals autograd through
    materialised logits, with the teacher exactly as store.teacher_logprobs densifies it."""
    g = torch.Generator().manual_seed(0)
    N, H, M = 37, 16, 20
    hn = torch.randn(N, H, generator=g, requires_grad=True)
    w_head = torch.randn(VD, H, generator=g, requires_grad=True)
    full = (3 * torch.randn(M, VD, generator=g)).log_softmax(-1)
    v, i = full.topk(8, -1)
    topk = {"teacher_topk_ids": i, "teacher_topk_logp": v.half().float()}
    dense = {"logp": full if teacher == "dense" else store.teacher_logprobs(topk, VD)}
    t = dense if teacher == "dense" else {"ids": i, "logp": topk["teacher_topk_logp"]}
    trows, w = torch.randint(0, M, (N,), generator=g), torch.rand(N, generator=g)
    ref = head_loss(hn, w_head, dense, trows, w, fused=False)
    gref = torch.autograd.grad(ref["loss"] * 2.5, [hn, w_head])
    got = head_loss(hn, w_head, t, trows, w, fused=True, chunk=8)
    ggot = torch.autograd.grad(got["loss"] * 2.5, [hn, w_head])
    assert torch.allclose(ref["loss"], got["loss"], rtol=1e-6)
    for key in ("value", "ce", "correct", "accept"):
        assert torch.allclose(ref[key], got[key], atol=1e-5), key
    for a, b in zip(gref, ggot):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # the no-grad (validation) branch gives the same numbers
        nog = head_loss(hn, w_head, t, trows, w, fused=True, chunk=8)
    assert torch.allclose(nog["loss"], got["loss"]) and torch.equal(nog["correct"],
                                                                    got["correct"])


def test_loss_is_zero_gradient_at_the_teacher():
    """A drafter whose logits equal the teacher's log-probs sits at the minimum (grad 0), and
    its accept = 1 and acc = 1: the loss and the metrics mean what they say."""
    g = torch.Generator().manual_seed(0)
    H = VD  # identity head: logits = hn
    tl = (2 * torch.randn(6, VD, generator=g)).log_softmax(-1)
    hn = tl.clone().requires_grad_(True)
    out = head_loss(hn, torch.eye(H), {"logp": tl}, torch.arange(6), torch.ones(6), fused=True)
    ce, correct, accept = out["ce"], out["correct"], out["accept"]
    (gr,) = torch.autograd.grad(out["loss"], [hn])
    assert gr.abs().max() < 1e-6
    assert torch.allclose(ce, -(tl.exp() * tl).sum(-1), atol=1e-5)   # = teacher entropy
    assert correct.all() and torch.allclose(accept, torch.ones(6), atol=1e-5)


# ---------------------------------------------------------------------------- compiled path
@pytest.mark.slow  # inductor compiles for about a minute on a small CPU
@pytest.mark.parametrize("obj", [DEFAULT, MIXED], ids=["kl", "mixed-dpace"])
def test_compiled_pieces_match_eager(head, obj):
    """torch.compile of the layer pieces, the LSE merge and the loss chunk (the GPU fast path)
    gives the eager numbers and gradients (inductor on CPU; flex itself stays eager here)."""
    T = 24
    b = batch_of(packed_rows("topk"), T, K=3, teacher="topk", head=head)
    outs = {}
    for comp in (False, True):
        d = make_drafter()
        ttt = TTT(d, attention="flex", compile=comp, obj=obj)
        out = run_ttt(ttt, d, b, part0=emulated_flex(b["seq_id"]))
        out["loss"].backward()
        outs[comp] = out["loss"].detach(), [p.grad for p in ttt.parameters()]
    assert torch.allclose(outs[False][0], outs[True][0], rtol=1e-5)
    for a, c in zip(outs[False][1], outs[True][1]):
        assert torch.allclose(a, c, rtol=1e-4, atol=1e-6 * a.abs().max())


def test_compiled_pieces_under_autocast_sum_gradients_as_eager(head):
    """Under autocast the layer's float32 matrices are cast once per forward and every TTT step
    uses the casts (TTT.cast_layer), as eager autocast's cast cache does: the compiled pieces
    (dynamo, aot_eager) then give eager's loss and gradients exactly. Casting inside each graph
    summed K float32 gradients instead (about 3e-3 apart here, and slower on the GPU)."""
    import torch._dynamo
    torch._dynamo.reset()
    b = batch_of(packed_rows("topk"), 24, K=3, teacher="topk", head=head)
    outs = {}
    for comp in (False, True):
        d = make_drafter()
        ttt = TTT(d, attention="flex", compile=comp, backend="aot_eager")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert set(ttt.cast_layer("cpu")) == {
                f"layer.{n}" for n, p in d.midlayer.named_parameters() if p.ndim == 2}
            out = run_ttt(ttt, d, b, part0=emulated_flex(b["seq_id"]))
        out["loss"].backward()
        outs[comp] = out["loss"].detach(), [(n, p.grad) for n, p in ttt.named_parameters()]
    assert ttt.cast_layer("cpu") == {}                                   # autocast off
    assert torch.equal(outs[False][0], outs[True][0])
    for (n, a), (_, c) in zip(outs[False][1], outs[True][1]):
        assert a.dtype == torch.float32 and torch.equal(a, c), n


# ------------------------------------------------------------ no recompilation
def _graphs() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def varied_batches(n: int, T: int, K: int, head, chunk: int) -> list[dict]:
    """n batches of 2 rows × T packed from samples of random lengths and prompt lengths, so
    each has its own number of loss rows N and its own last-chunk size; the third's N leaves
    1 row after its last whole chunk (dynamo specialises a size of 1: loss_chunks must join it
    to the chunk before, or that batch compiles one graph more)."""
    g = torch.Generator().manual_seed(3)
    out = []
    while len(out) < n:
        rows = []
        for _ in range(2):
            row, free = [], T
            while free >= 6:
                m = int(torch.randint(6, T + 1, (1,), generator=g).clamp(max=free))
                row.append(make_sample(m, g, int(torch.randint(0, m // 2, (1,), generator=g)),
                                       "topk"))
                free -= m
            rows.append(row)
        b = batch_of(rows, T, K=K, teacher="topk", head=head)
        one_left = len(b["rows"]) % chunk == 1 and len(b["rows"]) > chunk
        if one_left == (len(out) == 2) and len(b["rows"]) not in (len(x["rows"]) for x in out):
            out.append(b)
    return out


@pytest.mark.parametrize("obj", [DEFAULT, Objective(MIXED.terms, temperatures=(0.7,))],
                         ids=["kl", "mixed"])
def test_compiled_path_compiles_once_for_any_loss_rows(head, obj):
    """Real batches differ in their loss rows N, so the loss's last chunk has any size. Through
    AdamW steps on batches of different N and packings, the compiled path (dynamo with
    aot_eager: the guards and graphs inductor gets, no kernels to build on a CPU) compiles
    during the first batch and never again, one graph a piece, and trains as the eager path
    does; for today's loss and for a sum of every kind at several temperatures."""
    import torch._dynamo
    torch._dynamo.reset()
    T, K, chunk = 24, 3, 16
    data = varied_batches(6, T, K, head, chunk)
    assert len({len(b["rows"]) % chunk for b in data}) >= 4          # tails of several sizes
    assert len(data[2]["rows"]) % chunk == 1                           # one of 1 row
    models = {}
    for comp in (False, True):
        d = make_drafter()
        ttt = TTT(d, attention="flex", compile=comp, backend="aot_eager", loss_chunk=chunk,
                  obj=obj)
        opt = torch.optim.AdamW([p for p in ttt.parameters() if p.requires_grad], lr=1e-2)
        models[comp] = d, ttt, opt
    graphs, losses, g0 = [], {False: [], True: []}, _graphs()
    for b in data:
        for comp, (d, ttt, opt) in models.items():
            out = run_ttt(ttt, d, b, part0=emulated_flex(b["seq_id"]))
            out["loss"].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[comp].append(float(out["loss"].detach()))
        graphs.append(_graphs())
    # pre, post and the loss chunk: post once, though steps >= 1 take the merge's output and
    # step 0 part0's (laid out as q, as FlexAttention's is): the merge keeps part0's layout
    assert graphs[0] - g0 == 3 and graphs[-1] == graphs[0], (g0, graphs)
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)



def test_compile_cache_keys_do_not_depend_on_the_import_order():
    """Inductor's FX-graph cache key pickles every graph input's metadata, its memory format
    included. torch pickles a memory format as a global found by searching sys.modules in
    order, so a process that imported other modules first made other keys: on the H200 a
    `drafter train` after a cold `drafter run` missed 7 of its 9 graphs. A compiling TTT
    registers a reducer by name (ttt.stable_memory_format_pickles): the key of a contiguous
    input is the same after a module that holds `torch` is put first in sys.modules."""
    import types

    from torch._inductor.codecache import FxGraphCachePickler, extract_tensor_metadata_for_cache_key
    TTT(make_drafter(), attention="flex", compile=True, backend="aot_eager")
    meta = extract_tensor_metadata_for_cache_key(torch.zeros(2, 3))
    assert meta.memory_format is torch.contiguous_format
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    before = FxGraphCachePickler(gm).get_hash(meta)
    first = types.ModuleType("a_module_imported_first")
    first.torch = torch
    saved = dict(sys.modules)
    try:
        sys.modules.clear()
        sys.modules[first.__name__] = first
        sys.modules.update(saved)
        after = FxGraphCachePickler(gm).get_hash(meta)
    finally:
        sys.modules.clear()
        sys.modules.update(saved)
    assert after == before


def test_compiled_flex_keeps_one_graph_across_packings(monkeypatch):
    """flex_part0 builds a new block mask (a new mask_mod closure over seq_id) for each batch:
    dynamo guards on their shapes, not on the packing, so one graph serves every layout
    (forward only: CPU flex has no backward; the eager backend, same guards)."""
    import torch._dynamo
    from torch.nn.attention import flex_attention as fa

    from drafter.train import ttt as ttt_mod
    torch._dynamo.reset()
    monkeypatch.setitem(ttt_mod._FLEX, "fn", torch.compile(fa.flex_attention, dynamic=False,
                                                            backend="eager"))
    g = torch.Generator().manual_seed(0)
    B, T = 2, 256
    q = torch.randn(B, 4, T, 16, generator=g)
    k, v = torch.randn(B, 2, T, 16, generator=g), torch.randn(B, 2, T, 16, generator=g)
    graphs = []
    for cut in (T, 100, 37, 200):
        seq = (torch.arange(T) >= cut).long().expand(B, T).clone()
        seq[1, T - cut // 3:] = -1                                       # a padded tail
        o, lse = flex_part0(seq, compiled=True)(q, k, v)
        ref_o, ref_lse = emulated_flex(seq)(q, k, v)
        real = seq >= 0                                                  # pad rows: undefined
        assert torch.allclose(o.transpose(1, 2)[real], ref_o.transpose(1, 2)[real], atol=1e-5)
        assert torch.allclose(lse.transpose(1, 2)[real], ref_lse.transpose(1, 2)[real],
                              atol=1e-5)
        graphs.append(_graphs())
    assert graphs == [graphs[0]] * 4 and graphs[0] > 0


# -------------------------------------------------------------------------------- save/load
@pytest.mark.parametrize("layer", ["llama", "mla"])
def test_save_load_round_trip(tmp_path, layer):
    d = make_drafter(fc_norm=True, norm_output=True, **LAYERS[layer])
    d.set_vocab(torch.arange(VD) * 0 + 3, torch.zeros(V, dtype=torch.bool))
    save_drafter(d, tmp_path)
    e = load_drafter(tmp_path)
    assert e.cfg == d.cfg
    for (n, a), (m, b) in zip(d.state_dict().items(), e.state_dict().items()):
        assert n == m and torch.equal(a.to(b.dtype), b), n
    assert e.to_target_ids(torch.tensor([0, 5])).tolist() == [3, 8]


@pytest.mark.gpu
def test_gpu_flex_compiled_equals_sdpa(packed, head):
    """On a GPU: the real compiled FlexAttention path (with its log-sum-exp backward) against
    the exact path, in float32."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    T = 128  # one flex block; head_dim 16: the smallest the Triton kernels take
    b = batch_of(packed, T, K=4, head=head)
    b = {k: (v.cuda() if torch.is_tensor(v) else {kk: vv.cuda() for kk, vv in v.items()})
         for k, v in b.items()}
    res = {}
    for path in ("sdpa", "flex"):
        d = make_drafter(head_dim=16).cuda()
        ttt = TTT(d, attention=path, compile=path == "flex")
        out = run_ttt(ttt, d, b)
        out["loss"].backward()
        res[path] = out["loss"].detach(), [p.grad for p in ttt.parameters()]
    assert torch.allclose(res["sdpa"][0], res["flex"][0], rtol=1e-4)
    for a, c in zip(res["sdpa"][1], res["flex"][1]):
        assert torch.allclose(a, c, rtol=1e-3, atol=1e-5 * a.abs().max())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_half_precision_products_accumulate_in_float32(device):
    """The lm_head gradient's sum over loss chunks (FusedHeadLoss): float32 += bf16 @ bf16, one
    GEMM into the sum on a GPU whose torch has addmm's float32 output, the product and an add
    otherwise; either way the float64 sum of the same products, to bf16 rounding."""
    from drafter.train import losses

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    acc = torch.zeros(96, 80, device=device)
    ref = torch.zeros(96, 80, dtype=torch.float64)
    for _ in range(3):
        a = torch.randn(64, 96).bfloat16().to(device).T      # a transposed view, as g.T is
        b = torch.randn(64, 80).bfloat16().to(device)
        losses._accumulate(acc, a, b)
        ref += a.cpu().double() @ b.cpu().double()
    assert acc.dtype == torch.float32
    err = (acc.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err < 2e-2
    if device == "cuda":   # which way it went on this torch, for the record
        print("float32-output addmm:", losses._ADDMM_F32[acc.device])


def test_auto_draft_layer_is_mla_only_where_an_engine_serves_it():
    """auto: mla for an MLA target whose latent width vLLM's MLA backends take (Kimi-K2.5's
    512 + 64), llama for a small MLA target (12 + 4) and for a target without MLA; a choice
    made by hand stands."""
    from transformers import DeepseekV3Config, LlamaConfig

    kimi = DeepseekV3Config(kv_lora_rank=512, qk_rope_head_dim=64)
    small = DeepseekV3Config(kv_lora_rank=12, qk_rope_head_dim=4)
    assert draft_layer_for("auto", kimi) == "mla"
    assert draft_layer_for("auto", small) == "llama"
    assert draft_layer_for("auto", LlamaConfig()) == "llama"
    assert draft_layer_for("mla", small) == "mla" and draft_layer_for("llama", kimi) == "llama"
