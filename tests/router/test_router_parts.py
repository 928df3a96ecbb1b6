"""The router's parts, each built alone with fakes for what it is given (no Router, no sockets):
output ordering, the watchdog, node health and the dispatch of late reservation replies."""

from control.cluster_config import ClusterConfig, TimeoutConfig
from control.protocol import (
    Abort,
    FirstToken,
    NodeReady,
    RequestTokens,
    ReserveReply,
    StepTokens,
)
from control.sampling_params import SamplingParams
from router.dispatch import RequestDispatch
from router.health import NodeHealth
from router.kv_index import KVIndex
from router.nodes import NodeRegistry, NodeState, NodeStatus
from router.ordering import OutputOrdering
from router.state import RequestState, RouterRequest, TokenEvent
from router.watchdog import Watchdog

EOS = 1


class Calls:
    """Records every call of a callable it stands for."""

    def __init__(self, result=None):
        self.calls: list[tuple] = []
        self.result = result

    def __call__(self, *args):
        self.calls.append(args)
        return self.result


class Sink:
    """A metric that takes anything (labels, observations, increments) and keeps nothing."""

    def labels(self, *names):
        return self

    def observe(self, value):
        pass

    def inc(self, amount=1):
        pass


class FakeMetrics:
    def __init__(self):
        self.stage = self.itl = self.output_tokens = Sink()


class FakeAdmission:
    def __init__(self):
        self.first_tokens: list[RouterRequest] = []
        self.heartbeats: list = []

    def first_token(self, req):
        self.first_tokens.append(req)

    def on_heartbeat(self, node, msg):
        self.heartbeats.append((node.name, msg))


class FakeNodes:
    """The registry calls OutputOrdering makes, recorded."""

    def __init__(self):
        self.nodes: dict[str, NodeState] = {}
        self.released_prefill: list[RouterRequest] = []

    def release_prefill(self, req):
        self.released_prefill.append(req)


def prefilling(request_id: str, max_new: int, now: float = 0.0) -> RouterRequest:
    """A request whose prompt went to p0 with its KV reserved on d0."""
    req = RouterRequest(
        request_id, 7, [2, 3, 4], SamplingParams(max_new_tokens=max_new), frozenset({EOS})
    )
    req.advance(RequestState.RESERVING)
    req.advance(RequestState.PREFILLING)
    req.prefill_node, req.decode_node = "p0", "d0"
    req.timings.dispatched = now
    return req


def drain(req: RouterRequest) -> list:
    out = []
    while not req.events.empty():
        out.append(req.events.get_nowait())
    return out


def step(request_id: str, token_ids: list[int], finish_reason: str | None = None) -> StepTokens:
    return StepTokens.of([RequestTokens(request_id, token_ids, finish_reason)])


def make_ordering(requests):
    nodes, admission = FakeNodes(), FakeAdmission()
    endings = {name: Calls() for name in ("fail", "abort_on_nodes", "close", "preempt")}
    ordering = OutputOrdering(
        requests, nodes, admission, FakeMetrics(), max_positions=128, **endings
    )
    return ordering, nodes, admission, endings


def test_ordering_holds_decode_tokens_that_beat_the_first_token_and_releases_them_in_order():
    req = prefilling("r1", max_new=10)
    ordering, nodes, admission, endings = make_ordering({"r1": req})

    ordering.on_step_tokens(step("r1", [6, 7]))  # D's tokens, before P's first token
    assert drain(req) == [] and req.state == RequestState.PREFILLING

    ordering.on_first_token(FirstToken("r1", 5, prompt_len=3))
    assert drain(req) == [TokenEvent([5, 6, 7], None, [])]
    assert req.state == RequestState.DECODING
    assert nodes.released_prefill == [req] and admission.first_tokens == [req]

    ordering.on_step_tokens(step("r1", [8, EOS], "stop"))
    assert drain(req) == [TokenEvent([8, EOS], "stop", [])]
    assert req.state == RequestState.FINISHED and req.finish_reason == "stop"
    assert endings["close"].calls == [(req, "finished")]
    assert endings["abort_on_nodes"].calls == []  # the node ended it itself: nothing to abort
    assert endings["fail"].calls == [] and endings["preempt"].calls == []


def test_ordering_ends_a_request_at_its_own_length_limit_and_aborts_it_on_its_nodes():
    req = prefilling("r1", max_new=3)
    ordering, _, _, endings = make_ordering({"r1": req})
    ordering.on_first_token(FirstToken("r1", 5, prompt_len=3))
    ordering.on_step_tokens(step("r1", [6, 7, 8, 9]))  # the node sent more than asked for
    assert drain(req) == [TokenEvent([5], None, []), TokenEvent([6, 7], "length", [])]
    assert endings["abort_on_nodes"].calls == [(req, "finished")]
    assert endings["close"].calls == [(req, "finished")]


def test_ordering_applies_a_preempted_that_beat_the_first_token_after_that_token():
    req = prefilling("r1", max_new=10)
    req.pending_preempt = "the KV pool ran out"  # how recovery parks an early Preempted
    ordering, _, _, endings = make_ordering({"r1": req})
    ordering.on_first_token(FirstToken("r1", 5, prompt_len=3))
    assert drain(req) == [TokenEvent([5], None, [])]  # the token reaches the client first
    assert endings["preempt"].calls == [(req, "the KV pool ran out")]


