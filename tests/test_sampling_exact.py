"""Speculative sampling is exact in distribution, through the real decoder: a tiny float32 Llama
target on the CPU and a drafter whose distribution differs from it, many copies of one prompt
decoded in one batch, each copy's first three tokens (the prefill's token, then the speculative
steps') counted and set against the target's exact joint distribution of three tokens (its own
softmax at the temperature, from one forward over every continuation). Plain sampling, a chain
(Decoder._chain_step, tree.verify_chain_sample) and a tree with siblings (Decoder._spec_step,
tree.build_tree, tree.verify_sample, both walking rejection.walk_torch here) must pass a
chi-square test whose threshold is computed for the cells' degrees of freedom; and the same test
must fail on planted bugs: each is the real function with one thing wrong (a residual not
renormalised, siblings verified as if drawn with replacement, the acceptance min(1, p/q) read
from the wrong rows, a rejection that does not take the residual), put in place of the real one
for one decoding. On a GPU (`pytest -m gpu`) the same check runs the compiled walk kernel.
"""
from __future__ import annotations

import inspect
import math
import textwrap

import pytest
import torch

from drafter.decoding import block, decode, rejection
from drafter.decoding.decode import Decoder, TreeSpec

pytestmark = pytest.mark.usefixtures("one_thread")

V = 6                             # the target's vocab
T_IDS = [0, 1, 3, 5]              # the draft vocab's target ids (d2t): tokens 2 and 4 undraftable
N_DRAWS = 60_000                  # copies of the prompt, decoded as one batch
TEMPERATURE = 0.8
PROMPT = [1, 4, 2]
ALPHA = 1e-4                      # the test's false-alarm rate on the real code
CHAIN, TREE = TreeSpec.chain(2), TreeSpec(2, 2, 3)   # the tree: 2 children of the root, 1 below


class TableDrafter:
    """A drafter whose logits over the draft vocab depend on the last token alone (a table
    [V, Vd]), far from the target's: DraftModel's interface, no cache."""
    aux_layer_ids = None
    rows = None

    def __init__(self, table: torch.Tensor):
        self.table, self.vocab_size = table, table.shape[1]
        self.t_ids = torch.tensor(T_IDS)

    def allocate(self, *args):
        pass

    def to_target(self, ids):
        return self.t_ids[ids]

    def observe(self, ids, aux, pos, slots, vis, last):
        return None if last is None else self.table[ids.gather(1, last[:, None]).squeeze(1)]

    def score(self, depth, ids, parent, pos, slots, vis):
        return self.table[ids]                                                    # [B, k, Vd]


@pytest.fixture(scope="module")
def pair():
    """The target (a 1-layer Llama of vocab V, its head scaled so that its distributions are
    peaked and depend on the tokens before), the drafter, and the target's exact joint
    distribution of the first three new tokens at TEMPERATURE [V, V, V]."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    table = 2.0 * torch.randn(V, len(T_IDS))
    seqs = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])      # [V², 5]
    with torch.no_grad():
        lg = model(seqs).logits[:, len(PROMPT) - 1:].float()                      # [V², 3, V]
    p = torch.softmax(lg.double() / TEMPERATURE, -1).view(V, V, 3, V)
    joint = p[0, 0, 0][:, None, None] * p[:, 0, 1][:, :, None] * p[:, :, 2]      # [a, b, c]
    return model, TableDrafter(table), joint


def draws(model, proposer=None, tree=None, seed=0, graphs=False, verify=None) -> torch.Tensor:
    """The first three new tokens of N_DRAWS copies of PROMPT, one batch: [N_DRAWS, 3]. verify:
    the chain's sampled verification (Decoder.chain_verify; None: the standard one)."""
    # one step between two reads of the state: the rows are done after one step or two
    dec = Decoder(model, max_batch=N_DRAWS, cuda_graphs=graphs, span_bucket=16, sync_every=1)
    dec.chain_verify = verify
    torch.manual_seed(seed)
    outs = dec.generate([PROMPT] * N_DRAWS, 3, temperature=TEMPERATURE, proposer=proposer,
                        tree=tree)
    assert all(len(o.tokens) == 3 for o in outs)
    return torch.tensor([o.tokens for o in outs])


