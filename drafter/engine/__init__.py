"""Decoding on one GPU, as fast as it allows: the static-cache target and its CUDA graphs
(static), the paged KV cache (paged), speculative trees and their verification (tree), the plain and
speculative decoding loop evaluate measures (decode), the batched data engine generate runs with
`engine: local` (generator)."""
