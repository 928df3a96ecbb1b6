"""INT4 W4A8 fused MoE (native/csrc/moe_int4.cpp) against its twin `reference_int4.fused_moe_int4`,
on every ISA level, and the twin against the bf16 `reference.fused_moe` of its own dequantized
weights within the activation rounding.

Kernel vs twin: the integers (quantized x, group sums) are the same by construction; the fp32
group accumulation (kernel: FMAs in group order; twin: float64, rounded once) and the silu's exp
(vec::exp16 vs torch.exp) differ in the last bits, which may, rarely, move one element of h
across a rounding boundary of its quantization. So outputs are compared within TWIN_TOL and
almost all of them must be bit-equal (MIN_EQUAL), as for the int8 MoE."""

import pytest
import torch
from test_moe import _experts, _routing  # the bf16 suite's generators

from native import _C, _moe_int4_ops, ops, reference, reference_int4
from native._tags import tags

TWIN_TOL = {"rtol": 1e-2, "atol": 1e-2}
MIN_EQUAL = 0.98
# Twin vs the bf16 MoE on the same (dequantized) weights: two per-row int8 roundings of x and h.
ACTIVATION_REL_ERROR = 0.03


def _act(num_tokens: int, hidden: int) -> torch.Tensor:
    """Seeded activations: every run checks the same inputs (no test rests on the RNG's state)."""
    gen = torch.Generator().manual_seed(num_tokens * 1000 + hidden)
    return torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)


def _check(x, w13, w2, weights, ids, expert_offset=0, group=32):
    p13, p2 = ops.prepack_experts_int4(w13, w2, group)
    assert isinstance(p13, _moe_int4_ops.PackedExpertsInt4)
    out = ops.fused_moe_int4(x, p13, p2, weights, ids, expert_offset)
    r13, r2 = reference_int4.prepack_experts_int4(w13, w2, group)
    expected = reference_int4.fused_moe_int4(x, r13, r2, weights, ids, expert_offset)
    assert out.shape == expected.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), **TWIN_TOL)
    if out.numel():
        assert (out == expected).float().mean().item() >= MIN_EQUAL
    return out, expected


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize(
    "num_tokens,hidden,inter,num_experts,top_k",
    [
        (1, 64, 32, 4, 2),  # decode
        (3, 70, 45, 6, 3),  # decode, D and I off the 16-column block and the group
        (17, 33, 17, 3, 2),  # prefill, a ragged 6-row tile, K under one group
        (64, 96, 70, 16, 4),  # prefill, 2 panels of D, I off the block
    ],
)
def test_fused_moe_int4_matches_twin(isa, num_tokens, hidden, inter, num_experts, top_k, group):
    w13, w2 = _experts(num_experts, inter, hidden)
    x = _act(num_tokens, hidden)
    weights, ids = _routing(num_tokens, top_k, 0, num_experts)
    _check(x, w13, w2, weights, ids, group=group)


def test_prefill_sized_batch(isa):
    if isa == "portable":
        pytest.skip("same code as the small cases; too slow for the scalar path")
    w13, w2 = _experts(8, 160, 256)
    x = _act(300, 256)
    weights, ids = _routing(300, 2, 0, 3)  # skewed: experts 0-2 take most rows, 7 none
    ids[:40, 1] = 5
    _check(x, w13, w2, weights, ids, group=64)


def test_every_isa_path_gives_the_same_bits(isa):
    w13, w2 = _experts(5, 48, 80)
    x = _act(9, 80)
    weights, ids = _routing(9, 2, 0, 5)
    packed = ops.prepack_experts_int4(w13, w2, 16)
    got = ops.fused_moe_int4(x, *packed, weights, ids)
    _C.set_active_isa(99)  # the best this CPU has (the fixture restores the cap)
    assert torch.equal(got, ops.fused_moe_int4(x, *packed, weights, ids))


@pytest.mark.parametrize("expert_offset", [0, 4])
def test_expert_parallel_slice(isa, expert_offset):
    w13, w2 = _experts(4, 40, 64)
    x = _act(23, 64)
    weights, ids = _routing(23, 3, 0, 12)
    out, _ = _check(x, w13, w2, weights, ids, expert_offset)
    local = ((ids >= expert_offset) & (ids < expert_offset + 4)).any(1)
    assert torch.count_nonzero(out[~local]) == 0 and torch.count_nonzero(out[local]) > 0


