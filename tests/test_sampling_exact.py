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

from drafter.decoding import decode, rejection
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


def draws(model, proposer=None, tree=None, seed=0, graphs=False) -> torch.Tensor:
    """The first three new tokens of N_DRAWS copies of PROMPT, one batch: [N_DRAWS, 3]."""
    # one step between two reads of the state: the rows are done after one step or two
    dec = Decoder(model, max_batch=N_DRAWS, cuda_graphs=graphs, span_bucket=16, sync_every=1)
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


def planted(fn, *edits: tuple[str, str]):
    """`fn` (a function of drafter.decoding.rejection) with each source text `old` of `edits`
    replaced by its `new`."""
    src = textwrap.dedent(inspect.getsource(fn))
    for old, new in edits:
        assert src.count(old) == 1, f"{fn.__name__} no longer reads {old!r}: update the plant"
        src = src.replace(old, new)
    ns = dict(vars(rejection))
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
