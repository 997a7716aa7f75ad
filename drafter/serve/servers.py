"""Generation servers: which to start for a config (transformers, vLLM, SGLang) or which external
URLs to reach, and the healthy Pool the generate step sends requests to.

    with serve.servers(cfg, log_path) as pool:   # started and healthy, or an error with the log
        pool.endpoints[0].url, pool.model        # OpenAI-compatible root URL, model name to send
    # stopped here: on success, on errors and on Ctrl-C

    drafter serve CONFIG                          # the same server on its own, until Ctrl-C

`generate.server.engine` picks the server:

- `transformers` (default): `transformers serve <materialised target folder> --continuous-batching`
  on 127.0.0.1 and a free port (needs `transformers[serving]`).
- `vllm`, `sglang`: started from the command templates in TEMPLATES when the engine is installed.
- `external`: `generate.server.urls`, one or more, load-balanced by the client; nothing started.

Each started server is a drafter.serve.supervisor.ManagedServer: its own process group under a
supervisor, stopped with every worker, even when drafter is killed. `replicas` > 1 starts one
server per share of the visible GPUs. drafter.serve.client.ChatClient sends the requests.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import string
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from drafter.core.configload import is_local_host
from drafter.serve.supervisor import ManagedServer, ServerError, free_port

log = logging.getLogger("drafter")

# Default command per engine. Placeholders: {model} (folder or HF id), {host}, {port}, {dtype},
# {device}, {seed}, {python} (this interpreter). `generate.server.command` replaces the template;
# `generate.server.extra_args` is appended in both cases (e.g. ["--tensor-parallel-size", "8"]).
TEMPLATES = {
    # `python -m transformers.cli.transformers` is the `transformers` console script, without
    # relying on PATH. Same flags in 5.17 (GPU image) and 5.24 (read in transformers/cli/serve.py).
    "transformers": "{python} -m transformers.cli.transformers serve {model} --host {host} "
                    "--port {port} --device {device} --dtype {dtype} --continuous-batching "
                    "--log-level info",
    "vllm": "vllm serve {model} --host {host} --port {port} --dtype {dtype} --seed {seed}",
    "sglang": "{python} -m sglang.launch_server --model-path {model} --host {host} --port {port} "
              "--dtype {dtype} --random-seed {seed}",
}

# KV-cache page size of transformers' continuous batching (ContinuousBatchingConfig, 5.17-5.24).
_CB_PAGE_TOKENS = 256


# ------------------------------------------------------------------------------------------ helpers
def root_url(url: str) -> str:
    """'http://h:p/v1/' -> 'http://h:p' (clients add /v1/chat/completions themselves)."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        raise ServerError(f"generate.server.urls: '{url}' is not an http(s) URL")
    return url


def api_headers(scfg) -> dict[str, str]:
    """The Authorization header from the environment variable named in the config (never logged)."""
    key = os.environ.get(scfg.api_key_env or "", "")
    return {"Authorization": f"Bearer {key}"} if key else {}


# ------------------------------------------------------------------------------------ the command
def _target_args(cfg) -> dict[str, str]:
    """{model}, {dtype}, {device} for the templates, from the target section, plus 'on_cpu'."""
    from drafter.core.target import TargetError, pick_device, pick_dtype, resolve

    t = cfg.target
    model = resolve(t.model)
    if t.chat_template:
        if not Path(model).is_dir():
            raise TargetError("target.chat_template needs a local target folder when drafter "
                              "starts the server (an HF id cannot be overlaid)")
        model = _with_chat_template(model, Path(t.chat_template))
    device = pick_device(t)
    # auto: bfloat16 on GPU, float32 on CPU (bf16 matmuls are several times slower on CPU).
    dtype = str(pick_dtype(t, device)).replace("torch.", "")
    return {"model": model, "dtype": dtype, "device": "auto" if t.device == "auto" else t.device,
            "on_cpu": "1" if device == "cpu" else ""}


