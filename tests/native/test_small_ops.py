"""Small per-token kernels (rms_norm, fused_add_rms_norm, silu_and_mul, apply_rope, grouped_topk)
against their plain-torch twins in native.reference, on every ISA level (the `isa` fixture)."""

import pytest
import torch

from native import ops, reference

DTYPES = [torch.float32, torch.bfloat16]
# bf16 results may differ by one rounding step (fp32 sums in another order); fp32 by a few ulp.
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}

ROW_SHAPES = [(1, 1), (1, 2048), (7, 19), (3, 512), (64, 2048 + 13), (0, 64)]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **TOL[expected.dtype])


# ---- norms -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,dim", ROW_SHAPES)
def test_rms_norm(isa, dtype, tokens, dim):
    x = torch.randn(tokens, dim).to(dtype) * 3
    w = (torch.rand(dim) + 0.5).to(dtype)
    _close(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_rows(isa, dtype):
    kv = torch.randn(9, 576).to(dtype)  # normalize c_kv = kv[:, :512] in place of a copy
    w = torch.rand(512).to(dtype)
    _close(ops.rms_norm(kv[:, :512], w, 1e-6), reference.rms_norm(kv[:, :512], w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,dim", ROW_SHAPES)
def test_fused_add_rms_norm(isa, dtype, tokens, dim):
    x, res = torch.randn(tokens, dim).to(dtype), torch.randn(tokens, dim).to(dtype)
    w = (torch.rand(dim) + 0.5).to(dtype)
    out, summed = ops.fused_add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_summed = reference.fused_add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)  # one rounding, as torch
    _close(out, ref_out)


def test_leading_dims_are_flattened(isa):
    x, res = torch.randn(2, 3, 40).bfloat16(), torch.randn(2, 3, 40).bfloat16()
    w = torch.rand(40).bfloat16()
    _close(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    for got, want in zip(
        ops.fused_add_rms_norm(x, res, w, 1e-6),
        reference.fused_add_rms_norm(x, res, w, 1e-6),
        strict=True,
    ):
        _close(got, want)
    _close(ops.silu_and_mul(x), reference.silu_and_mul(x))


def test_rms_norm_falls_back_on_mixed_dtypes(isa):
    x, w = torch.randn(4, 33).bfloat16(), torch.rand(33)  # fp32 weight promotes the output
    expected = reference.rms_norm(x, w, 1e-6)
    assert expected.dtype == torch.float32
    _close(ops.rms_norm(x, w, 1e-6), expected)


# ---- silu_and_mul ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 1), (5, 13), (64, 1408), (2, 10944), (0, 8)])
def test_silu_and_mul(isa, dtype, tokens, inter):
    x = (torch.randn(tokens, 2 * inter) * 4).to(dtype)
    x[:, :1] = -100.0  # silu saturates to -0 without NaN
    _close(ops.silu_and_mul(x), reference.silu_and_mul(x))


# ---- rotary embedding ------------------------------------------------------------------------


def _cos_sin(max_pos: int, rope_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rope_dim, 2).float() / rope_dim)
    angles = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,rope_dim", [(1, 1, 64), (5, 16, 64), (64, 3, 18), (2, 2, 6)])
def test_apply_rope(isa, dtype, tokens, heads, rope_dim):
    # q_pe and k_pe are strided slices, as in the model (q[..., nope:], kv_a[:, kv_lora_rank:]).
    q = torch.randn(tokens, heads, 128 + rope_dim).to(dtype)
    kv = torch.randn(tokens, 512 + rope_dim).to(dtype)
    q_pe, k_pe = q[..., 128:], kv[:, 512:]
    positions = torch.randint(0, 4096, (tokens,))
    cos_sin = _cos_sin(4096, rope_dim)
    q_out, k_out = ops.apply_rope(q_pe, k_pe, positions, cos_sin)
    q_ref, k_ref = reference.apply_rope(q_pe, k_pe, positions, cos_sin)
    # Same roundings in the same order: exact.
    torch.testing.assert_close(q_out, q_ref, rtol=0, atol=0)
    torch.testing.assert_close(k_out, k_ref, rtol=0, atol=0)


def test_apply_rope_int32_positions_and_empty(isa):
    cos_sin = _cos_sin(16, 64)
    q, k = torch.randn(3, 4, 64), torch.randn(3, 64)
    pos = torch.tensor([15, 0, 7], dtype=torch.int32)
    got, want = ops.apply_rope(q, k, pos, cos_sin), reference.apply_rope(q, k, pos, cos_sin)
    _close(got[0], want[0])
    _close(got[1], want[1])
    q_out, k_out = ops.apply_rope(q[:0], k[:0], pos[:0], cos_sin)
    assert q_out.shape == (0, 4, 64) and k_out.shape == (0, 64)


def test_apply_rope_rejects_position_outside_table(isa):
    with pytest.raises(IndexError, match="position 16"):
        ops.apply_rope(
            torch.randn(1, 2, 64), torch.randn(1, 64), torch.tensor([16]), _cos_sin(16, 64)
        )


# ---- grouped top-k ---------------------------------------------------------------------------

# (experts, top_k, n_group, topk_group, scoring, method, norm, scale, bias)
ROUTING = {
    "v2_lite": (64, 6, 1, 1, "softmax", "greedy", False, 1.0, False),
    "v2": (160, 6, 8, 3, "softmax", "group_limited_greedy", False, 16.0, False),
    "v3": (256, 8, 8, 4, "sigmoid", "noaux_tc", True, 2.5, True),
    "odd": (19, 1, 1, 1, "sigmoid", "greedy", True, 1.0, True),
    "groups_greedy_norm": (24, 5, 3, 2, "softmax", "group_limited_greedy", True, 1.0, True),
    "fill_masked": (16, 6, 4, 1, "softmax", "noaux_tc", False, 1.0, False),  # 4 compete for 6
}


def _distinct_logits(tokens: int, experts: int, dtype: torch.dtype) -> torch.Tensor:
    """Logits without ties in either dtype (multiples of 1/32 below 8 are exact in bf16)."""
    rows = [torch.randperm(experts).float() / 32 - experts / 64 for _ in range(tokens)]
    return (torch.stack(rows) if rows else torch.empty(0, experts)).to(dtype)


def _decisive_tokens(logits, bias, top_k, n_group, topk_group, scoring, method, compared, tol=1e-6):
    """Tokens whose routing has no (near-)tie at a decision: the group cut and the order of the
    first `compared` experts. Exact ties are common in fp32 (score + bias rounds two experts to
    one value), and there the kernel and torch may both be right with different ids."""
    scores = logits.float().softmax(-1) if scoring == "softmax" else logits.float().sigmoid()
    choice = scores if bias is None else scores + bias
    decisive = torch.ones(logits.shape[0], dtype=torch.bool)
    if method != "greedy" and n_group > 1:
        grouped = choice.view(logits.shape[0], n_group, -1)
        if method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            group_scores = grouped.max(-1).values
        ranked = group_scores.sort(-1, descending=True).values
        decisive &= ranked[:, topk_group - 1] - ranked[:, topk_group] > tol
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[2], 1), float("-inf"))
    ranked = choice.sort(-1, descending=True).values[:, : compared + 1]
    gaps = ranked[:, :-1] - ranked[:, 1:]
    return decisive & (gaps > tol).all(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 33, 64])
