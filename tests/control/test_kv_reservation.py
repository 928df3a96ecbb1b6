"""On-demand decode KV, the shared pieces: the reservation rule the decode
node and the router both use, its config fields and their validation, and the Preempted
message on the wire."""

import pytest

from control import protocol
from control.cluster_config import ClusterConfig
from control.errors import ConfigError
from control.kv_reservation import reservation_tokens, worst_case_tokens
from control.protocol import Heartbeat, Preempted, ProtocolError


def _cfg(router=None, decode=None) -> ClusterConfig:
    return ClusterConfig.from_dict(
        {
            "router": router or {},
            "prefill": [{"name": "p"}],
            "decode": [{"name": "d", **(decode or {})}],
        }
    )


@pytest.mark.parametrize(
    "mode, headroom, prompt, max_new, expect",
    [
        ("on_demand", 32, 10, 100, 42),  # prompt + headroom
        ("on_demand", 32, 10, 5, 15),  # never more than the worst case
        ("on_demand", 0, 10, 100, 10),  # the prompt only: the first step grows it
        ("on_demand", 32, 500, 100, 512),  # clipped to the context
        ("worst_case", 32, 10, 100, 110),
        ("worst_case", 32, 500, 100, 512),
    ],
)
def test_the_reservation_rule(mode, headroom, prompt, max_new, expect):
    assert reservation_tokens(mode, headroom, prompt, max_new, 512) == expect
    assert reservation_tokens(mode, headroom, prompt, max_new, 512) <= worst_case_tokens(
        prompt, max_new, 512
    )


def test_defaults_are_on_demand_with_a_headroom_and_worst_case_is_one_switch_away():
    cfg = _cfg()
    assert cfg.decode[0].kv_reservation == "on_demand" and cfg.decode[0].kv_headroom_tokens == 32
    assert cfg.router.max_preemptions == 8
    old = _cfg({"max_preemptions": 0}, {"kv_reservation": "worst_case"})
    assert old.decode[0].kv_reservation == "worst_case" and old.router.max_preemptions == 0


@pytest.mark.parametrize(
    "router, decode, match",
    [
        (
            {},
            {"kv_reservation": "lazy"},
            "node d: kv_reservation must be one of on_demand, worst_case",
        ),
        ({}, {"kv_headroom_tokens": -1}, "node d: kv_headroom_tokens must be >= 0"),
        ({}, {"kv_headroom_tokens": "16"}, r"\[decode.d\] kv_headroom_tokens must be int"),
        ({"max_preemptions": -1}, {}, r"\[router\] max_preemptions must be >= 0"),
    ],
)
def test_bad_values_name_the_field(router, decode, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(router, decode)


def test_preempted_and_the_heartbeat_count_round_trip():
    for msg in (
        Preempted("r1~2", 7, "the KV pool ran out"),
        Heartbeat("d", "decode", num_preempted=3),
    ):
        assert protocol.decode(protocol.encode(msg)) == msg
    assert protocol.decode(protocol.encode(Preempted("r", 1))).reason == ""
    bad = protocol.encode(Preempted("r", 1))
    with pytest.raises(ProtocolError, match="Preempted: field 'num_tokens' has the wrong type"):
        protocol.decode(bad.replace(b"\xaanum_tokens\x01", b"\xaanum_tokens\xc3"))
