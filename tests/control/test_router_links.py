"""A node's links to several routers: wire ids name their router, messages about a request go
to its router only, messages about the node to every router; leases are per router."""

import pytest

from control.cluster_config import MAX_ROUTERS, ClusterConfig
from control.errors import ConfigError
from control.lease import RouterLeases
from control.messaging import QueueOutbox
from control.protocol import (
    FirstToken,
    Heartbeat,
    NodeReady,
    RequestError,
    RequestTokens,
    ReserveReply,
    StepTokens,
)
from control.router_links import RouterLinks, by_replica, replica_of, wire_prefix

CLIENT_IDS = ["cmpl-abc", "chatcmpl-1~2", "cmpl-r1.x", "resp_99", "r", "chatcmpl-x/3"]


@pytest.mark.parametrize("replica", range(MAX_ROUTERS))
@pytest.mark.parametrize("request_id", CLIENT_IDS)
def test_a_wire_id_names_its_router(replica, request_id):
    wire_id = wire_prefix(replica) + request_id
    assert replica_of(wire_id) == replica
    assert replica_of(wire_id + "~3") == replica  # a later attempt
    assert replica_of(wire_id + "/1") == replica  # a fork


def test_replica_zero_keeps_ids_as_they_are_and_bad_replicas_are_refused():
    assert wire_prefix(0) == ""
    with pytest.raises(ValueError):
        wire_prefix(MAX_ROUTERS)
    with pytest.raises(ValueError):
        wire_prefix(-1)


def _links(n=3):
    boxes = [QueueOutbox() for _ in range(n)]
    return RouterLinks(boxes), boxes


def test_request_messages_go_to_their_router_only():
    links, boxes = _links()
    links.send(FirstToken("r2.cmpl-a", 5, 3))
    links.send(RequestError("cmpl-b", "decode", "x"))
    links.send(ReserveReply("r1.cmpl-c", ok=True))
    assert [m.request_id for m in boxes[0].messages] == ["cmpl-b"]
    assert [m.request_id for m in boxes[1].messages] == ["r1.cmpl-c"]
    assert [m.request_id for m in boxes[2].messages] == ["r2.cmpl-a"]


def test_node_messages_go_to_every_router():
    links, boxes = _links()
    links.send(Heartbeat("d", "decode", free_pages=3))
    links.send(NodeReady("d", "decode", {}))
    for box in boxes:
        assert [type(m) for m in box.messages] == [Heartbeat, NodeReady]


def test_a_step_of_several_routers_is_split_in_order():
    links, boxes = _links()
    outputs = [
        RequestTokens("cmpl-a", [1]),
        RequestTokens("r1.cmpl-b", [2, 3], "stop"),
        RequestTokens("cmpl-c", [4], None, [-0.5], [[4]], [[-0.5]]),
        RequestTokens("r1.cmpl-d", []),
    ]
    assert links.send(StepTokens.of(outputs))
    (zero,) = boxes[0].messages
    (one,) = boxes[1].messages
    assert not boxes[2].messages
    assert zero.outputs() == [
        RequestTokens("cmpl-a", [1], None, [], [], []),
        RequestTokens("cmpl-c", [4], None, [-0.5], [[4]], [[-0.5]]),
    ]
    assert one.outputs() == [outputs[1], outputs[3]]


def test_send_to_a_router_the_cluster_lacks_is_dropped():
    links, boxes = _links(2)
    assert not links.send(FirstToken("r5.cmpl-a", 1, 1))
    assert not links.send_to(2, Heartbeat("p", "prefill"))
    assert all(not box.messages for box in boxes)
    with pytest.raises(ValueError):
        RouterLinks([])


def test_one_router_passes_everything_through():
    links, (box,) = _links(1)
    step = StepTokens.of([RequestTokens("r1.cmpl-a", [1])])  # a replica-1 id, one router
    links.send(step)
    assert box.messages == [step]


def test_prefill_numbering_per_router_on_the_wire():
    assert by_replica({}) == []
    assert by_replica({0: 4}) == [4]
    assert by_replica({2: 7, 0: 1}) == [1, 0, 7]


def test_leases_are_per_router():
    leases = RouterLeases()
    assert not leases.renew(0, "a", 1.0, now=0.0)
    assert not leases.renew(1, "b", 5.0, now=0.0)  # another router, not a restart
    assert leases.lapsed(0.5) == []
    assert leases.lapsed(2.0) == [0]  # router 0 went silent; router 1's lease runs on
    assert leases.lapsed(3.0) == []  # once
    assert leases.renew(1, "c", 5.0, now=3.0)  # router 1 restarted: a new id at its place
    assert not leases.renew(0, "a", 1.0, now=3.0)  # router 0 is back, same id
    assert sorted(leases.lapsed(9.0)) == [0, 1]


def _config(**router):
    return ClusterConfig.from_dict(
        {
            "router": {"port": 8000, "control_port": 7000, **router},
            "prefill": [{"name": "p", "control_port": 7100}],
            "decode": [{"name": "d", "control_port": 7200, "kv_port": 7300}],
        }
    )


def test_replicas_take_consecutive_ports():
    router = _config(replicas=3).router
    assert router.control_endpoints == [
        "tcp://127.0.0.1:7000",
        "tcp://127.0.0.1:7001",
        "tcp://127.0.0.1:7002",
    ]
    assert [router.for_replica(i).port for i in range(3)] == [8000, 8001, 8002]
    assert _config().router.control_endpoints == ["tcp://127.0.0.1:7000"]
    with pytest.raises(ConfigError, match="no replica 3"):
        router.for_replica(3)


@pytest.mark.parametrize("replicas", [0, MAX_ROUTERS + 1])
def test_replicas_out_of_range_are_refused(replicas):
    with pytest.raises(ConfigError, match="replicas"):
        _config(replicas=replicas)


def test_a_replica_port_that_meets_a_node_is_refused():
    with pytest.raises(ConfigError, match="share a host:port"):
        _config(replicas=2, control_port=7099)  # replica 1's control port is node p's
