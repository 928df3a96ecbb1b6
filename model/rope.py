"""Rotary-embedding tables (default and YaRN, as DeepSeek and Hugging Face compute them)."""

from __future__ import annotations

import math

import torch

from control.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, dim: int) -> torch.Tensor:
    """f_i for i in [0, dim/2): theta^(-2i/dim), blended with f_i / factor by YaRN's ramp."""
    base = rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    if rope.kind != "yarn":
        return extrapolation
    interpolation = 1.0 / (rope.factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        max_pos = rope.original_max_position_embeddings
        return dim * math.log(max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1.0 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def rope_cos_sin(rope: RopeConfig, dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, dim] fp32: cos(p * f_i) * a in [:, :dim/2], sin(p * f_i) * a in [:, dim/2:],
    where a is YaRN's attention factor (1 for the default rope)."""
    freqs = torch.outer(
        torch.arange(max_positions, dtype=torch.float32), inverse_frequencies(rope, dim)
    )
    scale = rope.attention_factor
    return torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=1).contiguous()