def chi_square(tokens: torch.Tensor, joint: torch.Tensor) -> tuple[float, float]:
    """Pearson's chi-square of the counts of (t1, t2, t3) against N_DRAWS x joint, cells
    expected below 5 pooled into one, and the threshold the real code must stay under: the
    chi-square quantile 1 - ALPHA for the cells' degrees of freedom (Wilson-Hilferty)."""
    obs = torch.bincount(tokens[:, 0] * V * V + tokens[:, 1] * V + tokens[:, 2],
                         minlength=V ** 3).double()
    exp = joint.flatten() * N_DRAWS
    big = exp >= 5
    o, e = obs[big], exp[big]
    if (~big).any():
        o, e = torch.cat([o, obs[~big].sum()[None]]), torch.cat([e, exp[~big].sum()[None]])
    stat = ((o - e) ** 2 / e).sum().item()
    df = len(e) - 1
    z = math.sqrt(2) * torch.special.erfinv(torch.tensor(1 - 2 * ALPHA, dtype=torch.float64))
    h = 2 / (9 * df)
    return stat, df * (1 - h + z.item() * math.sqrt(h)) ** 3


def planted(fn, *edits: tuple[str, str], module=rejection):
    """`fn` (a function of drafter.decoding.rejection, or of `module`) with each source text
    `old` of `edits` replaced by its `new`."""
    src = textwrap.dedent(inspect.getsource(fn))
    for old, new in edits:
        assert src.count(old) == 1, f"{fn.__name__} no longer reads {old!r}: update the plant"
        src = src.replace(old, new)
    ns = dict(vars(module))
    exec(compile(src, f"<{fn.__name__}, planted>", "exec"), ns)
    return ns[fn.__name__]


# Each bug as a replacement of a function the decoder calls: (name, tree, module, attribute,
# the replacement). The walk (rejection.walk_torch, both verifiers' arithmetic on the CPU) keeps
# a node's residual as max(0, p0 - lam q0) / G and its draft distribution as q0 / Z (its module
# doc): a rejection moves lam, G and Z and sets the drawn token aside.
def _walk(*edits):
    return lambda: planted(rejection.walk_torch, *edits)


# the last token after a rejection drawn from p, not from the residual
_residual_dropped = _walk(("w = (p0 - mu * q0).clamp(min=0)", "w = p0"))
# the residual's new normaliser G not taken: the next sibling's p is norm(..) times s, as
# `res` unnormalised in the direct form
_not_renormalised = _walk(("lam, g = torch.where(upd, lam1, lam), torch.where(upd, g1, g)",
                           "lam = torch.where(upd, lam1, lam)"))
# q kept whole after a rejection (Z stays 1, the drawn token stays in q's support, so its
# mass is neither set aside nor frozen): the siblings verified as if drawn with replacement
_with_replacement = _walk(("z = torch.where(rej, z - qt, z)", "z = z"),
                          ("drawn = drawn | (", "drawn = drawn & ~("),
                          ("f1 = f + (pt - lam1 * qt).clamp(min=0)", "f1 = f"))


def _chain_wrong_rows():
    real = decode.verify_chain_sample
    # p of draft i read at position i + 1: min(1, p/q) with the next position's target row
    return lambda toks, logits, *a, **kw: real(toks, logits.roll(-1, 1), *a, **kw)


def _tree_wrong_rows():
    real = decode.verify_sample
    # every node's q read from the root's row (dist 0): depth 2's acceptance uses the wrong q
    return lambda *a, **kw: real(*a[:7], torch.zeros_like(a[7]), *a[8:], **kw)


PLANTS = [
    ("chain: residual dropped", CHAIN, rejection, "walk_torch", _residual_dropped),
    ("chain: acceptance from the wrong rows", CHAIN, decode, "verify_chain_sample",
     _chain_wrong_rows),
    ("tree: residual not renormalised", TREE, rejection, "walk_torch", _not_renormalised),
    ("tree: siblings drawn with replacement", TREE, rejection, "walk_torch", _with_replacement),
    ("tree: acceptance from the wrong rows", TREE, decode, "verify_sample", _tree_wrong_rows),
]


def test_the_reference_is_a_distribution_the_drafter_does_not_share(pair):
    model, drafter, joint = pair
    assert joint.sum().item() == pytest.approx(1.0, abs=1e-9)
    # peaked enough to have many cells, spread enough that no cell is the whole mass
    assert int((joint * N_DRAWS >= 5).sum()) > 20 and joint.max().item() < 0.5
    # the drafter's distribution after the first token against the target's: far apart (total
    # variation, weighted by the first token's probability), so that drafts are rejected often
    q = torch.zeros(V, V, dtype=torch.float64).index_copy_(
        1, torch.tensor(T_IDS), torch.softmax(drafter.table.double() / TEMPERATURE, -1))
    p1, p12 = joint.sum((1, 2)), joint.sum(2)
    tv = 0.5 * (q - p12 / p1[:, None]).abs().sum(1)
    assert (p1 * tv).sum().item() > 0.2


