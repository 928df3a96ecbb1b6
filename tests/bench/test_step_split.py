"""The decode step's split by timers around the native calls (bench/step_split.py)."""

from __future__ import annotations

import pytest
import torch

from bench.step_split import kernel_timers, timed_split
from native import ops
from native.switch import extension, native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="native extension not built")


def _functions():
    return {n: getattr(extension, n) for n in dir(extension) if not n.startswith("_")}


def test_timers_count_kernel_calls_only_and_restore_every_function():
    before = _functions()
    weight = ops.prepack_linear(torch.randn(256, 512).bfloat16())
    x = torch.randn(1, 512).bfloat16()
    expected = ops.linear(x, weight)
    with kernel_timers() as clock:
        assert clock.kernels == 0.0
        torch.randn(64, 64) @ torch.randn(64, 64)  # torch's own work is not a kernel of ours
        assert clock.kernels == 0.0
        y = ops.linear(x, weight)
        assert clock.kernels > 0.0
    assert torch.equal(y, expected)  # the wrapped call returns what the kernel returns
    assert _functions() == before


def test_timers_restore_every_function_when_the_block_raises():
    before = _functions()
    with pytest.raises(RuntimeError, match="boom"), kernel_timers():
        raise RuntimeError("boom")
    assert _functions() == before


def test_timed_split_shares_sum_to_one():
    weight = ops.prepack_linear(torch.randn(512, 1024).bfloat16())
    x = torch.randn(1, 1024).bfloat16()
    split = timed_split(lambda: ops.linear(x, weight), steps=5)
    assert split["native_kernel_share"] > 0.0
    assert split["outside_kernels_share"] >= 0.0
    assert split["native_kernel_share"] + split["outside_kernels_share"] == pytest.approx(1.0)
    no_kernel = timed_split(lambda: sum(range(1000)), steps=3)
    assert no_kernel == {"outside_kernels_share": 1.0, "native_kernel_share": 0.0}
