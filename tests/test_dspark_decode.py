"""Block drafters in evaluate's decoder (drafter/decoding/dspark.py): a DSpark and a DFlash
drafter trained briefly through train.fit on a tiny random target, their decoder block against
the reference block (DSpark.draft), lossless greedy decoding in static and continuous batches
with the same acceptance at batch 1 and batched, an oracle block drafter at τ = K+1, the
confidence head's records and cuts, and a random DSpark on SmolLM2. CPU, float32. The
chi-square exactness of sampling is tests/test_sampling_exact.py's."""
from __future__ import annotations

import pytest
import torch

from drafter.core import config as C
from drafter.core.dist import Dist
from drafter.core.rundir import Run
from drafter.decoding.decode import Decoder, TreeSpec, acceptance_stats
from drafter.decoding.dspark import (
    CUTS,
    STAT_ROWS,
    DSparkDraft,
    calibration,
    cut_counts,
    proposer_for,
)
from drafter.decoding.tree import EagleDraft
from drafter.steps import train
from drafter.train import batches

K = 4  # the drafters' block
VOCAB = 512

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny random Llama target (vocab 512, the draft vocab all of it) whose layers write
    nothing into the residual stream (o_proj and down_proj zero: its next token is a function
    of the last one, so that a drafter trained for seconds has something to learn; its hidden
    states, the drafter's context, are still per position); {method: a DSpark / DFlash drafter
    trained through train.fit on its greedy continuations of random prompts}; held-out
    prompts and their plain greedy continuations."""
    from drafter.core import target
    from drafter.features.capture import Capture
    from tests.tiny import make_tiny

    root = tmp_path_factory.mktemp("dspark-world")
    tdir = make_tiny("llama", root, vocab_size=VOCAB, num_hidden_layers=4, initializer_range=0.5)
    model = target.load_model(C.TargetConfig(model=str(tdir)), device="cpu")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    g = torch.Generator().manual_seed(0)
    heads = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist()
             for n in torch.randint(5, 13, (36,), generator=g)]
    conts = Decoder(model, max_batch=36).generate(heads, 24)
    rows = [{"id": f"r{i}", "input_ids": h + o.tokens, "loss_mask": [0] * len(h) + [1] * 24}
            for i, (h, o) in enumerate(zip(heads, conts))]
    d2t, t2d = torch.zeros(VOCAB, dtype=torch.long), torch.ones(VOCAB, dtype=torch.bool)
    cap = Capture(model, None, d2t, t2d, teacher="hidden", layer_count=3)
    samples = cap(rows[:30])
    out = {}
    for method in ("dspark", "dflash"):
        d = tmp_path_factory.mktemp(method)
        cfg = C.load(None, [f"run_dir={d}", f"target.model={tdir}", "train.max_length=64",
                            "train.batch_tokens=256", "train.lr=3e-3", "train.warmup_ratio=0.1",
                            "train.log_every=100", "train.eval_every=0", "train.save_every=1000",
                            "train.epochs=10", f"train.method={method}",
                            f"train.dspark.block_size={K}", "train.dspark.layers=2",
                            "train.dspark.anchors=16", "train.dspark.markov_rank=16"])
        dr = train.build_drafter(cfg, model.config, cap.layer_ids, d2t, t2d,
                                 model.get_input_embeddings().weight.detach(), cap.head)
        train.fit(cfg, Run.of(cfg), Dist(), dr, batches.Source.memory(samples), None, cap.head)
        out[method] = dr.eval()
    prompts = heads[30:]
    plain = Decoder(model, max_batch=6).generate(prompts, 24)
    return {"model": model, "drafters": out, "prompts": prompts, "plain": plain}


class Recorded(DSparkDraft):
    """The drafts of every step, as the decoder drew them."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = []

    def draft(self, anchor, L, start, span, k, temperature):
        out = super().draft(anchor, L, start, span, k, temperature)
        self.calls.append((anchor.clone(), (L - start).clone(), *out))
        return out


