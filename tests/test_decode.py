"""drafter.decoding.decode: static-cache plain decoding against HF, speculative decoding (lossless,
oracle and always-wrong drafters), the EAGLE drafter's static path against Drafter.forward, and
rejection sampling preserving the target distribution. CPU, float32."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from drafter.decoding import tree as tree_mod
from drafter.decoding.decode import (
    Decoder,
    DraftQ,
    EagleDraft,
    TreeSpec,
    acceptance_stats,
    ancestors,
    build_tree,
    verify_chain_sample,
    verify_sample,
)
from drafter.train.model import Drafter, DrafterConfig
from tests.tiny import make_tiny

MAX_NEW = 9  # 1 token from the prefill + 2 full chain steps of K=3


pytestmark = pytest.mark.usefixtures("one_thread")


class RefDrafter:
    """A test drafter that reads the reference continuation `ref` [B, R] (prompt + plain greedy
    output, by position). mode: oracle (proposes the target's own next token), wrong (never
    proposes it: its logit is -inf), noisy (the right token ranks 2nd at positions divisible by
    3, 1st elsewhere: partial acceptance, non-first siblings on trees), shuffled (the right
    token, favoured, and four decoys in an order that depends on the position: any sibling, and
    nodes of one depth outranking those of another)."""
    aux_layer_ids = None
    rows = None  # continuous batching: a refill's batch is these cache rows (DraftModel)

    def __init__(self, ref: torch.Tensor, vocab_size: int, mode: str = "oracle"):
        self.ref, self.vocab_size, self.mode = ref, vocab_size, mode
        self.owner = torch.arange(ref.shape[0], device=ref.device)  # batch row -> row of ref

    def assign(self, rows, prompts):  # continuous batching: row b now decodes prompt i
        self.owner[torch.as_tensor(rows, device=self.ref.device)] = \
            torch.as_tensor(prompts, device=self.ref.device)

    def allocate(self, *args):
        pass

    def to_target(self, ids):
        return ids

    def _logits(self, pos):  # logits for the token at position pos + 2
        idx = (pos + 2).clamp(max=self.ref.shape[1] - 1)
        rows = self.rows if self.rows is not None else torch.arange(pos.shape[0],
                                                                    device=pos.device)
        ref = self.ref[self.owner[rows]]
        right = ref.gather(1, idx.reshape(idx.shape[0], -1)).reshape(pos.shape)
        lg = torch.zeros(*pos.shape, self.vocab_size, device=pos.device)
        if self.mode == "wrong":
            return lg.scatter(-1, right[..., None], float("-inf"))
        lg = lg.scatter(-1, right[..., None], 10.0)
        if self.mode == "noisy":
            decoy = (right + 1) % self.vocab_size
            lg = lg.scatter(-1, decoy[..., None], torch.where(pos % 3 == 0, 11.0, 5.0)[..., None])
        if self.mode == "shuffled":  # the right token and 4 decoys in an order set by position
            c = (right[..., None] + torch.arange(5, device=pos.device)) % self.vocab_size
            u = torch.frac(torch.sin(pos[..., None] * 12.9898 + c * 78.233) * 43758.5453).abs()
            lg = torch.zeros_like(lg).scatter(-1, c, 5.0 + 3.0 * u)
            lg = lg.scatter_add(-1, right[..., None], torch.full_like(u[..., :1], 2.0))
        return lg

    def observe(self, ids, aux, pos, slots, vis, last):
        return None if last is None else self._logits(pos.gather(1, last[:, None]).squeeze(1))

    def score(self, depth, ids, parent, pos, slots, vis):
        return self._logits(pos)


def _ref(prompts, outs, pad=16):
    R = max(len(p) + len(o.tokens) for p, o in zip(prompts, outs)) + pad
    ref = torch.zeros(len(prompts), R, dtype=torch.long)
    for b, (p, o) in enumerate(zip(prompts, outs)):
        ref[b, :len(p) + len(o.tokens)] = torch.tensor(p + o.tokens)
    return ref


def _tiny_drafter(target_config, Vd=1024, seed=0, **kw) -> Drafter:
    """A random EAGLE-3 drafter for this target with a non-trivial d2t."""
    torch.manual_seed(seed)
    V = target_config.vocab_size
    n = target_config.num_hidden_layers
    cfg = DrafterConfig.from_target(target_config, Vd, [2, n // 2, n - 3], **kw)
    dr = Drafter(cfg)
    sel = torch.randperm(V)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[sel] = True
    dr.set_vocab(sel - torch.arange(Vd), t2d)
    return dr


# ------------------------------------------------------------------------- pure tensor tests
def test_acceptance_stats_on_a_hand_made_trace():
    # 10 steps of a chain K=3 accepting: 0,1,3,3,2,0,3,1,2,3  -> hist [2, 2, 2, 4]
    trace = [0, 1, 3, 3, 2, 0, 3, 1, 2, 3]
    hist = [trace.count(a) for a in range(4)]
    st = acceptance_stats(hist)
    assert st["steps"] == 10 and st["accepted"] == sum(trace)
    assert st["tau"] == pytest.approx((sum(trace) + 10) / 10)          # 2.8
    assert st["acceptance"] == pytest.approx([0.8, 0.6, 0.4])          # P[a >= i]
    assert st["acceptance_conditional"] == pytest.approx([0.8, 0.75, 4 / 6])
    assert acceptance_stats([5, 0, 0])["acceptance_conditional"] == [0.0, None]


def test_build_tree_is_eagle2_greedy_and_ancestor_closed():
    torch.manual_seed(0)
    B, Vd, k, D = 3, 20, 3, 4
    tables = torch.randn(Vd, Vd) * 3   # the "drafter": logits of the next token given a token
    root = torch.randn(B, Vd) * 3
    calls = []

    def scorer(i, ids, parent):
        calls.append((i, ids.shape))
        return tables[ids]

    spec = TreeSpec(D, k, 10)
    d = build_tree(root, scorer, spec, 0.0)
    assert calls == [(1, (B, k)), (2, (B, k)), (3, (B, k))]
    N = spec.nodes
    assert d.tokens.shape == (B, N) and d.q is None
    lp0 = torch.log_softmax(root, -1)
    for b in range(B):
        par = d.parent[b].tolist()
        for n in range(N):  # every node's parent precedes it and sits one level up
            assert par[n] == 0 or (par[n] - 1 < n and d.depth[b, par[n] - 1] == d.depth[b, n] - 1)
        # depth-1 nodes are the root's best children, best first
        first = [n for n in range(N) if par[n] == 0]
        top = lp0[b].topk(len(first)).indices.tolist()
        assert d.tokens[b, first].tolist() == top
    anc = ancestors(torch.cat([torch.zeros(B, 1, dtype=torch.long), d.parent], 1), D)
    assert anc[:, 0].sum(-1).eq(1).all() and anc.diagonal(dim1=1, dim2=2).all()
    chain = build_tree(root, scorer, TreeSpec.chain(3), 0.0)
    assert chain.parent.tolist() == [[0, 1, 2]] * B and chain.depth.tolist() == [[1, 2, 3]] * B


@pytest.mark.parametrize("shape,dtype", [((64, 32000), torch.bfloat16),
                                         ((4, 8, 4096), torch.float32),
                                         ((3, 1000), torch.float32)],
                         ids=["frontier-bf16", "3d-float32", "narrow"])
def test_top_indices_finds_torch_topks_values(shape, dtype):
    """The chunked search (wide rows) and its fallback (narrow ones) give torch.topk's k values
    in its order, at k distinct indices, also among thousands of exact ties."""
    torch.manual_seed(0)
    x = torch.randn(shape)
    for t in (x.to(dtype), (x * 2).round().to(dtype)):
        i = tree_mod.top_indices(t, 8)
        assert i.shape == (*shape[:-1], 8)
        assert torch.equal(t.gather(-1, i), t.topk(8, dim=-1).values)
        assert (i.sort(-1).values.diff(dim=-1) > 0).all()


def _wide_vocab_tree(temperature: float):
    """A 4/4/20 tree over 4 rows of a 4,096-token draft vocab (wide enough for the chunked
    searches), its drafter a fixed table of logits, the same draws every call."""
    B, Vd, spec = 4, 4096, TreeSpec(4, 4, 20)
    g = torch.Generator().manual_seed(0)
    tables, root = torch.randn(97, Vd, generator=g) * 3, torch.randn(B, Vd, generator=g) * 3
    torch.manual_seed(1)
    return build_tree(root, lambda i, ids, parent: tables[ids % 97], spec, temperature)


def _assert_same_tree(a, b):
    for f in ("tokens", "parent", "depth", "valid", "dist", "rank"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert (a.q is None) == (b.q is None)
    if a.q is not None:
        assert torch.equal(a.q.rows, b.q.rows) and torch.equal(a.q.lse, b.q.lse)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_trees_over_a_wide_vocab_are_torch_topks_trees(monkeypatch, temperature):
    """build_tree over a 4,096-token draft vocab (the chunked search) makes the tree that
    torch.topk makes: the same tokens, parents, depths and distributions, greedy and sampled."""
    chunked = _wide_vocab_tree(temperature)
    monkeypatch.setattr(tree_mod, "top_indices", lambda x, k: x.topk(k, dim=-1).indices)
    _assert_same_tree(chunked, _wide_vocab_tree(temperature))


def _children_cases(dev="cpu"):
    """(rows, k) for fused_children: bf16 and float32, 2-D and 3-D, draft vocabs of 4,096
    (chunks of 64) and 32,000 (of 128: 250 chunks in a padded 256, over several tiles); exact
    ties by the thousand; the k best inside one chunk; half the vocab at -inf (a masked one)."""
    torch.manual_seed(0)
    x = torch.randn(6, 32000, device=dev) * 3
    x[1, 640:648] = 20.0                      # the row's top 8 all in chunk 5
    x[2, ::2] = float("-inf")
    yield x.bfloat16(), 8
    yield (x * 2).round().bfloat16(), 8
    yield x, 8
    yield torch.randn(2, 4, 4096, device=dev), 8
    yield (torch.randn(3, 4096, device=dev) * 2).round(), 4


def _check_children(x, k):
    import torch.nn.functional as F

    ids, logp = tree_mod.fused_children(x, k)
    assert ids.shape == logp.shape == (*x.shape[:-1], k) and logp.dtype == torch.float32
    assert torch.equal(x.gather(-1, ids), x.topk(k, dim=-1).values)      # torch.topk's order
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all()                    # k distinct ids
    want = F.log_softmax(x.float(), dim=-1).gather(-1, ids)
    assert (logp - want).abs().max() < 2e-5, (logp - want).abs().max()


def test_fused_children_in_the_interpreter():
    """tree.fused_children, the greedy expansion's one Triton kernel, run by Triton's
    interpreter on the CPU (skipped without Triton; the GPU test runs it compiled): torch.topk's
    values in its order at distinct ids, log_softmax's log-probs (_children_cases); and a greedy
    tree built with it is the eager kernels' tree."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        from drafter.decoding import tree as tree_mod
        from tests.test_decode import (_assert_same_tree, _check_children, _children_cases,
                                       _wide_vocab_tree)
        for x, k in _children_cases():
            _check_children(x, k)
        fused = _wide_vocab_tree(0.0)
        tree_mod.FUSED_SEARCH = False
        _assert_same_tree(fused, _wide_vocab_tree(0.0))
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


