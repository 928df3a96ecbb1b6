"""Handing freed heap memory back to the OS while a model loads.

Packing a weight makes temporaries of tens of MB (the raw matrix, its fp32 copy, the quantizer's
intermediates) that are freed at once, between allocations that stay (the packed weights).
glibc raises its mmap threshold to the size of the largest chunk freed (up to 32 MiB), so these
temporaries soon come from the heap, and the holes they leave between kept blocks stay resident:
loading the bench model in int8 otherwise ends with ~0.35 GB more resident than the weights it
holds. `malloc_trim(0)` returns every free page inside the heap (madvise), not only its top; the
model calls it after each layer, so the garbage of one layer at most is resident at a time.
Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


_TRIM = _malloc_trim()


def release_free_heap() -> None:
    """Returns the heap's free pages to the OS (glibc's malloc_trim; a no-op elsewhere)."""
    if _TRIM is not None:
        _TRIM(0)