@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_the_decoders_block_is_the_reference_block(trained, method):
    """The first step's block in the decoder (two left-padded rows, the prompt's context from
    the prefill's cache writes, the block's keys in scratch slots) equals DSpark.draft over the
    context made from the target's hidden states: the same drafts, logits (Markov bias in) and
    confidences; later steps' contexts come from the verifications' aux states."""
    m, target = trained["drafters"][method], trained["model"]
    prompts = trained["prompts"][:2]
    P = Recorded(m)
    Decoder(target, max_batch=2).generate(prompts, 3 * K, proposer=P, tree=TreeSpec.chain(K))
    assert len(P.calls) >= 2
    t_ids = P.t_ids
    for step, (anchor, apos, ids, z, _, conf) in enumerate(P.calls[:3]):
        for b in range(2):
            seq = prompts[b] if step == 0 else None
            if seq is None:  # later steps: the committed tokens up to the anchor, from the plain
                n = int(apos[b])  # run (greedy speculative decoding commits the same tokens)
                seq = (prompts[b] + trained["plain"][b].tokens)[:n]
            with torch.no_grad():
                hs = target(torch.tensor([seq]), output_hidden_states=True).hidden_states
                aux = torch.stack([hs[k] for k in m.cfg.target_layer_ids], 2)    # [1, P, A, Ht]
                ctx = m.context(m.fuse(aux), torch.arange(len(seq))[None])
                ref = m.draft(ctx, torch.tensor([len(seq)]), anchor[b:b + 1],
                              torch.tensor([len(seq)]))
            assert int(apos[b]) == len(seq)
            assert torch.equal(ref["ids"][0], t_ids[ids[b]]), (method, step, b)
            torch.testing.assert_close(ref["logits"][0], z[b], atol=2e-4, rtol=1e-4)
            if method == "dspark":
                torch.testing.assert_close(ref["confidence"][0], conf[b], atol=1e-5, rtol=1e-5)
            else:
                assert conf is None and ref["confidence"] is None


@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_block_drafters_are_lossless_batched_and_continuous(trained, method):
    """Greedy block decoding equals plain greedy decoding, token for token: in static batches
    of 3 (left-padded rows of other lengths), continuous batching over 6 prompts in 3 rows, and
    one prompt at a time; each prompt accepts the same drafts at every step either way (τ
    equal at batch 1 and batched); the trained drafter's drafts are accepted."""
    m, target = trained["drafters"][method], trained["model"]
    prompts, plain = trained["prompts"], trained["plain"]
    P = proposer_for(m)
    assert isinstance(P, DSparkDraft) and P.block_size == K
    res = {}
    for batch, continuous in ((3, False), (3, True), (1, False)):
        outs = Decoder(target, max_batch=batch).generate(
            prompts, 24, proposer=P, tree=TreeSpec.chain(K), continuous=continuous)
        assert [o.tokens for o in outs] == [o.tokens for o in plain], (batch, continuous)
        res[(batch, continuous)] = [(o.hist, o.steps) for o in outs]
    assert res[(3, False)] == res[(3, True)] == res[(1, False)]
    hist = [sum(h[a] for h, _ in res[(1, False)]) for a in range(K + 1)]
    assert acceptance_stats(hist)["tau"] > 1.15 and hist[0] > 0 and sum(hist[2:]) > 0, hist
    # a shorter chain of the same block: the first k drafts, still lossless
    outs = Decoder(target, max_batch=3).generate(prompts, 24, proposer=P, tree=TreeSpec.chain(2))
    assert [o.tokens for o in outs] == [o.tokens for o in plain]
    assert all(len(o.hist) == 3 for o in outs)


class Oracle(DSparkDraft):
    """A block drafter whose drafts are the plain run's tokens (oracle) or never are (wrong):
    the real block forward runs, its drafts replaced; `assign` follows continuous batching."""

    def __init__(self, model, ref, mode, cut=None):
        super().__init__(model, cut)
        self.ref, self.mode = ref, mode
        self.owner = torch.arange(ref.shape[0])

    def assign(self, rows, prompts):
        self.owner[torch.as_tensor(rows)] = torch.as_tensor(prompts)

    def draft(self, anchor, L, start, span, k, temperature):
        _, z, lse, conf = super().draft(anchor, L, start, span, k, temperature)
        pos = (L - start)[:, None] + 1 + torch.arange(k)                      # [B, k]
        B = anchor.shape[0]
        right = self.ref[self.owner[:B, None], pos.clamp(max=self.ref.shape[1] - 1)]
        z = torch.zeros_like(z).scatter(-1, right[..., None],   # (the draft vocab: all)
                                        10.0 if self.mode == "oracle" else -torch.inf)
        return z.argmax(-1), z, lse, conf


