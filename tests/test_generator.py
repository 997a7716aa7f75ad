"""drafter.generation.generator and drafter.generation.paged: the paged, continuously batched
generation of the generate step equals plain decoding token for token (float32) on every
architecture it runs, refills and compacts rows, refuses what cannot fit per request, samples
reproducibly; the Triton decode kernel equals the gather reference. CPU; GPU tests skip
themselves."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from drafter.decoding.decode import Decoder
from drafter.generation.generator import Generator, GeneratorUnsupported
from drafter.generation.local import LocalGenerator
from drafter.generation.paged import paged_attention_reference
from tests.tiny import make_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(arch, tmp_path, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(make_tiny(arch, tmp_path, **kw),
                                                dtype=torch.float32).eval()


def _one_by_one(model, prompts, max_new, stop):
    """Plain greedy decoding, one prompt at a time, on the static decoder (the reference)."""
    dec = Decoder(model, max_batch=1)
    return [dec.generate([p], m, stop_ids=stop)[0] for p, m in zip(prompts, max_new)]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_generator_equals_plain_decoding(arch, tmp_path):
    """7 prompts through 3 rows: refills (rows free at different steps), per-prompt max_new,
    stop ids, pages of 16 tokens, a check every 2 steps, and the tail compacted into a smaller
    bucket; MLA (DeepSeek-V3 caches latents) runs the gathered path."""
    model = _model(arch, tmp_path)
    torch.manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,)).tolist() for n in (30, 17, 5, 64, 9, 40, 3)]
    max_new = [16, 7, 20, 3, 12, 1, 30]
    stop = [5, 77]
    want = _one_by_one(model, prompts, max_new, stop)
    eng = Generator(model, max_batch=3, page_size=16, sync_every=2, refill_fraction=0.3,
                 prefill_tokens=40)     # packed chunks of at most 40 tokens; 64 on its own
    got = eng.generate(prompts, max_new, stop_ids=stop)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert [g.finish for g in got] == [w.finish for w in want]
    assert eng.last["requests"] == 7 and eng.last["tokens"] == sum(len(w.tokens) for w in want)
    assert (arch == "deepseek_v3") == bool(eng.cache.gather)    # MLA: the gathered path
    assert eng.last["prefill_groups"] >= 4 and eng.last["prefill_padded_tokens"] == sum(
        map(len, prompts))                         # packed: every token a prompt's own
    # the same generator again, more rows than prompts: one prefill, one bucket of 8 rows
    eng2 = Generator(model, max_batch=16, page_size=16)
    assert [g.tokens for g in eng2.generate(prompts, max_new, stop_ids=stop)] == \
        [w.tokens for w in want]
    assert eng2.last["prefill_groups"] == 1       # all 7 prompts in one packed forward


def test_generator_compacts_the_tail_and_refuses_what_cannot_fit(tmp_path):
    """max_position_embeddings 96: a prompt of 90 tokens with 16 new does not fit and comes back
    'too_long' (nothing decoded) while the others are decoded; rows finishing early leave the
    long answers alone in high rows, which move down (results unchanged)."""
    model = _model("llama", tmp_path, max_position_embeddings=96)
    torch.manual_seed(1)
    prompts = [torch.randint(3, 1000, (n,)).tolist() for n in (12, 90, 8, 20, 6, 15, 11, 9)]
    max_new = [40, 16, 2, 3, 40, 2, 3, 2]
    eng = Generator(model, max_batch=16, page_size=16, sync_every=1)
    got = eng.generate(prompts, max_new)
    assert got[1].finish == "too_long" and got[1].tokens == []
    assert eng.last["too_long"] == 1
    keep = [i for i in range(len(prompts)) if i != 1]
    want = _one_by_one(model, [prompts[i] for i in keep], [max_new[i] for i in keep], [])
    assert [got[i].tokens for i in keep] == [w.tokens for w in want]
    assert all(got[i].finish == "length" for i in keep)
    moved = []  # the compaction itself: the highest live rows move into the lowest free ones
    eng.rows.active.zero_()
    live = {0: "a", 3: "b", 9: "c", 12: "d"}
    for row, v in live.items():
        eng.rows.active[row] = True
        eng.rows.ctx[row] = 100 + row
        moved.append(v)
    free = sorted(set(range(16)) - set(live), reverse=True)
    eng._compact(live, free)
    assert sorted(live) == [0, 1, 2, 3] and [live[i] for i in range(4)] == ["a", "d", "c", "b"]
    assert eng.rows.ctx[:4].tolist() == [100, 112, 109, 103]
    assert eng.rows.active.nonzero().flatten().tolist() == [0, 1, 2, 3]


def test_generator_sampling_is_seeded_and_greedy_rows_stay_greedy(tmp_path):
    model = _model("llama", tmp_path)
    torch.manual_seed(2)
    prompts = [torch.randint(3, 1000, (n,)).tolist() for n in (10, 14, 7, 20)]
    eng = Generator(model, max_batch=4, page_size=16)
    temps = [0.0, 1.0, 0.0, 0.8]
    torch.manual_seed(5)
    a = eng.generate(prompts, 12, temperature=temps, top_p=0.9)
    torch.manual_seed(5)
    b = eng.generate(prompts, 12, temperature=temps, top_p=0.9)
    assert [x.tokens for x in a] == [x.tokens for x in b]
    greedy = _one_by_one(model, [prompts[0], prompts[2]], [12, 12], [])
    assert [a[0].tokens, a[2].tokens] == [w.tokens for w in greedy]
    assert a[1].tokens != _one_by_one(model, [prompts[1]], [12], [])[0].tokens
    # without a nucleus the generator samples through drafter.generation.sampling: seeded,
    # greedy rows greedy, and the sampled rows differ from greedy decoding
    torch.manual_seed(6)
    c = eng.generate(prompts, 12, temperature=temps)
    torch.manual_seed(6)
    assert [x.tokens for x in eng.generate(prompts, 12, temperature=temps)] == \
        [x.tokens for x in c]
    assert [c[0].tokens, c[2].tokens] == [w.tokens for w in greedy]
    assert c[3].tokens != _one_by_one(model, [prompts[3]], [12], [])[0].tokens


def test_generator_refuses_unsupported_models_and_local_generator_falls_back(tmp_path,
                                                                          smollm2_dir):
    """Gemma 2 (sliding windows, softcapping) is refused by the paged generator; LocalGenerator then
    decodes it in static batches. SmolLM2: stop token stripped, finish reasons, seeded."""
    from drafter.core.config import TargetConfig

    with pytest.raises(GeneratorUnsupported, match="sliding"):
        Generator(_model("gemma2", tmp_path))
    gem = LocalGenerator(TargetConfig(model=str(make_tiny("gemma2", tmp_path / "g",
                                                          tokenizer_dir=smollm2_dir)),
                                      dtype="float32"), batch_size=2)
    assert not isinstance(gem.workers[0], Generator)
    gp = [[5, 6, 7], [8, 9, 10, 11]]
    want = _one_by_one(gem.model, gp, [4, 3], gem.stop_ids)
    assert gem.generate(gp, [4, 3]) == [(w.tokens[:-1] if w.finish == "stop" else w.tokens,
                                         w.finish) for w in want]

    gen = LocalGenerator(TargetConfig(model=str(smollm2_dir), dtype="float32"), batch_size=2)
    assert isinstance(gen.workers[0], Generator)
    tok = gen.tokenizer
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": m}],
                                           add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"]
               for m in ("What is 2+3?", "Write a python function that adds two numbers.",
                         "Say hi.")]
    want = _one_by_one(gen.model, prompts, [9, 9, 9], gen.stop_ids)
    res = gen.generate(prompts, 9)
    for (toks, finish), w in zip(res, want):
        assert finish == w.finish
        assert toks == (w.tokens[:-1] if w.finish == "stop" else w.tokens)
    assert {f for _, f in res} == {"stop", "length"}
    a = gen.generate(prompts, 5, temperature=0.9, top_p=0.9, seed=3)
    assert a == gen.generate(prompts, 5, temperature=0.9, top_p=0.9, seed=3)


def test_streaming_generator_equals_the_closed_call(tmp_path, smollm2_dir):
    """An open stream (LocalGenerator.start): requests put before and while the generator decodes
    (one put only after the first results came back) give exactly the greedy tokens of one
    closed call over the same prompts; a request over the bound is "too_long"; the generator
    thread ends when the stream is closed, and `last` splits its seconds."""
    import threading

    from drafter.core.config import TargetConfig
    from drafter.generation.generator import Stream

    gen = LocalGenerator(TargetConfig(model=str(smollm2_dir), dtype="float32"), batch_size=3,
                         page_size=16, sync_every=2, refill_fraction=0.3)
    torch.manual_seed(3)
    prompts = [torch.randint(3, 40000, (n,)).tolist() for n in (30, 17, 5, 64, 9, 40, 3, 22)]
    max_new = [9, 4, 12, 3, 7, 1, 10, 6]
    want = gen.generate(prompts, max_new)
    got: dict = {}
    first = threading.Event()

    def on_result(tag, toks, finish):
        got[tag] = (toks, finish)
        first.set()

    feed = gen.start(on_result, max_len=120, max_new=12)
    assert feed.alive()
    feed.put(prompts[:3], max_new[:3], 0.0, [0, 1, 2])
    assert first.wait(300)                                  # decoding has begun
    feed.put(prompts[3:], max_new[3:], 0.0, list(range(3, 8)))
    feed.put([prompts[0] * 4], 12, 0.0, ["long"])          # 120 + 12 > max_len
    feed.join()
    assert not feed.alive()
    assert [got[i] for i in range(8)] == want
    assert got["long"] == ([], "too_long")
    last = gen.workers[0].last
    assert last["requests"] == 9 and last["too_long"] == 1
    parts = last["prefill_seconds"] + last["decode_seconds"] + last["wait_seconds"]
    assert parts <= last["seconds"] + 1e-6
    # a stream nobody closes keeps the generator waiting; close() alone ends it
    s = Stream(bound=(64, 4))
    t = threading.Thread(target=gen.workers[0].run, args=(s, lambda q, r: None, [], 1.0))
    t.start()
    t.join(0.3)
    assert t.is_alive()
    s.close()
    t.join(60)
    assert not t.is_alive()


def test_stream_puts_first_requests_ahead_in_their_order():
    """put(..., first=True) goes ahead of every request put without it, first-put first (each
    put longest prompt first); taking one from the head keeps the rest in place; abort drops
    them all."""
    from drafter.generation.generator import Stream, requests

    s = Stream(bound=(64, 4))
    s.put(requests([[1] * 3, [1] * 9], 4, 0.0, ["a3", "a9"]))
    s.put(requests([[2] * 2, [2] * 5], 4, 1.0, ["u2", "u5"], 2), first=True)
    q = s.peek()
    assert q.tag == "u5" and s.take_if(q) and not s.take_if(q)
    s.put(requests([[3] * 7], 4, 1.0, ["v7"], 4), first=True)       # after u2, before a9
    s.put(requests([[4] * 1], 4, 0.0, ["b1"], 5))
    order = []
    while (q := s.peek()) is not None:
        assert s.take_if(q)
        order.append(q.tag)
    assert order == ["u2", "v7", "a9", "a3", "b1"] and s.n_first == 0
    s.put(requests([[5] * 2], 4, 1.0, ["w"], 6), first=True)
    s.abort()
    assert s.peek() is None and len(s) == 0 and s.n_first == 0


def test_paged_reference_equals_dense_attention():
    """The gather reference (the CPU path and the kernel's oracle) against attention over each
    row's own keys, written out densely."""
    torch.manual_seed(0)
    B, nh, nkv, hd, P, W, pages = 4, 6, 2, 8, 4, 3, 20
    kp, vp = torch.randn(pages * P, nkv, hd), torch.randn(pages * P, nkv, hd)
    table = torch.stack([torch.randperm(pages - 1)[:W] + 1 for _ in range(B)]).int()
    lens = torch.tensor([5, 12, 1, 0], dtype=torch.int32)
    q = torch.randn(B, nh, hd)
    out = paged_attention_reference(q, kp, vp, table, lens, 0.5, P)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            assert out[b].abs().max() == 0
            continue
        slots = torch.tensor([int(table[b, t // P]) * P + t % P for t in range(n)])
        k, v = kp[slots], vp[slots]                                   # [n, nkv, hd]
        for h in range(nh):
            kv = h // (nh // nkv)
            w = torch.softmax(0.5 * k[:, kv] @ q[b, h], 0)
            torch.testing.assert_close(out[b, h], w @ v[:, kv], atol=1e-5, rtol=1e-5)


def _packed(lens, nh, nkv, hdk, hdv):
    N = sum(lens)
    starts = torch.cat([torch.full((n,), sum(lens[:i])) for i, n in enumerate(lens)]).int()
    return (torch.randn(N, nh, hdk), torch.randn(N, nkv, hdk), torch.randn(N, nkv, hdv),
            starts)


def _masked_dense(q, k, v, starts, scale):
    """Packed causal attention as one dense softmax with a block-diagonal causal mask."""
    N, nh, _ = q.shape
    g = nh // k.shape[1]
    i = torch.arange(N, device=q.device)
    seen = (i[None] >= starts[:, None].long()) & (i[None] <= i[:, None])          # [N, N]
    s = torch.einsum("nhd,mhd->hnm", q, k.repeat_interleave(g, 1)) * scale
    w = s.masked_fill(~seen[None], float("-inf")).softmax(-1)
    return torch.einsum("hnm,mhd->nhd", w, v.repeat_interleave(g, 1))


def test_packed_prefill_attention_equals_masked_dense():
    """Packed prompts (one token, a block of 64, lengths across blocks) attend causally within
    their own prompt only: one SDPA per prompt equals a dense block-diagonal causal mask."""
    from drafter.generation.paged import packed_attention_reference

    torch.manual_seed(0)
    for shape in [([5, 70, 1, 130, 3], 9, 3, 64, 64), ([200], 4, 4, 24, 16)]:
        q, k, v, starts = _packed(*shape)
        torch.testing.assert_close(packed_attention_reference(q, k, v, starts, 0.3),
                                   _masked_dense(q, k, v, starts, 0.3), atol=1e-5, rtol=1e-5)


def test_packed_prefill_kernel_in_the_interpreter():
    """The Triton prefill kernel run by Triton's interpreter on the CPU (skipped without Triton):
    GQA 3:1, unequal key/value dims, prompts of one token and across blocks of 64, padding."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch
        from drafter.generation.paged import packed_attention_triton
        from tests.test_generator import _masked_dense, _packed
        torch.manual_seed(0)
        for shape in [([5, 70, 1, 130, 3], 9, 3, 64, 64), ([200], 4, 4, 24, 16),
                      ([1, 1, 64, 65], 8, 2, 32, 32)]:
            q, k, v, starts = _packed(*shape)
            err = (packed_attention_triton(q, k, v, starts, 0.3)
                   - _masked_dense(q, k, v, starts, 0.3)).abs().max()
            assert err < 1e-4, (shape, err)
            # a graphed chunk's padding (starts -1) attends to nothing: output 0, the rest equal
            pad = [torch.cat([t, torch.randn(70, *t.shape[1:])]) for t in (q, k, v)]
            out = packed_attention_triton(*pad, torch.cat([starts, torch.full((70,), -1)]).int(),
                                          0.3)
            assert out[len(q):].abs().max() == 0
            assert (out[:len(q)] - _masked_dense(q, k, v, starts, 0.3)).abs().max() < 1e-4
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_sampling_kernel_in_the_interpreter():
    """drafter.generation.sampling's kernel by Triton's interpreter: greedy rows take torch.argmax's
    index (the first of a tie, across blocks), bfloat16 logits read as they are; sampled rows
    follow softmax(logits / T) and the same seed draws the same tokens, another seed others."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch
        from drafter.generation.sampling import sample_rows
        torch.manual_seed(0)
        lg = (torch.randn(4, 9000) * 2).bfloat16()
        lg[0, 5] = lg[0, 8000] = 50.0
        temp = torch.tensor([0.0, 0.0, 1.0, 0.0])
        out = sample_rows(lg, temp, torch.tensor([1]), True)
        want = lg.float().argmax(-1)
        assert out[0] == 5 and out[[1, 3]].tolist() == want[[1, 3]].tolist(), out
        lg = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]]).repeat(600, 1)
        temp = torch.full((600,), 0.7)
        a = sample_rows(lg, temp, torch.tensor([7]), True)
        assert a.tolist() == sample_rows(lg, temp, torch.tensor([7]), True).tolist()
        b = sample_rows(lg, temp, torch.tensor([8]), True)
        assert a.tolist() != b.tolist()
        freq = torch.bincount(torch.cat([a, b]), minlength=5) / 1200
        err = (freq - torch.softmax(lg[0] / 0.7, 0)).abs().max()
        assert err < 0.05, (freq, err)
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_triton_kernel_equals_reference_in_the_interpreter():
    """The decode kernel itself, run by Triton's interpreter on the CPU (skipped without Triton;
    the GPU test runs it compiled): GQA 3:1, MHA with unequal key/value dims (MLA-like), an idle
    row, pages of 16 and 32; with and without the longest rows split into parts."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch
        from drafter.generation.paged import (long_rows, paged_attention_reference,
                                          paged_attention_triton)
        torch.manual_seed(0)
        for B, nh, nkv, hdk, hdv, P in [(5, 9, 3, 64, 64, 16), (3, 4, 4, 24, 16, 16),
                                        (2, 8, 2, 32, 32, 32)]:
            pages, W = 40, 6
            kp, vp = torch.randn(pages * P, nkv, hdk), torch.randn(pages * P, nkv, hdv)
            table = torch.stack([torch.randperm(pages - 1)[:W] + 1 for _ in range(B)]).int()
            lens = torch.cat([torch.zeros(1), torch.randint(1, W * P, (B - 1,))]).int()
            q = torch.randn(B, nh, hdk)
            ref = paged_attention_reference(q, kp, vp, table, lens, 0.3, P)
            out = paged_attention_triton(q, kp, vp, table, lens, 0.3, P)
            assert (out - ref).abs().max() < 1e-4, (B, nh, (out - ref).abs().max())
            # the longest rows split into parts of 2 pages (not every long row: at most 2)
            lens[-1] = W * P
            ref = paged_attention_reference(q, kp, vp, table, lens, 0.3, P)
            split = long_rows(lens, 2, 2 * P)
            assert (split[1] >= 0).any()
            out = paged_attention_triton(q, kp, vp, table, lens, 0.3, P, split, 2 * P)
            assert (out - ref).abs().max() < 1e-4, (B, nh, (out - ref).abs().max())
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


# ------------------------------------------------------------------------------------ GPU only
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_generator_on_the_gpu(smollm2_dir):
    """float32 on the GPU: the compiled kernel equals the reference, and the generator with CUDA
    graphs (Triton kernel) gives the static decoder's greedy tokens; the plan fits the pool."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    kp, vp = torch.randn(64 * 64, 3, 64).cuda(), torch.randn(64 * 64, 3, 64).cuda()
    table = torch.stack([torch.randperm(63)[:8] + 1 for _ in range(5)]).int().cuda()
    lens = torch.tensor([0, 1, 64, 300, 512], dtype=torch.int32).cuda()
    q = torch.randn(5, 9, 64).cuda()
    from drafter.generation.paged import packed_attention_triton, paged_attention_triton
    from drafter.generation.sampling import sample_rows
    pq, pk, pv, starts = (t.cuda() for t in _packed([5, 70, 1, 130, 3], 9, 3, 64, 64))
    torch.testing.assert_close(packed_attention_triton(pq, pk, pv, starts, 0.3),
                               _masked_dense(pq, pk, pv, starts, 0.3), atol=1e-4, rtol=1e-4)
    lg = torch.randn(64, 49152, device="cuda").bfloat16()
    assert torch.equal(sample_rows(lg, torch.zeros(64, device="cuda"), torch.zeros(
        1, dtype=torch.long, device="cuda"), True), lg.argmax(-1))
    torch.testing.assert_close(paged_attention_triton(q, kp, vp, table, lens, 0.125, 64),
                               paged_attention_reference(q, kp, vp, table, lens, 0.125, 64),
                               atol=1e-4, rtol=1e-4)
    from drafter.generation.paged import long_rows
    torch.testing.assert_close(paged_attention_triton(q, kp, vp, table, lens, 0.125, 64,
                                                      long_rows(lens, 2, 128), 128),
                               paged_attention_reference(q, kp, vp, table, lens, 0.125, 64),
                               atol=1e-4, rtol=1e-4)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).cuda().eval()
    prompts = [torch.randint(100, 40000, (n,)).tolist() for n in (40, 300, 7, 90, 12)]
    want = _one_by_one(model, prompts, [40] * 5, [])
    eng = Generator(model, max_batch=4, cuda_graphs=True, sync_every=4)
    got = eng.generate(prompts, 40)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert eng.cache.use_triton and eng.graphs.enabled and eng.graphs.graphs
    assert eng.prefill_graphs.enabled and eng.prefill_graphs.graphs     # packed, graphed
    assert eng.last["peak_bytes"] > 0 and eng.last["pages"] >= 5
    again = eng.generate(prompts[:2], 8)         # a new plan frees and re-sizes the pools
    assert [g.tokens for g in again] == [w.tokens[:8] for w in want[:2]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_attention_does_not_depend_on_the_batch_on_the_gpu():
    """bfloat16 on the GPU, bit for bit: a prompt's prefill attention wherever it sits in the
    packed chunk (which prompts share it), a long row's decode attention split or not (which rows
    share the step). benchmarks/generate_throughput.py's `same` column checks the generator's greedy
    answers across batch sizes end to end."""
    from drafter.generation.paged import long_rows, packed_attention_triton, paged_attention_triton

    torch.manual_seed(0)
    dt = torch.bfloat16
    x = [torch.randn(150, h, 64, device="cuda", dtype=dt) for h in (9, 3, 3)]

    def packed(pre, post):                     # the prompt x after pre tokens, before post
        n = pre + 150 + post
        qkv = [torch.randn(n, h, 64, device="cuda", dtype=dt) for h in (9, 3, 3)]
        for t, xx in zip(qkv, x):
            t[pre:pre + 150] = xx
        starts = torch.tensor([0] * pre + [pre] * 150 + [pre + 150] * post, dtype=torch.int32,
                              device="cuda")
        return packed_attention_triton(*qkv, starts, 0.125)[pre:pre + 150]

    alone = packed(0, 0)
    for pre, post in [(1, 0), (37, 5), (100, 64), (64, 1)]:
        assert torch.equal(packed(pre, post), alone), (pre, post)
    kp = torch.randn(64 * 64, 3, 64, device="cuda", dtype=dt)
    vp = torch.randn(64 * 64, 3, 64, device="cuda", dtype=dt)
    table = torch.stack([torch.randperm(63)[:40] + 1 for _ in range(5)]).int().cuda()
    lens = torch.tensor([2500, 1, 64, 1300, 700], dtype=torch.int32, device="cuda")
    q = torch.randn(5, 9, 64, device="cuda", dtype=dt)
    whole = paged_attention_triton(q, kp, vp, table, lens, 0.125, 64)
    for rows in (1, 2, 5):                     # row 0 split alone, rows 0 and 3, every long row
        split = paged_attention_triton(q, kp, vp, table, lens, 0.125, 64, long_rows(lens, rows))
        assert torch.equal(split, whole), rows


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_local_generator_data_parallel(smollm2_dir):
    """Two visible GPUs: one generator each draining one queue; results in prompt order and equal to
    one device's (float32)."""
    from drafter.core.config import TargetConfig

    prompts = [torch.randint(100, 40000, (n,)).tolist() for n in (40, 30, 7, 90, 12, 5)]
    gen = LocalGenerator(TargetConfig(model=str(smollm2_dir), dtype="float32"), batch_size=2)
    assert gen.replicas == torch.cuda.device_count()
    one = LocalGenerator(TargetConfig(model=str(smollm2_dir), dtype="float32", device="cuda:0"),
                         batch_size=2)
    assert one.replicas == 1
    assert gen.generate(prompts, 20) == one.generate(prompts, 20)
