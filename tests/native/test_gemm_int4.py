"""INT4 W4A8 linear (native/csrc/gemm_int4.cpp) against its twin `reference_int4.linear_int4`, the
twin against the float product of its own dequantized weights, and the int4 quantizer's rule.

Tolerances:
- kernel vs twin: the integer group sums are exact in both; the kernel adds the scaled group terms
  in fp32 (one FMA per group), the twin in float64 with one final rounding. fp32 outputs agree
  within FP32_TOL of the output's largest magnitude (measured: <= 2.4e-7 on every ISA path), bf16
  outputs within that plus one bf16 rounding (2^-8 relative).
- kernel on any ISA path vs the best path: EXACT (the same integers, the same FMAs in the same
  order).
- twin vs x @ dequantize(w).T in float64: only the activations are rounded (per token, to
  a_scale / 2 at most per element), so |error[m, n]| <= a_scale[m] / 2 * sum_k |w[n, k]|.
"""

import pytest
import torch
from test_gemm_int8 import PORTABLE_MAX_MACS, _weight, _x

from native import _C, _int4_ops, ops, reference, reference_int4

FP32_TOL = 1e-5
SHAPES = [(1, 8), (16, 64), (33, 100), (130, 1030), (257, 520)]  # (N, K): ragged blocks, groups
GROUPS = [32, 64]


