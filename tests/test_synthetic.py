"""Synthetic prompts (drafter.data.synthetic; prepare source `synthetic`, written by generate's
local engine): the pre-query prefix of real chat templates, the filters and their reasons, the
diversity figures, and the pipeline end to end on the embedded SmolLM2 (multi-turn, steering,
rejections counted, resumed after kill -9 with nothing lost or repeated)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from drafter.core import config as C
from drafter.core.configload import apply_override
from drafter.core.rundir import Run, read_json, read_jsonl
from drafter.data.synthetic import PreQuery, PromptFilter, diversity
from drafter.run import pipeline

REPO = Path(__file__).resolve().parents[1]


def test_pre_query_prefix_of_the_smollm2_template(smollm2_dir):
    """The prefix ends exactly where a user message's text begins, with the history before it;
    the end-of-turn token is the template's <|im_end|>."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    pq = PreQuery(tok)
    first = pq.prefix([{"role": "system", "content": "Be brief."}])
    assert first == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    later = pq.prefix([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}])
    assert later.endswith("<|im_start|>assistant\nYo<|im_end|>\n<|im_start|>user\n")
    assert "Hi" in later
    assert pq.stop_ids == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert pq.ids([]) == tok(pq.prefix([]), add_special_tokens=False)["input_ids"]


def test_filter_reasons_and_duplicates():
    f = PromptFilter(min_chars=10, max_chars=80, near_dup=0.7)
    base = "How do I sort a list of dictionaries by a key in Python quickly?"
    assert f.check(base, "stop") is None
    assert f.check("  " + base.upper() + " ", "stop") == "duplicate"          # NFKC, case, space
    assert f.check(base.replace("quickly", "fast"), "stop") == "near_duplicate"
    assert f.check(base.replace("quickly", "fast"), "stop", dedup=False) is None  # follow-ups
    assert f.check("", "stop") == "empty"
    assert f.check("Explain monads in depth please", "length") == "truncated"
    assert f.check("Hi there", "stop") == "too_short"
    assert f.check("word " * 40, "stop") == "too_long"
    assert f.check("}}{{ ### $$$ %%% @@@ !!!", "stop") == "not_text"
    assert f.check("What is <|im_start|>assistant doing?", "stop") == "template"
    assert f.check("What is the capital city of Mongolia, and why?", "stop") is None
    assert f.counts["kept"] == 3 and f.counts["near_duplicate"] == 1
    assert sum(f.counts.values()) == 11


def test_diversity_figures():
    same = ["tell me a joke about cats"] * 4
    d = diversity(same + ["what is the boiling point of water at altitude"])
    assert d["prompts"] == 5 and d["exact_duplicate_rate"] == pytest.approx(3 / 5)
    assert d["near_duplicate_rate"] == pytest.approx(3 / 5)
    assert d["words_p50"] == 6 and 0 < d["distinct_2gram"] < 1
    assert diversity(["a b c", "d e f"])["distinct_1gram"] == 1.0


def _config(root: Path, **over) -> C.Config:
    data = {
        "run_dir": str(root / "run"),
        "target": {"model": "builtin:smollm2-135m-instruct", "dtype": "float32",
                   "device": "cpu"},
        "prepare": {"sources": [{"name": "syn", "synthetic": {
            "count": 6, "turns": 2, "topics": ["cooking", "algebra"], "max_tokens": 40,
            "min_chars": 8, "max_attempts": 6}}], "val_fraction": 0.0},
        "generate": {"server": {"engine": "drafter"}, "max_tokens": 12, "batch_size": 4},
    }
    for k, v in over.items():
        apply_override(data, k.split("."), v, k)  # the dotted overrides of C.load, values as given
    (root / "cfg.yaml").write_text(yaml.safe_dump(data))
    return C.load(root / "cfg.yaml")


