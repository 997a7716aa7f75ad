"""One server process drafter started, and nothing left of it after it stops.

    srv = ManagedServer(lambda port: argv, host, port, log_path, startup_timeout, stop_timeout)
    srv.start()          # spawned under the supervisor, then GET /health until 200
    srv.restart()        # after it died
    srv.stop()           # returns when no process of its group is left

A started server runs in its own process group (its own session), under a small supervisor
(SUPERVISOR below), with its output in the log file. Stopping sends SIGTERM to the whole group,
waits `stop_timeout`, then SIGKILL, and waits until no process of the group is left, so engine
workers (vLLM spawns several) never outlive the step. If drafter itself dies, even by kill -9,
the kernel signals the supervisor (PR_SET_PDEATHSIG, Linux), which takes the group down the same
way: no orphan keeps GPU memory. A server that never answers `GET /health` with 200 within
`startup_timeout`, or exits while starting, raises ServerError with the last lines of its log.

Which command to start, and for which config, is drafter.serve.servers's business: this module knows
only an argv, a port and a log file.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from drafter import DrafterError

log = logging.getLogger("drafter")

# How many log lines an error shows.
TAIL_LINES = 40
# Sessions of the servers this process started (start_new_session: a server's pid is its session
# id, and its workers inherit it even when the server dies first): after generate, a GPU holder
# in one of these is a leftover of ours; any other new holder is someone else's
# (gpu_release.wait_gpu_released).
STARTED_SESSIONS: set[int] = set()


class ServerError(DrafterError):
    """A server that cannot start, never becomes healthy, or died and cannot be restarted."""


# ------------------------------------------------------------------------------------------ helpers
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def group_alive(pgid: int) -> bool:
    """Whether any process of the group is left (zombies included, until reaped)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_with(parent: int):
    """preexec_fn of the supervisor: SIGTERM it when the process that started it dies."""
    prctl = None
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):  # resolved before the fork, not in the child
            prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec():
        if prctl is not None:
            PR_SET_PDEATHSIG = 1
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # drafter died before the line above took effect
            os._exit(1)
    return preexec


# The server runs under this supervisor, which leads the server's process group. PDEATHSIG only
# reaches the process drafter forked, not the engine workers below it, so the supervisor turns
# its own SIGTERM (from drafter's stop, or from the kernel when drafter dies, even by SIGKILL)
# into SIGTERM to the whole group, waits the grace period, then SIGKILLs the group. When the
# server exits on its own, the supervisor exits with its code after SIGTERMing what is left.
# argv: GRACE_SECONDS -- SERVER_ARGV...
SUPERVISOR = r"""
import os, signal, subprocess, sys, time
grace, argv, child = float(sys.argv[1]), sys.argv[3:], None
def running(pid):  # waitpid, not child.poll(): the main thread may hold Popen's wait lock
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == 0
    except ChildProcessError:
        return False
def down(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    end = time.time() + grace
    while child is not None and running(child.pid) and time.time() < end:
        time.sleep(0.1)
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGTERM, down)
signal.signal(signal.SIGINT, down)
child = subprocess.Popen(argv)
code = child.wait()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.killpg(0, signal.SIGTERM)
sys.exit(code if code >= 0 else 128 - code)
"""


def read_tail(path: Path, n: int = TAIL_LINES) -> str:
    """The last n lines of the current server's log (after the last drafter header)."""
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    lines = text.replace("\r", "\n").splitlines()
    starts = [i for i, x in enumerate(lines) if x.startswith("==== drafter:") and " starting " in x]
    lines = lines[starts[-1]:] if starts else lines
    return "\n".join(lines[-n:]) if lines else "(empty log)"


def _server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_DISABLE_UPDATE_CHECK", "1")  # the transformers CLI phones PyPI otherwise
    env.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")  # log lines reach server.log as they happen
    return env


