"""prepare: the real training pool in, every record accounted for; dedup, max_samples, seeded
shuffle and split; malformed input reported by file:line and failing past the threshold."""
import json

import pytest

from drafter import DrafterError
from drafter.core import config as C
from drafter.core.rundir import Run, read_jsonl
from drafter.data.sources import SourceError, read_source
from drafter.run import pipeline
from drafter.steps import prepare as P

README_TRAIN = {"gsm8k_train.jsonl": 7473, "codealpaca_4k.json": 4535, "codealpaca_2k.json": 2017,
                "arena_hard_v2_questions.jsonl": 750, "alpaca_seed_tasks.jsonl": 175,
                "sharegpt_dummy_conversation.json": 500}


def cfg_for(tmp_path, sources, *over, name="run"):
    srcs = "[" + ", ".join("{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in s.items()) + "}"
                           for s in sources) + "]"
    return C.load(None, [f"run_dir={tmp_path / name}", f"prepare.sources={srcs}", *over])


def conversations(cfg):
    return read_jsonl(Run.of(cfg).conversations("prepare"))


def invariant(c):
    reasons = sum(v for k, v in c.items() if k.startswith("rejected_"))
    assert c.get("rejected", 0) == reasons
    assert c["read"] == c["kept"] + c.get("rejected", 0) + c.get("duplicates", 0) + \
        c.get("over_max_samples", 0)
    assert c["kept"] == c["train"] + c.get("val", 0)


def test_whole_training_pool(tmp_path, shared_data):
    cfg = cfg_for(tmp_path, [{"path": str(shared_data / "train" / f)} for f in README_TRAIN],
                  "prepare.dedup=false")
    m = pipeline.run_step(cfg, "prepare")
    c = m["counts"]
    invariant(c)
    assert c["read"] == c["kept"] == sum(README_TRAIN.values())
    # gsm8k and arena-hard are questions only (2 codealpaca answers are empty: questions too)
    assert c["without_answers"] == 7473 + 750 + 2
    assert {f: m["sources"][f.split(".")[0]]["read"] for f in README_TRAIN} == README_TRAIN
    assert m["sources"]["sharegpt_dummy_conversation"]["format"] == "sharegpt"
    recs = conversations(cfg)
    assert len(recs) == c["kept"] and len({r["id"] for r in recs}) == len(recs)
    assert sum(r["split"] == "val" for r in recs) == c["val"] == round(0.05 * c["kept"])
    assert list(recs[0]) == ["id", "source", "split", "messages"] + \
        [k for k in ("meta",) if k in recs[0]]
    assert Run.of(cfg).rejects().read_text() == ""


def test_dedup_max_samples_shuffle_split(tmp_path):
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"question": q}) + "\n" for q in
                         ["Same  question", "x1", "x2", "x3", "x4", "x5"]))
    b.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in
                         [" Same question\n", "y1", "y2", "y2"]))
    srcs = [{"path": str(a), "max_samples": 3}, {"path": str(b)}]
    cfg = cfg_for(tmp_path, srcs, "prepare.val_fraction=0.25")
    m = P.main(cfg)
    c = m["counts"]
    invariant(c)
    # normalised whitespace: 'Same  question' == ' Same question\n'; y2 twice. Which copy of
    # the first survives depends on the shuffle: a's max_samples then drops 3 or 2.
    assert c["read"] == 10 and c["duplicates"] == 2
    sa, sb = m["sources"]["a"], m["sources"]["b"]
    assert sa["kept"] == 3
    assert sa["read"] == 6 == 3 + sa.get("duplicates", 0) + sa["over_max_samples"]
    assert sb["read"] == 4 == sb["kept"] + sb["duplicates"]
    assert c["val"] == round(0.25 * c["kept"]) >= 1
    firsts = [" ".join(r["messages"][0]["content"].split()) for r in conversations(cfg)]
    assert len(set(firsts)) == len(firsts) == c["kept"]
    first = conversations(cfg)
    assert P.main(cfg) == m and conversations(cfg) == first  # seeded: the same again
    cfg2 = cfg_for(tmp_path, srcs, "prepare.val_fraction=0.25", "prepare.seed=1", name="r2")
    P.main(cfg2)
    assert [r["id"] for r in conversations(cfg2)] != [r["id"] for r in first]
    cfg3 = cfg_for(tmp_path, srcs, "prepare.shuffle=false", "prepare.dedup=false", name="r3")
    c3 = P.main(cfg3)["counts"]
    invariant(c3)
    assert [r["messages"][0]["content"] for r in conversations(cfg3)] == \
        ["Same  question", "x1", "x2", " Same question\n", "y1", "y2", "y2"]
    assert c3["over_max_samples"] == 3 and "duplicates" not in c3


