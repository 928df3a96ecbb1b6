"""The roofline of this machine, measured in the run that uses it.

BW is the streaming-read bandwidth (`native._C.stream_read_bandwidth`: all kernel threads sum a
buffer far larger than the caches); PEAK is the rate of a large bf16 torch matmul. A kernel that
moves `bytes` and does `flops` cannot beat `max(bytes / BW, flops / PEAK)`; its roofline
efficiency is that bound divided by its measured time (1.0 = at the roof).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

try:
    from native import _C
except ImportError:  # not built: a torch reduction stands in for the probe
    _C = None


@dataclass(frozen=True)
class Roofline:
    bandwidth_gbs: float  # streaming read, 1e9 bytes/s
    peak_tflops: float  # bf16 matmul, 1e12 flop/s

    def bound_s(self, num_bytes: float, flops: float) -> float:
        """The least time the roofline allows for this traffic and arithmetic."""
        return max(num_bytes / (self.bandwidth_gbs * 1e9), flops / (self.peak_tflops * 1e12))

    def efficiency(self, num_bytes: float, flops: float, time_s: float) -> float:
        return self.bound_s(num_bytes, flops) / time_s if time_s > 0 else 0.0


def measure_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best streaming-read bandwidth in GB/s over `repeats` passes of a `num_bytes` buffer."""
    if _C is not None:
        return float(_C.stream_read_bandwidth(num_bytes, repeats))
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best / 1e9


def measure_peak_tflops(n: int = 4096, repeats: int = 3) -> float:
    """Best rate of an n x n x n bf16 matmul (torch), in TFLOP/s."""
    a = torch.randn(n, n).to(torch.bfloat16)
    b = torch.randn(n, n).to(torch.bfloat16)
    torch.mm(a, b)  # warm-up: library init, page faults of the output
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best / 1e12


def measure(quick: bool = False) -> Roofline:
    """Both roofs; `quick` uses small buffers (a smoke test, not a measurement)."""
    if quick:
        return Roofline(measure_bandwidth(64 << 20, 2), measure_peak_tflops(512, 2))
    return Roofline(measure_bandwidth(), measure_peak_tflops())
