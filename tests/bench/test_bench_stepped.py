"""`bench-serve --load-steps`: the arrivals of a stepped load, each step's attainment from
records whose outcome is known, node-seconds integrated from known /metrics samples, and a
stepped run against a fake server whose /metrics reports a node count that changes."""

import math

import numpy as np
import pytest
from bench_fakes import FakeBehavior, ServerThread, make_app
from fastapi.responses import PlainTextResponse

from bench import serve
from bench.serve_metrics import RequestRecord
from bench.stepped_load import (
    NodeWatcher,
    by_step,
    nodes_up,
    parse_steps,
    step_bounds,
    stepped_arrivals,
)
from control.errors import ConfigError


def test_steps_parse_and_bad_ones_are_refused():
    assert parse_steps("2:45,8:45,2.5:10") == [(2.0, 45.0), (8.0, 45.0), (2.5, 10.0)]
    for bad in ("2", "2:0", "0:5", "-1:5", "a:5", "inf:5", "2:45,"):
        with pytest.raises(ConfigError, match="RATE:SECONDS"):
            parse_steps(bad)


def test_arrivals_follow_each_steps_rate():
    steps = [(5.0, 400.0), (20.0, 400.0), (5.0, 400.0)]
    arrivals = stepped_arrivals(steps, seed=7)
    assert np.all(np.diff(arrivals) > 0) and arrivals[0] > 0 and arrivals[-1] < 1200
    bounds = step_bounds(steps)
    assert bounds == [0.0, 400.0, 800.0, 1200.0]
    for (rate, seconds), start, end in zip(steps, bounds, bounds[1:], strict=False):
        count = np.sum((arrivals >= start) & (arrivals < end))
        mean = rate * seconds  # Poisson: within 5 standard deviations of its mean
        assert abs(count - mean) < 5 * math.sqrt(mean), (rate, count)
    assert np.array_equal(arrivals, stepped_arrivals(steps, seed=7))  # the seed decides


def _record(index, ok, ttft_s, tpot_s=0.01):
    return RequestRecord(index, 0.0, 4, 4, ok=ok, ttft_s=ttft_s if ok else None, tpot_s=tpot_s)


def test_each_step_counts_the_requests_scheduled_in_it():
    steps = [(1.0, 10.0), (4.0, 10.0)]
    arrivals = np.array([1.0, 9.9, 10.0, 12.0, 19.0])
    records = [
        _record(0, True, 0.1),
        _record(1, True, 2.0),  # TTFT over the SLA
        _record(2, True, 0.1),
        _record(3, False, None),
        _record(4, True, 0.2, tpot_s=0.5),  # TPOT over the SLA
    ]
    first, second = by_step(records, steps, 1000.0, 50.0, arrivals)
    assert (first["requests"], first["completed"], first["sla_met"]) == (2, 2, 1)
    assert (second["requests"], second["completed"], second["sla_met"]) == (3, 2, 1)
    assert first["sla_attainment"] == 0.5 and second["sla_attainment"] == pytest.approx(1 / 3)
    assert first["ttft_ms"]["median"] == pytest.approx(1050.0)


METRICS = """# HELP duet_node_up 1 if the node is ready and alive
duet_node_up{node="d0",role="decode"} 1.0
duet_node_up{node="p0",role="prefill"} 1.0
duet_node_up{node="auto-prefill-1",role="prefill"} 1.0
duet_node_up{node="d1",role="decode"} 0.0
duet_node_running_requests{node="d0",role="decode"} 3.0
"""


def test_node_seconds_integrate_the_samples():
    assert nodes_up(METRICS) == {"prefill": 2.0, "decode": 1.0}
    watcher = NodeWatcher("http://unused/metrics")
    watcher.samples = [
        (0.0, {"prefill": 1.0, "decode": 1.0}),
        (2.0, {"prefill": 2.0, "decode": 1.0}),
        (5.0, {"prefill": 1.0, "decode": 1.0}),
    ]
    summary = watcher.summary()
    assert summary["node_seconds_by_role"] == {"prefill": 2.0 + 6.0, "decode": 5.0}
    assert summary["node_seconds"] == 13.0 and summary["peak_nodes"] == 3.0


def test_a_stepped_run_reports_steps_and_node_seconds(tmp_path, capsys):
    app, state = make_app(FakeBehavior(ttft_s=0.0, itl_s=0.0))

    @app.get("/metrics")
    async def metrics():  # a second prefill node once 10 requests came
        extra = len(state.received) >= 10
        return PlainTextResponse(
            'duet_node_up{node="p0",role="prefill"} 1\n'
            'duet_node_up{node="d0",role="decode"} 1\n'
            f'duet_node_up{{node="auto-prefill-1",role="prefill"}} {int(extra)}\n'
        )

    argv = ["--url", "", "--out", str(tmp_path), "--no-progress", "--seed", "3", "--no-plots"]
    argv += ["--load-steps", "20:0.5,60:0.5", "--input-len", "2", "--output-len", "2"]
    with ServerThread(app) as server:
        argv[1] = server.url
        assert serve.main(argv) == 0
    out = capsys.readouterr().out
    want = len(stepped_arrivals([(20.0, 0.5), (60.0, 0.5)], seed=3))
    assert len(state.received) == want
    assert "step 20/s for 0.5 s" in out and "step 60/s for 0.5 s" in out
    assert "node-seconds" in out and "(peak 3 nodes)" in out


def test_load_steps_are_refused_with_multi_turn():
    argv = ["--url", "http://x", "--dataset", "multi-turn", "--load-steps", "1:1"]
    with pytest.raises(ConfigError, match="multi-turn"):
        serve.resolve(serve.build_parser().parse_args(argv))
