"""Joining and leaving at the router (router.membership) without sockets: a NodeReady from an
unknown name is admitted (registered, connected, paired) or refused with its reason told to the
node; a joined node that dies is forgotten, a configured one never is; joined nodes appear in
/v1/cluster."""

from control.cluster_config import ClusterConfig
from control.protocol import Heartbeat, KVEvents, NodeReady, Shutdown
from router.cluster_view import cluster_view
from router.core import Router
from router.nodes import NodeStatus

FINGERPRINT = {"num_hidden_layers": 2}
LAYOUT = {"model.num_hidden_layers": 2, "num_layers": 2, "row_width": 96, "dtype": "bfloat16"}


class FakeTransport:
    def __init__(self):
        self.added, self.removed, self.told, self.sent = [], [], [], []

    def add_node(self, name, endpoint):
        self.added.append((name, endpoint))

    def remove_node(self, name):
        self.removed.append(name)

    def tell(self, endpoint, msg):
        self.told.append((endpoint, msg))

    def send(self, name, msg):
        self.sent.append((name, msg))
        return True


def make_router():
    cfg = ClusterConfig.from_dict({"prefill": [{"name": "p0"}], "decode": [{"name": "d0"}]})
    router = Router(cfg, eos_token_ids=[2], max_positions=512, fingerprint=FINGERPRINT)
    router.transport = FakeTransport()
    for name, role in (("p0", "prefill"), ("d0", "decode")):
        router.handle(NodeReady(name, role, {"fingerprint": LAYOUT, "page_size": 16}))
    return router


def join(router, name="dj", fingerprint=LAYOUT, endpoint="tcp://10.0.0.7:7400", **info):
    info = {"fingerprint": fingerprint, "control_endpoint": endpoint, "page_size": 16, **info}
    router.handle(NodeReady(name, "decode", {"num_pages": 64, **info}))
    return router.nodes.nodes.get(name)


def test_a_joining_node_is_admitted_connected_and_paired():
    router = make_router()
    node = join(router, kv_endpoint="tcp://10.0.0.7:7401")
    assert node is not None and node.joined and node.is_ready
    assert router.transport.added == [("dj", "tcp://10.0.0.7:7400")]
    router.handle(Heartbeat("dj", "decode", free_pages=64, total_pages=64, page_size=16))
    assert {n.name for n in router.nodes.ready("decode")} == {"d0", "dj"}
    router.handle(KVEvents("dj", "decode", 16, stored=[b"x" * 16]))  # its events are taken
    assert router.kv_index.summary()["dj"]["pages"] == 1
    view = cluster_view(router.cfg, router.nodes, router.is_serving)
    joined = [n for n in view["nodes"] if n.get("joined")]
    assert [n["name"] for n in joined] == ["dj"] and joined[0]["role"] == "decode"
    assert router.membership.num_joined == 1


def test_joins_are_refused_with_the_reason_told_to_the_node():
    router = make_router()
    other_model = {**LAYOUT, "model.num_hidden_layers": 3}
    assert join(router, "a", other_model, "tcp://h:1") is None
    assert join(router, "b", {**LAYOUT, "dtype": "float32"}, "tcp://h:2") is None
    assert join(router, "c", LAYOUT, "not an endpoint") is None  # ignored: nowhere to answer
    told = dict(router.transport.told)
    assert isinstance(told["tcp://h:1"], Shutdown) and "another model" in told["tcp://h:1"].reason
    assert "another KV layout: dtype" in told["tcp://h:2"].reason
    assert set(router.nodes.nodes) == {"p0", "d0"} and router.transport.added == []
    assert router.membership.num_refused == 2


def test_a_joined_node_that_dies_is_forgotten_and_a_configured_one_is_not():
    router = make_router()
    node = join(router)
    router.nodes.mark_dead(node, "connection lost (the process exited)")
    router._node_lost(node, "exited (connection lost)")
    assert "dj" not in router.nodes.nodes and router.transport.removed == ["dj"]
    d0 = router.nodes.nodes["d0"]
    router.nodes.mark_dead(d0, "connection lost (the process exited)")
    router._node_lost(d0, "exited (connection lost)")
    assert router.nodes.nodes["d0"].status == NodeStatus.DEAD  # kept: it is configured
    assert join(router) is not None  # the same name may join again
