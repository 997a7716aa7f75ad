"""vLLM's hidden-states connector for machines without CUDA (its CPU build).

vLLM's `extract_hidden_states` method keeps the requested layers' states in a cache-only layer,
and its `ExampleHiddenStatesConnector` writes each finished request's states to a safetensors
file: [T, layers, Ht] for the prompt tokens, path in `output.kv_transfer_params`. The stock
connector copies them to the host through a CUDA stream into pinned memory, which the CPU build
has neither of. This subclass does the same copy synchronously, on any device, and nothing else:
the file, the lock protocol (`load_hidden_states` waits on it) and the finished-request
bookkeeping are the stock connector's.

vLLM imports this module by path inside its engine process
(`kv_connector_module_path: drafter.features.vllm_connector`); drafter/features/vllm_capture.py
picks it on CPU and the stock connector elsewhere. Only that module imports this one.
"""
from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    """The stock hidden-states connector with a synchronous copy (no CUDA stream or event)."""

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size)[None]
                 + blocks[:, None] * self._block_size).flatten()            # [blocks*bs]
        n = pending.token_ids.shape[0]
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n)
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": states.cpu().contiguous(),
                       "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the reader waiting in load_hidden_states
        self._req_copy_events[pending.req_id] = None  # written: done sending at once

    def get_finished(self, finished_req_ids: set[str]):
        if self.has_connector_metadata():
            for pending in getattr(self._get_connector_metadata(), "pending_saves", []):
                self._submit_async_write(pending)
        self._accumulated_finished_req_ids.update(finished_req_ids)
        done = set()
        for req_id in list(self._accumulated_finished_req_ids):
            if req_id not in self._req_copy_events:  # its states are not written yet
                continue
            del self._req_copy_events[req_id]
            self._accumulated_finished_req_ids.discard(req_id)
            done.add(req_id)
        return done or None, None