def _check_against_twin(x: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
    packed = ops.prepack_linear_int4(w, group)
    assert isinstance(packed, _int4_ops.PackedLinearInt4)
    y = ops.linear_int4(x, packed)
    x2 = x.reshape(-1, x.shape[-1])
    twin = reference_int4.linear_int4(x2.float(), reference_int4.prepack_linear_int4(w, group))
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    got = y.reshape(twin.shape).float()
    scale = twin.abs().max().item() if twin.numel() else 0.0
    slack = FP32_TOL * scale + (twin.abs() * 2**-8 if x.dtype == torch.bfloat16 else 0.0)
    assert ((got - twin).abs() <= slack).all(), (got - twin).abs().max()
    return y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("m", [1, 3, 6, 7, 17, 300])
@pytest.mark.parametrize("n,k", SHAPES)
def test_linear_int4_matches_twin(isa, m, n, k, group, dtype):
    if isa == "portable" and m * n * k > PORTABLE_MAX_MACS:
        pytest.skip("covered by the smaller sizes on the scalar path")
    _check_against_twin(_x(m, k, dtype), _weight(n, k), group)


def test_linear_int4_many_chunks(isa):
    # M over two row chunks (240), K over the 4096-input K chunk, N ending in a partial panel.
    if isa == "portable":
        pytest.skip("same code as the small cases; too slow for the scalar path")
    _check_against_twin(_x(487, 4200), _weight(104, 4200), 64)


@pytest.mark.parametrize("m", [1, 5, 40])
def test_every_isa_path_gives_the_same_bits(isa, m):
    w, x = _weight(70, 300), _x(m, 300, torch.float32)
    packed = ops.prepack_linear_int4(w, 32)
    got = ops.linear_int4(x, packed)
    best = _C.set_active_isa(99)  # capped at what the CPU has
    assert torch.equal(got, ops.linear_int4(x, packed)), best


def test_integer_sums_are_exact(isa):
    # Weights in [-8, 7] with a -8 in every group quantize with scale exactly 1, and activations
    # with absmax 127 per row with scale 1: the outputs are the integer dot products themselves.
    # The extremes (15 * 127 per product, all of one sign) would saturate a 16-bit pair sum that
    # took 8-bit weights; nibbles against activations must not.
    gen = torch.Generator().manual_seed(3)
    m, n, k, group = 9, 40, 512, 64
    w = torch.randint(-8, 8, (n, k), generator=gen).float()
    w[:, ::group] = -8
    w[-1] = 7
    w[-1, ::group] = -8
    x = torch.randint(-127, 128, (m, k), generator=gen).float()
    x[:, 0] = 127
    x[-1] = -127
    y = ops.linear_int4(x, ops.prepack_linear_int4(w, group))
    assert torch.equal(y.double(), x.double() @ w.double().T)


@pytest.mark.parametrize("group", GROUPS)
def test_twin_within_the_activation_rounding(group):
    w, x = _weight(90, 700), _x(11, 700, torch.float32)
    quantized = reference_int4.quantize_weight_int4(w, group)
    got = reference_int4.linear_int4(x, quantized).double()
    exact = x.double() @ reference_int4.dequantize_int4(quantized).double().T
    _, a_scale = reference.quantize_per_token_int8(x)
    bound = a_scale.double()[:, None] / 2 * reference_int4.dequantize_int4(quantized).abs().sum(1)
    assert ((got - exact).abs() <= bound * (1 + 1e-6) + 1e-6).all()
    assert (got - exact).abs().max() > 0  # the activations really are rounded


@pytest.mark.parametrize("group", [8, 32, 64, 256])
def test_quantizer_rule(group):
    w = _weight(20, 3 * group + 5, seed=4)
    w[0, :group] = 0  # an all-zero group
    q, scale, g = reference_int4.quantize_weight_int4(w, group)
    assert g == group and q.dtype == torch.int8 and q.shape == w.shape
    assert scale.shape == (20, 4) and int(q.min()) >= -8 and int(q.max()) <= 7
    assert scale[0, 0] == 0 and not q[0, :group].any()
    # Each group's value of largest magnitude maps to exactly -8; every other value is within
    # half a step, except those clamped from +8 to 7 (a whole step at most).
    padded = torch.nn.functional.pad(w, (0, 4 * group - w.shape[1])).view(20, 4, group)
    extreme = padded.gather(-1, padded.abs().argmax(-1, keepdim=True)).squeeze(-1)
    torch.testing.assert_close(scale, extreme / -8.0, rtol=0, atol=0)
    error = (reference_int4.dequantize_int4(reference_int4.Int4Weight(q, scale, g)) - w).abs()
    step = scale.abs().repeat_interleave(group, 1)[:, : w.shape[1]]
    assert (error <= step * (0.5 + 1e-6)).logical_or(q == 7).all()
    assert (error <= step * (1 + 1e-6)).all()


def test_packed_layout_by_hand():
    w = _weight(40, 72, seed=5)
    packed = ops.prepack_linear_int4(w, 8)
    q, scale, _ = reference_int4.quantize_weight_int4(w, 8)
    for n, k in [(0, 0), (17, 13), (39, 71), (16, 4), (5, 68)]:
        byte = int(packed.packed[n // 16, k // 8, n % 16, k % 4])
        nibble = byte & 0x0F if k % 8 < 4 else byte >> 4
        assert nibble - 8 == int(q[n, k])
        assert packed.scales[n // 16, k // 8, n % 16] == scale[n, k // 8]
    assert not packed.scales[2, :, 8:].any()  # columns past N have scale 0
    unpacked = packed.unpack()
    assert torch.equal(unpacked.qweight, q) and torch.equal(unpacked.scale, scale)


def test_fallbacks_and_bad_inputs(isa):
    w = _weight(24, 40)
    packed = ops.prepack_linear_int4(w, 32)
    x = _x(4, 40)
    twin = reference_int4.linear_int4(x, packed.unpack())
    ops.set_native_enabled(False)
    try:
        assert torch.equal(ops.linear_int4(x, packed), twin)
        assert isinstance(ops.prepack_linear_int4(w, 32), reference_int4.Int4Weight)
    finally:
        ops.set_native_enabled(True)
    assert ops.linear_int4(x[:0], packed).shape == (0, 24)
    assert ops.linear_int4(x.view(2, 2, 40), packed).shape == (2, 2, 24)
    with pytest.raises(ValueError, match="group_size"):
        ops.prepack_linear_int4(w, 12)
    with pytest.raises(ValueError, match="group_size"):
        ops.prepack_linear_int4(w, 512)
    with pytest.raises(ValueError, match="K = 40"):
        ops.linear_int4(_x(4, 41), packed)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        ops.linear_int4(x.half(), packed)
    with pytest.raises(ValueError, match="float"):
        ops.prepack_linear_int4(w.to(torch.int8), 32)
    y = torch.empty(4, 24, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="group"):  # the binding checks what the wrapper hands it
        _C.linear_int4(x.data_ptr(), 1, 4, 40, 40, *packed.kernel_args[:5], 20, y.data_ptr(), 1, 24)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,group", [(1, 8, 8), (33, 100, 32), (130, 1030, 64), (17, 256, 256)])
def test_native_quantize_pack_gives_the_twins_bytes(dtype, n, k, group):
    """quantize_pack_int4 (one native pass) against the twin's quantize_weight_int4 + pack_int4
    on the same weights, bit for bit: random values plus the cases the rule must settle the same
    way: an all-zero group (and a -0.0), two extremes of one magnitude and opposite signs (the
    first one is the group's), and values exactly half a step from a level (half to even)."""
    if not ops.native_available():
        pytest.skip("native extension not built")
    w = _weight(n, k, seed=9).to(dtype)
    w[0, : min(k, group)] = 0.0
    w[0, 0] = -0.0
    if n > 2 and k >= 8:
        w[1, :8] = torch.tensor([0.5, -0.5, 0.25, -0.25, 0.1875, 0.3125, -0.0625, 0.0])
        w[2, :8] = torch.tensor([-1.0, 1.0, 0.1875, -0.1875, 0.4375, 0.5625, 0.6875, 0.8125])
    native = _int4_ops.quantize_pack_int4(w, group)
    ops.set_native_enabled(False)
    try:
        twin = _int4_ops.quantize_pack_int4(w, group)
    finally:
        ops.set_native_enabled(True)
    assert torch.equal(native[0], twin[0]) and torch.equal(native[1], twin[1])
    quantized = reference_int4.quantize_weight_int4(w, group)
    assert torch.equal(_int4_ops.unpack_int4(*native, n, k, group).qweight, quantized.qweight)
