"""A GGUF file as a normal HF folder, materialised once into the cache dir (target.resolve calls
it for a `.gguf` target and for `builtin:` ones).

transformers loads a GGUF (dequantised) but refuses to save_pretrained a GGUF-quantised model, so
we load in float32, drop the quantizer marks, set `architectures`, and save in bf16 with the
tokenizer and its chat template. The tokenizer splits text before BPE the way llama.cpp does for
the GGUF's `tokenizer.ggml.pre` (transformers has no rule for "smollm": without it a newline,
four spaces and "0" became 3 pieces, the last space apart, where llama.cpp keeps the newline and
the four spaces as one). A file lock plus a rename into place make two concurrent
materialisations produce one good folder; MATERIALISE_VERSION in the folder name makes a fixed
materialisation replace an older one.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
from pathlib import Path

from drafter.core.rundir import atomic_dir, atomic_json, cache_dir

log = logging.getLogger("drafter")

# Bumped whenever materialising changes what it writes (2: llama.cpp's pre-tokenizer).
MATERIALISE_VERSION = 2

# llama.cpp's pre-tokenizers (src/llama-vocab.cpp) that split every digit off before the GPT-2
# regex: `tokenizer.ggml.pre` values of LLAMA_VOCAB_PRE_TYPE_SMOLLM, _STARCODER and _REFACT,
# whose regex_exprs are {"\\p{N}", the GPT-2 regex}.
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact")


def _gguf_key(path: Path) -> str:
    st = path.stat()
    blob = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{MATERIALISE_VERSION}".encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def gguf_pre_tokenizer(gguf: Path) -> str | None:
    """The GGUF's `tokenizer.ggml.pre` (llama.cpp's name of its pre-tokenizer), or None."""
    from gguf import GGUFReader

    f = GGUFReader(str(gguf)).fields.get("tokenizer.ggml.pre")
    return bytes(f.parts[f.data[0]]).decode() if f is not None and f.data else None


def match_llama_cpp_split(tok, pre: str | None) -> None:
    """Give the tokenizer llama.cpp's pre-tokenizer for `pre`: for the digit-split family each
    \\p{N} character is its own piece (tokenizers' Digits: Rust's is_numeric is \\p{N}), then
    the GPT-2 regex runs on each piece (ByteLevel's regex is llama.cpp's GPT-2 one), so a run of
    spaces before a digit stays whole. Other pre-tokenizers are left as transformers built
    them."""
    if pre not in DIGIT_SPLIT_PRE:
        return
    from tokenizers import pre_tokenizers

    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def materialise_gguf(gguf: Path, out_root: Path | None = None) -> Path:
    """Turn a .gguf file (one that exists: target.resolve checks) into an HF folder (bf16
    safetensors, tokenizer, chat template), once."""
    gguf = Path(gguf)
    out_root = out_root or cache_dir() / "models"
    out = out_root / f"{gguf.stem}-{_gguf_key(gguf)}"
    if (out / "DRAFTER_COMPLETE").exists():
        return out
    with _file_lock(out_root / f".{out.name}.lock"):
        if (out / "DRAFTER_COMPLETE").exists():  # another process finished it while we waited
            return out
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("materialising %s into %s (once)", gguf, out)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _align_special_tokens(tok, model.config)
        match_llama_cpp_split(tok, gguf_pre_tokenizer(gguf))
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
        model.config.architectures = [type(model).__name__]
        model.to(torch.bfloat16)
        model.config.dtype = "bfloat16"
        with atomic_dir(out) as tmp:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            atomic_json(tmp / "DRAFTER_SOURCE.json", {"gguf": str(gguf.resolve()),
                                                      "size": gguf.stat().st_size})
            (tmp / "DRAFTER_COMPLETE").write_text("ok\n")
    return out


def _align_special_tokens(tok, config) -> None:
    """The GGUF's own bos/eos ids (tokenizer.ggml.*_token_id, read into the model config) win
    over what the tokenizer converter guessed: transformers 5.17 turns SmolLM2's eos into
    <|im_start|> (id 1) although the GGUF says 2 (<|im_end|>), and generation would never stop."""
    for name in ("bos", "eos"):
        want = getattr(config, f"{name}_token_id", None)
        if isinstance(want, list):
            want = want[0] if want else None
        if isinstance(want, int) and getattr(tok, f"{name}_token_id") != want:
            setattr(tok, f"{name}_token", tok.convert_ids_to_tokens(want))
    if tok.pad_token_id is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
