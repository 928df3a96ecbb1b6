"""Benchmarks (kernels, offline end to end, serving), each printing ratios measured in one
run; `bench.serve` is a load generator for any OpenAI-compatible server."""
