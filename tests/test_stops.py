"""Clean stops: `drafter run` stopped by SIGTERM (a scheduler's kill of its PID) or Ctrl-C (SIGINT
to the terminal's process group) inside each long step: generate (in-process, and behind a real
`transformers serve`), extract, online train and evaluate. Each stop exits 128 + the signal with no
abort message ("terminate called without an active exception": a thread still in torch when the
interpreter exits), leaves no child process and no thread of drafter's running at exit, and names
in the log what the rerun starts from; the rerun of the same command starts there.

Real subprocesses on CPU, a tiny random Llama with the SmolLM2 tokenizer. The command runs the CLI
under a probe that lists the threads still alive when the interpreter exits (daemon threads:
the ones nothing joined)."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from drafter.core.rundir import Run, read_json

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
       "TOKENIZERS_PARALLELISM": "false"}
# the CLI with a line at the interpreter's exit naming the threads still alive then
PROBE = ("import atexit, sys, threading\n"
         "atexit.register(lambda: print('threads at exit:', sorted(t.name for t in "
         "threading.enumerate() if t is not threading.main_thread()), file=sys.stderr, "
         "flush=True))\n"
         "from drafter.cli import main\n"
         "sys.exit(main())\n")
# tqdm's monitor: a daemon thread of tqdm's own that sleeps in Python until the process ends
HARMLESS = {"tqdm_monitor"}


def write_cfg(path: Path, run_dir: Path, model: Path, **over) -> Path:
    cfg = {
        "run_dir": str(run_dir),
        "target": {"model": str(model), "dtype": "float32", "device": "cpu"},
        "prepare": {"sources": [{"path": "builtin:quickstart-prompts", "max_samples": 40}],
                    "val_fraction": 0.2},
        "generate": {"concurrency": 2, "batch_size": 4, "max_tokens": 32,
                     "server": {"engine": "drafter", "startup_timeout": 300,
                                "stop_timeout": 10}},
        "tokenize": {"max_length": 128, "workers": 1},
        "vocab": {"draft_vocab_size": 256},
        "extract": {"shard_tokens": 32, "batch_tokens": 16},
        "train": {"ttt_steps": 2, "max_steps": 12, "save_every": 3, "keep_checkpoints": 2,
                  "batch_tokens": 128, "max_length": 64, "eval_every": 0, "log_every": 1,
                  "lr": 0.001, "dtype": "float32", "compile": False},
        "evaluate": {"datasets": [{"name": "q", "path": "builtin:quickstart-prompts",
                                   "max_prompts": 12}], "max_new_tokens": 32,
                     "run_recommended": False},
    }
    for dotted, value in over.items():
        d = cfg
        *head, last = dotted.split(".")
        for k in head:
            d = d.setdefault(k, {})
        d[last] = value
    path.write_text(yaml.safe_dump(cfg))
    return path


@contextlib.contextmanager
def running(cfg: Path, log: Path, until: str | None):
    """`drafter run CONFIG [--until STEP]` under the probe, in a session of its own (what a
    terminal or a scheduler would signal); killed with its group if the test leaves it."""
    with open(log, "ab") as f:
        p = subprocess.Popen(
            [sys.executable, "-c", PROBE, "run", str(cfg), *(["--until", until] if until else [])],
            cwd=REPO, env=ENV, stdout=f, stderr=f, start_new_session=True)
    try:
        yield p
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def finish(cfg: Path, log: Path, until: str | None) -> str:
    """Rerun the same command to its end; -> what this run logged."""
    at = log.stat().st_size if log.exists() else 0
    with running(cfg, log, until) as p:
        rc = p.wait(timeout=600)
    text = log.read_text(errors="replace")[at:]
    assert rc == 0, text[-4000:]
    return text


def group(pgid: int) -> list[psutil.Process]:
    """The live (not zombie) processes of a process group."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def stop_at(cfg: Path, run: Run, step: str, ready, log: Path, sig: int = signal.SIGTERM,
            until: str | None = None, whole_group: bool = False) -> dict:
    """Start the run, wait until `ready()` inside `step`, send `sig` to the drafter process
    (or, `whole_group`, to its process group as a terminal's Ctrl-C does), and check the stop:
    the exit status, no abort message, no thread of drafter's alive at exit, no child or member
    of its group left, the step's failed.json. -> {"log": this run's output, "children": the
    command lines of its children at the signal}."""
    at = log.stat().st_size if log.exists() else 0
    deadline = time.time() + 600
    with running(cfg, log, until or step) as p:
        while not (run.started(step).exists() and not run.manifest(step).exists() and ready()):
            assert p.poll() is None, f"finished before the stop: {log.read_text()[-3000:]}"
            assert time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.01)
        kids = psutil.Process(p.pid).children(recursive=True)
        cmds = [" ".join(k.cmdline()) for k in kids if k.is_running()]
        if whole_group:
            os.killpg(p.pid, sig)
        else:
            os.kill(p.pid, sig)
        rc = p.wait(timeout=180)
    text = log.read_text(errors="replace")[at:]
    assert rc == 128 + sig, text[-4000:]
    assert "terminate called" not in text and "Aborted" not in text, text[-4000:]
    names = re.findall(r"threads at exit: \[(.*)\]", text)
    assert names, text[-3000:]
    left = {n.strip().strip("'") for n in names[-1].split(",") if n.strip()}
    assert left <= HARMLESS, f"threads still running at exit: {left - HARMLESS}"
    t_end = time.time() + 30  # a child's own exit may trail its parent's by a moment
    while (alive := [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]
           + group(p.pid)) and time.time() < t_end:
        time.sleep(0.1)
    assert not alive, f"left running: {[k.cmdline() for k in alive]}"
    failed = read_json(run.failed(step))
    assert failed["interrupted"] is True and signal.Signals(sig).name in failed["error"]
    assert "rerun the same command to resume" in text
    return {"log": text, "children": cmds}


