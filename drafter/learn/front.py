"""The HTTP front clients reach: vLLM's OpenAI routes passed through to the engine behind it,
and a share of the requests kept with the tokens the target produced (drafter/learn/traffic.py).

    front = Front(run, cfg.learn, host, port, upstream=lambda: engine.url)
    front.start()          # a thread serving http://host:port/v1/...
    front.url, front.stats
    front.stop()

Only these routes pass: POST /v1/chat/completions, /v1/completions; GET /v1/models, /health,
/metrics, /version. vLLM's weight routes (reachable on the engine because drafter starts it in
its development mode: docs/learn.md, "Who can reach what") never do. A kept request is sent on
with `return_token_ids: true`, which makes vLLM return the prompt's and the answer's token ids
(streamed or not); the front takes them out of the response again unless the client asked for
them, so a client sees what vLLM alone would have answered. A request vLLM refuses or that
fails is passed back as it came and never kept. While the engine restarts, requests get 503.
"""
from __future__ import annotations

import json
import logging
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from drafter.core.rundir import Run
from drafter.learn import traffic

log = logging.getLogger("drafter")

POSTS = ("/v1/chat/completions", "/v1/completions")
GETS = ("/v1/models", "/health", "/metrics", "/version")
HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding",
       "host"}
# token id fields a kept request's response carries only because the front asked for them
ADDED = ("prompt_token_ids", "token_ids")


class Front:
    def __init__(self, run: Run, lc, host: str, port: int, upstream, default_temperature=1.0,
                 seed: int | None = None, timeout: float = 3600.0):
        self.run, self.lc = run, lc
        self.upstream = upstream            # () -> the engine's root URL, or None (restarting)
        self.default_temperature = default_temperature
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.stats = {"requests": 0, "kept": 0, "refused": 0, "errors": 0}
        self.timeout = timeout
        self.server = ThreadingHTTPServer((host, port), _handler(self))
        self.server.daemon_threads = True
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        self.thread = threading.Thread(target=self.server.serve_forever, name="learn-front",
                                       daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def count(self, key: str) -> None:
        with self.lock:
            self.stats[key] += 1

    def sample(self) -> bool:
        with self.lock:
            return self.lc.sample_rate > 0 and self.rng.random() < self.lc.sample_rate

    def keep(self, body: dict, prompt: list[int] | None, answers: dict[int, dict]) -> None:
        """The kept request's choices into the traffic folder (one record per choice; the
        prompt's ids come with the response, or with each choice: /v1/completions)."""
        T = body.get("temperature")
        T = self.default_temperature if T is None else float(T)
        top_p = float(body.get("top_p") if body.get("top_p") is not None else 1.0)
        for a in answers.values():
            ids = a.get("prompt") or prompt
            if a.get("ids") and ids:
                traffic.keep(self.run, ids, a["ids"], T, top_p, a.get("finish"),
                             self.lc.holdout)
                self.count("kept")


def _collect(obj: dict, answers: dict[int, dict], asked: bool) -> list[int] | None:
    """The token ids of one response (or stream chunk) into `answers` by choice index; takes
    them out of `obj` unless the client asked for them. Returns the prompt's ids if present."""
    prompt = obj.get("prompt_token_ids")
    for ch in obj.get("choices") or []:
        a = answers.setdefault(ch.get("index", 0), {"ids": []})
        a["ids"] += ch.get("token_ids") or []
        if ch.get("prompt_token_ids"):
            a["prompt"] = ch["prompt_token_ids"]
        if ch.get("finish_reason"):
            a["finish"] = ch["finish_reason"]
        if not asked:
            for k in ADDED:
                if k in ch:
                    ch[k] = None
    if not asked and "prompt_token_ids" in obj:
        obj["prompt_token_ids"] = None
    return prompt


def _handler(front: Front):
    import httpx

    client = httpx.Client(timeout=front.timeout, trust_env=False)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"   # a streamed body ends when the connection closes

        def log_message(self, *args) -> None:   # requests are never logged
            pass

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, code: int, message: str) -> None:
            self._send(code, json.dumps({"error": {"message": message, "code": code}}).encode())

        def _headers(self) -> dict:
            return {k: v for k, v in self.headers.items() if k.lower() not in HOP}

        def do_GET(self) -> None:  # noqa: N802
            path = self.path.split("?")[0]
            base = front.upstream()
            if path not in GETS:
                return self._error(404, f"{path}: not served here")
            if base is None:
                return self._error(503, "the engine is restarting")
            try:
                r = client.get(base + self.path, headers=self._headers())
            except httpx.HTTPError as e:
                return self._error(502, f"engine unreachable: {type(e).__name__}")
            self._send(r.status_code, r.content, r.headers.get("content-type", "text/plain"))

        def do_POST(self) -> None:  # noqa: N802
            path = self.path.split("?")[0]
            if path not in POSTS:
                return self._error(404, f"{path}: not served here")
            front.count("requests")
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            base = front.upstream()
            if base is None:
                return self._error(503, "the engine is restarting")
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            kept = isinstance(body, dict) and front.sample()
            asked = bool(body.get("return_token_ids")) if isinstance(body, dict) else False
            if kept:
                raw = json.dumps({**body, "return_token_ids": True}).encode()
            headers = {**self._headers(), "Content-Type": "application/json"}
            stream = isinstance(body, dict) and bool(body.get("stream"))
            try:
                with client.stream("POST", base + self.path, content=raw,
                                   headers=headers) as r:
                    if r.status_code != 200 or not kept:
                        return self._pass(r, stream and r.status_code == 200)
                    if stream:
                        return self._stream(r, body, asked)
                    data = json.loads(r.read())
            except httpx.HTTPError as e:
                front.count("errors")
                return self._error(502, f"engine unreachable: {type(e).__name__}")
            answers: dict[int, dict] = {}
            prompt = _collect(data, answers, asked)
            self._send(200, json.dumps(data).encode())
            front.keep(body, prompt, answers)

        def _pass(self, r, stream: bool) -> None:
            if r.status_code != 200:
                front.count("refused")
            if not stream:
                return self._send(r.status_code, r.read(),
                                  r.headers.get("content-type", "application/json"))
            self.send_response(r.status_code)
            self.send_header("Content-Type", r.headers.get("content-type", "text/event-stream"))
            self.end_headers()
            for chunk in r.iter_raw():
                self.wfile.write(chunk)
                self.wfile.flush()

        def _stream(self, r, body: dict, asked: bool) -> None:
            """Server-sent events, one `data: {...}` line an event: each chunk's token ids
            collected (and taken out), the rest passed on as it comes."""
            self.send_response(200)
            self.send_header("Content-Type", r.headers.get("content-type", "text/event-stream"))
            self.end_headers()
            answers: dict[int, dict] = {}
            prompt, done = None, False
            for line in r.iter_lines():
                if line.startswith("data: ") and line[6:].strip() != "[DONE]":
                    try:
                        obj = json.loads(line[6:])
                    except ValueError:
                        obj = None
                    if isinstance(obj, dict):
                        prompt = _collect(obj, answers, asked) or prompt
                        line = "data: " + json.dumps(obj)
                elif line.strip() == "data: [DONE]":
                    done = True
                self.wfile.write((line + "\n").encode())
                self.wfile.flush()
            if done:   # a stream cut short is not a whole answer: not kept
                front.keep(body, prompt, answers)

    return Handler
