"""Prepacked bf16 weights and the wrappers of the linear / fused-MoE / bmm kernels
(native/csrc/gemm.cpp, moe.cpp, bmm.cpp).

`native.ops` re-exports `prepack_linear`, `linear`, `prepack_experts`, `fused_moe` and `bmm` from
here; they keep the signatures and contracts of their twins in `native/reference.py`. bf16 on the
CPU takes the kernels; fp32 (the whole-model tests against Hugging Face), other devices, or native
switched off take the reference (a packed weight is unpacked for it, which is slow but correct).

Packed layout (see the NOTE in native/csrc/gemm_kernels.h): a weight [..., N, K] is zero-padded
to N a multiple of 32 and K even, then stored as [..., N/32, K/2, 32, 2]: per block of 32 output
columns, per pair of inputs, the 32 columns' (even k, odd k) pairs side by side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from native import reference
from native._tags import tags
from native.switch import extension as _C
from native.switch import native_available as _native_on

_BLOCK_N = 32


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """[..., N, K] -> [..., ceil(N/32), ceil(K/2), 32, 2], zero padded."""
    *lead, n, k = weight.shape
    num_blocks, k_pairs = -(-n // _BLOCK_N), -(-k // 2)
    if num_blocks * _BLOCK_N != n or 2 * k_pairs != k:
        weight = F.pad(weight, (0, 2 * k_pairs - k, 0, num_blocks * _BLOCK_N - n))
    blocked = weight.reshape(*lead, num_blocks, _BLOCK_N, k_pairs, 2)
    return blocked.transpose(-3, -2).contiguous()


def _unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of _pack: [..., N/32, K/2, 32, 2] -> [..., N, K]."""
    *lead, num_blocks, k_pairs, _, _ = packed.shape
    full = packed.transpose(-3, -2).reshape(*lead, num_blocks * _BLOCK_N, 2 * k_pairs)
    return full[..., :n, :k].contiguous()


class PackedLinear:
    """A bf16 weight prepacked for the kernels.

    `packed` holds the weight viewed as [*lead, n, k] in the layout above; `shape` is the shape of
    the original tensor (for a linear weight [N, K]: lead = (), n = N, k = K; for MoE w13
    [E, 2I, D]: lead = (E, 2), n = I, k = D, gate and up packed apart; for w2 [E, D, I]:
    lead = (E,), n = D, k = I). `unpack()` returns the original tensor.
    """

    __slots__ = ("packed", "n", "k", "shape")

    def __init__(self, weight: torch.Tensor, view_shape: tuple[int, ...]):
        self.shape = weight.shape
        self.n, self.k = view_shape[-2], view_shape[-1]
        self.packed = _pack(weight.reshape(view_shape))

    @classmethod
    def from_parts(cls, parts: list, view_shape: tuple[int, ...]):
        """The PackedLinear of the stack of `parts` (E bf16 tensors of one shape, or loaders of
        them: see `take_expert`; `view_shape` is the stack's), packed one part at a time into
        one buffer. Each entry of `parts` is released (set to None) once packed, so packing
        never holds a second copy of all of them: a model's experts are loaded once and packed
        in place of themselves."""
        obj = cls.__new__(cls)
        part_shape = tuple(peek_expert(parts).shape)
        obj.shape = torch.Size((len(parts), *part_shape))
        obj.n, obj.k = view_shape[-2], view_shape[-1]
        obj.packed = None
        for i in range(len(parts)):
            part = take_expert(parts, i)
            if tuple(part.shape) != part_shape or not _packable(part):
                raise ValueError(
                    f"prepack_experts: expert {i} is {part.dtype} {list(part.shape)}, expert 0 "
                    f"bf16 {list(part_shape)}: the experts' tensors must be E of one shape each"
                )
            one = _pack(part.reshape(view_shape[1:]))
            del part
            if obj.packed is None:
                obj.packed = torch.empty((len(parts), *one.shape), dtype=one.dtype)
            obj.packed[i] = one
        return obj

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def k_pairs(self) -> int:
        return self.packed.shape[-3]

    def unpack(self) -> torch.Tensor:
        return _unpack(self.packed, self.n, self.k).reshape(self.shape)

    def __repr__(self) -> str:
        return f"PackedLinear(shape={tuple(self.shape)}, dtype={self.dtype})"