@pytest.mark.parametrize("method", ["plain", "chain", "tree"])
def test_speculative_sampling_follows_the_target(pair, method):
    model, drafter, joint = pair
    spec = {"plain": None, "chain": CHAIN, "tree": TREE}[method]
    toks = draws(model, drafter if spec else None, spec)
    stat, limit = chi_square(toks, joint)
    assert stat < limit, f"{method}: chi-square {stat:.1f} over {limit:.1f}"
    if spec is not None:  # drafts were accepted and rejected both: both paths ran
        dec = Decoder(model, max_batch=64, cuda_graphs=False, span_bucket=16)
        outs = dec.generate([PROMPT] * 64, 3, temperature=TEMPERATURE, proposer=drafter,
                            tree=spec)
        hist = torch.tensor([o.hist for o in outs]).sum(0)
        assert hist[0] > 0 and hist[1:].sum() > 0


@pytest.mark.parametrize("name,spec,module,attr,make", PLANTS, ids=[p[0] for p in PLANTS])
def test_a_planted_bias_fails_the_test(pair, monkeypatch, name, spec, module, attr, make):
    model, drafter, joint = pair
    monkeypatch.setattr(module, attr, make())
    stat, limit = chi_square(draws(model, drafter, spec), joint)
    assert stat > limit, f"{name}: chi-square {stat:.1f}, not over {limit:.1f}"


# Block verification (drafter.decoding.block, Decoder.chain_verify): the same test at K = 2 and
# 3 (a chain of 3's first step tests h at two inner positions), and three plants, each the real
# block_terms with one thing wrong
def _block(*edits):
    return lambda: planted(block.block_terms, *edits, module=block)


# h_i without the 1 - p_i of its denominator: any residual mass passes the position
_block_h_loose = _block(("den = m + 1.0 - pi", "den = m"))
# the residual max(0, P - Q) without p_i (the standard one at every position)
_block_residual = _block(("r = (p[:, :K, None] * Pd - Q).clamp(min=0.0)",
                          "r = (Pd - Q).clamp(min=0.0)"))
# the last position passed with h_K = 1 instead of p_K
_block_last = _block(("h = torch.cat([h_mid, p[:, K:]], 1)",
                      "h = torch.cat([h_mid, torch.ones_like(p[:, K:])], 1)"))
BLOCK_PLANTS = [("block: h without 1 - p", CHAIN, _block_h_loose),
                ("block: residual without p", CHAIN, _block_residual),
                ("block: last position always passes", CHAIN, _block_last)]


@pytest.mark.parametrize("k", [2, 3])
def test_block_verification_follows_the_target(pair, k):
    model, drafter, joint = pair
    stat, limit = chi_square(draws(model, drafter, TreeSpec.chain(k),
                                   verify=block.verify_chain_block), joint)
    assert stat < limit, f"block K={k}: chi-square {stat:.1f} over {limit:.1f}"


@pytest.mark.parametrize("name,spec,make", BLOCK_PLANTS, ids=[p[0] for p in BLOCK_PLANTS])
def test_a_planted_bias_fails_block_verification(pair, monkeypatch, name, spec, make):
    model, drafter, joint = pair
    monkeypatch.setattr(block, "block_terms", make())
    stat, limit = chi_square(draws(model, drafter, spec, verify=block.verify_chain_block), joint)
    assert stat > limit, f"{name}: chi-square {stat:.1f}, not over {limit:.1f}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["chain", "tree"])
def test_speculative_sampling_follows_the_target_on_the_gpu(pair, method):
    """The chi-square check with the walk compiled by Triton (its own Philox noise for the last
    token) and the steps captured in CUDA graphs."""
    pytest.importorskip("triton")
    model, drafter, joint = pair
    gpu = TableDrafter(drafter.table.cuda())
    gpu.t_ids = gpu.t_ids.cuda()
    spec = {"chain": CHAIN, "tree": TREE}[method]
    stat, limit = chi_square(draws(model.cuda(), gpu, spec, graphs=True).cpu(), joint)
    model.cpu()
    assert stat < limit, f"{method} on the GPU: chi-square {stat:.1f} over {limit:.1f}"


