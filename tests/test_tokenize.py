"""tokenize: the loss mask on real template styles, written here on top of the SmolLM2 tokenizer
(with the special tokens each model family has added), plus the step end to end.

For every template the same three facts are checked on a two-turn conversation:
- the text before each assistant run decodes to exactly the template's generation prompt
  (role headers out, first answer token in);
- the masked run decodes to the answer (and its reasoning, where rendered) plus the end-of-turn
  token, which is the run's last token;
- nothing else is masked."""
import json

import pytest

from drafter import DrafterError
from drafter.core import config as C
from drafter.core.rundir import Run
from drafter.data import tokens
from drafter.run import pipeline
from drafter.steps import tokenize as T

CHATML = None  # SmolLM2's own template

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim"
    " + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")

# Qwen3 style: reasoning rendered only for answers after the last user turn (history drops it);
# the generation prompt gets an empty think block when thinking is off; tool calls inline.
QWEN3 = """
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}
{%- endif %}{%- endfor %}
{%- for m in messages %}
  {%- if m.role in ['system', 'user'] %}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
  {%- elif m.role == 'assistant' %}
    {%- set r = m.reasoning_content
          if m.reasoning_content is defined and m.reasoning_content else '' %}
    {%- if loop.index0 > ns.last_query and (loop.last or r) %}
      {{- '<|im_start|>assistant\n<think>\n' + r.strip('\n') + '\n</think>\n\n'
          + m.content.lstrip('\n') }}
    {%- else %}
      {{- '<|im_start|>assistant\n' + m.content }}
    {%- endif %}
    {%- if m.tool_calls %}{%- for tc in m.tool_calls %}
      {%- if (loop.first and m.content) or not loop.first %}{{- '\n' }}{%- endif %}
      {{- '<tool_call>\n{"name": "' + tc.function.name + '", "arguments": '
          + tc.function.arguments + '}\n</tool_call>' }}
    {%- endfor %}{%- endif %}
    {{- '<|im_end|>\n' }}
  {%- elif m.role == 'tool' %}
    {{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}
  {%- if enable_thinking is defined and enable_thinking is false %}
    {{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""

# DeepSeek-V3.1 style: `thinking` opens <think> in the generation prompt; history answers get
# '</think>' + content; the answer after the last user turn keeps its reasoning.
DEEPSEEK = """{{ bos_token }}
{%- set ns = namespace(last_query=-1, sys='') %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}
{%- endif %}
{%- if m.role == 'system' %}{%- set ns.sys = m.content %}{%- endif %}{%- endfor %}
{{- ns.sys }}
{%- for m in messages %}
  {%- if m.role == 'user' %}{{- '<｜User｜>' + m.content }}
  {%- elif m.role == 'assistant' %}
    {%- if loop.index0 > ns.last_query and m.reasoning_content %}
      {{- '<｜Assistant｜><think>' + m.reasoning_content + '</think>' + m.content
          + '<｜end▁of▁sentence｜>' }}
    {%- else %}
      {{- '<｜Assistant｜></think>' + m.content + '<｜end▁of▁sentence｜>' }}
    {%- endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<｜Assistant｜>' + ('<think>' if thinking else '</think>') }}{%- endif %}"""

# Kimi-K2-Thinking style: the model writes <think>...</think> itself after the header.
KIMI = """
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}
{%- endif %}{%- endfor %}
{%- for m in messages %}
  {%- if m.role == 'system' %}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>
  {%- elif m.role == 'user' %}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>
  {%- elif m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|><think>
    {{- (m.reasoning_content or '')
        if loop.index0 > ns.last_query else '' }}</think>{{ m.content }}<|im_end|>
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{%- endif %}"""

# GLM-4.5 style: nothing after an answer; the model stops by writing the next header, one of its
# stop tokens (generation_config.json eos_token_id lists <|user|> and <|observation|>).
GLM = ("[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}"
       "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

# ChatML with {% generation %} blocks: transformers' own assistant mask, to cross-check ours.
CHATML_GEN = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<｜User｜>",
           "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<|im_system|>", "<|im_user|>",
           "<|im_assistant|>", "<|im_middle|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>",
           "<|assistant|>", "<|observation|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # added, not special (as in Qwen3)

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4.", "reasoning_content": "Add two and two."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6.", "reasoning_content": "Three plus three is six."},
]


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(smollm2_dir)
    t.add_special_tokens({"additional_special_tokens": SPECIAL})
    t.add_tokens(ADDED)
    t.original_template = t.chat_template
    return t


