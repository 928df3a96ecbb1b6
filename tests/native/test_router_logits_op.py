"""ops.router_logits (native/csrc/router_logits.cpp) against its twin, F.linear in fp32 (the
oracle), on every ISA path: bf16 and fp32 activations and gates, strided rows, tails shorter
than a vector, one and two threads."""

from __future__ import annotations

import pytest
import torch

from native import ops, reference


def _close(got: torch.Tensor, x: torch.Tensor, gate: torch.Tensor) -> None:
    expected = reference.router_logits(x, gate)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    # fp32 sums of K products in another order: a few ulps of the sum of |products|.
    bound = (x.float().abs() @ gate.float().abs().T) * (x.shape[1] * 2.0**-24) + 1e-30
    assert ((got - expected).abs() <= bound).all()


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "tokens,experts,k", [(1, 64, 2048), (3, 160, 5120), (2, 7, 13), (33, 64, 200), (0, 4, 8)]
)
def test_equals_fp32_linear(isa, x_dtype, gate_dtype, tokens, experts, k):
    g = torch.Generator().manual_seed(tokens * 7 + experts + k)
    x = torch.randn(tokens, k, generator=g).to(x_dtype)
    gate = torch.randn(experts, k, generator=g).to(gate_dtype)
    _close(ops.router_logits(x, gate), x, gate)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_strided_rows_and_threads(isa, num_threads):
    previous = torch.get_num_threads()
    ops.set_num_threads(num_threads)
    try:
        g = torch.Generator().manual_seed(1)
        wide = torch.randn(5, 300, generator=g).to(torch.bfloat16)
        x = wide[:, 10:110]  # rows of stride 300
        gate = torch.randn(48, 100, generator=g)
        _close(ops.router_logits(x, gate), x, gate)
    finally:
        ops.set_num_threads(previous)


def test_uncovered_dtype_runs_the_twin(isa):
    x = torch.randn(2, 16).to(torch.float16)
    gate = torch.randn(4, 16)
    assert torch.equal(ops.router_logits(x, gate), reference.router_logits(x, gate))


def test_exact_on_integers(isa):
    """Small integers sum exactly in any order: the kernel must hit the oracle bit for bit."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-8, 9, (4, 777), generator=g).to(torch.bfloat16)
    gate = torch.randint(-8, 9, (9, 777), generator=g).to(torch.float32)
    assert torch.equal(ops.router_logits(x, gate), reference.router_logits(x, gate))
