"""The data engine generate runs with `generate.server.engine: drafter`: continuous batching of the
target over an open request stream (generator), the paged KV cache and its attention (paged) with
its Triton kernels (paged_kernels), the per-row sampling of its rows (sampling), its requests and
the stream its replicas drain (stream), and one generator per GPU on one stream, the static
decoder the fallback (local). Above decoding, whose static-cache pieces it reuses."""
