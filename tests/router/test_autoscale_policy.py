"""The autoscaling decisions alone (router.autoscale_policy), on a simulated clock: sustained load
scales up, a spike does not; a long lull drains a started node, never a configured one; the
cool-down and a starting node hold further changes; the bounds hold; an SLA shortfall scales the
role that misses its part of the SLA (TTFT: prefill, TPOT: decode)."""

from control.cluster_config import AutoscaleConfig
from router.autoscale_policy import Attainment, AutoscalePolicy, RoleSignals

CFG = AutoscaleConfig(
    enabled=True,
    max_prefill=3,
    max_decode=2,
    sustain_s=3.0,
    idle_s=10.0,
    cooldown_s=5.0,
    prefill_up_tokens=1000,
    prefill_down_tokens=0,
)
QUIET = RoleSignals(ready=1, starting=0, drainable=0, load=0.5)  # decode: between the marks


def prefill(load, ready=1, starting=0, drainable=0):
    return {"prefill": RoleSignals(ready, starting, drainable, load), "decode": QUIET}


def run(policy, signals_at, times, attainment=None):
    """Decisions over the times, as (time, role, delta)."""
    out = []
    for t in times:
        for d in policy.decide(signals_at(t), attainment, t):
            out.append((t, d.role, d.delta))
    return out


def test_sustained_load_scales_up_and_a_spike_does_not():
    policy = AutoscalePolicy(CFG)
    spike = run(policy, lambda t: prefill(5000 if t < 2 else 0), range(0, 10))
    assert spike == []
    policy = AutoscalePolicy(CFG)
    assert run(policy, lambda t: prefill(5000), range(0, 4)) == [(3, "prefill", 1)]


def test_no_second_change_while_starting_or_cooling_down_and_the_max_holds():
    policy = AutoscalePolicy(CFG)
    ready_at = []  # when each started node becomes ready: 3 s after its decision
    decisions = []
    for t in range(0, 40):
        ready = 1 + sum(r <= t for r in ready_at)
        signals = prefill(5000, ready=ready, starting=len(ready_at) + 1 - ready, drainable=0)
        for d in policy.decide(signals, None, t):
            decisions.append((t, d.delta))
            ready_at.append(t + 3)
    # up at 3; starting until 6, the load measured again from then: sustained at 9 (the
    # cool-down ended at 8); starting until 12; then 3 nodes, the max: no more
    assert decisions == [(3, 1), (9, 1)]


def test_a_long_lull_drains_a_started_node_but_never_a_configured_one():
    policy = AutoscalePolicy(CFG)
    assert run(policy, lambda t: prefill(0, ready=1), range(0, 30)) == []  # the config's only
    policy = AutoscalePolicy(CFG)
    decisions = run(policy, lambda t: prefill(0, ready=2, drainable=1), range(0, 30))
    assert decisions[0] == (10, "prefill", -1)
    assert run(AutoscalePolicy(CFG), lambda t: prefill(0, ready=1, drainable=1), range(30)) == []


def test_below_min_scales_up_at_once():
    policy = AutoscalePolicy(AutoscaleConfig(enabled=True, min_decode=2, max_decode=3))
    signals = {"prefill": RoleSignals(1, 0, 0, 0.0), "decode": RoleSignals(1, 0, 0, 0.0)}
    assert [(d.role, d.delta) for d in policy.decide(signals, None, 0.0)] == [("decode", 1)]


def test_an_sla_shortfall_scales_the_role_that_misses_its_part():
    signals = {"prefill": RoleSignals(1, 0, 0, 300.0), "decode": RoleSignals(1, 0, 0, 0.5)}

    def scaled(attainment):
        return [(d.role, d.delta) for d in AutoscalePolicy(CFG).decide(signals, attainment, 0.0)]

    # TTFT missed more than TPOT: prefill, though decode's load is nearer its mark
    assert scaled(Attainment(met=0.5, ttft=0.55, tpot=0.95)) == [("prefill", 1)]
    assert scaled(Attainment(met=0.5, ttft=0.9, tpot=0.6)) == [("decode", 1)]
    # both parts missed alike: the load decides (prefill at 0.3 of its mark, decode at 0.625)
    assert scaled(Attainment(met=0.5, ttft=0.7, tpot=0.7)) == [("decode", 1)]
    assert scaled(Attainment(met=0.95, ttft=0.95, tpot=1.0)) == []  # within the target
    assert (
        "TTFT part missed most"
        in AutoscalePolicy(CFG).decide(signals, Attainment(0.5, 0.5, 1.0), 0.0)[0].reason
    )
