"""Twin of `ops.mla_decode_absorbed`: one layer's absorbed MLA decode as the chain of the separate
ops it fuses (norm and rope of the new latent rows, W_UK absorption, flash decoding over the paged
cache, W_UV). `absorbed_chain` runs the chain over any set of those ops: the reference ones here,
the dispatching ones where the fused kernel does not cover a case (native/_mla_ops.py)."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import torch

from native import reference


def absorbed_chain(
    parts: ModuleType | SimpleNamespace,
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
    """`mla_decode_absorbed` through `parts.rms_norm`, `.apply_rope`, `.bmm` and `.mla_decode`."""
    rank, rope_dim = kv_a_norm.shape[0], cos_sin.shape[1]
    q_nope, q_pe = q.split([q.shape[2] - rope_dim, rope_dim], dim=-1)
    c_kv = parts.rms_norm(kv_a[:, :rank], kv_a_norm, eps)
    q_pe, k_pe = parts.apply_rope(
        q_pe.contiguous(), kv_a[:, rank:].contiguous(), positions, cos_sin
    )
    rows = torch.cat((c_kv, k_pe), dim=-1)  # [T, L + R], what the cache keeps
    q_latent = parts.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
    q_full = torch.cat((q_latent, q_pe), dim=-1).contiguous()  # [T, H, L + R]
    latent = parts.mla_decode(
        q_full, kv_cache, page_table, seq_lens, sm_scale, rank, new_rows=rows.to(kv_cache.dtype)
    )  # [T, H, L]
    return parts.bmm(latent.transpose(0, 1), w_uv_t).transpose(0, 1)  # [T, H, Dv]


def mla_decode_absorbed(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    kv_a_norm: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv_t: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """One decode token per row t, its heads' values before o_proj: [T, H, Dv].

    q: [T, H, Dn + R], the query projection's output per head (q_nope | q_pe before rope);
    kv_a: [T, L + R], the latent down-projection (c_kv before its norm | k_pe before rope);
    kv_a_norm: [L], the RMSNorm weight of c_kv; positions: [T] int64; cos_sin: [max_pos, R] fp32
    (`apply_rope`); w_uk: [H, Dn, L] and w_uv_t: [H, L, Dv] (or `prepack_bmm` of them);
    kv_cache, page_table, seq_lens, sm_scale as in `mla_decode`. Row t's new cache row
    [rms_norm(c_kv) | rope(k_pe)] is stored at position seq_lens[t] - 1 first (kv_cache mutates).
    """
    return absorbed_chain(
        reference,
        q,
        kv_a,
        kv_a_norm,
        eps,
        positions,
        cos_sin,
        w_uk,
        w_uv_t,
        kv_cache,
        page_table,
        seq_lens,
        sm_scale,
    )
