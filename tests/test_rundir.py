"""Run directory: manifests (skip, force, stale downstream, missing input) and atomic writes.

The pipeline mechanism is exercised with small step functions defined here (they write real
files in a real run directory); the real steps have their own tests."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from drafter.core import config as C
from drafter.core.rundir import JsonlAppender, MissingInput, Run, atomic_write, read_jsonl
from drafter.run import pipeline

CALLS = []


def fake_steps(monkeypatch):
    """prepare writes a file from its config; generate and tokenize copy their input."""
    def prepare(cfg):
        CALLS.append("prepare")
        atomic_write(Run.of(cfg).conversations("prepare"), f"seed={cfg.prepare.seed}\n")
        return {"counts": {"records": 1}}

    def generate(cfg):
        CALLS.append("generate")
        run = Run.of(cfg)
        text = run.require(run.conversations("prepare"), "prepare").read_text()
        atomic_write(run.conversations("generate"), text)
        return {"counts": {"ok": 1}}

    def tokenize(cfg):
        CALLS.append("tokenize")
        return {"counts": {"samples": 1}}

    steps = {"prepare": prepare, "generate": generate, "tokenize": tokenize}
    monkeypatch.setattr(pipeline, "_step_fn", lambda name: steps[name])
    CALLS.clear()


def cfg_for(tmp_path, *over):
    return C.load(None, [f"run_dir={tmp_path / 'run'}", *over])


def test_skip_force_and_stale(tmp_path, monkeypatch):
    fake_steps(monkeypatch)
    cfg = cfg_for(tmp_path)
    steps = ["prepare", "generate", "tokenize"]
    pipeline.run_all(cfg, steps=steps)
    assert CALLS == steps
    m = json.loads(Run.of(cfg).manifest("prepare").read_text())
    assert m["counts"] == {"records": 1} and "torch" in m["versions"] and m["seconds"] >= 0
    assert [s["state"] for s in pipeline.status(cfg.run_dir)["steps"][:3]] == ["done"] * 3

    CALLS.clear()
    pipeline.run_all(cfg, steps=steps)  # everything up to date
    assert CALLS == []

    pipeline.run_step(cfg, "generate", force=True)  # force redoes one step...
    assert CALLS == ["generate"]
    # ...whose new manifest makes tokenize stale (its recorded input hash no longer matches)
    states = {s["name"]: s["state"] for s in pipeline.status(cfg.run_dir)["steps"]}
    assert states["tokenize"] == "stale" and states["generate"] == "done"

    # A config change upstream makes every downstream step stale, transitively.
    cfg2 = cfg_for(tmp_path, "prepare.seed=7")
    pipeline.run_step(cfg2, "prepare")  # writes config.yaml with the new seed
    states = {s["name"]: s["state"] for s in pipeline.status(cfg.run_dir)["steps"]}
    assert states == {**states, "prepare": "done", "generate": "stale", "tokenize": "stale"}
    CALLS.clear()
    pipeline.run_all(cfg2, steps=steps)
    assert CALLS == ["generate", "tokenize"]
    assert Run.of(cfg2).conversations("generate").read_text() == "seed=7\n"


def test_new_fields_at_their_neutral_value_keep_fingerprints(tmp_path, monkeypatch):
    """A field added by a later release, at the value that behaves as before, leaves the hash
    of a step finished before it existed unchanged (no 4-minute generate redone)."""
    import hashlib

    from drafter.core.rundir import NEUTRAL, SECTIONS, UNHASHED

    monkeypatch.setattr(pipeline, "RETIRED", {})  # retired fields: the test after this one
    for dotted in NEUTRAL:
        step = next(s for s, secs in SECTIONS.items() if dotted.split(".")[0] in secs)
        cfg = cfg_for(tmp_path)
        parts = {s: C.to_dict(pipeline._section_value(cfg, s)) for s in SECTIONS[step]}
        for name in UNHASHED:  # never hashed (where chunks pass)
            parts.get(name.split(".")[0], {}).pop(name.split(".")[1], None)
        for name, value in NEUTRAL.items():  # the config as written before these fields existed
            section, *path = name.split(".")
            if section not in parts:
                continue
            ds = [parts[section]]
            for key in path[:-1]:  # through a list (prepare.sources.field): every item's
                ds = [x for d in ds for x in (d[key] if isinstance(d[key], list) else [d[key]])]
            for d in ds:
                assert d[path[-1]] == value  # the default is the neutral value
                del d[path[-1]]
        before = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
        assert pipeline.config_hash(cfg, step) == before
        value = NEUTRAL[dotted]
        other = {"train.draft_layer": "mla", "train.mla": "{v_head_dim: 64}",
                 "train.method": "dspark", "train.dspark": "{block_size: 4}",
                 "train.loss": "[{kind: tv}]", "train.position_weight": "dpace",
                 "train.optimizer": "muon"}.get(dotted) or (
            "[0.5]" if isinstance(value, list) else "true" if value is False else
            "false" if value is True else "1")
        section, *path = dotted.split(".")
        over = f"{dotted}={other}"
        if len(path) == 2 and isinstance(C.to_dict(getattr(cfg, section)).get(path[0]), list):
            over = f"{section}.{path[0]}[0].{path[1]}=Instruction"  # a key of a list's items
        assert pipeline.config_hash(cfg_for(tmp_path, over), step) != before, over


# Keys a config held before they were removed, and values spelled otherwise then (config.REMOVED,
# rundir.RETIRED): what a run dir's snapshot from then holds for today's default config (and
# for today's overrides below); NEUTRAL_BEFORE, the NEUTRAL entries drafter had for them then.
BEFORE = {"train.gc_freeze": True, "train.saved_graphs": True, "train.loader_threads": 4,
          "extract.self_check": True, "extract.packing": "auto", "evaluate.cuda_graphs": True,
          "extract.engine": "transformers", "generate.server.engine": "local"}
NEUTRAL_BEFORE = {"train.gc_freeze": True, "train.saved_graphs": True}
TODAY = ["generate.server.engine=drafter"]


def _at(d: dict, dotted: str):
    *path, last = dotted.split(".")
    for key in path:
        d = d.setdefault(key, {})
    return d, last


def test_a_snapshot_from_before_keys_were_retired_keeps_its_fingerprints(tmp_path):
    """A run dir's snapshot written before keys were removed and values renamed still reads
    (`drafter status`: validate=False), and each step's fingerprint is the one drafter gave it
    then: no finished step is redone for the change. Loaded as a config, it fails."""
    import hashlib

    import yaml

    from drafter.core.rundir import NEUTRAL, SECTIONS, UNHASHED

    old = C.to_dict(cfg_for(tmp_path, *TODAY))
    for dotted, value in BEFORE.items():
        d, key = _at(old, dotted)
        d[key] = value
    snap = tmp_path / "config.yaml"
    snap.write_text(yaml.safe_dump(old))
    with pytest.raises(C.ConfigError, match=r"config\.yaml:\d+: .*no longer|is now"):
        C.load(snap)
    cfg = C.load(snap, validate=False)
    assert cfg == cfg_for(tmp_path, *TODAY)
    for step, sections in SECTIONS.items():
        parts = {}
        for name in sections:  # as drafter hashed it then
            d, key = _at(json.loads(json.dumps(old)), name)
            parts[name] = d[key]
        for dotted in UNHASHED:  # keys no fingerprint ever held
            section, key = dotted.split(".")
            parts.get(section, {}).pop(key, None)
        for dotted, value in {**NEUTRAL, **NEUTRAL_BEFORE}.items():
            section, *path = dotted.split(".")
            if section in parts and path:
                ds = [parts[section]]
                for key in path[:-1]:  # through a list: every item's
                    ds = [x for d in ds for x in (d[key] if isinstance(d[key], list)
                                                  else [d[key]])]
                for d in ds:
                    if d.get(path[-1], not value) == value:
                        del d[path[-1]]
        then = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
        assert pipeline.config_hash(cfg, step) == then, step


def test_missing_input_names_the_producer(tmp_path, monkeypatch):
    fake_steps(monkeypatch)
    cfg = cfg_for(tmp_path)
    with pytest.raises(MissingInput, match=r"drafter prepare CONFIG"):
        pipeline.run_step(cfg, "generate")


def test_failed_step_is_reported(tmp_path, monkeypatch):
    def boom(cfg):
        raise ValueError("bad record at x.jsonl:3")

    monkeypatch.setattr(pipeline, "_step_fn", lambda name: boom)
    cfg = cfg_for(tmp_path)
    with pytest.raises(ValueError):
        pipeline.run_step(cfg, "prepare")
    row = pipeline.status(cfg.run_dir)["steps"][0]
    assert row["state"] == "failed" and "x.jsonl:3" in row["error"]


def test_atomic_write_killed_writer_leaves_no_partial_file(tmp_path):
    """A writer killed mid-write leaves the old content (or nothing), never a torn file."""
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    code = textwrap.dedent(f"""
        import os, sys, time
        from drafter.core.rundir import atomic_open
        with atomic_open({str(target)!r}, "wb") as f:
            f.write(b"x" * 1_000_000)
            f.flush()
            print("writing", flush=True)
            time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert target.read_bytes() == b"old"
    # the temp file is left behind but named as one; the real file is intact
    assert all(q.name.startswith(".tmp-") for q in tmp_path.iterdir() if q != target)


def test_jsonl_torn_tail_is_repaired(tmp_path):
    p = tmp_path / "a.jsonl"
    with JsonlAppender(p) as w:
        w.write({"id": 1})
        w.write({"id": 2})
    with open(p, "ab") as f:
        f.write(b'{"id": 3, "tru')  # killed mid-line
    assert [r["id"] for r in read_jsonl(p, repair=True)] == [1, 2]
    with JsonlAppender(p) as w:
        w.write({"id": 3})
    assert [r["id"] for r in read_jsonl(p)] == [1, 2, 3]


def test_cli_status_json_and_help(tmp_path, monkeypatch, capsys):
    from drafter import cli

    fake_steps(monkeypatch)
    cfg = cfg_for(tmp_path)
    pipeline.run_step(cfg, "prepare")
    assert cli.main(["status", cfg.run_dir, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    row = out["steps"][0]
    assert set(row) >= {"name", "state", "dir", "counts", "seconds"}
    assert row["state"] == "done" and out["steps"][1]["state"] == "pending"
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    for cmd in ["run", "prepare", "generate", "tokenize", "vocab", "extract", "train", "export",
                "evaluate", "status", "config", "serve", "plan", "doctor", "check", "report"]:
        assert cmd in text