def _with_chat_template(model: str, template: Path) -> str:
    """A folder that mirrors `model` (symlinks) with `template` as its chat template, so that the
    server renders exactly what tokenize renders. Built once per (model, template) in the cache."""
    import hashlib

    from drafter.core.rundir import atomic_dir, cache_dir

    src = Path(model)
    if not template.is_file():
        raise ServerError(f"target.chat_template: file not found: {template}")
    text = template.read_text()
    key = hashlib.sha256(f"{src.resolve()}|{text}".encode()).hexdigest()[:16]
    out = cache_dir() / "overlays" / f"{src.name}-{key}"
    if (out / "chat_template.jinja").exists():
        return str(out)
    with atomic_dir(out) as tmp:
        for p in src.iterdir():
            if p.name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
                continue
            (tmp / p.name).symlink_to(p.resolve())
        tc = src / "tokenizer_config.json"
        if tc.exists():
            conf = json.loads(tc.read_text())
            conf.pop("chat_template", None)
            (tmp / "tokenizer_config.json").write_text(json.dumps(conf, indent=2))
        (tmp / "chat_template.jinja").write_text(text)
    return str(out)


def build_command(cfg, port: int) -> list[str]:
    """The argv of the server drafter starts for `cfg.generate.server` on `port`."""
    s = cfg.generate.server
    engine = s.engine
    if s.command is None and engine not in TEMPLATES:
        raise ServerError(f"generate.server.engine={engine}: drafter starts no server for it")
    vllm = None
    if s.command is None and engine == "vllm":
        # The console script beside this interpreter (a venv run without activation), else PATH.
        here = Path(sys.executable).parent / "vllm"
        vllm = str(here) if here.exists() else shutil.which("vllm")
        if vllm is None:
            raise ServerError("generate.server.engine=vllm but `vllm` is not installed here: "
                              "pip install vllm, or use engine: transformers, or engine: "
                              "external with generate.server.urls")
    if s.command is None and engine == "sglang":
        import importlib.util

        if importlib.util.find_spec("sglang") is None:
            raise ServerError("generate.server.engine=sglang but `sglang` is not installed here: "
                              "pip install 'sglang[all]', or use engine: transformers, or engine: "
                              "external with generate.server.urls")
    template = s.command or TEMPLATES[engine]
    fields = {"host": s.host, "port": str(port), "seed": str(cfg.generate.seed),
              "python": sys.executable, "model": "", "dtype": "", "device": "", "on_cpu": ""}
    # Resolving the target may materialise it: only when the command names it.
    try:
        used = {name for _, name, _, _ in string.Formatter().parse(template) if name}
    except ValueError:
        used = set()  # unbalanced braces: the format below reports it
    if s.command is None or used & {"model", "dtype", "device"}:
        fields.update(_target_args(cfg))
    try:
        argv = [tok.format(**fields) for tok in shlex.split(template)]
    except (KeyError, IndexError, ValueError) as e:
        raise ServerError(f"generate.server.command: bad template {template!r} ({e}); "
                          f"placeholders: {', '.join('{' + k + '}' for k in fields)}") from None
    if vllm is not None:
        argv[0] = vllm
    extra = list(s.extra_args)
    t = cfg.target
    if s.command is None:
        if t.trust_remote_code:
            argv.append("--trust-remote-code")
        if t.revision and engine in ("vllm", "sglang"):
            argv += ["--revision", t.revision]
        if engine == "transformers" and fields["on_cpu"]:
            # On CPU, continuous batching sizes its KV cache from free host memory (gigabytes,
            # even for a 135M target). Size it for the requests in flight instead.
            if not any(a.startswith("--cb-num-blocks") for a in extra):
                per_req = -(-(cfg.generate.max_tokens + 1024) // _CB_PAGE_TOKENS)
                argv += ["--cb-num-blocks", str(max(16, cfg.generate.concurrency * per_req))]
    return argv + extra


# ------------------------------------------------------------------------------------------- pool
@dataclass
class Endpoint:
    """One OpenAI-compatible server the client sends requests to."""
    url: str                                  # root URL, without /v1
    server: ManagedServer | None = None       # None for external URLs
    inflight: int = 0
    restarts: int = 0


@dataclass
class Pool:
    """The endpoints of one generate run, the model name to send, and the request headers."""
    engine: str
    endpoints: list[Endpoint]
    model: str = ""
    headers: dict = field(default_factory=dict, repr=False)
    max_restarts: int = 0

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.endpoints]

    def pick(self, avoid: Endpoint | None = None) -> Endpoint:
        """The endpoint with the fewest requests in flight (another one than `avoid` if any)."""
        cands = [e for e in self.endpoints if e is not avoid] or self.endpoints
        return min(cands, key=lambda e: e.inflight)

    def recover(self, ep: Endpoint, generation: int) -> bool:
        """After a failed request on `ep`: restart its server if drafter started it and it died.
        Returns True when it restarted it. Raises ServerError when restarts are used up.
        Blocking on purpose: with one started server nothing else can progress meanwhile."""
        srv = ep.server
        if srv is None or srv.alive() or srv.generation != generation:
            return False
        if ep.restarts >= self.max_restarts:
            raise ServerError(
                f"the server at {ep.url} died and generate.server.max_restarts="
                f"{self.max_restarts} restarts are used up (log: {srv.log_path}); last lines:\n"
                f"{srv.tail()}")
        ep.restarts += 1
        srv.restart()
        ep.url = srv.url
        return True

    def stop(self) -> None:
        for e in self.endpoints:
            if e.server is not None:
                e.server.stop()