@pytest.mark.parametrize("spec", [TreeSpec.chain(3), TreeSpec(3, 3, 8), "chain step"],
                         ids=["chain", "tree", "chain-step"])
def test_rejection_sampling_preserves_the_target_distribution(spec):
    """Tiny vocab, a target p(x_t | x_{t-1}) and a different drafter q: the first two tokens
    emitted by speculative sampling (two steps when the first step accepts nothing) follow
    p(a | x0) p(b | a). Chi-square over the 25 cells; a 3% perturbation of p must be rejected.
    "chain step": a chain of 3 drawn token by token and verified by verify_chain_sample
    (Decoder._chain_step's sampler)."""
    torch.manual_seed(0)
    V, n = 5, 60_000
    P = torch.distributions.Dirichlet(torch.ones(V)).sample((V,))
    Q = torch.distributions.Dirichlet(torch.full((V,), 0.7)).sample((V,))
    logP, logQ = P.log(), Q.log()

    def chain_step(x0, K=3):
        full = [x0]
        for _ in range(K):  # each draft sampled from q given the one before
            lq = logQ[full[-1]]
            full.append((lq - torch.log(-torch.log(torch.rand_like(lq)))).argmax(-1))
        full = torch.stack(full, 1)                                                 # [n, K+1]
        toks = full[:, 1:]
        q = DraftQ(logQ[full[:, :-1]], torch.zeros(n, K), 1.0)     # log-probs as logits: lse 0
        n_acc, last = verify_chain_sample(toks, logP[full], q, torch.arange(V), 1.0)
        return torch.cat([toks, last[:, None]], 1).scatter(1, n_acc[:, None], last[:, None]), \
            n_acc

    def step(x0):  # one speculative step from the token x0 [n]: emitted tokens [n, D+1], count
        if spec == "chain step":
            return chain_step(x0)
        d = build_tree(logQ[x0], lambda i, ids, parent: logQ[ids], spec, 1.0)
        pf = torch.cat([torch.zeros(n, 1, dtype=torch.long), d.parent], 1)
        df = torch.cat([torch.zeros(n, 1, dtype=torch.long), d.depth], 1)
        full = torch.cat([x0[:, None], d.tokens], 1)
        path, n_acc, bonus = verify_sample(d.tokens, pf, d.valid, df, ancestors(pf, spec.depth),
                                           logP[full], d.q, d.dist, torch.arange(V), 1.0,
                                           spec.depth, spec.topk)
        em = torch.cat([full.gather(1, path)[:, 1:], bonus[:, None]], 1)
        return em.scatter(1, n_acc[:, None], bonus[:, None]), n_acc

    x0 = torch.zeros(n, dtype=torch.long)
    em, n_acc = step(x0)
    em2, _ = step(em[:, 0])
    first, second = em[:, 0], torch.where(n_acc >= 1, em[:, 1], em2[:, 0])
    obs = torch.bincount(first * V + second, minlength=V * V).double()
    assert n_acc.float().mean() > 0.3  # the drafter gets tokens accepted: the test means something

    def chi2(p):
        exp = (p[0][:, None] * p).flatten().double() * n
        return ((obs - exp) ** 2 / exp).sum().item()

    assert chi2(P) < 51.2                             # 24 degrees of freedom, p = 0.001
    assert chi2(0.97 * P + 0.03 / V) > 100            # the test has the power to see 3%


