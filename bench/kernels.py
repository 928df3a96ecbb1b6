"""`duet bench-kernels`: every kernel through `native.ops` on DeepSeek-V2-Lite per-layer shapes.

Per kernel and shape it reports the median time, bytes moved, flops, roofline efficiency
`max(bytes / BW, flops / PEAK) / time` with BW and PEAK measured in the same run
(bench/roofline.py), and the speed-up over the `native.reference` twin (extend attention also
over torch SDPA). Ops still backed by the reference show a speed-up near 1.

    duet bench-kernels [--json] [--repeats N] [--filter SUBSTR] [--quick] [--threads N]

With --json, stdout holds only a JSON list of rows {"kernel", "shape", "time_ms", "bytes",
"flops", "roofline", "speedup_vs_reference"} (+ "speedup_vs_sdpa"); the rest goes to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from bench import roofline
from bench.kernel_cases import FULL, QUICK, Case, all_cases
from native import ops

# Seconds of timed calls per case at most (the sample count shrinks for slow calls; one at least).
KERNEL_BUDGET_S = 3.0
BASELINE_BUDGET_S = 2.0
# A sample of a fast op loops until it lasts this long, so timer and call overheads average out.
MIN_SAMPLE_S = 2e-3


def time_call(fn: Callable[[], object], repeats: int, budget_s: float) -> float:
    """Median seconds per call of `fn` over up to `repeats` samples (after one warm-up call).

    A sample of a fast op loops `inner` calls; the sample count shrinks so the samples take about
    `budget_s` at most, but never below one."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    if first >= budget_s:  # one call fills the budget (seconds-long baselines): it is the sample
        return first
    inner = max(1, min(10_000, int(MIN_SAMPLE_S / max(first, 1e-9))))
    samples = max(1, min(repeats, int(budget_s / max(first * inner, 1e-9))))
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        times = []
        for _ in range(samples):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - start) / inner)
    finally:
        if gc_was_enabled:
            gc.enable()
    return statistics.median(times)


def measure_case(case: Case, roof: roofline.Roofline, repeats: int) -> dict:
    """One output row: the kernel's time and its ratios to the roofline and the baselines."""
    # Baselines get fewer samples (they can be slow), but three when asked for three or more.
    baseline_repeats = min(repeats, max(3, repeats // 3))
    kernel_s = time_call(case.run, repeats, KERNEL_BUDGET_S)
    ref_s = time_call(case.reference, baseline_repeats, BASELINE_BUDGET_S)
    row = {
        "kernel": case.kernel,
        "shape": case.shape,
        "time_ms": kernel_s * 1e3,
        "bytes": case.num_bytes,
        "flops": case.flops,
        "roofline": roof.efficiency(case.num_bytes, case.flops, kernel_s),
        "speedup_vs_reference": ref_s / kernel_s,
    }
    for name, fn in case.others.items():
        row[f"speedup_vs_{name}"] = (
            time_call(fn, max(1, repeats // 3), BASELINE_BUDGET_S) / kernel_s
        )
    return row


def _format_row(row: dict) -> str:
    extra = "".join(
        f"  x{value:.2f} vs {key[len('speedup_vs_') :]}"
        for key, value in row.items()
        if key.startswith("speedup_vs_") and key != "speedup_vs_reference"
    )
    gbs = row["bytes"] / row["time_ms"] / 1e6
    tflops = row["flops"] / row["time_ms"] / 1e9
    return (
        f"{row['kernel']:<22} {row['shape']:<40} {row['time_ms']:>10.4f} ms {gbs:>8.1f} GB/s "
        f"{tflops:>7.3f} TF/s {100 * row['roofline']:>6.1f}% roof  "
        f"x{row['speedup_vs_reference']:.2f} vs ref{extra}"
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


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns 0, or 1 when a kernel raised (its row is left out)."""
    args = _parse(argv)
    log = sys.stderr if args.json else sys.stdout
    ops.set_num_threads(args.threads or torch.get_num_threads())
    roof = roofline.measure(quick=args.quick)
    print(
        f"roofline: BW {roof.bandwidth_gbs:.1f} GB/s (stream read), PEAK {roof.peak_tflops:.3f} "
        f"TFLOP/s (bf16 matmul); threads {torch.get_num_threads()}; "
        f"native {'on' if ops.native_available() else 'off'}",
        file=log,
        flush=True,
    )
    rows, failed = [], 0
    for case in all_cases(QUICK if args.quick else FULL, lambda name: args.filter in name):
        try:
            row = measure_case(case, roof, args.repeats)
        except Exception as exc:  # one broken kernel must not hide the others' figures
            failed += 1
            print(f"{case.kernel} [{case.shape}] failed: {exc!r}", file=sys.stderr, flush=True)
            continue
        rows.append(row)
        print(_format_row(row), file=log, flush=True)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        sys.stdout.write("\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
