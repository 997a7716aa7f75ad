"""Client overhead of the generate step: drafter's generate throughput (tokens/s) against a bare
asyncio load generator, on the same server, same prompts, same concurrency. Target: drafter
reaches at least 95% of the bare generator (issue 4, BENCHMARKS.md).

    # CPU, tiny: starts `transformers serve` on the embedded SmolLM2 (one thread per server)
    python benchmarks/generate_client.py --tiny
    # GPU: a started server (transformers with continuous batching, or vllm / sglang)
    python benchmarks/generate_client.py --engine transformers --prompts 512 --max-tokens 256 \
        --concurrency 64
    # any running OpenAI-compatible server
    python benchmarks/generate_client.py --url http://127.0.0.1:8000/v1 --concurrency 256
    # the clients' own ceiling: a server that answers at once
    python benchmarks/generate_client.py --fake --prompts 2000 --concurrency 64

The bare generator is plain asyncio streams speaking HTTP/1.1 with keep-alive, one connection per
worker: no HTTP library, no files, no progress bar. drafter is `drafter.steps.generate.main` on a
fresh run directory (reading the prompts, its HTTP client, retries bookkeeping, JSONL appends,
the final reordering pass), timed end to end. After a warm-up, runs go in pairs (alternating
which client goes first, so that a change in the machine's load hits both alike); the table
reports every run and the client's own CPU time per request, then the median over pairs of
drafter/bare. Temperature 0 so both produce the same answers, hence about the same token counts.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from drafter.core import config as C  # noqa: E402
from drafter.core.rundir import Run, atomic_json  # noqa: E402
from drafter.serve import servers as serve  # noqa: E402
from drafter.steps import generate  # noqa: E402

# --fake: an OpenAI-compatible server that answers at once (raw ASGI on uvicorn, which
# transformers[serving] installs), so that the client is the bottleneck: its own ceiling.
FAKE_SERVER = r"""
import json, sys, uvicorn
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    if scope["method"] == "GET":
        out = {"status": "ok", "data": [{"id": "fake"}]}
    else:
        data, more = b"", True
        while more:
            msg = await receive()
            data, more = data + msg.get("body", b""), msg.get("more_body", False)
        n = json.loads(data).get("max_tokens", 16)
        out = {"choices": [{"index": 0, "finish_reason": "length",
                            "message": {"role": "assistant", "content": "tok " * n}}],
               "usage": {"prompt_tokens": 12, "completion_tokens": n}}
    raw = json.dumps(out).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
    await send({"type": "http.response.body", "body": raw})
uvicorn.run(app, host=sys.argv[1], port=int(sys.argv[2]), log_level="warning", lifespan="off")
"""


def load_prompts(path: str | None, n: int) -> list[str]:
    """n prompts: from a JSONL file (prompt / question / instruction field) or the builtin
    quickstart prompts, cycled with a suffix when there are fewer than n."""
    p = Path(path) if path else REPO / "drafter" / "data" / "quickstart_prompts.jsonl"
    base = []
    for line in p.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            base.append(r.get("prompt") or r.get("question") or r.get("instruction"))
    return [base[i % len(base)] + ("" if i < len(base) else f" (variant {i // len(base)})")
            for i in range(n)]


def request_body(model: str, prompt: str, i: int, a) -> dict:
    """The body drafter's client sends (same function, same values)."""
    g = C.GenerateConfig(max_tokens=a.max_tokens, temperature=0.0)
    return generate.request_body(g, model, [{"role": "user", "content": prompt}],
                                 generate.request_seed(g.seed, f"bench:{i:06d}", 0))


# ------------------------------------------------------------------------- the bare load generator
async def _read_response(reader) -> dict:
    status = await reader.readline()
    if not status:
        raise ConnectionError("server closed the connection")
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        payload = await reader.readexactly(int(headers["content-length"]))
    else:  # chunked
        parts = []
        while (size := int((await reader.readline()).strip(), 16)) > 0:
            parts.append(await reader.readexactly(size))
            await reader.readline()
        await reader.readline()
        payload = b"".join(parts)
    code = int(status.split()[1])
    if code != 200:
        raise RuntimeError(f"HTTP {code}: {payload[:200]!r}")
    return json.loads(payload)


async def bare(url: str, bodies: list[dict], concurrency: int) -> tuple[float, int]:
    u = urlsplit(url)
    host, port = u.hostname, u.port or 80
    queue: asyncio.Queue = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(json.dumps(b).encode())
    tokens = 0

    async def worker():
        nonlocal tokens
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while not queue.empty():
                data = queue.get_nowait()
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s:%d\r\n"
                             b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                             % (host.encode(), port, len(data)) + data)
                await writer.drain()
                resp = await _read_response(reader)
                tokens += resp["usage"]["completion_tokens"]
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return time.perf_counter() - t0, tokens


