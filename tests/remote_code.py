"""A tiny remote-code multimodal wrapper shaped like Kimi-K2.5, built in tests (no download).

    path = make_kimi_like(tmp_path, tokenizer_dir=smollm2_dir)

Kimi-K2.5 ships as `KimiK25ForConditionalGeneration` in the folder's own modeling_kimi_k25.py
(`auto_map` in config.json, so loading it needs `trust_remote_code`): a DeepSeek-V3 causal LM
under `language_model` (MLA, routed experts) beside a vision tower and its projector, and a
`quantization_config` of compressed-tensors form (INT4, groups of 32, for the routed experts;
lm_head, attention, shared experts and dense MLPs left out). The folder here has the same shape
with tests/tiny.py's deepseek_v3 as the text model, a vision stub, and float32 weights: its
quantization_config is what the planner reads, and sits only in text_config, where transformers'
loader does not act on it (a top-level one would make transformers look for the
compressed-tensors package and packed weights).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.tiny import ARCHS, COMMON

CONFIGURATION = '''\
"""KimiK25Config: a DeepSeek-V3 text config and a vision config (written the way remote code
is: a plain __init__)."""
from transformers import DeepseekV3Config, PretrainedConfig


class KimiK25VisionConfig(PretrainedConfig):
    model_type = "kimi_k25_vision"

    def __init__(self, vt_hidden_size=16, vt_num_hidden_layers=2, patch_size=14,
                 text_hidden_size=64, **kwargs):
        self.vt_hidden_size = vt_hidden_size
        self.vt_num_hidden_layers = vt_num_hidden_layers
        self.patch_size = patch_size
        self.text_hidden_size = text_hidden_size
        super().__init__(**kwargs)


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"
    sub_configs = {"text_config": DeepseekV3Config, "vision_config": KimiK25VisionConfig}

    def __init__(self, text_config=None, vision_config=None, media_placeholder_token_id=0,
                 **kwargs):
        if isinstance(text_config, dict):
            text_config = DeepseekV3Config(**text_config)
        if isinstance(vision_config, dict):
            vision_config = KimiK25VisionConfig(**vision_config)
        self.text_config = text_config if text_config is not None else DeepseekV3Config()
        self.vision_config = vision_config if vision_config is not None \\
            else KimiK25VisionConfig()
        self.media_placeholder_token_id = media_placeholder_token_id
        super().__init__(**kwargs)
'''

MODELING = '''\
"""KimiK25ForConditionalGeneration: the text model under `language_model`, a vision stub under
`vision_tower` and `mm_projector`; text-only forwards go straight to the language model."""
from torch import nn
from transformers import DeepseekV3ForCausalLM, GenerationMixin, PreTrainedModel

from .configuration_kimi_k25 import KimiK25Config


class VisionStub(nn.Module):
    """Stands in for the vision tower: weights to load, never run on text."""

    def __init__(self, cfg):
        super().__init__()
        self.patch_embed = nn.Linear(3 * cfg.patch_size ** 2, cfg.vt_hidden_size)
        self.blocks = nn.ModuleList(nn.Linear(cfg.vt_hidden_size, cfg.vt_hidden_size)
                                    for _ in range(cfg.vt_num_hidden_layers))


class KimiK25PreTrainedModel(PreTrainedModel):
    config_class = KimiK25Config
    base_model_prefix = ""
    _no_split_modules = ["DeepseekV3DecoderLayer"]
    _supports_sdpa = True


class KimiK25ForConditionalGeneration(KimiK25PreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.vision_tower = VisionStub(config.vision_config)
        self.mm_projector = nn.Linear(config.vision_config.vt_hidden_size,
                                      config.text_config.hidden_size)
        self.language_model = DeepseekV3ForCausalLM(config.text_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def forward(self, input_ids=None, pixel_values=None, **kwargs):
        if pixel_values is not None:
            raise NotImplementedError("the vision stub runs no images")
        return self.language_model(input_ids=input_ids, **kwargs)
'''

# Kimi-K2.5's own quantization_config, as its config.json has it.
QUANTIZATION = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                    "group_size": 32, "num_bits": 4, "observer": "minmax",
                    "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


def text_config_dict(**overrides) -> dict:
    """tests/tiny.py's deepseek_v3, as a config.json's text_config."""
    import transformers

    cls_name, extra = ARCHS["deepseek_v3"]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **extra, **overrides})
    d = cfg.to_dict()
    d["architectures"] = ["DeepseekV3ForCausalLM"]
    return d


def write_folder(out: Path, quantization: dict | None = QUANTIZATION, **overrides) -> Path:
    """The folder without weights: config.json and the two code files."""
    out.mkdir(parents=True, exist_ok=True)
    text = text_config_dict(**overrides)
    if quantization is not None:
        text["quantization_config"] = quantization
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                     "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {"vt_hidden_size": 16, "vt_num_hidden_layers": 2, "patch_size": 14,
                          "text_hidden_size": text["hidden_size"]},
        "media_placeholder_token_id": 0,
        "tie_word_embeddings": False,
        "dtype": "float32",
        "bos_token_id": text.get("bos_token_id"),
        "eos_token_id": text.get("eos_token_id"),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "configuration_kimi_k25.py").write_text(CONFIGURATION)
    (out / "modeling_kimi_k25.py").write_text(MODELING)
    return out


def make_kimi_like(out: Path, tokenizer_dir: Path | None = None, seed: int = 0,
                   **overrides) -> Path:
    """The whole folder: config, code, float32 safetensors weights, and the SmolLM2 tokenizer
    when given (its vocab is tests/tiny.py's)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = write_folder(Path(out) / "kimi_k25", **overrides)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True,
                                             dtype=torch.float32).eval()
    written = json.loads((folder / "config.json").read_text())
    model.save_pretrained(folder)
    # save_pretrained rewrites config.json from the config object; keep the folder's own (the
    # shape a published checkpoint has), with the code files beside it
    (folder / "config.json").write_text(json.dumps(written, indent=2))
    if tokenizer_dir is not None:
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder
