"""The generate step's OpenAI-compatible chat client over a serve.Pool: least-loaded endpoint,
retries with backoff, restart of a started server that died, over httpx with keep-alive.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from drafter.serve.servers import Pool


class RequestError(Exception):
    """A request that failed for good: `permanent` when a retry will not help (HTTP 4xx other
    than 408/429), else it outlasted the retries (connection errors, 5xx, timeouts). `reason`
    is a short key shared by every request that failed the same way ("HTTP 400: context length
    exceeded", "timeout", "connection error (ConnectError)"); the message has the details."""

    def __init__(self, message: str, permanent: bool, reason: str):
        super().__init__(message)
        self.permanent = permanent
        self.reason = reason


# A 4xx body that says the prompt does not fit, in the words vLLM, SGLang, transformers serve
# and OpenAI use: these group under one reason whatever the numbers in them.
_CONTEXT = re.compile(r"context length|context window|maximum context|max_model_len|too long|"
                      r"longer than|max_position|exceeds? the (model|maximum)", re.I)


def body_reason(status: int, text: str) -> str:
    """The short reason of an HTTP error response: `HTTP <status>: <what the body says>`, where
    the body's message (OpenAI's `error.message`, vLLM's `message`, FastAPI's `detail`, else the
    text) is "context length exceeded" when it says so, else its first clause with numbers as N
    and quoted text as '...' (so that counts group), at most 60 characters."""
    msg = text
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        msg = (err.get("message") if isinstance(err, dict) else err) or obj.get("message") \
            or obj.get("detail") or text
        if isinstance(msg, list):  # FastAPI's validation errors: [{"msg": ...}, ...]
            msg = next((m.get("msg") for m in msg if isinstance(m, dict) and m.get("msg")),
                       text)
    msg = str(msg)
    if _CONTEXT.search(msg):
        return f"HTTP {status}: context length exceeded"
    msg = re.sub(r"'[^']*'|\"[^\"]*\"", "'...'", msg)
    msg = re.sub(r"\d+(\.\d+)?", "N", msg)
    msg = re.split(r"[;:\n(]|\.(?=\s|$)", msg.strip(), maxsplit=1)[0].strip()[:60].rstrip()
    return f"HTTP {status}: {msg}" if msg else f"HTTP {status}"


class ChatClient:
    """The OpenAI-compatible chat client of the generate step, over a Pool:

        client = ChatClient(pool, request_timeout=600, max_retries=5, retry_backoff=1.0)
        resp = await client.chat(body)      # the JSON response, or RequestError
        await client.close()

    Each request goes to the endpoint with the fewest requests in flight (another one on a retry
    when there are several); connection errors, timeouts, 5xx, 408 and 429 are retried with
    exponential backoff (and a dead server drafter started is restarted); other 4xx are final.

    httpx with keep-alive connections, one pool per endpoint sized by the concurrency (httpx's
    pool scans its connections on every request, so small pools keep that cheap: against a real
    server the client keeps up with a bare asyncio load generator)."""

    def __init__(self, pool: "Pool", request_timeout: float = 600.0, max_retries: int = 5,
                 retry_backoff: float = 1.0, concurrency: int = 64):
        self.pool = pool
        self.request_timeout = request_timeout
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self.concurrency = concurrency
        self.clients: dict = {}  # endpoint URL -> httpx.AsyncClient

    def _client(self, url: str):
        import httpx

        if url not in self.clients:
            self.clients[url] = httpx.AsyncClient(
                base_url=url, headers={**self.pool.headers, "User-Agent": "drafter"},
                timeout=httpx.Timeout(self.request_timeout),
                limits=httpx.Limits(max_connections=self.concurrency,
                                    max_keepalive_connections=self.concurrency),
                # proxies from the environment apply to external URLs, never to loopback
                trust_env=urlsplit(url).hostname not in ("127.0.0.1", "localhost", "::1"))
        return self.clients[url]

    async def _post(self, url: str, path: str, data: bytes) -> tuple[int, bytes]:
        r = await self._client(url).post(path, content=data,
                                         headers={"Content-Type": "application/json"})
        return r.status_code, r.content

    async def chat(self, body: dict) -> dict:
        import httpx

        data = json.dumps(body).encode()
        avoid, reason = None, None
        for attempt in range(self.max_retries + 1):
            ep = self.pool.pick(avoid)
            generation = ep.server.generation if ep.server else 0
            ep.inflight += 1
            try:
                async with asyncio.timeout(self.request_timeout):
                    status, payload = await self._post(ep.url, "/v1/chat/completions", data)
            except (httpx.TransportError, OSError, TimeoutError) as e:
                err = f"{type(e).__name__}: {e}".rstrip(": ")
                reason = f"connection error ({type(e).__name__})"
                if isinstance(e, (TimeoutError, httpx.TimeoutException)):
                    err = f"timeout after {self.request_timeout:.0f}s (generate.request_timeout)"
                    reason = "timeout"
            else:
                text = payload[:1000].decode(errors="replace")
                if status == 200:
                    try:
                        return json.loads(payload)
                    except ValueError as e:
                        err = f"bad JSON in the response ({e}): {text[:300]}"
                        reason = "bad JSON in the response"
                elif status >= 500 or status in (408, 429):
                    err = f"HTTP {status}: {text[:300]}"
                    reason = f"HTTP {status}"
                else:
                    raise RequestError(f"HTTP {status} from {ep.url}: {text}", permanent=True,
                                       reason=body_reason(status, text))
            finally:
                ep.inflight -= 1
            # A server drafter started that died is restarted (by whoever notices first).
            if self.pool.recover(ep, generation):
                continue
            avoid = ep
            if attempt == self.max_retries:
                raise RequestError(f"{err} (after {self.max_retries} retries; last at {ep.url})",
                                   permanent=False, reason=reason)
            delay = min(60.0, self.retry_backoff * 2 ** attempt)
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
        raise AssertionError("unreachable")

    async def close(self) -> None:
        for c in self.clients.values():
            await c.aclose()
        self.clients.clear()
