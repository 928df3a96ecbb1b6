"""`mla_decode_absorbed` backed by the chained kernel (native/csrc/mla_absorbed.cpp); the twin is
`native.reference_mla.mla_decode_absorbed`.

The kernel covers bf16 activations, cache and norm weight with W_UK / W_UV prepacked
(`prepack_bmm`), on the CPU; any other case runs the same chain through the separate ops, each
of which still picks its own kernel."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from native import _attention_ops, _gemm_ops, _small_ops, reference_mla
from native._tags import tags
from native.switch import kernels as _kernels

_SEPARATE_OPS = SimpleNamespace(
    rms_norm=_small_ops.rms_norm,
    apply_rope=_small_ops.apply_rope,
    bmm=_gemm_ops.bmm,
    mla_decode=_attention_ops.mla_decode,
)


def _covered(q, kv_a, kv_a_norm, positions, cos_sin, w_uk, w_uv_t, kv_cache) -> bool:
    bf16 = torch.bfloat16
    return (
        isinstance(w_uk, _gemm_ops.PackedLinear)
        and isinstance(w_uv_t, _gemm_ops.PackedLinear)
        and all(t.dtype == bf16 and t.is_cpu for t in (q, kv_a, kv_a_norm, kv_cache))
        and positions.dtype == torch.int64
        and positions.is_cpu
        and cos_sin.dtype == torch.float32
        and cos_sin.is_cpu
        and q.dim() == 3
        and kv_a.dim() == 2
        and q.stride(2) == 1
        and kv_a.stride(1) == 1
        # the W_UK product reads q_nope as rows of bf16 pairs
        and q.data_ptr() % 4 == 0
        and q.stride(0) % 2 == 0
        and q.stride(1) % 2 == 0
        and kv_cache.is_contiguous()  # written in place: a copy would lose the new rows
    )


def _check_shapes(q, kv_a, kv_a_norm, cos_sin, w_uk, w_uv_t, kv_cache, page_table, seq_lens):
    tokens, heads, qk_dim = q.shape
    rank, rope_dim = kv_a_norm.shape[0], cos_sin.shape[1]
    if kv_a.shape != (tokens, rank + rope_dim) or kv_cache.shape[2] != rank + rope_dim:
        raise ValueError(
            f"mla_decode_absorbed: kv_a {tuple(kv_a.shape)} and kv_cache "
            f"{tuple(kv_cache.shape)} must be [{tokens}, L + R] and [pages, page_size, L + R] "
            f"with L = {rank} (kv_a_norm), R = {rope_dim} (cos_sin)"
        )
    nope = qk_dim - rope_dim
    # prepack_bmm keeps b^T's shape: W_UK [H, Dn, L] as (H, L, Dn), W_UV^T [H, L, Dv] as (H, Dv, L)
    if w_uk.shape != (heads, rank, nope) or w_uv_t.shape[0] != heads or w_uv_t.shape[2] != rank:
        raise ValueError(
            f"mla_decode_absorbed: W_UK and W_UV^T must be prepacked [H, Dn, L] and [H, L, Dv] "
            f"for q {tuple(q.shape)} with L = {rank}"
        )
    if page_table.dim() != 2 or page_table.shape[0] != tokens or seq_lens.shape != (tokens,):
        raise ValueError(
            f"mla_decode_absorbed: page_table {tuple(page_table.shape)} must be [T, max_pages] "
            f"and seq_lens {tuple(seq_lens.shape)} [T] with T = {tokens}"
        )


def mla_decode_absorbed(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    kv_a_norm: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    w_uk,
    w_uv_t,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """See `native.reference_mla.mla_decode_absorbed`."""
    args = (q, kv_a, kv_a_norm, eps, positions, cos_sin, w_uk, w_uv_t, kv_cache)
    c = _kernels()
    if c is None or not _covered(q, kv_a, kv_a_norm, positions, cos_sin, w_uk, w_uv_t, kv_cache):
        return reference_mla.absorbed_chain(_SEPARATE_OPS, *args, page_table, seq_lens, sm_scale)
    _check_shapes(q, kv_a, kv_a_norm, cos_sin, w_uk, w_uv_t, kv_cache, page_table, seq_lens)
    tokens, heads, qk_dim = q.shape
    rank, rope_dim = kv_a_norm.shape[0], cos_sin.shape[1]
    v_dim = w_uv_t.shape[1]
    table = page_table if page_table.dtype == torch.int32 else page_table.to(torch.int32)
    table = table if table.stride(-1) == 1 else table.contiguous()
    norm_w = kv_a_norm.contiguous()
    cos_sin = cos_sin.contiguous()
    out = torch.empty(tokens, heads, v_dim, dtype=torch.bfloat16)
    c.mla_decode_absorbed(
        out.data_ptr(),
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        kv_a.data_ptr(),
        kv_a.stride(0),
        norm_w.data_ptr(),
        float(eps),
        positions.data_ptr(),
        cos_sin.data_ptr(),
        cos_sin.shape[0],
        w_uk.packed.data_ptr(),
        w_uk.k_pairs,
        w_uv_t.packed.data_ptr(),
        w_uv_t.k_pairs,
        [heads, qk_dim - rope_dim, rope_dim, rank, v_dim],
        kv_cache.data_ptr(),
        kv_cache.shape[0],
        kv_cache.shape[1],
        table.data_ptr(),
        table.stride(0),
        table.shape[1],
        seq_lens.tolist(),
        float(sm_scale),
        tags(out, q, kv_a, norm_w, positions, cos_sin, w_uk.packed, w_uv_t.packed, kv_cache, table),
    )
    return out
