"""What evaluate measures and how a reader sees it: the lossless verdict, with 16-bit mismatches
decoded again in float32 to tell drift from a real divergence (lossless), and the report with its
plots (report), the speculative setting to serve a drafter with (tuning) and its flags written
into the export READMEs (tuned). Above the engine and export layers; the evaluate step calls into
it."""
