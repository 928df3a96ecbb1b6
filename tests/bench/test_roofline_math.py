"""The roofline's bound math per instruction family and memory level, the cache-defeat rules of
the kernel cases, and the torch comparators against plain-torch oracles (no timing)."""

import pytest
import torch

from bench import cache_defeat, kernel_comparators, roofline
from native import reference_int4

PEAKS = {"bf16_dot": 2.0, "int8_dot": 4.0, "fp32_fma_zmm": 1.0, "fp32_fma_ymm": 0.5}  # 1e12/s
ROOF = roofline.Roofline(
    bandwidth_gbs=50.0, peaks_tflops=PEAKS, cache_bandwidth_gbs={"l2": 400.0, "l3": 200.0}
)


@pytest.mark.parametrize(
    ("compute", "family", "peak"),
    [("bf16", "bf16_dot", 2.0), ("int8", "int8_dot", 4.0), ("fp32", "fp32_fma_zmm", 1.0)],
)
def test_bound_is_the_larger_of_memory_and_the_family_peak(compute, family, peak):
    # 1e12 ops: 1 / peak seconds; 10e9 bytes at 50 GB/s: 0.2 s.
    bound = ROOF.bound(10e9, 1e12, compute, "dram")
    assert bound.seconds == pytest.approx(max(10e9 / 50e9, 1e12 / (peak * 1e12)))
    assert (bound.limit, bound.peak_family, bound.peak_tflops) == ("compute", family, peak)
    memory = ROOF.bound(500e9, 1e12, compute, "dram")  # 10 s of DRAM traffic
    assert memory.seconds == pytest.approx(10.0) and memory.limit == "memory"
    assert ROOF.efficiency(10e9, 1e12, 2 * bound.seconds, compute) == pytest.approx(0.5)


def test_cache_levels_and_memory_only_cases():
    assert ROOF.bound_s(400e9, 0, "none", "l2") == pytest.approx(1.0)
    assert ROOF.bound_s(400e9, 0, "none", "l3") == pytest.approx(2.0)
    # "none": no compute roof however many flops (a memory-bound op held to bandwidth only).
    bound = ROOF.bound(50e9, 1e15, "none", "dram")
    assert bound.seconds == pytest.approx(1.0) and bound.peak_family is None
    with pytest.raises(ValueError, match="l3"):
        roofline.Roofline(50.0, PEAKS).bound_s(1, 1, "bf16", "l3")
    with pytest.raises(ValueError, match="compute family"):
        ROOF.bound_s(1, 1, "fp8", "dram")
    with pytest.raises(ValueError, match="memory level"):
        ROOF.bound_s(1, 1, "bf16", "hbm")


def test_family_falls_back_to_the_instruction_the_kernels_use():
    no_bf16 = roofline.Roofline(50.0, {"fp32_fma_zmm": 1.0, "fp32_fma_ymm": 0.5})
    assert no_bf16.compute_roof("bf16") == ("fp32_fma_zmm", 1.0)
    assert roofline.Roofline(50.0, {"fp32_fma_ymm": 0.5}).compute_roof("fp32") == (
        "fp32_fma_ymm",
        0.5,
    )
    # No vpdpbusd: no compute roof (the memory roof alone can only lower the efficiency).
    assert no_bf16.compute_roof("int8") == (None, None)
    assert no_bf16.bound_s(50e9, 1e15, "int8", "dram") == pytest.approx(1.0)


def test_with_dram_replaces_only_the_dram_rate():
    beside = ROOF.with_dram(80.0)
    assert beside.bound_s(80e9, 0, "none", "dram") == pytest.approx(1.0)
    assert beside.peaks_tflops == PEAKS and beside.cache_bandwidth_gbs == ROOF.cache_bandwidth_gbs
    assert ROOF.bandwidth_gbs == 50.0


def test_plausibility_limit():
    assert roofline.is_plausible(1.0) and roofline.is_plausible(roofline.ROOFLINE_LIMIT)
    assert not roofline.is_plausible(1.06)
    assert not roofline.is_plausible(float("inf")) and not roofline.is_plausible(float("nan"))


