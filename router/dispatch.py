"""Reserving a request's KV on a decode node, then sending its prompt to a prefill node.

Steps 2 and 3 of `router.core`: the ready decode nodes are asked in the pairing policy's order
(`router.policy`) to reserve pages; a refusal moves on to the next node, a node that refuses
because it drains is marked so, a silent one fails the request (stage "reserve") rather than
letting a late reply be taken for the next node's. A yes that comes after the router gave up
is answered with an Abort, so the node frees those pages at once. Then the prefill node is
picked among SLA admission's candidates (`router.admission`) and sent the prompt with the
decode node's KV endpoint.

`RequestDispatch` owns the reservations in flight (one reply waiter per request); what it does
not own comes in through its constructor: the nodes, the policy, SLA admission, the metrics,
a `send` to the nodes, the unfinished requests (read only), and the coordinator's callables
that end a request (`reject`, `abort_on_nodes`, `forget`) or wait for a ready node
(`wait_for_nodes`). `room_changed` is set by whoever frees decode room (a request ending or
moving); a preempted request's reservation waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NoReturn

from control.cluster_config import TimeoutConfig
from control.protocol import Abort, Prefill, Reserve, ReserveReply, sampling_to_dict
from router.admission import AdmissionControl
from router.metrics import RouterMetrics
from router.nodes import NodeRegistry, NodeState
from router.policy import PairingPolicy
from router.room_queue import RoomQueue
from router.state import RETRY_AFTER_S, ErrorEvent, RequestState, RouterError, RouterRequest

Send = Callable[[str, Any], bool]  # (node name, message) -> whether it was queued


class RequestDispatch:
    """Reserves decode KV and dispatches the prefill (see the module docstring)."""

    def __init__(
        self,
        nodes: NodeRegistry,
        policy: PairingPolicy,
        admission: AdmissionControl,
        metrics: RouterMetrics,
        timeouts: TimeoutConfig,
        max_positions: int,
        requests: Mapping[str, RouterRequest],
        *,
        send: Send,
        reject: Callable[[RouterRequest, str, str], NoReturn],
        abort_on_nodes: Callable[[RouterRequest, str], None],
        forget: Callable[[RouterRequest], None],
        wait_for_nodes: Callable[[float], Awaitable[bool]],
        room_changed: asyncio.Event,
        queue_timeout_s: float = 0.0,
    ):
        self.nodes = nodes
        self.policy = policy
        self.admission = admission
        self.metrics = metrics
        self.timeouts = timeouts
        self.max_positions = max_positions
        self.requests = requests
        self.send = send
        self.reject = reject  # ends a request that never streamed; raises its RouterError
        self.abort_on_nodes = abort_on_nodes
        self.forget = forget
        self.wait_for_nodes = wait_for_nodes
        self.room_changed = room_changed
        self.queue_timeout_s = queue_timeout_s
        self.room_queue = RoomQueue()
        self._reply_waiters: dict[str, asyncio.Future] = {}  # by wire id: reservations asked

    def stop_waiting(self, req: RouterRequest) -> None:
        """A reservation of `req` in flight gets "no answer" now (the request failed, or its
        decode node was lost), so the reservation ends or goes on to the next node."""
        waiter = self._reply_waiters.get(req.wire_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self.room_queue.wake(req.wire_id)

    async def reserve_somewhere(self, req: RouterRequest, wait_for_room_s: float = 0.0) -> None:
        """Asks the ready decode nodes in the policy's order. A node that refuses because it is
        draining is marked so at once; when no decode node is ready at all (draining or
        restarting), waits for one up to the reserve timeout and asks again.

        When every node refuses for want of room, a request may wait for it, in turn
        (`router.room_queue`): a preempted one for `wait_for_room_s`, a new one for `[sla]
        queue_timeout_s` when no admission is set (`queue_timeout_s` here; 0: refused at
        once). While others wait, a new request takes its place behind them before asking."""
        wait_s = wait_for_room_s or self.queue_timeout_s
        preempted = wait_for_room_s > 0
        deadline = time.monotonic() + max(self.timeouts.reserve_s, wait_s)
        refusals: list[str] = []
        try:
            if wait_s and len(self.room_queue):
                self.room_queue.join(req.wire_id, preempted)
            while True:
                queued = req.wire_id in self.room_queue
                if queued and not self.room_queue.is_head(req.wire_id):
                    await self.room_queue.wait_turn(req.wire_id, deadline - time.monotonic())
                    if req.is_done or time.monotonic() >= deadline:
                        break
                    continue
                reserved, refusals, fits = await self._ask_nodes(req)
                if reserved:
                    return
                left = deadline - time.monotonic()
                if req.is_done or left <= 0:
                    break
                if self.nodes.ready("decode"):
                    if not wait_s or not fits:  # no room to wait for: too big for every pool
                        break
                    self.room_queue.join(req.wire_id, preempted)
                    if self.room_queue.is_head(req.wire_id):
                        await self.wait_for_room(left)  # room comes back as holds end
                else:
                    await self.wait_for_nodes(left)  # none ready: one is draining or restarting
        finally:
            waited = self.room_queue.leave(req.wire_id)
            if waited:
                req.room_wait_s += waited
                self.metrics.room_wait.observe(waited)
        if req.is_done:
            error = req.error or ErrorEvent("reserve", "the request ended during reservation")
            self.forget(req)
            raise RouterError(503, error.message, "reserve_failed", RETRY_AFTER_S)
        self.metrics.rejections.labels("no_decode_room").inc()
        why = "; ".join(refusals) or "no decode node has enough free KV pages"
        if req.room_wait_s:
            why += f"; waited {req.room_wait_s:.1f} s for room"
        self.reject(req, f"no decode node admitted the request ({why})", "no_decode_room")

    async def _ask_nodes(self, req: RouterRequest) -> tuple[bool, list[str], bool]:
        """One round over the ready decode nodes: (whether one reserved, each refusal's reason,
        whether any ready node's whole pool could hold it). The policy may rank none (none has
        room by the last heartbeats): no reservation, no refusal."""
        num_prompt = len(req.attempt_prompt_ids)
        max_new, n = req.attempt_sampling.max_new_tokens, req.attempt_sampling.n
        shape = (num_prompt, max_new, self.max_positions, n)
        # A node never admits what could not finish in its whole pool; each reserves by its own
        # rule (on_demand or worst_case): the policy ranks by the smallest (the nodes normally
        # share one), and each node is held for its own.
        ready = [
            node
            for node in self.nodes.ready("decode")
            if node.pages_for(node.worst_case_tokens(*shape)) <= node.total_pages
        ]
        num_tokens = min(
            (node.reservation_tokens(*shape) for node in ready),
            default=min(num_prompt + max_new, self.max_positions),
        )
        refusals = []
        for node in self.policy.rank_decode(ready, num_tokens, req.attempt_prompt_ids):
            if not node.is_ready:  # died or began draining while we asked another
                continue
            reply = await self._reserve_on(req, node, node.reservation_tokens(*shape))
            if req.is_done:  # failed meanwhile (node death, router shutdown)
                return False, refusals, True
            if reply is not None and reply.ok:
                req.timings.reserved = time.monotonic()
                self.metrics.stage.labels("reserve").observe(
                    req.timings.reserved - req.timings.arrival
                )
                return True, [], True
            if reply is not None and reply.draining:
                self.nodes.mark_draining(node)
            refusals.append(f"{node.name}: {reply.reason if reply else 'no answer'}")
        return False, refusals, bool(ready)

    async def _reserve_on(self, req: RouterRequest, node: NodeState, num_tokens: int):
        """Reserve on one decode node: the reply, None for a refusal to send; a silent node
        fails the request (stage reserve) rather than trying another, so a late reply can never
        be mistaken for the next node's."""
        self.nodes.hold_decode(req, node, node.pages_for(num_tokens))
        sampling = req.attempt_sampling
        # The prompt's ids go where they are read: the sampling's penalties, or the node's
        # prefix cache (it says how many leading rows it holds, and caches the prompt after).
        sends_ids = sampling.uses_prompt or bool(node.info.get("prefix_cache"))
        msg = Reserve(
            req.wire_id,
            req.room,
            len(req.attempt_prompt_ids),
            sampling_to_dict(sampling),
            timeout_s=self.timeouts.transfer_s,
            prompt_ids=list(req.attempt_prompt_ids) if sends_ids else [],
            priority=req.timings.arrival,  # the first arrival: a restart keeps its place
            fork_ids=[fork.wire_id for fork in req.pending_forks],
        )
        waiter = asyncio.get_running_loop().create_future()
        self._reply_waiters[req.wire_id] = waiter
        try:
            if not self.send(node.name, msg):
                self.nodes.release_decode(req)
                return None
            reply = await asyncio.wait_for(waiter, self.timeouts.reserve_s)
        except asyncio.TimeoutError:  # not the builtin before Python 3.11
            self.metrics.failures.labels("reserve").inc()
            self.abort_on_nodes(req, "reserve timed out")
            message = (
                f"decode node {node.name} did not answer the reservation within "
                f"{self.timeouts.reserve_s:g} s (stage reserve)"
            )
            self.reject(req, message, "reserve_timeout")
        finally:
            self._reply_waiters.pop(req.wire_id, None)
        if reply is None or not reply.ok:
            self.nodes.release_decode(req)
        return reply

    def dispatch_prefill(self, req: RouterRequest) -> None:
        candidates = self.admission.candidates(req, self.nodes.ready("prefill"))
        # What each node is expected to serve from its prefix cache, before the pick records
        # this prompt as cached on the chosen one.
        cached = {n.name: self.admission.cached_len(n, req.attempt_prompt_ids) for n in candidates}
        node = self.policy.pick_prefill(candidates, req.attempt_prompt_ids)
        if node is None:
            self.abort_on_nodes(req, "no prefill node")
            self.metrics.rejections.labels("no_node").inc()
            self.reject(req, "no prefill node is ready", "no_node_ready")
        self.nodes.hold_prefill(req, node)
        seq = self.admission.next_seq(node.name)
        msg = Prefill(
            req.wire_id,
            req.room,
            req.attempt_prompt_ids,
            sampling_to_dict(req.attempt_sampling),
            kv_endpoint=req.kv_endpoint,
            timeout_s=self.timeouts.prefill_queue_s,
            seq=seq,
            kv_key=req.kv_key,
            skip_rows=req.kv_cached_rows,
        )
        if not self.send(node.name, msg):
            self.abort_on_nodes(req, "prefill node unreachable")
            self.metrics.rejections.labels("unreachable").inc()
            self.reject(req, f"prefill node {node.name} is not accepting requests", "unreachable")
        req.timings.dispatched = time.monotonic()
        self.admission.dispatched(req, node, cached[node.name], seq)
        req.advance(RequestState.PREFILLING)
        self.metrics.dispatched.labels(node.name, "prefill").inc()
        self.metrics.dispatched.labels(req.decode_node, "decode").inc()
        if req.attempt == 0:
            self.metrics.prompt_tokens.inc(req.prompt_len)

    def on_reserve_reply(self, msg: ReserveReply) -> None:
        waiter = self._reply_waiters.get(msg.request_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(msg)
            if msg.ok:
                req = self.requests[msg.request_id]
                req.kv_endpoint, req.kv_key = msg.kv_endpoint, msg.kv_key
                # (a node's word, bounded by the prompt: the prefill node checks it too)
                req.kv_cached_rows = min(max(msg.cached_rows, 0), len(req.attempt_prompt_ids))
            return
        if msg.ok:  # a late yes to a request we gave up on: make the node free its pages
            for node in self.nodes.of_role("decode"):
                self.send(node.name, Abort(msg.request_id, "reservation came too late"))

    async def wait_for_room(self, timeout_s: float) -> None:
        """Until a decode hold ends (a request finished, failed or was preempted) or a
        heartbeat interval passed (room a node freed on its own), at most `timeout_s`."""
        self.room_changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                self.room_changed.wait(), min(timeout_s, self.timeouts.heartbeat_s)
            )
