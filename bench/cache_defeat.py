"""How a `duet bench-kernels` case keeps its inputs out of the caches, or says where they sit.

A weight read from L3 instead of DRAM would flatter a bandwidth-bound case, so a case rotates
through enough copies of its inputs (`cycling`) that one round streams at least
`cache_defeat_bytes()` (roof_probes.dram_stream_bytes: 384 MiB, 12x the 32 MiB L3 this was tuned
on, or 4x a larger L3); it is then held to the DRAM roof. 4x a 32 MiB L3 was not enough:
the L3's adaptive replacement keeps part of a working set a few times its size (a 156 MB round
of int4 experts read at 1.2x the DRAM roof; int8 GEMVs over 160 MB rounds ran 10-40% faster
than over 640 MB ones, int4 ones not, in one interleaved run). A case whose inputs
are too small to rotate that far (capped at MAX_COPIES) is cache-resident, held to the L2 or L3
roof (`memory_level`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from bench import roof_probes

# Tiny inputs (a decode-token rmsnorm) would need ten thousand copies: such a case stays in cache.
MAX_COPIES = 256


def cache_defeat_bytes() -> int:
    """Bytes one round of a rotation streams, at least, to come from DRAM."""
    return roof_probes.dram_stream_bytes()


def copies_to_defeat(bytes_per_call: int) -> int:
    """Copies of a case's inputs to rotate so one round streams cache_defeat_bytes() (capped)."""
    return max(1, min(MAX_COPIES, math.ceil(cache_defeat_bytes() / max(1, bytes_per_call))))


def memory_level(round_bytes: int) -> str:
    """The level a case's inputs stream from, given the distinct bytes one round of its rotation
    reads: "dram" from cache_defeat_bytes() up, else "l2" if they fit one core's L2, else "l3"
    (a round between L3 and cache_defeat_bytes() partly hits L3: its L3 roof is the higher one)."""
    if round_bytes >= cache_defeat_bytes():
        return "dram"
    l2_bytes, _ = roof_probes.cache_sizes()
    return "l2" if round_bytes <= l2_bytes else "l3"


def cycling(items: list) -> Callable[[], object]:
    """A callable returning items[0], items[1], ... round robin (one per timed call)."""
    state = {"i": -1}

    def next_item():
        state["i"] = (state["i"] + 1) % len(items)
        return items[state["i"]]

    return next_item