def lines_of(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def stopped_line(text: str, step: str) -> str:
    m = re.search(rf"I {step}: stopped; (.*)", text)
    assert m, text[-3000:]
    return m.group(1)


@pytest.fixture(scope="module")
def base(tmp_path_factory, smollm2_dir):
    """The tiny target and a run finished through export: each test copies it and stops one
    step of a rerun that redoes that step."""
    from tests.tiny import make_tiny

    root = tmp_path_factory.mktemp("stops")
    model = make_tiny("llama", root, tokenizer_dir=smollm2_dir)
    cfg = write_cfg(root / "base.yaml", root / "base", model)
    finish(cfg, root / "base.log", until="export")
    return {"root": root, "model": model, "run": root / "base"}


@pytest.fixture(scope="module")
def deep(tmp_path_factory, smollm2_dir):
    """A target of 32 layers, and a run finished through vocab: online, its forward takes longer
    than the drafter's step, as a real target's does, so that the loader's thread is inside the
    target when the signal comes."""
    from tests.tiny import make_tiny

    root = tmp_path_factory.mktemp("deep")
    model = make_tiny("llama", root, tokenizer_dir=smollm2_dir, num_hidden_layers=32)
    over = {"prepare.sources": [{"path": "builtin:quickstart-prompts", "max_samples": 16}],
            "generate.max_tokens": 16}
    finish(write_cfg(root / "deep.yaml", root / "deep", model, **over), root / "deep.log",
           until="vocab")
    return {"root": root, "model": model, "run": root / "deep", "over": over}


def copy_run(base: dict, tmp_path: Path, **over) -> tuple[Path, Run]:
    run_dir = tmp_path / "run"
    shutil.copytree(base["run"], run_dir)
    return write_cfg(tmp_path / "cfg.yaml", run_dir, base["model"], **base.get("over", {}),
                     **over), Run(run_dir)


# ----------------------------------------------------------------------------------- the steps
@pytest.mark.parametrize("sig,whole_group", [(signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["sigterm", "ctrl-c"])
def test_online_train_stops_clean_and_resumes_from_the_checkpoint_it_names(
        deep, tmp_path, sig, whole_group):
    """Online train: the prefetch thread runs the target's forward when the signal comes; the
    stop waits for it, names the newest checkpoint, and the rerun resumes from that one."""
    cfg, run = copy_run(deep, tmp_path, **{"train.online": True, "train.max_steps": 40})

    def ready():  # a checkpoint in, and steps beyond it
        return len(run.checkpoints()) >= 1 and lines_of(run.train_metrics()) >= 8

    out = stop_at(cfg, run, "train", ready, tmp_path / "log", sig, whole_group=whole_group)
    named = stopped_line(out["log"], "train")
    m = re.match(r"the rerun resumes from checkpoint (\S+) \(step (\d+)\)", named)
    assert m, named
    ckpt, step = Path(m.group(1)), int(m.group(2))
    assert ckpt == run.checkpoints()[-1] and step >= 3
    again = finish(cfg, tmp_path / "log", until="train")
    assert f"train: resumed from {ckpt} (step {step})" in again
    assert read_json(run.manifest("train"))["final_step"] == 40


def test_local_generate_stops_clean_and_keeps_its_answers(base, tmp_path):
    """generate in this process (engine drafter): the generator's thread decodes when the signal
    comes; the stop ends it, says how many answers the rerun keeps, and the rerun keeps them."""
    cfg, run = copy_run(base, tmp_path, **{"generate.max_tokens": 96})
    out = stop_at(cfg, run, "generate", lambda: lines_of(run.conversations("generate")) >= 3,
                  tmp_path / "log")
    m = re.match(r"the rerun keeps (\d+) conversations? answered", stopped_line(out["log"],
                                                                             "generate"))
    assert m and int(m.group(1)) == lines_of(run.conversations("generate")) >= 3
    again = finish(cfg, tmp_path / "log", until="generate")
    assert f"generate: 40 conversations: {m.group(1)} done" in again
    assert read_json(run.manifest("generate"))["counts"]["resumed"] == int(m.group(1))


def test_served_generate_stops_clean_and_its_server_with_it(base, tmp_path):
    """generate behind a real `transformers serve` (a supervisor and the server in a process
    group of their own): SIGTERM to drafter alone stops both, and the rerun keeps the answers."""
    cfg, run = copy_run(base, tmp_path, **{"generate.max_tokens": 96,
                                           "generate.server.engine": "transformers"})
    out = stop_at(cfg, run, "generate", lambda: lines_of(run.conversations("generate")) >= 2,
                  tmp_path / "log")
    assert any("serve" in c for c in out["children"]), out["children"]
    pgids = [int(x) for x in re.findall(r"pgid=(\d+)", run.server_log().read_text())]
    assert pgids and not any(group(g) for g in pgids)
    n = int(re.match(r"the rerun keeps (\d+)", stopped_line(out["log"], "generate")).group(1))
    assert n == lines_of(run.conversations("generate"))
    again = finish(cfg, tmp_path / "log", until="generate")
    assert f"generate: 40 conversations: {n} done" in again


def test_extract_stops_clean_and_keeps_its_shards(base, tmp_path):
    """extract: the shard writer's threads end with the step (the ones being written finish);
    the rerun keeps the shards the stop named."""
    cfg, run = copy_run(base, tmp_path, **{"extract.shard_tokens": 24})
    shutil.rmtree(run.step_dir("extract"))  # the changed shard size redoes them anyway

    def written():
        return sum(1 for s in ("train", "val") if run.shards(s).is_dir()
                   for _ in run.shards(s).glob("shard_*.safetensors"))

    out = stop_at(cfg, run, "extract", lambda: written() >= 3, tmp_path / "log")
    m = re.match(r"the rerun keeps (\d+) shards? written", stopped_line(out["log"], "extract"))
    assert m and int(m.group(1)) == written() >= 3
    finish(cfg, tmp_path / "log", until="extract")
    assert read_json(run.manifest("extract"))["counts"]["shards_kept"] == int(m.group(1))


def test_evaluate_stops_clean_and_keeps_its_finished_passes(base, tmp_path):
    """evaluate: stopped after its first decoding pass; the rerun keeps the passes named."""
    cfg, run = copy_run(base, tmp_path)
    passes = run.eval_passes()
    out = stop_at(cfg, run, "evaluate", lambda: passes.is_dir() and any(passes.glob("*.json")),
                  tmp_path / "log", until="evaluate")
    m = re.match(r"the rerun keeps (\d+) decoding pass(?:es)? finished",
                 stopped_line(out["log"], "evaluate"))
    assert m and int(m.group(1)) >= 1
    again = finish(cfg, tmp_path / "log", until="evaluate")
    assert again.count("kept from the interrupted run") == int(m.group(1))


def test_the_stop_names_what_each_step_resumes_from(tmp_path):
    """resume_point without a run behind it: train with no checkpoint, resume off, a named
    checkpoint; a step that keeps nothing."""
    from drafter.core import config as C
    from drafter.run.lifecycle import resume_point

    cfg = C.load(None, [f"run_dir={tmp_path}"])
    run = Run(tmp_path)
    assert resume_point(cfg, run, "train") == "no checkpoint yet: the rerun starts train over"
    cfg.train.resume = "off"
    assert "starts train over" in resume_point(cfg, run, "train")
    cfg.train.resume = "/ckpt/step_000010"
    assert resume_point(cfg, run, "train").endswith("(/ckpt/step_000010)")
    assert resume_point(cfg, run, "tokenize") == "the rerun redoes it"
    assert resume_point(cfg, run, "generate").startswith("the rerun keeps 0 conversations")
