"""`drafter learn`: serve the target with a drafter in vLLM and keep learning from the traffic.

    drafter learn CONFIG [key=value ...]            serve and learn until Ctrl-C / SIGTERM
    drafter learn CONFIG --rollback [VERSION]       serve the drafter served before (or VERSION)

One process holds RUN_DIR/learn/.lock and runs, until stopped:
- vLLM on the serving drafter (drafter/learn/engine.py), restarted on the same drafter when it
  dies (generate.server.max_restarts in a row);
- the front clients reach on generate.server.host:port (127.0.0.1 unless
  generate.server.allow_remote), which keeps a share of the requests (drafter/learn/front.py);
- the learner, a child process (`drafter learn CONFIG --learner`, drafter/learn/learner.py),
  restarted when it dies; serving goes on without it meanwhile;
- every second: a rollback asked for (rollback.json) or a candidate proposed (proposal.json)
  swapped in, then serving.json and swaps.jsonl updated (drafter/learn/versions.py); a
  proposal made from another drafter than the one served now is dropped; the retention limits
  applied to the kept requests; every WINDOW_SECONDS, vLLM's served acceptance of the window
  logged and added to served.jsonl.

A rerun after any kill serves serving.json's drafter and resumes the learner's round.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from drafter import DrafterError
from drafter.core import config as C
from drafter.core.configload import is_local_host
from drafter.core.rundir import JsonlAppender, Run, atomic_write, pid_lock, pid_unlock
from drafter.learn import front as F
from drafter.learn import traffic, versions
from drafter.learn.engine import Engine, EngineError
from drafter.serve.supervisor import ServerError

log = logging.getLogger("drafter")

WINDOW_SECONDS = 30.0
PRUNE_SECONDS = 30.0
LEARNER_NICE = 10   # the scheduler favours the engine's threads over the learner's


class LearnError(DrafterError):
    pass


# -------------------------------------------------------------------------------- the first one
def first_version(cfg, run: Run) -> str:
    """v0000 from learn.drafter, served first; the version serving.json names afterwards."""
    cur = versions.serving(run)
    if cur is not None:
        return cur["version"]
    from drafter.export.enginedir import load_drafter_dir
    from drafter.export.engines import DTYPES, target_info

    spec = cfg.learn.drafter
    src = run.export("native") if spec == "export" else Path(spec).expanduser()
    if not src.exists():
        raise LearnError(f"learn.drafter ({C.where(cfg, 'learn.drafter')}): {src} not found; "
                         "run `drafter run CONFIG --until export` first, or name a drafter dir")
    ckpts = sorted(p for p in src.glob("step_[0-9]*") if (p / "COMPLETE").exists())
    if ckpts and not (src / "config.json").exists() and not (src / "drafter_config.json").exists():
        src = ckpts[-1]   # a train dir: its latest complete checkpoint
    target = target_info(cfg.target.model, cfg.target)
    dr = load_drafter_dir(src, target=target, dtype=DTYPES[cfg.export.dtype])
    if not (run.learn_version(0) / versions.META).exists():
        versions.write_version(run, 0, dr, target, DTYPES[cfg.export.dtype],
                               {"from": str(Path(src).resolve())})
    versions.set_serving(run, versions.name(0), {"kind": "start", "from": None,
                                                 "how": "first start"})
    return versions.name(0)


# ------------------------------------------------------------------------------------- rollback
def rollback(cfg, to: str | None, wait_s: float = 900.0) -> int:
    """Serve `to` (default: the drafter served before the current one): through the running
    `drafter learn` when one holds the lock (it swaps it in), else from the next start."""
    run = Run.of(cfg)
    target = versions.rollback_target(run, to)
    run.learn().mkdir(parents=True, exist_ok=True)
    f, holder = pid_lock(run.learn(".lock"))
    if f is not None:
        try:
            cur = versions.serving(run)
            versions.set_serving(run, target, {"kind": "rollback", "from": cur and
                                               cur["version"], "how": "at the next start"})
        finally:
            pid_unlock(f)
        print(f"{target} will be served at the next `drafter learn` (nothing is serving now)")
        return 0
    versions.request_rollback(run, target)
    t0 = time.time()
    while time.time() - t0 < wait_s:
        cur = versions.serving(run)
        if cur and cur["version"] == target and versions.rollback_request(run) is None:
            print(f"serving {target} (drafter learn PID {holder})")
            return 0
        time.sleep(0.5)
    raise LearnError(f"asked the running drafter learn (PID {holder}) to serve {target}; it has "
                     f"not within {wait_s:.0f} s (its log: {run.learn('server.log')})")


# ---------------------------------------------------------------------------------- the learner
class Learner:
    """The learner child: started, watched, restarted, stopped with the group."""

    def __init__(self, cfg_path: Path, log_path: Path):
        self.cfg_path, self.log_path = cfg_path, log_path
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    def start(self) -> None:
        from drafter.serve.supervisor import _die_with

        die = _die_with(os.getpid())

        def preexec():   # dies with drafter learn; its CPU work yields to serving's
            die()
            os.nice(LEARNER_NICE)

        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "drafter.cli", "learn", str(self.cfg_path), "--learner"],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                preexec_fn=preexec, env=os.environ.copy())
        log.info("learn: learner started (pid %d, log %s)", self.proc.pid, self.log_path)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -------------------------------------------------------------------------------------- serving
class Served:
    """The running parts and the main loop's steps (module doc)."""

    def __init__(self, cfg, run: Run):
        self.cfg, self.run = cfg, run
        self.engine = Engine(cfg, run, run.learn("server.log"))
        self.front: F.Front | None = None
        self.learner: Learner | None = None
        self.window = {"time": time.time(), "counters": None}
        self.engine_restarts = 0

    def version(self) -> str:
        return versions.serving(self.run)["version"]

    def swap_to(self, version: str, kind: str, figures: dict | None = None) -> dict | None:
        """Serve `version`; None when vLLM cannot serve it (then it serves the one it served,
        restarted if need be, and swaps.jsonl says why)."""
        cur = self.version()
        self._window_close()   # the window so far belongs to the drafter served so far
        try:
            meta = versions.version_meta(self.run, version)
            how = self.engine.swap(versions.path_of(self.run, version), version,
                                   meta.get("sha256"))
        except (ServerError, EngineError, versions.VersionError) as e:
            log.warning("learn: cannot serve %s (%s); serving %s on", version, e, cur)
            if not (self.engine.ready and self.engine.alive()):
                self.engine.restart(versions.path_of(self.run, cur))
            with JsonlAppender(self.run.learn("swaps.jsonl")) as f:
                f.write({"time": time.time(), "kind": "failed", "to": cur, "tried": version,
                         "error": str(e)[:2000]})
            return None
        rec = {"kind": kind, "from": cur, **how, "figures": figures}
        versions.set_serving(self.run, version, rec)
        log.info("learn: serving %s (was %s; %s %s, %.3f s)%s", version, cur, kind, how["how"],
                 how["seconds"], f": tau {figures.get('tau_cand')} against "
                 f"{figures.get('tau_base')}, lower bound of the gain {figures.get('lower')}"
                 if figures else "")
        return rec

    def step(self) -> None:
        """One turn of the main loop."""
        sc = self.cfg.generate.server
        if not self.engine.alive():
            if self.engine_restarts >= sc.max_restarts:
                raise LearnError(f"vLLM died {self.engine_restarts + 1} times in a row "
                                 f"(generate.server.max_restarts); log "
                                 f"{self.run.learn('server.log')}")
            self.engine_restarts += 1
            self.engine.restart(versions.path_of(self.run, self.version()))
            self.window = {"time": time.time(), "counters": None}
            with JsonlAppender(self.run.learn("swaps.jsonl")) as f:
                f.write({"time": time.time(), "kind": "restart", "to": self.version(),
                         "how": "vLLM died: restarted on the serving drafter"})
        if self.learner is not None and not self.learner.alive():
            self.learner.restarts += 1
            if self.learner.restarts <= max(sc.max_restarts, 1):
                log.warning("learn: the learner exited (code %s); restarting it",
                            self.learner.proc.returncode)
                self.learner.start()
            else:
                log.warning("learn: the learner exited %d times; serving goes on without "
                            "learning (its log: %s)", self.learner.restarts,
                            self.learner.log_path)
                self.learner = None
        rb = versions.rollback_request(self.run)
        if rb is not None:
            if rb["to"] != self.version():
                self.swap_to(rb["to"], "rollback")
            versions.clear(self.run, "rollback")
        p = versions.proposal(self.run)
        if p is not None:
            if p.get("based_on") == self.version():
                self.swap_to(p["version"], "swap", p.get("figures"))
            else:
                log.info("learn: %s was trained from %s, not from %s served now: kept aside",
                         p["version"], p.get("based_on"), self.version())
            versions.clear(self.run, "proposal")
        if time.time() - self.window["time"] >= WINDOW_SECONDS:
            self._window_close()

    def _window_close(self) -> None:
        """vLLM's served acceptance since the window opened, logged and kept in served.jsonl."""
        try:
            now = self.engine.counters()
        except Exception:  # noqa: BLE001  (an engine mid-restart: the next window)
            return
        before, t0 = self.window["counters"], self.window["time"]
        self.window = {"time": time.time(), "counters": now}
        if before is None or now["draft_tokens"] < before["draft_tokens"]:
            return
        d = {k: now[k] - before[k] for k in now}
        if not d["draft_tokens"]:
            return
        k = self.cfg.export.speculative_tokens
        steps = d["draft_tokens"] / k
        tau = 1 + d["accepted"] / steps
        rec = {"time": time.time(), "seconds": round(time.time() - t0, 1),
               "version": self.version(), "k": k, **d, "tau": round(tau, 5)}
        with JsonlAppender(self.run.learn("served.jsonl")) as f:
            f.write(rec)
        log.info("learn: served tau %.3f over %d steps (%s)", tau, int(steps), rec["version"])


