"""What evaluate measures and how a reader sees it: the lossless verdict, with 16-bit mismatches
decoded again in float32 to tell drift from a real divergence (lossless), the figures of its
passes and their sums (summary), the speculative setting to serve a drafter with (tuning) and
its flags written into the export READMEs (tuned), the acceptance measured inside vLLM
(vllm_eval), and the report with its plots (report). Above the decoding and export layers; the
evaluate step calls into it."""
