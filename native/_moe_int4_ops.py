"""INT4 W4A8 fused MoE: experts packed for the kernel of native/csrc/moe_int4.cpp and its wrapper.

`native.ops` re-exports `prepack_experts_int4` and `fused_moe_int4`; they keep the contracts of
their twins in `native/reference_int4.py` (same quantization steps, same integers).

Packed layout: each expert's gate [I, D], up [I, D] and down [D, I] projection is quantized per
group and packed as `PackedLinearInt4` (native/_int4_ops.py, the layout of
native/csrc/gemm_int4.h), then stacked: w13 packed [E, 2, ceil(I/16), Dp/8, 16, 4] with scales
[E, 2, ceil(I/16), Dp/group, 16]; w2 packed [E, ceil(D/16), Ip/8, 16, 4] with scales
[E, ceil(D/16), Ip/group, 16].
"""

from __future__ import annotations

import torch

from native import reference_int4
from native._gemm_ops import check_moe_inputs, list_of, peek_expert, routing_tensors, take_expert
from native._int4_ops import pack_int4, quantize_pack_int4, unpack_int4
from native._tags import tags
from native.reference_int4 import DEFAULT_GROUP_SIZE, Int4Weight, check_group_size
from native.switch import extension as _C
from native.switch import native_available as _native_on


