"""The prefill node server: chunked prefill on the extend kernels, the prefix cache, the KV
streamed to decode nodes, the first token to the router; tensor-parallel ranks (`ranks`)."""