def test_an_oracle_block_drafter_reaches_k_plus_1(trained):
    """Drafts that are always the target's tokens: every step accepts all K (τ = K+1), static
    and continuous; never: none (τ = 1); with a confidence cut that no draft passes (product >=
    1): each row verifies none, τ = 1, the tokens still the plain ones."""
    m, target = trained["drafters"]["dspark"], trained["model"]
    prompts = trained["prompts"]
    new = 1 + 4 * (K + 1)          # the prefill's token, then 4 full steps
    plain = Decoder(target, max_batch=5).generate(prompts, new + K + 2)
    R = max(len(p) + len(o.tokens) for p, o in zip(prompts, plain))
    ref = torch.zeros(len(prompts), R, dtype=torch.long)
    for b, (p, o) in enumerate(zip(prompts, plain)):
        ref[b, :len(p) + len(o.tokens)] = torch.tensor(p + o.tokens)
    for mode, cut, tau in (("oracle", None, K + 1), ("wrong", None, 1.0), ("oracle", 1.0, 1.0)):
        for continuous in (False, True):
            outs = Decoder(target, max_batch=3).generate(
                prompts, new, proposer=Oracle(m, ref, mode, cut), tree=TreeSpec.chain(K),
                continuous=continuous)
            assert [o.tokens for o in outs] == [o.tokens[:new] for o in plain]
            for o in outs:
                assert acceptance_stats(o.hist)["tau"] == tau, (mode, cut, o.hist)


def test_confidence_records_and_cuts(trained):
    """The confidence head's records: per position the tests and acceptances are the
    histogram's; the counts of a cut at each threshold are what a run with that cut accepts
    (one step a prompt: the same steps), and a cut run is lossless."""
    m, target = trained["drafters"]["dspark"], trained["model"]
    prompts, plain = trained["prompts"], trained["plain"]
    dec = Decoder(target, max_batch=5)
    outs = dec.generate(prompts, 24, proposer=DSparkDraft(m), tree=TreeSpec.chain(K))
    hist = [sum(o.hist[a] for o in outs) for a in range(K + 1)]
    st = acceptance_stats(hist)
    cal = calibration(_summed(outs), st["steps"])
    assert cal["tested"][0] == st["steps"]
    assert cal["measured"] == pytest.approx(st["acceptance_conditional"])
    assert cal["measured_unconditional"] == pytest.approx(st["acceptance"])
    assert all(0 < p < 1 for p in cal["predicted"] if p is not None)
    # one speculative step a prompt: the cuts' counts against runs with those cuts
    one = dec.generate(prompts, 2, proposer=DSparkDraft(m), tree=TreeSpec.chain(K))
    cuts = cut_counts(_summed(one))
    assert cuts["thresholds"] == list(CUTS)
    for c, acc, ver in zip(CUTS, cuts["accepted"], cuts["verified"]):
        got = dec.generate(prompts, 2, proposer=DSparkDraft(m, cut=c), tree=TreeSpec.chain(K))
        assert acc[K - 1] == sum(a * n for o in got for a, n in enumerate(o.hist)), c
        assert all(x <= y for x, y in zip(acc, ver)) and ver == sorted(ver)
        assert all(o.stats[STAT_ROWS][0] == 0 for o in got)    # a cut run counts no cuts
    # lossless with a cut, over whole answers
    got = dec.generate(prompts, 24, proposer=DSparkDraft(m, cut=0.5), tree=TreeSpec.chain(K))
    assert [o.tokens for o in got] == [o.tokens for o in plain]


def _summed(outs) -> list:
    return [[sum(o.stats[r][i] for o in outs) for i in range(K)]
            for r in range(len(outs[0].stats))]


def test_a_cut_needs_a_confidence_head(trained):
    from drafter.decoding.tree import DecodeError

    with pytest.raises(DecodeError, match="confidence head"):
        DSparkDraft(trained["drafters"]["dflash"], cut=0.5)
    assert DSparkDraft(trained["drafters"]["dflash"]).stats_shape(K) is None


def test_the_float32_recheck_decodes_a_block_drafter(trained):
    """measure.lossless's recheck of a 16-bit mismatch decodes a block drafter with its own
    step (and its cut): planted mismatches whose float32 decodings agree become drift."""
    from drafter.measure.lossless import recheck_float32

    m, target = trained["drafters"]["dspark"], trained["model"]
    checks = [{"ids": p, "drafter": m, "tree": TreeSpec.chain(K), "cut": cut,
               "divergence": {"verdict": "mismatch"}}
              for p, cut in zip(trained["prompts"][:2], (None, 0.5))]
    assert recheck_float32(target, checks, 12, []) == 2
    assert all(c["divergence"] == {"verdict": "drift", "float32": {"verdict": "identical"}}
               for c in checks)


def _smol_dspark(tc, seed=0):
    """A random DSpark drafter of SmolLM2's shape (one layer) over a draft vocab of 2048 ids,
    the target's embeddings, block 3, a Markov head and a confidence head."""
    from drafter.core.target import default_block_layer_ids
    from drafter.train.dspark import DSpark, DSparkConfig

    torch.manual_seed(seed)
    cfg = DSparkConfig.from_target(tc, "dspark", 2048, default_block_layer_ids(30, 3), 3,
                                   tc.vocab_size - 1, layers=1, markov_rank=16,
                                   confidence_head=True, intermediate_size=256)
    dr = DSpark(cfg)
    sel = torch.randperm(tc.vocab_size)[:2048].sort().values
    t2d = torch.zeros(tc.vocab_size, dtype=torch.bool)
    t2d[sel] = True
    dr.set_vocab(sel - torch.arange(2048), t2d)
    return dr


