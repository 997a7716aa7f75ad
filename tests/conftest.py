"""Shared fixtures: the embedded SmolLM2 target materialised once per test session into a
session cache dir (never ~/.cache), and tiny random configs of real architectures."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    """Every test uses one throwaway cache (materialised targets), unless DRAFTER_CACHE is set
    by the caller to reuse a warm one."""
    if not os.environ.get("DRAFTER_TEST_KEEP_CACHE"):
        os.environ["DRAFTER_CACHE"] = str(tmp_path_factory.mktemp("drafter-cache"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    yield


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`):
    tiny shapes and decoding's many small ops gain nothing from a second thread, OpenMP threads
    spinning against each other make them 10x slower on a busy 2-core machine, and one thread
    is one fixed order of float reductions. Subprocesses get the same through their env."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smollm2_dir(_cache_dir) -> Path:
    """The builtin target as an HF folder (materialised once per session)."""
    from drafter.core.target import resolve

    return Path(resolve("builtin:smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """A tiny random Llama target (8 layers, hidden 64, vocab 49152) as an HF folder: the
    target of the engine layout, export and check tests."""
    from tiny import make_tiny

    return make_tiny("llama", tmp_path_factory.mktemp("target"), num_hidden_layers=8)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.skip(f"{SHARED_DATA} not present")
    return SHARED_DATA


@pytest.fixture
def steady_speed(monkeypatch):
    """The speed check's limits lifted (drafter/measure/speedcheck.py): for tests of what evaluate
    does with speed figures that hold up, on a test machine whose speed may not. The check has
    tests of its own (tests/test_serving.py, tests/test_evaluate.py)."""
    from drafter.measure import speedcheck

    for name in ("SPREAD", "PLAIN_X_MAX", "DISAGREE"):
        monkeypatch.setattr(speedcheck, name, float("inf"))
    monkeypatch.setattr(speedcheck, "PLAIN_X_MIN", 0.0)
