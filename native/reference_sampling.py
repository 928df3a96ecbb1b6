"""Plain-torch twins of the counter-based sampling ops (native/csrc/sampling.cpp), bit for bit.

A request's random numbers are a pure function of (seed, draw, index): `draw` counts the tokens
the request sampled before (its counter), `index` is the token id whose race number it is.

    key(seed, draw) = mix64(mix64(seed ^ SEED_SALT) ^ draw)     one per row
    bits            = mix64(key + index * GOLDEN)               splitmix64's output #index
    U               = (2 * (bits >> 41) + 1) * 2^-24            23 bits, exact in fp32, in (0, 1)
    E               = -log(U) by the Cephes logf polynomial, fp32, no fused multiply-add
    token           = the first argmax over v of probs[v] / E_v (a positive ratio; else -1)

mix64 is the splitmix64 finalizer, integer arithmetic is mod 2^64. The race reads indices
[0, V); negative indices are reserved for other draws of the same (seed, draw), such as the
acceptance test of a speculative token (`random_uniform(seeds, draws, -1)`).

Torch has no uint64 arithmetic: int64 holds the same bits (+, *, ^ wrap alike); the right
shifts are logical (arithmetic shift, then a mask) and the uint64 constants are written as the
int64 of the same bits. The fp32 steps are one torch op each (no addcmul, no alpha=), in the
kernel's order, so each rounds once as the kernel's do.
"""

from __future__ import annotations

import torch


def _int64(constant: int) -> int:
    """The int64 with the bits of a uint64 constant."""
    return constant - (1 << 64) if constant >= 1 << 63 else constant


GOLDEN = _int64(0x9E3779B97F4A7C15)
SEED_SALT = _int64(0x2545F4914F6CDD1D)
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)
_UNIFORM_SHIFT = 41  # the top 23 bits make U

_SQRT_HALF = 0.707106781186547524
_LOG_POLY = (
    7.0376836292e-2,
    -1.1514610310e-1,
    1.1676998740e-1,
    -1.2420140846e-1,
    1.4249322787e-1,
    -1.6668057665e-1,
    2.0000714765e-1,
    -2.4999993993e-1,
    3.3333331174e-1,
)
_LN2_LO, _LN2_HI = -2.12194440e-4, 0.693359375


def _srl(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 bits (a bijection of 64-bit words)."""
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return z ^ _srl(z, 31)


def row_keys(seeds: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """seeds, draws int64 [R] -> the rows' stream keys int64 [R]."""
    return mix64(mix64(seeds ^ SEED_SALT) ^ draws)


def uniforms(seeds: torch.Tensor, draws: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """seeds, draws int64 [R]; index int64 [N] -> U fp32 [R, N], each in (0, 1)."""
    bits = mix64(row_keys(seeds, draws)[:, None] + index[None, :] * GOLDEN)  # [R, N]
    odd = 2 * _srl(bits, _UNIFORM_SHIFT) + 1  # < 2^24: exact in fp32
    return odd.float() * 2.0**-24


def neg_log(u: torch.Tensor) -> torch.Tensor:
    """-log(u) for fp32 u in (0, 1), as the kernel computes it: u = m 2^e with m in
    [sqrt(1/2), sqrt(2)), log(u) = e ln2 + log(1 + x), x = m - 1, by Cephes' logf polynomial."""
    m, exponent = torch.frexp(u)  # m in [0.5, 1)
    e = exponent.float()
    low = m < _SQRT_HALF
    e = torch.where(low, e - 1.0, e)
    x = torch.where(low, m + m, m) - 1.0  # exact
    z = x * x
    y = torch.full_like(x, _LOG_POLY[0])
    for c in _LOG_POLY[1:]:
        y = y * x + c
    y = (y * x) * z
    y = y + e * _LN2_LO
    y = y - z * 0.5
    r = x + y
    r = r + e * _LN2_HI
    return -r


def race_exponentials(seeds: torch.Tensor, draws: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """seeds, draws int64 [R] -> E fp32 [R, V]: the race's Exp(1) numbers of each row."""
    return neg_log(uniforms(seeds, draws, torch.arange(vocab_size)))


def race_sample(probs: torch.Tensor, seeds: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """probs fp32 [R, V] (unnormalized, >= 0); seeds, draws int64 [R] -> tokens int64 [R]:
    token r = the first argmax of probs[r] / E(seeds[r], draws[r]), which is v with
    probability probs[r, v] / sum(probs[r]); -1 for a row with no positive probability (all
    zero, negative or NaN)."""
    ratio = probs.float() / race_exponentials(seeds, draws, probs.shape[1])  # [R, V]
    ratio = torch.where(ratio > 0, ratio, 0.0)  # only a positive ratio wins (NaN does not)
    tokens = ratio.argmax(-1)  # the first maximum
    return tokens.masked_fill_(ratio.amax(-1) <= 0, -1) if len(tokens) else tokens


def random_uniform(seeds: torch.Tensor, draws: torch.Tensor, index: int) -> torch.Tensor:
    """seeds, draws int64 [R] -> U fp32 [R]: the uniform of each row's stream at `index` (for
    index in [0, V) the one its race turns into E; negative indices are never raced)."""
    return uniforms(seeds, draws, torch.tensor([index]))[:, 0]


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x fp32 [R, V] -> int64 [R]: each row's first index of its largest value (its first NaN when
    it has one): the greedy token."""
    return x.argmax(-1)