def test_cache_defeat_rules():
    big = cache_defeat.cache_defeat_bytes()
    _, l3_bytes = cache_defeat.roof_probes.cache_sizes()
    assert big >= 4 * l3_bytes and big >= 384 << 20
    assert cache_defeat.copies_to_defeat(big // 4) == 4
    assert cache_defeat.copies_to_defeat(2 * big) == 1
    assert cache_defeat.copies_to_defeat(1) == cache_defeat.MAX_COPIES
    assert cache_defeat.memory_level(big) == "dram"
    assert cache_defeat.memory_level(4096) == "l2"
    l2_bytes, _ = cache_defeat.roof_probes.cache_sizes()
    assert cache_defeat.memory_level(l2_bytes + 1) == "l3"
    nxt = cache_defeat.cycling(["a", "b", "c"])
    assert [nxt() for _ in range(5)] == ["a", "b", "c", "a", "b"]


def test_torch_linear_variants_compute_x_wt_on_each_copy():
    x = torch.randn(5, 24)
    weights = [torch.randn(16, 24) for _ in range(3)]
    variants = kernel_comparators.torch_linear_variants(x, weights)
    assert len(variants) >= 3
    for name, fn in variants.items():
        for w in weights:  # each call takes the next copy, in order
            torch.testing.assert_close(fn(), x @ w.T, msg=name)


def test_int8_mm_matches_int32_matmul():
    a = torch.randint(-128, 128, (32, 64), dtype=torch.int8)
    b = torch.randint(-128, 128, (64, 48), dtype=torch.int8)
    fn = kernel_comparators.int8_mm(a, b)
    if fn is None:  # the documented answer where this torch has no CPU int8 GEMM
        pytest.skip("torch._int_mm does not run on this CPU build")
    out = fn()
    assert out.dtype == torch.int32
    assert torch.equal(out, a.to(torch.int32) @ b.to(torch.int32))
    assert kernel_comparators.int8_mm(a.float(), b.float()) is None  # not int8: no comparator


def test_int4_mm_matches_the_dequantized_matmul():
    """torch's int4 weight-only GEMM on an Int4Weight's values: x @ dequantize(W).T to within
    its bf16 roundings (scales, partial sums, output) of the outputs' scale (K = 96: padded to
    two groups of 64). Seeded: over 200 seeds the worst error was 0.55 % of the largest output;
    an elementwise rtol is no bound here (one output near a cancellation came out 6.6 % off)."""
    gen = torch.Generator().manual_seed(0)
    weight = reference_int4.quantize_weight_int4(torch.randn(48, 96, generator=gen), 64)
    x = torch.randn(3, 96, generator=gen).to(torch.bfloat16)
    fn = kernel_comparators.int4_mm(x, weight)
    if fn is None:  # the documented answer where this torch has no CPU int4 GEMM
        pytest.skip("aten._weight_int4pack_mm_for_cpu does not run on this torch")
    out = fn()
    assert out.shape == (3, 48) and out.dtype == torch.bfloat16
    expected = x.float() @ reference_int4.dequantize_int4(weight).T
    assert (out.float() - expected).abs().max() <= 0.02 * expected.abs().max()


def test_sdpa_comparator_matches_causal_attention_with_prefix():
    new_len, prefix_len, heads, dim = 5, 3, 2, 8
    q, k, v = (torch.randn(new_len, heads, dim) for _ in range(3))
    k_prefix, v_prefix = torch.randn(prefix_len, heads, dim), torch.randn(prefix_len, heads, dim)
    out = kernel_comparators.sdpa(q, k, v, k_prefix, v_prefix, 0.5)()  # [1, H, S, D]
    keys, values = torch.cat((k_prefix, k)), torch.cat((v_prefix, v))
    scores = torch.einsum("shd,thd->hst", q, keys) * 0.5
    visible = torch.ones(new_len, prefix_len + new_len, dtype=torch.bool).tril(prefix_len)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    torch.testing.assert_close(out[0], torch.einsum("hst,thd->hsd", probs, values))
