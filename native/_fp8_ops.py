"""FP8 e4m3 weight-only linear: prepacked 1-byte weights with DeepSeek's 128x128 block scales and
the wrapper of the kernel (native/csrc/gemm_fp8.cpp).

`native.ops` re-exports `prepack_linear_fp8`, `prepack_linear_fp8_from` and `linear_fp8`; they keep
the contracts of their twins in `native/reference.py`. bf16 activations on the CPU take the kernel;
anything else (fp32, other devices, native switched off) takes the twin on the unpacked weight.

Packed layout (the NOTE in native/csrc/gemm_fp8_kernels.h): the weight's bytes [N, K] are
zero-padded to N a multiple of 32 and K even, blocked as the bf16 layout [N/32, K/2, 32, 2] and each
64-byte k-pair row reordered [z=2, lane=4, 8] -> [lane, z, 8] (the order the kernel's byte unpacks
undo). Scales stay fp32 [ceil(N/128), ceil(K/128)].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from native import reference
from native._gemm_ops import _kernel_input  # the bf16 kernel's input rules
from native._tags import DTYPE_TAGS
from native.switch import extension as _C
from native.switch import native_available as _native_on

_BLOCK_N = 32
_TAG_F32, _TAG_BF16, _TAG_FP8 = (
    DTYPE_TAGS[t] for t in (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
)
_NAN_MAGNITUDE = 0x7F  # e4m3fn NaN: 0x7f and 0xff


def _pack(w_fp8: torch.Tensor) -> torch.Tensor:
    """float8 [N, K] -> uint8 [ceil(N/32), ceil(K/2), 64] in the kernel's order."""
    n, k = w_fp8.shape
    num_blocks, k_pairs = -(-n // _BLOCK_N), -(-k // 2)
    w = w_fp8.view(torch.uint8)
    if num_blocks * _BLOCK_N != n or 2 * k_pairs != k:
        w = F.pad(w, (0, 2 * k_pairs - k, 0, num_blocks * _BLOCK_N - n))
    blocked = w.reshape(num_blocks, _BLOCK_N, k_pairs, 2).transpose(1, 2)  # bf16 layout order
    rows = blocked.reshape(num_blocks, k_pairs, 2, 4, 8).transpose(2, 3)
    return rows.reshape(num_blocks, k_pairs, 64).contiguous()


def _unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of _pack -> float8 [N, K]."""
    num_blocks, k_pairs, _ = packed.shape
    rows = packed.view(num_blocks, k_pairs, 4, 2, 8).transpose(2, 3)
    blocked = rows.reshape(num_blocks, k_pairs, _BLOCK_N, 2).transpose(1, 2)
    full = blocked.reshape(num_blocks * _BLOCK_N, 2 * k_pairs)
    return full[:n, :k].contiguous().view(torch.float8_e4m3fn)


class PackedLinearFp8:
    """An FP8 e4m3 weight [N, K] prepacked for `linear_fp8`: 1 byte per weight in `packed`, the
    fp32 block scales [ceil(N/128), ceil(K/128)] in `scale_inv`."""

    __slots__ = ("packed", "scale_inv", "n", "k")

    def __init__(self, weight_fp8: torch.Tensor, scale_inv: torch.Tensor):
        self.n, self.k = weight_fp8.shape
        self.packed = _pack(weight_fp8)
        self.scale_inv = scale_inv.float().contiguous()

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k))

    @property
    def k_pairs(self) -> int:
        return self.packed.shape[1]

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight_fp8 [N, K], scale_inv): what `reference.prepack_linear_fp8` returns."""
        return _unpack(self.packed, self.n, self.k), self.scale_inv

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by: float32 [N, K]."""
        return reference.dequantize_fp8_blocks(*self.unpack())

    def __repr__(self) -> str:
        return f"PackedLinearFp8(shape={tuple(self.shape)})"


def prepack_linear_fp8(weight_fp8: torch.Tensor, scale_inv: torch.Tensor) -> PackedLinearFp8:
    """Packs an FP8 weight [N, K] (float8_e4m3fn) and its scales [ceil(N/128), ceil(K/128)].

    Raises ValueError for another dtype or rank, mis-shaped or non-finite scales, or NaN weights
    (a quantizer never writes them; the kernel's conversions need not agree on them)."""
    if weight_fp8.dtype != torch.float8_e4m3fn or weight_fp8.dim() != 2:
        raise ValueError(
            f"prepack_linear_fp8: weight must be a 2-D float8_e4m3fn tensor, got "
            f"{weight_fp8.dtype} {list(weight_fp8.shape)}"
        )
    n, k = weight_fp8.shape
    blocks = (-(-n // reference.FP8_BLOCK), -(-k // reference.FP8_BLOCK))
    if not scale_inv.is_floating_point() or tuple(scale_inv.shape) != blocks:
        raise ValueError(
            f"prepack_linear_fp8: scale_inv must be a float tensor of shape {list(blocks)} for "
            f"weight {[n, k]} (128x128 blocks), got {scale_inv.dtype} {list(scale_inv.shape)}"
        )
    if not bool(torch.isfinite(scale_inv).all()):
        raise ValueError("prepack_linear_fp8: scale_inv has non-finite values")
    magnitude = weight_fp8.detach().view(torch.uint8) & 0x7F
    if bool((magnitude == _NAN_MAGNITUDE).any()):
        raise ValueError("prepack_linear_fp8: weight holds NaN")
    return PackedLinearFp8(weight_fp8.detach().cpu(), scale_inv.detach().cpu())


def prepack_linear_fp8_from(weight: torch.Tensor) -> PackedLinearFp8:
    """Block-quantizes a bf16 / fp32 weight [N, K] (`reference.quantize_fp8_blocks`) and packs it."""
    return prepack_linear_fp8(*reference.quantize_fp8_blocks(weight.detach()))


def _arg(t: torch.Tensor, tag: int) -> tuple[int, int, int]:
    """(data pointer, dtype tag, elements spanned from it) for the binding's checks."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), tag, span if t.numel() else 0


def linear_fp8(x: torch.Tensor, weight: PackedLinearFp8) -> torch.Tensor:
    """y = x @ dequantize(weight).T.   x: [..., K] -> [..., N] in x.dtype."""
    if not isinstance(weight, PackedLinearFp8):
        raise TypeError(f"linear_fp8: weight must be a PackedLinearFp8, got {type(weight)}")
    n, k = weight.n, weight.k
    if x.shape[-1] != k:
        raise ValueError(f"linear_fp8: x has {x.shape[-1]} features, the weight expects {k}")
    if not (_native_on() and x.dtype == torch.bfloat16 and x.device.type == "cpu"):
        return reference.linear_fp8(x, weight.unpack())
    lead = x.shape[:-1]
    if k == 0:  # an empty sum (and no rows for the kernel to align)
        return torch.zeros(*lead, n, dtype=torch.bfloat16)
    x2 = _kernel_input(x.reshape(lead.numel(), k), k)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if m and n:
        ldx = x2.stride(0) if m > 1 else 2 * weight.k_pairs
        scale = weight.scale_inv
        _C.linear_fp8(
            _arg(x2, _TAG_BF16),
            m,
            ldx,
            weight.k_pairs,
            _arg(weight.packed, _TAG_FP8),
            n,
            _arg(scale, _TAG_F32),
            scale.shape[1],
            _arg(y, _TAG_BF16),
            n,
        )
    return y.reshape(*lead, n)


def dequantize_fp8_blocks(
    w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """`reference.dequantize_fp8_blocks`: float32 [N, K] of an e4m3 weight and its block scales,
    in one pass (native/csrc/weight_quant.cpp) when the kernels are on."""
    n, k = w_fp8.shape
    b0, b1 = block
    if tuple(scale_inv.shape) != (-(-n // b0), -(-k // b1)):
        raise ValueError(
            f"dequantize_fp8_blocks: scale_inv {list(scale_inv.shape)} does not fit weight "
            f"{[n, k]} in blocks {list(block)}"
        )
    if not _native_on() or w_fp8.device.type != "cpu" or w_fp8.dtype != torch.float8_e4m3fn:
        return reference.dequantize_fp8_blocks(w_fp8, scale_inv, block)
    w = w_fp8.contiguous()
    scale = scale_inv.float().contiguous()
    out = torch.empty(n, k, dtype=torch.float32)
    _C.dequantize_fp8_blocks(
        w.data_ptr(),
        scale.data_ptr(),
        n,
        k,
        b0,
        b1,
        out.data_ptr(),
        [DTYPE_TAGS[w.dtype], DTYPE_TAGS[scale.dtype], DTYPE_TAGS[out.dtype]],
    )
    return out