class PackedExpertsInt4:
    """One stacked projection of the E experts (w13: [gate | up] of `inter` rows each; w2), each
    part packed as `PackedLinearInt4`. `unpack()` returns the twin's Int4Weight."""

    __slots__ = ("packed", "scales", "shape", "parts", "group_size")

    def __init__(self, num_experts: int, parts: int, n: int, k: int, group_size: int):
        self.shape = torch.Size((num_experts, parts * n, k))
        self.parts, self.group_size = parts, group_size
        blocks, groups = -(-n // 16), -(-k // group_size)
        self.packed = torch.empty(num_experts, parts, blocks, groups * group_size // 8, 16, 4,
                                  dtype=torch.uint8)  # fmt: skip
        self.scales = torch.empty(num_experts, parts, blocks, groups, 16, dtype=torch.float32)

    def store(self, e: int, weight: torch.Tensor | Int4Weight) -> None:
        """Packs expert e's weight [parts * n, k] in place: a float one quantized, an
        Int4Weight of this group size as it is (of another, quantized again from its values)."""
        if isinstance(weight, Int4Weight) and weight.group_size != self.group_size:
            weight = reference_int4.dequantize_int4(weight)
        if isinstance(weight, Int4Weight):
            q, scale = weight.qweight.chunk(self.parts, 0), weight.scale.chunk(self.parts, 0)
            for part, pair in enumerate(zip(q, scale, strict=True)):
                quantized = Int4Weight(*pair, self.group_size)
                self.packed[e, part], self.scales[e, part] = pack_int4(quantized)
            return
        for part, rows in enumerate(weight.detach().chunk(self.parts, 0)):
            self.packed[e, part], self.scales[e, part] = quantize_pack_int4(rows, self.group_size)

    def unpack(self) -> Int4Weight:
        num_experts, rows, k = self.shape
        q, scale, group = unpack_int4(
            self.packed, self.scales, rows // self.parts, k, self.group_size
        )
        return Int4Weight(
            q.reshape(num_experts, rows, k), scale.reshape(num_experts, rows, -1), group
        )

    def __repr__(self) -> str:
        return f"PackedExpertsInt4(shape={tuple(self.shape)}, group_size={self.group_size})"


def _shape(entry) -> torch.Size:
    return entry.qweight.shape if isinstance(entry, Int4Weight) else entry.shape


def _checked(parts: list):
    """Takes every entry in turn (`take_expert`), each a float tensor or an Int4Weight of
    expert 0's shape: a ValueError otherwise."""
    shape = _shape(peek_expert(parts))
    for i in range(len(parts)):
        w = take_expert(parts, i)
        ok = isinstance(w, Int4Weight) or (isinstance(w, torch.Tensor) and w.is_floating_point())
        if not ok or _shape(w) != shape:
            kind = "Int4Weight" if isinstance(w, Int4Weight) else w.dtype
            raise ValueError(
                f"prepack_experts_int4: expert {i} is {kind} {list(_shape(w))}; the experts must be"
                f" E float tensors or Int4Weights of one shape ({list(shape)})"
            )
        yield w


def _twin_experts(entries: list, group_size: int) -> Int4Weight:
    """The twin's stacked Int4Weight of one projection's experts: Int4Weights of this group size
    as they are (as `PackedExpertsInt4.store` keeps them), anything else quantized."""
    if all(isinstance(w, Int4Weight) and w.group_size == group_size for w in entries):
        stacked = (
            torch.stack([w.qweight for w in entries]),
            torch.stack([w.scale for w in entries]),
        )
        return Int4Weight(*stacked, group_size)
    floats = [
        reference_int4.dequantize_int4(w) if isinstance(w, Int4Weight) else w for w in entries
    ]
    return reference_int4.quantize_weight_int4(torch.stack(floats), group_size)


def prepack_experts_int4(
    w13: torch.Tensor | list, w2: torch.Tensor | list, group_size: int = DEFAULT_GROUP_SIZE
):
    """Quantizes routed experts (w13 [E, 2I, D], w2 [E, D, I], or lists of the E experts'
    tensors or of loaders of them, consumed one at a time) for `fused_moe_int4`. An entry may be
    an Int4Weight, quantized already (a GPTQ checkpoint's, `model.gptq`): it is kept as it is
    when expert 0 of w13 is one too, whose group size then rules (anything else is quantized
    from its floats). Returns (PackedExpertsInt4, PackedExpertsInt4), or the twin's Int4Weight
    pair when the kernel is off or the weights are not on the CPU."""
    parts13, parts2 = list_of(w13), list_of(w2)
    if len(parts13) != len(parts2):
        raise ValueError(f"prepack_experts_int4: {len(parts13)} w13 but {len(parts2)} w2 experts")
    first13, first2 = peek_expert(parts13), peek_expert(parts2)
    if isinstance(first13, Int4Weight):
        group_size = first13.group_size
    check_group_size(group_size)
    ((two_inter, hidden), (hidden2, inter)) = _shape(first13), _shape(first2)
    if two_inter != 2 * inter or hidden2 != hidden:
        raise ValueError(
            f"prepack_experts_int4: w13 {(len(parts13), two_inter, hidden)} and w2 "
            f"{(len(parts2), hidden2, inter)} disagree"
        )
    num_experts = len(parts13)
    device = lambda w: (w.qweight if isinstance(w, Int4Weight) else w).device.type  # noqa: E731
    on_cpu = device(first13) == device(first2) == "cpu"
    del first13, first2
    experts13, experts2 = _checked(parts13), _checked(parts2)
    if not (on_cpu and _native_on()):
        return _twin_experts(list(experts13), group_size), _twin_experts(list(experts2), group_size)
    p13 = PackedExpertsInt4(num_experts, 2, inter, hidden, group_size)
    p2 = PackedExpertsInt4(num_experts, 1, hidden, inter, group_size)
    for e, (one13, one2) in enumerate(zip(experts13, experts2, strict=True)):
        p13.store(e, one13)
        p2.store(e, one2)
    return p13, p2


def fused_moe_int4(
    x: torch.Tensor,
    w13: PackedExpertsInt4 | Int4Weight,
    w2: PackedExpertsInt4 | Int4Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """Routed experts in W4A8; the contract of `reference_int4.fused_moe_int4` ([T, D] -> [T, D])."""
    packed = isinstance(w13, PackedExpertsInt4)
    if packed != isinstance(w2, PackedExpertsInt4):
        raise ValueError("fused_moe_int4: w13 and w2 must both come from prepack_experts_int4")
    num_experts, two_inter, hidden = w13.shape if packed else w13.qweight.shape
    inter = two_inter // 2
    w2_shape = tuple(w2.shape if packed else w2.qweight.shape)
    if w2_shape != (num_experts, hidden, inter) or w13.group_size != w2.group_size:
        raise ValueError(
            f"fused_moe_int4: w2 {w2_shape} (group {w2.group_size}) does not match w13 "
            f"{(num_experts, two_inter, hidden)} (group {w13.group_size})"
        )
    check_moe_inputs("fused_moe_int4", x, hidden, topk_weights, topk_ids)
    if not packed:
        return reference_int4.fused_moe_int4(x, w13, w2, topk_weights, topk_ids, expert_offset)
    if not (_native_on() and x.dtype == torch.bfloat16 and x.device.type == "cpu"):
        return reference_int4.fused_moe_int4(
            x, w13.unpack(), w2.unpack(), topk_weights, topk_ids, expert_offset
        )
    num_tokens, top_k = topk_ids.shape
    out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16)
    if num_tokens == 0:
        return out
    x2 = x if x.stride(1) == 1 else x.contiguous()
    weights, ids = routing_tensors(topk_weights, topk_ids)
    ldx = x2.stride(0) if num_tokens > 1 else hidden
    _C.fused_moe_int4(
        x2.data_ptr(),
        num_tokens,
        ldx,
        w13.packed.data_ptr(),
        w13.scales.data_ptr(),
        w2.packed.data_ptr(),
        w2.scales.data_ptr(),
        num_experts,
        inter,
        hidden,
        w13.group_size,
        weights.data_ptr(),
        ids.data_ptr(),
        top_k,
        int(expert_offset),
        out.data_ptr(),
        hidden,
        tags(x2, w13.packed, w13.scales, w2.packed, w2.scales, weights, ids, out),
    )
    return out
