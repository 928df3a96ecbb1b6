"""FP8 e4m3 weight-only fused MoE (native/csrc/moe_fp8.cpp) against its twin
`reference.fused_moe_fp8`, on every ISA level (the `isa` fixture): decode and prefill token counts,
I and D off the 32-column block, the 128 x 128 scale block and the k-pair (several scale blocks,
gate / up halves with their own blocks), experts with no tokens, ids outside this rank's range
(expert parallelism), a token routed twice, T = 0, and bad inputs.

Tolerances:
- kernel vs twin: both multiply by the exact e4m3 values in fp32 and round silu(gate) * up to bf16;
  the kernel sums each 128-wide k block from zero and scales it, the twin scales each weight. The
  difference is fp32 summation order, which can flip the bf16 rounding of an h element or of the
  output (one ulp, 2^-8 relative): rtol = atol = 1e-2 on O(1) outputs.
- twin vs the unquantized experts (plain fp32 `reference.fused_moe`): e4m3 keeps 3 mantissa bits
  (relative rounding error <= 2^-4, about 2^-4 / sqrt(3) rms), so the output's relative L2 error
  stays well under 0.1.
"""

import pytest
import torch
from test_moe import _experts, _routing  # the bf16 suite's generators

from native import _moe_fp8_ops, ops, reference

FP8 = torch.float8_e4m3fn
TWIN_TOL = {"rtol": 1e-2, "atol": 1e-2}


def _fp8_experts(num_experts: int, inter: int, hidden: int, seed: int = 0):
    """Raw e4m3 experts as a checkpoint holds them, with varied block scales."""
    gen = torch.Generator().manual_seed(seed)
    blocks = lambda n: -(-n // 128)  # noqa: E731

    def weight(n, k, scale_rows):
        w = (torch.randn(num_experts, n, k, generator=gen) * 64).clamp(-448, 448).to(FP8)
        s = torch.exp(torch.randn(num_experts, scale_rows, blocks(k), generator=gen)) / (
            64 * k**0.5
        )
        return w, s

    w13, s13 = weight(2 * inter, hidden, 2 * blocks(inter))
    w2, s2 = weight(hidden, inter, blocks(hidden))
    return w13, w2, s13, s2


def _x(num_tokens: int, hidden: int, seed: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)


def _check(x, packed, weights, ids, expert_offset=0):
    p13, p2 = packed
    out = ops.fused_moe_fp8(x, p13, p2, weights, ids, expert_offset)
    twin = reference.fused_moe_fp8(x, p13.unpack(), p2.unpack(), weights, ids, expert_offset)
    assert out.shape == twin.shape == x.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), twin.float(), **TWIN_TOL)
    return out


@pytest.mark.parametrize("num_tokens", [1, 3, 17, 64])
@pytest.mark.parametrize("hidden,inter,num_experts,top_k", [(70, 45, 6, 3), (200, 160, 4, 2)])
def test_quantized_experts_match_twin(isa, num_tokens, hidden, inter, num_experts, top_k):
    w13, w2 = _experts(num_experts, inter, hidden)
    packed = ops.prepack_experts_fp8_from(w13, w2)
    weights, ids = _routing(num_tokens, top_k, 0, num_experts)
    _check(_x(num_tokens, hidden), packed, weights, ids)


@pytest.mark.parametrize("num_tokens", [1, 17])
def test_checkpoint_experts_with_varied_scales(isa, num_tokens):
    # I = 160: gate's and up's last scale rows are partial; D = 300: odd sizes in both GEMMs.
    w13, w2, s13, s2 = _fp8_experts(3, 160, 300)
    packed = ops.prepack_experts_fp8(w13, w2, s13, s2)
    weights, ids = _routing(num_tokens, 2, 0, 3)
    _check(_x(num_tokens, 300), packed, weights, ids)


def test_odd_hidden_and_prefill_sized_batch(isa):
    if isa in ("portable", "avx2"):  # avx2 runs the portable fp8 code
        pytest.skip("same code as the small cases; too slow for the scalar path")
    w13, w2 = _experts(8, 136, 257)
    packed = ops.prepack_experts_fp8_from(w13, w2)
    weights, ids = _routing(300, 2, 0, 3)  # skewed: experts 0-2 take most rows, 7 none
    ids[:40, 1] = 5
    _check(_x(300, 257), packed, weights, ids)


@pytest.mark.parametrize("expert_offset", [0, 4])
def test_expert_parallel_slice(isa, expert_offset):
    # 12 global experts, this rank holds 4 of them: other ids contribute nothing.
    w13, w2 = _experts(4, 40, 64)
    packed = ops.prepack_experts_fp8_from(w13, w2)
    weights, ids = _routing(23, 3, 0, 12)
    out = _check(_x(23, 64), packed, weights, ids, expert_offset)
    local = (ids >= expert_offset) & (ids < expert_offset + 4)
    assert torch.count_nonzero(out[~local.any(1)]) == 0


def test_duplicate_expert_unrouted_tokens_and_empty(isa):
    w13, w2 = _experts(3, 32, 64)
    packed = ops.prepack_experts_fp8_from(w13, w2)
    weights = torch.tensor([[0.5, 0.25], [1.0, 0.0], [0.3, 0.7], [0.2, 0.2]])
    ids = torch.tensor([[1, 1], [9, 9], [0, 2], [-1, 2]], dtype=torch.int32)
    x = _x(4, 64)
    out = _check(x, packed, weights, ids)
    assert torch.count_nonzero(out[1]) == 0  # routed only to experts held elsewhere
    once = ops.fused_moe_fp8(x[:1], *packed, torch.tensor([[0.75]]), ids[:1, :1])
    torch.testing.assert_close(out[0].float(), once[0].float(), **TWIN_TOL)  # twice = 0.75 once
    empty = _routing(0, 2, 0, 3)
    assert _check(torch.empty(0, 64, dtype=torch.bfloat16), packed, *empty).shape == (0, 64)


