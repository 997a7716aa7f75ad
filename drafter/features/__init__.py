"""The target's hidden states, what a drafter learns from: the target forward with hooks that
captures the aux states and the teacher (capture), the same outputs captured inside vLLM for
targets beyond transformers (vllm_capture) with its hidden-states connector for vLLM's CPU build
(vllm_connector), and the shards that store them (store)."""
