"""One module per pipeline step, in pipeline order (prepare, generate, tokenize, vocab, extract,
train, export, evaluate), each with a main(cfg) -> {"counts": {...}, ...}."""
