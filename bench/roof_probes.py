"""The probes behind the roofline (bench/roofline.py), wrapping `native._C`.

- Compute: the in-register rate of each instruction family the kernels are built on
  (native/csrc/peak_probe.cpp), on all kernel threads, a multiply-add counted as 2 ops.
- Memory: streaming reads by all kernel threads (native/csrc/membw.cpp) of a buffer far larger
  than L3 on huge pages (DRAM; the 4 KiB-page figure is kept for comparison), and of buffers that
  fit in L2 or L3 read many times over (the roofs of cache-resident cases).

Without the extension, memory rates come from a torch reduction and no compute peak is known.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

try:
    from native import _C
except ImportError:  # not built
    _C = None

# Probe family -> the instruction it times (one zmm/ymm instruction per accumulator per round).
PEAK_FAMILIES = {
    "bf16_dot": "vdpbf16ps zmm",
    "int8_dot": "vpdpbusd zmm",
    "fp32_fma_zmm": "vfmadd231ps zmm",
    "fp32_fma_ymm": "vfmadd231ps ymm",
    "amx_bf16": "tdpbf16ps tiles",
}
# Used when sysfs does not say (this machine: 1 MiB L2 per core, 32 MiB L3).
DEFAULT_L2_BYTES = 1 << 20
DEFAULT_L3_BYTES = 32 << 20
# Rounds of the in-register loop per timed pass (~25 ms at 2 instructions per cycle).
PEAK_ITERATIONS = 1 << 24


def peak_tflops(family: str, iterations: int = PEAK_ITERATIONS, repeats: int = 5) -> float | None:
    """Best in-register rate of `family` (a key of PEAK_FAMILIES) in 1e12 ops/s, or None when the
    CPU (or the DUET_ISA cap) lacks the instruction or the extension is not built."""
    if family not in PEAK_FAMILIES:
        raise ValueError(f"unknown peak family {family!r}; one of {sorted(PEAK_FAMILIES)}")
    if _C is None:
        return None
    rate = float(_C.peak_rate(family, iterations, repeats))
    return rate / 1e12 if rate > 0 else None


def all_peaks(quick: bool = False) -> dict[str, float]:
    """The peak of every family this CPU runs, in 1e12 ops/s (missing ones left out)."""
    iterations = PEAK_ITERATIONS >> 3 if quick else PEAK_ITERATIONS
    peaks = {family: peak_tflops(family, iterations, 3 if quick else 5) for family in PEAK_FAMILIES}
    return {family: rate for family, rate in peaks.items() if rate is not None}


@dataclass(frozen=True)
class ReadRate:
    gbs: float  # 1e9 bytes/s
    huge_page_bytes: int  # of the buffer backed by huge pages; -1 unknown
    num_bytes: int  # of the buffer

    @property
    def huge_page_share(self) -> float | None:
        """Share of the buffer on huge pages (None: unknown)."""
        if self.huge_page_bytes < 0:
            return None
        return min(1.0, self.huge_page_bytes / self.num_bytes)


def stream_read(num_bytes: int, repeats: int, huge_pages: bool = True, passes: int = 1) -> ReadRate:
    """Best rate of `passes` reads of a `num_bytes` buffer by all kernel threads."""
    if _C is not None:
        gbs, huge = _C.stream_read_probe(num_bytes, repeats, huge_pages, passes)
        return ReadRate(float(gbs), int(huge), num_bytes)
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(passes):
            x.sum()
        best = min(best, time.perf_counter() - start)
    return ReadRate(num_bytes * passes / best / 1e9, -1, num_bytes)


def _sysfs_cache_bytes(level: int) -> int | None:
    """Size of cpu0's unified or data cache of `level`, from sysfs."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if int((index / "level").read_text()) != level:
                continue
            if (index / "type").read_text().strip() not in ("Unified", "Data"):
                continue
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    return None


def cache_sizes() -> tuple[int, int]:
    """(L2 bytes of one core, L3 bytes), from sysfs where it says."""
    return (_sysfs_cache_bytes(2) or DEFAULT_L2_BYTES, _sysfs_cache_bytes(3) or DEFAULT_L3_BYTES)


def cache_bandwidth(quick: bool = False) -> dict[str, float]:
    """Read rates in GB/s of a buffer resident in L2 ("l2") and in L3 ("l3").

    Each thread reads half its core's L2 (resp. the threads share half the L3), many times per
    sample, so the data is read from that level and the sample lasts long enough to time."""
    l2_bytes, l3_bytes = cache_sizes()
    threads = max(1, torch.get_num_threads() if _C is None else _C.get_num_threads())
    l2_buf = max(1 << 20, threads * l2_bytes // 2)
    l3_buf = max(1 << 20, l3_bytes // 2)
    volume = (256 << 20) if quick else (1 << 30)  # bytes read per sample
    repeats = 3 if quick else 5
    return {
        "l2": stream_read(l2_buf, repeats, True, max(1, volume // l2_buf)).gbs,
        "l3": stream_read(l3_buf, repeats, True, max(1, volume // l3_buf)).gbs,
    }


# A read of DRAM must cover several times the L3 to miss it. 384 MiB is 12x the 32 MiB L3 these
# probes were first tuned on; a VM on a server part may be shown the whole socket's L3 (300 MB on
# one host, where 256 MB buffers streamed at 63-69 GB/s and DRAM at 36-38), so the size follows it.
MIN_DRAM_STREAM_BYTES = 384 << 20
DRAM_STREAM_L3_MULTIPLE = 4


def dram_stream_bytes() -> int:
    """Bytes a stream must cover to come from DRAM on this machine (see above)."""
    return max(MIN_DRAM_STREAM_BYTES, DRAM_STREAM_L3_MULTIPLE * cache_sizes()[1])


def dram_bandwidth(quick: bool = False, huge_pages: bool = True) -> ReadRate:
    """Streaming read of DRAM: 1 GiB or dram_stream_bytes(), whichever is larger, x 5 (quick:
    64 MiB x 3)."""
    if quick:
        return stream_read(64 << 20, 3, huge_pages)
    return stream_read(max(1 << 30, dram_stream_bytes()), 5, huge_pages)


def dram_bandwidth_beside(quick: bool = False) -> float:
    """A short DRAM probe (GB/s, huge pages) taken next to one case: the DRAM rate here swings
    by tens of percent within minutes, so each case is held to the rate measured beside it."""
    return stream_read(64 << 20, 1).gbs if quick else stream_read(dram_stream_bytes(), 3).gbs
