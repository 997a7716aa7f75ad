"""Speculative sampling is exact in distribution, through the real decoder: a tiny float32 Llama
target on the CPU and a drafter whose distribution differs from it, many copies of one prompt
decoded in one batch, each copy's first three tokens (the prefill's token, then the speculative
steps') counted and set against the target's exact joint distribution of three tokens (its own
softmax at the temperature, from one forward over every continuation). Plain sampling, a chain
(Decoder._chain_step, tree.verify_chain_sample) and a tree with siblings (Decoder._spec_step,
tree.build_tree, tree.verify_sample) must pass a chi-square test whose threshold is computed for
the cells' degrees of freedom; and the same test must fail on planted bugs: each is the real
function with one thing wrong (a residual not renormalised, a draft sampled with replacement, the
acceptance min(1, p/q) read from the wrong rows, a rejection that does not take the residual),
put in place of the real one for one decoding.
"""
from __future__ import annotations

import inspect
import math
import textwrap

import pytest
import torch

from drafter.engine import decode, tree as tree_mod
from drafter.engine.decode import Decoder, TreeSpec

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


def draws(model, proposer=None, tree=None, seed=0) -> torch.Tensor:
    """The first three new tokens of N_DRAWS copies of PROMPT, one batch: [N_DRAWS, 3]."""
    # one step between two reads of the state: the rows are done after one step or two
    dec = Decoder(model, max_batch=N_DRAWS, cuda_graphs=False, span_bucket=16, sync_every=1)
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


def planted(fn, old: str, new: str):
    """`fn` (a function of drafter.engine.tree) with the source text `old` replaced by `new`."""
    src = textwrap.dedent(inspect.getsource(fn))
    assert src.count(old) == 1, f"{fn.__name__} no longer reads {old!r}: update the plant"
    ns = dict(vars(tree_mod))
    exec(compile(src.replace(old, new), f"<{fn.__name__}, planted>", "exec"), ns)
    return ns[fn.__name__]


# Each bug as a replacement of the verifier decode.py calls: (name, tree, decode's attribute,
# the replacement). The chain's residual is drawn by Gumbel-max, which does not need it
# normalised; in the tree the next sibling's acceptance reads the renormalised residual.
def _chain_residual_dropped():
    real = tree_mod.verify_chain_sample
    return lambda toks, logits, q_tok, q_row, t: real(
        toks, logits, q_tok, lambda n: torch.zeros_like(q_row(n)), t)  # rejected: drawn from p


def _chain_wrong_rows():
    real = tree_mod.verify_chain_sample
    # p of draft i read at position i + 1: min(1, p/q) with the next position's target row
    return lambda toks, logits, q_tok, q_row, t: real(toks, logits.roll(-1, 1), q_tok, q_row, t)


def _tree_wrong_rows():
    real = tree_mod.verify_sample
    # every node's q read from the root's row (dist 0): depth 2's acceptance uses the wrong q
    return lambda *a: real(*a[:7], torch.zeros_like(a[7]), *a[8:])


PLANTS = [
    ("chain: residual dropped", CHAIN, "verify_chain_sample", _chain_residual_dropped),
    ("chain: acceptance from the wrong rows", CHAIN, "verify_chain_sample", _chain_wrong_rows),
    ("tree: residual not renormalised", TREE, "verify_sample", lambda: planted(
        tree_mod.verify_sample, "res / s.clamp(min=tiny)", "res")),
    ("tree: siblings drawn with replacement", TREE, "verify_sample", lambda: planted(
        tree_mod.verify_sample, "q2 = q_now.scatter(1, tok, 0.0)", "q2 = q_now")),
    ("tree: acceptance from the wrong rows", TREE, "verify_sample", _tree_wrong_rows),
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


@pytest.mark.parametrize("name,spec,attr,make", PLANTS, ids=[p[0] for p in PLANTS])
def test_a_planted_bias_fails_the_test(pair, monkeypatch, name, spec, attr, make):
    model, drafter, joint = pair
    monkeypatch.setattr(decode, attr, make())
    stat, limit = chi_square(draws(model, drafter, spec), joint)
    assert stat > limit, f"{name}: chi-square {stat:.1f}, not over {limit:.1f}"
