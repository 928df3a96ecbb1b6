"""INT8 W8A8 linear: weights packed for the kernel of native/csrc/gemm_int8.cpp and its wrapper.

`native.ops` re-exports `prepack_linear_int8` and `linear_int8` from here; they keep the contracts
of their twins in `native/reference.py` (same quantization, same integers, same epilogue).

Packed layout (see the NOTE in native/csrc/gemm_int8.h): the int8 weight [N, K] is zero-padded
to N a multiple of 16 and K a multiple of 4, then stored as [N/16, K/4, 16, 4]: per block of 16
output columns, per group of 4 inputs, the 16 columns' 4 weights side by side (one zmm of
vpdpbusd). Per padded column it keeps the fp32 scale and comp = 128 * sum_k q[n, k] (int32), the
term that turns the kernel's u8 activations (q + 128) back into the signed product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from native import reference
from native._tags import DTYPE_TAGS
from native.switch import extension as _C
from native.switch import native_available as _native_on

_BLOCK_N = 16
_GROUP_K = 4
_MAX_K = 65536  # kInt8MaxK of gemm_int8.h: the kernel's u8 x s8 sums must fit in int32
# dtype tags of native/csrc/common.h's DType (the binding checks every pointer's tag).
_TAGS = DTYPE_TAGS  # native/_tags.py
_X_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinearInt8:
    """A weight [N, K] quantized per output channel and packed for `linear_int8`.

    packed: int8 [ceil(N/16), ceil(K/4), 16, 4]; scale: fp32 [16 * ceil(N/16)] (0 past N);
    comp: int32 [16 * ceil(N/16)]. `unpack()` returns the reference's Int8Weight."""

    __slots__ = ("packed", "scale", "comp", "n", "k", "kernel_args")

    def __init__(self, quantized: reference.Int8Weight):
        q, scale = quantized
        self.n, self.k = q.shape
        num_blocks, k_groups = -(-self.n // _BLOCK_N), -(-self.k // _GROUP_K)
        pad_n, pad_k = num_blocks * _BLOCK_N - self.n, k_groups * _GROUP_K - self.k
        q = F.pad(q, (0, pad_k, 0, pad_n))
        blocked = q.reshape(num_blocks, _BLOCK_N, k_groups, _GROUP_K)
        self.packed = blocked.transpose(1, 2).contiguous()
        self.scale = F.pad(scale.float(), (0, pad_n)).contiguous()
        self.comp = (128 * q.sum(1, dtype=torch.int32)).to(torch.int32).contiguous()
        self.bind_kernel_args()

    def bind_kernel_args(self) -> None:
        """The weight's arguments of _C.linear_int8, read once here rather than on every call
        (the decode step calls this a few hundred times); again after the tensors move (a
        mapped pack, native.packed_state)."""
        self.kernel_args = (
            self.packed.data_ptr(), _TAGS[self.packed.dtype],
            self.scale.data_ptr(), _TAGS[self.scale.dtype],
            self.comp.data_ptr(), _TAGS[self.comp.dtype],
            self.n, self.k_groups,
        )  # fmt: skip

    @classmethod
    def quantized_from(cls, weight: torch.Tensor) -> PackedLinearInt8:
        """A float weight [N, K] quantized per row straight into the packed layout
        (`quantize_pack_int8_rows`, one pass): no int8 copy of it between."""
        obj = cls.__new__(cls)
        obj.n, obj.k = weight.shape
        obj.packed, obj.scale, obj.comp = empty_packed_int8(obj.n, obj.k)
        quantize_pack_int8_rows(weight, obj.packed, obj.scale, obj.comp)
        obj.bind_kernel_args()
        return obj

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k))

    @property
    def k_groups(self) -> int:
        return self.packed.shape[1]

    def unpack(self) -> reference.Int8Weight:
        num_blocks, k_groups = self.packed.shape[:2]
        q = self.packed.transpose(1, 2).reshape(num_blocks * _BLOCK_N, k_groups * _GROUP_K)
        return reference.Int8Weight(q[: self.n, : self.k].contiguous(), self.scale[: self.n])

    def __repr__(self) -> str:
        return f"PackedLinearInt8(shape={tuple(self.shape)})"


