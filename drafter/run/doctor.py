"""`drafter doctor [CONFIG]`: is this machine ready for a run? Reads, never changes anything.

Reads   package versions; CUDA devices, their free memory and the processes holding it (NVML,
        drafter/core/gpu.py); free disk of the run dir, the cache dir (rundir.cache_dir()) and the
        Hugging Face hub cache; which optional engines are installed.
Writes  nothing.
Command drafter doctor [CONFIG] [key=value ...] [--json]

Each line is ok, info, warn or FAIL. The exit status is 1 only for real problems: torch or
transformers missing or too old, a GPU machine whose torch cannot use CUDA, a run or cache
directory that cannot be written or has under 1 GiB free, or what the config asks for (its
generation engine, builtin target, GPU device) missing here. Foreign processes on the GPUs are
a warning: drafter never kills a process it did not start, and the steps' preflight decides.
"""
from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import sys
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from drafter.core.rundir import cache_dir

GiB = 1 << 30
MIN_FREE = 1 * GiB       # below this a directory drafter writes to is a failure
LOW_FREE = 50 * GiB      # below this a warning (one big target's weights or shards)
# The floors of pyproject.toml (the GPU image's versions).
FLOORS = {"torch": (2, 6), "transformers": (5, 0)}


@dataclass
class Row:
    section: str
    name: str
    status: str          # ok | info | warn | fail
    detail: str


def _version(pkg: str) -> str | None:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def _tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


# ------------------------------------------------------------------------------------ sections
def packages() -> list[Row]:
    rows = [Row("python", "python", "ok", f"{platform.python_version()} ({sys.executable})")]
    for pkg in ("torch", "transformers"):
        v = _version(pkg)
        if v is None:
            rows.append(Row("python", pkg, "fail", "not installed: pip install -e ."))
        elif _tuple(v) < FLOORS[pkg]:
            rows.append(Row("python", pkg, "fail", f"{v} is older than the supported "
                            f"{'.'.join(map(str, FLOORS[pkg]))}: pip install -U {pkg}"))
        else:
            rows.append(Row("python", pkg, "ok", v))
    for pkg in ("drafter", "safetensors", "accelerate", "gguf", "pyarrow", "nvidia-ml-py"):
        v = _version(pkg)
        rows.append(Row("python", pkg, "ok" if v else "warn", v or "not installed"))
    return rows


def gpus() -> tuple[list[Row], dict]:
    """CUDA as torch sees it and the devices as NVML sees them, with their holders."""
    from drafter.core import gpu

    rows = []
    devs = gpu.devices()
    try:
        import torch

        cuda_ok = torch.cuda.is_available()
        build = torch.version.cuda
    except Exception as e:  # noqa: BLE001 - a broken torch install is reported by packages()
        cuda_ok, build = False, f"torch import failed: {e}"
    if not devs:
        rows.append(Row("gpu", "devices", "info", "no NVIDIA GPU (NVML sees none): CPU only"))
    elif not cuda_ok:
        rows.append(Row("gpu", "torch cuda", "fail", f"{len(devs)} GPU(s) present but torch "
                        f"cannot use CUDA (torch build: {build or 'CPU only'}): install a "
                        "CUDA build of torch"))
    else:
        rows.append(Row("gpu", "torch cuda", "ok", f"CUDA {build}, {len(devs)} GPU(s)"))
    visible = set(gpu.visible_indices(devs)) if devs else set()
    if devs and os.environ.get("CUDA_VISIBLE_DEVICES") is not None and not visible:
        rows.append(Row("gpu", "CUDA_VISIBLE_DEVICES", "fail",
                        f"'{os.environ['CUDA_VISIBLE_DEVICES']}' matches no GPU"))
    own = gpu.related_pids()
    for g in devs:
        vis = "" if g.index in visible else " (not visible: CUDA_VISIBLE_DEVICES)"
        rows.append(Row("gpu", f"GPU {g.index}", "ok", f"{g.name}: {g.free / GiB:.1f} GiB free "
                        f"of {g.total / GiB:.1f} GiB{vis}"))
        for p in g.processes:
            mem = f"{p.used_bytes / GiB:.1f} GiB" if p.used_bytes else "memory"
            status = "info" if p.pid in own else "warn"
            rows.append(Row("gpu", f"GPU {g.index} PID {p.pid}", status,
                            f"{p.name} holds {mem} (drafter never kills it: stop it yourself "
                            f"before a run that needs this GPU)"))
    return rows, {"devices": [asdict(g) for g in devs]}


def _free(path: Path) -> tuple[Path, int]:
    p = Path(path).expanduser().absolute()
    while not p.exists():
        p = p.parent
    return p, shutil.disk_usage(p).free


def _writable(path: Path) -> bool:
    p = Path(path).expanduser().absolute()
    while not p.exists():
        p = p.parent
    return os.access(p, os.W_OK | os.X_OK)


