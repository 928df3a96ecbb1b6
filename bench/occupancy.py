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


class OccupancyWatcher:
    def __init__(self, metrics_url: str, period_s: float = 0.25):
        self.url = metrics_url
        self.period_s = period_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="occupancy", daemon=True)

    def __enter__(self) -> OccupancyWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while not self._stop.wait(self.period_s):
                try:
                    self.samples.append(decode_running(client.get(self.url).text))
                except httpx.HTTPError:
                    pass  # a slow scrape under load: skip this sample

    def summary(self) -> dict[str, float]:
        if not self.samples:
            return {"peak": 0.0, "mean": 0.0, "samples": 0}
        return {
            "peak": max(self.samples),
            "mean": sum(self.samples) / len(self.samples),
            "samples": len(self.samples),
        }
