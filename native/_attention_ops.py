"""Attention ops backed by the C++ kernels (native/csrc/extend_attention.cpp, mla_decode.cpp).

Each function has the signature and contract of its twin in `native.reference` and falls back to
it for cases the kernels do not cover: another device, a dtype other than float32/bfloat16,
mixed dtypes, or the native path switched off (`ops.set_native_enabled(False)`, DUET_NATIVE=0).
"""

from __future__ import annotations

import torch

from native import reference
from native._tags import DTYPE_TAGS
from native.switch import kernels as _kernels

# The element dtypes these kernels take (their tags: native/_tags.py).
_DTYPE_TAGS = {dtype: DTYPE_TAGS[dtype] for dtype in (torch.float32, torch.bfloat16)}
_MAX_HEAD_DIM = 1024


def _covered(*tensors: torch.Tensor) -> bool:
    dtype = tensors[0].dtype
    return dtype in _DTYPE_TAGS and all(
        t.device.type == "cpu" and t.dtype == dtype for t in tensors
    )


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
        return reference.extend_attention(
            q, k, v, k_prefix, v_prefix, new_lens, prefix_lens, sm_scale
        )
    _check_extend_shapes(q, k, v, k_prefix, v_prefix, new_lens, prefix_lens)
    num_tokens, num_heads, head_dim_qk = q.shape
    head_dim_v = v.shape[2]
    if max(head_dim_qk, head_dim_v) > _MAX_HEAD_DIM:
        return reference.extend_attention(
            q, k, v, k_prefix, v_prefix, new_lens, prefix_lens, sm_scale
        )
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
        raise ValueError(
            "extend_attention: q, k, v, k_prefix, v_prefix must be [tokens, heads, dim]"
        )
    num_tokens, num_heads, head_dim_qk = q.shape
    head_dim_v = v.shape[2]
    if k.shape != q.shape or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"extend_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
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
        raise ValueError(
            "extend_attention: new_lens and prefix_lens must be [B] of the same length"
        )


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    new_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode over the paged latent cache of one layer (flash decoding).

    q: [B, H, W]; kv_cache: [num_pages, page_size, W] (mutated when new_rows is given);
    page_table: [B, max_pages] int; seq_lens: [B] int (context length including the new token);
    new_rows: [B, W] or None, row b stored at position seq_lens[b] - 1 first.
    Returns [B, H, kv_lora_rank] in q.dtype. See `native.reference.mla_decode`.
    """
    c = _kernels()
    inputs = (q, kv_cache, page_table, seq_lens) + (() if new_rows is None else (new_rows,))
    if (
        c is None
        or not _covered(q, kv_cache)
        or any(t.device.type != "cpu" for t in inputs)
        or not kv_cache.is_contiguous()  # written in place: a copy would lose the new rows
    ):
        return reference.mla_decode(
            q, kv_cache, page_table, seq_lens, sm_scale, kv_lora_rank, new_rows
        )
    _check_decode_shapes(q, kv_cache, page_table, seq_lens, kv_lora_rank, new_rows)
    batch, num_heads, width = q.shape
    num_pages, page_size, _ = kv_cache.shape
    q = _rows_contiguous(q)
    table = page_table if page_table.dtype == torch.int32 else page_table.to(torch.int32)
    table = table if table.stride(-1) == 1 else table.contiguous()
    rows = new_rows
    if rows is not None:
        rows = rows if rows.dtype == kv_cache.dtype else rows.to(kv_cache.dtype)
        rows = rows if rows.is_contiguous() else rows.contiguous()
    out = torch.empty(batch, num_heads, kv_lora_rank, dtype=q.dtype)
    c.mla_decode(
        out.data_ptr(),
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        kv_cache.data_ptr(),
        num_pages,
        page_size,
        width,
        table.data_ptr(),
        table.stride(0),
        table.shape[1],
        seq_lens.tolist(),
        0 if rows is None else rows.data_ptr(),
        num_heads,
        int(kv_lora_rank),
        _DTYPE_TAGS[q.dtype],
        float(sm_scale),
    )
    return out


def _check_decode_shapes(q, kv_cache, page_table, seq_lens, kv_lora_rank, new_rows) -> None:
    if q.dim() != 3 or kv_cache.dim() != 3 or q.shape[2] != kv_cache.shape[2]:
        raise ValueError(
            f"mla_decode: q {tuple(q.shape)} must be [B, H, W] and kv_cache "
            f"{tuple(kv_cache.shape)} [num_pages, page_size, W]"
        )
    batch, _, width = q.shape
    if page_table.dim() != 2 or page_table.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(
            f"mla_decode: page_table {tuple(page_table.shape)} must be [B, max_pages] and "
            f"seq_lens {tuple(seq_lens.shape)} [B] with B = {batch}"
        )
    if not 1 <= kv_lora_rank <= width:
        raise ValueError(f"mla_decode: kv_lora_rank {kv_lora_rank} must be in [1, {width}]")
    if new_rows is not None and new_rows.shape != (batch, width):
        raise ValueError(f"mla_decode: new_rows {tuple(new_rows.shape)} must be [{batch}, {width}]")
