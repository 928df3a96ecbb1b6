"""FP8 e4m3 weight-only linear (native/csrc/gemm_fp8.cpp) against its twin `reference.linear_fp8`,
on every ISA level (the `isa` fixture): the e4m3 -> bf16 conversion of every byte, the GEMV
(M <= 6) and GEMM (M > 6) paths at sizes off the 32-column block, the 128 x 128 scale block and the
k-pair, and the from-bf16 block quantizer's error bound.

Tolerances:
- byte decoding: exact (one-hot activations, power-of-two scale: every output is one e4m3 value).
- kernel vs twin: the kernel scales each 128-wide k block's fp32 sum, the twin each fp32 weight;
  both round to bf16 once. So |y - y_twin| <= 2^-7 |y_twin| (one bf16 ulp) + 2 (2K + 8) 2^-24 S,
  S = |x| @ |w|^T (fp32 summation-order and rounding error of two K-term sums, twice for the
  rounding that may follow it).
- quantizer: e4m3 rounds to nearest with 3 mantissa bits, |w_q - w| <= 2^-4 |w| in the normal
  range and <= 2^-10 * scale among subnormals (step 2^-9 * scale).
"""

import pytest
import torch

from model.fp8_blocks import dequantize_fp8_blockwise, quantize_fp8_blockwise
from native import _fp8_ops, ops, reference

FP8 = torch.float8_e4m3fn
PORTABLE = ("portable", "avx2")  # avx2 runs the portable code of these kernels