@pytest.mark.parametrize("layer", ["llama", "mla"])
def test_eagle_draft_static_cache_matches_drafter_forward(layer):
    """EagleDraft's static-cache forward gives Drafter.forward's states: a causal prefix, then a
    tree step over a cache with an explicit mask. The MLA layer's keys and values differ in
    width (dqk 12, dv 6) and its score scale is DeepSeek's."""
    from transformers import DeepseekV3Config, LlamaConfig

    size = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    tc = LlamaConfig(**size) if layer == "llama" else DeepseekV3Config(
        **size, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=6, rope_scaling={"type": "yarn", "factor": 4.0, "mscale": 1.0,
                                    "mscale_all_dim": 1.0, "original_max_position_embeddings": 4})
    dr = _tiny_drafter(tc, Vd=100, draft_layer=layer)
    P = EagleDraft(dr)
    P.allocate(2, 32, "cpu", torch.float32)
    torch.manual_seed(1)
    B, T, Ht = 2, 6, 32
    aux = torch.randn(B, T, 3, Ht)
    ids = torch.randint(0, 300, (B, T))
    pos = torch.arange(T).expand(B, T)
    h = dr.fuse(aux)
    ref_h, ref_logits, kv = dr(ids, h, pos)                        # causal, no cache
    S = 16
    s = torch.arange(S)
    vis = s[None, None] <= pos[..., None]
    last = torch.tensor([T - 1, 2])
    logits = P.observe(ids, aux, pos, pos, vis, last)
    torch.testing.assert_close(logits, ref_logits[torch.arange(B), last])
    # a tree step: 3 new tokens at positions 6, 7, 7 (node 1 -> nodes 2 and 3), over the cache
    t_ids = torch.randint(0, 300, (B, 3))
    t_h = torch.randn(B, 3, 32)
    t_pos = torch.tensor([6, 7, 7]).expand(B, 3)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(3, T, dtype=torch.bool), tree], 1).expand(B, 1, 3, T + 3)
    ref_out, _, _ = dr(t_ids, t_h, t_pos, past_kv=kv, attn_mask=mask)
    slots = torch.tensor([T, T + 1, T + 2]).expand(B, 3)
    t_vis = (s[None, None] < T) | torch.cat([torch.zeros(3, T, dtype=torch.bool), tree,
                                             torch.zeros(3, S - T - 3, dtype=torch.bool)], 1)
    out = P._forward(t_ids, t_h, t_pos, slots, t_vis.expand(B, 3, S))
    torch.testing.assert_close(out, ref_out)


def test_eagle_draft_refill_writes_its_rows_only():
    """Continuous batching's refill (EagleDraft.rows set): observe over cache rows [2, 0] gives
    those rows the logits, root state and cache entries a whole-batch observe gives them, and
    leaves row 1 as it was (the decode-level test cannot see this: its EAGLE drafter is random
    and never accepted)."""
    from transformers import LlamaConfig

    tc = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    P = EagleDraft(_tiny_drafter(tc, Vd=100))
    torch.manual_seed(2)
    B, T, S = 3, 5, 16
    aux, ids = torch.randn(B, T, 3, 32), torch.randint(0, 300, (B, T))
    pos = torch.arange(T).expand(B, T)
    vis = (torch.arange(S)[None, None] <= pos[..., None]).expand(B, T, S)
    last = torch.tensor([T - 1, 1, 3])
    P.allocate(B, S, "cpu", torch.float32)
    want = P.observe(ids, aux, pos, pos, vis, last)
    kc, vc, root = P.kc.clone(), P.vc.clone(), P.root_h.clone()
    P.allocate(B, S, "cpu", torch.float32)
    P.kc[1].fill_(7.0)
    rows = torch.tensor([2, 0])
    P.rows = rows
    got = P.observe(ids[rows], aux[rows], pos[rows], pos[rows], vis[rows], last[rows])
    P.rows = None
    torch.testing.assert_close(got, want[rows])
    torch.testing.assert_close(P.kc[rows], kc[rows])
    torch.testing.assert_close(P.vc[rows], vc[rows])
    torch.testing.assert_close(P.root_h[rows], root[rows])
    assert (P.kc[1] == 7.0).all() and (P.vc[1] == 0).all() and (P.root_h[1] == 0).all()


# ---------------------------------------------------------------------------- the real target
@pytest.fixture(scope="module")
def smol(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    msgs = ["Write a python function that adds two numbers.", "What is 2+3?"]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": m}],
                                           add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for m in msgs]
    dec = Decoder(model, max_batch=2)
    plain = dec.generate(prompts, MAX_NEW, stop_ids=[tok.eos_token_id], record_gaps=True)
    return {"model": model, "tok": tok, "prompts": prompts, "dec": dec, "plain": plain,
            "ref": _ref(prompts, plain), "stop": [tok.eos_token_id]}


def test_runners_up_leave_out_the_picked_token_among_ties():
    """bf16 logits tie exactly; argmax's choice need not come first in topk's order. The
    runner-up tied with the picked token stays listed at gap 0 (the lossless check then calls a
    flip between them a tie), and the picked token is never its own runner-up."""
    from drafter.decoding.decode import NEAR, runners_up

    lg = torch.tensor([[1.0, 5.0, 5.0, 2.0] + [0.0] * 12,
                       [3.0, 1.0, 0.5, 9.0] + [-1.0] * 12])
    for picked in ([1, 3], [2, 3]):                      # either tied token as argmax's choice
        gaps, ids = runners_up(lg, torch.tensor(picked))
        assert ids.shape == gaps.shape == (2, NEAR)
        assert picked[0] not in ids[0].tolist() and 3 - picked[0] == ids[0, 0]   # the other tie
        assert gaps[0, 0] == 0 and gaps[0, 1] == 3.0 and ids[0, 1] == 3
        assert ids[1, :3].tolist() == [0, 1, 2] and gaps[1, :3].tolist() == [6.0, 8.0, 8.5]
        assert (gaps[:, 1:] >= gaps[:, :-1]).all()       # best first


def test_runners_up_over_a_real_vocab_match_torch_topk():
    """At SmolLM2's vocabulary (49,152: the two-read search applies) the runners-up are
    torch.topk's: the same margins, best first, in bf16-valued logits with exact ties."""
    from drafter.decoding.decode import NEAR, runners_up

    g = torch.Generator().manual_seed(0)
    lg = (torch.randn(6, 49152, generator=g) * 4).to(torch.bfloat16).float()
    picked = lg.argmax(-1)
    gaps, ids = runners_up(lg, picked)
    top = lg.topk(NEAR + 1, dim=-1).values[:, 1:]
    assert torch.equal(gaps, lg.gather(1, picked[:, None]) - top)
    assert torch.equal(lg.gather(1, ids), top) and (ids != picked[:, None]).all()


def test_plain_decoding_matches_hf_generate(smol):
    """Left-padded batch of two prompt lengths, static cache == transformers' own generate, also
    with the prefill cut into chunks of 16 tokens."""
    model, plain = smol["model"], smol["plain"]
    assert [o.finish for o in plain] == ["length", "stop"]  # "2 + 3 = 5<|im_end|>" stops early
    for p, o in zip(smol["prompts"], plain):
        ref = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False)
        assert o.tokens == ref[0, len(p):].tolist()
        assert o.steps == len(o.tokens) - 1 and len(o.gaps) == len(o.tokens)
        assert all(0 <= g[0] <= g[1] <= g[2] for g in o.gaps)          # runners-up, best first
        assert all(t not in near for t, near in zip(o.tokens, o.second))
    chunked = Decoder(model, max_batch=2, prefill_tokens=32)  # 16 tokens per row per chunk
    outs = chunked.generate(smol["prompts"], MAX_NEW, stop_ids=smol["stop"])
    assert [o.tokens for o in outs] == [o.tokens for o in plain]