def text(tok, ids):
    """Decoded text with added tokens written as themselves (decoders of some tokenizer builds
    rewrite them: transformers 5.17's GGUF conversion turns '▁' into a space)."""
    out, run = [], []
    for i in ids:
        if i in tok.added_tokens_decoder:
            out += [tok.decode(run), tok.added_tokens_decoder[i].content]
            run = []
        else:
            run.append(i)
    return "".join(out + [tok.decode(run)])


def renderer(tok, template, **kw):
    tok.chat_template = template or tok.original_template
    return T.Renderer(tok, stop_ids=(tok.eos_token_id,), **kw)


def encode(r, messages):
    text, spans = r.spans(messages)
    (ids, mask), = r.encode([(text, spans)])
    return ids, mask


def runs(mask):
    out, start = [], None
    for i, b in enumerate(mask + [0]):
        if b and start is None:
            start = i
        if not b and start is not None:
            out.append((start, i))
            start = None
    return out


def check(tok, r, messages, expected_runs, eot, prefix_is_prompt=True):
    ids, mask = encode(r, messages)
    assert len(ids) == len(mask) and set(mask) <= {0, 1}
    got = runs(mask)

    def dec(x):
        return text(tok, x)

    assert [dec(ids[a:b]) for a, b in got] == [e + eot for e in expected_runs]
    eot_id = tok.convert_tokens_to_ids(eot)
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for (a, b), i in zip(got, assistants):
        assert ids[b - 1] == eot_id                      # the end-of-turn token is in
        assert mask[a - 1] == 0 and mask[b:b + 1] in ([], [0])
        if prefix_is_prompt:                             # header out, first answer token in
            assert dec(ids[:a]) == r.render(messages[:i], generation_prompt=True)
    return ids, mask


def test_chatml_smollm2(tok):
    r = renderer(tok, CHATML)
    assert r.ends[0] == "<|im_end|>" and not r.renders_reasoning and r.mode == "segments"
    check(tok, r, CONV, ["It is 4.", "It is 6."], "<|im_end|>")


def test_llama3(tok):
    r = renderer(tok, LLAMA3)
    assert r.ends[0] == "<|eot_id|>"
    msgs = [dict(m, content=m["content"] + "  ") if m["role"] == "assistant" else m for m in CONV]
    # the template trims the answer: the mask follows what it renders
    check(tok, r, msgs, ["It is 4.", "It is 6."], "<|eot_id|>")


def test_qwen3_thinking(tok):
    r = renderer(tok, QWEN3)
    assert r.renders_reasoning
    # history drops the first answer's reasoning; the last keeps it, <think> included (the model
    # writes it when thinking is on)
    check(tok, r, CONV, ["It is 4.", "<think>\nThree plus three is six.\n</think>\n\nIt is 6."],
          "<|im_end|>")


def test_qwen3_no_thinking(tok):
    r = renderer(tok, QWEN3, enable_thinking=False)
    msgs = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in CONV]
    ids, mask = check(tok, r, msgs, ["It is 4.", "It is 6."], "<|im_end|>", prefix_is_prompt=False)
    # the empty think block of the last turn is the template's (generation prompt), not the model's
    (a0, _), (a1, _) = runs(mask)
    assert text(tok, ids[:a1]) == r.render(msgs[:4], generation_prompt=True)
    assert r.render(msgs[:4], generation_prompt=True).endswith("assistant\n<think>\n\n</think>\n\n")
    # first turn: the history has no think block, so the answer starts right after the header
    assert text(tok, ids[:a0]).endswith("What is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_tool_calls(tok):
    r = renderer(tok, QWEN3, enable_thinking=False)
    call = {"id": "c1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
    msgs = [{"role": "user", "content": "Add 2 and 2."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "4", "tool_call_id": "c1"},
            {"role": "assistant", "content": "The sum is 4."}]
    ids, mask = check(tok, r, msgs, ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}'
                                     '\n</tool_call>', "The sum is 4."], "<|im_end|>",
                      prefix_is_prompt=False)
    assert "<tool_response>\n4" in text(tok, [i for i, m in zip(ids, mask) if not m])


