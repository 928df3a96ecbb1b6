"""Fused bf16 MoE (native/csrc/moe.cpp) against `reference.fused_moe`, on every ISA level.

Covers decode and small-prefill token counts, sizes off the 32-column block and the K-pair,
experts with no tokens, ids outside this rank's expert range (expert parallelism), a token
routed twice to one expert, and empty inputs."""

import pytest
import torch

from native import _gemm_ops, ops, reference

# Intermediates are rounded to bf16 at different points than in the reference (gate/up stay fp32
# until silu * up), so allow a few bf16 ulps of an O(1) output.
BF16_TOL = {"rtol": 3e-2, "atol": 3e-2}


def _experts(num_experts: int, inter: int, hidden: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * (2.0 / inter) ** 0.5
    return w13.to(torch.bfloat16), w2.to(torch.bfloat16)


def _routing(num_tokens: int, top_k: int, low: int, high: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, high, (num_tokens, top_k), generator=gen, dtype=torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return weights, ids


def _tokens(num_tokens: int, hidden: int, seed: int = 2) -> torch.Tensor:
    """Activations from their own seed: the same inputs whichever tests ran before."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)


def _check(x, w13, w2, weights, ids, expert_offset=0):
    p13, p2 = ops.prepack_experts(w13, w2)
    assert isinstance(p13, _gemm_ops.PackedLinear)
    out = ops.fused_moe(x, p13, p2, weights, ids, expert_offset)
    expected = reference.fused_moe(x, w13, w2, weights, ids, expert_offset)
    assert out.shape == expected.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), **BF16_TOL)
    return out


@pytest.mark.parametrize(
    "num_tokens,hidden,inter,num_experts,top_k",
    [
        (1, 64, 32, 4, 2),
        (3, 70, 45, 6, 3),
        (8, 128, 96, 8, 6),
        (19, 33, 17, 3, 2),
        (64, 96, 64, 16, 4),
    ],
)
def test_fused_moe_matches_reference(isa, num_tokens, hidden, inter, num_experts, top_k):
    w13, w2 = _experts(num_experts, inter, hidden)
    x = _tokens(num_tokens, hidden)
    weights, ids = _routing(num_tokens, top_k, 0, num_experts)
    _check(x, w13, w2, weights, ids)


@pytest.mark.parametrize("expert_offset", [0, 4])
def test_expert_parallel_slice(isa, expert_offset):
    # 12 global experts, this rank holds 4 of them: other ids contribute nothing.
    w13, w2 = _experts(4, 40, 64)
    x = _tokens(23, 64)
    weights, ids = _routing(23, 3, 0, 12)
    _check(x, w13, w2, weights, ids, expert_offset)


def test_prefill_sized_batch(isa):
    if isa == "portable":
        pytest.skip("same code as the small cases; too slow for the scalar path")
    w13, w2 = _experts(8, 160, 256)
    x = _tokens(300, 256)
    # Skewed routing: experts 0-2 take most rows, expert 7 none.
    weights, ids = _routing(300, 2, 0, 3)
    ids[:40, 1] = 5
    _check(x, w13, w2, weights, ids)


def test_duplicate_expert_and_unrouted_tokens(isa):
    w13, w2 = _experts(3, 32, 64)
    x = _tokens(4, 64)
    weights = torch.tensor([[0.5, 0.25], [1.0, 0.0], [0.3, 0.7], [0.2, 0.2]])
    ids = torch.tensor([[1, 1], [9, 9], [0, 2], [-1, 2]], dtype=torch.int32)
    out = _check(x, w13, w2, weights, ids)
    assert torch.count_nonzero(out[1]) == 0  # token 1 routed only to experts held elsewhere


def test_empty_and_all_remote(isa):
    w13, w2 = _experts(2, 32, 64)
    empty = torch.empty(0, 64, dtype=torch.bfloat16)
    weights, ids = _routing(0, 2, 0, 2)
    assert _check(empty, w13, w2, weights, ids).shape == (0, 64)
    x = _tokens(5, 64)
    weights, ids = _routing(5, 2, 10, 20)
    assert torch.count_nonzero(_check(x, w13, w2, weights, ids)) == 0


def test_fallbacks_match_reference(isa):
    w13, w2 = _experts(3, 32, 48)
    x = _tokens(6, 48)
    weights, ids = _routing(6, 2, 0, 3)
    p13, p2 = ops.prepack_experts(w13, w2)
    assert torch.equal(p13.unpack(), w13) and torch.equal(p2.unpack(), w2)
    expected = reference.fused_moe(x, w13, w2, weights, ids)
    ops.set_native_enabled(False)
    try:
        assert torch.equal(ops.fused_moe(x, p13, p2, weights, ids), expected)
    finally:
        ops.set_native_enabled(True)
    # fp32 experts stay unpacked (reference path).
    f13, f2 = ops.prepack_experts(w13.float(), w2.float())
    assert not isinstance(f13, _gemm_ops.PackedLinear)
    torch.testing.assert_close(
        ops.fused_moe(x.float(), f13, f2, weights, ids),
        reference.fused_moe(x.float(), f13, f2, weights, ids),
    )


def test_rejects_mismatched_shapes(isa):
    w13, w2 = _experts(2, 32, 64)
    p13, p2 = ops.prepack_experts(w13, w2)
    weights, ids = _routing(3, 2, 0, 2)
    with pytest.raises(ValueError, match="hidden"):
        ops.fused_moe(torch.randn(3, 63).to(torch.bfloat16), p13, p2, weights, ids)
    with pytest.raises(ValueError, match="disagree"):
        ops.prepack_experts(w13, w2[:, :, :31])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_experts_given_one_by_one_pack_as_the_stack_and_are_consumed(dtype):
    """The model hands its experts over as lists so they are never held twice: the result is
    the stack's (packed or, for the reference path, stacked), and each entry is released."""
    w13, w2 = (w.to(dtype) for w in _experts(3, 40, 50))  # off the 32-column block, odd K
    parts13, parts2 = list(w13.unbind(0)), list(w2.unbind(0))
    p13, p2 = ops.prepack_experts(parts13, parts2)
    s13, s2 = ops.prepack_experts(w13, w2)
    if dtype == torch.bfloat16:  # packed one by one, each entry released
        assert all(p is None for p in (*parts13, *parts2))
    for got, want in ((p13, s13), (p2, s2)):
        if isinstance(want, _gemm_ops.PackedLinear):
            assert torch.equal(got.packed, want.packed) and got.shape == want.shape
            assert torch.equal(got.unpack(), want.unpack())
        else:
            assert torch.equal(got, want)
    with pytest.raises(ValueError, match="disagree"):
        ops.prepack_experts(list(w13.unbind(0)), [w[:, :31] for w in w2.unbind(0)])
    with pytest.raises(ValueError, match="one shape"):
        ops.prepack_experts([w13[0], w13[1][:, :7]], list(w2.unbind(0))[:2])