def test_prompts_padded_to_a_graphed_prefills_length_give_the_same_tokens(smol, monkeypatch):
    """A graphed prefill (a GPU's, Decoder._prompt_len) left-pads a batch's prompts to a
    multiple of PREFILL_BUCKET: more pad slots before each prompt, its positions unchanged. On
    the CPU, with that padding forced: the plain and speculative tokens and acceptance are the
    unpadded run's, static and continuous (whose first fill is padded, its refills not)."""
    from drafter.decoding.decode import PREFILL_BUCKET
    from drafter.decoding.static import round_up

    model, plain, V = smol["model"], smol["plain"], smol["model"].config.vocab_size
    prompts = smol["prompts"] + smol["prompts"][::-1]
    stop = smol["stop"]
    want = smol["dec"].generate(prompts, MAX_NEW, stop_ids=stop)
    chain = smol["dec"].generate(prompts, MAX_NEW, stop_ids=stop, tree=TreeSpec.chain(3),
                                 proposer=RefDrafter(_ref(prompts, want), V, "noisy"))
    seen = []

    def padded(self, B, Tp):
        seen.append((B, Tp))
        return round_up(Tp, PREFILL_BUCKET)

    monkeypatch.setattr(Decoder, "_prompt_len", padded)
    dec = Decoder(model, max_batch=2)
    for continuous in (False, True):
        got = dec.generate(prompts, MAX_NEW, stop_ids=stop, continuous=continuous)
        assert [o.tokens for o in got] == [o.tokens for o in want]
        assert [o.tokens for o in want[:2]] == [o.tokens for o in plain]
        spec = dec.generate(prompts, MAX_NEW, stop_ids=stop, tree=TreeSpec.chain(3),
                            proposer=RefDrafter(_ref(prompts, want), V, "noisy"),
                            continuous=continuous)
        assert [o.tokens for o in spec] == [o.tokens for o in want]
        assert [o.hist for o in spec] == [o.hist for o in chain]
    # every whole-batch prefill (2 rows) asked for its padded length: static, 2 batches x
    # (plain, chain); continuous, the first fill x (plain, chain) (its refills stay eager,
    # unpadded). Each generate also asks once for a batch of one: the cache's room.
    assert len([1 for B, _ in seen if B == 2]) == 6 and len(seen) == 6 + 4
    assert all(Tp % PREFILL_BUCKET for _, Tp in seen)


def _oracle_and_wrong(t, tree):
    dec, V = t["dec"], t["model"].config.vocab_size
    for mode, tau in (("oracle", tree.depth + 1), ("wrong", 1.0)):
        outs = dec.generate(t["prompts"], MAX_NEW, stop_ids=t["stop"],
                            proposer=RefDrafter(t["ref"], V, mode), tree=tree)
        assert [o.tokens for o in outs] == [o.tokens for o in t["plain"]]
        for o in outs:  # every single step: all D accepted (oracle) or none (wrong)
            a = tree.depth if mode == "oracle" else 0
            assert o.hist[a] == o.steps and sum(o.hist) == o.steps > 0
            assert acceptance_stats(o.hist)["tau"] == tau


def test_oracle_drafter_gives_k_plus_1_and_wrong_drafter_1(smol):
    _oracle_and_wrong(smol, TreeSpec.chain(3))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama (SmolLM2's vocab) and its plain greedy continuations."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        make_tiny("llama", tmp_path_factory.mktemp("tiny")), dtype=torch.float32).eval()
    torch.manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,)).tolist() for n in (23, 9, 16)]
    dec = Decoder(model, max_batch=3)
    plain = dec.generate(prompts, 3 * MAX_NEW)
    return {"model": model, "prompts": prompts, "dec": dec, "plain": plain, "stop": [],
            "ref": _ref(prompts, plain)}


def test_caches_are_sized_for_the_longest_prompt_before_timing(tiny_llama):
    """At batch 1 with prompts growing in length, the caches are allocated once, before the
    first batch (each growth inside the timed loop reallocated them and recaptured every CUDA
    graph, time that evaluate's step_ms counted), and the tokens do not change."""
    prompts = sorted(tiny_llama["prompts"], key=len)          # 9, 16, 23 tokens
    dec = Decoder(tiny_llama["model"], max_batch=1, span_bucket=8)  # caps round up to 8 slots
    calls = []
    real = dec.target.allocate
    dec.target.allocate = lambda *a: (calls.append(a), real(*a))[1]
    out = dec.generate(prompts, MAX_NEW)
    assert len(calls) == 1 and calls[0][0] == 1 and calls[0][1] >= 23 + MAX_NEW
    by_prompt = {tuple(p): o.tokens for p, o in zip(tiny_llama["prompts"], tiny_llama["plain"])}
    assert [o.tokens for o in out] == [by_prompt[tuple(p)][:MAX_NEW] for p in prompts]


def test_oracle_and_wrong_drafters_on_a_tree(tiny_llama):
    t = dict(tiny_llama, plain=[type(o)(o.tokens[:MAX_NEW], "length", 0)
                                for o in tiny_llama["plain"]])
    _oracle_and_wrong(t, TreeSpec(3, 2, 5))


def test_partial_acceptance_on_trees_is_lossless(tiny_llama):
    """The right token is sometimes the drafter's 2nd choice: a chain rejects there, a tree
    accepts a second sibling (its KV entries move to the committed slots)."""
    t = tiny_llama
    dec, V = t["dec"], t["model"].config.vocab_size
    hists = {}
    for tree in (TreeSpec.chain(3), TreeSpec(3, 2, 6)):
        outs = dec.generate(t["prompts"], 3 * MAX_NEW, proposer=RefDrafter(t["ref"], V, "noisy"),
                            tree=tree)
        assert [o.tokens for o in outs] == [o.tokens for o in t["plain"]]
        hists[tree.topk] = [sum(o.hist[a] for o in outs) for a in range(4)]
    chain, tree = acceptance_stats(hists[1]), acceptance_stats(hists[2])
    assert 1.0 < chain["tau"] < 4.0            # partial acceptance
    assert tree["tau"] > chain["tau"]          # the second sibling was accepted
    assert hists[2][3] > 0


def test_greedy_chain_step_equals_the_general_tree_step(tiny_llama, smol):
    """Decoder._chain_step (greedy chains) against the general tree step on the same chain: the
    same tokens and, step by step, the same acceptance (noisy oracle: partial acceptance; a
    random EAGLE-3 drafter: its real static cache and feedback)."""
    def both(t, make, K):
        res = []
        for fast in (True, False):
            t["dec"].fast_chain = fast
            try:
                res.append(t["dec"].generate(t["prompts"], 2 * MAX_NEW, stop_ids=t["stop"],
                                             proposer=make(), tree=TreeSpec.chain(K)))
            finally:
                t["dec"].fast_chain = True
        (a, b) = res
        assert [o.tokens for o in a] == [o.tokens for o in b]
        assert [(o.hist, o.steps) for o in a] == [(o.hist, o.steps) for o in b]
        return a

    V = tiny_llama["model"].config.vocab_size
    outs = both(tiny_llama, lambda: RefDrafter(tiny_llama["ref"], V, "noisy"), 4)
    assert 0 < sum(o.hist[0] for o in outs) < sum(o.steps for o in outs)  # partial acceptance
    dr = _tiny_drafter(smol["model"].config, Vd=2048, intermediate_size=256)
    calls = []

    class Recorded(EagleDraft):  # the drafts the drafter is asked to score, and what it returns
        def score(self, depth, ids, parent, pos, slots, vis):
            out = super().score(depth, ids, parent, pos, slots, vis)
            calls.append((depth, ids.tolist(), pos.tolist(), slots.tolist(),
                          out.argmax(-1).tolist()))
            return out

    both(smol, lambda: Recorded(dr), 3)
    half = len(calls) // 2
    assert half > 0 and calls[:half] == calls[half:]


