"""The native-kernels switch, in one place: whether ops run on the C++ kernels (`native._C`) or
on their reference twins. Off when the extension is not built or DUET_NATIVE=0; tests flip it
to compare both paths. Every `native._*_ops` module reads it at call time.
"""

from __future__ import annotations

import os

import torch

try:
    from native import _C as extension
except ImportError:  # not built: every op takes the reference path
    extension = None

_enabled = extension is not None and os.environ.get("DUET_NATIVE", "1") != "0"


def native_available() -> bool:
    return _enabled


def set_native_enabled(enabled: bool) -> None:
    """Switches every op between the kernels and the reference twins (tests compare both)."""
    global _enabled
    _enabled = bool(enabled) and extension is not None


def kernels():
    """The extension module when the native path is on, else None."""
    return extension if _enabled else None


def set_num_threads(num_threads: int) -> None:
    """Threads used by the kernels (and by torch, for the ops still on the reference path)."""
    torch.set_num_threads(num_threads)
    if extension is not None:
        extension.set_num_threads(num_threads)