def _packable(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and _native_on()


def _kernel_input(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [M, k] bf16 -> rows of even length with unit stride and 4-byte aligned row starts."""
    if k % 2:
        return F.pad(x, (0, 1))
    if x.stride(-1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
        return x.contiguous()
    return x


def prepack_linear(weight: torch.Tensor) -> torch.Tensor | PackedLinear:
    """Packs a bf16 CPU weight [N, K] for `linear`; anything else is returned unchanged."""
    if weight.dim() != 2 or not _packable(weight):
        return weight
    return PackedLinear(weight.detach(), tuple(weight.shape))


def linear(x: torch.Tensor, weight: torch.Tensor | PackedLinear) -> torch.Tensor:
    """y = x @ weight.T.   x: [..., K], weight: [N, K] or its PackedLinear -> [..., N]."""
    if not isinstance(weight, PackedLinear):
        return reference.linear(x, weight)
    if not (_native_on() and x.dtype == torch.bfloat16 and x.device.type == "cpu"):
        return reference.linear(x, weight.unpack())
    n, k = weight.n, weight.k
    if x.shape[-1] != k:
        raise ValueError(f"linear: x has {x.shape[-1]} features, the weight expects {k}")
    lead = x.shape[:-1]
    x2 = _kernel_input(x.reshape(lead.numel(), k), k)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if m and n:
        ldx = x2.stride(0) if m > 1 else 2 * weight.k_pairs
        _C.linear_bf16(
            x2.data_ptr(),
            m,
            ldx,
            weight.k_pairs,
            weight.packed.data_ptr(),
            n,
            y.data_ptr(),
            n,
            tags(x2, weight.packed, y),
        )
    return y.reshape(*lead, n)


def prepack_experts(w13: torch.Tensor | list, w2: torch.Tensor | list):
    """Packs bf16 CPU expert weights w13 [E, 2I, D], w2 [E, D, I] for `fused_moe`; each may also
    be a list of the E experts' tensors ([2I, D] / [D, I]) or of loaders of them (`take_expert`),
    which is consumed (each entry released once packed: the experts are never held twice).

    Returns (PackedLinear, PackedLinear), or the tensors (stacked) when the kernel does not
    cover them (other dtype or device, native disabled)."""
    if isinstance(w13, list) or isinstance(w2, list):
        return _prepack_expert_lists(list_of(w13), list_of(w2))
    if w13.dim() != 3 or w2.dim() != 3 or not (_packable(w13) and _packable(w2)):
        return w13, w2
    num_experts, two_inter, hidden = w13.shape
    if two_inter % 2 or tuple(w2.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(
            f"prepack_experts: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} disagree"
        )
    inter = two_inter // 2
    return (
        PackedLinear(w13.detach(), (num_experts, 2, inter, hidden)),
        PackedLinear(w2.detach(), (num_experts, hidden, inter)),
    )


def check_moe_inputs(
    op: str, x: torch.Tensor, hidden: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    """ValueError naming `op` unless x is [T, hidden] and the routing [T, top_k] twice: the
    checks every fused-MoE wrapper (bf16, int8, fp8) makes before its kernel reads them."""
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"{op}: x {tuple(x.shape)} does not match hidden size {hidden}")
    if (
        topk_ids.dim() != 2
        or topk_ids.shape != topk_weights.shape
        or topk_ids.shape[0] != x.shape[0]
    ):
        raise ValueError(
            f"{op}: topk_ids {tuple(topk_ids.shape)} / topk_weights "
            f"{tuple(topk_weights.shape)} do not match {x.shape[0]} tokens"
        )


def routing_tensors(topk_weights: torch.Tensor, topk_ids: torch.Tensor):
    """The routing as every fused-MoE kernel reads it: fp32 weights, int32 ids, contiguous."""
    return topk_weights.to(torch.float32).contiguous(), topk_ids.to(torch.int32).contiguous()


def list_of(weights: torch.Tensor | list) -> list:
    return weights if isinstance(weights, list) else list(weights.unbind(0))


def take_expert(parts: list, i: int):
    """Entry i of a list of the experts' tensors, released from the list (packing never holds
    two copies of the experts). An entry may be a zero-argument callable that loads the tensor:
    a lazily read checkpoint (`model.checkpoint_reader`) then reads each expert only as it is
    packed, so loading holds one expert in flight, not a layer's experts."""
    entry, parts[i] = parts[i], None
    return entry() if callable(entry) else entry


def peek_expert(parts: list, i: int = 0):
    """Entry i, loaded in place if it is a loader (its shape and dtype size the packing)."""
    if not parts:
        raise ValueError("prepack_experts: no experts to pack (E = 0)")
    if callable(parts[i]):
        parts[i] = parts[i]()
    return parts[i]


def checked_experts(op: str, parts: list):
    """Takes every entry of `parts` in turn (`take_expert`), each checked to be a float tensor
    of expert 0's shape: a ValueError naming `op` otherwise."""
    shape = peek_expert(parts).shape
    for i in range(len(parts)):
        w = take_expert(parts, i)
        if not w.is_floating_point() or w.shape != shape:
            raise ValueError(
                f"{op}: expert {i} is {w.dtype} {list(w.shape)}; the experts' tensors must be E "
                f"float tensors of one shape ({list(shape)})"
            )
        yield w


def _prepack_expert_lists(w13: list, w2: list):
    if len(w13) != len(w2):
        raise ValueError(f"prepack_experts: {len(w13)} w13 but {len(w2)} w2 experts")
    first13, first2 = peek_expert(w13), peek_expert(w2)
    (two_inter, hidden), (hidden2, inter) = first13.shape, first2.shape
    if two_inter != 2 * inter or hidden2 != hidden:
        raise ValueError(
            f"prepack_experts: w13 {(len(w13), two_inter, hidden)} and w2 "
            f"{(len(w2), hidden2, inter)} disagree"
        )
    num_experts = len(w13)
    packable = _packable(first13) and _packable(first2)
    del first13, first2  # held by the lists until taken, not past that
    if not packable:
        every = lambda parts: list(checked_experts("prepack_experts", parts))  # noqa: E731
        return reference.prepack_experts(every(w13), every(w2))
    return (
        PackedLinear.from_parts(w13, (num_experts, 2, inter, hidden)),
        PackedLinear.from_parts(w2, (num_experts, hidden, inter)),
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor | PackedLinear,
    w2: torch.Tensor | PackedLinear,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """Routed experts; the contract of `reference.fused_moe` (x: [T, D] -> [T, D])."""
    if not isinstance(w13, PackedLinear):
        return reference.fused_moe(x, w13, w2, topk_weights, topk_ids, expert_offset)
    if not (_native_on() and x.dtype == torch.bfloat16 and x.device.type == "cpu"):
        return reference.fused_moe(
            x, w13.unpack(), w2.unpack(), topk_weights, topk_ids, expert_offset
        )
    num_experts, _, hidden = w13.shape
    inter = w13.n
    if not isinstance(w2, PackedLinear) or tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"fused_moe: w2 {tuple(w2.shape)} does not match w13 {tuple(w13.shape)}")
    check_moe_inputs("fused_moe", x, hidden, topk_weights, topk_ids)
    num_tokens = x.shape[0]
    top_k = topk_ids.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16)
    if num_tokens == 0:
        return out
    x2 = _kernel_input(x, hidden)
    weights, ids = routing_tensors(topk_weights, topk_ids)
    ldx = x2.stride(0) if num_tokens > 1 else 2 * w13.k_pairs
    _C.fused_moe_bf16(
        x2.data_ptr(),
        num_tokens,
        ldx,
        w13.k_pairs,
        w13.packed.data_ptr(),
        w2.packed.data_ptr(),
        num_experts,
        inter,
        hidden,
        weights.data_ptr(),
        ids.data_ptr(),
        top_k,
        int(expert_offset),
        out.data_ptr(),
        hidden,
        tags(x2, w13.packed, w2.packed, weights, ids, out),
    )
    return out


