"""`duet bench-kernels` against an injected roofline: a row above ROOFLINE_LIMIT is flagged and
fails the run; each case is held to the DRAM rate probed beside it; the int4 rows count their
weights as stored (fake probes, real kernels on --quick shapes; nothing here is timed against a
figure)."""

import itertools
import json
import re

import pytest
import torch

from bench import kernel_cases, kernels, roofline
from control.quant_schemes import INT4_GROUP_SIZE
from native import ops

QUICK_ROPE = ["--quick", "--repeats", "1", "--filter", "rope"]


def _roof(gbs: float, tflops: float) -> roofline.Roofline:
    return roofline.Roofline(
        bandwidth_gbs=gbs,
        peaks_tflops={"bf16_dot": tflops, "fp32_fma_zmm": tflops},
        cache_bandwidth_gbs={"l2": gbs, "l3": gbs},
    )


def test_row_above_the_roof_is_flagged_and_the_run_fails(capsys):
    # 1 kB/s: any real rope call is "faster than the roof", i.e. a measurement error.
    assert kernels.main(["--json", *QUICK_ROPE], roof=_roof(1e-6, 1e-9)) == 1
    out = capsys.readouterr()
    rows = json.loads(out.out)
    assert rows and all(row["kernel"] == "rope" for row in rows)
    for row in rows:
        assert row["flags"] == ["above_roof"] and row["roofline"] > roofline.ROOFLINE_LIMIT
        assert row["bandwidth_gbs"] == 1e-6
        # The stderr line names the case and both figures (measured and the roof's bound).
        line = next(x for x in out.err.splitlines() if f"rope [{row['shape']}] roofline" in x)
        assert f"{row['time_ms']:.4f} ms" in line and f"{row['bound_ms']:.4f} ms" in line
    assert "row(s) above the roofline limit" in out.err


def test_flagged_row_is_marked_in_the_table(capsys):
    assert kernels.main(QUICK_ROPE, roof=_roof(1e-6, 1e-9)) == 1
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rope")]
    assert table and all("%!roof" in line for line in table)


def test_plausible_rows_pass_and_carry_the_probe_beside_them(capsys):
    # A distinct DRAM rate at every probe: before the case, then after its kernel was timed.
    beside = itertools.chain([500.0, 1000.0], itertools.count(4000.0, 1000.0))
    rc = kernels.main(
        ["--json", "--quick", "--repeats", "1", "--filter", "gemv_q_a"],
        roof=_roof(1e9, 1e9),
        probe_dram=lambda: next(beside),
    )
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["kernel"] for row in rows] == ["gemv_q_a"]
    row = rows[0]
    assert row["flags"] == [] and 0 < row["roofline"] < roofline.ROOFLINE_LIMIT
    assert row["dram_gbs_beside"] == 1000.0  # the better of the two probes around this case
    assert row["compute"] == "bf16" and row["peak_family"] == "bf16_dot"
    assert row["peak_tflops"] == 1e9 and row["level"] in ("dram", "l3", "l2")
    assert row["speedup_vs_torch"] > 0 and isinstance(row["torch_variant"], str)


def _int4_bytes(n: int, k: int, group: int = INT4_GROUP_SIZE) -> int:
    """Bytes of an int4 weight [n, k] as the kernels store it (native/_int4_ops.py): n padded to
    16 rows, k to whole groups; a nibble per weight and an fp32 scale per group of a row."""
    rows, cols = -(-n // 16) * 16, -(-k // group) * group
    return rows * cols // 2 + 4 * rows * (cols // group)


def test_int4_rows_count_their_weights_as_stored(capsys):
    """Every int4 row's bytes: the packed nibbles and the fp32 group scales, padding included
    (the quick q_b has K = 96, and the experts' down projection I = 96: two groups of 64 each),
    plus the activations; a one-token MoE row reads exactly its top_k experts."""
    if not ops.native_available():
        pytest.skip("native extension not built: no packed int4 weights")
    d = kernel_cases.QUICK
    one = ops.prepack_linear_int4(torch.randn(96, 96), INT4_GROUP_SIZE)
    assert one.packed.numel() + 4 * one.scales.numel() == _int4_bytes(96, 96) == 6912
    assert kernel_cases.int4_stored_bytes(one) == 6912  # not 96 * 96 / 2 + 4 * 96 * 2 = 5376
    w13 = torch.randn(d.num_experts, 2 * d.moe_inter, d.hidden)
    experts = ops.prepack_experts_int4(w13, torch.randn(d.num_experts, d.hidden, d.moe_inter))
    expert_bytes = 2 * _int4_bytes(d.moe_inter, d.hidden) + _int4_bytes(d.hidden, d.moe_inter)
    stored = sum(p.packed.numel() + 4 * p.scales.numel() for p in experts)
    assert stored == kernel_cases.int4_stored_bytes(*experts) == d.num_experts * expert_bytes

    roof = roofline.Roofline(
        bandwidth_gbs=1e3,
        peaks_tflops={"int8_dot": 1e3},
        cache_bandwidth_gbs={"l2": 1e3, "l3": 1e3},
    )
    rc = kernels.main(["--json", "--quick", "--repeats", "1", "--filter", "int4"], roof=roof)
    assert rc == 0
    rows = {row["kernel"] + " " + row["shape"]: row for row in json.loads(capsys.readouterr().out)}
    names = {row["kernel"] for row in rows.values()}
    linear = {f"{fam}_int4_{proj}" for fam in ("gemv", "gemm") for proj in d.projections}
    assert names == linear | {"moe_int4_decode", "moe_int4_prefill"}
    for row in rows.values():
        assert row["compute"] == "int8" and row["peak_family"] == "int8_dot", row
        assert 0 < row["roofline"] <= roofline.ROOFLINE_LIMIT and row["flags"] == [], row
        assert row["speedup_vs_int8"] > 0, row
        if row["kernel"].startswith("moe"):
            tokens = int(re.match(r"T=(\d+) ", row["shape"]).group(1))
            activations = 2 * tokens * d.hidden * 2 + tokens * d.top_k * 8
            if tokens == 1:  # one token: its top_k distinct experts
                assert row["bytes"] == d.top_k * expert_bytes + activations, row
            else:  # the mean over the routings of the experts one call reads
                experts_read = (row["bytes"] - activations) / expert_bytes
                assert d.top_k <= experts_read <= min(d.num_experts, tokens * d.top_k), row
        else:
            m, k, n = map(int, re.fullmatch(r"M=(\d+) K=(\d+) N=(\d+)", row["shape"]).groups())
            assert row["bytes"] == _int4_bytes(n, k) + (m * k + m * n) * 2, row
    assert rows["gemv_int4_q_b M=1 K=96 N=96"]["bytes"] == 6912 + (96 + 96) * 2