@pytest.mark.parametrize("tree", [TreeSpec.chain(3), TreeSpec(3, 3, 8)], ids=["chain", "tree"])
def test_eagle_drafter_is_lossless_and_samples(smol, tree):
    """A random EAGLE-3 drafter (real static-cache drafting path, aux hooks, d2t) on SmolLM2:
    greedy output == plain greedy; sampling runs and respects the limits."""
    dec, model = smol["dec"], smol["model"]
    P = EagleDraft(_tiny_drafter(model.config, Vd=2048, intermediate_size=256))
    outs = dec.generate(smol["prompts"], MAX_NEW, stop_ids=smol["stop"], proposer=P, tree=tree)
    assert [o.tokens for o in outs] == [o.tokens for o in smol["plain"]]
    assert all(sum(o.hist) == o.steps for o in outs)
    torch.manual_seed(0)
    outs = dec.generate(smol["prompts"], 6, stop_ids=smol["stop"], proposer=P, tree=tree,
                        temperature=0.8)
    for o in outs:
        assert 1 <= len(o.tokens) <= 6 and o.finish in ("stop", "length")
        assert (o.finish == "stop") == (o.tokens[-1] == smol["stop"][0])


def test_continuous_batching_gives_the_static_tokens(smol):
    """Continuous batching (a row whose answer has ended takes the next prompt: a prefill of
    that row alone while the others' caches stay) gives, prompt for prompt, the static batches'
    tokens, acceptance histograms and smaller-tree counts: plain, chain, tree, the test drafter
    and a real EAGLE-3 drafter; and it takes fewer steps when the answers end apart."""
    tok, model = smol["tok"], smol["model"]
    msgs = ["Name a color.", "Write a haiku about rain.", "What is 7*6?", "Say hi.",
            "List three fruits, comma separated.", "Why is the sky blue? One sentence.",
            "Count from one to five."]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": m}],
                                           add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for m in msgs]
    stop = smol["stop"] + [tok.convert_tokens_to_ids(".")]   # answers end apart
    dec, n = Decoder(model, max_batch=3), 20
    static = dec.generate(prompts, n, stop_ids=stop, record_gaps=True)
    it_static = dec.last["iterations"]
    assert len({len(o.tokens) for o in static}) > 2
    cont = dec.generate(prompts, n, stop_ids=stop, record_gaps=True, continuous=True)
    assert [o.tokens for o in cont] == [o.tokens for o in static]
    for a, b in zip(cont, static):  # margins: the same up to float rounding (other padding)
        assert torch.tensor(a.gaps) == pytest.approx(torch.tensor(b.gaps), abs=1e-3)
        assert a.second == b.second
    assert dec.last["iterations"] < it_static and dec.last["row_steps"] == \
        3 * dec.last["iterations"]
    ref, V = _ref(prompts, static), model.config.vocab_size
    # each proposer once, each tree once (all four pairs took ~90 s on two cores)
    for tree, P in ((TreeSpec.chain(3), RefDrafter(ref, V, "noisy")),
                    (TreeSpec(3, 2, 6), EagleDraft(_tiny_drafter(model.config)))):
        want = dec.generate(prompts, n, stop_ids=stop, proposer=P, tree=tree, tree_stats=True)
        got = dec.generate(prompts, n, stop_ids=stop, proposer=P, tree=tree, tree_stats=True,
                           continuous=True)
        assert [o.tokens for o in got] == [o.tokens for o in want] == \
            [o.tokens for o in static]
        assert [(o.hist, o.shapes, o.steps) for o in got] == \
            [(o.hist, o.shapes, o.steps) for o in want]
        if isinstance(P, RefDrafter):  # its drafts were accepted in most answers
            assert sum(sum(o.hist[1:]) > 0 for o in got) > len(got) // 2


# ------------------------------------------------------------------- other architectures
@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3", "gemma2"])
def test_tiny_architectures_plain_and_speculative(arch, tmp_path):
    """Static cache vs full recomputation for GQA (Qwen3), MLA + MoE (DeepSeek-V3) and sliding
    windows (Gemma 2, window 32: the prompt plus the answer cross it); tree speculation with an
    oracle drafter stays identical."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_tiny(arch, tmp_path),
                                                 dtype=torch.float32).eval()
    torch.manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,)).tolist() for n in (30, 17)]
    n_new = 16
    want = []
    with torch.no_grad():  # no cache at all: the whole sequence every token
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(n_new):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
            want.append(ids[0, len(p):].tolist())
    dec = Decoder(model, max_batch=2)
    plain = dec.generate(prompts, n_new)
    assert [o.tokens for o in plain] == want
    spec = dec.generate(prompts, n_new, proposer=RefDrafter(_ref(prompts, plain),
                                                            model.config.vocab_size, "noisy"),
                        tree=TreeSpec(3, 2, 5))
    assert [o.tokens for o in spec] == want


def _tiny_moe(tmp_path, dtype=torch.float32):
    """A tiny random DeepSeek-V3 (MLA; 5 MoE layers of 8 routed experts, 2 per token) at std 0.2
    (at 0.02 its top logits sit within rounding of each other: a check of nothing)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        make_tiny("deepseek_v3", tmp_path, initializer_range=0.2, n_routed_experts=8),
        dtype=dtype).eval()


def test_moe_experts_switch_to_batched_mm_for_a_capture_and_back(tmp_path, tiny_llama):
    """capturable_experts (entered around a CUDA graph's warm-up and capture) runs the experts
    that sync with the host (grouped_mm off its bf16 fast path, eager) as batched_mm and puts
    their implementation back after, also after an error; the three give the same logits in
    float32. A dense model is left alone."""
    from drafter.decoding.static import capturable_experts, syncing_experts

    model = _tiny_moe(tmp_path)
    experts = model.model.layers[1].mlp.experts
    assert model.config._experts_implementation == "grouped_mm"
    assert syncing_experts(model) == [model.config] and experts.config is model.config
    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (2, 5))
    with torch.no_grad():
        want = model(ids).logits
        with capturable_experts(model):
            assert experts.config._experts_implementation == "batched_mm"
            got = model(ids).logits
        assert model.config._experts_implementation == "grouped_mm"
        model.set_experts_implementation("eager")
        with capturable_experts(model):
            assert experts.config._experts_implementation == "batched_mm"
        eager = model(ids).logits
    assert model.config._experts_implementation == "eager"
    model.set_experts_implementation("grouped_mm")
    for out in (got, eager):
        torch.testing.assert_close(out, want, rtol=1e-5, atol=5e-5)
    with pytest.raises(RuntimeError, match="in the capture"):
        with capturable_experts(model):
            raise RuntimeError("in the capture")
    assert model.config._experts_implementation == "grouped_mm"
    dense = tiny_llama["model"]
    before = dense.config._experts_implementation
    assert syncing_experts(dense) == []
    with capturable_experts(dense):
        assert dense.config._experts_implementation == before