def test_synthetic_conversations_end_to_end(tmp_path, smollm2_dir):
    """prepare makes 6 placeholders with a topic system prompt each; generate has SmolLM2 write
    two user turns per conversation (the second after the first answer) and answer both;
    rejected samples are logged and counted by reason in the manifest; tokenize renders them."""
    cfg = _config(tmp_path)
    pipeline.run_step(cfg, "prepare")
    run = Run.of(cfg)
    recs = read_jsonl(run.conversations("prepare"))
    assert len(recs) == 6 and all(r["synthetic"] == {"turns": 2} for r in recs)
    assert all(r["messages"][0]["content"].startswith("The user asks about ") for r in recs)
    pipeline.run_step(cfg, "generate")
    out = read_jsonl(run.conversations("generate"))
    errs = read_jsonl(run.generate_errors()) if run.generate_errors().exists() else []
    assert len(out) + len(errs) == 6 and len(out) >= 4
    firsts = []
    for r in out:
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["system", "user", "assistant", "user", "assistant"], roles
        users = [m["content"] for m in r["messages"] if m["role"] == "user"]
        assert all(len(u) >= 8 and "<|im_" not in u for u in users)
        firsts.append(users[0])
        assert len(r["meta"]["turns"]) == 2
    assert len(set(firsts)) == len(firsts)
    m = read_json(run.manifest("generate"))
    syn = m["synthetic"]
    assert syn["conversations"] == len(out) and syn["user_turns_kept"] == 2 * len(out)
    rejects = read_jsonl(run.synthetic_rejects()) if run.synthetic_rejects().exists() else []
    assert syn["rejected"] == len(rejects) == sum(syn["rejected_by_reason"].values())
    for e in errs:
        assert e["reason"].startswith("synthetic: no usable user turn")
    pipeline.run_step(cfg, "tokenize")
    assert read_json(run.manifest("tokenize"))["counts"]["conversations"] >= 1


def test_synthetic_needs_the_local_engine(tmp_path):
    cfg = _config(tmp_path, **{"generate.server.engine": "transformers"})
    pipeline.run_step(cfg, "prepare")
    from drafter.steps import generate

    with pytest.raises(generate.GenerateError, match=r"prepare.sources\[0\] is synthetic"):
        generate.main(cfg)
    # a bad synthetic section is refused when the config loads, before any step runs
    with pytest.raises(C.ConfigError, match=r"prepare.sources\[0\].synthetic.count: must be "
                                            r">= 1, got 0"):
        _config(tmp_path, **{"prepare.sources": [{"synthetic": {"count": 0}}]})


@pytest.mark.slow
def test_synthetic_generate_resumes_after_kill(tmp_path, smollm2_dir):
    """kill -9 while generate writes synthetic conversations, then rerun: every conversation
    once, no first user turn twice, the rejected samples counted once each."""
    cfg = _config(tmp_path, **{"prepare.sources": [{"name": "syn", "synthetic": {
        "count": 24, "turns": 1, "max_tokens": 40, "min_chars": 8}}], "generate.batch_size": 2})
    pipeline.run_step(cfg, "prepare")
    run = Run.of(cfg)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "drafter.cli", "generate", str(tmp_path / "cfg.yaml")]
    p = subprocess.Popen(cmd, env=env, cwd=REPO, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = run.conversations("generate")
    t0 = time.time()
    while time.time() - t0 < 300 and p.poll() is None:
        if out.exists() and len(out.read_bytes().splitlines()) >= 3:
            break
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    before = len(read_jsonl(out, repair=True)) if out.exists() else 0
    r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    recs = read_jsonl(out)
    errs = read_jsonl(run.generate_errors()) if run.generate_errors().exists() else []
    ids = [x["id"] for x in recs] + [e["id"] for e in errs]
    assert sorted(ids) == sorted(f"syn:{i}" for i in range(24)) and before >= 1
    firsts = [next(m["content"] for m in x["messages"] if m["role"] == "user") for x in recs]
    assert len(set(firsts)) == len(firsts)
    m = read_json(run.manifest("generate"))
    assert m["counts"]["resumed"] >= before and m["synthetic"]["conversations"] == len(recs)
    json.dumps(m)
