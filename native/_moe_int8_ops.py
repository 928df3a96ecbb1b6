"""INT8 W8A8 fused MoE: experts packed for the kernel of native/csrc/moe_int8.cpp and its wrapper.

`native.ops` re-exports `prepack_experts_int8` and `fused_moe_int8`; they keep the contracts of
their twins in `native/reference.py` (same quantization steps, same integers).

Packed layout: each expert's gate [I, D], up [I, D] and down [D, I] projection is quantized per
output channel and packed as `PackedLinearInt8` (native/_quant_ops.py, the layout of
native/csrc/gemm_int8.h), then stacked: w13 packed [E, 2, ceil(I/16), ceil(D/4), 16, 4] with
scale / comp [E, 2, 16 ceil(I/16)]; w2 packed [E, ceil(D/16), ceil(I/4), 16, 4] with scale / comp
[E, 16 ceil(D/16)].
"""

from __future__ import annotations

import torch

from native import _quant_ops, reference
from native._gemm_ops import (
    check_moe_inputs,
    checked_experts,
    list_of,
    peek_expert,
    routing_tensors,
)
from native._tags import tags
from native.switch import extension as _C
from native.switch import native_available as _native_on


class PackedExpertsInt8:
    """One stacked projection of the E experts (w13: [gate | up] of `inter` rows each; w2), each
    expert's part packed as `PackedLinearInt8`. `unpack()` returns the reference's Int8Weight."""

    __slots__ = ("packed", "scale", "comp", "shape", "parts")

    def __init__(self, num_experts: int, parts: int, n: int, k: int):
        self.shape = torch.Size((num_experts, parts * n, k))
        self.parts = parts
        packed, scale, comp = _quant_ops.empty_packed_int8(n, k)
        # zeroed: the padding stays zero, each expert's rows are written in place
        self.packed = packed.expand(num_experts, parts, *packed.shape).contiguous()
        self.scale = scale.expand(num_experts, parts, *scale.shape).contiguous()
        self.comp = comp.expand(num_experts, parts, *comp.shape).contiguous()

    def store(self, e: int, weight: torch.Tensor) -> None:
        """Quantizes and packs expert e's float weight [parts * n, k] in place."""
        for part, rows in enumerate(weight.detach().chunk(self.parts, 0)):
            _quant_ops.quantize_pack_int8_rows(
                rows, self.packed[e, part], self.scale[e, part], self.comp[e, part]
            )

    def unpack(self) -> reference.Int8Weight:
        num_experts, rows, k = self.shape
        n = rows // self.parts
        blocks, groups = self.packed.shape[2:4]
        q = self.packed.transpose(3, 4).reshape(num_experts, self.parts, blocks * 16, groups * 4)
        q = q[:, :, :n, :k].reshape(num_experts, rows, k).contiguous()
        scale = self.scale[:, :, :n].reshape(num_experts, rows).contiguous()
        return reference.Int8Weight(q, scale)

    def __repr__(self) -> str:
        return f"PackedExpertsInt8(shape={tuple(self.shape)})"


def prepack_experts_int8(w13: torch.Tensor | list, w2: torch.Tensor | list):
    """Quantizes routed experts (w13 [E, 2I, D], w2 [E, D, I], or lists of the E experts'
    tensors or of loaders of them (`native._gemm_ops.take_expert`), consumed one at a time so
    the experts are never held twice) for `fused_moe_int8`.
    Returns (PackedExpertsInt8, PackedExpertsInt8), or the reference's Int8Weight pair when the
    kernel is off or the weights are not on the CPU."""
    parts13, parts2 = list_of(w13), list_of(w2)
    if len(parts13) != len(parts2):
        raise ValueError(f"prepack_experts_int8: {len(parts13)} w13 but {len(parts2)} w2 experts")
    first13, first2 = peek_expert(parts13), peek_expert(parts2)
    ((two_inter, hidden), (hidden2, inter)) = first13.shape, first2.shape
    if two_inter != 2 * inter or hidden2 != hidden:
        raise ValueError(
            f"prepack_experts_int8: w13 {(len(parts13), two_inter, hidden)} and w2 "
            f"{(len(parts2), hidden2, inter)} disagree"
        )
    if max(hidden, inter) > _quant_ops._MAX_K:
        raise ValueError(f"prepack_experts_int8: K = {max(hidden, inter)} exceeds the int8 limit")
    num_experts = len(parts13)
    on_cpu = first13.device.type == first2.device.type == "cpu"
    del first13, first2  # held by the lists until taken, not past that
    experts13 = checked_experts("prepack_experts_int8", parts13)
    experts2 = checked_experts("prepack_experts_int8", parts2)
    if not (on_cpu and _native_on()):
        return reference.prepack_experts_int8(list(experts13), list(experts2))
    p13 = PackedExpertsInt8(num_experts, 2, inter, hidden)
    p2 = PackedExpertsInt8(num_experts, 1, hidden, inter)
    for e, (one13, one2) in enumerate(zip(experts13, experts2, strict=True)):
        p13.store(e, one13)
        p2.store(e, one2)
    return p13, p2


def fused_moe_int8(
    x: torch.Tensor,
    w13: PackedExpertsInt8 | reference.Int8Weight,
    w2: PackedExpertsInt8 | reference.Int8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """Routed experts in W8A8 int8; the contract of `reference.fused_moe_int8` ([T, D] -> [T, D])."""
    packed = isinstance(w13, PackedExpertsInt8)
    if packed != isinstance(w2, PackedExpertsInt8):
        raise ValueError("fused_moe_int8: w13 and w2 must both come from prepack_experts_int8")
    num_experts, two_inter, hidden = w13.shape if packed else w13.qweight.shape
    inter = two_inter // 2
    w2_shape = tuple(w2.shape if packed else w2.qweight.shape)
    if w2_shape != (num_experts, hidden, inter):
        raise ValueError(
            f"fused_moe_int8: w2 {w2_shape} does not match w13 {(num_experts, two_inter, hidden)}"
        )
    check_moe_inputs("fused_moe_int8", x, hidden, topk_weights, topk_ids)
    if not packed:
        return reference.fused_moe_int8(x, w13, w2, topk_weights, topk_ids, expert_offset)
    if not (_native_on() and x.dtype == torch.bfloat16 and x.device.type == "cpu"):
        return reference.fused_moe_int8(
            x, w13.unpack(), w2.unpack(), topk_weights, topk_ids, expert_offset
        )
    num_tokens, top_k = topk_ids.shape
    out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16)
    if num_tokens == 0:
        return out
    x2 = x if x.stride(1) == 1 else x.contiguous()
    weights, ids = routing_tensors(topk_weights, topk_ids)
    ldx = x2.stride(0) if num_tokens > 1 else hidden
    _C.fused_moe_int8(
        x2.data_ptr(),
        num_tokens,
        ldx,
        w13.packed.data_ptr(),
        w13.scale.data_ptr(),
        w13.comp.data_ptr(),
        w2.packed.data_ptr(),
        w2.scale.data_ptr(),
        w2.comp.data_ptr(),
        num_experts,
        inter,
        hidden,
        weights.data_ptr(),
        ids.data_ptr(),
        top_k,
        int(expert_offset),
        out.data_ptr(),
        hidden,
        tags(x2, w13.packed, w13.scale, w13.comp, w2.packed, w2.scale, w2.comp, weights, ids, out),
    )
    return out
