"""Load-time weight conversions (native/csrc/weight_quant.cpp) against their twins: FP8 block
dequantization and the int8 quantize-and-pack, bit for bit, on ragged shapes."""

import pytest
import torch

from native import ops, reference
from native._quant_ops import PackedLinearInt8, empty_packed_int8, quantize_weight_int8_blocked


def _e4m3(n: int, k: int, seed: int) -> torch.Tensor:
    """Every finite e4m3 byte is possible (subnormals and zeros too), NaN (0x7f, 0xff) not."""
    raw = torch.randint(
        0, 256, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    raw[(raw & 0x7F) == 0x7F] = 0x3C
    return raw.view(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    "shape,block",
    [((256, 384), (128, 128)), ((77, 130), (128, 128)), ((33, 70), (16, 32)), ((1, 1), (128, 128))],
)
def test_fp8_dequantization_equals_the_twin(isa, shape, block):
    w = _e4m3(*shape, seed=shape[0])
    scales = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    scale_inv = torch.rand(scales, generator=torch.Generator().manual_seed(1)) * 4 + 1e-3
    got = ops.dequantize_fp8_blocks(w, scale_inv, block)
    want = reference.dequantize_fp8_blocks(w, scale_inv, block)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(16, 64), (45, 70), (1, 3), (130, 257)])
def test_quantize_pack_rows_equals_the_twin(isa, dtype, n, k):
    g = torch.Generator().manual_seed(n * k)
    parts = [torch.randn(n, k, generator=g).to(dtype), torch.randn(n + 3, k, generator=g).to(dtype)]
    parts[1][2] = 0  # an all-zero row: scale 0, q 0
    total = 2 * n + 3
    got, want = empty_packed_int8(total, k), empty_packed_int8(total, k)
    row = 0
    for part in parts:  # two parts stacked by rows, the second at a ragged offset
        ops.quantize_pack_int8_rows(part, *got, row)
        reference.quantize_pack_int8_rows(part, *want, row)
        row += part.shape[0]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n,k", [(64, 128), (45, 70)])
def test_one_pass_packing_equals_quantize_then_pack(isa, n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    one_pass = PackedLinearInt8.quantized_from(w)
    two_steps = PackedLinearInt8(quantize_weight_int8_blocked(w))
    for name in ("packed", "scale", "comp"):
        assert torch.equal(getattr(one_pass, name), getattr(two_steps, name)), name
    x = torch.randn(5, k).to(torch.bfloat16)
    assert torch.equal(ops.linear_int8(x, one_pass), ops.linear_int8(x, two_steps))
