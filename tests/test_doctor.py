"""drafter doctor on this machine: versions, GPUs, disks, engines, and the exit status (non-zero
only for real problems: a tiny or read-only run/cache dir on a real tmpfs, an engine or target
the config asks for that is missing)."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCTOR = [sys.executable, "-m", "drafter.cli", "doctor"]


def doctor(*args, env=None, cwd=REPO):
    p = subprocess.run([*DOCTOR, *args, "--json"], capture_output=True, text=True, cwd=cwd,
                       env={**os.environ, **(env or {})}, timeout=180)
    return p.returncode, json.loads(p.stdout), p.stderr


def rows(report, section=None):
    return {r["name"]: r for r in report["rows"] if section is None or r["section"] == section}


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("doctor")
    rc, rep, err = doctor(f"run_dir={tmp / 'run'}", env={"DRAFTER_CACHE": str(tmp)})
    return rc, rep, err, tmp


def test_healthy_machine(healthy):
    rc, rep, err, tmp_path = healthy
    assert rc == 0 and rep["ok"], err
    py = rows(rep, "python")
    import torch
    import transformers

    assert py["torch"]["detail"] == torch.__version__ and py["torch"]["status"] == "ok"
    assert py["transformers"]["detail"] == transformers.__version__
    assert py["safetensors"]["detail"] == version("safetensors")
    assert sys.version.split()[0] in py["python"]["detail"]
    # GPUs: exactly what NVML reports
    from drafter.core import gpu

    devs = gpu.devices()
    assert len(rep["devices"]) == len(devs)
    g = rows(rep, "gpu")
    if not devs:
        assert g["devices"]["status"] == "info" and "CPU only" in g["devices"]["detail"]
    else:
        assert all(f"GPU {d.index}" in g for d in devs)
    # disks: the run dir's free space on its file system
    d = rows(rep, "disk")
    free = shutil.disk_usage(tmp_path).free / 2**30
    shown = float(d["run dir"]["detail"].split(": ")[1].split(" GiB")[0])
    assert shown == pytest.approx(free, abs=0.5)
    assert str(tmp_path) in d["cache dir"]["detail"]
    # engines: installed or not, as importlib sees them; none is required by the default config
    e = rows(rep, "engines")
    # missing but not asked for by the config: information, not a failure
    assert e["sglang"]["status"] == ("ok" if importlib.util.find_spec("sglang") else "info")
    assert e["transformers"]["status"] == "ok"
    assert (e["llama-server"]["status"] == "ok") == (shutil.which("llama-server") is not None)


def test_text_output(healthy):
    from drafter.run import doctor as D

    text = D.render(healthy[1])
    for needle in ["python", "torch", "transformers", "gpu", "disk", "run dir", "cache dir",
                   "engines", "vllm", "sglang", "llama-server", "doctor: ok"]:
        assert needle in text
    bad = {**healthy[1], "rows": healthy[1]["rows"] + [
        {"section": "disk", "name": "x", "status": "fail", "detail": "d"}]}
    assert D.render(bad).endswith("doctor: 1 problem(s) to fix")


def test_missing_engine_and_target_asked_for_fail(tmp_path):
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    rc, rep, _ = doctor(f"run_dir={tmp_path}", "generate.server.engine=sglang",
                        "target.model=builtin:nope")
    assert rc == 1 and not rep["ok"]
    e = rows(rep, "engines")["sglang"]
    assert e["status"] == "fail" and "generate.server.engine" in e["detail"]
    t = rows(rep, "target")["builtin:nope"]
    assert t["status"] == "fail" and "unknown builtin" in t["detail"]


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-Urm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs unprivileged user+mount namespaces")
def test_tiny_and_read_only_dirs_fail(tmp_path):
    """A run dir on a 1 MiB tmpfs and a cache dir on a read-only tmpfs (real mounts, in a
    private mount namespace) are real problems."""
    small, ro = tmp_path / "small", tmp_path / "ro"
    small.mkdir()
    ro.mkdir()
    script = (f"mount -t tmpfs -o size=1m tmpfs {small} && mount -t tmpfs -o ro,size=1m tmpfs "
              f"{ro} && DRAFTER_CACHE={ro} exec {' '.join(DOCTOR)} run_dir={small}/run --json")
    p = subprocess.run(["unshare", "-Urm", "sh", "-c", script], capture_output=True, text=True,
                       cwd=REPO, timeout=180)
    assert p.returncode == 1, p.stderr[-2000:]
    d = rows(json.loads(p.stdout), "disk")
    assert d["run dir"]["status"] == "fail" and "0.0 GiB free" in d["run dir"]["detail"]
    assert d["cache dir"]["status"] == "fail" and "not writable" in d["cache dir"]["detail"]


@pytest.mark.gpu
def test_gpu_rows_match_nvml():
    from drafter.core import gpu

    devs = gpu.devices()
    if not devs:
        pytest.skip("no GPU")
    rc, rep, _ = doctor()
    g = rows(rep, "gpu")
    assert g["torch cuda"]["status"] == "ok"
    for d in devs:
        assert d.name in g[f"GPU {d.index}"]["detail"]
        for p in d.processes:
            assert f"GPU {d.index} PID {p.pid}" in g
