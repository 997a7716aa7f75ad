"""benchmarks/gpu_runs.sh, the resumable chain of GPU measurements, run for real (bash
subprocesses) in its tiny CPU mode: the archive a call leaves is what the next machine resumes
from, a step too long for the time left is not started, and the whole chain finishes on CPU
(`-m slow`)."""
from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEPS = ("kimi-extract", "kimi-train", "quality-data", "quality-train", "quality-b64",
         "quality-b1", "tests-decode", "tests-rest", "decode-b1", "tree-profile", "mla-train",
         "kimi-eval", "chunks-cost", "block-b64", "block-b1", "dspark-train")


def _driver(tmp_path, *args, timeout=600, **env):
    e = {**os.environ, "GPU_RUNS_TINY": "1", "STATE": str(tmp_path / "state"),
         "RESUME": str(tmp_path / "none.tar.gz"), **env}
    return subprocess.run(["bash", str(REPO / "benchmarks/gpu_runs.sh"), *args], env=e,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _members(archive: Path) -> set[str]:
    with tarfile.open(archive) as t:
        return {m.name.removeprefix("./") for m in t.getmembers()}


def test_unknown_steps_are_refused_with_the_usage(tmp_path):
    for args in (["decode-b1,bogus", str(tmp_path / "out")], ["decode-b1"]):
        r = _driver(tmp_path, *args, timeout=60)
        assert r.returncode == 2, r.stdout + r.stderr
        for s in STEPS:
            assert f"  {s} " in r.stdout
    assert not (tmp_path / "out").exists() and not (tmp_path / "state").exists()


def test_a_fresh_machine_resumes_from_the_archive(tmp_path):
    """Call 1 finishes decode-b1 and returns its archive; a second machine (an empty state)
    given that archive skips decode-b1 and keeps its figures in the archive it returns."""
    r = _driver(tmp_path, "decode-b1", str(tmp_path / "out1"))
    assert r.returncode == 0, r.stdout + r.stderr
    a1 = tmp_path / "out1" / "gpu-runs.tar.gz"
    got = _members(a1)
    assert {"done/decode-b1", "decode-b1-t0.json", "decode-b1-t1.json", "steps.log"} <= got
    assert (tmp_path / "out1" / "summary.txt").read_text() == "decode-b1: done\n"

    r = _driver(tmp_path, "decode-b1", str(tmp_path / "out2"), RESUME=str(a1),
                STATE=str(tmp_path / "state2"))
    assert r.returncode == 0, r.stdout + r.stderr
    log = (tmp_path / "out2" / "steps.log").read_text()
    assert "restored 1 finished step(s)" in log
    assert log.count("decode-b1: python") == 2          # the first machine's two, none anew
    archive = tmp_path / "out2" / "gpu-runs.tar.gz"
    assert {"done/decode-b1", "decode-b1-t1.json"} <= _members(archive)


def test_a_step_longer_than_the_time_left_does_not_start(tmp_path):
    """With 100 s to the deadline, decode-b1 (estimated at 120) is not started and does not
    count as a failure; nothing is marked done."""
    r = _driver(tmp_path, "decode-b1", str(tmp_path / "out"), GPU_RUNS_DEADLINE="100")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "out" / "summary.txt").read_text() == "decode-b1: not started (deadline)\n"
    assert not list((tmp_path / "state" / "done").iterdir())


@pytest.mark.slow
@pytest.mark.timeout(3300)   # the driver's own limit is 3000 s; pytest's default 600 is not
def test_the_whole_chain_at_tiny_sizes(tmp_path):
    """Every step in its tiny CPU form (tiny Kimi slices, the quality recipe at a few samples,
    the GPU tests skipping themselves), from an empty state: every step finishes, in order."""
    r = _driver(tmp_path, "all", str(tmp_path / "out"), timeout=3000,
                SLICES=str(tmp_path / "slices"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert summary == [f"{s}: done" for s in STEPS]
