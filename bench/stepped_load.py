"""A stepped load for `duet bench-serve --load-steps RATE:SECONDS,...` (e.g. `2:45,8:45,2:45`:
low, four times that, low): Poisson arrivals at each step's rate for its seconds, the SLA
attainment of the requests sent in each step, and what the cluster spent on it, in node-seconds.

Node-seconds are read from the router's /metrics while the load runs (`NodeWatcher`): every
`period_s` the nodes it reports up (`duet_node_up`, joined ones included), integrated over the
run. A fixed 1P1D spends 2 node-seconds a second; an autoscaled cluster what it ran.
"""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np

from bench.occupancy import MetricsWatcher
from bench.serve_metrics import RequestRecord, stats_ms
from control.errors import ConfigError

NODE_UP = re.compile(r'^duet_node_up\{[^}]*role="(prefill|decode)"[^}]*\} (\S+)$', re.M)


def parse_steps(text: str) -> list[tuple[float, float]]:
    """`RATE:SECONDS,...` -> [(rate, seconds)]; ConfigError for anything else."""
    steps = []
    for part in text.split(","):
        rate, sep, seconds = part.partition(":")
        try:
            step = (float(rate), float(seconds))
        except ValueError:
            step = None
        if not sep or step is None or not (step[0] > 0 and step[1] > 0) or np.isinf(step[0]):
            raise ConfigError(f"--load-steps: {part!r} is not RATE:SECONDS (both > 0, finite)")
        steps.append(step)
    return steps


def step_bounds(steps: list[tuple[float, float]]) -> list[float]:
    """Each step's start offset, and the end of the last."""
    return [0.0, *np.cumsum([seconds for _, seconds in steps]).tolist()]


def stepped_arrivals(steps: list[tuple[float, float]], seed: int) -> np.ndarray:
    """Send offsets (s): a Poisson process at each step's rate within that step."""
    rng = np.random.default_rng(seed)
    bounds = step_bounds(steps)
    out: list[float] = []
    for (rate, _), start, end in zip(steps, bounds, bounds[1:], strict=False):
        t = start + rng.exponential(1.0 / rate)
        while t < end:
            out.append(t)
            t += rng.exponential(1.0 / rate)
    return np.asarray(out)


def by_step(
    records: list[RequestRecord],
    steps: list[tuple[float, float]],
    ttft_ms: float,
    tpot_ms: float,
    arrivals: np.ndarray,
) -> list[dict[str, Any]]:
    """Per step: its rate and length, the requests scheduled in it, how many completed and met
    the SLA, and their TTFT."""
    bounds = step_bounds(steps)
    out = []
    for (rate, seconds), start, end in zip(steps, bounds, bounds[1:], strict=False):
        mine = [r for r in records if start <= arrivals[r.index] < end]
        met = sum(r.met_sla(ttft_ms, tpot_ms) for r in mine)
        out.append(
            {
                "rate": rate,
                "seconds": seconds,
                "requests": len(mine),
                "completed": sum(r.ok for r in mine),
                "sla_met": met,
                "sla_attainment": met / len(mine) if mine else 0.0,
                "ttft_ms": stats_ms([r.ttft_s for r in mine if r.ok]),
            }
        )
    return out


def nodes_up(metrics_text: str) -> dict[str, float]:
    """Nodes up per role in one /metrics page."""
    counts = {"prefill": 0.0, "decode": 0.0}
    for role, value in NODE_UP.findall(metrics_text):
        counts[role] += float(value)
    return counts


class NodeWatcher(MetricsWatcher):
    """The nodes up while a load runs, (time, per role) from the start; `summary()` integrates
    them."""

    SAMPLE_AT_START = True

    def __init__(self, metrics_url: str, period_s: float = 0.5):
        super().__init__(metrics_url, period_s)

    def sample(self, page: str) -> tuple[float, dict[str, float]]:
        return time.monotonic(), nodes_up(page)

    def summary(self) -> dict[str, Any]:
        """Node-seconds per role and in all (each sample held until the next), and the peak."""
        seconds = {"prefill": 0.0, "decode": 0.0}
        for (t0, up), (t1, _) in zip(self.samples, self.samples[1:], strict=False):
            for role in seconds:
                seconds[role] += up[role] * (t1 - t0)
        totals = [sum(up.values()) for _, up in self.samples]
        return {
            "node_seconds": sum(seconds.values()),
            "node_seconds_by_role": seconds,
            "peak_nodes": max(totals, default=0.0),
            "samples": len(self.samples),
        }
