"""PNG plots of serving benchmarks (matplotlib, Agg backend: no display needed).

- `plot_latency_cdfs`: CDFs of TTFT, TPOT, ITL and E2E latency of one run, SLA lines marked;
- `plot_timeline`: TTFT and TPOT of each request against its send time, failures marked;
- `plot_sweep`: goodput, p99 TTFT and p99 TPOT against request rate (or concurrency), one line
  per config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.serve_metrics import RequestRecord  # noqa: E402


def _cdf(ax, values_ms: list[float], title: str, sla_ms: float | None = None) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("share of samples")
    ax.grid(alpha=0.3)
    if not values_ms:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    xs = np.sort(np.asarray(values_ms))
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
    if sla_ms is not None:
        ax.axvline(sla_ms, color="red", linestyle="--", label=f"SLA {sla_ms:g} ms")
        ax.legend(loc="lower right")


def plot_latency_cdfs(
    records: list[RequestRecord], path: str | Path, ttft_ms: float, tpot_ms: float
) -> Path:
    """Write a 2x2 figure of latency CDFs over the successful requests; returns `path`."""
    ok = [r for r in records if r.ok]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    _cdf(axes[0, 0], [r.ttft_s * 1e3 for r in ok], "TTFT", ttft_ms)
    _cdf(axes[0, 1], [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None], "TPOT", tpot_ms)
    _cdf(axes[1, 0], [g * 1e3 for r in ok for g in r.itl_s], "Inter-token latency")
    _cdf(axes[1, 1], [r.latency_s * 1e3 for r in ok], "End-to-end latency")
    fig.suptitle(f"{len(ok)} of {len(records)} requests completed")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def plot_timeline(
    records: list[RequestRecord], path: str | Path, ttft_ms: float, tpot_ms: float
) -> Path:
    """Write TTFT and TPOT of each request against its send time (failures as red x)."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    series = (
        (axes[0], "TTFT (ms)", [(r.start_s, r.ttft_s) for r in ok], ttft_ms),
        (
            axes[1],
            "TPOT (ms)",
            [(r.start_s, r.tpot_s) for r in ok if r.tpot_s is not None],
            tpot_ms,
        ),
    )
    for ax, label, points, sla in series:
        if points:
            xs, ys = zip(*points, strict=True)
            ax.scatter(xs, np.asarray(ys) * 1e3, s=10, label="completed")
        if failed:
            ax.scatter(
                [r.start_s for r in failed],
                [0.0] * len(failed),
                marker="x",
                color="red",
                label=f"failed ({len(failed)})",
            )
        ax.axhline(sla, color="red", linestyle="--", label=f"SLA {sla:g} ms")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    axes[1].set_xlabel("request sent at (s since start)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def plot_sweep(runs: dict[str, list[dict[str, Any]]], path: str | Path, xlabel: str) -> Path:
    """Write goodput, p99 TTFT and p99 TPOT against the swept value (rate or concurrency).

    Args:
        runs: config label -> points {"x": swept value, "summary": bench-serve summary}; points
            at x = inf (all requests at once) are left out of the chart.
    """
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (
        (axes[0], "goodput (req/s)", lambda s: s["goodput"]),
        (axes[1], "p99 TTFT (ms)", lambda s: s["ttft_ms"]["p99"]),
        (axes[2], "p99 TPOT (ms)", lambda s: s["tpot_ms"]["p99"]),
    )
    sla, top = None, [0.0, 0.0, 0.0]
    for label, points in runs.items():
        points = sorted((p for p in points if np.isfinite(p["x"])), key=lambda p: p["x"])
        xs = [p["x"] for p in points]
        for i, (ax, _, value) in enumerate(panels):
            ys = np.array(
                [np.nan if value(p["summary"]) is None else value(p["summary"]) for p in points],
                dtype=float,
            )
            ax.plot(xs, ys, marker="o", label=label)
            if np.isfinite(ys).any():
                top[i] = max(top[i], float(np.nanmax(ys)))
        if points:
            sla = points[0]["summary"]["sla"]
    for i, (ax, title, _) in enumerate(panels):
        limit = None if sla is None or i == 0 else sla["ttft_ms" if i == 1 else "tpot_ms"]
        if limit is not None:
            title = f"{title}, SLA {limit:g} ms"
            ax.axhline(limit, color="red", linestyle="--", label="SLA")
            if limit > 2 * top[i] > 0:  # a far-away SLA line would flatten the data
                ax.set_ylim(0, 1.3 * top[i])
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