def test_empty_and_all_remote(isa):
    w13, w2 = _experts(2, 32, 64)
    empty = torch.empty(0, 64, dtype=torch.bfloat16)
    weights, ids = _routing(0, 2, 0, 2)
    assert _check(empty, w13, w2, weights, ids)[0].shape == (0, 64)
    x = _act(5, 64)
    weights, ids = _routing(5, 2, 10, 20)
    assert torch.count_nonzero(_check(x, w13, w2, weights, ids)[0]) == 0


@pytest.mark.parametrize("num_tokens", [1, 17])
def test_twin_close_to_bf16_moe_of_its_weights(num_tokens):
    w13, w2 = _experts(6, 96, 128)
    x = _act(num_tokens, 128)
    weights, ids = _routing(num_tokens, 3, 0, 6)
    r13, r2 = reference_int4.prepack_experts_int4(w13, w2, 32)
    got = reference_int4.fused_moe_int4(x, r13, r2, weights, ids).float()
    d13, d2 = (reference_int4.dequantize_int4(w) for w in (r13, r2))
    want = reference.fused_moe(x.float(), d13, d2, weights, ids).float()
    assert torch.linalg.norm(got - want) <= ACTIVATION_REL_ERROR * torch.linalg.norm(want)
    assert torch.linalg.norm(got - want) > 0


def test_packing_fallbacks_and_one_by_one(isa):
    w13, w2 = _experts(3, 40, 50)
    p13, p2 = ops.prepack_experts_int4(w13, w2, 32)
    r13, r2 = reference_int4.prepack_experts_int4(w13, w2, 32)
    for packed, ref in ((p13, r13), (p2, r2)):
        unpacked = packed.unpack()
        assert torch.equal(unpacked.qweight, ref.qweight) and torch.equal(unpacked.scale, ref.scale)
    x = _act(6, 50)
    weights, ids = _routing(6, 2, 0, 3)
    expected = reference_int4.fused_moe_int4(x, r13, r2, weights, ids)
    ops.set_native_enabled(False)
    try:
        assert torch.equal(ops.fused_moe_int4(x, p13, p2, weights, ids), expected)
        assert isinstance(ops.prepack_experts_int4(w13, w2, 32)[0], reference_int4.Int4Weight)
    finally:
        ops.set_native_enabled(True)
    parts13, parts2 = list(w13.unbind(0)), list(w2.unbind(0))
    o13, o2 = ops.prepack_experts_int4(parts13, parts2, 32)
    assert all(p is None for p in (*parts13, *parts2))  # consumed one at a time
    for got, want in ((o13, p13), (o2, p2)):
        assert torch.equal(got.packed, want.packed) and torch.equal(got.scales, want.scales)


def test_rejects_bad_inputs(isa):
    w13, w2 = _experts(2, 32, 64)
    p13, p2 = ops.prepack_experts_int4(w13, w2, 32)
    weights, ids = _routing(3, 2, 0, 2)
    x = _act(3, 64)
    with pytest.raises(ValueError, match="hidden"):
        ops.fused_moe_int4(_act(3, 63), p13, p2, weights, ids)
    with pytest.raises(ValueError, match="both"):
        ops.fused_moe_int4(x, p13, reference_int4.prepack_experts_int4(w13, w2)[1], weights, ids)
    with pytest.raises(ValueError, match="does not match"):
        ops.fused_moe_int4(x, p13, ops.prepack_experts_int4(w13, w2, 64)[1], weights, ids)
    with pytest.raises(ValueError, match="disagree"):
        ops.prepack_experts_int4(w13, w2[:, :, :31])
    with pytest.raises(ValueError, match="group_size"):
        ops.prepack_experts_int4(w13, w2, 20)
    # A wrapper mistake (the scales handed over as the w13 bytes) is an error, not a wrong read.
    bad = (x, p13.scales, p13.scales, p2.packed, p2.scales, weights, ids, x)
    with pytest.raises(ValueError, match="w13"):
        _C.fused_moe_int4(
            x.data_ptr(), 3, 64, *(t.data_ptr() for t in bad[1:5]), 2, 32, 64, 32,
            weights.data_ptr(), ids.data_ptr(), 2, 0, x.data_ptr(), 64, tags(*bad),
        )  # fmt: skip
