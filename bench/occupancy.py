"""Decode occupancy while a benchmark runs: how many streams the decode nodes hold at once.

`OccupancyWatcher` polls the router's /metrics (every `period_s`, in a thread) and sums the
decode nodes' `duet_node_running_requests` (requests in their running batches, from their
heartbeats). Its summary (peak and mean over the samples) is how the KV reservation policies are
compared: with the same pool, on-demand KV sustains more concurrent streams than reserving every
request's worst case up front.
"""

from __future__ import annotations

import re
import threading

import httpx

RUNNING = re.compile(r'^duet_node_running_requests\{[^}]*role="decode"[^}]*\} (\S+)$', re.M)


def decode_running(metrics_text: str) -> float:
    """The sum of the decode nodes' running requests in one /metrics page."""
    return sum(float(v) for v in RUNNING.findall(metrics_text))


class MetricsWatcher:
    """Reads the router's /metrics every `period_s` in a thread while a benchmark runs (a
    context manager), appending `sample(page)` to `samples`; a scrape that fails under load is
    skipped. `SAMPLE_AT_START`: the first sample at once, not after a period."""

    SAMPLE_AT_START = False

    def __init__(self, metrics_url: str, period_s: float = 0.25):
        self.url = metrics_url
        self.period_s = period_s
        self.samples: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics", daemon=True)

    def sample(self, page: str):
        raise NotImplementedError

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            if not self.SAMPLE_AT_START and self._stop.wait(self.period_s):
                return
            while True:
                try:
                    self.samples.append(self.sample(client.get(self.url).text))
                except httpx.HTTPError:
                    pass  # a slow scrape under load: skip this sample
                if self._stop.wait(self.period_s):
                    return


class OccupancyWatcher(MetricsWatcher):
    def sample(self, page: str) -> float:
        return decode_running(page)

    def summary(self) -> dict[str, float]:
        if not self.samples:
            return {"peak": 0.0, "mean": 0.0, "samples": 0}
        return {
            "peak": max(self.samples),
            "mean": sum(self.samples) / len(self.samples),
            "samples": len(self.samples),
        }