def prepack_bmm(b: torch.Tensor) -> torch.Tensor | PackedLinear:
    """A constant right operand b [N, K, P] of `bmm` packed once: the PackedLinear of b^T
    [N, P, K] (per batch entry the layout of a [P, K] linear weight), so `bmm` skips its per-call
    repack; the reference's when the kernel does not cover it (other dtype or device, native
    off)."""
    if b.dim() != 3 or not _packable(b):
        return reference.prepack_bmm(b)
    return PackedLinear(b.detach().transpose(1, 2), tuple(b.transpose(1, 2).shape))


def _bmm_lhs(a: torch.Tensor, k: int) -> torch.Tensor:
    """a as the kernels read it: K padded to even, rows of unit stride starting 4-byte aligned."""
    if k % 2:
        return F.pad(a, (0, 1))
    if a.stride(2) != 1 or a.stride(1) % 2 or a.stride(0) % 2 or a.data_ptr() % 4:
        return a.contiguous()
    return a


def _bmm_packed(a: torch.Tensor, b: PackedLinear) -> torch.Tensor:
    batch, p, k = b.shape
    if a.dim() != 3 or a.shape[0] != batch or a.shape[2] != k:
        raise ValueError(f"bmm: a {tuple(a.shape)} and b {(batch, k, p)} do not chain")
    if not (_native_on() and a.dtype == torch.bfloat16 and a.device.type == "cpu"):
        return reference.bmm(a, b.unpack().transpose(1, 2))
    m = a.shape[1]
    a = _bmm_lhs(a, k)
    if m == 1:  # one row: its stride is never followed, but the binding checks it
        sa1 = a.shape[2]
    else:
        sa1 = a.stride(1)
    out = torch.empty(batch, m, p, dtype=torch.bfloat16)
    _C.bmm_packed_bf16(
        a.data_ptr(),
        batch,
        m,
        b.k_pairs,
        a.stride(0),
        sa1,
        b.packed.data_ptr(),
        p,
        out.data_ptr(),
        tags(a, b.packed, out),
    )
    return out