def test_deepseek_thinking(tok):
    r = renderer(tok, DEEPSEEK, template_kwargs={"thinking": True})
    assert r.ends[0] == "<｜end▁of▁sentence｜>" and r.renders_reasoning
    # last answer: the prompt ends with <think>, the model writes reasoning, </think>, answer.
    # history answer: rendered '</think>It is 4.'; the prompt's '<think>' is not the model's.
    check(tok, r, CONV, ["</think>It is 4.", "Three plus three is six.</think>It is 6."],
          "<｜end▁of▁sentence｜>", prefix_is_prompt=False)
    ids, mask = encode(r, CONV)
    a, _ = runs(mask)[-1]
    assert text(tok, ids[:a]) == r.render(CONV[:4], generation_prompt=True)


def test_kimi_reasoning(tok):
    r = renderer(tok, KIMI)
    check(tok, r, CONV, ["<think></think>It is 4.",
                         "<think>Three plus three is six.</think>It is 6."], "<|im_end|>")


def test_glm_header_as_stop_token(tok):
    tok.chat_template = GLM
    names = ("<|endoftext|>", "<|user|>", "<|observation|>")
    stops = tuple(tok.convert_tokens_to_ids(t) for t in names)
    r = T.Renderer(tok, stop_ids=stops)
    assert r.open_end and r.ends == ["<|user|>"]
    ids, mask = encode(r, CONV)
    dec = [text(tok, ids[a:b]) for a, b in runs(mask)]
    # the first answer ends with the <|user|> the model wrote to stop; the last runs to the end
    assert dec == ["It is 4.<|user|>", "It is 6."]
    a, _ = runs(mask)[1]
    assert text(tok, ids[:a]) == r.render(CONV[:4], generation_prompt=True)


def test_generation_blocks_agree(tok):
    """transformers' {% generation %} mask (full-text offsets) equals ours token for token."""
    r = renderer(tok, CHATML_GEN)
    msgs = [m for m in CONV if m["role"] != "system"]
    ids, mask = encode(r, msgs)
    ref = tok.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    assert ref["input_ids"] == ids
    assert ref["assistant_masks"] == mask and sum(mask) > 0


@pytest.mark.parametrize("template", [CHATML, LLAMA3, QWEN3, DEEPSEEK, KIMI])
def test_offsets_mode_masks_the_same_text(tok, template):
    """The fallback (offsets of one whole-text encoding) marks the same characters. Tokens may
    differ at a boundary: segments tokenize the prompt alone, as the server does at inference
    (a prompt ending in '\n\n' is one token here, '\n' '\n' inside a longer text)."""
    kw = {"template_kwargs": {"thinking": True}} if template is DEEPSEEK else {}
    seg = encode(renderer(tok, template, **kw), CONV)
    off = encode(renderer(tok, template, mode="offsets", **kw), CONV)

    def dec(x):
        return text(tok, x)

    assert dec(seg[0]) == dec(off[0])
    assert [dec(seg[0][a:b]) for a, b in runs(seg[1])] == \
        [dec(off[0][a:b]) for a, b in runs(off[1])]
    if template is CHATML:
        assert seg == off


def test_template_without_end_token_is_an_error(tok):
    bare = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
    tok.chat_template = bare
    with pytest.raises(T.TemplateError, match="no end-of-turn token"):
        T.Renderer(tok, stop_ids=())


def line(rec):
    return json.dumps(rec).encode()