def empty_packed_int8(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zeroed (packed, scale, comp) of an [n, k] weight in the layout above (the padding must be
    zeros: padded columns add nothing, padded rows are never read)."""
    blocks, groups = -(-n // _BLOCK_N), -(-k // _GROUP_K)
    return (
        torch.zeros(blocks, groups, _BLOCK_N, _GROUP_K, dtype=torch.int8),
        torch.zeros(blocks * _BLOCK_N, dtype=torch.float32),
        torch.zeros(blocks * _BLOCK_N, dtype=torch.int32),
    )


def quantize_pack_int8_rows(weight, packed, scale, comp, row_offset: int = 0) -> None:
    """`reference.quantize_pack_int8_rows`: float rows [n, K] quantized per row into rows
    [row_offset, row_offset + n) of a packed weight (native/csrc/weight_quant.cpp, one pass)."""
    if not _native_on() or weight.dtype not in _X_DTYPES or weight.device.type != "cpu":
        return reference.quantize_pack_int8_rows(weight, packed, scale, comp, row_offset)
    weight = weight.contiguous()
    n, k = weight.shape
    blocks, groups = packed.shape[:2]
    if not (packed.is_contiguous() and scale.is_contiguous() and comp.is_contiguous()):
        raise ValueError("quantize_pack_int8_rows: the packed tensors must be contiguous")
    if scale.numel() != blocks * _BLOCK_N or comp.numel() != blocks * _BLOCK_N:
        raise ValueError("quantize_pack_int8_rows: scale and comp must have 16 * blocks entries")
    _C.quantize_pack_int8_rows(
        weight.data_ptr(),
        n,
        k,
        row_offset,
        groups,
        blocks * _BLOCK_N,
        packed.data_ptr(),
        scale.data_ptr(),
        comp.data_ptr(),
        [_TAGS.get(t.dtype, -1) for t in (weight, packed, scale, comp)],
    )


_QUANTIZE_ROWS = 256  # rows quantized at a time: bounds the fp32 temporaries while loading


def quantize_weight_int8_blocked(weight: torch.Tensor) -> reference.Int8Weight:
    """`reference.quantize_weight_int8`, a block of rows at a time: each row's quantization is
    its own, so the result is the same, but the fp32 temporaries are those of 256 rows, not of
    the matrix (a fused MLP's gate|up is ~0.2 GB of them in fp32)."""
    if weight.shape[0] <= _QUANTIZE_ROWS:
        return reference.quantize_weight_int8(weight)
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], _QUANTIZE_ROWS):
        rows = slice(start, start + _QUANTIZE_ROWS)
        q[rows], scale[rows] = reference.quantize_weight_int8(weight[rows])
    return reference.Int8Weight(q, scale)


def prepack_linear_int8(weight: torch.Tensor) -> PackedLinearInt8 | reference.Int8Weight:
    """Quantizes a float weight [N, K] per output channel; packs it when the kernel is on."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"prepack_linear_int8: expected a float [N, K] weight, got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    if weight.shape[1] > _MAX_K:
        raise ValueError(f"prepack_linear_int8: K = {weight.shape[1]} exceeds {_MAX_K}")
    if weight.device.type != "cpu" or not _native_on():
        return quantize_weight_int8_blocked(weight.detach())
    return PackedLinearInt8.quantized_from(weight.detach())


def activation_rows(op: str, x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., K] (bf16 or fp32, unit stride in its last dim) as the rows [M, K] a quantized
    linear's kernel reads (a copy only for broadcast rows); TypeError / ValueError naming `op`."""
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"{op}: x must be bfloat16 or float32, got {x.dtype}")
    shape = x.shape
    if not shape or shape[-1] != k:
        raise ValueError(f"{op}: x {tuple(shape)} does not have the weight's K = {k}")
    x2 = x if len(shape) == 2 else x.reshape(shape[:-1].numel(), k)
    if x2.stride(1) != 1 and k > 1:
        raise ValueError(f"{op}: x must be contiguous in its last dimension")
    if x2.shape[0] > 1 and x2.stride(0) < k:  # broadcast rows (stride 0): give them memory
        x2 = x2.contiguous()
    return x2


def linear_int8(x: torch.Tensor, weight: PackedLinearInt8 | reference.Int8Weight) -> torch.Tensor:
    """W8A8 y ~= x @ W.T (the contract of `reference.linear_int8`). x: [..., K] bf16 or fp32,
    unit stride in its last dim -> [..., N] of x's dtype."""
    packed = isinstance(weight, PackedLinearInt8)
    n, k = (weight.n, weight.k) if packed else weight.qweight.shape
    shape = x.shape
    x2 = activation_rows("linear_int8", x, k)
    m = x2.shape[0]
    if not packed:
        y = reference.linear_int8(x2, weight)
    elif not (x.is_cpu and _native_on()):
        y = reference.linear_int8(x2, weight.unpack())
    else:
        y = torch.empty(m, n, dtype=x.dtype)
        if m and n:
            tag = _TAGS[x.dtype]
            ldx = x2.stride(0) if m > 1 else k
            _C.linear_int8(x2.data_ptr(), tag, m, k, ldx, *weight.kernel_args, y.data_ptr(), tag, n)
    return y if len(shape) == 2 else y.view(*shape[:-1], n)
