"""The generate step against a real `transformers serve` (embedded SmolLM2 on CPU), and against a
small in-test OpenAI-compatible server for what no real server here produces (reasoning fields,
faults). One real server is shared by the module; the tests that kill things start their own."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from drafter.core import config as C
from drafter.core.configload import apply_override
from drafter.core.rundir import Run, atomic_json, read_json, read_jsonl
from drafter.data.conversations import request_seed, split_reasoning
from drafter.run import pipeline
from drafter.serve import servers as serve
from drafter.serve import supervisor
from drafter.steps import generate

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ helpers
def make_run(root: Path, records: list[dict], **overrides) -> C.Config:
    """A run dir whose prepare step is done with `records`; the config with `overrides`."""
    run = Run(root)
    p = run.conversations("prepare")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    atomic_json(run.manifest("prepare"), {"step": "prepare", "counts": {"ok": len(records)}})
    data = {"run_dir": str(root)}
    for k, v in overrides.items():
        apply_override(data, k.split("."), v, k)  # the dotted overrides of C.load, values as given
    (root / "cfg.yaml").write_text(yaml.safe_dump(data))
    return C.load(root / "cfg.yaml")


def conv(i, *turns, system=None, source="t"):
    msgs = [{"role": "system", "content": system}] if system else []
    for t in turns:
        msgs += [{"role": "user", "content": t}, {"role": "assistant", "content": "ORIGINAL"}]
    return {"id": f"{source}:{i:03d}", "source": source, "split": "train", "messages": msgs}


def output(cfg) -> list[dict]:
    return read_jsonl(Run.of(cfg).conversations("generate"))


def errors(cfg) -> list[dict]:
    return read_jsonl(Run.of(cfg).generate_errors())


def check_invariants(cfg, records):
    out = output(cfg)
    ids = [r["id"] for r in out]
    assert len(ids) == len(set(ids)), "duplicate ids in the output"
    order = [r["id"] for r in records]
    assert ids == [i for i in order if i in set(ids)], "output not in input order"
    m = read_json(Run.of(cfg).manifest("generate"))
    c = m["counts"]
    assert c["ok"] + c["errors"] + c["skipped"] == c["input"] == len(records)
    assert c["ok"] == len(out)
    return out, m


def server_pgids(cfg) -> list[int]:
    text = Run.of(cfg).server_log().read_text()
    return [int(x) for x in re.findall(r"==== drafter: pid=\d+ pgid=(\d+)", text)]


# --------------------------------------------------------------------------- the real shared server
# Servers started by tests use one thread: on a shared 2-core machine, two OpenMP threads per
# server spin against other processes (measured here: 8 tokens in 11 s with 2 threads under load,
# 2-4 s with one).
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tf_server(smollm2_dir, tmp_path_factory):
    """One real `transformers serve` of SmolLM2 (CPU, continuous batching) for the module."""
    d = tmp_path_factory.mktemp("tf-server")
    cfg = C.load(None, [f"run_dir={d}", "generate.concurrency=4", "generate.max_tokens=8"])
    with pytest.MonkeyPatch.context() as mp:
        for k, v in ONE_THREAD.items():
            mp.setenv(k, v)
        with serve.servers(cfg, d / "server.log") as pool:
            yield pool


def test_multi_turn_regeneration(tf_server, smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    records = [
        conv(0, "Name a fruit.", "Name another one.", system="You answer in one line."),
        conv(1, "What is 2+2?"),
        # Two user turns in a row: one answer, after the second, as in the original.
        {"id": "t:002", "source": "t", "split": "val", "messages": [
            {"role": "user", "content": "Here is a word: apple."},
            {"role": "user", "content": "Spell it backwards."},
            {"role": "assistant", "content": "ORIGINAL"}]},
        # Prompt-only record (no assistant turn): answered too.
        {"id": "t:003", "source": "t", "split": "train",
         "messages": [{"role": "user", "content": "Say hello."}], "meta": {"keep": 1}},
    ]
    # model_name given: transformers serve 5.17 cannot list its models offline (HTTP 500)
    cfg = make_run(tmp_path, records, **{"generate.server.engine": "external",
                                         "generate.server.urls": [tf_server.urls[0] + "/v1"],
                                         "generate.server.model_name": tf_server.model,
                                         "generate.max_tokens": 8, "generate.concurrency": 4})
    pipeline.run_step(cfg, "generate")
    out, m = check_invariants(cfg, records)
    assert m["counts"]["ok"] == 4 and m["counts"]["turns"] == 5
    assert m["server"]["model"] == str(smollm2_dir)
    by_id = {r["id"]: r for r in out}

    roles = [x["role"] for x in by_id["t:000"]["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert [x["role"] for x in by_id["t:002"]["messages"]] == ["user", "user", "assistant"]
    assert by_id["t:003"]["meta"]["keep"] == 1 and by_id["t:003"]["split"] == "train"
    for r in out:
        answers = [x for x in r["messages"] if x["role"] == "assistant"]
        assert answers and all(a["content"] and a["content"] != "ORIGINAL" for a in answers)
        turns = r["meta"]["turns"]
        assert len(turns) == len(answers)
        for t in turns:
            assert t["finish_reason"] in ("stop", "length")
            assert 1 <= t["completion_tokens"] <= 8 and t["prompt_tokens"] > 0
    assert m["tokens"]["completion"] == sum(r["meta"]["usage"]["completion_tokens"] for r in out)

    # The second request carried the regenerated first answer: the server's prompt token count
    # equals the chat template rendering of that history.
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    msgs = by_id["t:000"]["messages"]
    history = [{"role": x["role"], "content": x["content"]} for x in msgs[:4]]
    text = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    expected = len(tok(text, add_special_tokens=False)["input_ids"])
    assert by_id["t:000"]["meta"]["turns"][1]["prompt_tokens"] == expected

    # Done: a rerun regenerates nothing (pipeline skip, and main() itself on a finished folder).
    assert pipeline.run_step(cfg, "generate")["counts"]["ok"] == 4
    again = generate.main(cfg)
    assert again["counts"]["generated"] == 0 and again["counts"]["resumed"] == 4


def test_client_killed_mid_run_then_resumed(tf_server, tmp_path):
    records = [conv(i, f"Give me fact number {i} about the sea.") for i in range(8)]
    cfg = make_run(tmp_path, records, **{"generate.server.engine": "external",
                                         "generate.server.urls": [tf_server.urls[0]],
                                         "generate.server.model_name": tf_server.model,
                                         "generate.max_tokens": 8, "generate.concurrency": 2})
    out_path = Run.of(cfg).conversations("generate")
    cmd = [sys.executable, "-m", "drafter.cli", "generate", str(tmp_path / "cfg.yaml")]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            if out_path.exists() and out_path.read_bytes().count(b"\n") >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        proc.stderr.close()
    first = read_jsonl(out_path)
    assert 2 <= len(first) < len(records)
    assert len({r["id"] for r in first}) == len(first)
    assert not Run.of(cfg).manifest("generate").exists()
    # A kill in the middle of a write leaves a torn last line: the resume cuts it off.
    with open(out_path, "ab") as f:
        f.write(b'{"id": "t:007", "source": "t", "messa')

    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out, m = check_invariants(cfg, records)
    assert {x["id"] for x in out} == {x["id"] for x in records}
    assert m["counts"]["resumed"] == len(first) and m["counts"]["generated"] == 8 - len(first)
    assert not errors(cfg)


def test_server_killed_mid_run_is_restarted(smollm2_dir, tmp_path, monkeypatch):
    for k, v in ONE_THREAD.items():
        monkeypatch.setenv(k, v)
    records = [conv(i, f"Write a word that rhymes with number {i}.") for i in range(5)]
    cfg = make_run(tmp_path, records, **{"generate.max_tokens": 8, "generate.concurrency": 2,
                                         "generate.retry_backoff": 0.2,
                                         "generate.server.max_restarts": 2,
                                         "generate.server.stop_timeout": 10})
    out_path = Run.of(cfg).conversations("generate")
    killed: list[int] = []

    def killer():
        deadline = time.time() + 300
        while time.time() < deadline:
            if out_path.exists() and out_path.read_bytes().count(b"\n") >= 1:
                pgid = server_pgids(cfg)[-1]
                os.killpg(pgid, signal.SIGKILL)
                killed.append(pgid)
                return
            time.sleep(0.05)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    pipeline.run_step(cfg, "generate")
    t.join(5)
    assert killed, "the server was never killed"
    out, m = check_invariants(cfg, records)
    assert m["counts"]["ok"] == 5 and m["server"]["restarts"] == 1
    pgids = server_pgids(cfg)
    assert len(pgids) == 2 and pgids[0] == killed[0]
    for pgid in pgids:  # the restarted server was stopped at the end of the step too
        assert not supervisor.group_alive(pgid)


# ---------------------------------------------------------------------------- an in-test server
class FakeOpenAI:
    """A minimal OpenAI-compatible server whose answers depend on the last user message: vLLM-style
    reasoning fields, inline <think>, 5xx, dropped connections and 4xx on demand."""

    def __init__(self, name="fake-model"):
        self.name = name
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.calls: dict[str, int] = {}
        self.broken = set()  # prompts answered with 503 for as long as they are in here
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out first ("slow")

            def do_GET(self):
                if self.path in ("/health", "/v1/models"):
                    self._send(200, {"data": [{"id": fake.name}]})
                else:
                    self._send(404, {"error": "no"})

            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(n))
                with fake.lock:
                    fake.requests.append(body)
                    fake.headers.append(dict(self.headers))
                    last = body["messages"][-1]["content"]
                    k = fake.calls[last] = fake.calls.get(last, 0) + 1
                res = fake.answer(last, k, body)
                if res is None:  # drop the connection without an answer
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                code, obj = res
                self._send(code, obj)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @staticmethod
    def ok(content, finish="stop", **extra):
        msg = {"role": "assistant", "content": content, **extra}
        return 200, {"choices": [{"index": 0, "message": msg, "finish_reason": finish}],
                     "usage": {"prompt_tokens": 11, "completion_tokens": 5}}

    def answer(self, last, k, body):
        if last in self.broken:
            return 503, {"error": "overloaded"}
        if last == "field":
            return self.ok("The answer.", reasoning_content="Let me think.")
        if last == "field-new":
            return self.ok("Done.", reasoning="Thinking, vLLM >= 0.10 style.")
        if last == "inline":
            return self.ok("<think>\nstep 1\nstep 2\n</think>\n\nFinal answer.")
        if last == "inside":  # the generation prompt already opened <think>
            return self.ok("step A\n</think>\n\nFinal B.")
        if last == "cut":
            return self.ok("<think>\nstill thinking", finish="length")
        if last == "flaky":
            return (503, {"error": "busy"}) if k <= 2 else self.ok("after 503s")
        if last == "drop":
            return None if k == 1 else self.ok("after a dropped connection")
        if last == "bad":
            return 400, {"error": "prompt too long"}
        if last == "long":
            return self.ok("cut off here", finish="length")
        if last.startswith("ctx-"):  # vLLM's words for a prompt over max_model_len
            return 400, {"object": "error", "type": "BadRequestError", "code": 400, "message":
                         f"This model's maximum context length is 2048 tokens. However, you "
                         f"requested {last[4:]} tokens in the messages. Please reduce it."}
        if last.startswith("denied-"):  # OpenAI's error object, details varying per request
            return 403, {"error": {"message": f"Model 'm{last[7:]}' is not allowed for key "
                                              f"{last[7:]}", "type": "permission_error"}}
        if last == "malformed":
            return 200, {"choices": []}
        if last == "slow":
            time.sleep(1.5)
        return self.ok(f"echo: {last}")

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    f = FakeOpenAI()
    yield f
    f.close()


def fake_cfg(tmp_path, records, urls, **kw):
    return make_run(tmp_path, records, **{"generate.server.engine": "external",
                                          "generate.server.urls": urls,
                                          "generate.retry_backoff": 0.01,
                                          "generate.max_retries": 3, **kw})


TOOL = {"type": "function", "function": {"name": "get_time", "description": "the time",
                                          "parameters": {"type": "object", "properties": {}}}}


def test_reasoning_capture_retries_and_errors(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTER_TEST_KEY", "sk-test-123")
    records = [conv(0, "field"), conv(1, "field-new"), conv(2, "inline"), conv(3, "inside"),
               conv(4, "cut"), conv(5, "flaky"), conv(6, "drop"), conv(7, "bad"),
               conv(8, "inline", "next question"), conv(9, "long"),
               {**conv(10, "use a tool"), "tools": [TOOL]}]
    cfg = fake_cfg(tmp_path, records, [fake.url + "/v1"],
                   **{"generate.server.api_key_env": "DRAFTER_TEST_KEY",
                      "generate.temperature": 0.7, "generate.top_p": 0.9,
                      "generate.max_tokens": 33, "generate.seed": 5,
                      "generate.chat_template_kwargs": {"enable_thinking": True}})
    pipeline.run_step(cfg, "generate")
    out, m = check_invariants(cfg, records)
    by_id = {r["id"]: r["messages"] for r in out}

    def answer(i, n=0):
        return [x for x in by_id[f"t:{i:03d}"] if x["role"] == "assistant"][n]

    assert answer(0) == {"role": "assistant", "content": "The answer.",
                         "reasoning_content": "Let me think."}
    assert answer(1)["reasoning_content"] == "Thinking, vLLM >= 0.10 style."
    assert answer(2) == {"role": "assistant", "content": "Final answer.",
                         "reasoning_content": "step 1\nstep 2"}
    assert answer(3) == {"role": "assistant", "content": "Final B.", "reasoning_content": "step A"}
    assert answer(4) == {"role": "assistant", "content": "", "reasoning_content": "still thinking"}
    assert answer(5)["content"] == "after 503s" and fake.calls["flaky"] == 3
    assert answer(6)["content"] == "after a dropped connection" and fake.calls["drop"] == 2
    assert answer(9)["content"] == "cut off here"
    # The history sent for the second turn holds the regenerated answer, without its reasoning.
    second = [b for b in fake.requests if b["messages"][-1]["content"] == "next question"][0]
    assert second["messages"][1] == {"role": "assistant", "content": "Final answer."}
    assert answer(8, 1)["content"] == "echo: next question"
    # Sampling settings, per-request seeds, template kwargs, model name and the API key.
    body = [b for b in fake.requests if b["messages"][-1]["content"] == "field"][0]
    assert (body["model"], body["temperature"], body["top_p"], body["max_tokens"]) == \
        ("fake-model", 0.7, 0.9, 33)
    assert body["chat_template_kwargs"] == {"enable_thinking": True}
    seeds = {b["seed"] for b in fake.requests}
    assert len(seeds) > 5 and all(isinstance(s, int) for s in seeds)
    assert all(h.get("Authorization") == "Bearer sk-test-123" for h in fake.headers)
    assert "sk-test-123" not in Run.of(cfg).manifest("generate").read_text()
    # The record's tools are offered to the model (tokenize renders them too) and kept.
    tooly = [b for b in fake.requests if b["messages"][-1]["content"] == "use a tool"][0]
    assert tooly["tools"] == [TOOL] and "tools" not in body
    assert [r for r in out if r["id"] == "t:010"][0]["tools"] == [TOOL]
    # The 400 is a permanent error with its reason and message; everything else is ok.
    errs = errors(cfg)
    assert [(e["id"], e["kind"]) for e in errs] == [("t:007", "permanent")]
    assert errs[0]["reason"] == "HTTP 400: context length exceeded"
    assert "HTTP 400" in errs[0]["message"] and "prompt too long" in errs[0]["message"]
    c = m["counts"]
    assert (c["ok"], c["errors"], c["truncated"]) == (10, 1, 2)
    assert m["errors_by_kind"] == {"permanent": 1, "transient": 0}
    assert m["errors_by_reason"] == {"HTTP 400: context length exceeded": 1}


def test_drop_truncated(fake, tmp_path):
    records = [conv(0, "long"), conv(1, "hello"), conv(2, "hi", "long")]
    cfg = fake_cfg(tmp_path, records, [fake.url], **{"generate.drop_truncated": True})
    pipeline.run_step(cfg, "generate")
    out, m = check_invariants(cfg, records)
    assert [r["id"] for r in out] == ["t:001"]
    errs = {e["id"]: e for e in errors(cfg)}
    assert set(errs) == {"t:000", "t:002"} and errs["t:002"]["turn"] == 1
    assert all(e["kind"] == "permanent" and e["reason"] == "truncated"
               and "generate.max_tokens" in e["message"] for e in errs.values())


def test_transient_failures_fail_the_step_and_are_retried(fake, tmp_path):
    records = [conv(i, f"q{i}") for i in range(5)]
    cfg = fake_cfg(tmp_path, records, [fake.url])
    fake.broken = {"q1", "q3"}
    with pytest.raises(generate.GenerateError, match="2 conversations failed.*Rerun"):
        pipeline.run_step(cfg, "generate")
    assert Run.of(cfg).failed("generate").exists()
    errs = errors(cfg)
    assert {e["id"] for e in errs} == {"t:001", "t:003"}
    assert all(e["kind"] == "transient" and e["reason"] == "HTTP 503"
               and "overloaded" in e["message"] for e in errs)
    assert fake.calls["q1"] == 4  # 1 + max_retries
    assert len(output(cfg)) == 3

    fake.broken = set()  # the server recovered: the rerun retries only the two
    n_before = len(fake.requests)
    m = pipeline.run_step(cfg, "generate")
    assert len(fake.requests) - n_before == 2
    out, m = check_invariants(cfg, records)
    assert m["counts"]["ok"] == 5 and m["counts"]["retried"] == 2 and m["counts"]["errors"] == 0
    assert not errors(cfg)  # compacted: resolved errors are gone
    assert m["errors_by_reason"] == {}


def test_every_error_has_its_reason_counted_and_kept_across_a_resume(fake, tmp_path, caplog):
    """Each failed conversation's id, short reason and message go to errors.jsonl; the manifest
    counts them by reason (messages that differ only in their numbers group under one) and the
    step's log line names them; a rerun skips the permanent ones and keeps their reasons; a line
    written before reasons were kept (the message in `reason`) is read as reason and message."""
    import logging

    records = [conv(0, "ok"), conv(1, "ctx-3000"), conv(2, "ctx-9000"), conv(3, "denied-1"),
               conv(4, "denied-22"), conv(5, "malformed"), conv(6, "bad"),
               {"id": "t:007", "source": "t", "split": "train",
                "messages": [{"role": "system", "content": "no question"}]}]
    cfg = fake_cfg(tmp_path, records, [fake.url])
    with caplog.at_level(logging.INFO, logger="drafter"):
        m = pipeline.run_step(cfg, "generate")
    out, m = check_invariants(cfg, records)
    assert [r["id"] for r in out] == ["t:000"]
    want = {"t:001": "HTTP 400: context length exceeded",
            "t:002": "HTTP 400: context length exceeded",
            "t:003": "HTTP 403: Model '...' is not allowed for key N",
            "t:004": "HTTP 403: Model '...' is not allowed for key N",
            "t:005": "a response without choices[0].message",
            "t:006": "HTTP 400: context length exceeded", "t:007": "no user turn"}
    errs = {e["id"]: e for e in errors(cfg)}
    assert {i: e["reason"] for i, e in errs.items()} == want
    assert all(e["kind"] == "permanent" for e in errs.values())
    assert "requested 9000 tokens" in errs["t:002"]["message"]
    assert "'m22' is not allowed" in errs["t:004"]["message"]
    assert m["errors_by_reason"] == {"HTTP 400: context length exceeded": 3,
                                     "HTTP 403: Model '...' is not allowed for key N": 2,
                                     "a response without choices[0].message": 1,
                                     "no user turn": 1}
    assert m["errors_by_kind"] == {"permanent": 7, "transient": 0}
    line = next(r.getMessage() for r in caplog.records if " errors (" in r.getMessage())
    assert "7 errors (7 permanent, 0 transient: 3 HTTP 400: context length exceeded, 2 HTTP " \
           "403: Model '...' is not allowed for key N, 1 a response" in line
    assert str(Run.of(cfg).generate_errors()) in line

    # an errors.jsonl line as written before reasons were kept: its message was the reason
    path = Run.of(cfg).generate_errors()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    old = {"id": "t:003", "kind": "permanent", "turn": 0, "time": 1.0,
           "reason": "HTTP 403 from http://h/v1: {\"error\": \"no\"}"}
    path.write_text("".join(json.dumps(old if e["id"] == "t:003" else e) + "\n" for e in lines))
    n = len(fake.requests)
    m = generate.main(cfg)      # the step again, on its own files: a resume
    assert len(fake.requests) == n                  # permanent errors are not asked again
    assert m["counts"]["errors"] == 7 and m["counts"]["ok"] == 1
    errs = {e["id"]: e for e in errors(cfg)}
    assert errs["t:003"]["reason"] == "HTTP N from http" and \
        errs["t:003"]["message"] == old["reason"]
    assert {i: e["reason"] for i, e in errs.items() if i != "t:003"} == \
        {i: r for i, r in want.items() if i != "t:003"}
    assert sum(m["errors_by_reason"].values()) == 7


def test_a_timeout_is_a_transient_error_named_timeout(fake, tmp_path):
    records = [conv(0, "q0"), conv(1, "slow")]
    cfg = fake_cfg(tmp_path, records, [fake.url], **{"generate.request_timeout": 0.3,
                                                     "generate.max_retries": 1})
    with pytest.raises(generate.GenerateError, match="1 conversations failed"):
        pipeline.run_step(cfg, "generate")
    errs = errors(cfg)
    assert [(e["id"], e["kind"], e["reason"]) for e in errs] == [("t:001", "transient",
                                                                  "timeout")]
    assert "generate.request_timeout" in errs[0]["message"]


def test_http_error_bodies_group_by_reason():
    from drafter.serve.client import body_reason

    assert body_reason(400, json.dumps({"detail": "Prompt is longer than the model's context "
                                                  "of 4096"})) == \
        "HTTP 400: context length exceeded"
    assert body_reason(422, json.dumps({"detail": [{"loc": ["body"], "msg": "field required"}]})) \
        == "HTTP 422: field required"
    assert body_reason(404, "Not Found") == "HTTP 404: Not Found"
    assert body_reason(400, json.dumps({"error": {"message": "top_p 1.5 must be <= 1."}})) == \
        body_reason(400, json.dumps({"error": {"message": "top_p 2 must be <= 1."}})) == \
        "HTTP 400: top_p N must be <= N"
    assert body_reason(400, "") == "HTTP 400"
    assert generate.error_reason("record has no messages list") == "record has no messages list"
    assert generate.error_reason("prompt too long: 9000 tokens + 5") == "prompt too long"


def test_load_balanced_across_urls(tmp_path):
    a, b = FakeOpenAI(), FakeOpenAI()
    try:
        records = [conv(i, f"q{i}") for i in range(12)]
        cfg = fake_cfg(tmp_path, records, [a.url, b.url], **{"generate.concurrency": 2})
        m = pipeline.run_step(cfg, "generate")
        assert m["counts"]["ok"] == 12
        assert len(a.requests) + len(b.requests) == 12
        assert len(a.requests) >= 3 and len(b.requests) >= 3
    finally:
        a.close()
        b.close()


def test_disabled_is_quick_and_starts_nothing(tmp_path):
    records = [conv(i, f"q{i}") for i in range(3)]
    # A server command that would fail: proves that nothing is started.
    cfg = make_run(tmp_path, records, **{"generate.enabled": False,
                                         "generate.server.command": "false"})
    m = pipeline.run_step(cfg, "generate")
    assert m["counts"] == {"input": 3, "ok": 0, "errors": 0, "skipped": 3}
    assert m["enabled"] is False
    assert not Run.of(cfg).conversations("generate").exists()


def test_bad_input_names_the_line(tmp_path):
    records = [conv(0, "a"), conv(1, "b"), conv(0, "c")]
    cfg = make_run(tmp_path, records)
    with pytest.raises(generate.GenerateError, match=r"conversations.jsonl:3: id 't:000' "
                                                     r"already used at line 1"):
        generate.main(cfg)


def test_split_reasoning():
    s = split_reasoning
    assert s("plain") == ("plain", "")
    assert s("x", "r") == ("x", "r")
    assert s("<think>\na\n</think>\n\nb") == ("b", "a")
    assert s("a\n</think>\n\nb") == ("b", "a")
    assert s("<think>a") == ("", "a")
    assert s(None) == ("", "")
    assert request_seed(0, "a", 0) == request_seed(0, "a", 0)
    assert request_seed(0, "a", 0) != request_seed(0, "a", 1)


def test_local_engine(tmp_path, smollm2_dir):
    """engine=drafter through drafter.generation.local.LocalGenerator: multi-turn, turn by turn; a
    prompt over the target's context (SmolLM2: 8192) is its conversation's error, with its
    reason, and the others are answered."""
    from transformers import AutoTokenizer

    records = [conv(0, "Say hi."), conv(1, "Name a color.", "Another one?"),
               conv(2, "word " * 9000)]
    cfg = make_run(tmp_path, records, **{"generate.server.engine": "drafter",
                                         "generate.max_tokens": 4, "generate.batch_size": 2,
                                         "target.device": "cpu"})
    pipeline.run_step(cfg, "generate")
    out, m = check_invariants(cfg, records)
    assert m["counts"]["ok"] == 2 and m["counts"]["turns"] == 3
    assert m["counts"]["too_long"] == 1 and m["errors_by_reason"] == {"prompt too long": 1}
    assert [(e["id"], e["reason"]) for e in errors(cfg)] == [("t:002", "prompt too long")]
    assert "do not fit the target's context" in errors(cfg)[0]["message"]
    for r in out:
        for t in r["meta"]["turns"]:
            assert 1 <= t["completion_tokens"] <= 4 and t["finish_reason"] in ("stop", "length")
    # The second turn's prompt is the template rendering of the regenerated history.
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    msgs = out[1]["messages"][:3]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert out[1]["meta"]["turns"][1]["prompt_tokens"] == len(tok(text, add_special_tokens=False)
                                                              ["input_ids"])
    # phases_s: two timelines (this thread, the engine's), each summing to the step's seconds
    ph, secs = m["phases_s"], m["throughput"]["seconds"]
    assert ph["load"] > 0
    assert {"templates_tokenize", "detokenize", "write", "other"} <= set(ph["host"])
    assert set(ph["engine"]) == {"prefill", "decode", "wait_requests", "capture", "other"}
    assert ph["engine"]["decode"] > 0 and ph["engine"]["prefill"] > 0
    for part in ("host", "engine"):
        assert min(ph[part].values()) >= -0.05, ph
        assert abs(sum(ph[part].values()) - secs) <= 0.05 * secs + 0.5, (ph, secs)
    # what the engine did: every turn a request, prefilled in admissions of padded groups
    ec = m["engine_counts"]
    # (the prompt too long is a request too: answered "too_long" without a prefill)
    assert ec["requests"] == 4 and 1 <= ec["admissions"] <= 3 and ec["prefill_groups"] >= 1
    assert ec["prefill_tokens"] == sum(t["prompt_tokens"] for r in out for t in r["meta"]["turns"])
    assert ec["prefill_padded_tokens"] >= ec["prefill_tokens"]
    assert ec["steps"] > 0 and ec["sampling_steps"] == 0            # greedy
    assert ec["tokens"] >= m["tokens"]["completion"]                # stop tokens kept


def test_local_stream_equals_pools(tmp_path, smollm2_dir, monkeypatch):
    """engine=drafter, greedy: the streaming path (next turns put back while the engine decodes)
    writes the same records as decoding the pool turn by turn in calls (the static decoder's
    path), multi-turn conversations and a copy at another temperature included."""
    records = [conv(0, "Say hi."), conv(1, "Name a color.", "Another one?"),
               conv(2, "What is 2+2?", "And 3+3?", "And 4+4?", system="Be brief."),
               conv(3, "Name a fruit.")]
    kw = {"generate.server.engine": "drafter", "generate.max_tokens": 6,
          "generate.batch_size": 2, "target.device": "cpu"}
    cfg = make_run(tmp_path / "stream", records, **kw)
    pipeline.run_step(cfg, "generate")
    monkeypatch.setattr(generate, "_stream_local", generate._pools_local)
    pools = make_run(tmp_path / "pools", records, **kw)
    pipeline.run_step(pools, "generate")
    a, b = output(cfg), output(pools)
    assert [r["id"] for r in a] == [r["id"] for r in b] == [r["id"] for r in records]
    assert [r["messages"] for r in a] == [r["messages"] for r in b]
    assert [r["meta"]["turns"] for r in a] == [r["meta"]["turns"] for r in b]
    assert read_json(Run.of(pools).manifest("generate"))["phases_s"]["host"]["engine_calls"] > 0


def test_extra_temperatures_answer_every_conversation_again(tmp_path, smollm2_dir):
    """generate.extra_temperatures: each conversation is answered at generate.temperature under
    its id and once more per extra temperature as ID@tT (same split, its temperature in meta),
    in input order; a rerun with the copies done generates nothing; the greedy answers are the
    ones a run without copies writes."""
    records = [conv(0, "Say hi."), {**conv(1, "Name a color."), "split": "val"}]
    kw = {"generate.server.engine": "drafter", "generate.max_tokens": 6,
          "generate.batch_size": 4, "target.device": "cpu"}
    cfg = make_run(tmp_path / "a", records, **kw, **{"generate.extra_temperatures": [1.5]})
    m = pipeline.run_step(cfg, "generate")
    out = output(cfg)
    assert [r["id"] for r in out] == ["t:000", "t:000@t1.5", "t:001", "t:001@t1.5"]
    assert [r["split"] for r in out] == ["train", "train", "val", "val"]
    assert [r["meta"].get("generate_temperature") for r in out] == [None, 1.5, None, 1.5]
    assert m["counts"]["input"] == m["counts"]["ok"] == 4
    assert m["sampling"]["extra_temperatures"] == [1.5]
    again = generate.main(cfg)
    assert again["counts"]["generated"] == 0 and again["counts"]["ok"] == 4
    plain = make_run(tmp_path / "b", records, **kw)
    pipeline.run_step(plain, "generate")
    greedy = {r["id"]: r["messages"] for r in output(plain)}
    assert {r["id"]: r["messages"] for r in out if "@" not in r["id"]} == greedy
    assert any(r["messages"] != greedy[r["id"].split("@")[0]] for r in out if "@" in r["id"])
    # the body an HTTP engine gets carries the copy's temperature
    g = plain.generate
    assert generate.request_body(g, "m", [], 0)["temperature"] == g.temperature == 0.0
    assert generate.request_body(g, "m", [], 0, temperature=1.5)["temperature"] == 1.5


def test_the_served_temperatures_through_an_http_server(fake, tmp_path):
    """generate.extra_temperatures: evaluate answers every conversation once per served
    temperature (evaluate.temperatures) besides generate.temperature's, through an HTTP
    server: each copy's requests carry its own temperature, the manifest the list it resolved
    to, and one dataset holds them all (the copies in input order, the same split)."""
    records = [conv(0, "a"), conv(1, "b", "c")]
    cfg = fake_cfg(tmp_path, records, [fake.url], **{
        "generate.extra_temperatures": "evaluate", "evaluate.temperatures": [0.0, 0.7, 1.0, 0.7]})
    assert cfg.generate.extra_temperatures == [0.7, 1.0]
    m = pipeline.run_step(cfg, "generate")
    assert m["sampling"]["extra_temperatures"] == [0.7, 1.0]
    out = output(cfg)
    assert [r["id"] for r in out] == ["t:000", "t:000@t0.7", "t:000@t1", "t:001", "t:001@t0.7",
                                      "t:001@t1"]
    by_t = {}
    for b in fake.requests:
        by_t.setdefault(b["temperature"], []).append(b["messages"][-1]["content"])
    assert {t: sorted(v) for t, v in by_t.items()} == {t: ["a", "b", "c"]
                                                       for t in (0.0, 0.7, 1.0)}


def test_extra_temperatures_must_differ(tmp_path):
    with pytest.raises(C.ConfigError, match="extra_temperatures"):
        make_run(tmp_path, [conv(0, "q")], **{"generate.extra_temperatures": [0.0]})


def test_a_prompt_over_the_context_is_rejected_per_record(fake, tmp_path):
    """HTTP engines: a prompt whose rendered length + max_tokens exceeds the target's context
    (SmolLM2: 8192) is a permanent error of its record, counted as too_long and never sent, so
    one 60,000-word prompt cannot kill a `transformers serve` worker; the rest are answered."""
    huge = "word " * 60_000
    records = [conv(0, "q0"), conv(1, huge), conv(2, "q2")]
    cfg = fake_cfg(tmp_path, records, [fake.url], **{"generate.max_tokens": 64})
    m = pipeline.run_step(cfg, "generate")
    out, m = check_invariants(cfg, records)
    assert [r["id"] for r in out] == ["t:000", "t:002"]
    errs = errors(cfg)
    assert [(e["id"], e["kind"]) for e in errs] == [("t:001", "permanent")]
    assert errs[0]["reason"] == "prompt too long"
    assert errs[0]["message"].startswith("prompt too long:") and "8192" in errs[0]["message"]
    assert m["counts"]["too_long"] == 1 and m["counts"]["errors"] == 1
    assert all(len(json.dumps(b)) < 10_000 for b in fake.requests)   # never sent
    assert m["counts"]["ok"] == 2


def test_the_quality_recipe_is_one_config(shared_data):
    """configs/quality-smollm2.yaml: every pool of the shared train data, 40,000 synthetic
    prompts written on the data engine, each answered greedily and again at T=0.8, one online
    pass at lr 1.2e-3 on 0.1 CE + 0.9 TV with D-PACE's weights, evaluated at T 0, 0.7 and 1
    with a chain and a tree at batch 64. It is loaded (validated) here, not run."""
    cfg = C.load(REPO / "configs" / "quality-smollm2.yaml")
    pools = [s for s in cfg.prepare.sources if s.synthetic is None]
    assert sorted(Path(s.path).name for s in pools) == \
        sorted(p.name for p in (shared_data / "train").iterdir() if p.name != "README.md")
    assert all(s.path.startswith("../shared/data/train/") and (REPO / s.path).is_file()
               for s in pools)
    syn = [s for s in cfg.prepare.sources if s.synthetic is not None]
    assert len(syn) == 1 and syn[0].synthetic.count == 40_000
    g = cfg.generate
    assert (g.server.engine, g.temperature, g.extra_temperatures, g.batch_size) == \
        ("drafter", 0.0, [0.8], 2048)
    assert [v for _, v in generate.copies(g)] == [None, 0.8]
    t = cfg.train
    assert (t.online, t.epochs, t.lr, t.max_steps) == (True, 1, 1.2e-3, None)
    assert [(x.kind, x.weight) for x in t.loss] == [("ce", 0.1), ("tv", 0.9)]
    assert t.position_weight == "dpace"     # the measured best (BENCHMARKS.md, the losses)
    ev = cfg.evaluate
    assert (ev.temperatures, ev.methods, ev.batch_size) == ([0.0, 0.7, 1.0], ["chain", "tree"], 64)
    assert all((REPO / d.path).is_file() for d in ev.datasets)
