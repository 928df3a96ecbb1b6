"""Plain-torch twins of the INT4 W4A8 ops (`linear_int4`, `fused_moe_int4`): the oracle of their
kernels (native/csrc/gemm_int4.h, moe_int4.cpp) in tests and their fallback off the CPU.

Weights: 4-bit symmetric, one fp32 scale per group of `group_size` inputs of an output row
(llama.cpp's Q4_0 rule): scale = -e / 8 where e is the group's value of largest magnitude (so e
maps to -8 and all 16 levels are used), q = clamp(round_half_even(w / scale), -8, 7); an all-zero
group has scale 0 and q = 0. K is zero-padded to whole groups. Activations: the int8 linear's
per-token quantizer (`reference.quantize_per_token_int8`).

The output is y = x_scale * sum_g scale[n, g] * (sum_{k in g} q_x[k] q_w[n, k]): the integer sums
are exact in both; the kernels add the group terms in fp32 (one fused multiply-add per group, in
group order), this twin in float64 and rounds once, so the two differ by fp32 rounding only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from native import reference

DEFAULT_GROUP_SIZE = 64  # the inputs that share a scale (see model/quant.py for the choice)
MAX_GROUP_SIZE = 256  # kInt4MaxGroup of gemm_int4.h


class Int4Weight(NamedTuple):
    """A weight quantized for `linear_int4`: qweight int8 [..., N, K] in [-8, 7], scale fp32
    [..., N, ceil(K / group_size)]."""

    qweight: torch.Tensor
    scale: torch.Tensor
    group_size: int


def check_group_size(group_size: int) -> int:
    if not isinstance(group_size, int) or not (
        8 <= group_size <= MAX_GROUP_SIZE and group_size % 8 == 0
    ):
        raise ValueError(
            f"int4 group_size must be a multiple of 8 in [8, {MAX_GROUP_SIZE}], got {group_size!r}"
        )
    return group_size


def quantize_weight_int4(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> Int4Weight:
    """weight [..., N, K] -> Int4Weight with weight ~= q * scale per group (the rule above)."""
    check_group_size(group_size)
    k = weight.shape[-1]
    groups = -(-k // group_size)
    w = F.pad(weight.float(), (0, groups * group_size - k))
    w = w.view(*weight.shape[:-1], groups, group_size)
    extreme = w.gather(-1, w.abs().argmax(-1, keepdim=True)).squeeze(-1)
    scale = extreme / -8.0
    safe = torch.where(scale == 0, 1.0, scale)
    q = torch.where(scale[..., None] == 0, 0.0, torch.round(w / safe[..., None]))
    q = q.clamp_(-8, 7).to(torch.int8).view(*weight.shape[:-1], groups * group_size)
    return Int4Weight(q[..., :k].contiguous(), scale, group_size)


def dequantize_int4(weight: Int4Weight) -> torch.Tensor:
    """The fp32 values [..., N, K] an Int4Weight stands for."""
    k = weight.qweight.shape[-1]
    scale = weight.scale.repeat_interleave(weight.group_size, -1)[..., :k]
    return weight.qweight.float() * scale


def prepack_linear_int4(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> Int4Weight:
    """Quantizes a float weight [N, K] for `linear_int4` (the kernels also pack it)."""
    return quantize_weight_int4(weight, group_size)


def _grouped_sums(q: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """float64 [M, N] = sum_g scale[n, g] * (q[m, g] . qweight[n, g]) (the sums exact)."""
    k, group = q.shape[1], w.group_size
    groups = w.scale.shape[-1]
    pad = groups * group - k
    qx = F.pad(q.double(), (0, pad))
    qw = F.pad(w.qweight.double(), (0, pad))
    out = torch.zeros(q.shape[0], qw.shape[0], dtype=torch.float64)
    for g in range(groups):
        cols = slice(g * group, (g + 1) * group)
        out += (qx[:, cols] @ qw[:, cols].T) * w.scale[:, g].double()[None, :]
    return out


def linear_int4(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """W4A8 y ~= x @ W.T: x [M, K] quantized per token (int8), the group sums scaled and added,
    times the token's scale; returned in x.dtype. [M, N]."""
    q, x_scale = reference.quantize_per_token_int8(x)
    return (_grouped_sums(q, weight) * x_scale.double()[:, None]).to(x.dtype)


def prepack_experts_int4(
    w13: torch.Tensor | list[torch.Tensor],
    w2: torch.Tensor | list[torch.Tensor],
    group_size: int = DEFAULT_GROUP_SIZE,
) -> tuple[Int4Weight, Int4Weight]:
    """Quantizes routed experts per group: w13 [E, 2I, D] and w2 [E, D, I] (lists are stacked)."""
    stacked = reference.prepack_experts(w13, w2)
    return tuple(quantize_weight_int4(w, group_size) for w in stacked)


def _expert(weight: Int4Weight, e: int) -> Int4Weight:
    return Int4Weight(weight.qweight[e], weight.scale[e], weight.group_size)


def fused_moe_int4(
    x: torch.Tensor,
    w13: Int4Weight,
    w2: Int4Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """Routed experts in W4A8, the contract of `fused_moe` with weights from
    `prepack_experts_int4`: x quantized per token once, gate/up as `linear_int4` in fp32,
    h = silu(g) * u in fp32, h quantized again per (token, expert) row for the down projection.
    Returns [T, D] in x.dtype."""
    num_local = w13.qweight.shape[0]
    inter = w13.qweight.shape[1] // 2
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    qx, x_scale = reference.quantize_per_token_int8(x)
    local_ids = topk_ids.long() - expert_offset
    for e in range(num_local):
        token_idx, slot = torch.nonzero(local_ids == e, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        gate_up = _grouped_sums(qx[token_idx], _expert(w13, e)).float()
        gate_up = gate_up * x_scale[token_idx, None]
        g, u = gate_up[:, :inter], gate_up[:, inter:]
        h = g / (1.0 + torch.exp(-g)) * u
        qh, h_scale = reference.quantize_per_token_int8(h)
        y = _grouped_sums(qh, _expert(w2, e)).float() * h_scale[:, None]
        out.index_add_(0, token_idx, y * topk_weights[token_idx, slot, None].float())
    return out.to(x.dtype)