def test_process_counts_skips_and_length(tok):
    r = renderer(tok, CHATML)
    good = {"id": "a", "split": "train", "messages": CONV[1:3]}
    lines = [
        (1, line(good)),
        (2, line({"id": "b", "split": "val", "messages": CONV[1:2]})),              # prompt only
        (3, line({"id": "c", "split": "train",                                      # failed answer
                  "messages": CONV[1:3] + [CONV[3], {"role": "assistant", "content": None}]})),
        (4, line({"id": "d", "split": "train", "messages": CONV[1:3] + [CONV[3]]})),  # trailing q
    ]
    rows, counts, skipped = T.process(r, lines, "f.jsonl", 10_000, "truncate")
    assert [x[1] for x in rows] == ["a", "c", "d"]
    assert rows[1][2] == rows[0][2] == rows[2][2]   # c and d reduce to a's first turn
    assert counts["skipped_no_assistant"] == 1 and counts["cut_at_missing_answer"] == 1
    assert counts["trailing_turns_dropped"] == 2 and counts["conversations"] == 4
    assert skipped[0]["id"] == "b" and skipped[0]["line"] == 2
    n = len(rows[0][2])
    rows, counts, _ = T.process(r, [(1, line(good))], "f", n - 3, "truncate")
    assert len(rows[0][2]) == n - 3 and counts["truncated"] == 1
    rows, counts, _ = T.process(r, [(1, line(good))], "f", n - 3, "drop")
    assert rows == [] and counts["skipped_too_long"] == 1
    # cut before the answer starts: nothing to learn from, skipped and counted
    rows, counts, _ = T.process(r, [(1, line(good))], "f", 5, "truncate")
    assert rows == [] and counts["skipped_no_masked_tokens"] == 1
    with pytest.raises(DrafterError, match="f.jsonl:7"):
        T.process(r, [(7, b"{not json")], "f.jsonl", 100, "truncate")
    # drop_truncated: an answer generate cut at max_tokens skips its conversation
    cut = {**good, "id": "e", "meta": {"finish_reason": "length"}}
    ok = {**good, "id": "f", "meta": {"finish_reason": "stop"}}
    both = [(1, line(cut)), (2, line(ok))]
    rows, counts, skipped = T.process(r, both, "f", 10_000, "truncate", drop_truncated=True)
    assert [x[1] for x in rows] == ["f"] and counts["skipped_truncated_answer"] == 1
    assert skipped[0]["id"] == "e" and skipped[0]["reason"] == "truncated_answer"
    rows, _, _ = T.process(r, both, "f", 10_000, "truncate")
    assert [x[1] for x in rows] == ["e", "f"]


def repeated(ids, mask, copies=3, n=T.LOOP_NGRAM):
    """Brute force: per answer (run of mask 1), the tokens closing a window seen at least
    copies - 1 times before in it."""
    out, start = [], 0
    for t in range(len(ids)):
        if not mask[t]:
            start = t + 1
        elif t - start + 1 >= n and sum(ids[t - n + 1:t + 1] == ids[a - n + 1:a + 1]
                                        for a in range(start + n - 1, t)) >= copies - 1:
            out.append(t)
    return out


def test_loop_cut_keeps_the_first_repeats_of_each_answer():
    prompt, text = list(range(1000, 1010)), list(range(100, 130))   # 30 tokens, no repeat
    loop = [7, 8, 9, 10, 11] * 40                                   # a 5-token cycle
    ids = prompt + text + loop + [2]
    mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
    for limit in (0, 8, 50):
        for copies in (2, 3):
            cut = T.loop_cut(ids, mask, limit, copies)
            rep = repeated(ids, mask, copies)
            assert cut == rep[limit]                 # the (limit+1)-th looping token is cut
            assert len(repeated(ids[:cut], mask[:cut], copies)) == limit
            assert ids[:len(prompt) + len(text)] == (prompt + text)  # what precedes stays
    assert T.loop_cut(ids, mask, len(repeated(ids, mask))) is None   # fewer repeats than limit
    assert T.loop_cut(prompt + text, [0] * 10 + [1] * 30, 0) is None  # no loop
    # a passage said twice is not a loop (code restated after a fix), a third time it is
    twice, thrice = text + [1] + text, text + [1] + text + [1] + text
    assert T.loop_cut(prompt + twice, [0] * 10 + [1] * len(twice), 0) is None
    assert T.loop_cut(prompt + thrice, [0] * 10 + [1] * len(thrice), 0) == 10 + 2 * 31 + 15
    assert T.loop_cut(prompt + twice, [0] * 10 + [1] * len(twice), 0, copies=2) == 10 + 31 + 15
    # windows are counted per answer: three answers saying the same are not a loop
    three = prompt + text + prompt + text + prompt + text
    assert T.loop_cut(three, ([0] * 10 + [1] * 30) * 3, 0) is None


