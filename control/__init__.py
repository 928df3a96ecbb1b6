"""The control plane, torch-free: wire messages and sampling parameters as plain data, the
cluster config, sockets and their security, prompt checks, the tokenizer, cost models.

The router, the deploy tools and the benchmark clients import only this package (and no
torch, model or kernels); every other package may import it.
"""
