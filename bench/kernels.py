"""`duet bench-kernels`: every kernel through `native.ops` on DeepSeek-V2-Lite per-layer shapes.

Per kernel and shape it reports the median time, bytes moved, flops, and the roofline efficiency
`max(bytes / BW, flops / PEAK) / time` (bench/roofline.py): PEAK is the in-register rate of the
instruction family the kernel is built on (vdpbf16ps for the bf16 kernels), BW the streaming
read of the memory the case's inputs stream from: DRAM (huge pages, probed again just before
each case) or, for cache-resident cases, L2/L3. Speed-ups are over the baselines a user would
pick (the fastest of torch's matmul forms for GEMM/GEMV, torch SDPA for extend attention,
torch's int4 weight-only GEMM for the int4 ones), over the scheme a quantized row replaces,
timed beside it (int8 for int4, bf16 for fp8 MoE), and over the `native.reference` twin (a
plain-torch correctness oracle, not a speed baseline).

    duet bench-kernels [--json] [--repeats N] [--filter SUBSTR] [--quick] [--threads N]

A roofline above ROOFLINE_LIMIT (1.05) is a measurement error: the row is marked "!", a line on
stderr names the case and both figures, and the run exits non-zero. With --json, stdout holds
only a JSON list of rows {"kernel", "shape", "time_ms", "bytes", "flops", "roofline", "bound",
"compute", "peak_family", "peak_tflops", "level", "bandwidth_gbs", "dram_gbs_beside", "flags",
"speedup_vs_reference_twin"} (+ "speedup_vs_torch" / "torch_variant", "speedup_vs_sdpa",
"speedup_vs_int8", "speedup_vs_bf16"); the rest goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch

from bench import roof_probes, roofline
from bench.kernel_cases import FULL, QUICK, Case, all_cases
from native import ops
from native.timing import time_call

# Seconds of timed calls per case at most (the sample count shrinks for slow calls; one at least).
KERNEL_BUDGET_S = 3.0
BASELINE_BUDGET_S = 2.0


def time_baseline(variants: dict[str, Callable[[], object]], repeats: int) -> tuple[str, float]:
    """(name, seconds) of the fastest variant of a baseline (each gets a share of the budget)."""
    budget = BASELINE_BUDGET_S / max(1, len(variants))
    timed = {name: time_call(fn, repeats, budget) for name, fn in variants.items()}
    best = min(timed, key=timed.get)
    return best, timed[best]


def measure_case(
    case: Case, roof: roofline.Roofline | Callable[[], roofline.Roofline], repeats: int
) -> dict:
    """One output row: the kernel's time and its ratios to the roofline and the baselines.

    `roof` carries the DRAM rate probed beside this case; a callable is asked for it right
    after the kernel was timed (the rate around the timing, not after the slow baselines)."""
    # Baselines get fewer samples (they can be slow), but three when asked for three or more.
    baseline_repeats = min(repeats, max(3, repeats // 3))
    kernel_s = time_call(case.run, repeats, KERNEL_BUDGET_S)
    roof = roof() if callable(roof) else roof
    ref_s = time_call(case.reference, baseline_repeats, BASELINE_BUDGET_S)
    bound = roof.bound(case.num_bytes, case.flops, case.compute, case.level)
    efficiency = bound.seconds / kernel_s
    row = {
        "kernel": case.kernel,
        "shape": case.shape,
        "time_ms": kernel_s * 1e3,
        "bytes": case.num_bytes,
        "flops": case.flops,
        "roofline": efficiency,
        "bound": bound.limit,
        "bound_ms": bound.seconds * 1e3,
        "compute": case.compute,
        "peak_family": bound.peak_family,
        "peak_tflops": bound.peak_tflops,
        "level": case.level,
        "bandwidth_gbs": bound.bandwidth_gbs,
        "dram_gbs_beside": roof.bandwidth_gbs,
        "flags": [] if roofline.is_plausible(efficiency) else ["above_roof"],
        "speedup_vs_reference_twin": ref_s / kernel_s,
    }
    for name, variants in case.others.items():
        variant, baseline_s = time_baseline(variants, max(1, repeats // 3))
        row[f"speedup_vs_{name}"] = baseline_s / kernel_s
        if len(variants) > 1:
            row[f"{name}_variant"] = variant
    return row


def _beside(roof: roofline.Roofline, probe_dram: Callable[[], float]):
    """The roof a case is held to: the DRAM rate probed just before the case and just after
    its kernel was timed, the higher of the two. A short probe can land in a dip of this host's
    DRAM rate (or on a buffer the kernel got fewer huge pages for) and read below what the
    kernel then streams; the better of two readings around the timing is the closer roof."""
    before = probe_dram()
    return lambda: roof.with_dram(max(before, probe_dram()))


def _format_row(row: dict) -> str:
    baselines = "".join(
        f"  x{value:.2f} vs {key[len('speedup_vs_') :]}"
        for key, value in row.items()
        if key.startswith("speedup_vs_") and key != "speedup_vs_reference_twin"
    )
    gbs = row["bytes"] / row["time_ms"] / 1e6
    tflops = row["flops"] / row["time_ms"] / 1e9
    roof = f"{row['level']} {row['bandwidth_gbs']:.0f} GB/s"
    if row["peak_family"]:
        roof += f", {row['peak_family']} {row['peak_tflops']:.3f}"
    mark = "!" if row["flags"] else " "
    return (
        f"{row['kernel']:<22} {row['shape']:<40} {row['time_ms']:>10.4f} ms {gbs:>8.1f} GB/s "
        f"{tflops:>7.3f} TF/s {100 * row['roofline']:>6.1f}%{mark}roof ({row['bound']}: {roof})"
        f"{baselines}  (twin x{row['speedup_vs_reference_twin']:.2f})"
    )


def _report_above_roof(row: dict) -> None:
    print(
        f"bench-kernels: {row['kernel']} [{row['shape']}] roofline {row['roofline']:.2f} > "
        f"{roofline.ROOFLINE_LIMIT}: measured {row['time_ms']:.4f} ms, but the roof allows no "
        f"less than {row['bound_ms']:.4f} ms ({row['bound']}-bound: {row['level']} "
        f"{row['bandwidth_gbs']:.1f} GB/s, {row['peak_family']} {row['peak_tflops']} TFLOP/s) "
        "- a measurement error",
        file=sys.stderr,
        flush=True,
    )


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="duet bench-kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print only a JSON list of rows")
    parser.add_argument("--repeats", type=int, default=10, help="timed samples per kernel")
    parser.add_argument("--filter", default="", help="only kernels whose name contains this")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test)")
    parser.add_argument("--threads", type=int, default=0, help="kernel threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def main(
    argv: list[str] | None = None,
    roof: roofline.Roofline | None = None,
    probe_dram: Callable[[], float] | None = None,
) -> int:
    """Runs the benchmark; returns 0, or 1 when a kernel raised (its row is left out) or a row's
    roofline is above ROOFLINE_LIMIT.

    `roof` replaces the measured roofline and `probe_dram` the DRAM probe taken beside each case
    (given `roof` alone, its DRAM rate is kept for every case): for tests and replays."""
    args = _parse(argv)
    log = sys.stderr if args.json else sys.stdout
    ops.set_num_threads(args.threads or torch.get_num_threads())
    if roof is None:
        roof = roofline.measure(quick=args.quick)
        probe_dram = probe_dram or (lambda: roof_probes.dram_bandwidth_beside(args.quick))
    fixed_dram = roof.bandwidth_gbs
    probe_dram = probe_dram or (lambda: fixed_dram)
    print(
        f"{roof.describe()}; threads {torch.get_num_threads()}; "
        f"native {'on' if ops.native_available() else 'off'}",
        file=log,
        flush=True,
    )
    rows, failed, above_roof = [], 0, 0
    for case in all_cases(QUICK if args.quick else FULL, lambda name: args.filter in name):
        try:
            row = measure_case(case, _beside(roof, probe_dram), args.repeats)
        except Exception as exc:  # one broken kernel must not hide the others' figures
            failed += 1
            print(f"{case.kernel} [{case.shape}] failed: {exc!r}", file=sys.stderr, flush=True)
            continue
        rows.append(row)
        print(_format_row(row), file=log, flush=True)
        if row["flags"]:
            above_roof += 1
            _report_above_roof(row)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        sys.stdout.write("\n")
    if above_roof:
        print(
            f"bench-kernels: {above_roof} row(s) above the roofline limit "
            f"{roofline.ROOFLINE_LIMIT}: fix the measurement before quoting any figure",
            file=sys.stderr,
            flush=True,
        )
    return 1 if failed or above_roof else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
