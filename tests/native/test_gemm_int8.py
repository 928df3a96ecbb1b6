"""INT8 W8A8 linear (native/csrc/gemm_int8.cpp) against its twin `reference.linear_int8`, and the
twin against the float product.

Tolerances: kernel vs twin is EXACT (torch.equal) on every ISA level, for bf16 and fp32 outputs:
both quantize the activations with the same fp32 operations, sum the same int8 products in
int32 (exact whatever the order) and dequantize with the same two fp32 multiplies, then round
once. The twin vs `x @ w.T` in float is within the worst-case int8 error stated in
`_quantization_bound`, plus one bf16 rounding of the output."""

import pytest
import torch

from native import _quant_ops, ops, reference

SHAPES = [(1, 1), (16, 4), (33, 17), (100, 130), (257, 1030)]  # (N, K): off the 16 / 4 blocks
PORTABLE_MAX_MACS = 20_000_000  # keeps the scalar path to seconds


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) / max(k, 1) ** 0.5


def _x(m: int, k: int, dtype=torch.bfloat16, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(dtype)


def _check_against_twin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    packed = ops.prepack_linear_int8(w)
    assert isinstance(packed, _quant_ops.PackedLinearInt8)
    y = ops.linear_int8(x, packed)
    expected = reference.linear_int8(x.reshape(-1, x.shape[-1]), reference.prepack_linear_int8(w))
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    assert torch.equal(y.reshape(expected.shape), expected)
    return y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 6, 7, 17, 512])
@pytest.mark.parametrize("n,k", SHAPES)
def test_linear_int8_equals_twin(isa, m, n, k, dtype):
    if isa == "portable" and m * n * k > PORTABLE_MAX_MACS:
        pytest.skip("covered by the smaller sizes on the scalar path")
    _check_against_twin(_x(m, k, dtype), _weight(n, k))


def test_linear_int8_many_chunks(isa):
    # M over two row chunks (240), K over the 2048-input K chunk, N ending in a partial panel.
    if isa == "portable":
        pytest.skip("same code as the small cases; too slow for the scalar path")
    _check_against_twin(_x(487, 2100), _weight(104, 2100))


def test_integer_sums_are_exact(isa):
    # Integer-valued operands with absmax 127 quantize with scale exactly 1, so the fp32 outputs
    # are the int32 sums themselves. The last row and column are at the extremes (all 127 vs all
    # -127): a path that saturates 16-bit pair sums (vpmaddubsw) would fail here.
    gen = torch.Generator().manual_seed(3)
    m, n, k = 9, 40, 1030
    xq = torch.randint(-126, 127, (m, k), generator=gen)
    wq = torch.randint(-126, 127, (n, k), generator=gen)
    xq[:, 0], wq[:, 0] = 127, 127
    xq[-1], wq[-1] = 127, -127
    packed = ops.prepack_linear_int8(wq.float())
    y = ops.linear_int8(xq.float(), packed)
    sums = xq.int() @ wq.int().T
    assert int(sums.abs().max()) == 127 * 127 * k  # exactly representable in fp32 (< 2^24)
    assert torch.equal(y, sums.float())


def test_activation_ties_round_half_to_even(isa):
    # A row with absmax 127 quantizes with 127 / absmax = 1, so q = round(x) and the halves
    # -126.5 ... 126.5 are all ties. With the weight 127 * identity (scale 1), y = 127 * q exactly.
    halves = torch.arange(-126.5, 127.0, 1.0)
    x = torch.cat((torch.tensor([127.0]), halves))[None]
    k = x.shape[1]
    w = 127 * torch.eye(k)
    for dtype in (torch.float32, torch.bfloat16):  # bf16 holds every half below 128 exactly
        y = ops.linear_int8(x.to(dtype), ops.prepack_linear_int8(w)).float()
        q = torch.round(x)  # torch.round: half to even
        assert torch.equal(y, (127 * q).to(dtype).float())
        assert torch.equal(q[0, 1:4], torch.tensor([-126.0, -126.0, -124.0]))


