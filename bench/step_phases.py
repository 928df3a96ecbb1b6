"""The phases of a decode step with MTP: the main model's forward (the verify pass), the MTP
layer's draft pass, and how many routed experts each MoE layer of the main forward reads.

A verify step feeds each speculating request's last token and its drafts through the main model
together, so every weight read once serves all those rows, except the routed experts: each row
picks its own top-k, and the experts read are the union of the rows' picks. `phase_timers`
measures exactly that: the wall time of the two forwards and the mean size of that union per
MoE layer, per step (`python -m bench.decode_step --phases`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from model.layers import MoE


class Phases:
    """Totals over the steps run inside `phase_timers`."""

    def __init__(self):
        self.main_s = 0.0  # main-model forwards (with MTP: the verify passes)
        self.draft_s = 0.0  # MTP-layer forwards
        self.main_forwards = 0
        self.expert_reads = 0  # unique routed experts per MoE call of the main forwards, summed
        self.moe_calls = 0
        self._in_main = False

    def per_step(self, steps: int) -> dict:
        return {
            "main_ms": self.main_s * 1000 / steps,
            "draft_ms": self.draft_s * 1000 / steps,
            "experts_per_moe_layer": self.expert_reads / max(1, self.moe_calls),
        }


def _timed(fn: Callable, phases: Phases, attr: str, main: bool) -> Callable:
    def call(*args, **kwargs):
        phases._in_main = main
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(phases, attr, getattr(phases, attr) + time.perf_counter() - started)
            phases._in_main = False

    return call


def _counting(fn: Callable, phases: Phases) -> Callable:
    def routed(x, weights, ids):
        if phases._in_main:
            phases.expert_reads += int(ids.unique().numel())
            phases.moe_calls += 1
        return fn(x, weights, ids)

    return routed


@contextmanager
def phase_timers(model) -> Iterator[Phases]:
    """Within the block the model's forwards are timed and its MoE layers' routed experts
    counted (instance attributes shadow the methods; removed on the way out)."""
    phases = Phases()
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    saved = [moe.routed_experts for moe in moes]
    for moe in moes:
        moe.routed_experts = _counting(moe.routed_experts, phases)
    model.forward = _timed(type(model).forward.__get__(model), phases, "main_s", True)
    model.forward_with_hidden = _timed(
        type(model).forward_with_hidden.__get__(model), phases, "main_s", True
    )
    model.forward_mtp = _timed(type(model).forward_mtp.__get__(model), phases, "draft_s", False)
    try:
        yield phases
    finally:
        for name in ("forward", "forward_with_hidden", "forward_mtp"):
            del model.__dict__[name]
        for moe, fn in zip(moes, saved, strict=True):
            moe.routed_experts = fn
