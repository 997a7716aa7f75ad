"""A served draft model's weights replaced in a running vLLM through vLLM's own draft weight
update, from a safetensors file: imported by vLLM's workers only.

    vllm serve TARGET --speculative-config '{"method": "eagle3", "model": DIR, ...}' \
        --weight-transfer-config '{"backend": "drafter_files"}' \
        --worker-extension-cls drafter.core.vllm_weights.Extension     # VLLM_SERVER_DEV_MODE=1
    POST /init_weight_transfer_engine {"init_info": {}}
    POST /start_draft_weight_update
    POST /update_weights {"update_info": {"path": "/abs/weights.safetensors", "sha256": "..."}}
    POST /finish_weight_update {"weight_version": "v3"}

What the file may hold: the draft layer's tensors in the native export's names (fc, midlayer,
norm, lm_head, d2t). Never `embed_tokens`: vLLM gives an EAGLE draft the target's own table
when the export's is identical (vllm/v1/spec_decode/llm_base_proposer.py,
`_maybe_share_embeddings`), so writing it would write the target's weights; nor an `lm_head`
vLLM shares with the target (`_maybe_share_lm_head`).

The reasoning: docs/internals.md, "Module notes", vllm_weights.py.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch

from drafter.core.vllm_cpu import Repairs

log = logging.getLogger("drafter")

BACKEND = "drafter_files"
REFUSED = ("embed_tokens",)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _register() -> bool:
    """Register the backend in vLLM's weight transfer factory (once a process)."""
    try:
        from vllm.distributed.weight_transfer.base import (
            WeightTransferEngine,
            WeightTransferInitInfo,
            WeightTransferUpdateInfo,
        )
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return False
    if BACKEND in WeightTransferEngineFactory._registry:
        return True

    @dataclass
    class InitInfo(WeightTransferInitInfo):
        pass

    @dataclass
    class UpdateInfo(WeightTransferUpdateInfo):
        path: str
        sha256: str | None = None

    class FileEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
        """Weights from a safetensors file, loaded in place (module doc)."""

        init_info_cls = InitInfo
        update_info_cls = UpdateInfo

        def init_transfer_engine(self, init_info) -> None:
            pass

        def start_weight_update(self) -> None:
            pass

        def finish_weight_update(self) -> None:
            pass

        def update_weights(self, update_info) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type != "cpu":   # base.py:502 syncs an accelerator unconditionally
                torch.accelerator.synchronize()

        def receive_weights(self, info) -> None:
            from safetensors.torch import load_file

            if self.model is self._default_model:
                raise RuntimeError(f"{BACKEND} replaces a draft model's weights only: call "
                                   "start_draft_weight_update first")
            if info.sha256 and _sha256(info.path) != info.sha256:
                raise RuntimeError(f"{info.path}: its sha256 is not the one announced")
            weights = load_file(info.path)
            bad = [n for n in weights if any(r in n for r in REFUSED)]
            head = getattr(self.model, "lm_head", None)
            shared = head is not None and any(
                p.data_ptr() == head.weight.data_ptr() for p in self._default_model.parameters())
            if shared:
                bad += [n for n in weights if "lm_head" in n]
            if bad:
                raise RuntimeError(f"{info.path}: {bad} are the target's own tensors in this "
                                   "engine (shared with the draft): refused")
            from vllm.model_executor.model_loader.reload import (
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )

            # vLLM's own reload, start to end in this one call: the layers' processing after
            # loading runs again (the CPU build repacks each linear layer's weight into a
            # oneDNN handle there and keeps an empty tensor as its `weight`), and the processed
            # tensors are copied into the old storage
            with torch.no_grad():
                initialize_layerwise_reload(self.model)
                try:
                    self.model.load_weights(weights.items())
                finally:
                    finalize_layerwise_reload(self.model, self.model_config)
            log.info("%s: %d draft tensors loaded from %s", BACKEND, len(weights), info.path)

        def shutdown(self) -> None:
            pass

    WeightTransferEngineFactory.register_engine(BACKEND, FileEngine)
    return True


REGISTERED = _register()


class Extension(Repairs):
    """The worker extension vLLM inherits its worker from: the import registers the backend."""
