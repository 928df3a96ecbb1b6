"""What a duet router's /metrics says moved during a benchmark run: the prompt KV rows the prefill
nodes sent and those they did not send because the decode node held them (decode-side prefix
reuse), summed over the nodes, as the difference of two scrapes.

The nodes report these counters in their heartbeats, so a scrape lags by up to one heartbeat
interval: `settled` scrapes until two scrapes a heartbeat apart agree. Another server (vLLM,
SGLang) has no such counters: the figures are then absent, never zero.
"""

from __future__ import annotations

import time

import httpx

COUNTERS = {
    "kv_rows_sent": "duet_kv_rows_sent_total",
    "kv_rows_skipped": "duet_kv_rows_skipped_total",
}


def scrape(url: str) -> dict[str, float] | None:
    """The counters summed over every node, or None when the server exposes none of them."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    totals: dict[str, float] = {}
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        name = sample.split("{", 1)[0]
        for key, metric in COUNTERS.items():
            if name == metric:
                totals[key] = totals.get(key, 0.0) + float(value)
    return totals or None


def settled(url: str, interval_s: float = 2.0, timeout_s: float = 30.0) -> dict[str, float] | None:
    """`scrape` once the counters stopped moving (two scrapes `interval_s` apart agree)."""
    last, deadline = scrape(url), time.monotonic() + timeout_s
    while last is not None and time.monotonic() < deadline:
        time.sleep(interval_s)
        now = scrape(url)
        if now == last:
            return now
        last = now
    return last


def moved(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, int]:
    """The counters' growth over the run ({} when the server has none)."""
    if before is None or after is None:
        return {}
    return {key: int(after.get(key, 0.0) - before.get(key, 0.0)) for key in COUNTERS}