def _fp8_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 weight spanning subnormals to +-448, and varied block scales."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(torch.empty(n, k).uniform_(-11, 9, generator=gen))
    w = (torch.randn(n, k, generator=gen).sign() * magnitude).clamp(-448, 448).to(FP8)
    scale = torch.exp(torch.randn(-(-n // 128), -(-k // 128), generator=gen)) / 448
    return w, scale


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(torch.bfloat16)


def _assert_matches_twin(x: torch.Tensor, packed: _fp8_ops.PackedLinearFp8) -> None:
    y = ops.linear_fp8(x, packed)
    twin = reference.linear_fp8(x, reference.prepack_linear_fp8(*packed.unpack())).float()
    assert y.shape == (*x.shape[:-1], packed.n) and y.dtype == torch.bfloat16
    k = x.shape[-1]
    summed = x.float().abs() @ packed.dequantize().abs().T
    bound = 2**-7 * twin.abs() + 2 * (2 * k + 8) * 2**-24 * summed
    excess = (y.float() - twin).abs() - bound
    assert excess.numel() == 0 or excess.max() <= 0, f"worst excess {excess.max().item()}"


@pytest.mark.parametrize("k", [3, 9])  # one-hot x: M = 3 (GEMV) and M = 9 (GEMM)
def test_every_byte_decodes_like_torch(isa, k):
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    n = codes.numel()  # 254: N off the 32-column block
    index = (torch.arange(n)[:, None] + 85 * torch.arange(k)[None, :]) % n
    w = codes[index].view(FP8)  # every code in every column
    scale = torch.full((-(-n // 128), 1), 0.5)
    y = ops.linear_fp8(torch.eye(k, dtype=torch.bfloat16), ops.prepack_linear_fp8(w, scale))
    expected = (w.float() * 0.5).T
    assert torch.equal(y.float(), expected)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 17])
@pytest.mark.parametrize("n,k", [(1, 1), (33, 17), (100, 130), (160, 384), (257, 1030)])
def test_linear_fp8_matches_twin(isa, m, n, k):
    _assert_matches_twin(_x(m, k), ops.prepack_linear_fp8(*_fp8_weight(n, k)))


def test_linear_fp8_prefill_size(isa):
    # M = 512: three row chunks of the GEMM; the portable path gets a small weight.
    n, k = (70, 200) if isa in PORTABLE else (257, 1030)
    _assert_matches_twin(_x(512, k), ops.prepack_linear_fp8(*_fp8_weight(n, k, seed=3)))


def test_linear_fp8_strided_batched_and_empty(isa):
    packed = ops.prepack_linear_fp8(*_fp8_weight(70, 48))
    wide = _x(9, 101)
    _assert_matches_twin(wide[:, 3:51], packed)  # odd row stride: the wrapper copies
    _assert_matches_twin(_x(12, 100)[:, 2:50], packed)  # even stride, offset view: no copy
    x3 = _x(10, 48).view(2, 5, 48)
    _assert_matches_twin(x3, packed)
    assert ops.linear_fp8(torch.empty(0, 48, dtype=torch.bfloat16), packed).shape == (0, 70)
    no_inputs = ops.prepack_linear_fp8(torch.zeros(40, 0, dtype=FP8), torch.ones(1, 0))
    for m in (1, 9):  # GEMV and GEMM paths: an empty sum is zero
        y = ops.linear_fp8(torch.empty(m, 0, dtype=torch.bfloat16), no_inputs)
        assert y.shape == (m, 40) and torch.count_nonzero(y) == 0


def test_pack_roundtrip():
    w, scale = _fp8_weight(45, 33)
    packed = ops.prepack_linear_fp8(w, scale)
    assert packed.packed.shape == (2, 17, 64) and packed.packed.dtype == torch.uint8
    w_back, scale_back = packed.unpack()
    assert torch.equal(w_back.view(torch.uint8), w.view(torch.uint8))
    assert torch.equal(scale_back, scale)


def test_block_math_matches_engine_loader():
    # One math for FP8 checkpoints: the twins equal model/weights.py's load-time functions.
    w = torch.randn(300, 200) * torch.exp(torch.randn(300, 1))
    w[:128, :128] = 0  # an all-zero block gets scale 1
    q, scale = reference.quantize_fp8_blocks(w)
    q_engine, scale_engine = quantize_fp8_blockwise(w)
    assert torch.equal(q.view(torch.uint8), q_engine.view(torch.uint8))
    assert torch.equal(scale, scale_engine) and scale[0, 0] == 1
    assert torch.equal(
        reference.dequantize_fp8_blocks(q, scale), dequantize_fp8_blockwise(q, scale)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantizer_error_bound(dtype):
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(200, 300, generator=gen) * torch.exp(torch.randn(200, 1, generator=gen))
    w[:, :5] *= 1e-4  # deep into the subnormals of their block
    w = w.to(dtype)
    packed = ops.prepack_linear_fp8_from(w)
    scale = packed.scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    err = (packed.dequantize() - w.float()).abs()
    assert torch.all(err <= 2**-4 * w.float().abs() + 2**-10 * scale * (1 + 1e-6))
    blocks = w.float().abs().amax()  # the largest value maps to 448 exactly (up to fp32)
    assert torch.isclose(packed.dequantize().abs().amax(), blocks, rtol=1e-6)


def test_quantized_linear_near_bf16_linear(isa):
    # The twin against the plain float oracle: within the quantization error of the weight.
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(96, 260, generator=gen) / 16).to(torch.bfloat16)
    x = _x(7, 260)
    packed = ops.prepack_linear_fp8_from(w)
    y = ops.linear_fp8(x, packed).float()
    exact = x.float() @ w.float().T
    quant_err = x.float().abs() @ (packed.dequantize() - w.float()).abs().T
    assert torch.all((y - exact).abs() <= quant_err + 2**-7 * exact.abs() + 1e-3)
    assert (y - exact).abs().max() > 0  # the weights were really quantized


def test_fallbacks_match_twin(isa):
    packed = ops.prepack_linear_fp8(*_fp8_weight(50, 40))
    twin_weight = reference.prepack_linear_fp8(*packed.unpack())
    xf = _x(3, 40).float()  # fp32 activations: the twin
    assert torch.equal(ops.linear_fp8(xf, packed), reference.linear_fp8(xf, twin_weight))
    ops.set_native_enabled(False)
    try:
        x = _x(3, 40)
        assert torch.equal(ops.linear_fp8(x, packed), reference.linear_fp8(x, twin_weight))
    finally:
        ops.set_native_enabled(True)


def test_bad_inputs_raise():
    w, scale = _fp8_weight(40, 130)  # scale [1, 2]
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        ops.prepack_linear_fp8(w.float(), scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        ops.prepack_linear_fp8(w[None], scale)
    with pytest.raises(ValueError, match=r"shape \[1, 2\]"):
        ops.prepack_linear_fp8(w, scale[:, :1])
    with pytest.raises(ValueError, match="scale_inv"):
        ops.prepack_linear_fp8(w, scale.to(torch.int32))
    with pytest.raises(ValueError, match="non-finite"):
        ops.prepack_linear_fp8(w, torch.full_like(scale, float("inf")))
    nan = w.clone()
    nan.view(torch.uint8)[3, 7] = 0xFF
    with pytest.raises(ValueError, match="NaN"):
        ops.prepack_linear_fp8(nan, scale)
    with pytest.raises(ValueError, match="2-D float"):
        ops.prepack_linear_fp8_from(torch.ones(4, 4, dtype=torch.int32))
    packed = ops.prepack_linear_fp8(w, scale)
    with pytest.raises(ValueError, match="features"):
        ops.linear_fp8(_x(2, 129), packed)
    with pytest.raises(TypeError, match="PackedLinearFp8"):
        ops.linear_fp8(_x(2, 130), w)


def test_binding_checks_dtypes_and_sizes():
    if not ops.native_available():
        pytest.skip("native extension not built")
    from native import _C

    packed = ops.prepack_linear_fp8(*_fp8_weight(40, 130))
    x, y = _x(2, 130), torch.empty(2, 40, dtype=torch.bfloat16)
    s = packed.scale_inv

    def call(x_arg, w_arg, s_arg, y_arg):
        _C.linear_fp8(x_arg, 2, 130, 65, w_arg, 40, s_arg, s.shape[1], y_arg, 40)

    args = [_fp8_ops._arg(t, tag) for t, tag in ((x, 1), (packed.packed, 6), (s, 0), (y, 1))]
    call(*args)  # well-formed: runs
    # the bindings' one dtype rule (common.h): the argument, what it is, what it must be
    for i, bad_tag, message in (
        (0, 0, "x is float32, expected bfloat16"),
        (1, 1, "packed weight is bfloat16, expected float8_e4m3fn"),
        (2, 1, "scale is bfloat16, expected float32"),
        (3, 0, "y is float32, expected bfloat16"),
    ):
        wrong = list(args)
        wrong[i] = (args[i][0], bad_tag, args[i][2])
        with pytest.raises(ValueError, match=f"^linear_fp8: {message}$"):
            call(*wrong)
    short = list(args)
    short[1] = (args[1][0], 6, args[1][2] - 1)
    with pytest.raises(ValueError, match="elements"):
        call(*short)
