"""Sampling ops: the counter-based ones backed by native/csrc/sampling.cpp (the exponential race
over a batch of rows in one call, and the uniforms of the same streams), and the greedy rows'
argmax (native/csrc/argmax.cpp).

Each function has the signature and contract of its twin in `native.reference_sampling` (the
stream's definition is there) and gives the same bits; it falls back to the twin when the
kernels are off or a tensor is not on the CPU.
"""

from __future__ import annotations

import torch

from native import reference_sampling
from native._tags import tags
from native.switch import kernels as _kernels


def _int64_rows(t: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    if t.shape != (rows,) or t.dtype != torch.int64:
        raise ValueError(f"{name} must be int64 [{rows}], got {t.dtype} {list(t.shape)}")
    return t if t.is_contiguous() else t.contiguous()


def race_sample(probs: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """probs fp32 [R, V] (unnormalized, >= 0); seeds, counters int64 [R] -> tokens int64 [R]:
    row r's token is v with probability probs[r, v] / sum(probs[r]), a pure function of
    (seeds[r], counters[r], probs[r]); -1 for a row with no positive probability (all zero,
    negative or NaN: the caller decides what such a row means)."""
    if probs.dim() != 2 or probs.dtype != torch.float32:
        raise ValueError(f"probs must be fp32 [R, V], got {probs.dtype} {list(probs.shape)}")
    rows = probs.shape[0]
    seeds, counters = _int64_rows(seeds, rows, "seeds"), _int64_rows(counters, rows, "counters")
    kernels = _kernels()
    if kernels is None or not (probs.is_cpu and seeds.is_cpu and counters.is_cpu):
        return reference_sampling.race_sample(probs, seeds, counters)
    probs = probs if probs.is_contiguous() else probs.contiguous()
    tokens = torch.empty(rows, dtype=torch.int64)
    kernels.race_sample(
        probs.data_ptr(),
        seeds.data_ptr(),
        counters.data_ptr(),
        tokens.data_ptr(),
        rows,
        probs.shape[1],
        tags(probs, seeds, counters, tokens),
    )
    return tokens


def race_exponentials(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """seeds, counters int64 [R] -> E fp32 [R, V]: the Exp(1) numbers each row's race divides
    by (what `race_sample` compares, for tests and diagnostics)."""
    rows = seeds.shape[0] if seeds.dim() == 1 else -1
    seeds, counters = _int64_rows(seeds, rows, "seeds"), _int64_rows(counters, rows, "counters")
    kernels = _kernels()
    if kernels is None or not (seeds.is_cpu and counters.is_cpu):
        return reference_sampling.race_exponentials(seeds, counters, vocab_size)
    out = torch.empty(rows, vocab_size, dtype=torch.float32)
    kernels.race_exponentials(
        seeds.data_ptr(),
        counters.data_ptr(),
        out.data_ptr(),
        rows,
        vocab_size,
        tags(seeds, counters, out),
    )
    return out


def random_uniform(seeds: torch.Tensor, counters: torch.Tensor, index: int) -> torch.Tensor:
    """seeds, counters int64 [R] -> U fp32 [R] in (0, 1): each row's uniform at token index
    `index` (in [0, V): the one its race turns into E; negative indices are never raced, so they
    are free for other draws of the same (seed, counter), e.g. index -1 - j for the acceptance
    test of the j-th speculative token)."""
    rows = seeds.shape[0] if seeds.dim() == 1 else -1
    seeds, counters = _int64_rows(seeds, rows, "seeds"), _int64_rows(counters, rows, "counters")
    kernels = _kernels()
    if kernels is None or not (seeds.is_cpu and counters.is_cpu):
        return reference_sampling.random_uniform(seeds, counters, index)
    out = torch.empty(rows, dtype=torch.float32)
    kernels.random_uniform(
        seeds.data_ptr(),
        counters.data_ptr(),
        out.data_ptr(),
        rows,
        index,
        tags(seeds, counters, out),
    )
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x fp32 [R, V] -> int64 [R]: torch.argmax(x, -1), each row's first index of its largest
    value (its first NaN when it has one)."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] == 0:
        raise ValueError(f"x must be fp32 [R, V] with V >= 1, got {x.dtype} {list(x.shape)}")
    kernels = _kernels()
    if kernels is None or not x.is_cpu:
        return reference_sampling.argmax_rows(x)
    if x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1]):
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    ld = x.stride(0) if x.shape[0] > 1 else x.shape[1]
    kernels.argmax_rows(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], ld, tags(x, out))
    return out
