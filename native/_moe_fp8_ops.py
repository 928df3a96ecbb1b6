"""FP8 e4m3 weight-only fused MoE: experts prepacked 1 byte per weight with DeepSeek's 128x128
block scales, and the wrapper of the kernel (native/csrc/moe_fp8.cpp).

`native.ops` re-exports `prepack_experts_fp8`, `prepack_experts_fp8_from` and `fused_moe_fp8`; they
keep the contracts of their twins in `native/reference.py`. bf16 activations on the CPU take the
kernel; anything else (fp32, other devices, native switched off) takes the twin.

Inputs (a DeepSeek FP8 checkpoint, per expert): w13 = cat(gate_proj, up_proj) [2I, D] and its
scales cat(gate_proj, up_proj weight_scale_inv) [2 ceil(I/128), ceil(D/128)] (each half keeps its
own 128x128 blocks); w2 = down_proj [D, I] with [ceil(D/128), ceil(I/128)]. Each argument is the
stack over the E local experts or a list of them; lists are consumed (each entry released once
packed: the experts are never held twice).

Packed layout: every [N, K] matrix (gate, up, down) in linear_fp8's (native/_fp8_ops.py):
w13 uint8 [E, 2, ceil(I/32), ceil(D/2), 64], w2 uint8 [E, ceil(D/32), ceil(I/2), 64]; scales fp32
stacked as given.
"""

from __future__ import annotations

import torch

from native import reference
from native._fp8_ops import _NAN_MAGNITUDE, _arg, _pack, _unpack
from native._gemm_ops import (
    _kernel_input,
    check_moe_inputs,
    peek_expert,
    routing_tensors,
    take_expert,
)
from native._tags import DTYPE_TAGS
from native.switch import extension as _C
from native.switch import native_available as _native_on

FP8 = torch.float8_e4m3fn
_TAG_F32, _TAG_BF16, _TAG_FP8, _TAG_I32 = (
    DTYPE_TAGS[t] for t in (torch.float32, torch.bfloat16, FP8, torch.int32)
)


class PackedExpertsFp8:
    """One weight of the E local experts (w13 [E, 2I, D] or w2 [E, D, I]) prepacked for
    `fused_moe_fp8`: `packed` uint8 in the layout above, `scale_inv` fp32 [E, rows, cols]."""

    __slots__ = ("packed", "scale_inv", "shape", "halves")

    def __init__(self, packed, scale_inv, shape, halves):
        self.packed, self.scale_inv, self.shape, self.halves = packed, scale_inv, shape, halves

    @property
    def k_pairs(self) -> int:
        return self.packed.shape[-2]

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_fp8 [E, N, K], scale_inv): what `reference.prepack_experts_fp8` holds."""
        num, rows, k = self.shape
        n = rows // self.halves
        parts = self.packed.reshape(num * self.halves, *self.packed.shape[-3:])
        w = torch.stack([_unpack(p, n, k) for p in parts])
        return w.reshape(num, rows, k), self.scale_inv

    def __repr__(self) -> str:
        return f"PackedExpertsFp8(shape={tuple(self.shape)})"


def _check_expert(name: str, w: torch.Tensor, s: torch.Tensor, shape, halves: int) -> None:
    if w.dtype != FP8 or tuple(w.shape) != shape:
        raise ValueError(
            f"prepack_experts_fp8: {name} must be float8_e4m3fn of shape {list(shape)} per "
            f"expert, got {w.dtype} {list(w.shape)}"
        )
    n, k = shape[0] // halves, shape[1]
    scales = (halves * -(-n // reference.FP8_BLOCK), -(-k // reference.FP8_BLOCK))
    if not s.is_floating_point() or tuple(s.shape) != scales:
        raise ValueError(
            f"prepack_experts_fp8: {name} scales must be a float tensor of shape {list(scales)} "
            f"per expert, got {s.dtype} {list(s.shape)}"
        )
    if not bool(torch.isfinite(s).all()):
        raise ValueError(f"prepack_experts_fp8: {name} scales have non-finite values")
    if bool(((w.view(torch.uint8) & 0x7F) == _NAN_MAGNITUDE).any()):
        raise ValueError(f"prepack_experts_fp8: {name} holds NaN")


def _pack_experts(name: str, num: int, expert, shape, halves: int) -> PackedExpertsFp8:
    """Packs E experts one at a time into one buffer; `expert(e)` returns expert e's (w_fp8,
    scale_inv) and releases the caller's copy, so the experts are never held twice."""
    packed, scale_inv = None, None
    for e in range(num):
        w, s = (t.detach().cpu() for t in expert(e))
        _check_expert(name, w, s, shape, halves)
        one = torch.stack([_pack(half) for half in w.chunk(halves)])
        if packed is None:
            packed = torch.empty((num, *one.shape), dtype=torch.uint8)
            scale_inv = torch.empty((num, *s.shape), dtype=torch.float32)
        packed[e] = one
        scale_inv[e] = s
    if halves == 1:
        packed = packed.squeeze(1)
    return PackedExpertsFp8(packed, scale_inv, torch.Size((num, *shape)), halves)


