"""What the router does about lost nodes and preempted requests: moving them to another attempt.

Lost nodes are found by the watchdog (`router.watchdog`: connection dropped, silent) and by
their own messages (`router.health`: NodeFailed, a NodeReady after a restart). Recovery: a
request whose node is lost is moved to a surviving pair as a new attempt
(`RouterRequest.restart`): before its first token a plain retry, after it a re-prefill of the
prompt and the tokens already streamed, so the stream goes on where it stopped. At most
`max_migrations` moves; then it fails with an error naming the stage.

Preemption (on-demand decode KV): a decode node whose KV pool ran out sends
`Preempted` after the StepTokens with the request's last tokens; the request restarts the same
way (prompt + output re-prefilled, on any pair, the same decode node included), with its own
bound, `max_preemptions` (not counted in `max_migrations`); one more fails it (stage
"preemption").
A preempted attempt waits for a decode node with room (refusals are retried as holds end) for
what is left of its decode budget (`decode_s` after its first token, at least `reserve_s`);
then it fails (stage "preemption"). A Preempted that arrives before P's FirstToken (another
socket) waits in the request until that token is in, so no token is lost.

A RequestError from a node that is draining (its drain timed out and it gave the request back)
moves the request too, unseen by the client, and so does one of stage "transfer": the KV link
failed (a dropped connection, a restarted peer, frames that failed their integrity check), which
is not the request's doing, so it gets a new attempt like a node loss, within the same
`max_migrations`. Any other RequestError fails it.

`NodeLossRecovery` owns the background tasks that start moved attempts (`moves`; the router
cancels them at stop). The unfinished requests (it re-keys a moved one under its new wire id),
the nodes, the metrics, the timeouts and the bounds come in through its constructor, and so do
the two parts it starts a new attempt with, as small interfaces: `AttemptDispatch` (reserve,
dispatch; `router.dispatch`) and `ClusterReadiness` (`router.health`), and the coordinator's
callables (`fail`, `abort_on_nodes`, `is_closing`). `room_changed` is set when a move frees
decode room (a preempted request's reservation waits on it).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import Protocol

from control.cluster_config import TimeoutConfig
from control.protocol import Preempted, RequestError
from router.metrics import RouterMetrics
from router.nodes import NodeRegistry, NodeState, NodeStatus
from router.state import STAGE_OF_STATE, ErrorEvent, RequestState, RouterError, RouterRequest

log = logging.getLogger("router")


class AttemptDispatch(Protocol):
    """How a new attempt is started (`router.dispatch.RequestDispatch`)."""

    async def reserve_somewhere(self, req: RouterRequest, wait_for_room_s: float = 0.0) -> None:
        """Reserves decode KV for the attempt; raises RouterError if no node takes it."""

    def dispatch_prefill(self, req: RouterRequest) -> None:
        """Sends the attempt's prompt to a prefill node; raises RouterError if none takes it."""

    def stop_waiting(self, req: RouterRequest) -> None:
        """Answers a reservation in flight "no answer" (its decode node is gone)."""


