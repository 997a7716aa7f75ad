"""sources: every real file in ../shared/data loads with its README count; each format maps to the
canonical messages; each kind of bad input gets its reason, file and line."""
import gzip
import json

import pytest

from drafter.core.config import SourceConfig
from drafter.data.sources import Reject, SourceError, load_prompts, read_source

SHARED = [  # (file, records in ../shared/data/README.md, format)
    ("train/gsm8k_train.jsonl", 7473, "prompt"),
    ("train/codealpaca_4k.json", 4535, "alpaca"),
    ("train/codealpaca_2k.json", 2017, "alpaca"),
    ("train/arena_hard_v2_questions.jsonl", 750, "prompt"),
    ("train/alpaca_seed_tasks.jsonl", 175, "alpaca"),
    ("train/sharegpt_dummy_conversation.json", 500, "sharegpt"),
    ("eval/mt_bench_questions.jsonl", 80, "prompt"),
    ("eval/humaneval.jsonl.gz", 164, "prompt"),
    ("eval/gsm8k_test.jsonl", 1319, "prompt"),
]


def read(path, **kw):
    stats = {}
    opts = {k: kw.pop(k) for k in ("require_assistant",) if k in kw}
    items = list(read_source(SourceConfig(path=str(path), **kw), stats=stats, **opts))
    return [x for x in items if not isinstance(x, Reject)], \
        [x for x in items if isinstance(x, Reject)], stats


@pytest.mark.parametrize("rel,count,fmt", SHARED, ids=[s[0] for s in SHARED])
def test_shared_files_load_with_readme_counts(shared_data, rel, count, fmt):
    recs, bad, stats = read(shared_data / rel)
    assert len(recs) == count and bad == [] and stats["format"] == fmt
    assert len({r["id"] for r in recs}) == count
    for r in recs:
        roles = [m["role"] for m in r["messages"]]
        assert "user" in roles and all(m["content"].strip() for m in r["messages"]
                                       if m["role"] == "user")
    if fmt == "prompt":
        assert all(set(m["role"] for m in r["messages"]) == {"user"} for r in recs)


def test_shared_file_details(shared_data):
    mt, _, _ = read(shared_data / "eval/mt_bench_questions.jsonl")
    assert all(len(r["messages"]) == 2 for r in mt)  # two successive user turns, no answers
    assert mt[0]["meta"] == {"orig_id": 81, "category": "writing"}
    sg, _, _ = read(shared_data / "train/sharegpt_dummy_conversation.json")
    assert [m["role"] for m in sg[0]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert sg[0]["messages"][0]["content"] == "Who are you?"
    ca, _, stats = read(shared_data / "train/codealpaca_2k.json")
    assert ca[0]["messages"] == [
        {"role": "user", "content": "What are the distinct values from the given list?\n\n"
                                    "dataList = [3, 9, 3, 5, 7, 9, 5]"},
        {"role": "assistant", "content": "The distinct values from the given list are 3, 5, 7 "
                                         "and 9."}]
    # two records have an empty output: kept as questions for generate to answer ...
    assert stats["dropped_empty_answers"] == 2
    # ... and rejected, with their line, when the data's own answers are required
    recs, bad, _ = read(shared_data / "train/codealpaca_2k.json", require_assistant=True)
    assert len(recs) == 2015 and [b.reason for b in bad] == ["empty_content"] * 2
    text = (shared_data / "train/codealpaca_2k.json").read_text().splitlines()
    # the line of a JSON array element is where it opens
    assert all(text[b.line - 1].strip() == "{" and '"instruction"' in text[b.line] for b in bad)
    seed, _, _ = read(shared_data / "train/alpaca_seed_tasks.jsonl")
    assert seed[0]["messages"][1]["role"] == "assistant"  # from instances[0].output


def test_builtins_and_load_prompts():
    qs = load_prompts("builtin:quickstart-prompts")
    assert len(qs) == 80 and qs[0]["id"] == "quickstart-prompts:000000"
    he = load_prompts("builtin:humaneval", max_n=5)
    assert len(he) == 5 and he[0]["meta"]["orig_id"] == "HumanEval/0"
    assert he[0]["messages"][0]["content"].startswith("from typing import List")
    with pytest.raises(SourceError, match="known: builtin:quickstart-prompts"):
        load_prompts("builtin:nope")


def test_load_prompts_keeps_user_turns_only(tmp_path):
    p = tmp_path / "chat.jsonl"
    p.write_text(json.dumps({"messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"}]}) + "\n" + "{broken\n")
    out = load_prompts(str(p))
    assert [m["content"] for m in out[0]["messages"]] == ["S", "q1", "q2"] and len(out) == 1


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_openai_format(tmp_path):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    p = write_jsonl(tmp_path / "oa.jsonl", [{
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                         {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
            {"role": "assistant", "content": "It is 42.", "reasoning_content": "Look it up."}],
        "tools": json.dumps([{"type": "function", "function": {"name": "f"}}])}])
    (r,), bad, stats = read(p)
    assert stats["format"] == "openai" and bad == []
    assert r["messages"] == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is 42.", "reasoning_content": "Look it up."}]
    assert r["tools"][0]["function"]["name"] == "f"


