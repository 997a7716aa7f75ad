"""Served acceptance under a traffic shift, with and without `drafter learn`'s learning.

    drafter run benchmarks/learn-shift-smollm2.yaml --until export      # the chat drafter
    python benchmarks/learn_shift.py benchmarks/learn-shift-smollm2.yaml \
        --out benchmarks/results/learn-shift-smollm2.json --lock /tmp/vllm.lock

For each temperature and mode, a fresh `drafter learn` (RUN_DIR-<mode>-t<T>/, vLLM serving the
run's export first) gets the same stream of chat requests: MT-bench's first turns outside its
math and coding categories, then code (HumanEval), then math (GSM8K test), each request once,
`--concurrency` at a time. Mode `static` keeps nothing (learn.sample_rate=0): the drafter
trained on chat serves throughout; `learn` keeps every request and swaps candidates in as the
learner finds them better. Every `--window` requests the script reads vLLM's spec-decode
counters through the front (GET /metrics): τ = 1 + accepted / (draft tokens / K) of the
window, the drafter served, the served tokens/s, and whether a round was training meanwhile. Before
the stream, `--overhead` requests timed through the front and straight to vLLM in turns give
the front's own cost (in the static runs, which keep nothing). With `--pace`, a window starts
at least that many seconds after the one before: traffic at a rate, not as fast as vLLM serves.

Afterwards each swap is checked once more apart from the loop's own judgement: the drafter
swapped out and the one swapped in, decoded by drafter's evaluator on `--check` shifted prompts
that were never served (HumanEval's and GSM8K's next ones), at the run's temperature: the one
swapped in must not accept less (the figures and the paired test's verdict are recorded).

The JSON holds every window, swap, round and check, and per run and phase the pooled τ; the
summary prints τ per phase, static against learn, and on the shifted phases the ratio.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EVAL = REPO.parent / "shared" / "data" / "eval"


def prompts(phases: dict[str, int], check: int) -> tuple[list[tuple[str, str]], list[str]]:
    """The served stream [(phase, user text)] in order, and the never-served check prompts."""
    mt = [json.loads(x) for x in open(EVAL / "mt_bench_questions.jsonl")]
    chat = [q["turns"][0] for q in mt if q["category"] not in ("math", "coding")]
    he = [json.loads(x)["prompt"] for x in gzip.open(EVAL / "humaneval.jsonl.gz", "rt")]
    code = [f"Complete this Python function:\n\n{p}" for p in he]
    math = [json.loads(x)["question"] for x in open(EVAL / "gsm8k_test.jsonl")]
    pools = {"chat": chat, "code": code, "math": math}
    stream = [(name, pools[name][i]) for name, n in phases.items() for i in range(n)]
    nxt = [pools[name][phases[name] + i] for name in ("code", "math")
           for i in range(check // 2) if name in phases]
    return stream, nxt


def _get(url: str, path: str):
    import httpx

    return httpx.get(url + path, timeout=60, trust_env=False)


def counters(url: str) -> dict:
    from drafter.learn.engine import parse_counters

    return parse_counters(_get(url, "/metrics").text)


def chat(url: str, model: str, text: str, T: float, max_tokens: int) -> int:
    import httpx

    r = httpx.post(url + "/v1/chat/completions", timeout=1800, trust_env=False,
                   json={"model": model, "messages": [{"role": "user", "content": text}],
                         "max_tokens": max_tokens, "temperature": T, "seed": 0})
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


def serve_run(args, cfg_path: Path, run_dir: Path, drafter: Path, mode: str, T: float,
              stream: list[tuple[str, str]]) -> dict:
    from drafter.core.rundir import read_json, read_jsonl
    from drafter.serve.supervisor import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    over = [f"run_dir={run_dir}", f"learn.drafter={drafter}", f"generate.server.port={port}",
            *args.set]
    if mode == "static":
        over.append("learn.sample_rate=0")
    out = run_dir.with_suffix(".out")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "drafter.cli", "learn", str(cfg_path), *over],
                            env=env, stdout=open(out, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    windows, t_start = [], time.time()
    try:
        while "/v1\n" not in out.read_text(errors="replace"):
            if proc.poll() is not None:
                raise SystemExit(out.read_text()[-3000:])
            time.sleep(1)
        model = _get(url, "/v1/models").json()["data"][0]["id"]
        # in static runs only: a learning run would keep the timed requests
        overhead = front_overhead(run_dir, url, model, stream, args) \
            if args.overhead and mode == "static" else None
        before = counters(url)
        t0 = time.time()
        for w0 in range(0, len(stream), args.window):
            part = stream[w0:w0 + args.window]
            if windows:   # traffic at a rate: a window starts --pace seconds after the last
                time.sleep(max(0.0, args.pace - (time.time() - t0)))
            t0 = time.time()
            with cf.ThreadPoolExecutor(args.concurrency) as ex:
                toks = list(ex.map(lambda x: chat(url, model, x[1], T, args.max_tokens), part))
            dt = time.time() - t0
            now = counters(url)
            d = {key: now[key] - before[key] for key in now}
            before = now
            serving = read_json(run_dir / "learn/serving.json")["version"]
            rounds = sorted((run_dir / "learn/rounds").glob("r*")) \
                if (run_dir / "learn/rounds").exists() else []
            busy = bool(rounds) and not (rounds[-1] / "judged.json").exists()
            steps = d["draft_tokens"] / args.k
            windows.append({"first": w0, "phase": part[0][0], "requests": len(part),
                            "version": serving, "tokens": sum(toks), "seconds": round(dt, 2),
                            "tokens_per_s": round(sum(toks) / dt, 2), "learner_busy": busy,
                            **d, "tau": round(1 + d["accepted"] / steps, 5) if steps else None,
                            "elapsed_s": round(time.time() - t_start, 1)})
            w = windows[-1]
            print(f"  {mode} T={T:g} {w['phase']:>4} req {w0:>3}-{w0 + len(part) - 1:<3} "
                  f"{serving} tau {w['tau']} {w['tokens_per_s']} tok/s"
                  f"{' (round training)' if busy else ''}", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(300)
    learn = run_dir / "learn"
    swaps = read_jsonl(learn / "swaps.jsonl") if (learn / "swaps.jsonl").exists() else []
    rounds = [read_json(p / "judged.json") for p in sorted((learn / "rounds").glob("r*"))
              if (p / "judged.json").exists()] if (learn / "rounds").exists() else []
    return {"mode": mode, "temperature": T, "run_dir": str(run_dir), "overhead": overhead,
            "windows": windows,
            "swaps": swaps, "rounds": rounds, "phases": pooled(windows, args.k),
            "seconds": round(time.time() - t_start, 1)}


def front_overhead(run_dir: Path, url: str, model: str, stream, args) -> dict:
    """The front's cost: `--overhead` requests, one at a time, each sent to the front and
    straight to vLLM in turns (greedy, 16 tokens; the same prompts), their mean latency."""
    lines = [x for x in (run_dir / "learn/server.log").read_text().splitlines()
             if x.startswith("==== drafter: pid=")]
    direct = lines[-1].split("url=")[1].strip()
    t = {"front": [], "direct": []}
    for i in range(args.overhead):
        for name, base in (("front", url), ("direct", direct))[::1 if i % 2 else -1]:
            t0 = time.perf_counter()
            chat(base, model, stream[i % len(stream)][1], 0.0, 16)
            t[name].append(time.perf_counter() - t0)
    mean = {k: sum(v) / len(v) for k, v in t.items()}
    return {"requests": args.overhead, "front_s": round(mean["front"], 4),
            "direct_s": round(mean["direct"], 4),
            "added_ms": round(1000 * (mean["front"] - mean["direct"]), 1)}


def pooled(windows: list[dict], k: int) -> dict:
    """τ per phase over all its windows, and over the second half of each phase's windows."""
    out = {}
    for ph in dict.fromkeys(w["phase"] for w in windows):
        ws = [w for w in windows if w["phase"] == ph]
        for key, sel in (("all", ws), ("second_half", ws[len(ws) // 2:])):
            steps = sum(w["draft_tokens"] for w in sel) / k
            acc = sum(w["accepted"] for w in sel)
            out.setdefault(ph, {})[key] = {
                "tau": round(1 + acc / steps, 5) if steps else None, "steps": steps,
                "requests": sum(w["requests"] for w in sel),
                "tokens_per_s": round(sum(w["tokens"] for w in sel) /
                                      max(sum(w["seconds"] for w in sel), 1e-9), 2)}
    return out


def check_swaps(cfg, res: dict, check_prompts: list[str], max_new: int) -> list[dict]:
    """Each swap of a learning run judged again on prompts it never served (module doc)."""
    import torch

    from drafter.core.rundir import Run
    from drafter.core.target import load_model, load_tokenizer
    from drafter.decoding.decode import Decoder, stop_ids_of
    from drafter.export.enginedir import load_drafter_dir
    from drafter.export.engines import target_info
    from drafter.learn import judge, learner, versions

    swaps = [s for s in res["swaps"] if s.get("kind") == "swap"]
    if not swaps:
        return []
    torch.set_num_threads(learner.CPU_THREADS)   # the machine shared: as the learner decodes
    tok = load_tokenizer(cfg.target)
    model = load_model(cfg.target, "cpu", torch.float32)
    dec, stop = Decoder(model, max_batch=1), stop_ids_of(tok, model)
    ti = target_info(cfg.target.model, cfg.target)
    reqs = [{"prompt_ids": tok(tok.apply_chat_template([{"role": "user", "content": p}],
                                                       add_generation_prompt=True,
                                                       tokenize=False),
                               add_special_tokens=False).input_ids,
             "temperature": res["temperature"], "top_p": 1.0} for p in check_prompts]
    run = Run(res["run_dir"])
    out = []
    for s in swaps:
        h = {}
        for v in (s["from"], s["to"]):
            dr = load_drafter_dir(versions.path_of(run, v), dtype=torch.float32, target=ti)
            h[v] = judge.acceptance(dec, dr, reqs, cfg.export.speculative_tokens, max_new, stop,
                                    seed=1)
        v = judge.compare(h[s["from"]], h[s["to"]])
        out.append({"from": s["from"], "to": s["to"], "tau_from": v["tau_base"],
                    "tau_to": v["tau_cand"], "gain": v["gain"], "lower": v["lower"],
                    "better": v["better"], "not_worse": v["tau_cand"] >= v["tau_base"],
                    "prompts": v["prompts"]})
        print(f"  check {s['from']} -> {s['to']}: tau {v['tau_base']} -> {v['tau_cand']}",
              flush=True)
    return out


@contextlib.contextmanager
def locked(path: str | None):
    """Hold the machine's vLLM lock (flock) for one run, so that other vLLM jobs go between."""
    if not path:
        yield
        return
    import fcntl

    with open(path, "a") as f:
        while True:   # polled: a blocking flock would not give way to Ctrl-C
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--out", required=True)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--modes", default="static,learn")
    ap.add_argument("--phases", default="chat=32,code=96,math=96")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--pace", type=float, default=0.0, help="seconds from one window's start "
                    "to the next's at least: traffic at a rate, not as fast as vLLM serves")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--check", type=int, default=16, help="never-served prompts per swap check")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for `drafter learn` (both modes), e.g. "
                    "train.max_steps=12 to bound a round")
    ap.add_argument("--lock", help="a file to flock around each run (one vLLM at a time on a "
                    "shared machine: /tmp/vllm.lock)")
    ap.add_argument("--overhead", type=int, default=16, help="requests timed through the front "
                    "and straight to vLLM, in turns, before the stream (0: none)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from drafter.core import config as C
    from drafter.core.rundir import Run

    cfg = C.load(args.config)
    args.k = cfg.export.speculative_tokens
    run = Run.of(cfg)
    drafter = run.export("native").resolve()
    if not drafter.exists():
        raise SystemExit(f"{drafter}: run `drafter run {args.config} --until export` first")
    phases = {p.split("=")[0]: int(p.split("=")[1]) for p in args.phases.split(",")}
    stream, check = prompts(phases, args.check)
    results = {"config": args.config, "overrides": args.set, "pace_s": args.pace,
               "phases": phases,
               "window": args.window, "concurrency": args.concurrency,
               "max_tokens": args.max_tokens, "k": args.k,
               "drafter": str(drafter), "runs": []}
    outp = Path(args.out)
    for T in [float(x) for x in args.temperatures.split(",")]:
        for mode in args.modes.split(","):
            run_dir = Path(f"{run.root}-{mode}-t{T:g}").resolve()
            if run_dir.exists():
                raise SystemExit(f"{run_dir} exists: each run starts fresh (move it away)")
            print(f"{mode} at T={T:g}: {run_dir}", flush=True)
            with locked(args.lock):
                res = serve_run(args, Path(args.config), run_dir, drafter, mode, T, stream)
            if mode == "learn":
                res["checks"] = check_swaps(cfg, res, check, cfg.evaluate.max_new_tokens)
            results["runs"].append(res)
            outp.write_text(json.dumps(results, indent=1))
    summary(results)
    return 0


def summary(results: dict) -> None:
    for T in sorted({r["temperature"] for r in results["runs"]}):
        runs = {r["mode"]: r for r in results["runs"] if r["temperature"] == T}
        print(f"\nT={T:g}: tau per phase (all windows / second half)")
        for ph in results["phases"]:
            row = []
            for mode in ("static", "learn"):
                p = runs.get(mode, {}).get("phases", {}).get(ph)
                row.append(f"{mode} {p['all']['tau']} / {p['second_half']['tau']}" if p else "")
            print(f"  {ph:>5}: " + "   ".join(row))
        if "static" in runs and "learn" in runs:
            for ph in results["phases"]:
                if ph == "chat":
                    continue
                r = [runs["learn"]["phases"][ph][h]["tau"] / runs["static"]["phases"][ph][h]["tau"]
                     for h in ("all", "second_half")]
                print(f"  {ph}: learn / static = {r[0]:.3f} (all), {r[1]:.3f} (second half)")


if __name__ == "__main__":
    sys.exit(main())
