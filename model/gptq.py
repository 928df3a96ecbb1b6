"""GPTQ 4-bit checkpoints (`quantization_config.quant_method = "gptq"`, AutoGPTQ / GPTQModel
format): a linear `X` is stored as `X.qweight` int32 [K/8, N] (input k's 4 bits at bits
4 * (k % 8) of row k // 8), `X.qzeros` int32 [K/G, N/8] (likewise along N), `X.scales` fp16
[K/G, N] and, optionally, `X.g_idx` int32 [K] (the group of each input; k // G unless the
checkpoint was made with desc_act). The value is w[n, k] = scales[g, n] * (q[k, n] - z[g, n]),
g = g_idx[k], where the "gptq" (v1) format stores z - 1 and "gptq_v2" stores z.

A symmetric checkpoint (every z = 8) with inputs in group order and a group size the int4 kernels
take is exactly our int4 form (`Int4Weight`: q - 8, the scales as fp32): the "int4" scheme keeps
it as stored, bit for bit. Anything else (another scheme, zero points, desc_act) is dequantized
to floats first, as an FP8 checkpoint is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from native.reference_int4 import MAX_GROUP_SIZE, Int4Weight

SUFFIXES = ("qweight", "qzeros", "scales")  # the tensors every GPTQ linear has
G_IDX = "g_idx"  # and the one it may have


def unpack_int32_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words holding 8 4-bit values each (the lowest bits first) unpacked along `dim`:
    [..., X, ...] -> [..., 8 X, ...] of int16 values in [0, 15]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    words = packed.unsqueeze(-1)  # [..., 1]
    nibbles = torch.bitwise_and(torch.bitwise_right_shift(words, shifts), 0xF).to(torch.int16)
    if dim in (-1, packed.dim() - 1):
        return nibbles.flatten(-2)
    return nibbles.movedim(-1, dim + 1).flatten(dim, dim + 1)


class GptqWeight(NamedTuple):
    """One GPTQ linear as stored (tensors as above), its group size, whether its zeros are the
    v1 form (z - 1), and its weight's name for messages."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None
    group_size: int
    zeros_minus_one: bool
    name: str

    @property
    def shape(self) -> torch.Size:
        """[N, K] of the weight it stands for."""
        return torch.Size((self.qweight.shape[1], self.qweight.shape[0] * 8))

    def _levels_and_zeros(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [K, N], z [K/G, N], the group of each input [K]) as int16 / int64."""
        q = unpack_int32_nibbles(self.qweight, 0)
        z = unpack_int32_nibbles(self.qzeros, 1) + (1 if self.zeros_minus_one else 0)
        k = q.shape[0]
        groups = torch.arange(k) // self.group_size if self.g_idx is None else self.g_idx.long()
        return q, z[:, : q.shape[1]], groups

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] in `dtype`: scales[g, n] * (q[k, n] - z[g, n]) in fp32."""
        q, z, groups = self._levels_and_zeros()
        w = (q - z[groups]).float() * self.scales.float()[groups]
        return w.T.contiguous().to(dtype)

    def as_int4(self) -> Int4Weight | None:
        """Our int4 form of this weight, exactly, or None when it has none (zero points other
        than 8, inputs out of group order, a group size the kernels do not take)."""
        group = self.group_size
        if group % 8 or group > MAX_GROUP_SIZE or self.shape[1] % group:
            return None
        q, z, groups = self._levels_and_zeros()
        if not bool((z == 8).all()):
            return None
        if not torch.equal(groups, torch.arange(q.shape[0]) // group):
            return None
        return Int4Weight(
            (q - 8).to(torch.int8).T.contiguous(), self.scales.float().T.contiguous(), group
        )