def test_sharegpt_alpaca_prompt_formats(tmp_path):
    p = write_jsonl(tmp_path / "sg.jsonl", [
        {"system": "Be brief.", "conversations": [
            {"from": "gpt", "value": "Hello! (scraped greeting)"},
            {"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}])
    (r,), _, stats = read(p)
    assert r["messages"] == [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Q"},
                             {"role": "assistant", "content": "A"}]
    assert stats["dropped_leading_assistant"] == 1
    p = write_jsonl(tmp_path / "al.jsonl", [{"instruction": "Sum", "input": "1 2", "output": "3"},
                                            {"instruction": "Say hi", "input": "", "output": "hi"}])
    recs, _, _ = read(p)
    assert recs[0]["messages"][0]["content"] == "Sum\n\n1 2"
    assert recs[1]["messages"] == [{"role": "user", "content": "Say hi"},
                                   {"role": "assistant", "content": "hi"}]
    # the override: the same file read as prompts only
    recs, _, _ = read(p, format="prompt")
    assert recs[0]["messages"] == [{"role": "user", "content": "Sum\n\n1 2"}]
    p = write_jsonl(tmp_path / "pr.jsonl", [{"question": "Why?"}, {"prompt": "How?"},
                                            {"turns": ["One", "Two"]},
                                            {"prompt": [{"role": "user", "content": "Chat?"}]}])
    recs, _, _ = read(p)
    assert [[m["content"] for m in r["messages"]] for r in recs] == [
        ["Why?"], ["How?"], ["One", "Two"], ["Chat?"]]


def test_bad_records_each_get_reason_and_line(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "fine"}, {"role": "assistant", "content": "ok"}]},
        "{not json",                                                                  # 2
        "[1, 2]",                                                                     # 3
        {"messages": [{"role": "user", "content": "  "}]},                             # 4
        {"messages": [{"role": "user", "content": 7}]},                               # 5
        {"messages": [{"role": "wizard", "content": "x"}]},                           # 6
        {"messages": [{"role": "assistant", "content": "orphan"}]},                   # 7
        {"messages": [{"content": "no role"}]},                                       # 8
        {"conversations": []},                                                        # 9
        {"messages": [{"role": "user", "content": "question only"}]},                 # 10
    ]
    p = write_jsonl(tmp_path / "bad.jsonl", rows)
    recs, bad, _ = read(p)
    assert [(b.line, b.reason) for b in bad] == [
        (2, "bad_json"), (3, "not_an_object"), (4, "empty_content"), (5, "non_string_content"),
        (6, "unknown_role"), (7, "no_user_turn"), (8, "bad_message"), (9, "missing_field")]
    assert bad[0].where == f"{p}:2" and "wizard" in bad[4].detail and "int" in bad[3].detail
    assert len(recs) == 2 and recs[1]["id"] == "bad:000009"   # ids count every record
    _, bad, _ = read(p, require_assistant=True)
    assert bad[-1].line == 10 and bad[-1].reason == "no_assistant_turn"


def test_unknown_format_lists_fields(tmp_path):
    p = write_jsonl(tmp_path / "odd.jsonl", [{"foo": 1, "bar": 2}, {"foo": 3}])
    with pytest.raises(SourceError, match=r"foo \(2\), bar \(1\)"):
        read(p)


def test_missing_and_unsupported(tmp_path):
    with pytest.raises(SourceError, match="source file not found: .*nope.jsonl"):
        read(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(SourceError, match="unsupported file type"):
        read(tmp_path / "x.csv")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(SourceError, match="no records"):
        read(tmp_path / "empty.jsonl")


def test_json_array_lines_and_errors(tmp_path):
    p = tmp_path / "arr.json"
    p.write_text('[\n  {"question": "a"},\n  {"question": ""},\n  {"question": "c"}\n]\n')
    recs, bad, _ = read(p)
    assert len(recs) == 2 and bad[0].line == 3 and bad[0].reason == "empty_content"
    p.write_text('[\n  {"question": "a"},\n  {"question": }\n]')
    with pytest.raises(SourceError, match=r"arr.json:3:\d+: not valid JSON"):
        read(p)


def test_gzip_parquet_and_folder(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"conversations": [{"from": "human", "value": f"q{i}"},
                               {"from": "gpt", "value": f"a{i}"}]} for i in range(5)]
    d = tmp_path / "data"
    d.mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:3]), d / "part-0.parquet")
    with gzip.open(d / "part-1.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows[3:]))
    recs, bad, stats = read(d)
    assert stats["format"] == "sharegpt" and bad == []
    assert [r["messages"][1]["content"] for r in recs] == ["a0", "a1", "a2", "a3", "a4"]
    recs, _, _ = read(d / "part-0.parquet")
    assert len(recs) == 3 and recs[0]["source"] == "part-0"


def test_hf_dataset_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"messages": [{"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": f"a{i}"}]} for i in range(4)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "ds")
    recs, bad, _ = read(tmp_path / "ds", name="mine")
    assert len(recs) == 4 and bad == [] and recs[3]["id"] == "mine:000003"
    with pytest.raises(SourceError, match="no split 'test'"):
        read(tmp_path / "ds", split="test")