def test_a_random_dspark_on_smollm2_is_lossless(smollm2_dir):
    """The embedded SmolLM2 (30 layers, GQA, a real vocab) with a random DSpark drafter of its
    shape: greedy tokens equal plain greedy decoding, continuous batching too; sampling runs
    within its limits; an EAGLE-3 Drafter still gets EagleDraft."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafter.train.model import Drafter, DrafterConfig

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tc = model.config
    dr = _smol_dspark(tc)
    dr.set_embeddings(model.get_input_embeddings().weight.detach())
    msgs = ["Write a python function that adds two numbers.", "What is 2+3?", "Say hi."]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": x}],
                                           add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for x in msgs]
    stop = [tok.eos_token_id]
    dec = Decoder(model, max_batch=2)
    plain = dec.generate(prompts, 10, stop_ids=stop)
    P = proposer_for(dr)
    for continuous in (False, True):
        outs = dec.generate(prompts, 10, stop_ids=stop, proposer=P, tree=TreeSpec.chain(3),
                            continuous=continuous)
        assert [o.tokens for o in outs] == [o.tokens for o in plain]
        assert all(sum(o.hist) == o.steps for o in outs)
    torch.manual_seed(0)
    for o in dec.generate(prompts, 6, stop_ids=stop, proposer=P, tree=TreeSpec.chain(3),
                          temperature=0.8):
        assert 1 <= len(o.tokens) <= 6 and (o.finish == "stop") == (o.tokens[-1] == stop[0])
    eagle = Drafter(DrafterConfig.from_target(tc, 2048, [2, 15, 27], intermediate_size=256))
    assert isinstance(proposer_for(eagle), EagleDraft)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_block_steps_in_cuda_graphs_give_the_eager_tokens(smollm2_dir):
    """On a GPU (float32, so that eager and graph runs compare token for token): the block
    step captured in CUDA graphs (and its prefill's context writes) gives the eager tokens and
    acceptance, with and without a confidence cut; sampled steps replay too, and graphs are
    really used. `pytest -m gpu tests/test_dspark_decode.py`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).cuda().eval()
    dr = _smol_dspark(model.config)
    dr.set_embeddings(model.get_input_embeddings().weight.detach())
    torch.manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,)).tolist() for n in (40, 300, 7)]
    eager, graphed = Decoder(model, max_batch=3, cuda_graphs=False), \
        Decoder(model, max_batch=3, cuda_graphs=True)
    plain = eager.generate(prompts, 40)
    for cut in (None, 0.3):
        want = eager.generate(prompts, 40, proposer=DSparkDraft(dr, cut), tree=TreeSpec.chain(3))
        got = graphed.generate(prompts, 40, proposer=DSparkDraft(dr, cut), tree=TreeSpec.chain(3))
        assert [o.tokens for o in got] == [o.tokens for o in want] == [o.tokens for o in plain]
        assert [(o.hist, o.stats) for o in got] == [(o.hist, o.stats) for o in want]
    assert graphed.graphs.enabled and graphed.graphs.graphs, "graph capture fell back to eager"
    outs = graphed.generate(prompts, 16, proposer=DSparkDraft(dr), tree=TreeSpec.chain(3),
                            temperature=0.8)
    assert all(1 <= len(o.tokens) <= 16 for o in outs) and graphed.graphs.enabled


def test_settings_a_block_drafter_cannot_run_are_refused_before_decoding(trained):
    from drafter.decoding.block import verify_chain_block
    from drafter.decoding.tree import DecodeError

    m, target = trained["drafters"]["dspark"], trained["model"]
    dec, p = Decoder(target, max_batch=2), trained["prompts"][:2]
    with pytest.raises(DecodeError, match="drafts a chain, not a tree"):
        dec.generate(p, 4, proposer=DSparkDraft(m), tree=TreeSpec(2, 2, 3))
    with pytest.raises(DecodeError, match=f"drafts {K} tokens a block"):
        dec.generate(p, 4, proposer=DSparkDraft(m), tree=TreeSpec.chain(K + 1))
    dec.chain_verify = verify_chain_block
    with pytest.raises(DecodeError, match="block verification tests a whole chain"):
        dec.generate(p, 4, proposer=DSparkDraft(m, cut=0.5), tree=TreeSpec.chain(K),
                     temperature=1.0)
