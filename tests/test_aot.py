"""The train step's pieces compiled whole, saved by one process and loaded by another without
dynamo (drafter/train/aot.py): on the CPU with Inductor's C++ kernels, against eager."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drafter.train import aot

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="inductor's CPU kernels need a C++ compiler")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    n = len(aot._REPORT)
    yield tmp_path / "inductor" / "drafter-aot"
    del aot._REPORT[n:]


def _affine(x, w):
    return (x * w).relu() + 1.0


def _piece(mode: str) -> aot.Piece:
    return aot.Piece("affine", _affine, torch.compile(_affine, dynamic=False), {}, mode)


def test_a_saved_piece_loads_runs_and_leaves_other_shapes_to_torch_compile(cache):
    x, w = torch.randn(4, 3), torch.randn(3)
    saver = _piece("save")
    torch.testing.assert_close(saver(x, w), _affine(x, w))
    files = list(cache.iterdir())
    assert [f.name for f in files] == [saver.entry["file"]] and saver.entry["result"] == "saved"

    loader = _piece("load")
    torch.testing.assert_close(loader(x, w), _affine(x, w))
    assert loader.entry["result"] == "loaded" and loader.aot is not None
    x2 = torch.randn(4, 3)
    torch.testing.assert_close(loader(x2, w), _affine(x2, w))
    assert loader.entry["fallback_calls"] == 0
    # a shape the saved function was not compiled for: its guards refuse it, torch.compile runs
    x5 = torch.randn(5, 3)
    torch.testing.assert_close(loader(x5, w), _affine(x5, w))
    assert loader.entry["fallback_calls"] == 1
    assert [r["result"] for r in aot.report()[-2:]] == ["saved", "loaded"]


def test_no_file_or_a_damaged_one_compiles_as_usual(cache, caplog):
    x, w = torch.randn(4, 3), torch.randn(3)
    missing = _piece("load")
    torch.testing.assert_close(missing(x, w), _affine(x, w))
    assert missing.entry["result"] == "missing" and missing.aot is None

    _piece("save")(x, w)
    (path,) = cache.iterdir()
    path.write_bytes(b"not a compiled function")
    damaged = _piece("load")
    with caplog.at_level(logging.WARNING, logger="drafter"):
        torch.testing.assert_close(damaged(x, w), _affine(x, w))
    assert damaged.entry["result"] == "failed" and damaged.aot is None
    assert "affine" in caplog.text and "compiling it as usual" in caplog.text
    off = _piece("off")
    torch.testing.assert_close(off(x, w), _affine(x, w))
    assert off.entry is None


def _gather(x, idx):
    return x[idx] * 2.0


def test_a_loaded_piece_that_fails_at_its_first_call_is_dropped_for_torch_compile(cache, caplog):
    """Its error is not its guards': the piece runs again through torch.compile (a pure
    function), which raises the same error to the caller, and the saved function is not used
    again in this process."""
    x, ok, bad = torch.randn(6), torch.tensor([0, 5, 2]), torch.tensor([0, 9, 2])
    aot.Piece("gather", _gather, torch.compile(_gather, dynamic=False), {}, "save")(x, ok)
    loader = aot.Piece("gather", _gather, torch.compile(_gather, dynamic=False), {}, "load")
    with caplog.at_level(logging.WARNING, logger="drafter"), \
            pytest.raises((IndexError, RuntimeError)):
        loader(x, bad)
    assert loader.entry["result"] == "failed" and loader.aot is None
    assert "at its first call" in caplog.text
    torch.testing.assert_close(loader(x, ok), _gather(x, ok))


def test_the_key_holds_shapes_strides_grad_mode_and_modules_but_not_dynamic_rows():
    a = torch.randn(6, 5)
    lin, lin2 = torch.nn.Linear(5, 5), torch.nn.Linear(5, 4)
    key = aot.signature("f", (a,), {"m": lin})
    assert aot.signature("f", (torch.randn(6, 5),), {"m": lin}) == key   # values: not in it
    assert aot.signature("f", (torch.randn(7, 5),), {"m": lin}) != key
    assert aot.signature("f", (a.double(),), {"m": lin}) != key
    assert aot.signature("f", (a.t(),), {"m": lin}) != key                # strides
    assert aot.signature("f", (a,), {"m": lin2}) != key                   # the module's params
    assert aot.signature("g", (a,), {"m": lin}) != key
    with torch.no_grad():
        assert aot.signature("f", (a,), {"m": lin}) != key
    r1, r2 = torch.randn(6, 5), torch.randn(9, 5)   # the loss chunk's rows: dynamic
    assert aot.signature("f", (r1,), {}, rows=True) == aot.signature("f", (r2,), {}, rows=True)
    assert aot.signature("f", (r1,), {}, rows=True) != aot.signature("f", (r1[:, :4],), {},
                                                                     rows=True)


_TTT = """
import json, sys, torch
from drafter.train.aot import report
from drafter.train.trainer import compile_stats
from drafter.train.losses import head_loss
from drafter.train.ttt import TTT
from tests.test_model import batch_of, make_drafter, packed_rows, run_ttt
mode = sys.argv[1]
d = make_drafter()
ttt = TTT(d, attention="sdpa", compile=mode != "eager", saved=mode if mode != "eager" else "off")
b = batch_of(packed_rows(), 24, head=torch.randn(40, 24) * 0.3)
out = run_ttt(ttt, d, b)
# the fused loss's chunk statistics, as train runs them on a GPU: chunks of 5 rows, a ragged last
g = torch.Generator().manual_seed(3)
hn = torch.randn(23, 32, generator=g, requires_grad=True)
head = torch.randn(40, 32, generator=g)
teacher = {"ids": torch.randint(0, 40, (30, 4), generator=g),
           "logp": torch.randn(30, 4, generator=g).log_softmax(-1) - 0.5}
