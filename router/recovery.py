"""What the router does about lost nodes: finding them, and moving their requests.

Detection (the watchdog, every quarter second): a node whose control connection dropped (its
process exited; `RouterTransport.lost_connections`), a node silent past `node_timeout_s` (hung),
and requests past their stage deadline. The watchdog also renews every live node's lease on the
router's requests (`RouterPing`; see `engine.lease`).

Recovery: a request whose node is lost is moved to a surviving pair as a new attempt
(`RouterRequest.restart`): before its first token a plain retry, after it a re-prefill of the
prompt and the tokens already streamed, so the stream goes on where it stopped. At most
`max_migrations` moves; then it fails with an error naming the stage.

Preemption (on-demand decode KV, issue 10 part 3): a decode node whose KV pool ran out sends
`Preempted` after the request's last Tokens; the request restarts the same way (prompt + output
re-prefilled, on any pair, the same decode node included), with its own bound,
`max_preemptions` (not counted in `max_migrations`); one more fails it (stage "preemption").
A preempted attempt waits for a decode node with room (refusals are retried as holds end) for
what is left of its decode budget (`decode_s` after its first token, at least `reserve_s`);
then it fails (stage "preemption"). A Preempted that arrives before P's FirstToken (another
socket) waits in the request until that token is in, so no token is lost.

A mixin of `router.core.Router`, whose state it uses (nodes, requests, transport, metrics,
timeouts) and whose request steps it calls (`_reserve_somewhere`, `_dispatch_prefill`, `_fail`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time

from engine.protocol import Preempted, RouterPing
from router.nodes import NodeState
from router.state import ErrorEvent, RequestState, RouterError, RouterRequest

log = logging.getLogger("router")

STAGE_OF_STATE = {
    RequestState.CREATED: "reserve",
    RequestState.RESERVING: "reserve",
    RequestState.PREFILLING: "prefill",
    RequestState.DECODING: "decode",
}


class NodeLossRecovery:
    """Finds lost nodes and moves their requests (see the module docstring)."""

    def _fail_node_requests(self, node: NodeState, what: str) -> None:
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
                waiter = self._reserve_waiters.get(req.wire_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
            elif req.num_migrations < self.cfg.router.max_migrations and not self._closing:
                self._move(req, stage, message)
            else:
                moved = f" after {req.num_migrations} migrations" if req.num_migrations else ""
                self._fail(req, stage, message + moved)

    def _move(self, req: RouterRequest, stage: str, why: str) -> None:
        """Restarts `req` as a new attempt on a surviving pair: the old attempt is aborted on
        its nodes (a live one frees its pages now, a dead one's restart starts empty), then a
        background task reserves and dispatches anew (prompt + tokens streamed so far)."""
        log.warning("request %s: %s; moving it to another node pair", req.request_id, why)
        self.metrics.migrations.labels(stage).inc()
        self._restart(req, why)

    def _on_preempted(self, msg: Preempted) -> None:
        req = self.requests.get(msg.request_id)
        if req is None or req.is_done:  # an old attempt's, or it ended meanwhile
            return
        if req.state < RequestState.DECODING:  # P's FirstToken is still on its way
            req.pending_preempt = msg.reason
            return
        self._preempt(req, msg.reason)

    def _preempt(self, req: RouterRequest, reason: str) -> None:
        """The decode node dropped the request (its Tokens all arrived): restart it, or fail it
        once it has been preempted more than `max_preemptions` times."""
        req.num_preemptions += 1
        self.metrics.preemptions.inc()
        cap = self.cfg.router.max_preemptions
        why = f"preempted by decode node {req.decode_node}: {reason}"
        if req.num_preemptions > cap or self._closing:
            message = f"{why} (preempted {req.num_preemptions} times; max_preemptions is {cap})"
            self._fail(req, "preemption", message)
            return
        log.info("request %s: %s; re-prefilling it", req.request_id, why)
        budget = req.timings.first_token + self.t.decode_s - time.monotonic()
        self._restart(req, why, wait_for_room_s=max(self.t.reserve_s, budget))

    def _restart(self, req: RouterRequest, why: str, wait_for_room_s: float = 0.0) -> None:
        self._abort_on_nodes(req, f"moved: {why}")
        self.nodes.release_prefill(req)
        self.nodes.release_decode(req)
        self.requests.pop(req.wire_id, None)
        self._room_changed.set()
        req.restart(secrets.randbits(63))
        self.requests[req.wire_id] = req
        for fork in req.pending_forks:  # n > 1 before the first token: they follow its attempt
            self.requests.pop(fork.wire_id, None)
            fork.attempt, fork.room = req.attempt, req.room
            self.requests[fork.wire_id] = fork
        attempt = self._run_attempt(req, why, wait_for_room_s)
        task = asyncio.create_task(attempt, name=f"move-{req.wire_id}")
        self._moves.add(task)
        task.add_done_callback(self._moves.discard)

    async def _run_attempt(self, req: RouterRequest, why: str, wait_for_room_s: float = 0.0):
        """Reserve and dispatch a restarted request; if no pair takes it within the reserve
        timeout (a preempted one: `wait_for_room_s`), it fails (stage "migration", or
        "preemption") and its client gets the error event."""
        try:
            if not self.is_serving:
                await self._wait_for_nodes(self.t.reserve_s)
            if req.is_done:  # the client left, or the router is stopping
                return
            await self._reserve_somewhere(req, wait_for_room_s)
            self._dispatch_prefill(req)
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

    async def _wait_for_room(self, timeout_s: float) -> None:
        """Until a decode hold ends (a request finished, failed or was preempted) or a
        heartbeat interval passed (room a node freed on its own), at most `timeout_s`."""
        self._room_changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._room_changed.wait(), min(timeout_s, self.t.heartbeat_s))

    async def _wait_for_nodes(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for a ready prefill and a ready decode node (one may be
        restarting or draining); True if the cluster serves."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.is_serving and not self._closing:
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._nodes_changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._nodes_changed.wait(), left)
        return self.is_serving and not self._closing

    async def _watchdog_loop(self) -> None:
        period = min(0.25, self.t.heartbeat_s / 2)
        next_ping = 0.0
        while True:
            await asyncio.sleep(period)
            try:
                now = time.monotonic()
                self.check_deadlines(now)
                if now >= next_ping:  # renew every node's lease on our requests
                    next_ping = now + self.t.heartbeat_s
                    ping = RouterPing(self.router_id, self.t.lease_s)
                    for node in self.nodes.nodes.values():
                        if node.is_alive:  # a dead one's queue would only fill up
                            self.transport.send(node.name, ping)
            except Exception:
                log.exception("watchdog error")

    def check_deadlines(self, now: float) -> None:
        """Declares silent nodes dead and fails requests past their stage deadline."""
        for name in self.transport.lost_connections() if self.transport is not None else ():
            node = self.nodes.nodes.get(name)
            if node is not None and node.is_alive:
                log.error("node %s (%s) closed its connection: declared dead", name, node.role)
                self.nodes.mark_dead(node, "connection lost (the process exited)")
                self._fail_node_requests(node, "exited (connection lost)")
        for node in self.nodes.expired(self.t.node_timeout_s, now):
            silent = now - node.last_seen
            log.error("node %s (%s) silent for %.1f s: declared dead", node.name, node.role, silent)
            self.nodes.mark_dead(node, f"no heartbeat for {silent:.1f} s")
            self._fail_node_requests(node, f"stopped answering (no heartbeat for {silent:.1f} s)")
        prefill_limit = self.t.prefill_queue_s + self.t.transfer_s
        for req in list(self.requests.values()):
            error = req.overdue(now, prefill_limit, self.t.decode_s)
            if error is not None:
                self._fail(req, error.stage, error.message)
