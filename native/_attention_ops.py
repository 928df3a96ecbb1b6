"""Attention ops backed by the C++ kernels (native/csrc/extend_attention.cpp, mla_decode.cpp).

Each function has the signature and contract of its twin in `native.reference` and falls back to
it for cases the kernels do not cover: another device, a dtype other than float32/bfloat16,
mixed dtypes, or the native path switched off (`ops.set_native_enabled(False)`, DUET_NATIVE=0).
"""

from __future__ import annotations

import torch

from native import reference

_DTYPE_TAGS = {torch.float32: 0, torch.bfloat16: 1}  # duet::DType in native/csrc/common.h
_MAX_HEAD_DIM = 1024


def _kernels():
    """The extension module when the native path is on, else None (checked at call time)."""
    from native import ops

    return ops._C if ops.native_available() else None


def _covered(*tensors: torch.Tensor) -> bool:
    dtype = tensors[0].dtype
    return dtype in _DTYPE_TAGS and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels take any token/head strides but need a contiguous last dimension."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    new_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Prefill attention: cached prefix (no mask) + new tokens (causal), variable lengths.

    q, k: [T, H, Dqk], v: [T, H, Dv] (new tokens of all sequences, packed in order);
    k_prefix: [P, H, Dqk], v_prefix: [P, H, Dv]; new_lens, prefix_lens: [B] int.
    Returns [T, H, Dv] in q.dtype. See `native.reference.extend_attention`.
    """
    c = _kernels()
    if c is None or not _covered(q, k, v, k_prefix, v_prefix):
        return reference.extend_attention(q, k, v, k_prefix, v_prefix, new_lens, prefix_lens, sm_scale)
    _check_extend_shapes(q, k, v, k_prefix, v_prefix, new_lens, prefix_lens)
    num_tokens, num_heads, head_dim_qk = q.shape
    head_dim_v = v.shape[2]
    if max(head_dim_qk, head_dim_v) > _MAX_HEAD_DIM:
        return reference.extend_attention(q, k, v, k_prefix, v_prefix, new_lens, prefix_lens, sm_scale)
    q, k, v, k_prefix, v_prefix = map(_rows_contiguous, (q, k, v, k_prefix, v_prefix))
    new_list, prefix_list = new_lens.tolist(), prefix_lens.tolist()
    covered = sum(new_list)
    out = torch.empty(num_tokens, num_heads, head_dim_v, dtype=q.dtype)
    if covered < num_tokens:
        out[covered:] = 0
    tensors = (q, k, v, k_prefix, v_prefix, out)
    strides = [s for t in tensors for s in (t.stride(0), t.stride(1))]
    c.extend_attention(
        out.data_ptr(),
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        k_prefix.data_ptr(),
        v_prefix.data_ptr(),
        strides,
        new_list,
        prefix_list,
        num_tokens,
        k_prefix.shape[0],
        num_heads,
        head_dim_qk,
        head_dim_v,
        _DTYPE_TAGS[q.dtype],
        float(sm_scale),
    )
    return out


def _check_extend_shapes(q, k, v, k_prefix, v_prefix, new_lens, prefix_lens) -> None:
    if any(t.dim() != 3 for t in (q, k, v, k_prefix, v_prefix)):
        raise ValueError("extend_attention: q, k, v, k_prefix, v_prefix must be [tokens, heads, dim]")
    num_tokens, num_heads, head_dim_qk = q.shape
    head_dim_v = v.shape[2]
    if k.shape != q.shape or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"extend_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k_prefix.shape[1:] != (num_heads, head_dim_qk) or v_prefix.shape != (
        k_prefix.shape[0],
        num_heads,
        head_dim_v,
    ):
        raise ValueError(
            f"extend_attention: k_prefix {tuple(k_prefix.shape)}, v_prefix {tuple(v_prefix.shape)} "
            f"do not match q {tuple(q.shape)}, v {tuple(v.shape)}"
        )
    if new_lens.dim() != 1 or new_lens.shape != prefix_lens.shape:
        raise ValueError("extend_attention: new_lens and prefix_lens must be [B] of the same length")
