"""Foundations every other package stands on: the typed config (config) with its YAML loading,
overrides and cross-field rules (configload), the only code that knows run-directory paths and
writes atomically (rundir), the torchrun environment (dist), the GPUs and who holds them (gpu),
the target model loaded the one way (target), a GGUF target materialised into an HF folder
(gguf), the target's weights read and sized as stored (weights), vLLM started for the target
(vllm), a repair of its CPU build that its workers load (vllm_cpu), and the backend its workers
load to swap a served drafter's weights from a file (vllm_weights). Imports nothing of drafter
but drafter.DrafterError."""
