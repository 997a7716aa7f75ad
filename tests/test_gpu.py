"""GPU preflight: NVML snapshot, the refuse/warn/off decision, PIDs named, nothing killed."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from drafter.core import gpu

GiB = gpu.GiB


def snapshot(holders=((4242, "python3", 30 * GiB),)) -> list[gpu.Gpu]:
    """Two 80 GiB GPUs; GPU 1 has the given holders."""
    g0 = gpu.Gpu(0, "H200", "GPU-aaaa-0000", 80 * GiB, 79 * GiB, 1 * GiB, [])
    used = sum(b or 0 for _, _, b in holders)
    g1 = gpu.Gpu(1, "H200", "GPU-bbbb-1111", 80 * GiB, 79 * GiB - used, 1 * GiB + used,
                 [gpu.GpuProcess(pid, name, b, 1) for pid, name, b in holders])
    return [g0, g1]


def test_cpu_machine_has_no_gpu_and_preflight_passes():
    if gpu.devices():
        pytest.skip("this machine has a GPU")
    assert gpu.describe() == "no GPU"
    assert gpu.visible_indices() == []
    for policy in ("refuse", "warn"):
        rep = gpu.preflight(10**15, policy=policy)
        assert rep == {"ok": True, "gpus": [], "message": "no GPU"}
    assert gpu.preflight(10**15, policy="off")["skipped"]


def test_check_names_foreign_holders_and_short_memory():
    gpus = snapshot()
    rep = gpu.check(gpus, [0], 40 * GiB)
    assert rep["ok"] and rep["gpus"][0]["holders"] == []
    rep = gpu.check(gpus, [0, 1], 40 * GiB)
    assert not rep["ok"]
    assert rep["busy"] == ["GPU 1: PID 4242 (python3) holds 30.0 GiB"]
    assert rep["short"] == []                        # 49 GiB free >= 40 GiB
    rep = gpu.check(gpus, [1], {1: 60 * GiB})
    assert "GPU 1: needs ~60.0 GiB, 49.0 GiB free of 80.0 GiB" in rep["short"]
    # our own PIDs (this process, sibling ranks) are not foreign
    assert gpu.check(gpus, [1], 1, ignore_pids={4242})["ok"]
    # NVML may not know a holder's memory (containers): still a holder
    rep = gpu.check(snapshot(((7, "?", None),)), [1], 1)
    assert rep["busy"] == ["GPU 1: PID 7 (?) holds memory"]
    assert gpu.check(gpus, [5], 1)["short"] == ["GPU 5 is not present"]


def test_preflight_policies(caplog):
    gpus = snapshot()
    with pytest.raises(gpu.GpuBusy, match=r"PID 4242 \(python3\)") as e:
        gpu.preflight(1 * GiB, use=[1], gpus=gpus, ignore_pids=set())
    assert "never kills" in str(e.value)
    with pytest.raises(gpu.GpuMemoryShort, match="batch_tokens"):
        gpu.preflight(80 * GiB, use=[0], gpus=gpus, ignore_pids=set())
    with caplog.at_level(logging.WARNING, logger="drafter"):
        rep = gpu.preflight(100 * GiB, use=[1], gpus=gpus, policy="warn", ignore_pids=set())
    assert not rep["ok"] and "PID 4242" in caplog.text and "not enough free" in caplog.text
    assert gpu.preflight(100 * GiB, use=[1], gpus=gpus, policy="off")["skipped"]
    assert gpu.preflight(1 * GiB, use=[0], gpus=gpus, ignore_pids=set())["ok"]


def test_visible_indices_follow_cuda_visible_devices(monkeypatch):
    gpus = snapshot()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu.visible_indices(gpus) == [0, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gpu.visible_indices(gpus) == [1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb,0")
    assert gpu.visible_indices(gpus) == [1, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,GPU-zzzz,1")   # CUDA stops at a bad entry
    assert gpu.visible_indices(gpus) == [0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu.visible_indices(gpus) == []


def test_describe_lists_holders():
    text = gpu.describe(snapshot())
    assert "GPU 1 H200: 49.0 GiB free of 80.0 GiB" in text
    assert "PID 4242 python3 holds 30.0 GiB" in text


def test_process_name_and_sibling_ranks(tmp_path):
    """Real processes: a launcher with two children, as torchrun starts ranks; each child sees
    the other as related (its memory on another GPU is not a foreign holder)."""
    assert "python" in gpu.process_name(os.getpid())
    child = textwrap.dedent(f"""
        import json, os, sys, time
        from pathlib import Path
        from drafter.core import gpu
        d = Path({str(tmp_path)!r})
        def wait(pattern):   # a barrier over files: both siblings alive until both are done
            while len(list(d.glob(pattern))) < 2:
                time.sleep(0.02)
        (d / f"up.{{os.getpid()}}").touch()
        wait("up.*")
        print(json.dumps({{"me": os.getpid(), "related": sorted(gpu.related_pids())}}),
              flush=True)
        (d / f"done.{{os.getpid()}}").touch()
        wait("done.*")
    """)
    launcher = textwrap.dedent(f"""
        import os, subprocess, sys
        env = dict(os.environ, TORCHELASTIC_RUN_ID="t", LOCAL_WORLD_SIZE="2")
        ps = [subprocess.Popen([sys.executable, "-c", {child!r}], env=env,
                               stdout=subprocess.PIPE, text=True) for _ in range(2)]
        for p in ps:
            sys.stdout.write(p.communicate()[0])
    """)
    out = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split("\n")
    a, b = (json.loads(line) for line in out if line.strip())
    assert a["me"] in b["related"] and b["me"] in a["related"]
    if not os.environ.get("LOCAL_WORLD_SIZE"):  # without torchrun's environment: only itself
        assert gpu.related_pids() == {os.getpid()}


@pytest.mark.gpu
def test_real_gpu_holder_is_refused(tmp_path):
    """On a GPU machine: a process that holds memory is named by PID, and left running."""
    if not gpu.devices():
        pytest.skip("no GPU")
    holder = subprocess.Popen([sys.executable, "-c", "import torch, time; "
                               "x = torch.empty(1 << 30, device='cuda'); print('up', flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "up"
        with pytest.raises(gpu.GpuBusy, match=f"PID {holder.pid}"):
            gpu.preflight(1, use=[gpu.visible_indices()[0]])
        assert holder.poll() is None   # never killed by drafter
    finally:
        holder.kill()
        holder.wait()
