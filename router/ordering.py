"""The output of a request in order: P's first token, then D's tokens, into its stream.

Step 4 of `router.core`. P's FirstToken and the decode node's StepTokens travel on different
sockets, so D's tokens (and a Preempted) can arrive first: they wait in the request
(`pending_tokens`, `pending_finish`, `pending_preempt`) until the first token is in, then go
out behind it. A StepTokens holds one decode step's output for all its requests: each entry
goes to its own request's stream exactly as if it had come alone; an entry of a request the
router no longer runs (aborted, finished, an old attempt's wire id) is ignored. `_emit` applies
the router's own stop checks, counts tokens and inter-token latency, and ends the request at
a finish (n > 1: each fork starts at P's first token and streams on its own from then on).

`OutputOrdering` keeps no state of its own: the unfinished requests, the nodes, SLA
admission and the metrics come in through its constructor, and so do the coordinator's
callables that end a request (`fail`, `abort_on_nodes`, `close`) and recovery's `preempt`, which
restarts a request whose Preempted had to wait for its first token.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping

from control.logprobs import TokenLogprobs
from control.protocol import FirstToken, RequestTokens, StepTokens
from router.admission import AdmissionControl
from router.metrics import RouterMetrics
from router.nodes import NodeRegistry
from router.state import RequestState, RouterRequest, TokenEvent

log = logging.getLogger("router")


class OutputOrdering:
    """Turns first tokens and step tokens into each request's events (see the module
    docstring)."""

    def __init__(
        self,
        requests: Mapping[str, RouterRequest],
        nodes: NodeRegistry,
        admission: AdmissionControl,
        metrics: RouterMetrics,
        max_positions: int,
        *,
        fail: Callable[[RouterRequest, str, str], None],
        abort_on_nodes: Callable[[RouterRequest, str], None],
        close: Callable[[RouterRequest, str], None],
        preempt: Callable[[RouterRequest, str], None],
    ):
        self.requests = requests
        self.nodes = nodes
        self.admission = admission
        self.metrics = metrics
        self.max_positions = max_positions
        self.fail = fail
        self.abort_on_nodes = abort_on_nodes
        self.close = close  # terminal bookkeeping of a request that finished
        self.preempt = preempt

    def on_first_token(self, msg: FirstToken) -> None:
        req = self.requests.get(msg.request_id)
        if req is None or not req.advance(RequestState.DECODING):
            return
        now = time.monotonic()
        if not req.timings.first_token:  # a moved request keeps the TTFT its client saw
            req.timings.first_token = req.timings.last_token = now
            req.cached_tokens = min(max(msg.cached_tokens, 0), req.prompt_len)
        self.nodes.release_prefill(req)
        self.admission.first_token(req)
        for stage, ms in msg.stage_ms.items():
            self.metrics.stage.labels(stage).observe(ms / 1000)
        if req.num_output_tokens == 0 and req.sampling.prompt_logprobs is not None:
            req.prompt_logprobs = _logprobs_list(
                msg.prompt_logprobs, msg.prompt_top_ids, msg.prompt_top_logprobs, msg.prompt_ranks
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
            self.preempt(req, req.pending_preempt)

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
                self.fail(
                    fork,
                    "prefill",
                    f"the prefill node sent {len(msg.fork_tokens)} first tokens for "
                    f"{len(forks)} forked sequences",
                )
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

    def on_step_tokens(self, msg: StepTokens) -> None:
        """One decode step's output: each request's share to its own stream."""
        now = time.monotonic()
        for out in msg.outputs():
            try:
                self._on_request_tokens(out, now)
            except Exception:  # a bug with one request must not cost the others their tokens
                log.exception("error while handling the tokens of %s", out.request_id)

    def _on_request_tokens(self, out: RequestTokens, now: float) -> None:
        req = self.requests.get(out.request_id)
        if req is None or req.is_done:  # aborted, ended, or an old attempt's
            return
        logprobs = _logprobs_list(out.logprobs, out.top_ids, out.top_logprobs)
        if req.state < RequestState.DECODING:  # the decode node beat P's FirstToken here
            req.pending_tokens.extend(out.token_ids)
            req.pending_logprobs.extend(logprobs)
            req.pending_finish = out.finish_reason
            return
        self._emit(req, out.token_ids, out.finish_reason, now, logprobs)

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
                self.abort_on_nodes(req, "finished")
            self.close(req, "finished")


def _logprobs_list(
    logprobs: list[float],
    top_ids: list[list[int]],
    top_logprobs: list[list[float]],
    ranks: list[int] | None = None,
) -> list[TokenLogprobs]:
    """The wire's parallel lists -> one TokenLogprobs per token ([] when they do not align;
    ranks 0 when they did not travel)."""
    ranks = ranks or [0] * len(logprobs)
    if not (len(logprobs) == len(top_ids) == len(top_logprobs) == len(ranks)):
        return []
    entries = zip(logprobs, top_ids, top_logprobs, ranks, strict=True)
    return [TokenLogprobs(*entry) for entry in entries]


def _first_logprobs(msg: FirstToken) -> list[TokenLogprobs]:
    return _logprobs_list(msg.logprob, [msg.top_ids], [msg.top_logprobs])[:1] if msg.logprob else []