def test_process_trims_loops_and_counts(tok):
    r = renderer(tok, CHATML)
    words = " ".join(f"w{i}" for i in range(40))
    loopy = {"id": "a", "split": "train", "messages": [
        {"role": "user", "content": "Say something."},
        {"role": "assistant", "content": words + " It is a test." * 60},
        {"role": "user", "content": "More."}, {"role": "assistant", "content": "Sure."}]}
    whole, _, _ = T.process(r, [(1, line(loopy))], "f", 10_000, "truncate")
    rows, counts, _ = T.process(r, [(1, line(loopy))], "f", 10_000, "truncate",
                                max_loop_tokens=32)
    ids, mask = rows[0][2], rows[0][3]
    assert counts["loop_trimmed"] == 1
    assert counts["loop_trimmed_tokens"] == len(whole[0][2]) - len(ids) > 100
    assert ids == whole[0][2][:len(ids)] and mask == whole[0][3][:len(ids)]
    assert len(repeated(ids, mask)) == 32 and mask[-1] == 1        # cut inside the answer
    assert tok.decode(ids).count(words) == 1 and "More." not in tok.decode(ids)
    # no loop: nothing changes
    calm = {**loopy, "messages": loopy["messages"][:1] + [{"role": "assistant",
                                                           "content": words}]}
    a, c, _ = T.process(r, [(1, line(calm))], "f", 10_000, "truncate", max_loop_tokens=0)
    b, _, _ = T.process(r, [(1, line(calm))], "f", 10_000, "truncate")
    assert a == b and c["loop_trimmed"] == 0


def test_reasoning_not_rendered_is_counted(tok):
    r = renderer(tok, CHATML)
    rows, counts, _ = T.process(r, [(1, line({"id": "a", "split": "train",
                                              "messages": CONV}))], "f", 1000, "truncate")
    assert len(rows) == 1 and counts["reasoning_not_rendered"] == 1


def cfg_for(tmp_path, *over):
    return C.load(None, [f"run_dir={tmp_path / 'run'}", "generate.enabled=false", *over])


def test_step_end_to_end(tmp_path, shared_data, smollm2_dir):
    """prepare (real ShareGPT file + prompt-only quickstart) -> tokenize -> files read back."""
    cfg = cfg_for(tmp_path, f"prepare.sources=[{{path: {shared_data}/train/sharegpt_dummy_"
                  "conversation.json}, {path: 'builtin:quickstart-prompts'}]",
                  "prepare.val_fraction=0.2", "tokenize.max_length=48")
    pipeline.run_step(cfg, "prepare")
    out = T.main(cfg)   # generate (another step) is not run: tokenize reads prepare's output
    c = out["counts"]
    assert c["conversations"] == 52 + 80 and c["skipped_no_assistant"] == 80
    run = Run.of(cfg)
    n_train, n_val = tokens.num_rows(run.tokens("train")), tokens.num_rows(run.tokens("val"))
    assert (n_train, n_val) == (c["train"], c["val"]) and n_train + n_val == 52
    assert c["truncated"] >= 1 and out["end_of_turn"][0] == "<|im_end|>"
    rows = list(tokens.iter_samples(run.tokens("train"), batch_rows=7))
    assert sum(r["num_tokens"] for r in rows) + sum(
        r["num_tokens"] for r in tokens.iter_samples(run.tokens("val"))) == c["tokens"]
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) == r["num_tokens"] <= 48 for r in rows)
    assert all(r["id"].startswith("sharegpt_dummy_conversation:") for r in rows)
    assert not list((run.step_dir("tokenize")).glob(".tmp-*"))


def test_workers_give_the_same_files(tmp_path, shared_data, smollm2_dir):
    cfg1 = cfg_for(tmp_path, f"prepare.sources=[{{path: {shared_data}/train/alpaca_seed_tasks"
                   ".jsonl}]", "tokenize.workers=1", "tokenize.batch_size=16")
    pipeline.run_step(cfg1, "prepare")
    T.main(cfg1)
    a = list(tokens.iter_samples(Run.of(cfg1).tokens("train")))
    cfg2 = cfg_for(tmp_path, f"prepare.sources=[{{path: {shared_data}/train/alpaca_seed_tasks"
                   ".jsonl}]", "tokenize.workers=2", "tokenize.batch_size=16")
    T.main(cfg2)
    assert list(tokens.iter_samples(Run.of(cfg2).tokens("train"))) == a and len(a) > 100


def test_prompt_only_without_generate_is_a_clear_error(tmp_path, smollm2_dir):
    cfg = cfg_for(tmp_path)  # builtin:quickstart-prompts: questions only
    pipeline.run_step(cfg, "prepare")
    with pytest.raises(DrafterError, match="generate.enabled=true"):
        T.main(cfg)
    assert not Run.of(cfg).tokens("train").exists()


def test_missing_input_names_the_step(tmp_path):
    with pytest.raises(DrafterError, match="drafter prepare"):
        T.main(cfg_for(tmp_path))
    with pytest.raises(DrafterError, match="drafter generate"):
        T.main(cfg_for(tmp_path, "generate.enabled=true"))
