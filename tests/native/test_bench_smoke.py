"""Smoke test of `duet bench-kernels` (bench/kernels.py) on tiny shapes, and of the roofline probes."""

import json
import math

import pytest

from bench import kernels, roofline

FAMILIES = (
    "moe_decode", "moe_prefill", "gemv", "gemm", "mla_decode", "extend_attention", "rmsnorm",
    "rope", "topk",
)  # fmt: skip
ROW_KEYS = {"kernel", "shape", "time_ms", "bytes", "flops", "roofline", "speedup_vs_reference"}


def test_bench_kernels_quick_json(capsys):
    assert kernels.main(["--json", "--quick", "--repeats", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)  # stdout holds the JSON list and nothing else
    assert isinstance(rows, list) and rows
    for row in rows:
        assert ROW_KEYS <= row.keys(), row
        assert isinstance(row["kernel"], str) and isinstance(row["shape"], str)
        assert row["kernel"].startswith(FAMILIES), row["kernel"]
        assert isinstance(row["bytes"], int) and row["bytes"] > 0
        assert isinstance(row["flops"], int) and row["flops"] > 0
        for key in ("time_ms", "roofline", "speedup_vs_reference"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
    kernel_names = {row["kernel"] for row in rows}
    for family in FAMILIES:
        assert any(name.startswith(family) for name in kernel_names), family
    extend_rows = [row for row in rows if row["kernel"] == "extend_attention"]
    assert all(row["speedup_vs_sdpa"] > 0 for row in extend_rows)


def test_bench_kernels_filter(capsys):
    assert kernels.main(["--json", "--quick", "--repeats", "1", "--filter", "rope"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(row["kernel"] == "rope" for row in rows)


def test_stream_read_bandwidth():
    native = pytest.importorskip("native._C")
    assert 0.1 < native.stream_read_bandwidth(16 << 20, 2) < 10_000  # GB/s
    with pytest.raises(ValueError, match="1 MiB"):
        native.stream_read_bandwidth(1024, 1)


def test_roofline_efficiency():
    roof = roofline.Roofline(bandwidth_gbs=50.0, peak_tflops=1.0)
    assert roof.bound_s(50e9, 0) == pytest.approx(1.0)  # memory-bound
    assert roof.bound_s(0, 2e12) == pytest.approx(2.0)  # compute-bound
    assert roof.efficiency(50e9, 1e12, 2.0) == pytest.approx(0.5)
