"""What evaluate measures and how a reader sees it: the lossless verdict, with 16-bit mismatches
decoded again in float32 to tell drift from a real divergence (lossless), the figures of its
passes and their sums (summary), whether its speed figures hold up, timed again in turns
(speedcheck), the speculative setting to serve a drafter with (tuning), the serving command per
temperature that reproduces it (serving) and its flags written into the export READMEs (tuned),
the acceptance measured inside vLLM (vllm_eval) and the test of whether it agrees with drafter's
own at a temperature above 0 (agreement), and the report with its plots (report). Above the
decoding and export layers; the evaluate step calls into it."""
