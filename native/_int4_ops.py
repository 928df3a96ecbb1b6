"""INT4 W4A8 linear: weights packed for the kernel of native/csrc/gemm_int4.cpp and its wrapper.

`native.ops` re-exports `prepack_linear_int4` and `linear_int4` from here; they keep the contracts
of their twins in `native/reference_int4.py` (same quantization, same integers).

Packed layout (the NOTE in native/csrc/gemm_int4.h): the int4 weight [N, K] is padded to N a
multiple of 16 and K a multiple of the group size, then stored as bytes [N/16, Kp/8, 16, 4]: per
block of 16 output columns, per 8 inputs, the 16 columns' 4 bytes side by side, byte t holding
input t of the 8 in its low nibble and input t + 4 in its high one (each as q + 8, unsigned). The
scales are [N/16, Kp/group, 16] fp32 (0 past N).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from native import reference_int4
from native._quant_ops import activation_rows
from native._tags import DTYPE_TAGS
from native.reference_int4 import DEFAULT_GROUP_SIZE, Int4Weight, check_group_size
from native.switch import extension as _C
from native.switch import native_available as _native_on

_BLOCK_N = 16
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what quantize_pack_int4's kernel reads


def pack_int4(weight: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [..., N/16, Kp/8, 16, 4], scales fp32 [..., N/16, Kp/group, 16]) of an
    Int4Weight [..., N, K] (leading dims: experts, parts)."""
    q, scale, group = weight
    *lead, n, k = q.shape
    groups = scale.shape[-1]
    blocks = -(-n // _BLOCK_N)
    pad_n, pad_k = blocks * _BLOCK_N - n, groups * group - k
    nibbles = (F.pad(q, (0, pad_k, 0, pad_n)).to(torch.int16) + 8).to(torch.uint8)
    nibbles = nibbles.view(*lead, blocks, _BLOCK_N, groups * group // 8, 2, 4)
    packed = nibbles[..., 0, :] | (nibbles[..., 1, :] << 4)  # [..., blocks, 16, Kp/8, 4]
    packed = packed.transpose(-3, -2).contiguous()
    scales = F.pad(scale.float(), (0, 0, 0, pad_n)).view(*lead, blocks, _BLOCK_N, groups)
    return packed, scales.transpose(-2, -1).contiguous()


def unpack_int4(packed: torch.Tensor, scales: torch.Tensor, n: int, k: int, group: int):
    """The Int4Weight [..., n, k] of `pack_int4`'s tensors."""
    *lead, blocks, rows, _, _ = packed.shape
    per_column = packed.transpose(-3, -2)  # [..., blocks, 16, Kp/8, 4]
    nibbles = torch.stack((per_column & 0x0F, per_column >> 4), -2)  # [..., Kp/8, 2, 4]
    q = (nibbles.to(torch.int16) - 8).to(torch.int8).reshape(*lead, blocks * _BLOCK_N, rows * 8)
    scale = scales.transpose(-2, -1).reshape(*lead, blocks * _BLOCK_N, scales.shape[-2])
    return Int4Weight(q[..., :n, :k].contiguous(), scale[..., :n, :].contiguous(), group)


def quantize_pack_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_int4(quantize_weight_int4(weight, group_size)) of a float weight [N, K]: the same
    bytes, in one native pass (native/csrc/weight_quant_int4.cpp) where the kernels are on and
    the weight is a CPU fp32 / bf16 one, else through the twin."""
    check_group_size(group_size)
    if not (_native_on() and weight.device.type == "cpu" and weight.dtype in _NATIVE_DTYPES):
        return pack_int4(reference_int4.quantize_weight_int4(weight, group_size))
    weight = weight.detach().contiguous()
    n, k = weight.shape
    blocks, groups = -(-n // _BLOCK_N), -(-k // group_size)
    packed = torch.empty(blocks, groups * group_size // 8, _BLOCK_N, 4, dtype=torch.uint8)
    scales = torch.empty(blocks, groups, _BLOCK_N, dtype=torch.float32)
    _C.quantize_pack_int4(
        weight.data_ptr(),
        n,
        k,
        group_size,
        packed.data_ptr(),
        scales.data_ptr(),
        [DTYPE_TAGS[t.dtype] for t in (weight, packed, scales)],
    )
    return packed, scales


class PackedLinearInt4:
    """A weight [N, K] quantized per group and packed for `linear_int4`. `unpack()` returns the
    twin's Int4Weight."""

    __slots__ = ("packed", "scales", "n", "k", "group_size", "kernel_args")

    def __init__(self, weight: Int4Weight):
        self.n, self.k = weight.qweight.shape
        self.group_size = weight.group_size
        self.packed, self.scales = pack_int4(weight)
        self.bind_kernel_args()

    @classmethod
    def quantized_from(cls, weight: torch.Tensor, group_size: int) -> PackedLinearInt4:
        """A float weight [N, K] quantized straight into the packed layout (`quantize_pack_int4`)."""
        obj = cls.__new__(cls)
        obj.n, obj.k = weight.shape
        obj.group_size = group_size
        obj.packed, obj.scales = quantize_pack_int4(weight, group_size)
        obj.bind_kernel_args()
        return obj

    def bind_kernel_args(self) -> None:
        """The weight's arguments of _C.linear_int4, read once (again after the tensors move:
        a mapped pack, native.packed_state)."""
        self.kernel_args = (
            self.packed.data_ptr(), DTYPE_TAGS[self.packed.dtype],
            self.scales.data_ptr(), DTYPE_TAGS[self.scales.dtype],
            self.n, self.group_size,
        )  # fmt: skip

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k))

    def unpack(self) -> Int4Weight:
        return unpack_int4(self.packed, self.scales, self.n, self.k, self.group_size)

    def __repr__(self) -> str:
        return f"PackedLinearInt4(shape={tuple(self.shape)}, group_size={self.group_size})"