# Block drafters (drafter.decoding.dspark): their own step drafts the chain (one forward, the
# Markov bias left to right, q the biased distribution drawn from) and verifies it as a chain;
# a confidence cut verifies each row's drafts only while the confidences' product holds
def block_drafter(method: str, seed: int = 4):
    """A DSpark (or DFlash) drafter of the pair's target over the draft vocab T_IDS, block 2,
    its weights drawn wide: a distribution far from the target's, a Markov bias that moves it,
    confidences that differ from draft to draft."""
    from drafter.train.dspark import DSpark, DSparkConfig

    dspark_ = method == "dspark"
    cfg = DSparkConfig(method=method, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=V,
                       draft_vocab_size=len(T_IDS), target_hidden_size=16,
                       target_layer_ids=[0, 1], block_size=2, mask_token_id=V - 1,
                       markov_rank=4 if dspark_ else 0, confidence_head=dspark_,
                       anchor_predicts=dspark_)
    torch.manual_seed(seed)
    m = DSpark(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.7)
        if m.markov_head is not None:
            m.markov_head.markov_w2.weight.normal_(0.0, 2.0)
            m.confidence_head.proj.weight.normal_(0.0, 1.5)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[T_IDS] = True
    m.set_vocab(torch.tensor(T_IDS) - torch.arange(len(T_IDS)), t2d)
    return m


BLOCK_CASES = [("dspark", None, None), ("dflash", None, None),
               ("dspark", block.verify_chain_block, None), ("dspark", None, 0.6)]


@pytest.mark.parametrize("method,verify,cut", BLOCK_CASES,
                         ids=["dspark", "dflash", "dspark block verification", "dspark cut"])
def test_block_drafters_sample_the_target(pair, method, verify, cut):
    from drafter.decoding.dspark import DSparkDraft

    model, _, joint = pair
    P = DSparkDraft(block_drafter(method), cut)
    stat, limit = chi_square(draws(model, P, CHAIN, verify=verify), joint)
    assert stat < limit, f"{method}: chi-square {stat:.1f} over {limit:.1f}"
    # drafts accepted and rejected both, and a cut that cuts some rows and not others
    dec = Decoder(model, max_batch=256, cuda_graphs=False, span_bucket=16)
    outs = dec.generate([PROMPT] * 256, 3, temperature=TEMPERATURE, proposer=P, tree=CHAIN)
    hist = torch.tensor([o.hist for o in outs]).sum(0)
    assert hist[0] > 0 and hist[1:].sum() > 0
    if cut is not None:
        tested = torch.tensor([o.stats[1] for o in outs]).sum(0)        # per position
        assert 0 < tested[1] < hist[1:].sum()     # draft 2 reached, tested at some steps only


def _block_bias_dropped():
    from drafter.decoding import dspark

    # q read without the Markov bias: the drafts were drawn from the biased distribution
    return planted(dspark.DSparkDraft.draft, ("zs.append(z)", "zs.append(base[:, i])"),
                   module=dspark)


def _cut_after_the_walk():
    from drafter.decoding import dspark

    # the cut applied to the count of a walk over the whole chain, as greedy decoding may:
    # the last token then comes from a later node, not from p at the cut
    return planted(dspark.DSparkDraft.step, ("live = j[None] < kcut[:, None]",
                                             "live = j[None] < k + 0 * kcut[:, None]"),
                   module=dspark)


DSPARK_PLANTS = [("dspark: q without the Markov bias", "draft", _block_bias_dropped, None),
                 ("dspark: the cut after an uncut walk", "step", _cut_after_the_walk, 0.6)]


@pytest.mark.parametrize("name,attr,make,cut", DSPARK_PLANTS, ids=[p[0] for p in DSPARK_PLANTS])
def test_a_planted_bias_fails_the_block_drafter(pair, monkeypatch, name, attr, make, cut):
    from drafter.decoding.dspark import DSparkDraft

    model, _, joint = pair
    monkeypatch.setattr(DSparkDraft, attr, make())
    stat, limit = chi_square(draws(model, DSparkDraft(block_drafter("dspark"), cut), CHAIN),
                             joint)
    assert stat > limit, f"{name}: chi-square {stat:.1f}, not over {limit:.1f}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cut", [None, 0.6], ids=["dspark", "dspark cut"])
def test_block_drafters_sample_the_target_on_the_gpu(pair, cut):
    """The block drafter's chi-square check with its steps captured in CUDA graphs, the walk
    (a chain, or each row's own up to its cut) and the drafts' Gumbel draws in Triton."""
    pytest.importorskip("triton")
    from drafter.decoding.dspark import DSparkDraft

    model, _, joint = pair
    P = DSparkDraft(block_drafter("dspark"), cut)      # allocate() moves it to the GPU
    stat, limit = chi_square(draws(model.cuda(), P, CHAIN, graphs=True).cpu(), joint)
    model.cpu()
    assert stat < limit, f"block drafter on the GPU: chi-square {stat:.1f} over {limit:.1f}"