# ---------------------------------------------------------------------------------------- drafter
def drafter_run(url: str, prompts: list[str], a, root: Path) -> tuple[float, int]:
    run = Run(root)
    p = run.conversations("prepare")
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w") as f:
        for i, q in enumerate(prompts):
            f.write(json.dumps({"id": f"bench:{i:06d}", "source": "bench", "split": "train",
                                "messages": [{"role": "user", "content": q}]}) + "\n")
    atomic_json(run.manifest("prepare"), {"step": "prepare", "counts": {}})
    cfg = C.load(None, [f"run_dir={root}", "generate.server.engine=external",
                        f"generate.server.urls=[{url}]", f"generate.concurrency={a.concurrency}",
                        f"generate.max_tokens={a.max_tokens}", "generate.temperature=0.0"])
    t0 = time.perf_counter()
    res = generate.main(cfg)
    seconds = time.perf_counter() - t0
    assert res["counts"]["ok"] == len(prompts), res["counts"]
    return seconds, res["tokens"]["completion"]


# ------------------------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="an OpenAI-compatible server (default: start one)")
    ap.add_argument("--engine", default="transformers", choices=["transformers", "vllm", "sglang"],
                    help="server to start when --url is not given")
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct", help="target.model")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompts-file", help="JSONL with prompt/question/instruction fields")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each client, alternating")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU size: 12 prompts x 16 tokens, concurrency 4, 5 pairs of runs")
    ap.add_argument("--fake", action="store_true",
                    help="a server that answers at once: the clients' own ceiling")
    a = ap.parse_args()
    if a.tiny:
        a.prompts, a.max_tokens, a.concurrency, a.repeats = 12, 16, 4, 5
        # One thread per CPU server: OpenMP threads spin against other processes otherwise.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("MKL_NUM_THREADS", "1")
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    prompts = load_prompts(a.prompts_file, a.prompts)

    with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
        tmp = Path(tmp)
        cfg = C.load(None, [f"run_dir={tmp / 'server'}", f"target.model={a.model}",
                            f"generate.server.engine={'external' if a.url else a.engine}",
                            f"generate.concurrency={a.concurrency}",
                            f"generate.max_tokens={a.max_tokens}"]
                     + ([f"generate.server.urls=[{a.url}]"] if a.url else []))
        if a.fake:
            (tmp / "fake.py").write_text(FAKE_SERVER)
            cfg.generate.server.command = f"{{python}} {tmp / 'fake.py'} {{host}} {{port}}"
        with serve.servers(cfg, tmp / "server.log") as pool:
            url, model = pool.urls[0], pool.model
            bodies = [request_body(model, q, i, a) for i, q in enumerate(prompts)]
            print(f"server {url} ({pool.engine}), model {model}", file=sys.stderr)
            # Warm-up: continuous batching allocates its cache on the first requests.
            asyncio.run(bare(url, bodies[:a.concurrency], a.concurrency))
            rows = []  # (client, run, seconds, tokens, client CPU seconds)
            for r in range(a.repeats):
                # Pairs run back to back, in alternating order, so that a change in the load of
                # the machine hits both clients of a pair alike.
                order = ("bare", "drafter") if r % 2 == 0 else ("drafter", "bare")
                for name in order:
                    c0 = time.process_time()
                    if name == "bare":
                        s, t = asyncio.run(bare(url, bodies, a.concurrency))
                    else:
                        s, t = drafter_run(url, prompts, a, tmp / f"run{r}")
                    rows.append((name, r + 1, s, t, time.process_time() - c0))
                    print(f"{name:<7} run {r + 1}: {t} tokens in {s:.2f}s", file=sys.stderr)

    server = "instant fake server" if a.fake else f"{pool.engine} server, model {a.model}"
    print(f"\nclient overhead: {a.prompts} prompts x max_tokens {a.max_tokens}, concurrency "
          f"{a.concurrency}, {server}")
    print(f"{'client':<8} {'run':>3} {'seconds':>8} {'tokens':>7} {'tok/s':>9} {'req/s':>7} "
          f"{'client CPU ms/req':>17}")
    for name, r, s, t, cpu in rows:
        print(f"{name:<8} {r:>3} {s:>8.2f} {t:>7} {t / s:>9.1f} {a.prompts / s:>7.1f} "
              f"{1000 * cpu / a.prompts:>17.2f}")
    tps = {(n, r): t / s for n, r, s, t, _ in rows}
    pairs = [tps[("drafter", r)] / tps[("bare", r)] for r in range(1, a.repeats + 1)]
    med = {n: statistics.median(v for (m, _), v in tps.items() if m == n)
           for n in ("bare", "drafter")}
    ratio = statistics.median(pairs)
    print(f"median tok/s: bare {med['bare']:.1f}, drafter {med['drafter']:.1f}; drafter/bare per "
          f"pair {' '.join(f'{p:.3f}' for p in pairs)}; median {ratio:.3f} "
          f"({'PASS' if ratio >= 0.95 else 'FAIL'}: target >= 0.95)")
    return 0 if ratio >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
