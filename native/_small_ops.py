"""Wrappers of the small per-token kernels (norm.cpp, rope.cpp, topk.cpp in native/csrc).

Each function has the signature and contract of its twin in `native.reference` (see the
docstrings there) and falls back to it when the kernel does not cover the call: native
disabled, a tensor off the CPU, a dtype other than float32/bfloat16, or unusual arguments.
Outputs are allocated here with torch; inputs are made contiguous only where the kernel needs it
(rows may be strided: slices such as q[..., nope:] or kv[:, :kv_lora_rank] are read in place).
"""

from __future__ import annotations

import torch

from native import reference

try:
    from native import _C
except ImportError:  # not built: the reference ops are used
    _C = None

# dtype tags of native/csrc/common.h's DType.
_DTYPE_TAG = {torch.float32: 0, torch.bfloat16: 1}
# Group-ranking codes of topk.cpp: greedy (no groups), top-2 sum (noaux_tc), max.
_GROUP_METHOD = {"greedy": 0, "noaux_tc": 1}


def _on(*tensors: torch.Tensor) -> bool:
    """True when the kernels are enabled and every tensor lives on the CPU."""
    return ops.native_available() and all(t.device.type == "cpu" for t in tensors)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last] with a unit stride on the last dim (a view when possible)."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] <= 1 else x2.contiguous()


def _row_stride(x2: torch.Tensor) -> int:
    return x2.stride(0) if x2.shape[0] > 1 else x2.shape[1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    tag = _DTYPE_TAG.get(x.dtype)
    dim = x.shape[-1] if x.dim() else 0
    if (
        tag is None
        or weight.dtype != x.dtype
        or weight.shape != (dim,)
        or dim == 0
        or not _on(x, weight)
    ):
        return reference.rms_norm(x, weight, eps)
    x2, w = _rows(x), weight.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype)
    _C.rms_norm(
        x2.data_ptr(), _row_stride(x2), w.data_ptr(), out.data_ptr(), x2.shape[0], dim, eps, tag
    )
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    tag = _DTYPE_TAG.get(x.dtype)
    dim = x.shape[-1] if x.dim() else 0
    if (
        tag is None
        or residual.dtype != x.dtype
        or weight.dtype != x.dtype
        or residual.shape != x.shape
        or weight.shape != (dim,)
        or dim == 0
        or not _on(x, residual, weight)
    ):
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    x2, r2, w = _rows(x), _rows(residual), weight.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype)
    summed = torch.empty(x2.shape, dtype=x.dtype)
    _C.fused_add_rms_norm(
        x2.data_ptr(), _row_stride(x2), r2.data_ptr(), _row_stride(r2), w.data_ptr(),
        out.data_ptr(), summed.data_ptr(), x2.shape[0], dim, eps, tag,
    )  # fmt: skip
    return out.view(x.shape), summed.view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    tag = _DTYPE_TAG.get(x.dtype)
    if tag is None or x.dim() == 0 or x.shape[-1] % 2 or x.shape[-1] == 0 or not _on(x):
        return reference.silu_and_mul(x)
    x2 = _rows(x)
    half = x2.shape[1] // 2
    out = torch.empty(x2.shape[0], half, dtype=x.dtype)
    _C.silu_and_mul(x2.data_ptr(), _row_stride(x2), out.data_ptr(), x2.shape[0], half, tag)
    return out.view(*x.shape[:-1], half)


def apply_rope(
    q_pe: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    tag = _DTYPE_TAG.get(q_pe.dtype)
    if (
        tag is None
        or k_pe.dtype != q_pe.dtype
        or q_pe.dim() != 3
        or k_pe.dim() != 2
        or cos_sin.dtype != torch.float32
        or cos_sin.dim() != 2
        or cos_sin.shape[1] != q_pe.shape[2]
        or k_pe.shape != (q_pe.shape[0], q_pe.shape[2])
        or positions.shape != (q_pe.shape[0],)
        or q_pe.shape[2] % 2
        or not _on(q_pe, k_pe, positions, cos_sin)
    ):
        return reference.apply_rope(q_pe, k_pe, positions, cos_sin)
    num_tokens, num_heads, rope_dim = q_pe.shape
    q = q_pe if q_pe.stride(2) == 1 else q_pe.contiguous()
    k = k_pe if k_pe.stride(1) == 1 else k_pe.contiguous()
    pos = positions.to(torch.int64).contiguous()
    cs = cos_sin.contiguous()
    q_out = torch.empty(num_tokens, num_heads, rope_dim, dtype=q.dtype)
    k_out = torch.empty(num_tokens, rope_dim, dtype=k.dtype)
    _C.apply_rope(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), pos.data_ptr(),
        cs.data_ptr(), cs.shape[0], q_out.data_ptr(), k_out.data_ptr(), num_tokens, num_heads,
        rope_dim, tag,
    )  # fmt: skip
    return q_out, k_out


def grouped_topk(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    scoring_func: str,
    topk_method: str,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (router_logits, correction_bias, top_k, n_group, topk_group, scoring_func)
    args += (topk_method, norm_topk_prob, routed_scaling_factor)
    tag = _DTYPE_TAG.get(router_logits.dtype)
    if tag is None or router_logits.dim() != 2:
        return reference.grouped_topk(*args)
    num_tokens, num_experts = router_logits.shape
    method = _GROUP_METHOD.get(topk_method, 2) if n_group > 1 else 0
    grouped = method != 0
    if (
        not 1 <= top_k <= num_experts
        or (grouped and (num_experts % n_group or not 1 <= topk_group <= n_group))
        or (method == 1 and num_experts // n_group < 2)  # top-2 of a group of one
        or (correction_bias is not None and correction_bias.shape != (num_experts,))
        or not _on(router_logits, *(() if correction_bias is None else (correction_bias,)))
    ):
        return reference.grouped_topk(*args)
    logits = _rows(router_logits)
    bias = None if correction_bias is None else correction_bias.to(torch.float32).contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32)
    _C.grouped_topk(
        logits.data_ptr(), _row_stride(logits), tag, 0 if bias is None else bias.data_ptr(),
        weights.data_ptr(), ids.data_ptr(), num_tokens, num_experts, top_k, n_group, topk_group,
        scoring_func == "softmax", method, bool(norm_topk_prob), float(routed_scaling_factor),
    )  # fmt: skip
    return weights, ids


# Imported last: native.ops imports this module, and the wrappers only read ops at call time.
from native import ops  # noqa: E402
