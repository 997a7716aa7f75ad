"""The target's hidden states, what a drafter learns from: the target forward with hooks that
captures the aux states and the teacher (capture), the same outputs captured inside vLLM for
targets beyond transformers (vllm_capture) with its hidden-states connector for vLLM's CPU build
(vllm_connector), the shards that store them (store), and the spool the chunks of a run pass
through when the disk holds less than the whole data (spool)."""
