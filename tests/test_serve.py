"""Server lifecycle: the real `transformers serve` through `drafter serve CONFIG`, and small real
servers (scripts run as subprocesses) for the failure paths: never healthy, exits while starting,
ignores SIGTERM, outlives a drafter killed with SIGKILL. Every test checks that no process of the
server's group is left (os.killpg(pgid, 0) -> ProcessLookupError)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from drafter.core import config as C
from drafter.serve import servers as serve
from drafter.serve import supervisor

REPO = Path(__file__).resolve().parents[1]

# A healthy OpenAI-ish server: /health and /v1/models. argv: HOST PORT [ignore-term]
FAKE = r'''
import json, signal, sys, subprocess
from http.server import BaseHTTPRequestHandler, HTTPServer
host, port = sys.argv[1], int(sys.argv[2])
if "ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "child" in sys.argv:  # a worker in the same group, like an engine's workers
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        body = json.dumps({"status": "ok", "data": [{"id": "fake-model"}]}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
print("fake server up", flush=True)
HTTPServer((host, port), H).serve_forever()
'''


def pgids(log: Path) -> list[int]:
    return [int(x) for x in re.findall(r"==== drafter: pid=\d+ pgid=(\d+)", log.read_text())]


def wait_gone(pgid: int, seconds: float = 15.0) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if not supervisor.group_alive(pgid):
            return True
        time.sleep(0.1)
    return False


def fake_cfg(tmp_path, *flags, **over) -> C.Config:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE)
    cfg = C.load(None, [f"run_dir={tmp_path / 'run'}",
                        *[f"generate.server.{k}={v}" for k, v in over.items()]])
    cfg.generate.server.command = f"{{python}} {script} {{host}} {{port}} " + " ".join(flags)
    return cfg


def test_never_healthy_error_has_log_tail_and_leaves_no_process(tmp_path):
    # Prints, starts a worker in its group, never serves /health.
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(600)']); print('loading shards 3/7', flush=True); "
            "time.sleep(600)")
    cfg = C.load(None, [f"run_dir={tmp_path}", "generate.server.startup_timeout=3",
                        "generate.server.stop_timeout=2"])
    cfg.generate.server.command = "{python} -c " + json.dumps(code)
    log = tmp_path / "server.log"
    t0 = time.time()
    with pytest.raises(serve.ServerError) as e:
        with serve.servers(cfg, log):
            pass
    msg = str(e.value)
    assert "did not become healthy within 3s" in msg and "startup_timeout" in msg
    assert "loading shards 3/7" in msg and str(log) in msg
    assert time.time() - t0 < 60
    (pgid,) = pgids(log)
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_exit_while_starting_fails_fast_with_the_log(tmp_path):
    cfg = C.load(None, [f"run_dir={tmp_path}", "generate.server.startup_timeout=600"])
    cfg.generate.server.command = ("{python} -c \"import sys; print('OSError: no model at "
                                   "/nowhere', flush=True); sys.exit(3)\"")
    t0 = time.time()
    with pytest.raises(serve.ServerError, match=r"(?s)exited with code 3.*no model at /nowhere"):
        with serve.servers(cfg, tmp_path / "server.log"):
            pass
    assert time.time() - t0 < 60  # not the 600 s timeout


def test_stop_escalates_to_sigkill_and_kills_workers(tmp_path):
    cfg = fake_cfg(tmp_path, "ignore-term", "child", stop_timeout=1)
    log = tmp_path / "server.log"
    with serve.servers(cfg, log) as pool:
        assert pool.model == "fake-model"
        assert httpx.get(pool.endpoints[0].url + "/health").status_code == 200
        (pgid,) = pgids(log)
        assert supervisor.group_alive(pgid)
    assert wait_gone(pgid, 5)
    assert "fake server up" in log.read_text()


def test_server_dies_when_drafter_is_killed(tmp_path):
    cfg = fake_cfg(tmp_path, "child")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(C.to_dict(cfg)))
    code = ("import sys, time; from drafter.core import config; "
            "from drafter.serve import servers as serve; "
            "cfg = config.load(sys.argv[1]); "
            "ctx = serve.servers(cfg, sys.argv[2]); pool = ctx.__enter__(); "
            "print(pool.endpoints[0].server.pgid, flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "cfg.yaml"),
                             str(tmp_path / "server.log")], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)
    try:
        pgid = int(proc.stdout.readline())
        assert supervisor.group_alive(pgid)
    finally:
        proc.kill()  # SIGKILL: no cleanup code runs in drafter
        proc.wait()
        proc.stdout.close()
    assert wait_gone(pgid), "the server outlived drafter"


def test_replicas(tmp_path, monkeypatch):
    cfg = fake_cfg(tmp_path, replicas=2)
    log = tmp_path / "server.log"
    with serve.servers(cfg, log) as pool:
        assert len(pool.endpoints) == 2 and len(set(pool.urls)) == 2
        for ep in pool.endpoints:
            assert httpx.get(ep.url + "/health").status_code == 200
        groups = pgids(log) + pgids(tmp_path / "server.1.log")
        assert len(groups) == 2 and all(supervisor.group_alive(g) for g in groups)
    assert all(wait_gone(g, 5) for g in groups)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert serve._gpu_groups(4) == ["0,1", "2,3", "4,5", "6,7"]
    assert serve._gpu_groups(1) == [""]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(serve.ServerError, match="replicas=2 but only 1 GPUs"):
        serve._gpu_groups(2)


def test_build_command(tmp_path, smollm2_dir):
    cfg = C.load(None, ["generate.concurrency=4", "generate.max_tokens=1000",
                        "generate.server.extra_args=[--attn-implementation, sdpa]",
                        "target.device=cpu"])
    argv = serve.build_command(cfg, 4321)
    assert argv[:4] == [sys.executable, "-m", "transformers.cli.transformers", "serve"]
    assert argv[4] == str(smollm2_dir)
    for flag in (["--host", "127.0.0.1"], ["--port", "4321"], ["--dtype", "float32"],
                 ["--device", "cpu"], ["--cb-num-blocks", str(4 * 8)]):
        i = argv.index(flag[0])
        assert argv[i:i + 2] == flag
    assert "--continuous-batching" in argv and argv[-2:] == ["--attn-implementation", "sdpa"]

    cfg.generate.server.command = "myserve --model {model} --listen {host}:{port} --seed {seed}"
    assert serve.build_command(cfg, 7)[:5] == ["myserve", "--model", str(smollm2_dir),
                                               "--listen", "127.0.0.1:7"]
    cfg.generate.server.command = "myserve {nope}"
    with pytest.raises(serve.ServerError, match="placeholders"):
        serve.build_command(cfg, 7)

    cfg.generate.server.command = None
    cfg.generate.server.engine = "vllm"
    if serve.shutil.which("vllm") is None:
        with pytest.raises(serve.ServerError, match="pip install vllm"):
            serve.build_command(cfg, 7)


def test_chat_template_override_reaches_the_server_folder(tmp_path, smollm2_dir):
    from transformers import AutoTokenizer

    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}<<{{ m.role }}>>{{ m.content }}{% endfor %}")
    cfg = C.load(None, [f"target.chat_template={tpl}", "target.device=cpu"])
    folder = Path(serve.build_command(cfg, 1)[4])
    assert folder != smollm2_dir and (folder / "config.json").exists()
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<<user>>hi"
    assert serve.build_command(cfg, 2)[4] == str(folder)  # built once


def test_real_transformers_serve_not_healthy_in_time(tmp_path, smollm2_dir):
    """The real `transformers serve` stopped while it still loads: clear error, nothing left."""
    cfg = C.load(None, [f"run_dir={tmp_path}", "generate.server.startup_timeout=1",
                        "generate.server.stop_timeout=10", "target.device=cpu"])
    log = tmp_path / "server.log"
    with pytest.raises(serve.ServerError, match=r"(?s)transformers server did not become "
                                                r"healthy within 1s.*last lines:.*starting "):
        with serve.servers(cfg, log):
            pass
    (pgid,) = pgids(log)
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    assert f"transformers.cli.transformers serve {smollm2_dir}" in log.read_text()


def test_real_transformers_serve_healthy_says_nothing_alarming(tmp_path, smollm2_dir, caplog):
    """A healthy `transformers serve`: requests name the model drafter started it with, and its
    /v1/models (which lists the HF hub cache, a 500 with a traceback where there is none) is
    not asked: neither drafter's log nor the server's holds an error."""
    import logging

    cfg = C.load(None, [f"run_dir={tmp_path}", "target.device=cpu",
                        "generate.server.stop_timeout=10"])
    log = tmp_path / "server.log"
    with caplog.at_level(logging.INFO, logger="drafter"):
        with serve.servers(cfg, log) as pool:
            assert pool.model == str(smollm2_dir)
            r = httpx.post(pool.urls[0] + "/v1/chat/completions", timeout=120,
                           json={"model": pool.model, "max_tokens": 2,
                                 "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 200, r.text
    assert [x.getMessage() for x in caplog.records if x.levelno >= logging.WARNING] == []
    text = log.read_text()
    assert "GET /health HTTP/1.1\" 200" in text and "/v1/models" not in text
    assert "500 Internal Server Error" not in text and "Traceback" not in text


def test_drafter_serve_cli(tmp_path):
    """`drafter serve CONFIG` starts the server, prints its URL, serves, stops on Ctrl-C. (The
    real `transformers serve` start and stop are covered in test_generate.py.)"""
    cfg = fake_cfg(tmp_path, "child")
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(C.to_dict(cfg)))
    proc = subprocess.Popen([sys.executable, "-m", "drafter.cli", "serve", str(cfg_path)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not (lines and lines[-1].startswith("http")):
            line = proc.stdout.readline()
            assert line, f"drafter serve exited: {proc.stderr.read()[-3000:]}"
            lines.append(line.strip())
        url = lines[-1]
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", url)
        assert lines[0] == "serving fake-model"
        assert httpx.get(url + "/models").json()["data"][0]["id"] == "fake-model"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    (pgid,) = pgids(tmp_path / "run" / "generate" / "server.log")
    assert wait_gone(pgid, 5)
