"""Evaluate's decoding on one GPU, plain and speculative, as fast as it allows: the static-cache
target, its CUDA graphs and pinned uploads (static), speculative trees, their drafting and
verification and the drafter behind them (tree), sampled verification on the draft vocab's
support (rejection), the Triton kernels of the trees' expansions and of that verification
(tree_kernels) with the pieces they share, search keys and Gumbel noise (triton_helpers), the
sampling noise as the PyTorch forms draw it and the numbers the kernels share with them (noise),
block verification of a sampled chain (block), a block drafter's (DSpark, DFlash) context cache
and its step (dspark), and the decoding loop evaluate measures (decode)."""
