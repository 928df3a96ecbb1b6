"""The router's request engine: the coordinator of a request's way through the cluster.

For each request (see `router.state` for its state machine):
  1. admit (`submit`, here): refuse at once (503 + Retry-After) when too many requests are
     unfinished; wait (up to `reserve_s`) while no node of a role is ready (one restarting or
     draining); refuse or hold a request no prefill node is predicted to serve within the TTFT
     SLA, as `[sla] admission` says (`router.admission`);
  2. reserve (`router.dispatch`): ask decode nodes in the policy's order to reserve KV pages;
     a refusal moves on to the next node, a silent node fails the request (stage "reserve");
  3. prefill (`router.dispatch`): send the prompt to the chosen prefill node with the decode
     node's KV endpoint;
  4. stream (`router.ordering`): P's FirstToken and D's StepTokens (one per decode step, for
     all its requests) become `TokenEvent`s in output order (D's tokens that arrive before P's
     first token wait in the request); exactly one terminal event ends the stream.
Node messages reach `handle` from the receive loop; node health is `router.health`'s. Every wait
is bounded: the watchdog (`router.watchdog`) fails requests past their stage deadline and finds
lost nodes, whose requests move to surviving pairs (`router.recovery`); failures and aborts
send Abort to both nodes (`_fail`, `abort`, here), so pages are freed on both sides whatever
happened.

`Router` is the coordinator: it owns the unfinished requests, the nodes' registry, the
transport and the request endings (`_fail`, `_reject`, `_close`, ...), and builds the five
parts that do the steps above, handing each what it uses through its constructor:
`RequestDispatch` (`dispatch`), `OutputOrdering` (`ordering`), `NodeHealth` (`health`),
`NodeLossRecovery` (`recovery`) and `Watchdog` (`watchdog`). The parts never reach into each
other: where one needs another (recovery starts attempts through dispatch, health reports lost
nodes to recovery), it is given that part or one of its methods.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Iterable
from typing import Any

from control.cluster_config import ClusterConfig
from control.protocol import (
    Abort,
    FirstToken,
    Heartbeat,
    KVEvents,
    NodeFailed,
    NodeReady,
    Preempted,
    RequestError,
    ReserveReply,
    StepTokens,
)
from control.router_links import wire_prefix
from control.sampling_params import SamplingParams
from control.security import CurveSecurity
from router.admission import AdmissionControl, CostModelCollector
from router.dispatch import RequestDispatch
from router.health import NodeHealth
from router.kv_index import KVIndex
from router.membership import Membership
from router.metrics import RouterMetrics
from router.nodes import NodeRegistry, NodeState, NodeStatus
from router.ordering import OutputOrdering
from router.policy import PairingPolicy, default_policy
from router.recovery import NodeLossRecovery
from router.request_log import log_request_end
from router.state import (
    RETRY_AFTER_S,
    STAGE_OF_STATE,
    ErrorEvent,
    RequestState,
    RouterError,
    RouterRequest,
    TokenEvent,
)
from router.transport import RouterTransport
from router.watchdog import Watchdog

log = logging.getLogger("router")


class Router:
    """Owns the nodes' state, the unfinished requests and the sockets. Event-loop only.

    Args:
        cfg: the cluster config (nodes, timeouts, SLA, router limits).
        eos_token_ids: tokens that end a request unless `ignore_eos`.
        max_positions: the model's context length.
        fingerprint: the model's `ModelConfig.fingerprint()`; nodes reporting another are
            refused (marked dead) at NodeReady.
        security: the cluster's CURVE keys (`control.security.cluster_security`) for the
            sockets; None for plain ones.
        replica: this router's place among the cluster's routers (`[router] replicas`,
            `control.router_links`): it binds that replica's control socket and marks its wire
            ids with it.
    """

    def __init__(
        self,
        cfg: ClusterConfig,
        eos_token_ids: list[int],
        max_positions: int,
        fingerprint: dict[str, Any] | None = None,
        policy: PairingPolicy | None = None,
        security: CurveSecurity | None = None,
        replica: int = 0,
    ):
        self._cfg = cfg
        self.security = security
        self.t = cfg.timeouts
        self.eos_ids = frozenset(eos_token_ids)
        self._max_positions = max_positions
        self.fingerprint = fingerprint
        self.nodes = NodeRegistry(cfg)
        self.kv_index = KVIndex()  # what the nodes' prefix caches hold (their KV events)
        self.policy = policy or default_policy(cfg, self.kv_index)
        self.transport: RouterTransport | None = None
        self.metrics = RouterMetrics(self.nodes, cfg.sla, self._num_bad_frames)
        self.admission = AdmissionControl(cfg, self.metrics, replica)  # SLA admission
        self.admission.cached_len = self.policy.cached_len  # TTFT leaves out expected cache hits
        self.metrics.registry.register(CostModelCollector(self.admission))
        self.requests: dict[str, RouterRequest] = {}
        self._tasks: list[asyncio.Task] = []
        self._room_changed = asyncio.Event()  # set when a decode hold ends (preempted waits)
        self._closing = False
        self.router_id = secrets.token_hex(8)  # new at every start: nodes drop the old one's work
        self.replica = replica
        self.wire_prefix = wire_prefix(replica)
        self.autoscaler = None  # router.autoscaler.Autoscaler under `duet up --autoscale`
        self._build_parts()

    def _build_parts(self) -> None:
        """The five parts, each given what it uses, built in the order they need each other;
        health, built first, reaches recovery (built later) through `_node_lost`."""
        self.membership = Membership(
            self.nodes, self.fingerprint, self.kv_index, lambda: self.transport
        )
        self.health = NodeHealth(
            self.nodes,
            self.policy,
            self.admission,
            self.fingerprint,
            self.kv_index,
            node_lost=self._node_lost,
            is_closing=self._is_closing,
            admit=self.membership.admit,
        )
        # With no admission set, a request waits for decode room (in turn) instead of a 503.
        sla = self.cfg.sla
        room_wait_s = sla.queue_timeout_s if sla.admission == "none" else 0.0
        self.dispatch = RequestDispatch(
            self.nodes,
            self.policy,
            self.admission,
            self.metrics,
            self.t,
            self.max_positions,
            self.requests,
            send=self._send,
            reject=self._reject,
            abort_on_nodes=self._abort_on_nodes,
            forget=self._forget,
            wait_for_nodes=self.health.wait_for_nodes,
            room_changed=self._room_changed,
            queue_timeout_s=room_wait_s,
        )
        self.metrics.waiting_for_room.set_function(lambda: len(self.dispatch.room_queue))
        self.recovery = NodeLossRecovery(
            self.requests,
            self.nodes,
            self.metrics,
            self.t,
            max_migrations=self.cfg.router.max_migrations,
            max_preemptions=self.cfg.router.max_preemptions,
            dispatch=self.dispatch,
            readiness=self.health,
            fail=self._fail,
            abort_on_nodes=self._abort_on_nodes,
            is_closing=self._is_closing,
            room_changed=self._room_changed,
        )
        self.ordering = OutputOrdering(
            self.requests,
            self.nodes,
            self.admission,
            self.metrics,
            self.max_positions,
            fail=self._fail,
            abort_on_nodes=self._abort_on_nodes,
            close=self._close,
            preempt=self.recovery.preempt,
        )
        self.watchdog = Watchdog(
            self.nodes,
            self.requests,
            self.t,
            self.router_id,
            replica=self.replica,
            send=self._send,
            lost_connections=self._lost_connections,
            node_lost=self._node_lost,
            fail=self._fail,
        )

    # `cfg` and `max_positions` stay settable after construction, as they were when the parts
    # read them from the router: a new value reaches the parts that use it. (The timeouts `t`
    # are taken from the config once, at construction; so are the nodes, policy, admission,
    # metrics, fingerprint and router id the parts are given.)
    @property
    def cfg(self) -> ClusterConfig:
        return self._cfg

    @cfg.setter
    def cfg(self, cfg: ClusterConfig) -> None:
        self._cfg = cfg
        self.recovery.max_migrations = cfg.router.max_migrations
        self.recovery.max_preemptions = cfg.router.max_preemptions

    @property
    def max_positions(self) -> int:
        return self._max_positions

    @max_positions.setter
    def max_positions(self, max_positions: int) -> None:
        self._max_positions = max_positions
        self.dispatch.max_positions = max_positions
        self.ordering.max_positions = max_positions

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        endpoints = {n.name: n.control_endpoint for n in self.nodes.nodes.values()}
        # Nodes connect to our control_endpoint (this replica's).
        bind = self.cfg.router.for_replica(self.replica).control_bind_endpoint
        self.transport = RouterTransport(bind, endpoints, self.security)
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name="router-recv"),
            asyncio.create_task(self.watchdog.run(), name="router-watchdog"),
        ]
        if self.autoscaler is not None:
            self._tasks.append(asyncio.create_task(self.autoscaler.run(), name="autoscaler"))

    def fail_all(self, message: str = "the router is shutting down") -> None:
        """Refuses new requests and fails every unfinished one (each stream gets its error
        event, each node an Abort). Called when a stop signal arrives, before connections
        are drained."""
        self._closing = True
        for req in list(self.requests.values()):
            self._fail(req, "router", message)

    async def stop(self) -> None:
        """Fails every unfinished request (aborting it on its nodes) and closes the sockets."""
        self.fail_all()
        moves = tuple(self.recovery.moves)
        for task in (*self._tasks, *moves):
            task.cancel()
        await asyncio.gather(*self._tasks, *moves, return_exceptions=True)
        if self.autoscaler is not None:
            self.autoscaler.close()
        if self.transport is not None:
            self.transport.close()

    def _num_bad_frames(self) -> int:
        return self.transport.num_bad_frames if self.transport is not None else 0

    # ---- what the parts are given ------------------------------------------------------------
    # The transport is read at each call, not handed over: it is made at `start` (and tests set
    # their own after construction).
    def _send(self, node: str, msg: Any) -> bool:
        return self.transport.send(node, msg)

    def _lost_connections(self) -> Iterable[str]:
        return self.transport.lost_connections() if self.transport is not None else ()

    def _is_closing(self) -> bool:
        return self._closing

    def _node_lost(self, node: NodeState, what: str) -> None:
        self.recovery.node_lost(node, what)
        if node.joined and node.status == NodeStatus.DEAD:  # it left: its requests moved
            self.membership.forget(node)
            self.admission.forget_node(node.name)

    # ---- the parts' public faces -------------------------------------------------------------
    @property
    def is_serving(self) -> bool:
        """A prefill node and a decode node are ready."""
        return self.health.is_serving

    def check_deadlines(self, now: float) -> None:
        """Declares silent nodes dead and fails requests past their stage deadline."""
        self.watchdog.check_deadlines(now)

    # ---- the request API used by the HTTP layer -------------------------------------------
    async def submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams):
        """Admits, reserves and dispatches a request; returns it in PREFILLING.

        Raises RouterError (503 with Retry-After) if it cannot start now. `sampling` is final:
        its max_new_tokens already fits the context.
        """
        if self._closing:
            raise RouterError(503, "the router is shutting down", "shutting_down", RETRY_AFTER_S)
        limit = self.cfg.router.max_queued_requests
        if len(self.requests) + self.admission.num_waiting >= limit:  # queued for the SLA too
            self.metrics.rejections.labels("overloaded").inc()
            raise RouterError(
                503,
                f"too many unfinished requests ({limit}); retry later",
                "overloaded",
                RETRY_AFTER_S,
            )
        if not self.is_serving and not await self.health.wait_for_nodes(self.t.reserve_s):
            self.metrics.rejections.labels("no_node").inc()
            raise RouterError(
                503, "no prefill or no decode node is ready", "no_node_ready", RETRY_AFTER_S
            )
        stop_ids = sampling.stop_ids(self.eos_ids)  # the nodes' rule (structured: EOS always)
        wire_id = self.wire_prefix + request_id  # its first attempt's
        if wire_id in self.requests:  # a client-chosen id (x-request-id) still running
            raise RouterError(400, f"request id {request_id!r} is in use", "duplicate_request_id")
        req = RouterRequest(request_id, secrets.randbits(63), prompt_ids, sampling, stop_ids)
        req.wire_prefix = self.wire_prefix
        req.forks = [
            RouterRequest(
                f"{request_id}/{i}",
                req.room,
                prompt_ids,
                sampling.for_sequence(i),
                stop_ids,
                parent=req,
                wire_prefix=self.wire_prefix,
            )
            for i in range(1, sampling.n)
        ]
        await self.admission.admit(req, lambda: self.nodes.ready("prefill"))  # may 503 or wait
        if wire_id in self.requests:  # the same id started while this one waited
            self.admission.forget(req)
            raise RouterError(400, f"request id {request_id!r} is in use", "duplicate_request_id")
        self.requests[req.wire_id] = req
        for fork in req.forks:  # registered now: D may stream one before P's first token
            self.requests[fork.wire_id] = fork
        req.advance(RequestState.RESERVING)
        try:
            await self.dispatch.reserve_somewhere(req)
        except asyncio.CancelledError:  # the HTTP task went away mid-reservation
            self.abort(req, "cancelled during reservation")
            raise
        self.dispatch.dispatch_prefill(req)
        return req

    async def events(self, req: RouterRequest) -> AsyncIterator[TokenEvent | ErrorEvent]:
        """The request's events up to and including the terminal one."""
        backstop = self.t.prefill_queue_s + self.t.transfer_s + self.t.decode_s + 10.0
        while True:
            try:
                event = await asyncio.wait_for(req.events.get(), backstop)
            except asyncio.TimeoutError:  # not the builtin before Python 3.11
                # Never expected (the watchdog fails requests earlier); keeps the wait bounded.
                self._fail(req, STAGE_OF_STATE.get(req.state, "decode"), "no progress")
                event = req.error or ErrorEvent("decode", "no progress")
            yield event
            if isinstance(event, ErrorEvent) or event.finish_reason is not None:
                return

    def finish_early(self, req: RouterRequest, finish_reason: str) -> None:
        """The HTTP layer ended the request (a stop string): FINISHED, nodes told to drop it."""
        if req.advance(RequestState.FINISHED):
            req.finish_reason = finish_reason
            self._abort_on_nodes(req, "stop string")
            self._close(req, "finished")

    def abort(self, req: RouterRequest, reason: str = "client disconnected") -> None:
        """The client went away: FAILED (sticky), Abort to both nodes; no-op once terminal."""
        if req.advance(RequestState.FAILED):
            req.error = ErrorEvent("client", reason)
            self._abort_on_nodes(req, reason)
            req.events.put_nowait(req.error)  # wakes a handler still waiting on the request
            self._close(req, "aborted")

    # ---- incoming messages -----------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            msg = await self.transport.recv()
            try:
                self.handle(msg)
            except Exception:  # a bug here must not stop the router from hearing its nodes
                log.exception("error while handling %s", type(msg).__name__)

    def handle(self, msg: Any) -> None:
        """Applies one node message (public so tests can drive the router without sockets)."""
        handler = {
            Heartbeat: self.health.on_heartbeat,
            NodeReady: self.health.on_node_ready,
            NodeFailed: self.health.on_node_failed,
            KVEvents: self.health.on_kv_events,
            ReserveReply: self.dispatch.on_reserve_reply,
            FirstToken: self.ordering.on_first_token,
            StepTokens: self.ordering.on_step_tokens,
            RequestError: self.recovery.on_request_error,
            Preempted: self.recovery.on_preempted,
        }.get(type(msg))
        if handler is None:
            log.warning("ignored a %s sent to the router", type(msg).__name__)
            return
        handler(msg)

    # ---- failure paths ---------------------------------------------------------------------
    def _fail(self, req: RouterRequest, stage: str, message: str) -> None:
        if not req.advance(RequestState.FAILED):
            return
        req.error = ErrorEvent(stage, message)
        self._abort_on_nodes(req, f"failed at {stage}")
        self.dispatch.stop_waiting(req)
        self.metrics.failures.labels(stage).inc()
        req.events.put_nowait(req.error)
        self._close(req, "failed")

    def _reject(self, req: RouterRequest, message: str, code: str) -> None:
        """Ends a request that never started streaming and raises the 503 for the client."""
        req.advance(RequestState.FAILED)
        req.error = ErrorEvent("admission", message)
        self._forget(req)
        log_request_end(req, "rejected")
        raise RouterError(503, message, code, RETRY_AFTER_S)

    def _abort_on_nodes(self, req: RouterRequest, reason: str) -> None:
        for name in (req.prefill_node, req.decode_node):
            if name is not None:
                self.transport.send(name, Abort(req.wire_id, reason))

    # ---- bookkeeping ---------------------------------------------------------------------
    def _forget(self, req: RouterRequest) -> None:
        self.nodes.release_prefill(req)
        self.nodes.release_decode(req)
        self.admission.forget(req)
        self.requests.pop(req.wire_id, None)
        self._room_changed.set()
        for fork in req.pending_forks:  # it ended before its first token: its forks with it
            if fork.advance(RequestState.FAILED):
                fork.error = req.error or ErrorEvent("router", "the request ended")
                fork.events.put_nowait(fork.error)
            self.requests.pop(fork.wire_id, None)

    def _close(self, req: RouterRequest, outcome: str) -> None:
        """Terminal bookkeeping: free the load estimates, count the outcome, record latencies
        (of requests: the forks of an n > 1 request are logged, not counted again)."""
        self._forget(req)
        log_request_end(req, outcome)
        if req.parent is not None:
            return
        self.metrics.requests.labels(outcome).inc()
        if outcome == "finished" and req.timings.first_token:
            t = req.timings
            self.metrics.observe_finished(
                t.ttft, t.tpot(req.num_output_tokens), t.last_token - t.arrival
            )