def test_malformed_lines_reported_and_threshold(tmp_path):
    p = tmp_path / "mixed.jsonl"
    lines = [json.dumps({"question": f"q{i}"}) for i in range(8)]
    lines[2] = "{oops"
    lines[5] = json.dumps({"question": ""})
    p.write_text("\n".join(lines) + "\n")
    cfg = cfg_for(tmp_path, [{"path": str(p)}], "prepare.max_bad_fraction=0.1")
    with pytest.raises(P.PrepareError) as e:
        P.main(cfg)
    msg = str(e.value)
    assert "2 of 8 records are malformed" in msg and f"{p}:3: bad_json" in msg and \
        f"{p}:6: empty_content" in msg and "rejects.jsonl" in msg
    cfg = cfg_for(tmp_path, [{"path": str(p)}], "prepare.max_bad_fraction=0.25")
    c = pipeline.run_step(cfg, "prepare")["counts"]
    invariant(c)
    assert c["rejected"] == 2 and c["rejected_bad_json"] == 1 and c["rejected_empty_content"] == 1
    rej = read_jsonl(Run.of(cfg).rejects())
    assert [(r["file"], r["line"], r["reason"]) for r in rej] == [
        (str(p), 3, "bad_json"), (str(p), 6, "empty_content")]


def test_require_assistant(tmp_path, shared_data):
    src = [{"path": str(shared_data / "train" / "codealpaca_2k.json")}]
    c = P.main(cfg_for(tmp_path, src, "prepare.require_assistant=true", "prepare.dedup=false"))[
        "counts"]
    invariant(c)
    assert c["rejected_empty_content"] == 2 and c["kept"] == 2015
    with pytest.raises(P.PrepareError, match="no assistant turn"):
        P.main(cfg_for(tmp_path, [{"path": "builtin:quickstart-prompts"}],
                       "prepare.require_assistant=true"))


def test_config_and_source_errors(tmp_path):
    with pytest.raises(DrafterError, match="source file not found"):
        P.main(cfg_for(tmp_path, [{"path": str(tmp_path / "missing.jsonl")}]))
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"text": "x", "label": 1}) + "\n")
    with pytest.raises(DrafterError, match=r"text \(1\), label \(1\)"):
        P.main(cfg_for(tmp_path, [{"path": str(odd)}]))
    with pytest.raises(C.ConfigError, match="both named 'quickstart-prompts'"):
        P.main(cfg_for(tmp_path, [{"path": "builtin:quickstart-prompts"}] * 2))
    twice = [{"path": "builtin:quickstart-prompts"},
             {"path": "builtin:quickstart-prompts", "name": "again"}]
    c = P.main(cfg_for(tmp_path, twice))["counts"]
    assert c["read"] == 160 and c["duplicates"] == 80


def test_a_line_that_is_not_utf8_is_one_reject_with_file_and_line(tmp_path):
    """A 0xff byte in one line of a source (JSONL, gzipped too) is a reject naming the file and
    line; the lines after it are read; a JSON array with such a byte is one error naming them.
    Too many of them fail the step with exit 2 and the same file:line."""
    import gzip

    from drafter import cli

    lines = [json.dumps({"question": f"q{i}"}).encode() for i in range(10)]
    lines[4] = b'{"question": "caf\xff"}'
    blob = b"\n".join(lines) + b"\n"
    for name, data in (("mixed.jsonl", blob), ("mixed.jsonl.gz", gzip.compress(blob))):
        p = tmp_path / name
        p.write_bytes(data)
        cfg = cfg_for(tmp_path, [{"path": str(p)}], "prepare.max_bad_fraction=0.2",
                      name=f"run-{name}")
        c = P.main(cfg)["counts"]
        assert (c["read"], c["kept"], c["rejected_bad_encoding"]) == (10, 9, 1)
        rej = read_jsonl(Run.of(cfg).rejects())
        assert [(r["file"], r["line"], r["reason"]) for r in rej] == [(str(p), 5, "bad_encoding")]
        assert "byte 0xff at column 18" in rej[0]["detail"]
    arr = tmp_path / "array.json"
    arr.write_bytes(b'[{"question": "a"},\n {"question": "caf\xff"}]')
    with pytest.raises(SourceError, match=r"array\.json:2: not UTF-8: byte 0xff"):
        list(read_source(C.SourceConfig(path=str(arr))))
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"run_dir: {tmp_path / 'run-cli'}\nprepare:\n  sources:\n"
                   f"    - path: {tmp_path / 'mixed.jsonl'}\n")
    assert cli.main(["prepare", str(bad)]) == 2   # 1 of 10 > max_bad_fraction 0.01
