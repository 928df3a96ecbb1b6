"""INT8 W8A8 fused MoE (native/csrc/moe_int8.cpp) against its twin `reference.fused_moe_int8`, on
every ISA level, and the twin against the bf16 `reference.fused_moe` within the int8 error.

Kernel vs twin: the integers (quantized x, int32 sums, quantized h) are the same by
construction; the fp32 silu uses vec::exp16 (std::exp on the portable path) in the kernel and
torch.exp in the twin, which may differ in the last bit and so, rarely, move one element of h
across a rounding boundary of its quantization. So outputs are compared within a bf16 ulp-scale tolerance (TWIN_TOL) and almost
all of them must be bit-equal (MIN_EQUAL)."""

import pytest
import torch
from test_moe import _experts, _routing  # the bf16 suite's generators

from native import _moe_int8_ops, ops, reference
from native._tags import tags

TWIN_TOL = {"rtol": 1e-2, "atol": 1e-2}
MIN_EQUAL = 0.98
# Twin vs the bf16 MoE: two per-row int8 roundings of x and h (~0.4% each of the row's absmax)
# plus the weights' per-channel rounding: a few percent of the output's norm.
INT8_REL_ERROR = 0.05


def _check(x, w13, w2, weights, ids, expert_offset=0):
    p13, p2 = ops.prepack_experts_int8(w13, w2)
    assert isinstance(p13, _moe_int8_ops.PackedExpertsInt8)
    out = ops.fused_moe_int8(x, p13, p2, weights, ids, expert_offset)
    r13, r2 = reference.prepack_experts_int8(w13, w2)
    expected = reference.fused_moe_int8(x, r13, r2, weights, ids, expert_offset)
    assert out.shape == expected.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), **TWIN_TOL)
    if out.numel():
        assert (out == expected).float().mean().item() >= MIN_EQUAL
    return out, expected


@pytest.mark.parametrize(
    "num_tokens,hidden,inter,num_experts,top_k",
    [
        (1, 64, 32, 4, 2),  # decode
        (3, 70, 45, 6, 3),  # decode, D and I off the 16-column block and the 4-group
        (17, 33, 17, 3, 2),  # prefill, a ragged 6-row tile
        (64, 96, 70, 16, 4),  # prefill, 2 panels of D, I off the block
    ],
)
def test_fused_moe_int8_matches_twin(isa, num_tokens, hidden, inter, num_experts, top_k):
    w13, w2 = _experts(num_experts, inter, hidden)
    x = torch.randn(num_tokens, hidden).to(torch.bfloat16)
    weights, ids = _routing(num_tokens, top_k, 0, num_experts)
    _check(x, w13, w2, weights, ids)


def test_prefill_sized_batch(isa):
    if isa == "portable":
        pytest.skip("same code as the small cases; too slow for the scalar path")
    w13, w2 = _experts(8, 160, 256)
    x = torch.randn(300, 256).to(torch.bfloat16)
    weights, ids = _routing(300, 2, 0, 3)  # skewed: experts 0-2 take most rows, 7 none
    ids[:40, 1] = 5
    _check(x, w13, w2, weights, ids)


@pytest.mark.parametrize("expert_offset", [0, 4])
def test_expert_parallel_slice(isa, expert_offset):
    # 12 global experts, this rank holds 4 of them: other ids contribute nothing.
    w13, w2 = _experts(4, 40, 64)
    x = torch.randn(23, 64).to(torch.bfloat16)
    weights, ids = _routing(23, 3, 0, 12)
    out, _ = _check(x, w13, w2, weights, ids, expert_offset)
    local = ((ids >= expert_offset) & (ids < expert_offset + 4)).any(1)
    assert torch.count_nonzero(out[~local]) == 0 and torch.count_nonzero(out[local]) > 0


def test_duplicate_expert_and_unrouted_tokens(isa):
    w13, w2 = _experts(3, 32, 64)
    x = torch.randn(4, 64).to(torch.bfloat16)
    weights = torch.tensor([[0.5, 0.25], [1.0, 0.0], [0.3, 0.7], [0.2, 0.2]])
    ids = torch.tensor([[1, 1], [9, 9], [0, 2], [-1, 2]], dtype=torch.int32)
    out, _ = _check(x, w13, w2, weights, ids)
    assert torch.count_nonzero(out[1]) == 0  # token 1 routed only to experts held elsewhere
    # Token 0 routed twice to expert 1 counts twice: as once with the summed weight 0.75.
    p13, p2 = ops.prepack_experts_int8(w13, w2)
    once = ops.fused_moe_int8(x[:1], p13, p2, torch.tensor([[0.75]]), ids[:1, :1])
    torch.testing.assert_close(out[0].float(), once[0].float(), **TWIN_TOL)