@pytest.mark.parametrize("config", ROUTING.keys())
def test_grouped_topk(isa, dtype, tokens, config):
    experts, top_k, n_group, topk_group, scoring, method, norm, scale, has_bias = ROUTING[config]
    logits = _distinct_logits(tokens, experts, dtype)
    bias = torch.rand(experts) * 0.05 if has_bias else None
    args = (logits, bias, top_k, n_group, topk_group, scoring, method, norm, scale)
    weights, ids = ops.grouped_topk(*args)
    ref_weights, ref_ids = reference.grouped_topk(*args)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (tokens, top_k)
    # fill_masked: only 4 experts compete, the other slots are fillers tied at -inf.
    compared = 4 if config == "fill_masked" else top_k
    rows = _decisive_tokens(logits, bias, top_k, n_group, topk_group, scoring, method, compared)
    assert rows.sum() >= tokens // 2, "test data too tie-prone to check anything"
    assert torch.equal(ids[rows, :compared], ref_ids[rows, :compared])
    torch.testing.assert_close(
        weights[rows, :compared], ref_weights[rows, :compared], rtol=1e-5, atol=1e-6
    )


def test_grouped_topk_strided_logits_and_empty(isa):
    logits = torch.randn(10, 80)[:, :64]
    args = (None, 6, 1, 1, "softmax", "greedy", True, 1.0)
    weights, ids = ops.grouped_topk(logits, *args)
    ref_weights, ref_ids = reference.grouped_topk(logits, *args)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
    weights, ids = ops.grouped_topk(logits[:0], *args)
    assert weights.shape == (0, 6) and ids.shape == (0, 6)


def test_unsupported_dtype_uses_reference(isa):
    x, w = torch.randn(3, 40).half(), torch.rand(40).half()
    assert torch.equal(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    assert torch.equal(ops.silu_and_mul(x), reference.silu_and_mul(x))