# ---------------------------------------------------------------------------------- managed server
class ManagedServer:
    """One server process (group) drafter started: start, wait for health, restart, stop."""

    def __init__(self, argv_for_port, host: str, port: int, log_path: Path,
                 startup_timeout: float, stop_timeout: float, name: str = "server",
                 env: dict[str, str] | None = None):
        self.argv_for_port = argv_for_port  # port -> argv
        self.env = env or {}
        self.host = host
        self.port = port or free_port(host)
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.pgid: int | None = None
        self.generation = 0  # bumped on every (re)start: clients tell a new server from the old

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = TAIL_LINES) -> str:
        return read_tail(self.log_path, n)

    def spawn(self) -> None:
        argv = self.argv_for_port(self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n==== drafter: {time.strftime('%Y-%m-%d %H:%M:%S')} starting "
                       f"{shlex.join(argv)}\n".encode())
            logf.flush()
            try:
                # Popen from the calling thread: PDEATHSIG fires when *that thread* ends, so
                # drafter starts servers from its main thread only.
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", SUPERVISOR, str(self.stop_timeout), "--", *argv],
                    stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=_die_with(os.getpid()),
                    env={**_server_env(), **self.env})
            except OSError as e:
                raise ServerError(f"cannot start the {self.name}: {e}") from None
            self.pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
            STARTED_SESSIONS.add(self.proc.pid)
            logf.write(f"==== drafter: pid={self.proc.pid} pgid={self.pgid} url={self.url}\n"
                       .encode())
        self.generation += 1
        log.info("%s: started pid %d, waiting for %s/health (log: %s)", self.name,
                 self.proc.pid, self.url, self.log_path)

    def wait_healthy(self) -> None:
        """Block until GET /health is 200; ServerError (server stopped) on exit or timeout."""
        import httpx

        t0 = time.time()
        last_note = t0
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    self.stop()
                    raise ServerError(
                        f"the {self.name} exited with code {code} while starting "
                        f"(log: {self.log_path}); last lines:\n{self.tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        log.info("%s: healthy at %s after %.1fs", self.name, self.url,
                                 time.time() - t0)
                        return
                if time.time() - t0 > self.startup_timeout:
                    self.stop()
                    raise ServerError(
                        f"the {self.name} did not become healthy within "
                        f"{self.startup_timeout:.0f}s (generate.server.startup_timeout; "
                        f"log: {self.log_path}); last lines:\n{self.tail()}")
                if time.time() - last_note > 60:
                    log.info("%s: still starting (%.0fs)", self.name, time.time() - t0)
                    last_note = time.time()
                time.sleep(0.25)

    def start(self) -> None:
        self.spawn()
        try:
            self.wait_healthy()
        except ServerError as e:
            # The chosen port was taken between free_port() and the bind: once more elsewhere.
            if "address already in use" not in str(e).lower():
                raise
            self.port = free_port(self.host)
            self.spawn()
            self.wait_healthy()

    def restart(self) -> None:
        log.warning("%s: died (exit code %s); restarting. Last lines:\n%s", self.name,
                    self.proc.poll() if self.proc else None, self.tail(10))
        self.stop()
        self.start()

    def stop(self) -> None:
        """SIGTERM to the group, wait, SIGKILL; return when no process of the group is left."""
        if self.proc is None:
            return
        pgid, proc = self.pgid, self.proc
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:  # the supervisor itself SIGKILLs the group after stop_timeout
            proc.wait(timeout=self.stop_timeout + 5)
        except subprocess.TimeoutExpired:
            log.warning("%s: no exit %.0fs after SIGTERM; sending SIGKILL", self.name,
                        self.stop_timeout)
        # Workers of the engine may outlive the leader; give them the rest of the grace period.
        deadline = time.time() + self.stop_timeout
        while group_alive(pgid) and time.time() < deadline and proc.poll() is not None:
            time.sleep(0.1)
        if group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        deadline = time.time() + 10
        while group_alive(pgid) and time.time() < deadline:
            time.sleep(0.1)
        if group_alive(pgid):
            log.warning("%s: process group %d still has processes after SIGKILL (zombies not "
                        "yet reaped?)", self.name, pgid)
        else:
            log.info("%s: stopped (pid %d)", self.name, proc.pid)
        self.proc = None
