"""Where a decode step's time goes: Python, this project's kernels, torch's operators.

Two ways to split a step, both reported by `python -m bench.decode_step`:

- `profile_split`, from cProfile: every function's own time. A deterministic profiler pays a
  hook on every Python call and return and books it to the Python side, so it overstates the
  share of Python in a step made of many small calls (about 1,800 a step at batch 1).
- `timed_split`, from timers around the native calls. Every function of `native._C` is
  wrapped with a clock around the call itself (the wrapper's own cost lands outside the
  interval, on the Python side), and the step's wall time is taken over the same steps, so
  the share of the step outside this project's kernels is 1 - kernels / wall, with nothing
  subtracted or estimated: torch's operators (allocations, views, a few copies) and the Python
  between the calls both count as outside. (Timing torch's operators apart, through a
  `TorchDispatchMode`, was tried: the mode's own dispatch, inside each interval, came to more
  than the whole outside share, so no finer split is reported.)
"""

from __future__ import annotations

import pstats
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from native.switch import extension


def profile_split(stats: pstats.Stats) -> dict:
    """Shares of the profiled time: Python bodies, our kernels (native._C), other C calls."""
    total = python = ours = 0.0
    for (filename, _, name), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        total += tottime
        if filename != "~":
            python += tottime
        elif "native._C" in name or "_C." in name and "torch" not in name:
            ours += tottime
    return {
        "python_share": python / total,
        "native_kernel_share": ours / total,
        "torch_c_share": (total - python - ours) / total,
    }


class _Clock:
    """Seconds spent inside the wrapped calls."""

    def __init__(self):
        self.kernels = 0.0


def _timed(fn: Callable, clock: _Clock) -> Callable:
    def call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.kernels += time.perf_counter() - started

    return call


def _kernel_functions() -> dict[str, Callable]:
    return {
        name: fn
        for name in dir(extension)
        if not name.startswith("_")
        and type(fn := getattr(extension, name)).__name__ == "builtin_function_or_method"
    }


@contextmanager
def kernel_timers() -> Iterator[_Clock]:
    """Within the block every `native._C` function adds its wall time to the clock it yields;
    the functions are restored on the way out."""
    clock = _Clock()
    originals = _kernel_functions()
    for name, fn in originals.items():
        setattr(extension, name, _timed(fn, clock))
    try:
        yield clock
    finally:
        for name, fn in originals.items():
            setattr(extension, name, fn)


def timed_split(step: Callable[[], object], steps: int) -> dict:
    """Shares of the wall time of `steps` calls of `step` inside this project's kernels and
    outside them (everything else: torch's operators and Python)."""
    if extension is None:
        raise RuntimeError("the native extension is not built: nothing to time")
    with kernel_timers() as clock:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - started
    return {
        "outside_kernels_share": max(0.0, wall - clock.kernels) / wall,
        "native_kernel_share": clock.kernels / wall,
    }