def disks(cfg) -> list[Row]:
    hf_home = os.environ.get("HF_HOME", "~/.cache/huggingface")
    places = [("run dir", Path(cfg.run_dir), True), ("cache dir", cache_dir(), True),
              ("HF hub cache", Path(os.environ.get("HF_HUB_CACHE") or f"{hf_home}/hub"), False)]
    rows = []
    for name, path, needed in places:
        fs, free = _free(path)
        detail = f"{path}: {free / GiB:.1f} GiB free on {fs}"
        if not _writable(path):
            rows.append(Row("disk", name, "fail" if needed else "warn",
                            f"{path}: not writable ({fs})"))
        elif free < MIN_FREE:
            rows.append(Row("disk", name, "fail" if needed else "warn", detail))
        elif free < LOW_FREE:
            rows.append(Row("disk", name, "warn", detail + " (`drafter plan CONFIG` says how "
                            "much the run needs)"))
        else:
            rows.append(Row("disk", name, "ok", detail))
    return rows


def engines(cfg) -> list[Row]:
    """Optional engines: installed or not; a failure only when the config asks for a missing one."""
    want = cfg.generate.server.engine if cfg.generate.enabled else None
    serving = [m for m in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(m) is None]
    found = {
        "transformers": (not serving, "transformers serve" + (
            "" if not serving else f": missing {', '.join(serving)} "
            "(pip install 'transformers[serving]')")),
        "vllm": (shutil.which("vllm") is not None or importlib.util.find_spec("vllm") is not None,
                 f"vllm {_version('vllm') or 'not installed'}"),
        "sglang": (importlib.util.find_spec("sglang") is not None,
                   f"sglang {_version('sglang') or 'not installed'}"),
    }
    rows = []
    for name, (ok, detail) in found.items():
        custom = want == name and cfg.generate.server.command is not None
        if ok:
            status = "ok"
        elif want == name and not custom:
            status = "fail"
            detail += " (generate.server.engine asks for it)"
        else:
            status = "info"
        rows.append(Row("engines", name, status, detail))
    for tool in ("llama-server", "convert_hf_to_gguf.py"):
        path = shutil.which(tool)
        rows.append(Row("engines", tool, "ok" if path else "info",
                        path or "not on PATH (only for serving the export with llama.cpp)"))
    fa = importlib.util.find_spec("flash_attn") is not None
    rows.append(Row("engines", "flash-attn", "ok" if fa else "info",
                    _version("flash-attn") or "not installed (extract packs samples only with "
                                               "flash attention)"))
    return rows


def target(cfg) -> list[Row]:
    """The configured target, checked without loading anything."""
    spec = cfg.target.model
    if spec.startswith("builtin:"):
        from drafter.core.target import TargetError, builtin_file

        try:
            f = builtin_file(spec.split(":", 1)[1])
            return [Row("target", spec, "ok", f"{f} ({f.stat().st_size / 2**20:.0f} MiB GGUF)")]
        except TargetError as e:
            return [Row("target", spec, "fail", str(e))]
    p = Path(os.path.expanduser(spec))
    if p.suffix == ".gguf":
        return [Row("target", spec, "ok" if p.is_file() else "fail",
                    "GGUF file" if p.is_file() else "GGUF file not found")]
    if p.is_dir():
        ok = (p / "config.json").exists()
        return [Row("target", spec, "ok" if ok else "fail",
                    "HF folder" if ok else "folder without config.json")]
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        return [Row("target", spec, "info", "HF model id (downloaded on first use)")]
    return [Row("target", spec, "fail", "neither a folder, a .gguf file, an HF id nor builtin:")]


def check(cfg) -> dict:
    rows = packages()
    g_rows, g_info = gpus()
    rows += g_rows + disks(cfg) + engines(cfg) + target(cfg)
    device = cfg.target.device
    if device.startswith("cuda") and not any(r.name == "torch cuda" and r.status == "ok"
                                             for r in rows):
        rows.append(Row("target", "target.device", "fail",
                        f"target.device={device} but CUDA is not usable here"))
    return {"ok": not any(r.status == "fail" for r in rows), "rows": [asdict(r) for r in rows],
            **g_info}


MARK = {"ok": "ok  ", "info": "  - ", "warn": "WARN", "fail": "FAIL"}


def render(report: dict) -> str:
    lines, section = [], None
    for r in report["rows"]:
        if r["section"] != section:
            section = r["section"]
            lines.append(section)
        lines.append(f"  [{MARK[r['status']]}] {r['name']}: {r['detail']}")
    bad = [r for r in report["rows"] if r["status"] == "fail"]
    lines.append("doctor: ok" if not bad else f"doctor: {len(bad)} problem(s) to fix")
    return "\n".join(lines)


def main(cfg, as_json: bool = False) -> int:
    report = check(cfg)
    print(json.dumps(report, indent=2, default=str) if as_json else render(report))
    return 0 if report["ok"] else 1
