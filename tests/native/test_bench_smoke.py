"""Smoke test of `duet bench-kernels` (bench/kernels.py) on tiny shapes, and of the roofline probes
(native/csrc/peak_probe.cpp, membw.cpp): positive finite rates, the documented answer where an
instruction is missing. No rate is compared with a figure (the machine is shared)."""

import json
import math

import pytest
import torch

from bench import kernel_comparators, kernels, roof_probes, roofline
from native import reference_int4

ISA_LEVELS = {"portable": 0, "avx2": 1, "avx512": 2, "avx512_bf16": 3, "amx": 4}

FAMILIES = (
    "moe_decode", "moe_prefill", "moe_int8_decode", "moe_int8_prefill", "moe_int4_decode",
    "moe_int4_prefill", "moe_fp8_decode", "moe_fp8_prefill", "gemv", "gemm", "mla_decode",
    "extend_attention", "rmsnorm", "rope", "topk",
)  # fmt: skip
ROW_KEYS = {
    "kernel", "shape", "time_ms", "bytes", "flops", "roofline", "bound", "bound_ms", "compute",
    "peak_family", "peak_tflops", "level", "bandwidth_gbs", "dram_gbs_beside", "flags",
    "speedup_vs_reference_twin",
}  # fmt: skip


def test_bench_kernels_quick_json(capsys):
    measurable = set(roof_probes.all_peaks(quick=True))  # none on the portable (scalar) path
    assert kernels.main(["--json", "--quick", "--repeats", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)  # stdout holds the JSON list and nothing else
    assert isinstance(rows, list) and rows
    for row in rows:
        assert ROW_KEYS <= row.keys(), row
        assert isinstance(row["kernel"], str) and isinstance(row["shape"], str)
        assert row["kernel"].startswith(FAMILIES), row["kernel"]
        assert isinstance(row["bytes"], int) and row["bytes"] > 0
        assert isinstance(row["flops"], int) and row["flops"] > 0
        for key in ("time_ms", "roofline", "speedup_vs_reference_twin", "dram_gbs_beside"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert row["flags"] == [], row  # tiny shapes are far below any roof
        assert row["level"] in roofline.MEMORY_LEVELS and row["compute"] in roofline.COMPUTE_PROBES
        if not measurable & set(roofline.COMPUTE_PROBES[row["compute"]]):
            # a small op, or an ISA (DUET_ISA=portable) without any of its instructions
            assert row["peak_family"] is None and row["bound"] == "memory"
        else:
            assert row["peak_family"] in roof_probes.PEAK_FAMILIES and row["peak_tflops"] > 0
    kernel_names = {row["kernel"] for row in rows}
    for family in FAMILIES:
        assert any(name.startswith(family) for name in kernel_names), family
    extend_rows = [row for row in rows if row["kernel"] == "extend_attention"]
    assert all(row["speedup_vs_sdpa"] > 0 for row in extend_rows)
    int8_rows = [row for row in rows if "_int8_" in row["kernel"]]
    assert int8_rows and all(row["compute"] == "int8" for row in int8_rows)
    int4_rows = [row for row in rows if "_int4_" in row["kernel"]]
    _check_int4_rows(int4_rows, int8_rows)
    linear_rows = [
        row
        for row in rows
        if row["kernel"].startswith(("gemv", "gemm")) and row not in int8_rows + int4_rows
    ]  # bf16 and fp8 weights: against torch's bf16 matmuls
    assert linear_rows and all(row["speedup_vs_torch"] > 0 for row in linear_rows)


def _check_int4_rows(int4_rows: list[dict], int8_rows: list[dict]) -> None:
    """The int4 rows: one beside every int8 GEMV / GEMM row but the LM head's (no scheme holds
    the head in int4) and every int8 fused-MoE row, on vpdpbusd, each timed against the int8
    kernel on the same weights (and torch's int4 GEMM where this torch runs it)."""
    int4_names = {row["kernel"] for row in int4_rows}
    int8_names = {row["kernel"] for row in int8_rows if not row["kernel"].endswith("lm_head")}
    assert int4_names == {name.replace("_int8_", "_int4_") for name in int8_names}
    assert {"moe_int4_decode", "gemv_int4_dense_up", "gemm_int4_dense_down"} <= int4_names
    int4 = reference_int4.quantize_weight_int4(torch.ones(16, 64), 64)
    torch_int4 = kernel_comparators.int4_mm(torch.ones(1, 64), int4) is not None
    for row in int4_rows:
        assert row["compute"] == "int8" and row["speedup_vs_int8"] > 0, row
        assert 0 < row["roofline"] <= roofline.ROOFLINE_LIMIT, row
        if torch_int4 and not row["kernel"].startswith("moe"):
            assert row["speedup_vs_torch"] > 0, row


def test_bench_kernels_filter(capsys):
    assert kernels.main(["--json", "--quick", "--repeats", "1", "--filter", "rope"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(row["kernel"] == "rope" for row in rows)


def test_stream_read_bandwidth():
    native = pytest.importorskip("native._C")
    assert 0.1 < native.stream_read_bandwidth(16 << 20, 2) < 10_000  # GB/s
    with pytest.raises(ValueError, match="1 MiB"):
        native.stream_read_bandwidth(1024, 1)


def test_peak_probes_return_positive_finite_rates():
    native = pytest.importorskip("native._C")
    features, level = native.cpu_features(), ISA_LEVELS[native.active_isa()]
    supported = {  # the CPU has the instruction and the active ISA (DUET_ISA) allows it
        "bf16_dot": features["avx512_bf16"] and level >= ISA_LEVELS["avx512_bf16"],
        "int8_dot": features["avx512_vnni"] and level >= ISA_LEVELS["avx512_bf16"],
        "fp32_fma_zmm": level >= ISA_LEVELS["avx512"],
        "fp32_fma_ymm": level >= ISA_LEVELS["avx2"],
    }
    for family, is_supported in supported.items():
        rate = roof_probes.peak_tflops(family, iterations=1 << 12, repeats=2)
        if is_supported:
            assert rate is not None and math.isfinite(rate) and rate > 0, family
        else:
            assert rate is None, family
    with pytest.raises(ValueError, match="unknown peak family"):
        roof_probes.peak_tflops("fp8_dot")
    with pytest.raises(ValueError, match="unknown family"):
        native.peak_rate("fp8_dot", 16, 1)


def test_peak_probe_of_a_missing_instruction_is_unsupported():
    native = pytest.importorskip("native._C")
    best = native.active_isa()
    try:
        native.set_active_isa(1)  # AVX2 at most: no vdpbf16ps, vpdpbusd or zmm FMA
        for family in ("bf16_dot", "int8_dot", "fp32_fma_zmm"):
            assert native.peak_rate(family, 16, 1) == 0.0
            assert roof_probes.peak_tflops(family, 16, 1) is None
        assert set(roof_probes.all_peaks(quick=True)) <= {"fp32_fma_ymm"}
    finally:
        native.set_active_isa(ISA_LEVELS[best])


def test_stream_read_probe_on_huge_and_small_pages():
    native = pytest.importorskip("native._C")
    for huge_pages in (True, False):
        gbs, huge_bytes = native.stream_read_probe(4 << 20, 2, huge_pages, 2)
        assert math.isfinite(gbs) and gbs > 0
        assert huge_bytes >= -1 and huge_bytes <= 4 << 20
    _, huge_bytes = native.stream_read_probe(4 << 20, 1, False, 1)
    assert huge_bytes <= 0  # MADV_NOHUGEPAGE: no huge pages (or unknown)
    with pytest.raises(ValueError, match="passes"):
        native.stream_read_probe(4 << 20, 1, True, 0)
    rates = roof_probes.cache_bandwidth(quick=True)
    assert set(rates) == {"l2", "l3"} and all(math.isfinite(v) and v > 0 for v in rates.values())


def test_measured_roofline_has_every_roof():
    roof = roofline.measure(quick=True)
    assert roof.bandwidth_gbs > 0 and roof.bandwidth_4k_gbs > 0
    assert set(roof.cache_bandwidth_gbs) == {"l2", "l3"}
    assert all(v > 0 for v in roof.peaks_tflops.values())
    assert roof.describe().startswith("roofline: read GB/s: DRAM")
