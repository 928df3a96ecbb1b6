"""compressed-tensors int4 checkpoints (`quantization_config.quant_method = "compressed-tensors"`,
format "pack-quantized", as llm-compressor writes W4A16 models): a linear `X` is stored as
`X.weight_packed` int32 [N, K/8] (input k's 4 bits, offset by +8 to unsigned, at bits 4 * (k % 8)
of word k // 8 of its row), `X.weight_scale` [N, K/G] and `X.weight_shape` [2] = [N, K]; the value
is w[n, k] = weight_scale[n, k // G] * (q[n, k] - 8).

Only the symmetric group-wise form is taken (the config is refused otherwise). It is GPTQ's
symmetric form transposed, so `as_gptq` rewrites it as one (`model.gptq`): quant = "int4" keeps
it bit for bit at its group size, and every other scheme dequantizes it the same way."""

from __future__ import annotations

import torch

from model.gptq import GptqWeight

METHOD = "compressed-tensors"
SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")
_ZEROS_8 = 0x88888888 - 2**32  # eight zero points of 8 in one int32 word


def as_gptq(packed: torch.Tensor, scale: torch.Tensor, group: int, name: str) -> GptqWeight:
    """packed int32 [N, K/8] and scale [N, K/G] as the GPTQ weight they stand for."""
    n, k = packed.shape[0], packed.shape[1] * 8
    zeros = torch.full((-(-k // group), -(-n // 8)), _ZEROS_8, dtype=torch.int32)
    return GptqWeight(packed.T.contiguous(), zeros, scale.T.contiguous(), None, group, False, name)
