"""The roofline of this machine, measured in the run that uses it (probes: bench/roof_probes.py).

A case declares the instruction family its compute runs on (`compute`: "bf16" for vdpbf16ps,
"int8" for vpdpbusd, "fp32" for FMA, "none" for memory-bound ops held to bandwidth only) and
the memory level its inputs stream from (`level`: "dram" when it rotates inputs past the L3,
else "l2"/"l3"). It then cannot beat `max(bytes / BW[level], flops / PEAK[family])`; its roofline
efficiency is that bound divided by its measured time (1.0 = at the roof). PEAK is the in-register
rate of the family's instruction; BW for DRAM is a huge-page streaming read, re-probed beside
each case (`with_dram`). An efficiency above ROOFLINE_LIMIT is a measurement error.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from bench import roof_probes

# Compute family -> probe families tried in order: the instruction the kernels run on the active
# ISA (the bf16 kernels fall back to fp32 FMA without AVX512-BF16).
COMPUTE_PROBES = {
    "bf16": ("bf16_dot", "fp32_fma_zmm", "fp32_fma_ymm"),
    # a kernel with an AMX path (mla_decode): the tiles' rate where the CPU has them
    "bf16_tiles": ("amx_bf16", "bf16_dot", "fp32_fma_zmm", "fp32_fma_ymm"),
    "int8": ("int8_dot",),
    "fp32": ("fp32_fma_zmm", "fp32_fma_ymm"),
    "none": (),
}
MEMORY_LEVELS = ("dram", "l3", "l2")
# A kernel cannot beat the roof; more than 5 % above it is a timer, cache or probe error.
ROOFLINE_LIMIT = 1.05


@dataclass(frozen=True)
class Bound:
    """The least time the roofline allows a case, and which roof sets it."""

    seconds: float
    limit: str  # "memory" or "compute"
    bandwidth_gbs: float  # the memory roof used (of the case's level)
    peak_family: str | None  # the probe family of the compute roof; None: memory roof only
    peak_tflops: float | None


@dataclass(frozen=True)
class Roofline:
    bandwidth_gbs: float  # DRAM streaming read on huge pages, 1e9 bytes/s
    peaks_tflops: Mapping[str, float]  # probe family -> 1e12 ops/s (families the CPU runs)
    cache_bandwidth_gbs: Mapping[str, float] = field(default_factory=dict)  # "l2", "l3"
    bandwidth_4k_gbs: float | None = None  # the DRAM probe on 4 KiB pages, for comparison
    huge_page_share: float | None = None  # of the DRAM probe's buffer; None: unknown

    def compute_roof(self, compute: str) -> tuple[str | None, float | None]:
        """(probe family, 1e12 ops/s) of the compute roof of `compute`; (None, None): none."""
        if compute not in COMPUTE_PROBES:
            raise ValueError(f"unknown compute family {compute!r}; one of {list(COMPUTE_PROBES)}")
        for family in COMPUTE_PROBES[compute]:
            if family in self.peaks_tflops:
                return family, self.peaks_tflops[family]
        return None, None

    def memory_roof(self, level: str) -> float:
        """GB/s of streaming reads from `level`."""
        if level == "dram":
            return self.bandwidth_gbs
        if level not in MEMORY_LEVELS:
            raise ValueError(f"unknown memory level {level!r}; one of {MEMORY_LEVELS}")
        if level not in self.cache_bandwidth_gbs:
            raise ValueError(f"no {level} bandwidth measured for a {level}-resident case")
        return self.cache_bandwidth_gbs[level]

    def bound(
        self, num_bytes: float, flops: float, compute: str = "bf16", level: str = "dram"
    ) -> Bound:
        bandwidth = self.memory_roof(level)
        family, peak = self.compute_roof(compute)
        memory_s = num_bytes / (bandwidth * 1e9)
        compute_s = flops / (peak * 1e12) if peak else 0.0
        limit = "compute" if compute_s > memory_s else "memory"
        return Bound(max(memory_s, compute_s), limit, bandwidth, family, peak)

    def bound_s(
        self, num_bytes: float, flops: float, compute: str = "bf16", level: str = "dram"
    ) -> float:
        """The least time the roofline allows for this traffic and arithmetic."""
        return self.bound(num_bytes, flops, compute, level).seconds

    def efficiency(
        self,
        num_bytes: float,
        flops: float,
        time_s: float,
        compute: str = "bf16",
        level: str = "dram",
    ) -> float:
        bound_s = self.bound_s(num_bytes, flops, compute, level)
        return bound_s / time_s if time_s > 0 else 0.0

    def with_dram(self, bandwidth_gbs: float) -> Roofline:
        """The same roofs with the DRAM rate probed beside a case."""
        return dataclasses.replace(self, bandwidth_gbs=bandwidth_gbs)

    def describe(self) -> str:
        """One line for the log: every roof and where it comes from."""
        huge = (
            f"{100 * self.huge_page_share:.0f}% huge pages"
            if self.huge_page_share is not None
            else "huge pages unknown"
        )
        four_k = f", 4 KiB pages {self.bandwidth_4k_gbs:.1f}" if self.bandwidth_4k_gbs else ""
        caches = "".join(f", {k.upper()} {v:.0f}" for k, v in self.cache_bandwidth_gbs.items())
        peaks = ", ".join(
            f"{roof_probes.PEAK_FAMILIES[f]} {v:.3f}" for f, v in self.peaks_tflops.items()
        )
        return (
            f"roofline: read GB/s: DRAM {self.bandwidth_gbs:.1f} ({huge}){four_k}{caches}; "
            f"in-register peaks 1e12 op/s: {peaks or 'none measured'}"
        )


def measure(quick: bool = False) -> Roofline:
    """Every roof; `quick` uses small buffers and short loops (a smoke test, not a measurement)."""
    dram = roof_probes.dram_bandwidth(quick)
    dram_4k = roof_probes.dram_bandwidth(quick, huge_pages=False)
    return Roofline(
        bandwidth_gbs=dram.gbs,
        peaks_tflops=roof_probes.all_peaks(quick),
        cache_bandwidth_gbs=roof_probes.cache_bandwidth(quick),
        bandwidth_4k_gbs=dram_4k.gbs,
        huge_page_share=dram.huge_page_share,
    )


def is_plausible(efficiency: float) -> bool:
    """False for a roofline efficiency no kernel can reach (above ROOFLINE_LIMIT, or not finite)."""
    return math.isfinite(efficiency) and efficiency <= ROOFLINE_LIMIT
