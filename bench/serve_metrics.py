"""Per-request records of a serving benchmark and the summary computed from them.

Definitions (those of `vllm bench serve`):
- TTFT: request sent -> first streamed chunk with text;
- ITL: gaps between successive text chunks of a request (all requests pooled);
- TPOT: (latency - TTFT) / (output tokens - 1), per request with more than one output token;
- E2E: request sent -> stream finished;
- SLA met: the request succeeded, TTFT <= ttft_ms and (TPOT <= tpot_ms or one output token);
- rejected: refused at admission (HTTP 503 or 429: the server said "not now", nothing ran);
  SLA attainment of admitted requests = SLA met / (requests - rejected), what SLA admission
  control is judged by;
- goodput: requests that met the SLA per second of benchmark duration;
- throughputs: successful requests, their prompt tokens and output tokens, per second.
Percentiles are numpy's (linear interpolation) over successful requests only.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
REJECTIONS = ("http_503", "http_429")  # error kinds of a request refused at admission


@dataclasses.dataclass
class RequestRecord:
    """What happened to one request. Times in seconds; `start_s` from the benchmark start."""

    index: int
    start_s: float
    prompt_len: int  # prompt tokens: the server's usage.prompt_tokens, else the dataset's
    expected_output_len: int  # max_tokens asked for
    ok: bool = False
    error: str | None = None  # error kind (http_503, stream_error, timeout, ...) when not ok
    error_message: str = ""
    output_len: int = 0
    usage_reported: bool = False  # output_len came from the stream's usage, not the tokenizer
    ttft_s: float | None = None
    latency_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = dataclasses.field(default_factory=list)
    conversation: int | None = None  # multi-turn: the conversation and its turn (from 1)
    turn: int | None = None

    def met_sla(self, ttft_ms: float, tpot_ms: float) -> bool:
        if not self.ok or self.ttft_s is None or self.ttft_s * 1e3 > ttft_ms:
            return False
        return self.tpot_s is None or self.tpot_s * 1e3 <= tpot_ms


def stats_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 (ms) of values in seconds; None for each when empty."""
    if not values_s:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    arr = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(arr, PERCENTILES)
    return {"mean": float(arr.mean()), "median": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(
    records: list[RequestRecord], duration_s: float, ttft_ms: float, tpot_ms: float
) -> dict[str, Any]:
    """The benchmark summary; every number is a function of `records` and `duration_s`."""
    ok = [r for r in records if r.ok]
    met = sum(r.met_sla(ttft_ms, tpot_ms) for r in records)
    errors = Counter(r.error for r in records if not r.ok)
    rejected = sum(errors.get(kind, 0) for kind in REJECTIONS)
    admitted = len(records) - rejected
    duration_s = max(duration_s, 1e-9)
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(sorted(errors.items())),
        "duration_s": duration_s,
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": sum(r.output_len for r in ok),
        "request_throughput": len(ok) / duration_s,
        "input_throughput": sum(r.prompt_len for r in ok) / duration_s,
        "output_throughput": sum(r.output_len for r in ok) / duration_s,
        "ttft_ms": stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": stats_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": stats_ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": stats_ms([r.latency_s for r in ok]),
        "sla": {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms},
        "sla_met": met,
        "sla_attainment": met / len(records) if records else 0.0,
        "rejected": rejected,
        "sla_attainment_admitted": met / admitted if admitted else 0.0,
        "goodput": met / duration_s,
        **_by_turn(ok),
    }


def _by_turn(ok: list[RequestRecord]) -> dict[str, Any]:
    """Multi-turn runs: TTFT of first turns (nothing to reuse) apart from the later ones."""
    if not any(r.turn is not None for r in ok):
        return {}
    return {
        "ttft_ms_first_turn": stats_ms([r.ttft_s for r in ok if r.turn == 1]),
        "ttft_ms_later_turns": stats_ms([r.ttft_s for r in ok if (r.turn or 0) >= 2]),
        "prompt_tokens_first_turn": sum(r.prompt_len for r in ok if r.turn == 1),
        "prompt_tokens_later_turns": sum(r.prompt_len for r in ok if (r.turn or 0) >= 2),
    }


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(summary: dict[str, Any], title: str = "Serving benchmark") -> str:
    """The summary as a fixed-width text table."""
    width = 56
    lines = [f"{' ' + title + ' ':=^{width}}"]

    def row(name: str, value: str) -> None:
        lines.append(f"{name:<38}{value:>{width - 38}}")

    row("Requests (completed / sent)", f"{summary['completed']} / {summary['num_requests']}")
    row("Failed requests", str(summary["failed"]))
    for kind, count in summary["errors"].items():
        row(f"  {kind}", str(count))
    row("Duration (s)", _fmt(summary["duration_s"]))
    row("Total input tokens", str(summary["total_input_tokens"]))
    row("Total output tokens", str(summary["total_output_tokens"]))
    row("Request throughput (req/s)", _fmt(summary["request_throughput"], 3))
    row("Input token throughput (tok/s)", _fmt(summary["input_throughput"]))
    row("Output token throughput (tok/s)", _fmt(summary["output_throughput"]))
    sla = summary["sla"]
    row(
        f"SLA (TTFT <= {sla['ttft_ms']:g} ms, TPOT <= {sla['tpot_ms']:g} ms) met",
        f"{summary['sla_met']} ({100 * summary['sla_attainment']:.1f}%)",
    )
    if summary.get("rejected"):
        row("Rejected at admission (503/429)", str(summary["rejected"]))
        row("SLA met among admitted", f"{100 * summary['sla_attainment_admitted']:.1f}%")
    row("Goodput (req/s)", _fmt(summary["goodput"], 3))
    sections = [
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "E2E latency"),
    ]
    if "ttft_ms_first_turn" in summary:
        sections += [
            ("ttft_ms_first_turn", "TTFT, turn 1"),
            ("ttft_ms_later_turns", "TTFT, turns 2+"),
        ]
    for key, name in sections:
        lines.append(f"{' ' + name + ' (ms) ':-^{width}}")
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{stat.capitalize()} {name}", _fmt(summary[key][stat]))
    if summary.get("kv_rows"):  # a duet router's counters over the run (bench.server_counters)
        rows = summary["kv_rows"]
        lines.append(f"{' Prompt KV rows (server) ':-^{width}}")
        row("Sent by prefill nodes", str(rows["kv_rows_sent"]))
        row("Not sent (the decode node held them)", str(rows["kv_rows_skipped"]))
    lines.append("=" * width)
    return "\n".join(lines)