def bmm(a: torch.Tensor, b: torch.Tensor | PackedLinear) -> torch.Tensor:
    """Batched matmul.  a: [N, M, K], b: [N, K, P] (or `prepack_bmm(b)`) -> [N, M, P] (fp32
    accumulation)."""
    if isinstance(b, PackedLinear):
        return _bmm_packed(a, b)
    if not (
        _native_on()
        and a.dtype == torch.bfloat16
        and b.dtype == torch.bfloat16
        and a.device.type == "cpu"
        and b.device.type == "cpu"
        and a.dim() == 3
        and b.dim() == 3
    ):
        return reference.bmm(a, b)
    batch, m, k = a.shape
    if b.shape[0] != batch or b.shape[1] != k:
        raise ValueError(f"bmm: a {tuple(a.shape)} and b {tuple(b.shape)} do not chain")
    p = b.shape[2]
    a = _bmm_lhs(a, k)
    if b.stride(2) != 1:
        b = b.contiguous()
    out = torch.empty(batch, m, p, dtype=torch.bfloat16)
    _C.bmm_bf16(
        a.data_ptr(),
        batch,
        m,
        (k + 1) // 2,
        a.stride(0),
        a.stride(1),
        b.data_ptr(),
        k,
        p,
        b.stride(0),
        b.stride(1),
        out.data_ptr(),
        tags(a, b, out),
    )
    return out
