"""ops.argmax_rows (native/csrc/argmax.cpp) against its twin, torch.argmax (the oracle), on every
ISA path: ties (the first index wins), NaN (the first NaN wins), infinities, signed zeros, rows
shorter than a vector and tails past the last whole one, strided rows."""

from __future__ import annotations

import pytest
import torch

from native import _C, ops
from native import reference_sampling as ref

NAN, INF = float("nan"), float("inf")


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Random rows, coarsely rounded so that equal maxima (ties) are common."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * 4).round() / 4


@pytest.mark.parametrize(
    "rows,vocab", [(1, 1), (1, 15), (2, 16), (3, 17), (4, 100), (7, 32000), (33, 1003), (0, 5)]
)
def test_random_rows_with_ties_equal_the_twin(isa, rows, vocab):
    x = _logits(rows, vocab, seed=rows * 1000 + vocab)
    got = ops.argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, ref.argmax_rows(x))


@pytest.mark.parametrize("vocab", [5, 16, 40, 1000])
def test_special_values_equal_the_twin(isa, vocab):
    cases = []
    base = torch.zeros(vocab)
    for positions, value in (
        ((vocab // 2,), NAN),  # one NaN beats every number
        ((vocab - 1, 1), NAN),  # the first NaN wins, wherever it lies
        ((vocab - 1,), INF),
        ((0, vocab - 1), INF),  # equal maxima: the first
        ((vocab // 3,), -0.0),  # -0.0 == 0.0: the first zero wins
    ):
        row = base.clone()
        for p in positions:
            row[p] = value
        cases.append(row)
    cases.append(torch.full((vocab,), -INF))  # masked everywhere: index 0
    ramp = torch.arange(vocab, dtype=torch.float32)
    cases += [ramp, ramp.flip(0), torch.full((vocab,), 3.0)]
    x = torch.stack(cases)
    assert torch.equal(ops.argmax_rows(x), ref.argmax_rows(x))
    # the tail alone: a NaN or the maximum past the last whole vector
    tail = torch.zeros(1, vocab)
    tail[0, -1] = 5.0
    assert ops.argmax_rows(tail).item() == vocab - 1


def test_strided_rows_and_threads(isa):
    wide = _logits(9, 700, seed=5)
    x = wide[:, 3:603]  # row stride 700, unit stride in a row
    want = ref.argmax_rows(x)
    assert torch.equal(ops.argmax_rows(x), want)
    threads = _C.get_num_threads()
    try:
        ops.set_num_threads(1)
        assert torch.equal(ops.argmax_rows(x), want)
    finally:
        ops.set_num_threads(threads)
    column_major = wide.t().contiguous().t()[:, 3:603]  # the same values, no unit stride in a row
    assert torch.equal(ops.argmax_rows(column_major), want)


def test_bad_input_is_refused(isa):
    with pytest.raises(ValueError, match="fp32"):
        ops.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="V >= 1"):
        ops.argmax_rows(torch.zeros(2, 0))
    with pytest.raises(ValueError, match="fp32"):
        ops.argmax_rows(torch.zeros(5))
