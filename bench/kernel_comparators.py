"""Baselines a user would pick instead of our kernels: the speed-up columns of `duet bench-kernels`.

Each builder returns {variant name: zero-argument callable}; the benchmark times every variant
and holds our kernel to the fastest. (The `native.reference` twins are correctness oracles, not
speed baselines: plain-torch loops nobody would deploy.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.cache_defeat import cycling
from native.reference_int4 import Int4Weight

Variants = dict[str, Callable[[], object]]


def torch_linear_variants(x: torch.Tensor, weights: list[torch.Tensor]) -> Variants:
    """y = x @ w.T for x [M, K] and w [N, K], every way torch offers, each rotating through the
    same weight copies as our kernel: F.linear and torch.mm on w.T (a view), and torch.mm /
    torch.matmul on a [K, N] copy of the weight prepared before timing."""
    w = cycling(weights)
    w_t = cycling([weight.t().contiguous() for weight in weights])  # [K, N]
    return {
        "F.linear": lambda: F.linear(x, w()),
        "mm(x, w.t())": lambda: torch.mm(x, w().t()),
        "mm(x, w_kn)": lambda: torch.mm(x, w_t()),
        "matmul(x, w_kn)": lambda: torch.matmul(x, w_t()),
    }


def int8_mm(a: torch.Tensor, b: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    """torch's int8 GEMM `torch._int_mm(a, b)` (a int8 [M, K], b int8 [K, N] -> int32 [M, N]),
    or None where this torch does not run it on the CPU for these shapes (older releases need
    M > 16 and K, N multiples of 8, or have no CPU kernel at all)."""
    int_mm = getattr(torch, "_int_mm", None)
    if int_mm is None or a.dtype != torch.int8 or b.dtype != torch.int8:
        return None
    try:
        int_mm(a, b)
    except (RuntimeError, NotImplementedError):
        return None
    return lambda: int_mm(a, b)


def int4_mm(x: torch.Tensor, weight: Int4Weight) -> Callable[[], torch.Tensor] | None:
    """torch's int4 weight-only GEMM (`aten._weight_int4pack_mm_for_cpu`, torchao's CPU path:
    bf16 activations, the weight dequantized per group inside the kernel) on the values of an
    Int4Weight [N, K]: q + 8 as its unsigned nibbles, its scales (in bf16, as the op takes them)
    with zero points 0, so y ~= x @ dequantize_int4(weight).T. x [M, K] and the weight are
    zero-padded to whole groups before timing. None where this torch lacks the op or refuses
    the shapes."""
    aten = torch.ops.aten
    convert = getattr(aten, "_convert_weight_to_int4pack_for_cpu", None)
    mm = getattr(aten, "_weight_int4pack_mm_for_cpu", None)
    if convert is None or mm is None:
        return None
    q, scale, group = weight
    pad = scale.shape[-1] * group - q.shape[-1]
    try:
        packed = convert(F.pad(q, (0, pad)).to(torch.int32) + 8, 1)
        scales_zeros = torch.stack((scale.t(), torch.zeros_like(scale.t())), -1)
        scales_zeros = scales_zeros.to(torch.bfloat16).contiguous()  # [K / group, N, 2]
        x_padded = F.pad(x, (0, pad)).to(torch.bfloat16).contiguous()
        mm(x_padded, packed, group, scales_zeros)
    except (RuntimeError, NotImplementedError):
        return None
    return lambda: mm(x_padded, packed, group, scales_zeros)


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    sm_scale: float,
) -> Callable[[], object]:
    """torch SDPA over the same data as extend attention ([S, H, D] inputs): [1, H, S, D] copies
    and the prefix-plus-causal mask made here, before timing."""
    new_len, prefix_len = q.shape[0], k_prefix.shape[0]
    q4 = q.transpose(0, 1)[None].contiguous()
    k4 = torch.cat((k_prefix, k)).transpose(0, 1)[None].contiguous()
    v4 = torch.cat((v_prefix, v)).transpose(0, 1)[None].contiguous()
    if prefix_len == 0:
        return lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=sm_scale)
    mask = torch.ones(new_len, prefix_len + new_len, dtype=torch.bool).tril(prefix_len)
    return lambda: F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=sm_scale)
