"""vocab: the d2t/t2d invariants on hand-made count tables, counting only loss-masked training
tokens, and the step's files."""
import json
import logging
from fractions import Fraction

import pytest
import torch

from drafter import DrafterError
from drafter.core import config as C
from drafter.core.rundir import Run, atomic_open
from drafter.data import tokens
from drafter.steps import vocab as Vs


def invariants(d2t, t2d, counts, vd):
    targets = torch.arange(vd) + d2t                       # target = i + d2t[i]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and d2t.shape == (vd,)
    assert t2d.shape == counts.shape and int(t2d.sum()) == vd
    assert torch.all(targets[1:] > targets[:-1])           # sorted and unique
    assert torch.equal(torch.nonzero(t2d).flatten(), targets)
    return targets


def test_top_k_ties_and_exact_coverage():
    #                      0  1  2  3  4  5  6  7  8  9
    counts = torch.tensor([0, 5, 0, 3, 3, 9, 0, 1, 3, 2], dtype=torch.int64)
    d2t, t2d, info = Vs.build_vocab(counts, 4)
    targets = invariants(d2t, t2d, counts, 4)
    # 9 (id 5), 5 (id 1), then three ids with 3: the lower ids 3 and 4 win the tie
    assert targets.tolist() == [1, 3, 4, 5] and d2t.tolist() == [1, 2, 2, 2]
    assert Fraction(info["covered_tokens"], info["masked_tokens"]) == Fraction(5 + 3 + 3 + 9, 26)
    assert info["coverage"] == 20 / 26 and info["distinct_tokens"] == 7 and info["padded"] == 0


def test_padding_with_unused_ids():
    counts = torch.zeros(12, dtype=torch.int64)
    counts[[7, 2, 9]] = torch.tensor([4, 1, 2])
    d2t, t2d, info = Vs.build_vocab(counts, 6)
    targets = invariants(d2t, t2d, counts, 6)
    assert targets.tolist() == [0, 1, 2, 3, 7, 9]      # 3 seen + the 3 lowest unused ids
    assert info["padded"] == 3 and info["coverage"] == 1.0


def test_capped_at_target_vocab():
    counts = torch.tensor([1, 0, 2], dtype=torch.int64)
    d2t, t2d, info = Vs.build_vocab(counts, 100)
    invariants(d2t, t2d, counts, 3)
    assert info["draft_vocab_size"] == 3 and info["requested_draft_vocab_size"] == 100


def write_tokens(path, rows):
    with atomic_open(path, "wb") as f:
        w = tokens.TokenWriter(f.name, row_group_rows=2)
        for i, (ids, mask) in enumerate(rows):
            w.write(f"s{i}", ids, mask)
        w.close()


def test_counts_only_masked_tokens(tmp_path):
    p = tmp_path / "t.parquet"
    write_tokens(p, [([1, 2, 3, 4], [0, 0, 1, 1]), ([4, 4, 5], [0, 1, 1]), ([9, 9], [0, 0])])
    c = Vs.count_tokens(p, 10)
    assert c.tolist() == [0, 0, 0, 1, 2, 1, 0, 0, 0, 0]
    with pytest.raises(DrafterError, match="outside the target vocab"):
        Vs.count_tokens(p, 5)


def test_step_files(tmp_path, smollm2_dir, caplog):
    cfg = C.load(None, [f"run_dir={tmp_path / 'run'}", "vocab.draft_vocab_size=4"])
    run = Run.of(cfg)
    with pytest.raises(DrafterError, match="drafter tokenize"):
        Vs.main(cfg)
    write_tokens(run.tokens("train"), [([10, 11, 12, 12], [0, 1, 1, 1]),
                                       ([13, 12, 40000], [0, 1, 1])])
    write_tokens(run.tokens("val"), [([7, 7, 7], [1, 1, 1])])   # never counted
    with caplog.at_level(logging.INFO, logger="drafter"):
        out = Vs.main(cfg)
    assert "coverage 100.00%" in caplog.text
    d2t, t2d, counts = tokens.load_vocab(run.vocab())
    targets = invariants(d2t, t2d, counts, 4)
    assert t2d.numel() == 49152 and targets.tolist() == [0, 11, 12, 40000]  # padded with id 0
    assert counts[12] == 3 and counts[7] == 0 and int(counts.sum()) == 5
    info = json.loads(run.vocab_info().read_text())
    assert info["coverage"] == out["coverage"] == 1.0 and info["padded"] == 1
    assert out["counts"] == {"masked_tokens": 5, "distinct_tokens": 3, "draft_vocab_size": 4,
                             "padded": 1}
