"""The planner's cluster simulation against closed forms: the M/D/1 mean wait
(Pollaczek-Khinchine) on the prefill side, TPOT = the step time for a decode node that never
waits, and the regimes where nothing can meet the SLA."""

import math

import pytest

from control.cost_model import DecodeCost, PrefillCost
from deploy.plan_model import Layout, Workload, _simulate_prefill, mean_wait_md1, simulate

FIXED = 1e9  # a prior this strong is the model: no samples are observed


def prefill_taking(seconds: float) -> PrefillCost:
    return PrefillCost(prior=(seconds, 0.0, 0.0), prior_weight=FIXED)


def decode_taking(per_step: float, per_request: float = 0.0) -> DecodeCost:
    return DecodeCost(prior=(per_step, per_request, 0.0), prior_weight=FIXED)


@pytest.mark.parametrize("load", [0.3, 0.6, 0.8])
def test_prefill_wait_matches_pollaczek_khinchine(load):
    service = 0.1
    rate = load / service
    # One prompt a forward (its 64 tokens fill the budget): service = the prior, M/D/1.
    layout = Layout(1, 1, 64, chunk_size=1024, max_batch_tokens=64)
    # TTFT target: the bare service time, so only requests that never waited meet it.
    w = Workload(64, 2, rate, ttft_s=service + 1e-9, tpot_s=10.0)
    p = simulate(
        w,
        layout,
        prefill_taking(service),
        decode_taking(0.001),
        overhead_s=0.0,
        num_requests=40000,
        seed=1,
    )
    assert p.prefill_load == pytest.approx(load)
    assert p.mean_ttft_s - service == pytest.approx(mean_wait_md1(rate, service), rel=0.08)
    assert p.p_ttft == pytest.approx(1 - load, abs=0.02)  # M/D/1: P(no wait) = 1 - load


def test_two_prefill_nodes_pool_their_queues():
    """Join-the-shortest-queue over two nodes beats one node at half the rate."""
    service = 0.1
    layout1, layout2 = Layout(1, 1, 64, 1024, 64), Layout(2, 1, 64, 1024, 64)
    w1 = Workload(64, 2, rate=6.0, ttft_s=0.15, tpot_s=10.0)
    w2 = Workload(64, 2, rate=12.0, ttft_s=0.15, tpot_s=10.0)
    one = simulate(w1, layout1, prefill_taking(service), decode_taking(0.001), 0.0, 20000, 3)
    two = simulate(w2, layout2, prefill_taking(service), decode_taking(0.001), 0.0, 20000, 3)
    assert two.prefill_load == pytest.approx(one.prefill_load)
    assert two.p_ttft > one.p_ttft


def test_tpot_is_the_step_time_when_nobody_waits():
    """A request joins at the next step boundary: its TPOT is the step time plus at most one
    step spread over its output_len - 1 steps."""
    step, out = 0.02, 16
    layout = Layout(1, 1, max_batch=1000, chunk_size=1024)
    worst = step * out / (out - 1)
    for target, expected in ((worst * 1.001, 1.0), (step * 0.999, 0.0)):
        w = Workload(64, out, rate=5.0, ttft_s=10.0, tpot_s=target)
        p = simulate(w, layout, prefill_taking(0.01), decode_taking(step), 0.0, 2000, 4)
        assert step <= p.median_tpot_s <= worst
        assert p.p_tpot == expected


def test_batch_cap_makes_requests_wait():
    """With a cap of one request, a second one waits for the first's whole decode."""
    step = 0.01
    w = Workload(64, 11, rate=50.0, ttft_s=10.0, tpot_s=step * 1.5)
    capped = simulate(
        w, Layout(1, 1, 1, 1024), prefill_taking(0.001), decode_taking(step), 0.0, 2000, 5
    )
    free = simulate(
        w, Layout(1, 1, 1000, 1024), prefill_taking(0.001), decode_taking(step), 0.0, 2000, 5
    )
    assert free.p_tpot == 1.0 and capped.p_tpot < 0.5


def test_overloaded_decode_misses_tpot():
    """Each running request adds 1 ms a step; 64 tokens at 20 requests/s need more running
    requests than any TPOT target of 20 ms allows."""
    w = Workload(64, 64, rate=20.0, ttft_s=10.0, tpot_s=0.02)
    p = simulate(
        w,
        Layout(1, 1, 1000, 1024),
        prefill_taking(0.001),
        decode_taking(0.002, 0.001),
        0.0,
        2000,
        6,
    )
    assert p.p_tpot < 0.05 and p.attainment <= p.p_tpot


def test_pollaczek_khinchine_itself():
    assert mean_wait_md1(5.0, 0.1) == pytest.approx(0.5 * 0.1 / (2 * 0.5))
    assert math.isinf(mean_wait_md1(10.0, 0.1))


def test_later_arrivals_share_an_earlier_prompts_forwards():
    """As the prefill scheduler packs chunks (each forward costs 1 ms a token): the first of
    three 100-token prompts arriving together starts alone (the node starts at once); the two
    that queued meanwhile share the next forward when it holds both, else go one by one."""
    per_token = PrefillCost(prior=(0.0, 1e-3, 0.0), prior_weight=FIXED)
    w = Workload(100, 2, rate=1.0, ttft_s=10.0, tpot_s=10.0)
    both = _simulate_prefill([0.0] * 3, w, Layout(1, 1, 8, 100, 200), per_token)
    one = _simulate_prefill([0.0] * 3, w, Layout(1, 1, 8, 100, 100), per_token)
    assert both == pytest.approx([0.1, 0.3, 0.3]) and one == pytest.approx([0.1, 0.2, 0.3])
    # Chunks of 50, room for 100: [#0 50] [#0 50, #1 50] [#1 50, #2 50] [#2 50].
    halves = _simulate_prefill([0.0] * 3, w, Layout(1, 1, 8, 50, 100), per_token)
    assert halves == pytest.approx([0.15, 0.25, 0.3])