def test_a_field_of_ones_own_is_read_where_the_format_reads_its_prompt(tmp_path):
    """A prompt file whose prompt is `Instruction` (capitalised, as in a public test set): refused
    with a message naming `field`, read through `field: Instruction` (format auto or prompt)
    without rewriting the file; a record without it is a reject naming the key. `field` also
    names a list of turns or of messages, and the instruction of an alpaca record."""
    rows = [{"Instruction": "Name a prime.", "id": 7}, {"Instruction": "Name a colour."},
            {"Prompt": "no Instruction here"}]
    p = write_jsonl(tmp_path / "test_set.jsonl", rows)
    with pytest.raises(SourceError, match="`field` to the field that holds the prompt"):
        read(p)
    for fmt in ("auto", "prompt"):
        recs, bad, stats = read(p, field="Instruction", format=fmt)
        assert stats["format"] == "prompt"
        assert [r["messages"] for r in recs] == [[{"role": "user", "content": "Name a prime."}],
                                                 [{"role": "user", "content": "Name a colour."}]]
        assert recs[0]["meta"] == {"orig_id": 7}
        assert [(b.reason, b.line) for b in bad] == [("missing_field", 3)]
        assert "no 'Instruction' field (the source's `field`" in bad[0].detail
    turns = write_jsonl(tmp_path / "turns.jsonl", [{"Turns": ["q1", "q2"], "turns": ["x"]}])
    recs, _, _ = read(turns, field="Turns")
    assert [m["content"] for m in recs[0]["messages"]] == ["q1", "q2"]
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"dialog": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}])
    recs, _, stats = read(chat, field="dialog")
    assert stats["format"] == "openai" and [m["role"] for m in recs[0]["messages"]] == \
        ["user", "assistant"]
    alp = write_jsonl(tmp_path / "alp.jsonl", [{"Question": "Add 2 and 3.", "input": "",
                                                "output": "5"}])
    recs, _, _ = read(alp, field="Question", format="alpaca")
    assert recs[0]["messages"] == [{"role": "user", "content": "Add 2 and 3."},
                                   {"role": "assistant", "content": "5"}]


def test_the_field_key_reaches_prepare_and_evaluate(tmp_path):
    """`field` is a typed key of a prepare source and of an evaluate dataset (the same reader),
    given in YAML; an unknown key beside it is still an error."""
    import yaml

    from drafter.core import config as C
    from drafter.steps.evaluate import _datasets

    p = write_jsonl(tmp_path / "test_set.jsonl", [{"Instruction": f"Q{i}"} for i in range(3)])
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"),
        "prepare": {"sources": [{"path": str(p), "field": "Instruction"}]},
        "evaluate": {"datasets": [{"name": "set", "path": str(p), "field": "Instruction",
                                   "max_prompts": 2}]}}))
    cfg = C.load(cfg_path)
    src = cfg.prepare.sources[0]
    assert src.field == "Instruction"
    recs = [r for r in read_source(src) if not isinstance(r, Reject)]
    assert [r["messages"][0]["content"] for r in recs] == ["Q0", "Q1", "Q2"]
    ((name, _, got),) = _datasets(cfg.evaluate)
    assert name == "set" and [r["messages"][0]["content"] for r in got] == ["Q0", "Q1"]
    cfg_path.write_text(cfg_path.read_text().replace("field: Instruction", "feld: Instruction",
                                                     1))
    with pytest.raises(C.ConfigError, match="feld"):
        C.load(cfg_path)