def test_empty_and_all_remote(isa):
    w13, w2 = _experts(2, 32, 64)
    empty = torch.empty(0, 64, dtype=torch.bfloat16)
    weights, ids = _routing(0, 2, 0, 2)
    assert _check(empty, w13, w2, weights, ids)[0].shape == (0, 64)
    x = torch.randn(5, 64).to(torch.bfloat16)
    weights, ids = _routing(5, 2, 10, 20)
    assert torch.count_nonzero(_check(x, w13, w2, weights, ids)[0]) == 0


@pytest.mark.parametrize("num_tokens", [1, 17])
def test_twin_close_to_bf16_moe(num_tokens):
    w13, w2 = _experts(6, 96, 128)
    x = torch.randn(num_tokens, 128).to(torch.bfloat16)
    weights, ids = _routing(num_tokens, 3, 0, 6)
    r13, r2 = reference.prepack_experts_int8(w13, w2)
    got = reference.fused_moe_int8(x, r13, r2, weights, ids).float()
    want = reference.fused_moe(x, w13, w2, weights, ids).float()
    assert torch.linalg.norm(got - want) <= INT8_REL_ERROR * torch.linalg.norm(want)


def test_packing_and_fallbacks(isa):
    w13, w2 = _experts(3, 40, 50)  # off the 16-column block, K not a multiple of 4
    p13, p2 = ops.prepack_experts_int8(w13, w2)
    r13, r2 = reference.prepack_experts_int8(w13, w2)
    for packed, ref in ((p13, r13), (p2, r2)):
        unpacked = packed.unpack()
        assert torch.equal(unpacked.qweight, ref.qweight) and torch.equal(unpacked.scale, ref.scale)
    x = torch.randn(6, 50).to(torch.bfloat16)
    weights, ids = _routing(6, 2, 0, 3)
    expected = reference.fused_moe_int8(x, r13, r2, weights, ids)
    ops.set_native_enabled(False)
    try:
        assert torch.equal(ops.fused_moe_int8(x, p13, p2, weights, ids), expected)
        assert not isinstance(ops.prepack_experts_int8(w13, w2)[0], _moe_int8_ops.PackedExpertsInt8)
    finally:
        ops.set_native_enabled(True)
    assert torch.equal(ops.fused_moe_int8(x, r13, r2, weights, ids), expected)


def test_experts_given_one_by_one_pack_as_the_stack_and_are_consumed():
    w13, w2 = _experts(3, 40, 50)
    parts13, parts2 = list(w13.unbind(0)), list(w2.unbind(0))
    p13, p2 = ops.prepack_experts_int8(parts13, parts2)
    assert all(p is None for p in (*parts13, *parts2))
    s13, s2 = ops.prepack_experts_int8(w13, w2)
    for got, want in ((p13, s13), (p2, s2)):
        assert torch.equal(got.packed, want.packed) and torch.equal(got.comp, want.comp)
        assert torch.equal(got.scale, want.scale) and got.shape == want.shape


def test_rejects_bad_inputs(isa):
    w13, w2 = _experts(2, 32, 64)
    p13, p2 = ops.prepack_experts_int8(w13, w2)
    weights, ids = _routing(3, 2, 0, 2)
    x = torch.randn(3, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="hidden"):
        ops.fused_moe_int8(torch.randn(3, 63).to(torch.bfloat16), p13, p2, weights, ids)
    with pytest.raises(ValueError, match="do not match"):
        ops.fused_moe_int8(x, p13, p2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="both"):
        ops.fused_moe_int8(x, p13, reference.prepack_experts_int8(w13, w2)[1], weights, ids)
    with pytest.raises(ValueError, match="disagree"):
        ops.prepack_experts_int8(w13, w2[:, :, :31])
    with pytest.raises(ValueError, match="one shape"):
        ops.prepack_experts_int8([w13[0], w13[1][:, :7]], list(w2.unbind(0)))
    with pytest.raises(ValueError, match="float"):
        ops.prepack_experts_int8(w13.to(torch.int8), w2.to(torch.int8))
    from native import _C

    # A wrapper mistake (comp handed over as the w13 scale) is an error, not a wrong read.
    bad = (x, p13.packed, p13.comp, p13.comp, p2.packed, p2.scale, p2.comp, weights, ids, x)
    with pytest.raises(ValueError, match="w13 scale"):
        _C.fused_moe_int8(
            x.data_ptr(),
            3,
            64,
            *(t.data_ptr() for t in bad[1:7]),
            2,
            32,
            64,
            weights.data_ptr(),
            ids.data_ptr(),
            2,
            0,
            x.data_ptr(),
            64,
            tags(*bad),
        )