def prepack_linear_int4(
    weight: torch.Tensor | Int4Weight, group_size: int = DEFAULT_GROUP_SIZE
) -> PackedLinearInt4 | Int4Weight:
    """Quantizes a float weight [N, K] per group (or takes one quantized already: an Int4Weight
    keeps its own group size); packs it when the kernel is on."""
    if isinstance(weight, Int4Weight):
        check_group_size(weight.group_size)
        if weight.qweight.device.type != "cpu" or not _native_on():
            return weight
        return PackedLinearInt4(weight)
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"prepack_linear_int4: expected a float [N, K] weight, got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    check_group_size(group_size)
    if weight.device.type != "cpu" or not _native_on():
        return reference_int4.quantize_weight_int4(weight.detach(), group_size)
    return PackedLinearInt4.quantized_from(weight.detach(), group_size)


def linear_int4(x: torch.Tensor, weight: PackedLinearInt4 | Int4Weight) -> torch.Tensor:
    """W4A8 y ~= x @ W.T (the contract of `reference_int4.linear_int4`). x: [..., K] bf16 or
    fp32, unit stride in its last dim -> [..., N] of x's dtype."""
    packed = isinstance(weight, PackedLinearInt4)
    n, k = (weight.n, weight.k) if packed else weight.qweight.shape
    shape = x.shape
    x2 = activation_rows("linear_int4", x, k)
    m = x2.shape[0]
    if not packed:
        y = reference_int4.linear_int4(x2, weight)
    elif not (x.is_cpu and _native_on()):
        y = reference_int4.linear_int4(x2, weight.unpack())
    else:
        y = torch.empty(m, n, dtype=x.dtype)
        if m and n:
            tag = DTYPE_TAGS[x.dtype]
            ldx = x2.stride(0) if m > 1 else k
            _C.linear_int4(x2.data_ptr(), tag, m, k, ldx, *weight.kernel_args, y.data_ptr(), tag, n)
    return y if len(shape) == 2 else y.view(*shape[:-1], n)
