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
from native._tags import DTYPE_TAGS
from native.switch import extension as _C
from native.switch import native_available as _native_on

# The element dtypes these kernels take (their tags: native/_tags.py).
_DTYPE_TAG = {dtype: DTYPE_TAGS[dtype] for dtype in (torch.float32, torch.bfloat16)}
# Group-ranking codes of topk.cpp: greedy (no groups), top-2 sum (noaux_tc), max.
_GROUP_METHOD = {"greedy": 0, "noaux_tc": 1}


def _on(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """True when the kernels are enabled and the tensors live on the CPU."""
    return x.is_cpu and (weight is None or weight.is_cpu) and _native_on()


def _row_view(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """2-D x with unit stride on the last dim (copied only if needed), and its row stride.

    The wrappers are on the decode path, where tensor attribute reads cost ~0.2-0.4 us each, so
    the common contiguous case is answered with the fewest of them."""
    if x.is_contiguous():
        return x, x.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
        return x, x.shape[1]
    return x, x.stride(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    tag = _DTYPE_TAG.get(x.dtype)
    if tag is None or weight.dtype is not x.dtype or x.dim() == 0 or not _on(x, weight):
        return reference.rms_norm(x, weight, eps)
    if x.dim() != 2:
        return rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
    rows, dim = x.shape
    if dim == 0 or weight.shape != (dim,):
        return reference.rms_norm(x, weight, eps)
    x, stride = _row_view(x)
    w = weight if weight.is_contiguous() else weight.contiguous()
    out = torch.empty(rows, dim, dtype=x.dtype)
    _C.rms_norm(x.data_ptr(), stride, w.data_ptr(), out.data_ptr(), rows, dim, eps, tag)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    tag = _DTYPE_TAG.get(x.dtype)
    if (
        tag is None
        or weight.dtype is not x.dtype
        or residual.dtype is not x.dtype
        or x.dim() == 0
        or not (residual.is_cpu and _on(x, weight))
    ):
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    if x.dim() != 2:
        if residual.shape != x.shape:
            return reference.fused_add_rms_norm(x, residual, weight, eps)
        out, summed = fused_add_rms_norm(
            x.reshape(-1, x.shape[-1]), residual.reshape(-1, x.shape[-1]), weight, eps
        )
        return out.view(x.shape), summed.view(x.shape)
    rows, dim = x.shape
    if dim == 0 or weight.shape != (dim,) or residual.shape != x.shape:
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    x, x_stride = _row_view(x)
    residual, res_stride = _row_view(residual)
    w = weight if weight.is_contiguous() else weight.contiguous()
    out = torch.empty(rows, dim, dtype=x.dtype)
    summed = torch.empty(rows, dim, dtype=x.dtype)
    _C.fused_add_rms_norm(
        x.data_ptr(),
        x_stride,
        residual.data_ptr(),
        res_stride,
        w.data_ptr(),
        out.data_ptr(),
        summed.data_ptr(),
        rows,
        dim,
        eps,
        tag,
    )
    return out, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    tag = _DTYPE_TAG.get(x.dtype)
    if tag is None or x.dim() == 0 or not _on(x):
        return reference.silu_and_mul(x)
    if x.dim() != 2:
        out = silu_and_mul(x.reshape(-1, x.shape[-1]))
        return out.view(*x.shape[:-1], out.shape[-1])
    rows, width = x.shape
    if width == 0 or width % 2:
        return reference.silu_and_mul(x)
    x, stride = _row_view(x)
    half = width // 2
    out = torch.empty(rows, half, dtype=x.dtype)
    _C.silu_and_mul(x.data_ptr(), stride, out.data_ptr(), rows, half, tag)
    return out


def apply_rope(
    q_pe: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    tag = _DTYPE_TAG.get(q_pe.dtype)
    if (
        tag is None
        or k_pe.dtype is not q_pe.dtype
        or cos_sin.dtype is not torch.float32
        or q_pe.dim() != 3
        or k_pe.dim() != 2
        or cos_sin.dim() != 2
        or not (positions.is_cpu and cos_sin.is_cpu and _on(q_pe, k_pe))
    ):
        return reference.apply_rope(q_pe, k_pe, positions, cos_sin)
    num_tokens, num_heads, rope_dim = q_pe.shape
    if (
        rope_dim % 2
        or k_pe.shape != (num_tokens, rope_dim)
        or cos_sin.shape[1] != rope_dim
        or positions.shape != (num_tokens,)
    ):
        return reference.apply_rope(q_pe, k_pe, positions, cos_sin)
    q_strides = q_pe.stride()
    if q_strides[2] != 1:
        q_pe = q_pe.contiguous()
        q_strides = q_pe.stride()
    k_strides = k_pe.stride()
    if k_strides[1] != 1:
        k_pe = k_pe.contiguous()
        k_strides = k_pe.stride()
    if positions.dtype is not torch.int64 or not positions.is_contiguous():
        positions = positions.to(torch.int64).contiguous()
    if not cos_sin.is_contiguous():
        cos_sin = cos_sin.contiguous()
    q_out = torch.empty(num_tokens, num_heads, rope_dim, dtype=q_pe.dtype)
    k_out = torch.empty(num_tokens, rope_dim, dtype=q_pe.dtype)
    _C.apply_rope(
        q_pe.data_ptr(),
        q_strides[0],
        q_strides[1],
        k_pe.data_ptr(),
        k_strides[0],
        positions.data_ptr(),
        cos_sin.data_ptr(),
        cos_sin.shape[0],
        q_out.data_ptr(),
        k_out.data_ptr(),
        num_tokens,
        num_heads,
        rope_dim,
        tag,
    )
    return q_out, k_out


def router_logits(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    tag, gate_tag = _DTYPE_TAG.get(x.dtype), _DTYPE_TAG.get(gate.dtype)
    if (
        tag is None
        or gate_tag is None
        or x.dim() != 2
        or gate.dim() != 2
        or gate.shape[1] != x.shape[1]
        or not _on(x, gate)
    ):
        return reference.router_logits(x, gate)
    x, stride = _row_view(x)
    w = gate if gate.is_contiguous() else gate.contiguous()
    tokens, experts = x.shape[0], w.shape[0]
    out = torch.empty(tokens, experts, dtype=torch.float32)
    _C.router_logits(
        x.data_ptr(),
        stride,
        tag,
        w.data_ptr(),
        gate_tag,
        out.data_ptr(),
        tokens,
        experts,
        x.shape[1],
    )
    return out


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
    tag = _DTYPE_TAG.get(router_logits.dtype)
    method = _GROUP_METHOD.get(topk_method, 2) if n_group > 1 else 0
    covered = (
        tag is not None
        and router_logits.dim() == 2
        and _on(router_logits, correction_bias)
        and 1 <= top_k <= router_logits.shape[1]
    )
    if covered:
        num_tokens, num_experts = router_logits.shape
        if method != 0:  # groups must tile the experts; top-2 needs two per group
            covered = num_experts % n_group == 0 and 1 <= topk_group <= n_group
            covered = covered and (method != 1 or num_experts // n_group >= 2)
        if correction_bias is not None:
            covered = covered and correction_bias.shape == (num_experts,)
    if not covered:
        return reference.grouped_topk(
            router_logits,
            correction_bias,
            top_k,
            n_group,
            topk_group,
            scoring_func,
            topk_method,
            norm_topk_prob,
            routed_scaling_factor,
        )
    logits, stride = _row_view(router_logits)
    bias_ptr = 0
    if correction_bias is not None:
        if correction_bias.dtype is not torch.float32 or not correction_bias.is_contiguous():
            correction_bias = correction_bias.to(torch.float32).contiguous()
        bias_ptr = correction_bias.data_ptr()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32)
    _C.grouped_topk(
        logits.data_ptr(),
        stride,
        tag,
        bias_ptr,
        weights.data_ptr(),
        ids.data_ptr(),
        num_tokens,
        num_experts,
        top_k,
        n_group,
        topk_group,
        scoring_func == "softmax",
        method,
        bool(norm_topk_prob),
        float(routed_scaling_factor),
    )
    return weights, ids


def checksum(data: torch.Tensor) -> int:
    """`reference.checksum` of a contiguous CPU tensor's bytes, at memory speed (the packed weight
    store verifies every tensor it maps with it)."""
    if not data.is_contiguous():
        raise ValueError("checksum: the tensor must be contiguous")
    if data.device.type != "cpu" or not _native_on():
        return reference.checksum(data)
    raw = data.detach().view(-1).view(torch.uint8)
    return _C.checksum(raw.data_ptr(), DTYPE_TAGS[raw.dtype], raw.numel())