def main(cfg, learner: bool = False, rollback_to: str | None = None,
         rollback_asked: bool = False) -> int:
    if learner:
        from drafter.learn.learner import main as learn_main

        return learn_main(cfg)
    if rollback_asked:
        return rollback(cfg, rollback_to)
    run = Run.of(cfg)
    sc = cfg.generate.server
    if not is_local_host(sc.host):   # allowed by generate.server.allow_remote (configload.py)
        log.warning("learn: clients reach the target from other machines at %s "
                    "(generate.server.allow_remote)", sc.host)
    run.learn().mkdir(parents=True, exist_ok=True)
    f, holder = pid_lock(run.learn(".lock"))
    if f is None:
        raise LearnError(f"{run.learn()} is served by another drafter learn (PID {holder})")
    served = Served(cfg, run)
    try:
        version = first_version(cfg, run)
        cfg_path = run.learn("config.yaml")
        atomic_write(cfg_path, C.dump(cfg))   # the learner reads the same resolved config
        secs = served.engine.start(versions.path_of(run, version))
        log.info("learn: vLLM serves %s (started in %.1f s; drafter swaps %s)", version, secs,
                 "in place" if served.engine.in_place else "by restarting vLLM")
        served.front = F.Front(run, cfg.learn, sc.host, sc.port, lambda: served.engine.url,
                               default_temperature=_default_temperature(cfg),
                               seed=cfg.generate.seed)
        served.front.start()
        served.learner = Learner(cfg_path, run.learn("learner.log"))
        served.learner.start()
        print(f"serving {cfg.target.model} with drafter {version}\n{served.front.url}/v1\n"
              f"(learning in {run.learn()}; Ctrl-C stops)", flush=True)
        pruned = 0.0
        while True:
            served.step()
            if served.engine.alive():
                served.engine_restarts = 0
            if time.time() - pruned > PRUNE_SECONDS:
                traffic.prune(run, cfg.learn)
                pruned = time.time()
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("stopped", flush=True)
        raise
    finally:
        if served.front is not None:
            served.front.stop()
        if served.learner is not None:
            served.learner.stop()
        served.engine.stop()
        pid_unlock(f)


def _default_temperature(cfg) -> float:
    """The temperature vLLM samples a request at that names none: the target's
    generation_config.json's, else 1 (vLLM's own default)."""
    import json

    from drafter.core.target import resolve

    p = Path(resolve(cfg.target.model)) / "generation_config.json"
    try:
        t = json.loads(p.read_text()).get("temperature")
    except (OSError, ValueError):
        t = None
    return float(t) if t is not None else 1.0
