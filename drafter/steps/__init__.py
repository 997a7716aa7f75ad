"""One module per pipeline step, each with a main(cfg) -> {"counts": {...}, ...}."""