class ClusterReadiness(Protocol):
    """Whether a moved request has a pair to go to (`router.health.NodeHealth`)."""

    @property
    def is_serving(self) -> bool:
        """A prefill node and a decode node are ready."""

    async def wait_for_nodes(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for the cluster to serve; True if it does."""


class NodeLossRecovery:
    """Moves the requests of lost nodes, and preempted requests, to new attempts (see the
    module docstring)."""

    def __init__(
        self,
        requests: dict[str, RouterRequest],
        nodes: NodeRegistry,
        metrics: RouterMetrics,
        timeouts: TimeoutConfig,
        *,
        max_migrations: int,
        max_preemptions: int,
        dispatch: AttemptDispatch,
        readiness: ClusterReadiness,
        fail: Callable[[RouterRequest, str, str], None],
        abort_on_nodes: Callable[[RouterRequest, str], None],
        is_closing: Callable[[], bool],
        room_changed: asyncio.Event,
    ):
        self.requests = requests
        self.nodes = nodes
        self.metrics = metrics
        self.timeouts = timeouts
        self.max_migrations = max_migrations
        self.max_preemptions = max_preemptions
        self.dispatch = dispatch
        self.readiness = readiness
        self.fail = fail
        self.abort_on_nodes = abort_on_nodes
        self.is_closing = is_closing
        self.room_changed = room_changed
        self.moves: set[asyncio.Task] = set()  # attempts of moved requests being started

    def node_lost(self, node: NodeState, what: str) -> None:
        """The node is gone (dead, silent, restarted): each unfinished request it held moves to
        another pair (`_move`), unseen by the client but for a pause; a request already moved
        `max_migrations` times fails, naming the stage. A reservation waiting on the node is
        answered "no answer", so the reservation goes on to the next decode node."""
        for req in list(self.requests.values()):
            on_decode = req.decode_node == node.name
            on_prefill = req.prefill_node == node.name and req.state <= RequestState.PREFILLING
            if req.is_done or not (on_decode or on_prefill):
                continue
            stage = STAGE_OF_STATE.get(req.state, "decode")
            message = f"{node.role} node {node.name} {what} (stage {stage})"
            if req.state == RequestState.RESERVING:
                self.dispatch.stop_waiting(req)
            elif req.num_migrations < self.max_migrations and not self.is_closing():
                self._move(req, stage, message)
            else:
                moved = f" after {req.num_migrations} migrations" if req.num_migrations else ""
                self.fail(req, stage, message + moved)

    def _move(self, req: RouterRequest, stage: str, why: str) -> None:
        """Restarts `req` as a new attempt on a surviving pair: the old attempt is aborted on
        its nodes (a live one frees its pages now, a dead one's restart starts empty), then a
        background task reserves and dispatches anew (prompt + tokens streamed so far)."""
        log.warning("request %s: %s; moving it to another node pair", req.request_id, why)
        self.metrics.migrations.labels(stage).inc()
        self._restart(req, why)

    def on_request_error(self, msg: RequestError) -> None:
        req = self.requests.get(msg.request_id)
        if req is None:
            return
        draining = [
            self.nodes.nodes[name]
            for name in (req.prefill_node, req.decode_node)
            if name in self.nodes.nodes and self.nodes.nodes[name].status == NodeStatus.DRAINING
        ]
        can_move = req.num_migrations < self.max_migrations and not self.is_closing()
        if draining and can_move:
            # a node whose drain timed out gave the request back: move it, unseen
            self._move(req, msg.stage, f"{draining[0].name} stopped draining: {msg.message}")
        elif msg.stage == "transfer" and can_move and not req.is_done:
            self._move(req, "transfer", f"the KV transfer failed: {msg.message}")
        else:
            moved = f" after {req.num_migrations} migrations" if req.num_migrations else ""
            self.fail(req, msg.stage, msg.message + moved)

    def on_preempted(self, msg: Preempted) -> None:
        req = self.requests.get(msg.request_id)
        if req is None or req.is_done:  # an old attempt's, or it ended meanwhile
            return
        if req.state < RequestState.DECODING:  # P's FirstToken is still on its way
            req.pending_preempt = msg.reason
            return
        self.preempt(req, msg.reason)

    def preempt(self, req: RouterRequest, reason: str) -> None:
        """The decode node dropped the request (its tokens all arrived): restart it, or fail it
        once it has been preempted more than `max_preemptions` times."""
        req.num_preemptions += 1
        self.metrics.preemptions.inc()
        cap = self.max_preemptions
        why = f"preempted by decode node {req.decode_node}: {reason}"
        if req.num_preemptions > cap or self.is_closing():
            message = f"{why} (preempted {req.num_preemptions} times; max_preemptions is {cap})"
            self.fail(req, "preemption", message)
            return
        log.info("request %s: %s; re-prefilling it", req.request_id, why)
        budget = req.timings.first_token + self.timeouts.decode_s - time.monotonic()
        self._restart(req, why, wait_for_room_s=max(self.timeouts.reserve_s, budget))

    def _restart(self, req: RouterRequest, why: str, wait_for_room_s: float = 0.0) -> None:
        self.abort_on_nodes(req, f"moved: {why}")
        self.nodes.release_prefill(req)
        self.nodes.release_decode(req)
        self.requests.pop(req.wire_id, None)
        self.room_changed.set()
        req.restart(secrets.randbits(63))
        self.requests[req.wire_id] = req
        for fork in req.pending_forks:  # n > 1 before the first token: they follow its attempt
            self.requests.pop(fork.wire_id, None)
            fork.attempt, fork.room = req.attempt, req.room
            self.requests[fork.wire_id] = fork
        attempt = self._run_attempt(req, why, wait_for_room_s)
        task = asyncio.create_task(attempt, name=f"move-{req.wire_id}")
        self.moves.add(task)
        task.add_done_callback(self.moves.discard)

    async def _run_attempt(self, req: RouterRequest, why: str, wait_for_room_s: float = 0.0):
        """Reserve and dispatch a restarted request; if no pair takes it within the reserve
        timeout (a preempted one: `wait_for_room_s`), it fails (stage "migration", or
        "preemption") and its client gets the error event."""
        try:
            if not self.readiness.is_serving:
                await self.readiness.wait_for_nodes(self.timeouts.reserve_s)
            if req.is_done:  # the client left, or the router is stopping
                return
            await self.dispatch.reserve_somewhere(req, wait_for_room_s)
            self.dispatch.dispatch_prefill(req)
        except RouterError as exc:
            if req.error is not None and req.error.stage == "admission":  # refused: no pair
                stage, whom = (
                    ("preemption", "no decode node had room for it again")
                    if wait_for_room_s
                    else ("migration", "no other node pair took the request")
                )
                req.error = ErrorEvent(stage, f"{why}; {whom}: {exc.message}")
                self.metrics.failures.labels(stage).inc()
                req.events.put_nowait(req.error)
                self.metrics.requests.labels("failed").inc()
