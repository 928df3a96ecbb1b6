"""bf16 linear with prepacked weights (native/csrc/gemm.cpp) against `reference.linear`, and the
bf16 bmm (native/csrc/bmm.cpp) against `reference.bmm`.

Runs on every ISA level (the `isa` fixture), covering the GEMV path (M <= 6) and the blocked GEMM
path (M > 6) with N, K off the 32-column block and the K-pair, and K past one K chunk (1024)."""

import pytest
import torch

from native import _gemm_ops, ops, reference

# bf16 outputs: one rounding of an O(1) value plus fp32 summation-order differences.
BF16_TOL = {"rtol": 2e-2, "atol": 2e-2}


def _weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) / max(k, 1) ** 0.5).to(torch.bfloat16)
    return w, ops.prepack_linear(w)


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(torch.bfloat16)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("n,k", [(1, 1), (32, 64), (33, 17), (100, 130), (257, 1030)])
def test_linear_matches_reference(isa, m, n, k):
    w, packed = _weights(n, k)
    assert isinstance(packed, _gemm_ops.PackedLinear)
    x = _x(m, k)
    y = ops.linear(x, packed)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), reference.linear(x, w).float(), **BF16_TOL)


def test_linear_large_m_many_chunks(isa):
    # M over two row chunks (240) and K over two K chunks, N ending in a half panel.
    if isa == "portable":
        pytest.skip("same code as the small cases; too slow for the scalar path")
    w, packed = _weights(96, 1100)
    x = _x(487, 1100)
    torch.testing.assert_close(
        ops.linear(x, packed).float(), reference.linear(x, w).float(), **BF16_TOL
    )


def test_linear_strided_and_batched_input(isa):
    w, packed = _weights(70, 48)
    wide = _x(9, 101)
    x = wide[:, 3:51]  # row stride 101 (odd), offset 3: the wrapper must copy
    torch.testing.assert_close(
        ops.linear(x, packed).float(), reference.linear(x, w).float(), **BF16_TOL
    )
    x3 = _x(10, 48).view(2, 5, 48)
    y3 = ops.linear(x3, packed)
    assert y3.shape == (2, 5, 70)
    torch.testing.assert_close(y3.float(), reference.linear(x3, w).float(), **BF16_TOL)


def test_linear_empty_input(isa):
    _, packed = _weights(40, 24)
    assert ops.linear(torch.empty(0, 24, dtype=torch.bfloat16), packed).shape == (0, 40)
    _, no_inputs = _weights(40, 0)
    for m in (1, 9):  # GEMV and GEMM paths: an empty sum is zero
        y = ops.linear(torch.empty(m, 0, dtype=torch.bfloat16), no_inputs)
        assert y.shape == (m, 40) and torch.count_nonzero(y) == 0


def test_pack_roundtrip_and_metadata():
    w, packed = _weights(45, 33)
    if not isinstance(packed, _gemm_ops.PackedLinear):
        pytest.skip("native extension not available")
    assert packed.shape == w.shape and packed.dtype == torch.bfloat16
    assert packed.packed.shape == (2, 17, 32, 2)
    assert torch.equal(packed.unpack(), w)


def test_fallbacks_match_reference(isa):
    w, packed = _weights(50, 40)
    x = _x(3, 40)
    # fp32 activations with a packed weight: the reference on the unpacked weight.
    xf = x.float()
    torch.testing.assert_close(ops.linear(xf, packed), reference.linear(xf, w))
    # fp32 weights stay unpacked and take the reference path.
    wf = w.float()
    assert ops.prepack_linear(wf) is wf
    torch.testing.assert_close(ops.linear(xf, wf), reference.linear(xf, wf))
    # Native switched off after packing: still correct.
    ops.set_native_enabled(False)
    try:
        assert ops.prepack_linear(w) is w
        assert torch.equal(ops.linear(x, packed), reference.linear(x, w))
    finally:
        ops.set_native_enabled(True)


def test_linear_rejects_wrong_width(isa):
    _, packed = _weights(16, 32)
    with pytest.raises(ValueError, match="features"):
        ops.linear(_x(2, 31), packed)


@pytest.mark.parametrize(
    "batch,m,k,p",
    [(1, 1, 1, 1), (16, 1, 128, 512), (16, 5, 512, 128), (3, 7, 33, 70), (2, 13, 300, 65)],
)
def test_bmm_matches_reference(isa, batch, m, k, p):
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(batch, m, k, generator=gen).to(torch.bfloat16)
    b = (torch.randn(batch, k, p, generator=gen) / k**0.5).to(torch.bfloat16)
    out = ops.bmm(a, b)
    assert out.shape == (batch, m, p) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference.bmm(a, b).float(), **BF16_TOL)


@pytest.mark.parametrize(
    "batch,m,k,p",
    [(1, 1, 1, 1), (16, 1, 128, 512), (16, 5, 512, 128), (3, 7, 33, 70), (2, 13, 300, 65)],
)
def test_bmm_with_b_prepacked_matches_reference(isa, batch, m, k, p):
    """The model's absorbed weights are prepacked once (`prepack_bmm`): the same products as
    the plain-b kernel (bit for bit: the same tiles over the same K order) and the twin."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(batch, m, k, generator=gen).to(torch.bfloat16)
    b = (torch.randn(batch, k, p, generator=gen) / k**0.5).to(torch.bfloat16)
    packed = ops.prepack_bmm(b)
    out = ops.bmm(a, packed)
    assert out.shape == (batch, m, p) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference.bmm(a, b).float(), **BF16_TOL)
    assert torch.equal(out, ops.bmm(a, b))
    # Head-major views of token-major activations, as MLA's decode passes them.
    rows = torch.randn(m, batch, k + 8, generator=gen).to(torch.bfloat16)[..., :k].transpose(0, 1)
    torch.testing.assert_close(
        ops.bmm(rows, packed).float(), reference.bmm(rows, b).float(), **BF16_TOL
    )
    with pytest.raises(ValueError, match="chain"):
        ops.bmm(a[..., :-1] if k > 1 else a[:, :, :0], packed)


def test_bmm_prepacked_off_the_kernel_is_the_twin():
    b = torch.randn(2, 6, 5).to(torch.bfloat16)
    packed = ops.prepack_bmm(b)
    a = torch.randn(2, 3, 6).to(torch.bfloat16)
    ops.set_native_enabled(False)
    try:
        assert torch.equal(ops.bmm(a, packed), reference.bmm(a, b))
    finally:
        ops.set_native_enabled(True)
    b32 = b.float()
    assert ops.prepack_bmm(b32) is b32  # not the kernel's dtype: kept as it is


def test_bmm_strided_and_empty(isa):
    # Head-major view of a token-major tensor, as in MLA weight absorption.
    a = torch.randn(5, 16, 128).to(torch.bfloat16).transpose(0, 1)  # [16, 5, 128]
    b = (torch.randn(16, 512, 128) / 128**0.5).to(torch.bfloat16).transpose(1, 2)  # [16, 128, 512]
    torch.testing.assert_close(ops.bmm(a, b).float(), reference.bmm(a, b).float(), **BF16_TOL)
    assert ops.bmm(a[:, :0], b).shape == (16, 0, 512)
    zero_k = ops.bmm(
        torch.empty(2, 3, 0, dtype=torch.bfloat16), torch.empty(2, 0, 4, dtype=torch.bfloat16)
    )
    assert torch.count_nonzero(zero_k) == 0
    with pytest.raises(ValueError, match="chain"):
        ops.bmm(a, b[:, :64])
