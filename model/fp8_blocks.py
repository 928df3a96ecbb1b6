"""FP8 e4m3 block quantization of a weight matrix, DeepSeek-V3 style: `w = w_fp8 * scale_inv`
per block of the weight (128x128 in DeepSeek's checkpoints), edge blocks partial. The loader
dequantizes with it; the tiny model's FP8 variant and the tests quantize with it. The kernels'
twins in native/reference.py do the same math (the tests pin the two together)."""

from __future__ import annotations

import math

import torch

from native import ops

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def _padded_blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 copy of `w` [N, K] zero-padded to whole blocks, viewed as [N/b0, b0, K/b1, b1]."""
    n, k = w.shape
    b0, b1 = block
    nb0, nb1 = math.ceil(n / b0), math.ceil(k / b1)
    padded = torch.zeros(nb0 * b0, nb1 * b1, dtype=torch.float32)
    padded[:n, :k] = w
    return padded.view(nb0, b0, nb1, b1)


def dequantize_fp8_blockwise(
    w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """w [N, K] float32 = w_fp8 [N, K] * scale_inv [ceil(N/b0), ceil(K/b1)] per block (edge
    blocks partial): `ops.dequantize_fp8_blocks`, one pass in the kernels."""
    return ops.dequantize_fp8_blocks(w_fp8, scale_inv, tuple(block))


def quantize_fp8_blockwise(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize w [N, K] to (w_fp8 [N, K] float8_e4m3fn, scale_inv [N/b0, K/b1] float32).

    scale_inv = amax(|block|) / 448, so each block's largest value maps to the fp8 maximum;
    an all-zero block gets scale_inv 1.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_blockwise needs a 2-D tensor, got shape {list(w.shape)}")
    n, k = w.shape
    blocks = _padded_blocks(w.float(), block)  # [N/b0, b0, K/b1, b1]
    amax = blocks.abs().amax(dim=(1, 3))  # [N/b0, K/b1]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    q = q.view(blocks.shape[0] * block[0], -1)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale_inv.contiguous()