def _as_list(w) -> list | None:
    return None if w is None else w if isinstance(w, list) else list(w.unbind(0))


def _taker(weights: list, scales: list | None, halves: int):
    """expert(e) for _pack_experts over lists: (weights[e], scales[e]); without scales, what
    the loader weights[e] returns when it is an FP8 (weight, scale_inv) pair, else weights[e]
    block-quantized (gate and up halves apart: reference.quantize_expert_fp8). The entries are
    released as they are taken (`take_expert`)."""

    def take(e: int):
        w = take_expert(weights, e)
        if isinstance(w, tuple):
            return w
        if scales is None:
            if w.dtype == FP8:
                raise ValueError("prepack_experts_fp8: FP8 expert weights need their scales")
            return reference.quantize_expert_fp8(w.detach(), halves)
        return w, take_expert(scales, e)

    return take


def _pack_pair(w13: list, w2: list, scale13: list | None, scale2: list | None):
    num = len(w13)
    if not (num > 0 and len(w2) == num and (scale13 is None or len(scale13) == len(scale2) == num)):
        raise ValueError("prepack_experts_fp8: w13, w2 and their scales need E > 0 entries each")
    first = peek_expert(w13)
    first = first[0] if isinstance(first, tuple) else first
    shape = first.shape
    del first  # held by the list until taken, not past that
    two_inter, hidden = shape if len(shape) == 2 else (-1, -1)
    if two_inter <= 0 or two_inter % 2 or hidden <= 0:
        raise ValueError(f"prepack_experts_fp8: w13 expert {list(shape)} is not [2I, D]")
    take13, take2 = _taker(w13, scale13, 2), _taker(w2, scale2, 1)
    packed13 = _pack_experts("w13", num, take13, (two_inter, hidden), 2)
    packed2 = _pack_experts("w2", num, take2, (hidden, two_inter // 2), 1)
    return packed13, packed2


def prepack_experts_fp8(
    w13, w2, scale13=None, scale2=None
) -> tuple[PackedExpertsFp8, PackedExpertsFp8]:
    """Packs FP8 experts (layout in the module docstring) for `fused_moe_fp8`; list arguments
    are consumed. Without scales, w13 and w2 are lists of loaders (`take_expert`) that each
    return an expert's (w_fp8, scale_inv) pair.

    Raises ValueError for another dtype, shapes that disagree, mis-shaped or non-finite scales,
    or NaN weights."""
    return _pack_pair(*(_as_list(w) for w in (w13, w2, scale13, scale2)))


def prepack_experts_fp8_from(w13, w2) -> tuple[PackedExpertsFp8, PackedExpertsFp8]:
    """Block-quantizes bf16 / fp32 experts [E, 2I, D] / [E, D, I] (tensors, lists, or lists of
    loaders, consumed one expert at a time; absmax per 128x128 block / 448, gate and up apart)
    and packs them."""
    w13, w2 = _as_list(w13), _as_list(w2)
    for w in (peek_expert(w13), peek_expert(w2)):
        if not w.is_floating_point() or w.dtype == FP8:
            raise ValueError(f"prepack_experts_fp8_from: needs bf16 / fp32 experts, got {w.dtype}")
    del w  # the lists hold expert 0 until it is taken, not past that
    return _pack_pair(w13, w2, None, None)


def fused_moe_fp8(
    x: torch.Tensor,
    w13: PackedExpertsFp8,
    w2: PackedExpertsFp8,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """Routed FP8 experts; the contract of `reference.fused_moe_fp8` (x: [T, D] -> [T, D])."""
    if not (isinstance(w13, PackedExpertsFp8) and isinstance(w2, PackedExpertsFp8)):
        raise TypeError("fused_moe_fp8: w13 and w2 must come from prepack_experts_fp8")
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if w13.halves != 2 or tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(
            f"fused_moe_fp8: w2 {tuple(w2.shape)} does not match w13 {tuple(w13.shape)}"
        )
    check_moe_inputs("fused_moe_fp8", x, hidden, topk_weights, topk_ids)
    if not (_native_on() and x.dtype == torch.bfloat16 and x.device.type == "cpu"):
        return reference.fused_moe_fp8(
            x, w13.unpack(), w2.unpack(), topk_weights, topk_ids, expert_offset
        )
    num_tokens, top_k = topk_ids.shape
    out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16)
    if num_tokens == 0:
        return out
    x2 = _kernel_input(x, hidden)
    weights, ids = routing_tensors(topk_weights, topk_ids)
    ldx = x2.stride(0) if num_tokens > 1 else 2 * w13.k_pairs
    _C.fused_moe_fp8(
        _arg(x2, _TAG_BF16),
        num_tokens,
        ldx,
        w13.k_pairs,
        _arg(w13.packed, _TAG_FP8),
        _arg(w13.scale_inv, _TAG_F32),
        _arg(w2.packed, _TAG_FP8),
        _arg(w2.scale_inv, _TAG_F32),
        num_experts,
        inter,
        hidden,
        _arg(weights, _TAG_F32),
        _arg(ids, _TAG_I32),
        top_k,
        int(expert_offset),
        _arg(out, _TAG_BF16),
    )
    return out
