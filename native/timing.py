"""Timing a call the way every benchmark and the planner's profile do: the median of samples,
each looping a fast call long enough that the timer's own cost averages out."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

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