# ------------------------------------------------------------------------------------ GPU only
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_give_the_eager_tokens(smollm2_dir):
    """On a GPU (float32, so that eager and graph runs are comparable token for token): captured
    steps (plain, chain, tree, sampling shapes) give the eager tokens, and graphs are really used
    (no fallback). `pytest -m gpu tests/test_decode.py`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).cuda().eval()
    torch.manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,)).tolist() for n in (40, 300, 7)]
    eager, graphed = Decoder(model, max_batch=3, cuda_graphs=False), \
        Decoder(model, max_batch=3, cuda_graphs=True)
    plain = eager.generate(prompts, 40)
    assert [o.tokens for o in graphed.generate(prompts, 40)] == [o.tokens for o in plain]
    ref = _ref(prompts, plain).cuda()  # the test drafter stays on the GPU: capturable
    for tree in (TreeSpec.chain(5), TreeSpec(4, 4, 16)):
        for P in (RefDrafter(ref, model.config.vocab_size, "noisy"),
                  EagleDraft(_tiny_drafter(model.config, Vd=4096))):
            want = eager.generate(prompts, 40, proposer=P, tree=tree)
            got = graphed.generate(prompts, 40, proposer=P, tree=tree)
            assert [o.tokens for o in got] == [o.tokens for o in want] == \
                [o.tokens for o in plain]
            assert [o.hist for o in got] == [o.hist for o in want]
    assert graphed.graphs.enabled and graphed.graphs.graphs, "graph capture fell back to eager"
    outs = graphed.generate(prompts, 16, proposer=EagleDraft(_tiny_drafter(model.config)),
                            tree=TreeSpec(3, 3, 8), temperature=0.8)
    assert all(1 <= len(o.tokens) <= 16 for o in outs) and graphed.graphs.enabled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphed_prefills_give_the_eager_prefills_tokens(smollm2_dir):
    """Batch 1 and 2 prefills replayed from CUDA graphs (one per padded length: a small prefill
    is kernel launches) give the tokens and acceptance of eager prefills, plain and speculative
    (EAGLE drafter, greedy gaps recorded), static and continuous; each length is captured once;
    prefill_seconds still counts them. float32 on the GPU: eager prefills here are not padded,
    so the margins may differ in the last bits, not the tokens."""
    from transformers import AutoModelForCausalLM

    from drafter.decoding.decode import PREFILL_BUCKET

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).cuda().eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist()
               for n in (5, 64, 65, 200, 130, 7)]
    P = EagleDraft(_tiny_drafter(model.config, Vd=4096))
    for B, continuous in ((1, False), (2, False), (2, True)):
        eager = Decoder(model, max_batch=B, prefill_graph_tokens=0)
        graphed = Decoder(model, max_batch=B)
        keys = set()  # the prefill graphs each generate left (a new proposer clears the graphs)
        for proposer in (None, P):
            kw = dict(proposer=proposer, tree=TreeSpec.chain(3) if proposer else None,
                      continuous=continuous, record_gaps=proposer is None)
            want = eager.generate(prompts, 24, **kw)
            got = graphed.generate(prompts, 24, **kw)
            assert [o.tokens for o in got] == [o.tokens for o in want]
            assert [o.hist for o in got] == [o.hist for o in want]
            if proposer is None:  # the padded prefill's GEMM shapes round otherwise (H200:
                # 0.66178 against 0.66177): the margins agree to float32 rounding, not bitwise
                for o, w in zip(got, want):
                    torch.testing.assert_close(torch.tensor(o.gaps), torch.tensor(w.gaps),
                                               rtol=1e-4, atol=1e-4)
            assert graphed.last["prefill_seconds"] > 0
            keys |= {k for k in graphed.graphs.graphs if k[0] == "prefill"}
            assert not [k for k in eager.graphs.graphs if k[0] == "prefill"]
        again = graphed.generate(prompts, 24, **kw)  # every length captured before: none now
        assert graphed.last["capture_seconds"] == 0
        assert [o.tokens for o in again] == [o.tokens for o in got]
        lengths = {k[2] for k in keys}
        assert lengths and all(t % PREFILL_BUCKET == 0 for t in lengths)
        # batch 1: 5, 7 -> 64; 64 -> 64; 65 -> 128; 130 -> 192; 200 -> 256, plain and speculative
        assert B > 1 or (lengths == {64, 128, 192, 256} and len(keys) == 8)
    assert graphed.graphs.enabled, "graph capture fell back to eager"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_children_on_the_gpu():
    """fused_children compiled by Triton (the tree step's greedy expansion on CUDA) passes the
    interpreter test's checks, at the frontier's batch-64 shape too."""
    for x, k in _children_cases("cuda"):
        _check_children(x, k)
    _check_children(torch.randn(64, 8, 32000, device="cuda").bfloat16(), 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_trees_at_batch_64_give_the_plain_tokens_in_float32(smollm2_dir):
    """The strict check at the shapes evaluate serves: 64 rows, CUDA graphs, the 6/8/48 tree
    and smaller ones, in float32 on the GPU, token-identical to plain greedy decoding.
    In bf16 the same trees flip near-ties (verification GEMMs of 64 x 49 rows round otherwise
    than the plain step's 64); float32 tells such flips from a decoder error."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).cuda().eval()
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(5, 300, (64,), generator=g).tolist()
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lens]
    dec = Decoder(model, max_batch=64)
    plain = dec.generate(prompts, 48)
    want = [o.tokens for o in plain]
    ref = _ref(prompts, plain).cuda()
    for tree in (TreeSpec(6, 8, 48), TreeSpec(3, 8, 17), TreeSpec(2, 8, 7), TreeSpec.chain(2)):
        for P in (RefDrafter(ref, model.config.vocab_size, "noisy"),
                  RefDrafter(ref, model.config.vocab_size, "shuffled"),
                  EagleDraft(_tiny_drafter(model.config, Vd=4096))):
            got = dec.generate(prompts, 48, proposer=P, tree=tree)
            bad = [i for i, o in enumerate(got) if o.tokens != want[i]]
            assert not bad, f"{tree.label()} {type(P).__name__}: rows {bad[:8]} differ"
    assert dec.graphs.enabled and dec.graphs.graphs, "graph capture fell back to eager"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_moe_steps_capture_in_float32(tmp_path, caplog):
    """A tiny DeepSeek-V3 in float32 on the GPU. Its grouped_mm experts copy their offsets to
    the host there (torch's grouped GEMM off its bf16 fast path), which a capture refuses
    ("cannot copy between CPU and CUDA tensors during capture": decoding fell back to eager);
    the steps are now captured with batched_mm and give the eager tokens, plain and
    speculative (chain and tree), without a fallback; prefills stay eager and the experts keep
    grouped_mm outside captures. On SM90/SM100 bf16 captures grouped_mm itself."""
    import logging

    from drafter.decoding.static import syncing_experts

    model = _tiny_moe(tmp_path).cuda()
    assert syncing_experts(model) == [model.config]
    torch.manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,)).tolist() for n in (30, 17, 5)]
    eager, graphed = Decoder(model, max_batch=3, cuda_graphs=False), Decoder(model, max_batch=3)
    with caplog.at_level(logging.WARNING, logger="drafter"):
        plain = eager.generate(prompts, 24)
        assert len({t for o in plain for t in o.tokens}) > 12  # varied: a check that can fail
        assert [o.tokens for o in graphed.generate(prompts, 24)] == [o.tokens for o in plain]
        ref = _ref(prompts, plain).cuda()
        for tree in (TreeSpec.chain(3), TreeSpec(3, 2, 5)):
            P = RefDrafter(ref, model.config.vocab_size, "noisy")
            want = eager.generate(prompts, 24, proposer=P, tree=tree)
            got = graphed.generate(prompts, 24, proposer=P, tree=tree)
            assert [o.tokens for o in got] == [o.tokens for o in want] == \
                [o.tokens for o in plain]
            assert [o.hist for o in got] == [o.hist for o in want]
    assert "CUDA graph capture failed" not in caplog.text
    assert graphed.graphs.enabled and graphed.graphs.graphs, "graph capture fell back to eager"
    assert not [k for k in graphed.graphs.graphs if k[0] == "prefill"]
    assert model.config._experts_implementation == "grouped_mm"
    if torch.cuda.get_device_capability()[0] in (9, 10):
        model.bfloat16()
        assert syncing_experts(model) == []
        eager, graphed = (Decoder(model, max_batch=3, cuda_graphs=g, prefill_graph_tokens=0)
                          for g in (False, True))
        with caplog.at_level(logging.WARNING, logger="drafter"):
            want = eager.generate(prompts, 16)
            got = graphed.generate(prompts, 16)
        assert "CUDA graph capture failed" not in caplog.text and graphed.graphs.graphs
        assert [o.tokens for o in got] == [o.tokens for o in want]