def _gpu_groups(replicas: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each replica: the visible GPUs split into `replicas` contiguous
    groups; [""] * replicas without GPUs (CPU replicas share the cores)."""
    if replicas < 1:
        raise ServerError(f"generate.server.replicas={replicas}: must be at least 1")
    if replicas == 1:
        return [""]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [x.strip() for x in visible.split(",") if x.strip()]
    else:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    if not ids:
        return [""] * replicas
    if len(ids) < replicas:
        raise ServerError(f"generate.server.replicas={replicas} but only {len(ids)} GPUs are "
                          f"visible ({','.join(ids)}): one replica needs at least one GPU")
    per = len(ids) // replicas
    if per * replicas != len(ids):
        log.warning("generate.server.replicas=%d: %d GPUs each; GPUs %s stay unused", replicas,
                    per, ",".join(ids[per * replicas:]))
    return [",".join(ids[i * per:(i + 1) * per]) for i in range(replicas)]


def _models(url: str, headers: dict, timeout: float = 10.0) -> list[str]:
    import httpx

    r = httpx.get(f"{url}/v1/models", headers=headers, timeout=timeout, trust_env=False)
    r.raise_for_status()
    return [m.get("id") for m in r.json().get("data", []) if m.get("id")]


def _wait_external(url: str, headers: dict, timeout: float) -> list[str]:
    import httpx

    t0, err = time.time(), None
    while time.time() - t0 < timeout:
        try:
            return _models(url, headers)
        except httpx.HTTPStatusError as e:
            # Up, but unable to list its models (transformers serve lists the HF hub cache's,
            # and answers 500 where that cache does not exist): go on if /health says so; the
            # model then comes from server.model_name.
            err = e
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", headers=headers, timeout=10.0,
                             trust_env=False).status_code == 200:
                    log.warning("GET %s/v1/models failed (%s); the server is healthy", url, e)
                    return []
            time.sleep(1.0)
        except (httpx.HTTPError, ValueError) as e:
            err = e
            time.sleep(1.0)
    raise ServerError(f"the external server {url} did not answer GET /v1/models within "
                      f"{timeout:.0f}s (generate.server.startup_timeout): {err}")


def _pick_model(scfg, listed: list[str], started: str | None) -> str:
    if scfg.model_name:
        return scfg.model_name
    if started and started in listed:
        return started
    if listed:
        if len(listed) > 1:
            log.warning("the server lists several models %s; using %s (set "
                        "generate.server.model_name to choose)", listed, listed[0])
        return listed[0]
    if started:
        return started
    raise ServerError("the server lists no model in GET /v1/models: set "
                      "generate.server.model_name")


@contextlib.contextmanager
def servers(cfg, log_path: Path):
    """Start (or reach) the generation servers of `cfg.generate.server`; yield a healthy Pool;
    stop every started server on exit, whatever the exit (return, error, Ctrl-C)."""
    s = cfg.generate.server
    headers = api_headers(s)
    pool = Pool(engine=s.engine, endpoints=[], headers=headers, max_restarts=s.max_restarts)
    try:
        if s.engine == "external":
            if not s.urls:
                raise ServerError("generate.server.engine=external needs generate.server.urls "
                                  "(e.g. [http://10.0.0.5:8000/v1])")
            listed: list[str] = []
            for u in s.urls:
                ep = Endpoint(url=root_url(u))
                listed = _wait_external(ep.url, headers, s.startup_timeout)
                pool.endpoints.append(ep)
            pool.model = _pick_model(s, listed, None)
        elif s.engine == "drafter":
            raise ServerError("generate.server.engine=drafter runs in-process: there is no server "
                              "to start")
        else:
            if not is_local_host(s.host):  # allowed by generate.server.allow_remote (configload.py)
                log.warning("generate.server.host=%s: the %s server accepts requests from other "
                            "machines (generate.server.allow_remote is true); anyone who "
                            "reaches %s can use the target", s.host, s.engine, s.host)
            model = _target_args(cfg)["model"] if s.command is None else None
            groups = _gpu_groups(s.replicas)
            for i, gpus in enumerate(groups):
                log_i = Path(log_path) if i == 0 else Path(log_path).with_suffix(f".{i}.log")
                port = s.port + i if s.port else 0
                name = f"{s.engine} server" + (f" {i}" if len(groups) > 1 else "")
                srv = ManagedServer(lambda port: build_command(cfg, port), s.host, port,
                                    log_i, s.startup_timeout, s.stop_timeout, name=name,
                                    env={"CUDA_VISIBLE_DEVICES": gpus} if gpus else None)
                pool.endpoints.append(Endpoint(url=srv.url, server=srv))
            for ep in pool.endpoints:  # all load at once, then each is waited for
                ep.server.spawn()
            for ep in pool.endpoints:
                try:
                    ep.server.wait_healthy()
                except ServerError as e:
                    if "address already in use" not in str(e).lower():
                        raise
                    ep.server.port = free_port(ep.server.host)  # taken meanwhile: another
                    ep.server.start()
                ep.url = ep.server.url
            url = pool.endpoints[0].url
            listed = []
            # transformers serve answers for whichever model a request names, and its
            # /v1/models lists the HF hub cache, not the model it was started with (a 500 and
            # a traceback in its log where that cache does not exist): not asked.
            if not (s.engine == "transformers" and model is not None):
                try:
                    listed = _models(url, headers)
                except Exception as e:  # noqa: BLE001  (a server without /v1/models still works)
                    if model is None:
                        log.warning("GET %s/v1/models failed (%s)", url, e)
                    else:
                        log.info("GET %s/v1/models: %s; the server is healthy, and requests "
                                 "name the model it was started with", url, e)
            pool.model = _pick_model(s, listed, model)
        log.info("generation server: %s, model %s", ", ".join(pool.urls), pool.model)
        yield pool
    finally:
        pool.stop()

# ----------------------------------------------------------------------------- drafter serve CONFIG
def main(cfg) -> int:
    """`drafter serve CONFIG`: start the generation server of the config, print its URL, keep it
    up until Ctrl-C (or SIGTERM), then stop it. The log goes to the run's generate/server.log."""
    from drafter.core.rundir import Run

    s = cfg.generate.server
    if s.engine in ("external", "drafter"):
        raise ServerError(f"generate.server.engine={s.engine}: drafter starts no server for it "
                          f"(use engine transformers, vllm or sglang)")
    log_path = Run.of(cfg).server_log()

    def on_term(signum, frame):
        raise KeyboardInterrupt

    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, on_term)
    try:
        with servers(cfg, log_path) as pool:
            urls = "\n".join(f"{ep.url}/v1" for ep in pool.endpoints)
            print(f"serving {pool.model}\n{urls}\n(log: {log_path}; Ctrl-C stops it)",
                  flush=True)
            while True:
                time.sleep(1.0)
                for ep in pool.endpoints:
                    if not ep.server.alive():
                        raise ServerError(
                            f"the server at {ep.url} exited (code {ep.server.proc.poll()}); "
                            f"last lines of {ep.server.log_path}:\n{ep.server.tail()}")
    except KeyboardInterrupt:
        print("stopped", flush=True)
    return 0