trows, w = torch.randint(0, 30, (23,), generator=g), torch.rand(23, generator=g)
loss = head_loss(hn, head, teacher, trows, w, fused=True, chunk=5, stats_fn=ttt.stats_fn)["loss"]
(out["loss"] + loss).backward()
grads = {n: p.grad.double().sum().item() for n, p in d.named_parameters() if p.grad is not None}
c = compile_stats()
print(json.dumps({"loss": out["loss"].item(), "head": loss.item(), "hn": hn.grad.sum().item(),
                  "grads": grads, "frames": [(f["graph"], f["pass"]) for f in c["frames"]],
                  "saved": [(r["graph"], r["result"], r["fallback_calls"]) for r in report()]}))
"""


@pytest.mark.slow
def test_train_pieces_saved_by_one_process_load_in_another_without_dynamo(tmp_path):
    """precompile's process saves pre, post and the loss chunk's statistics; a train process
    loads all three and traces nothing (no dynamo frame), with eager's loss and gradients.
    Slow (about 90 s on two cores: Inductor's C++ kernels compiled cold): `pytest -m slow
    tests/test_aot.py`; the GPU test of tests/test_train.py checks the same on a GPU."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    runs = {}
    for mode in ("save", "load", "eager"):
        p = subprocess.run([sys.executable, "-c", _TTT, mode], env=env, capture_output=True,
                           text=True, timeout=900, cwd=REPO, check=False)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[mode] = json.loads(p.stdout.strip().splitlines()[-1])
    pieces = ["pre", "post", "chunk_stats"]
    assert runs["save"]["saved"] == [[n, "saved", 0] for n in pieces]
    assert runs["load"]["saved"] == [[n, "loaded", 0] for n in pieces]
    # dynamo traced nothing in the train process (a "first run" is the kernels' first call)
    assert [f for f in runs["load"]["frames"] if f[1] != "first run"] == []
    assert sum(f[1] == "forward" for f in runs["save"]["frames"]) == 3  # traced there: 3 compiles
    assert len(list((tmp_path / "cache" / "drafter-aot").iterdir())) == 3
    ref = runs["eager"]
    for mode in ("save", "load"):
        for k in ("loss", "head", "hn"):
            assert runs[mode][k] == pytest.approx(ref[k], rel=1e-4, abs=1e-5), (mode, k)
        assert runs[mode]["grads"].keys() == ref["grads"].keys()
        for n, v in ref["grads"].items():
            assert runs[mode]["grads"][n] == pytest.approx(v, rel=1e-3, abs=1e-4), (mode, n)