def _quantization_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Worst case of |linear_int8 - x @ w.T| before the output rounding: with per-row steps
    s_x = absmax(x[m]) / 127, s_w = absmax(w[n]) / 127 and rounding errors of at most half a step,
    sum_k |x w - (x + e_x)(w + e_w)| <= s_x/2 |w[n]|_1 + s_w/2 |x[m]|_1 + K s_x s_w / 4."""
    xf, wf = x.float(), w.float()
    s_x = xf.abs().amax(1, keepdim=True) / 127
    s_w = wf.abs().amax(1)[None, :] / 127
    w_l1 = wf.abs().sum(1)[None, :]
    x_l1 = xf.abs().sum(1, keepdim=True)
    return s_x / 2 * w_l1 + s_w / 2 * x_l1 + x.shape[1] * s_x * s_w / 4


@pytest.mark.parametrize("m,n,k", [(1, 257, 1030), (17, 100, 130), (64, 96, 2048)])
def test_twin_within_int8_error_of_float(m, n, k):
    x, w = _x(m, k), _weight(n, k)
    y = reference.linear_int8(x, reference.prepack_linear_int8(w)).float()
    exact = x.float() @ w.T
    bound = _quantization_bound(x, w) + exact.abs() * 2**-8 + 1e-6  # + one bf16 rounding
    assert bool(((y - exact).abs() <= bound).all())
    # Typical error is far below the worst case: ~1 % of the output's scale for Gaussian data.
    assert float((y - exact).norm() / exact.norm()) < 0.03


def test_quantizers():
    x = torch.tensor([[0.5, -2.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1e-35, -1e-35, 0.0, 0.0]])
    q, scale = reference.quantize_per_token_int8(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q[0].tolist() == [32, -127, 64, 0]  # 0.5 * 63.5 = 31.75 -> 32; 63.5 -> 64 (even)
    assert scale[0] == pytest.approx(2.0 / 127)
    # All-zero and vanishing rows quantize to zeros with scale 0 (no inf / NaN).
    assert torch.count_nonzero(q[1:]) == 0 and torch.count_nonzero(scale[1:]) == 0
    w = _weight(20, 50)
    qw, w_scale = reference.quantize_weight_int8(w)
    assert int(qw.abs().amax(1).min()) == 127  # every channel uses the full range
    assert bool(((qw.float() * w_scale[:, None] - w).abs() <= w_scale[:, None] / 2 + 1e-7).all())


def test_pack_layout_and_roundtrip():
    w = _weight(45, 33)
    packed = ops.prepack_linear_int8(w)
    if not isinstance(packed, _quant_ops.PackedLinearInt8):
        pytest.skip("native extension not available")
    qw, w_scale = reference.quantize_weight_int8(w)
    assert packed.packed.shape == (3, 9, 16, 4) and packed.packed.dtype == torch.int8
    # Element (g, j, t) of block b is Wq[16 b + j][4 g + t].
    assert packed.packed[2, 8, 3, 0] == qw[35, 32] and packed.packed[1, 2, 5, 1] == qw[21, 9]
    assert torch.equal(packed.packed[2, 8, 13:], torch.zeros(3, 4, dtype=torch.int8))  # N pad
    assert torch.equal(packed.packed[0, 8, :, 1:], torch.zeros(16, 3, dtype=torch.int8))  # K pad
    assert torch.equal(packed.comp[:45], 128 * qw.int().sum(1)) and packed.comp.shape == (48,)
    unpacked = packed.unpack()
    assert torch.equal(unpacked.qweight, qw) and torch.equal(unpacked.scale, w_scale)


def test_zero_rows_strided_batched_and_empty(isa):
    w = _weight(70, 48)
    x = _x(9, 48)
    x[4] = 0
    y = _check_against_twin(x, w)
    assert torch.count_nonzero(y[4]) == 0
    wide = _x(9, 101)
    _check_against_twin(wide[:, 3:51], w)  # row stride 101, offset 3: read in place
    _check_against_twin(_x(10, 48).view(2, 5, 48), w)
    _check_against_twin(_x(1, 48).expand(4, 48), w)  # broadcast rows (stride 0)
    packed = ops.prepack_linear_int8(w)
    assert ops.linear_int8(torch.empty(0, 48, dtype=torch.bfloat16), packed).shape == (0, 70)
    no_inputs = ops.prepack_linear_int8(torch.zeros(40, 0))
    for m in (1, 9):  # GEMV and GEMM paths: an empty sum is zero
        y = ops.linear_int8(torch.empty(m, 0, dtype=torch.bfloat16), no_inputs)
        assert y.shape == (m, 40) and torch.count_nonzero(y) == 0


def test_bad_inputs_raise(isa):
    w = _weight(16, 32)
    packed = ops.prepack_linear_int8(w)
    for bad in (_x(2, 32).half(), _x(2, 32).to(torch.int8)):
        with pytest.raises(TypeError, match="bfloat16 or float32"):
            ops.linear_int8(bad, packed)
    with pytest.raises(ValueError, match="K = 32"):
        ops.linear_int8(_x(2, 31), packed)
    with pytest.raises(ValueError, match="contiguous"):
        ops.linear_int8(_x(32, 5).t(), packed)
    with pytest.raises(ValueError, match="float"):
        ops.prepack_linear_int8(torch.ones(4, 4, dtype=torch.int8))
    with pytest.raises(ValueError, match="float"):
        ops.prepack_linear_int8(torch.ones(4))


def test_binding_checks_dtypes_and_sizes():
    if not ops.native_available():
        pytest.skip("native extension not built")
    from native import _C

    packed = ops.prepack_linear_int8(_weight(16, 32))
    x, y = _x(2, 32), torch.empty(2, 16, dtype=torch.bfloat16)
    good = dict(x_tag=1, w_tag=5, scale_tag=0, comp_tag=3, y_tag=1, k_groups=8, ldx=32)

    def call(**changes):
        a = {**good, **changes}
        _C.linear_int8(
            x.data_ptr(),
            a["x_tag"],
            2,
            32,
            a["ldx"],
            packed.packed.data_ptr(),
            a["w_tag"],
            packed.scale.data_ptr(),
            a["scale_tag"],
            packed.comp.data_ptr(),
            a["comp_tag"],
            16,
            a["k_groups"],
            y.data_ptr(),
            a["y_tag"],
            16,
        )

    call()
    for change, message in (
        ({"x_tag": 3}, "x must be bfloat16 or float32"),
        # the bindings' one dtype rule (common.h): the argument, what it is, what it must be
        ({"y_tag": 0}, r"y \(x's dtype\) is float32, expected bfloat16"),
        ({"w_tag": 1}, "packed weight is bfloat16, expected int8"),
        ({"scale_tag": 1}, "w_scale is bfloat16, expected float32"),
        ({"comp_tag": 0}, "comp is float32, expected int32"),
    ):
        with pytest.raises(ValueError, match=f"^linear_int8: {message}$"):
            call(**change)
    for change in ({"k_groups": 9}, {"ldx": 31}):
        with pytest.raises(ValueError, match="sizes"):
            call(**change)


def test_fallbacks_equal_twin():
    w, x = _weight(50, 40), _x(3, 40)
    expected = reference.linear_int8(x, reference.prepack_linear_int8(w))
    packed = ops.prepack_linear_int8(w)
    ops.set_native_enabled(False)
    try:
        plain = ops.prepack_linear_int8(w)
        assert isinstance(plain, reference.Int8Weight)
        assert torch.equal(ops.linear_int8(x, plain), expected)
        assert torch.equal(ops.linear_int8(x, packed), expected)  # packed before the switch
    finally:
        ops.set_native_enabled(True)
