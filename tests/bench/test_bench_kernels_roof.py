"""`duet bench-kernels` against an injected roofline: a row above ROOFLINE_LIMIT is flagged and
fails the run; each case is held to the DRAM rate probed beside it (fake probes, real kernels on
--quick shapes; nothing here is timed against a figure)."""

import itertools
import json

from bench import kernels, roofline

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
