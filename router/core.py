"""The router's request engine: admission, pairing, the per-request protocol and node health.

For each request (see `router.state` for its state machine):
  1. admit: refuse at once (503 + Retry-After) when too many requests are unfinished; wait
     (up to `reserve_s`) while no node of a role is ready (one restarting or draining); refuse
     or hold a request no prefill node is predicted to serve within the TTFT SLA, as `[sla]
     admission` says (`router.admission`);
  2. reserve: ask decode nodes in the policy's order to reserve KV pages; a refusal moves on
     to the next node, a silent node fails the request (stage "reserve");
  3. prefill: send the prompt to the chosen prefill node with the decode node's KV endpoint;
  4. stream: P's FirstToken and D's Tokens become `TokenEvent`s in output order (D's tokens
     that arrive before P's first token wait in the request); exactly one terminal event ends
     the stream.
Every wait is bounded: the watchdog (`router.recovery`) fails requests past their stage
deadline, finds lost nodes and moves their requests to surviving pairs; failures and aborts
send Abort to both nodes, so pages are freed on both sides whatever happened.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from engine.cluster_config import ClusterConfig
from engine.logprobs import TokenLogprobs
from engine.protocol import (
    Abort,
    FirstToken,
    Heartbeat,
    NodeFailed,
    NodeReady,
    Preempted,
    Prefill,
    RequestError,
    Reserve,
    ReserveReply,
    Tokens,
    sampling_to_dict,
)
from engine.sampling import SamplingParams
from engine.security import CurveSecurity
from router.admission import AdmissionControl, CostModelCollector
from router.metrics import RouterMetrics
from router.nodes import NodeRegistry, NodeState, NodeStatus
from router.policy import PairingPolicy, default_policy
from router.recovery import STAGE_OF_STATE, NodeLossRecovery
from router.request_log import log_request_end
from router.state import ErrorEvent, RequestState, RouterError, RouterRequest, TokenEvent
from router.transport import RouterTransport

log = logging.getLogger("router")

RETRY_AFTER_S = 1


class Router(NodeLossRecovery):
    """Owns the nodes' state, the unfinished requests and the sockets. Event-loop only.

    Args:
        cfg: the cluster config (nodes, timeouts, SLA, router limits).
        eos_token_ids: tokens that end a request unless `ignore_eos`.
        max_positions: the model's context length.
        fingerprint: the model's `ModelConfig.fingerprint()`; nodes reporting another are
            refused (marked dead) at NodeReady.
        security: the cluster's CURVE keys (`engine.security.cluster_security`) for the
            sockets; None for plain ones.
    """

    def __init__(
        self,
        cfg: ClusterConfig,
        eos_token_ids: list[int],
        max_positions: int,
        fingerprint: dict[str, Any] | None = None,
        policy: PairingPolicy | None = None,
        security: CurveSecurity | None = None,
    ):
        self.cfg = cfg
        self.security = security
        self.t = cfg.timeouts
        self.eos_ids = frozenset(eos_token_ids)
        self.max_positions = max_positions
        self.fingerprint = fingerprint
        self.nodes = NodeRegistry(cfg)
        self.policy = policy or default_policy(cfg)
        self.transport: RouterTransport | None = None
        self.metrics = RouterMetrics(self.nodes, cfg.sla, self._num_bad_frames)
        self.admission = AdmissionControl(cfg, self.metrics)  # SLA admission (issue 10 part 2)
        self.admission.cached_len = self.policy.cached_len  # TTFT leaves out expected cache hits
        self.metrics.registry.register(CostModelCollector(self.admission))
        self.requests: dict[str, RouterRequest] = {}
        self._reserve_waiters: dict[str, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._moves: set[asyncio.Task] = set()  # attempts of moved requests being started
        self._nodes_changed = asyncio.Event()  # set when a node becomes ready
        self._room_changed = asyncio.Event()  # set when a decode hold ends (preempted waits)
        self._closing = False
        self.router_id = secrets.token_hex(8)  # new at every start: nodes drop the old one's work

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        endpoints = {n.name: n.control_endpoint for n in self.nodes.nodes.values()}
        bind = self.cfg.router.control_bind_endpoint  # nodes connect to control_endpoint
        self.transport = RouterTransport(bind, endpoints, self.security)
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name="router-recv"),
            asyncio.create_task(self._watchdog_loop(), name="router-watchdog"),
        ]

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
        for task in (*self._tasks, *self._moves):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._moves, return_exceptions=True)
        if self.transport is not None:
            self.transport.close()

    def _num_bad_frames(self) -> int:
        return self.transport.num_bad_frames if self.transport is not None else 0

    @property
    def is_serving(self) -> bool:
        return bool(self.nodes.ready("prefill")) and bool(self.nodes.ready("decode"))

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
                503, f"too many unfinished requests ({limit}); retry later", "overloaded",
                RETRY_AFTER_S,
            )  # fmt: skip
        if not self.is_serving and not await self._wait_for_nodes(self.t.reserve_s):
            self.metrics.rejections.labels("no_node").inc()
            raise RouterError(
                503, "no prefill or no decode node is ready", "no_node_ready", RETRY_AFTER_S
            )
        stop_ids = sampling.stop_ids(self.eos_ids)  # the nodes' rule (structured: EOS always)
        if request_id in self.requests:  # a client-chosen id (x-request-id) still running
            raise RouterError(400, f"request id {request_id!r} is in use", "duplicate_request_id")
        req = RouterRequest(request_id, secrets.randbits(63), prompt_ids, sampling, stop_ids)
        req.forks = [
            RouterRequest(
                f"{request_id}/{i}",
                req.room,
                prompt_ids,
                sampling.for_sequence(i),
                stop_ids,
                parent=req,
            )  # fmt: skip
            for i in range(1, sampling.n)
        ]
        await self.admission.admit(req, lambda: self.nodes.ready("prefill"))  # may 503 or wait
        if request_id in self.requests:  # the same id started while this one waited
            self.admission.forget(req)
            raise RouterError(400, f"request id {request_id!r} is in use", "duplicate_request_id")
        self.requests[req.wire_id] = req
        for fork in req.forks:  # registered now: D may stream one before P's first token
            self.requests[fork.wire_id] = fork
        req.advance(RequestState.RESERVING)
        try:
            await self._reserve_somewhere(req)
        except asyncio.CancelledError:  # the HTTP task went away mid-reservation
            self.abort(req, "cancelled during reservation")
            raise
        self._dispatch_prefill(req)
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

    # ---- admission steps -------------------------------------------------------------------
    async def _reserve_somewhere(self, req: RouterRequest, wait_for_room_s: float = 0.0) -> None:
        """Asks the ready decode nodes in the policy's order. A node that refuses because it is
        draining is marked so at once; when no decode node is ready at all (draining or
        restarting), waits for one up to the reserve timeout and asks again. With
        `wait_for_room_s` (a preempted request), refusals for want of room are retried as
        decode holds end, for up to that long."""
        num_prompt = len(req.attempt_prompt_ids)
        max_new, n = req.attempt_sampling.max_new_tokens, req.attempt_sampling.n
        shape = (num_prompt, max_new, self.max_positions, n)
        deadline = time.monotonic() + max(self.t.reserve_s, wait_for_room_s)
        refusals = []
        while True:
            # A node never admits what could not finish in its whole pool; each reserves by its
            # own rule (on_demand or worst_case): the policy ranks by the smallest (the nodes
            # normally share one), and each node is held for its own.
            ready = [
                node
                for node in self.nodes.ready("decode")
                if node.pages_for(node.worst_case_tokens(*shape)) <= node.total_pages
            ]
            num_tokens = min(
                (node.reservation_tokens(*shape) for node in ready),
                default=min(num_prompt + max_new, self.max_positions),
            )
            candidates = self.policy.rank_decode(ready, num_tokens)
            refusals = []
            for node in candidates:
                if not node.is_ready:  # died or began draining while we asked another
                    continue
                need = node.reservation_tokens(*shape)
                reply = await self._reserve_on(req, node, need)
                if req.is_done:  # failed meanwhile (node death, router shutdown)
                    break
                if reply is not None and reply.ok:
                    req.timings.reserved = time.monotonic()
                    self.metrics.stage.labels("reserve").observe(
                        req.timings.reserved - req.timings.arrival
                    )
                    return
                if reply is not None and reply.draining:
                    self.nodes.mark_draining(node)
                refusals.append(f"{node.name}: {reply.reason if reply else 'no answer'}")
            left = deadline - time.monotonic()
            if req.is_done or left <= 0:
                break
            if self.nodes.ready("decode"):
                if not wait_for_room_s:
                    break
                await self._wait_for_room(left)  # a preempted request: room comes back
            else:
                await self._wait_for_nodes(left)  # none ready: one is draining or restarting
        if req.is_done:
            error = req.error or ErrorEvent("reserve", "the request ended during reservation")
            self._forget(req)
            raise RouterError(503, error.message, "reserve_failed", RETRY_AFTER_S)
        self.metrics.rejections.labels("no_decode_room").inc()
        why = "; ".join(refusals) or "no decode node has enough free KV pages"
        self._reject(req, f"no decode node admitted the request ({why})", "no_decode_room")

    async def _reserve_on(self, req: RouterRequest, node: NodeState, num_tokens: int):
        """Reserve on one decode node: the reply, None for a refusal to send; a silent node
        fails the request (stage reserve) rather than trying another, so a late reply can never
        be mistaken for the next node's."""
        self.nodes.hold_decode(req, node, node.pages_for(num_tokens))
        sampling = req.attempt_sampling
        msg = Reserve(
            req.wire_id, req.room, len(req.attempt_prompt_ids), sampling_to_dict(sampling),
            timeout_s=self.t.transfer_s,
            prompt_ids=list(req.attempt_prompt_ids) if sampling.uses_prompt else [],
            priority=req.timings.arrival,  # the first arrival: a restart keeps its place
            fork_ids=[fork.wire_id for fork in req.pending_forks],
        )  # fmt: skip
        waiter = asyncio.get_running_loop().create_future()
        self._reserve_waiters[req.wire_id] = waiter
        try:
            if not self.transport.send(node.name, msg):
                self.nodes.release_decode(req)
                return None
            reply = await asyncio.wait_for(waiter, self.t.reserve_s)
        except asyncio.TimeoutError:  # not the builtin before Python 3.11
            self.metrics.failures.labels("reserve").inc()
            self._abort_on_nodes(req, "reserve timed out")
            message = (
                f"decode node {node.name} did not answer the reservation within "
                f"{self.t.reserve_s:g} s (stage reserve)"
            )
            self._reject(req, message, "reserve_timeout")
        finally:
            self._reserve_waiters.pop(req.wire_id, None)
        if reply is None or not reply.ok:
            self.nodes.release_decode(req)
        return reply

    def _dispatch_prefill(self, req: RouterRequest) -> None:
        candidates = self.admission.candidates(req, self.nodes.ready("prefill"))
        # What each node is expected to serve from its prefix cache, before the pick records
        # this prompt as cached on the chosen one.
        cached = {n.name: self.admission.cached_len(n, req.attempt_prompt_ids) for n in candidates}
        node = self.policy.pick_prefill(candidates, req.attempt_prompt_ids)
        if node is None:
            self._abort_on_nodes(req, "no prefill node")
            self.metrics.rejections.labels("no_node").inc()
            self._reject(req, "no prefill node is ready", "no_node_ready")
        self.nodes.hold_prefill(req, node)
        seq = self.admission.next_seq(node.name)
        msg = Prefill(
            req.wire_id, req.room, req.attempt_prompt_ids, sampling_to_dict(req.attempt_sampling),
            kv_endpoint=req.kv_endpoint, timeout_s=self.t.prefill_queue_s, seq=seq,
        )  # fmt: skip
        if not self.transport.send(node.name, msg):
            self._abort_on_nodes(req, "prefill node unreachable")
            self.metrics.rejections.labels("unreachable").inc()
            self._reject(req, f"prefill node {node.name} is not accepting requests", "unreachable")
        req.timings.dispatched = time.monotonic()
        self.admission.dispatched(req, node, cached[node.name], seq)
        req.advance(RequestState.PREFILLING)
        self.metrics.dispatched.labels(node.name, "prefill").inc()
        self.metrics.dispatched.labels(req.decode_node, "decode").inc()
        if req.attempt == 0:
            self.metrics.prompt_tokens.inc(req.prompt_len)

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
            Heartbeat: self._on_heartbeat,
            NodeReady: self._on_node_ready,
            NodeFailed: self._on_node_failed,
            ReserveReply: self._on_reserve_reply,
            FirstToken: self._on_first_token,
            Tokens: self._on_tokens,
            RequestError: self._on_request_error,
            Preempted: self._on_preempted,  # router.recovery
        }.get(type(msg))
        if handler is None:
            log.warning("ignored a %s sent to the router", type(msg).__name__)
            return
        handler(msg)

    def _on_heartbeat(self, msg: Heartbeat) -> None:
        node = self.nodes.get(msg.node, msg.role)
        if node is None:
            return
        if node.status == "dead" and node.error.startswith("incompatible"):
            return  # a node refused at NodeReady stays out until it restarts
        if self.nodes.on_heartbeat(node, msg):
            self._nodes_changed.set()
            log.info("node %s (%s) is alive", node.name, node.role)
        self.policy.observe_heartbeat(node)
        self.admission.on_heartbeat(node, msg)

    def _on_node_ready(self, msg: NodeReady) -> None:
        node = self.nodes.get(msg.node, msg.role)
        if node is None:
            log.warning(
                "NodeReady from %r (%s), which is not in the cluster config", msg.node, msg.role
            )
            return
        if node.num_active:  # it restarted: whatever it held is gone
            self._fail_node_requests(node, "restarted")
        mismatch = _fingerprint_mismatch(self.fingerprint, msg.info.get("fingerprint"))
        if mismatch:
            self.nodes.mark_dead(node, f"incompatible model: {mismatch}")
            log.error(
                "node %s serves another model; it gets no requests (%s)", node.name, node.error
            )
            return
        self.nodes.mark_ready(node, msg.info)
        self._nodes_changed.set()
        log.info("node %s (%s) is ready", node.name, node.role)

    def _on_node_failed(self, msg: NodeFailed) -> None:
        node = self.nodes.get(msg.node, msg.role)
        if node is None:
            return
        log.error("node %s (%s) failed: %s", node.name, node.role, msg.error)
        self.nodes.mark_dead(node, msg.error)
        self._fail_node_requests(node, f"failed: {msg.error}")

    def _on_reserve_reply(self, msg: ReserveReply) -> None:
        waiter = self._reserve_waiters.get(msg.request_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(msg)
            if msg.ok:
                self.requests[msg.request_id].kv_endpoint = msg.kv_endpoint
            return
        if msg.ok:  # a late yes to a request we gave up on: make the node free its pages
            for node in self.nodes.of_role("decode"):
                self.transport.send(node.name, Abort(msg.request_id, "reservation came too late"))

    def _on_first_token(self, msg: FirstToken) -> None:
        req = self.requests.get(msg.request_id)
        if req is None or not req.advance(RequestState.DECODING):
            return
        now = time.monotonic()
        if not req.timings.first_token:  # a moved request keeps the TTFT its client saw
            req.timings.first_token = req.timings.last_token = now
        self.nodes.release_prefill(req)
        self.admission.first_token(req)
        for stage, ms in msg.stage_ms.items():
            self.metrics.stage.labels(stage).observe(ms / 1000)
        if req.attempt == 0 and req.sampling.prompt_logprobs is not None:
            req.prompt_logprobs = _logprobs_list(
                msg.prompt_logprobs, msg.prompt_top_ids, msg.prompt_top_logprobs
            )
        self._start_forks(req, msg, now)
        self._first_output(req, msg.token, _first_logprobs(msg), now)

    def _first_output(
        self, req: RouterRequest, token: int, logprobs: list[TokenLogprobs], now: float
    ) -> None:
        """The first token and whatever of D's beat it here, then a Preempted that did."""
        tokens, finish = [token, *req.pending_tokens], req.pending_finish
        logprobs = [*logprobs, *req.pending_logprobs]
        req.pending_tokens, req.pending_logprobs = [], []
        self._emit(req, tokens, finish, now, logprobs)
        if req.pending_preempt is not None and not req.is_done:  # D's Preempted came first
            self._preempt(req, req.pending_preempt)

    def _start_forks(self, req: RouterRequest, msg: FirstToken, now: float) -> None:
        """n > 1: each fork starts DECODING on the request's decode node with its own first
        token (from `msg`); the request itself is one sequence from now on (its restarts
        re-prefill only it)."""
        forks = req.pending_forks
        if not forks:
            return
        req.sampling = req.sampling.for_sequence(0)  # from now on: no pending forks
        if len(msg.fork_tokens) != len(forks):
            for fork in forks:
                self._fail(
                    fork, "prefill",
                    f"the prefill node sent {len(msg.fork_tokens)} first tokens for "
                    f"{len(forks)} forked sequences",
                )  # fmt: skip
            return
        logprobs = _logprobs_list(msg.fork_logprobs, msg.fork_top_ids, msg.fork_top_logprobs)
        node = self.nodes.nodes.get(req.decode_node or "")
        for i, (fork, token) in enumerate(zip(forks, msg.fork_tokens, strict=True)):
            if not fork.advance(RequestState.DECODING):  # ended meanwhile
                continue
            fork.kv_endpoint = req.kv_endpoint
            fork.timings = dataclasses.replace(req.timings)
            fork.prompt_logprobs = req.prompt_logprobs
            if node is not None:  # counted as active there (its pages are in req's hold)
                self.nodes.hold_decode(fork, node, 0)
            else:
                fork.decode_node = req.decode_node
            self._first_output(fork, token, logprobs[i : i + 1] if logprobs else [], now)

    def _on_tokens(self, msg: Tokens) -> None:
        req = self.requests.get(msg.request_id)
        if req is None or req.is_done:
            return
        logprobs = _logprobs_list(msg.logprobs, msg.top_ids, msg.top_logprobs)
        if req.state < RequestState.DECODING:  # the decode node beat P's FirstToken here
            req.pending_tokens.extend(msg.token_ids)
            req.pending_logprobs.extend(logprobs)
            req.pending_finish = msg.finish_reason
            return
        self._emit(req, msg.token_ids, msg.finish_reason, time.monotonic(), logprobs)

    def _on_request_error(self, msg: RequestError) -> None:
        req = self.requests.get(msg.request_id)
        if req is None:
            return
        draining = [
            self.nodes.nodes[name]
            for name in (req.prefill_node, req.decode_node)
            if name in self.nodes.nodes and self.nodes.nodes[name].status == NodeStatus.DRAINING
        ]
        if draining and req.num_migrations < self.cfg.router.max_migrations and not self._closing:
            # a node whose drain timed out gave the request back: move it, unseen
            self._move(req, msg.stage, f"{draining[0].name} stopped draining: {msg.message}")
        else:
            self._fail(req, msg.stage, msg.message)

    # ---- output ----------------------------------------------------------------------------
    def _emit(
        self,
        req: RouterRequest,
        tokens: list[int],
        finish: str | None,
        now: float,
        logprobs: list[TokenLogprobs] = (),
    ) -> None:
        """Queues tokens for the client; ends the request at a finish (the node's or its own).
        `logprobs`: one per token when the sampling asked (a node that sent fewer sends none)."""
        out, local_finish = req.accept_tokens(tokens, self.max_positions)
        logprobs = list(logprobs)[: len(out)] if len(logprobs) >= len(out) else []
        if out:
            if req.num_output_tokens > 0:
                gap = (now - req.timings.last_token) / len(out)
                for _ in out:
                    self.metrics.itl.observe(gap)
            req.timings.last_token = now
        req.num_output_tokens += len(out)
        self.metrics.output_tokens.inc(len(out))
        final = local_finish or finish
        if not out and final is None:
            return
        req.events.put_nowait(TokenEvent(out, final, logprobs))
        if final is not None and req.advance(RequestState.FINISHED):
            req.finish_reason = final
            if finish is None:  # ended here before the decode node said so: it must drop it
                self._abort_on_nodes(req, "finished")
            self._close(req, "finished")

    # ---- failure paths ---------------------------------------------------------------------
    def _fail(self, req: RouterRequest, stage: str, message: str) -> None:
        if not req.advance(RequestState.FAILED):
            return
        req.error = ErrorEvent(stage, message)
        self._abort_on_nodes(req, f"failed at {stage}")
        waiter = self._reserve_waiters.get(req.wire_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
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


def _fingerprint_mismatch(mine: dict[str, Any] | None, theirs: Any) -> str | None:
    """One line naming the first model field a node's fingerprint disagrees on, else None.

    A node's fingerprint may add fields (KV layout) and may prefix the model's with "model."
    (kvtransfer's form); fields it does not report are not checked here (the prefill/decode
    handshake checks the full layout)."""
    if not mine or not isinstance(theirs, dict):
        return None
    for key, value in mine.items():
        for name in (key, f"model.{key}"):
            if name in theirs and theirs[name] != value:
                return f"'{key}' is {theirs[name]!r} on the node, {value!r} here"
    return None


def _logprobs_list(
    logprobs: list[float], top_ids: list[list[int]], top_logprobs: list[list[float]]
) -> list[TokenLogprobs]:
    """The wire's parallel lists -> one TokenLogprobs per token ([] when they do not align)."""
    if not (len(logprobs) == len(top_ids) == len(top_logprobs)):
        return []
    return [TokenLogprobs(*entry) for entry in zip(logprobs, top_ids, top_logprobs, strict=True)]


def _first_logprobs(msg: FirstToken) -> list[TokenLogprobs]:
    return _logprobs_list(msg.logprob, [msg.top_ids], [msg.top_logprobs])[:1] if msg.logprob else []