def test_gqa_sdpa_equals_transformers_sdpa():
    """The static decoder's attention (grouped query heads folded into the query length, K/V
    never repeated) gives transformers' SDPA result under a per-row mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from drafter.decoding.static import _gqa_sdpa

    torch.manual_seed(0)
    B, nh, nkv, T, S, hd = 3, 6, 2, 4, 11, 8
    q, k, v = torch.randn(B, nh, T, hd), torch.randn(B, nkv, S, hd), torch.randn(B, nkv, S, hd)
    vis = torch.rand(B, T, S) < 0.6
    vis[..., 0] = True
    mask = torch.zeros(B, 1, T, S).masked_fill(~vis[:, None], float("-inf"))
    mod = torch.nn.Module()
    mod.num_key_value_groups, mod.is_causal, mod.training = nh // nkv, True, False
    ref, _ = sdpa_attention_forward(mod, q, k, v, mask, scaling=0.3)
    out, _ = _gqa_sdpa(mod, q, k, v, mask, scaling=0.3)
    assert out.shape == (B, T, nh, hd)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_a_proposer_shared_by_two_decoders_is_reallocated_for_each(tiny_llama):
    """One drafter behind two Decoders (evaluate's and a benchmark's): the second one's smaller
    caches replaced the drafter's, and the first Decoder, which still believed them its own,
    failed on a tree step ("expanded size 512 must match 256", decode_speed --profile on the
    H200), or with CUDA graphs would have replayed onto freed buffers. Each Decoder now
    reallocates the drafter when another one did, and the tokens stay the plain ones."""
    t = tiny_llama
    cfg = t["model"].config
    P = EagleDraft(_tiny_drafter(cfg, Vd=cfg.vocab_size))
    tree = TreeSpec(3, 2, 5)
    big = Decoder(t["model"], max_batch=3, span_bucket=8)
    small = Decoder(t["model"], max_batch=1, span_bucket=8)
    big.generate(t["prompts"], 3 * MAX_NEW, proposer=P, tree=tree)
    small.generate(t["prompts"][1:2], 2, proposer=P, tree=tree)   # 9 tokens: fewer slots, 1 row
    assert P.kc.shape[0] == 1
    outs = big.generate(t["prompts"], 3 * MAX_NEW, proposer=P, tree=tree)
    assert P.kc.shape[0] == 3 and P.kc.shape[2] == big.cap[1]
    assert [o.tokens for o in outs] == [o.tokens for o in t["plain"]]


def test_slot_cache_moves_every_pooled_layer_in_one_gather_and_scatter():
    """copy_slots (a tree step's accepted nodes to their final slots) gives what a loop over the
    layers gives; the layers of the pooled (heads, dim) share one pool per store, so it costs 2
    kernels per store for all of them, plus 2 per store for each layer of another shape (an MLA
    latent, say), whatever the number of layers."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from drafter.decoding.static import _slot_cache_class

    g = torch.Generator().manual_seed(0)
    SlotCache = _slot_cache_class()
    shapes = [(2, 4)] * 5 + [(1, 6)]                        # five standard layers, one other
    cache = SlotCache(max_batch=3, max_slots=10, num_layers=6, pooled=(2, 4))
    cache.slots = torch.arange(10).expand(2, 10)             # batch 2 fills every slot
    for i, (h, d) in enumerate(shapes):
        k, v = (torch.randn(2, h, 10, d, generator=g) for _ in range(2))
        cache.update(k, v, i)
    assert len(cache.pools) == 2                             # one for the keys, one for values
    assert cache.k[0]._base is cache.pools[id(cache.k)] and cache.k[5]._base is None
    before = {(n, i): b.clone() for n, s in (("k", cache.k), ("v", cache.v)) for i, b in s.items()}
    src, dst = torch.tensor([[7, 3], [2, 9]]), torch.tensor([[4, 5], [6, 7]])

    class Kernels(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket).split(".")[-1]
            Kernels.n += name in ("gather", "scatter_", "scatter")
            return func(*args, **(kwargs or {}))

    with Kernels():
        cache.copy_slots(src, dst)
    assert Kernels.n == 2 * 2 + 2 * 2 * 1                   # pools: 2 per store; the other: 2x2
    for (n, i), ref in before.items():
        for b in range(2):
            ref[b, :, dst[b]] = ref[b, :, src[b]].clone()
        assert torch.equal((cache.k if n == "k" else cache.v)[i], ref), (n, i)
    pool_bytes = 2 * 6 * 3 * 2 * 10 * 4 * 4                  # k and v pools (6 slices, float32)
    assert cache.nbytes() == pool_bytes + 2 * 3 * 1 * 10 * 6 * 4


def test_prefills_run_without_cudnn_attention_and_steps_with_it(tiny_llama):
    """cuDNN attention builds a plan per new shape (about 195 ms on the H200): the eager
    prefills, one shape per prompt length, run SDPA without it, so that evaluate's prefill
    seconds no longer depend on which method met a prompt length first; the steps (fixed
    shapes, captured on a GPU) keep it; the tokens are the same."""
    t = tiny_llama
    cfg = t["model"].config
    P = EagleDraft(_tiny_drafter(cfg, Vd=cfg.vocab_size))
    dec = Decoder(t["model"], max_batch=3, span_bucket=8)
    seen = {"target": [], "drafter": []}
    fwd, obs = dec.target.forward, P.observe

    def target(ids, *a, **kw):
        seen["target"].append((ids.shape[1], torch.backends.cuda.cudnn_sdp_enabled()))
        return fwd(ids, *a, **kw)

    def observe(*a, **kw):
        seen["drafter"].append(torch.backends.cuda.cudnn_sdp_enabled())
        return obs(*a, **kw)
    dec.target.forward, P.observe = target, observe
    assert torch.backends.cuda.cudnn_sdp_enabled()
    outs = dec.generate(t["prompts"], 3 * MAX_NEW, proposer=P, tree=TreeSpec.chain(2))
    assert [o.tokens for o in outs] == [o.tokens for o in t["plain"]]
    prefill = [on for T, on in seen["target"] if T == 23]            # the longest prompt's
    steps = [on for T, on in seen["target"] if T == 3]               # verification: K + 1
    assert prefill == [False] and steps and all(steps)
    assert seen["drafter"][:2] == [False, False] and all(seen["drafter"][2:])
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_a_forward_folds_its_mask_for_the_grouped_heads_once(tiny_llama):
    """The mask's rows repeated for the g query heads of a KV head (a copy when T > 1) are made
    by the first layer of a forward and reused by the others (a copy a layer before: 30 kernels
    of a SmolLM2 verification); the next forward, with a new mask, makes its own."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from drafter.decoding.static import StaticTarget

    model = tiny_llama["model"]
    c = model.config
    g, n_layers = c.num_attention_heads // c.num_key_value_heads, c.num_hidden_layers
    assert g > 1 and n_layers > 1
    tgt = StaticTarget(model)
    tgt.allocate(2, 16)
    B, T, S = 2, 3, 16

    class Folds(TorchDispatchMode):  # ops whose output has the folded mask's shape
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and tuple(out.shape) == (B, 1, g * T, S):
                Folds.n += 1
            return out

    def forward(ids):
        slots = (4 + torch.arange(T)).expand(B, T)
        vis = torch.arange(S)[None, None] <= slots[..., None]
        return tgt.forward(ids, slots, slots, vis, torch.zeros(B, dtype=torch.long))[0]

    ids = torch.randint(3, 100, (B, T))
    with torch.no_grad(), Folds():
        one = forward(ids)
    per_forward = Folds.n
    assert 1 <= per_forward < n_layers
    with torch.no_grad(), Folds():
        two = forward(ids)
    assert Folds.n == 2 * per_forward
    torch.testing.assert_close(one, two)


def test_shape_acceptance_on_a_hand_made_step():
    """Six nodes of a (3, 2, 6) tree, ranked by score, the path 1 -> 5 -> 6 accepted; a depth-3
    node of the other branch (4) outranks path node 5, which counts at depth 3 but not at depth
    2; a second row accepted nothing."""
    from drafter.decoding.tree import shape_acceptance

    #                  node  1  2  3  4  5  6     (2 -> 3 -> 4 and 1 -> 5 -> 6)
    depth = torch.tensor([[1, 1, 2, 3, 2, 3]] * 2)
    rank = torch.tensor([[0, 1, 2, 3, 4, 5]] * 2)
    path = torch.tensor([[0, 1, 5, 6], [0, 0, 0, 0]])
    acc, valid = shape_acceptance(rank, depth, path, torch.tensor([3, 0]))
    assert (acc * valid)[0].tolist() == [[1, 1, 0, 0, 0, 0],     # D'=1: nodes 1, 2
                                         [1, 1, 1, 2, 0, 0],     # D'=2: 1, 2, 3, then 5
                                         [1, 1, 1, 1, 2, 3]]     # D'=3: 4 outranks 5
    assert valid[0].tolist() == [[True] * 2 + [False] * 4, [True] * 4 + [False] * 2,
                                 [True] * 6]
    assert acc[1].sum() == 0 and valid[1].tolist() == valid[0].tolist()


def test_tree_stats_give_what_a_smaller_tree_accepts(tiny_llama):
    """tree_stats on a (3, 2, 6) tree: for every smaller (depth D', N' nodes) tree of the same
    topk that its step can stand for, the count it gives is what that tree's own first step
    accepts, from the same state (shuffled drafter: any sibling accepted). Two new tokens: the
    prefill's and one step's."""
    t = tiny_llama
    V = t["model"].config.vocab_size
    torch.manual_seed(1)
    prompts = [torch.randint(3, 1000, (int(n),)).tolist() for n in torch.randint(4, 24, (12,))]
    dec = Decoder(t["model"], max_batch=len(prompts))  # RefDrafter reads its rows by batch row
    P = RefDrafter(_ref(prompts, dec.generate(prompts, 8)), V, "shuffled")
    big = TreeSpec(3, 2, 6)
    first = dec.generate(prompts, 2, proposer=P, tree=big, tree_stats=True)
    checked = differ = 0
    for d in range(1, 4):
        for n in range(1, TreeSpec(d, 2, 6).nodes + 1):
            small = dec.generate(prompts, 2, proposer=P, tree=TreeSpec(d, 2, n))
            for o, s in zip(first, small):
                accepted, valid = o.shapes[0][d - 1][n - 1], o.shapes[1][d - 1][n - 1]
                a = next(i for i, c in enumerate(s.hist) if c)      # its one step's
                if valid:
                    assert accepted == a, (d, n)
                    checked += 1
                    differ += a != next(i for i, c in enumerate(o.hist) if c)
    assert checked >= 100 and differ >= 10
    # over whole answers: every step counts once for the full tree and as it accepted
    P = RefDrafter(t["ref"], V, "shuffled")
    outs = t["dec"].generate(t["prompts"], 3 * MAX_NEW, proposer=P, tree=big, tree_stats=True)
    assert [o.tokens for o in outs] == [o.tokens for o in t["plain"]]
    for o in outs:
        assert o.shapes[1][2][5] == o.steps == sum(o.hist)
        assert o.shapes[0][2][5] == sum(a * c for a, c in enumerate(o.hist))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3", "gemma2"])
def test_folded_verification_gives_the_same_tokens_and_logits(arch, tmp_path):
    """StaticTarget(fold=True) (the default on a GPU, off on the CPU): a batch-1 forward over T
    tokens as T rows of one token gives the unfolded forward's logits and aux states, and a
    batch-1 chain and tree decode the plain tokens (GQA, MLA + MoE; Gemma 2's sliding windows
    are never folded)."""
    from transformers import AutoModelForCausalLM

    from drafter.decoding.static import StaticTarget

    model = AutoModelForCausalLM.from_pretrained(make_tiny(arch, tmp_path),
                                                 dtype=torch.float32).eval()
    torch.manual_seed(0)
    n = model.config.num_hidden_layers
    outs = {}
    ids = torch.randint(3, 1000, (1, 20))
    for fold in (False, True):
        tgt = StaticTarget(model, fold=fold)
        tgt.allocate(1, 64)
        tgt.set_aux([1, n // 2, n])
        with torch.no_grad():
            s = torch.arange(20)
            vis = (s[None] <= s[:, None])[None]                                # causal [1, T, S]
            tgt.forward(ids[:, :12], s[None, :12], s[None, :12], vis[:, :12, :20],
                        torch.zeros(1, dtype=torch.long))
            shapes, fwd = [], model.forward
            model.forward = lambda *a, **kw: (shapes.append(tuple(kw["input_ids"].shape)),
                                              fwd(*a, **kw))[1]
            outs[fold] = tgt.forward(ids[:, 12:], s[None, 12:], s[None, 12:], vis[:, 12:],
                                     torch.zeros(1, dtype=torch.long))
            del model.forward
        window = getattr(model.config, "sliding_window", None) and arch == "gemma2"
        assert shapes == [(8, 1) if fold and not window else (1, 8)]
    torch.testing.assert_close(outs[True][0], outs[False][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[True][1], outs[False][1], atol=1e-4, rtol=1e-4)
    prompts = [torch.randint(3, 1000, (n,)).tolist() for n in (30, 17)]
    assert StaticTarget(model).fold is False and Decoder(model).target.fold is False  # CPU
    dec = Decoder(model, max_batch=1, fold=True)
    plain = dec.generate(prompts, 12)
    P = RefDrafter(_ref(prompts, plain), model.config.vocab_size, "noisy")
    for tree in (TreeSpec.chain(3), TreeSpec(3, 2, 5)):
        spec = []
        for p in prompts:   # one prompt a batch: RefDrafter reads its reference by batch row
            P.ref = _ref([p], [plain[prompts.index(p)]])
            spec += dec.generate([p], 12, proposer=P, tree=tree)
        assert [o.tokens for o in spec] == [o.tokens for o in plain]
        assert sum(sum(o.hist[1:]) for o in spec) > 0          # drafts were accepted
