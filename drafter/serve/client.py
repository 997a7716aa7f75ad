"""The generate step's OpenAI-compatible chat client over a serve.Pool: least-loaded endpoint,
retries with backoff, restart of a started server that died, over httpx with keep-alive.
"""
from __future__ import annotations

import asyncio
import json
import random
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from drafter.serve.servers import Pool


class RequestError(Exception):
    """A request that failed for good: `permanent` when a retry will not help (HTTP 4xx other
    than 408/429), else it outlasted the retries (connection errors, 5xx, timeouts)."""

    def __init__(self, message: str, permanent: bool):
        super().__init__(message)
        self.permanent = permanent


class ChatClient:
    """The OpenAI-compatible chat client of the generate step, over a Pool:

        client = ChatClient(pool, request_timeout=600, max_retries=5, retry_backoff=1.0)
        resp = await client.chat(body)      # the JSON response, or RequestError
        await client.close()

    Each request goes to the endpoint with the fewest requests in flight (another one on a retry
    when there are several); connection errors, timeouts, 5xx, 408 and 429 are retried with
    exponential backoff (and a dead server drafter started is restarted); other 4xx are final.

    httpx with keep-alive connections, one pool per endpoint sized by the concurrency (httpx's
    pool scans its connections on every request, so small pools keep that cheap; against a real
    server the client gave 0.98 of a bare asyncio load generator's throughput on a 2-core CPU)."""

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
        avoid = None
        for attempt in range(self.max_retries + 1):
            ep = self.pool.pick(avoid)
            generation = ep.server.generation if ep.server else 0
            ep.inflight += 1
            try:
                async with asyncio.timeout(self.request_timeout):
                    status, payload = await self._post(ep.url, "/v1/chat/completions", data)
            except (httpx.TransportError, OSError, TimeoutError) as e:
                err = f"{type(e).__name__}: {e}".rstrip(": ")
                if isinstance(e, TimeoutError):
                    err = f"timeout after {self.request_timeout:.0f}s (generate.request_timeout)"
            else:
                text = payload[:1000].decode(errors="replace")
                if status == 200:
                    try:
                        return json.loads(payload)
                    except ValueError as e:
                        err = f"bad JSON in the response ({e}): {text[:300]}"
                elif status >= 500 or status in (408, 429):
                    err = f"HTTP {status}: {text[:300]}"
                else:
                    raise RequestError(f"HTTP {status} from {ep.url}: {text}", permanent=True)
            finally:
                ep.inflight -= 1
            # A server drafter started that died is restarted (by whoever notices first).
            if self.pool.recover(ep, generation):
                continue
            avoid = ep
            if attempt == self.max_retries:
                raise RequestError(f"{err} (after {self.max_retries} retries; last at {ep.url})",
                                   permanent=False)
            delay = min(60.0, self.retry_backoff * 2 ** attempt)
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
        raise AssertionError("unreachable")

    async def close(self) -> None:
        for c in self.clients.values():
            await c.aclose()
        self.clients.clear()