def test_twin_is_close_to_unquantized_experts():
    w13, w2 = _experts(4, 160, 200)
    x = _x(17, 200).float()
    weights, ids = _routing(17, 2, 0, 4)
    twin = reference.fused_moe_fp8(x, *reference.prepack_experts_fp8_from(w13, w2), weights, ids)
    exact = reference.fused_moe(x, w13.float(), w2.float(), weights, ids)
    assert ((twin - exact).norm() / exact.norm()).item() < 0.1


def test_lists_are_consumed_and_pack_as_the_stack():
    w13, w2, s13, s2 = _fp8_experts(3, 40, 50)
    lists = [list(t.unbind(0)) for t in (w13, w2, s13, s2)]
    from_lists = ops.prepack_experts_fp8(*lists)
    assert all(entry is None for entries in lists for entry in entries)
    stacked = ops.prepack_experts_fp8(w13, w2, s13, s2)
    for got, want, (w, s) in zip(from_lists, stacked, ((w13, s13), (w2, s2)), strict=True):
        assert torch.equal(got.packed, want.packed) and got.shape == want.shape
        unpacked, scale = got.unpack()
        assert torch.equal(unpacked.view(torch.uint8), w.view(torch.uint8))
        assert torch.equal(scale, s)
    b13, b2 = _experts(3, 40, 50)
    parts = [list(b13.unbind(0)), list(b2.unbind(0))]
    quantized = ops.prepack_experts_fp8_from(*parts)
    assert all(entry is None for entries in parts for entry in entries)
    twin13, twin2 = reference.prepack_experts_fp8_from(b13, b2)
    for got, (w, s) in zip(quantized, (twin13, twin2), strict=True):
        unpacked, scale = got.unpack()
        assert torch.equal(unpacked.view(torch.uint8), w.view(torch.uint8))
        assert torch.equal(scale, s)


def test_fallback_without_native_is_the_twin():
    w13, w2 = _experts(3, 32, 48)
    packed = ops.prepack_experts_fp8_from(w13, w2)
    x = _x(6, 48)
    weights, ids = _routing(6, 2, 0, 3)
    twin = reference.fused_moe_fp8(x, packed[0].unpack(), packed[1].unpack(), weights, ids)
    ops.set_native_enabled(False)
    try:
        assert torch.equal(ops.fused_moe_fp8(x, *packed, weights, ids), twin)
    finally:
        ops.set_native_enabled(True)
    # fp32 activations (the whole-model tests) take the twin too.
    twin32 = reference.fused_moe_fp8(x.float(), *(p.unpack() for p in packed), weights, ids)
    assert torch.equal(ops.fused_moe_fp8(x.float(), *packed, weights, ids), twin32)


def test_bad_inputs_raise():
    w13, w2, s13, s2 = _fp8_experts(2, 40, 64)
    p13, p2 = ops.prepack_experts_fp8(w13, w2, s13, s2)
    weights, ids = _routing(3, 2, 0, 2)
    with pytest.raises(ValueError, match="hidden"):
        ops.fused_moe_fp8(_x(3, 63), p13, p2, weights, ids)
    with pytest.raises(ValueError, match="do not match"):
        ops.fused_moe_fp8(_x(4, 64), p13, p2, weights, ids)
    with pytest.raises(ValueError, match="does not match"):
        ops.fused_moe_fp8(_x(3, 64), p13, p13, weights, ids)
    with pytest.raises(TypeError, match="prepack_experts_fp8"):
        ops.fused_moe_fp8(_x(3, 64), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        ops.prepack_experts_fp8(w13.float(), w2, s13, s2)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        ops.prepack_experts_fp8(w13, w2[:, :, :31], s13, s2)
    with pytest.raises(ValueError, match="scales must be"):
        ops.prepack_experts_fp8(w13, w2, s13[:, :1], s2)
    with pytest.raises(ValueError, match="non-finite"):
        ops.prepack_experts_fp8(w13, w2, s13, s2 * float("inf"))
    nan = w13.clone()
    nan.view(torch.uint8)[0, 0, 0] = 0x7F
    with pytest.raises(ValueError, match="NaN"):
        ops.prepack_experts_fp8(nan, w2, s13, s2)
    with pytest.raises(ValueError, match="entries"):
        ops.prepack_experts_fp8(w13, w2[:1], s13, s2)
    with pytest.raises(ValueError, match="bf16 / fp32"):
        ops.prepack_experts_fp8_from(w13, w2)


def test_binding_checks_sizes():
    """A wrapper mistake (a tensor smaller than the sizes say) is an error, not a read past it."""
    w13, w2 = _experts(2, 32, 64)
    p13, p2 = ops.prepack_experts_fp8_from(w13, w2)
    x, out = _x(3, 64), torch.empty(3, 64, dtype=torch.bfloat16)
    weights, ids = _routing(3, 2, 0, 2)
    arg = _moe_fp8_ops._arg
    tags = _moe_fp8_ops.DTYPE_TAGS
    with pytest.raises(ValueError, match="w2 holds"):
        ops._moe_fp8_ops._C.fused_moe_fp8(
            arg(x, tags[torch.bfloat16]),
            3,
            64,
            32,
            arg(p13.packed, tags[FP8]),
            arg(p13.scale_inv, tags[torch.float32]),
            arg(p2.packed[:1], tags[FP8]),
            arg(p2.scale_inv, tags[torch.float32]),
            2,
            32,
            64,
            arg(weights, tags[torch.float32]),
            arg(ids, tags[torch.int32]),
            2,
            0,
            arg(out, tags[torch.bfloat16]),
        )