class WatchedNodes:
    """The registry calls the watchdog makes; `silent` is what `expired` reports."""

    def __init__(self, *nodes: NodeState, silent=()):
        self.nodes = {node.name: node for node in nodes}
        self.silent = list(silent)
        self.expired_args: list[tuple] = []

    def expired(self, timeout_s, now):
        self.expired_args.append((timeout_s, now))
        return self.silent

    def mark_dead(self, node, error):
        node.status, node.error = NodeStatus.DEAD, error


def live_node(name: str, role: str, last_seen: float = 0.0) -> NodeState:
    return NodeState(name, role, f"tcp://{name}", 16, 64, NodeStatus.READY, last_seen)


def make_watchdog(nodes, requests, lost=()):
    timeouts = TimeoutConfig(prefill_queue_s=5.0, transfer_s=5.0, decode_s=30.0, node_timeout_s=2)
    callbacks = {"node_lost": Calls(), "fail": Calls()}
    watchdog = Watchdog(
        nodes,
        requests,
        timeouts,
        "router-1",
        send=Calls(True),
        lost_connections=lambda: list(lost),
        **callbacks,
    )
    return watchdog, callbacks


def test_watchdog_fails_a_request_past_its_stage_deadline_through_the_callback():
    late = prefilling("late", max_new=10, now=100.0)  # 11 s without a first token (limit 10)
    on_time = prefilling("on_time", max_new=10, now=108.0)  # 3 s
    decoding = prefilling("decoding", max_new=10, now=90.0)
    decoding.advance(RequestState.DECODING)
    decoding.timings.first_token = 95.0  # 16 s of decoding (limit 30)
    requests = {r.request_id: r for r in (late, on_time, decoding)}
    watchdog, callbacks = make_watchdog(WatchedNodes(), requests)

    watchdog.check_deadlines(111.0)

    assert callbacks["fail"].calls == [
        (late, "prefill_queue", "no first token within 10 s (stage prefill_queue)")
    ]
    assert callbacks["node_lost"].calls == []


def test_watchdog_declares_lost_and_silent_nodes_dead_and_reports_them():
    p0, d0, d1 = (
        live_node("p0", "prefill", 7.0),
        live_node("d0", "decode"),
        live_node("d1", "decode"),
    )
    nodes = WatchedNodes(p0, d0, d1, silent=[p0])
    watchdog, callbacks = make_watchdog(nodes, {}, lost=["d0", "nobody"])

    watchdog.check_deadlines(10.0)

    assert nodes.expired_args == [(2, 10.0)]  # asked with its node timeout
    assert callbacks["node_lost"].calls == [
        (d0, "exited (connection lost)"),
        (p0, "stopped answering (no heartbeat for 3.0 s)"),
    ]
    assert (d0.status, p0.status, d1.status) == (NodeStatus.DEAD, NodeStatus.DEAD, "ready")
    assert callbacks["fail"].calls == []


def two_node_registry() -> NodeRegistry:
    cfg = ClusterConfig.from_dict({"prefill": [{"name": "p0"}], "decode": [{"name": "d0"}]})
    return NodeRegistry(cfg)


class NoPolicy:
    def observe_heartbeat(self, node):
        pass


def test_health_refuses_another_model_and_reports_a_restarted_node_as_lost():
    nodes = two_node_registry()
    node_lost = Calls()
    health = NodeHealth(
        nodes,
        NoPolicy(),
        FakeAdmission(),
        {"num_hidden_layers": 3},
        KVIndex(),
        node_lost=node_lost,
        is_closing=lambda: False,
    )
    health.on_node_ready(NodeReady("p0", "prefill", {"fingerprint": {"num_hidden_layers": 3}}))
    health.on_node_ready(NodeReady("d0", "decode", {"fingerprint": {"num_hidden_layers": 4}}))
    assert nodes.nodes["p0"].is_ready and nodes.nodes["d0"].status == NodeStatus.DEAD
    assert not health.is_serving and node_lost.calls == []

    nodes.nodes["p0"].num_active = 1  # it held a request: a new NodeReady means it restarted
    health.on_node_ready(NodeReady("p0", "prefill", {}))
    assert node_lost.calls == [(nodes.nodes["p0"], "restarted")]


def test_dispatch_answers_a_late_reservation_yes_with_an_abort_to_the_decode_nodes():
    nodes = two_node_registry()
    send = Calls(True)
    dispatch = RequestDispatch(
        nodes,
        policy=None,
        admission=None,
        metrics=None,
        timeouts=TimeoutConfig(),
        max_positions=128,
        requests={},
        send=send,
        reject=Calls(),
        abort_on_nodes=Calls(),
        forget=Calls(),
        wait_for_nodes=Calls(),
        room_changed=None,
    )
    dispatch.on_reserve_reply(ReserveReply("gone", True, "tcp://d0-kv"))
    dispatch.on_reserve_reply(ReserveReply("gone-too", False, "", reason="full"))
    assert send.calls == [("d0", Abort("gone", "reservation came too late"))]
