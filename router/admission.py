"""SLA admission: the router predicts each request's TTFT on every prefill node and, when no node
can meet `[sla] ttft_ms`, applies `[sla] admission` ("reject" | "queue" | "none").

Per prefill node a `PrefillCost`, per decode node a `DecodeCost` (`control.cost_model`), fed by
the timing samples in the nodes' heartbeats (the prior until the first). The prediction for a
prompt of L tokens on prefill node n (chunk size C_n, cost model P_n):

    TTFT_n = queue_n + prefill_n + transfer_n
    queue_n    = P_n.predict_forward(Q_tokens, Q_attention, Q_forwards)
                 Q = the node's queued work in its last heartbeat (tokens, sum of new*prefix over
                 the chunks still to compute, forwards at least) + the same figures of every
                 request the router admitted to it that the heartbeat does not include yet (a
                 Prefill carries the router's per-node `seq`; the heartbeat, the last it took)
    prefill_n  = P_n.predict_forward(new + fill, attention, F)   for the prompt's own chunks
                 (F forwards of C_n tokens, after K_n tokens the pairing policy expects node n
                 to serve from its prefix cache, `cached_len`: 0 without a prefix cache);
                 fill = min(F * max_batch_tokens - new, lambda_n * alone_n): the node packs the
                 chunks of later arrivals into the prompt's forwards, slowing them; lambda_n is
                 the prompt tokens/s the router sent node n over the last 10 s, alone_n the
                 prompt's forwards' time without them (first order: arrivals during its prefill)
    transfer_n = min(C_n, L) * kv_bytes_per_token / [sla] kv_bytes_per_s
                 (rows stream out while the next chunk computes: only the last chunk's rows
                 are sent after the compute; bytes per token from the node's KV fingerprint)

The queue is taken as FIFO and serial: a packed forward shares its fixed cost among its chunks,
so the estimate errs long, by at most the fixed cost of each shared forward. The check compares TTFT_n from now with ttft_ms; time a request
already spent waiting at the router ("queue") is not counted against it (the operator chose to
trade that wait for service). With "none" the prediction is still made and exported (the
predicted-vs-measured error), but it changes nothing.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily

from control.cluster_config import ClusterConfig
from control.cost_model import DecodeCost, PrefillCost, prompt_features
from control.protocol import Heartbeat
from router.nodes import NodeState
from router.state import RouterError, RouterRequest

ARRIVAL_WINDOW_S = 10.0  # the prompt-token arrival rate per prefill node is taken over this
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "int8": 1}
SLA_CODE = "sla_unmet"


@dataclass
class Work:
    """Prefill work in the cost model's features."""

    tokens: int = 0
    attention: float = 0.0  # sum of new*prefix
    forwards: int = 0

    def plus(self, other: Work) -> Work:
        return Work(
            self.tokens + other.tokens,
            self.attention + other.attention,
            self.forwards + other.forwards,
        )


@dataclass(frozen=True)
class Prediction:
    node: str
    ttft_s: float
    queue_s: float
    prefill_s: float
    transfer_s: float


@dataclass
class _Admitted:
    """A request the router sent (or is about to send) to a prefill node, not yet known to be in
    one of its heartbeats."""

    node: str
    work: Work
    seq: int = 0  # its Prefill's `seq` (0: still reserving, not sent yet)
    predicted_ttft_s: float = 0.0  # from arrival, for the predicted-vs-measured metric


class AdmissionControl:
    def __init__(self, cfg: ClusterConfig, metrics, replica: int = 0):
        """`metrics`: the router's RouterMetrics (rejections, TTFT prediction error);
        `replica`: the router's place (`control.router_links`), whose Prefill numbering the
        nodes' heartbeats report back."""
        self.sla = cfg.sla
        self.replica = replica
        self.metrics = metrics
        self.prefill_cost = {p.name: PrefillCost() for p in cfg.prefill}
        self.decode_cost = {d.name: DecodeCost() for d in cfg.decode}
        self.chunk_size = {p.name: p.chunk_size for p in cfg.prefill}
        self.max_batch_tokens = {p.name: p.max_batch_tokens for p in cfg.prefill}
        self._template = cfg.prefill[
            0
        ]  # a joined prefill node's settings (ClusterConfig.joining_node)
        self._admitted: dict[int, _Admitted] = {}  # by id() of the RouterRequest (all attempts)
        self._last_seq: dict[str, int] = {}  # per prefill node: the last Prefill.seq sent
        self._arrivals: dict[str, deque] = {}  # per prefill node: (time, new tokens) sent
        self._changed: asyncio.Future | None = None  # resolved at the next heartbeat
        self.num_waiting = 0  # requests queued for admission ("queue"), not yet started
        # (node, prompt ids) -> prompt tokens it will serve from its prefix cache; the router
        # sets the cache-aware policy's estimate here.
        self.cached_len: Callable[[NodeState, list[int]], int] = lambda node, prompt_ids: 0

    def _know(self, node: NodeState) -> None:
        """A node that joined at run time gets the models and settings a configured one has."""
        if node.role == "prefill" and node.name not in self.prefill_cost:
            self.prefill_cost[node.name] = PrefillCost()
            self.chunk_size[node.name] = self._template.chunk_size
            self.max_batch_tokens[node.name] = self._template.max_batch_tokens
        elif node.role == "decode" and node.name not in self.decode_cost:
            self.decode_cost[node.name] = DecodeCost()

    def forget_node(self, name: str) -> None:
        """A joined node left: its models go (they are in /metrics)."""
        for table in (self.prefill_cost, self.decode_cost, self.chunk_size, self.max_batch_tokens):
            table.pop(name, None)
        self._last_seq.pop(name, None)
        self._arrivals.pop(name, None)

    # ---- learning ----------------------------------------------------------------------------
    def on_heartbeat(self, node: NodeState, hb: Heartbeat) -> None:
        """Feeds the node's timing samples to its cost model, drops the admitted requests this
        heartbeat accounts for, and wakes the requests queued for admission."""
        self._know(node)
        prefill, decode = self.prefill_cost.get(node.name), self.decode_cost.get(node.name)
        for sample in hb.timing_samples:
            if len(sample) != 3 or not all(math.isfinite(v) and v >= 0 for v in sample):
                continue  # a garbled sample must not poison the model
            x1, x2, seconds = sample
            if node.role == "prefill" and prefill is not None:
                prefill.observe_forward(int(x1), x2, seconds)  # new tokens, sum new*prefix
            elif node.role == "decode" and decode is not None:
                decode.observe(int(x1), int(x2), seconds)  # batch, total context
        if node.role == "prefill":
            seqs, replica = hb.prefill_seqs, self.replica  # our own numbering's last taken
            taken = seqs[replica] if replica < len(seqs) else 0
            for entry in self._admitted.values():
                if entry.node == node.name and 0 < entry.seq <= taken:
                    entry.work = Work()  # the node took its Prefill: its queued figures have it
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None

    # ---- prediction --------------------------------------------------------------------------
    def predict(
        self, node: NodeState, prompt_len: int, exclude: int | None = None, cached_len: int = 0
    ) -> Prediction:
        """Predicted TTFT of a `prompt_len`-token prompt on prefill node `node` (module doc), of
        which `cached_len` come from its prefix cache; `exclude`: a request whose own admitted
        work is not queue ahead of itself."""
        self._know(node)
        cost = self.prefill_cost[node.name]
        chunk = self.chunk_size[node.name]
        queued = self._queued(node, exclude)
        queue_s = cost.predict_forward(queued.tokens, queued.attention, queued.forwards)
        new, attention, forwards = prompt_features(prompt_len, cached_len, chunk)
        # The node packs the chunks of later arrivals into this prompt's forwards (up to
        # max_batch_tokens each), which slows them: the tokens expected to arrive meanwhile.
        alone_s = cost.predict_forward(new, attention, forwards)
        room = max(0, forwards * self.max_batch_tokens[node.name] - new)
        fill = min(room, self.arrival_rate(node.name) * alone_s)
        prefill_s = cost.predict_forward(new + fill, attention, forwards)
        last_chunk = min(chunk, prompt_len)
        transfer_s = last_chunk * _kv_bytes_per_token(node) / self.sla.kv_bytes_per_s
        total = queue_s + prefill_s + transfer_s
        return Prediction(node.name, total, queue_s, prefill_s, transfer_s)

    def ranked(
        self, nodes: list[NodeState], prompt_ids: list[int], exclude: int | None = None
    ) -> list[Prediction]:
        """Predictions for `nodes`, lowest TTFT first (ties by name)."""
        n_ids = len(prompt_ids)
        preds = [self.predict(n, n_ids, exclude, self.cached_len(n, prompt_ids)) for n in nodes]
        return sorted(preds, key=lambda p: (p.ttft_s, p.node))

    def _queued(self, node: NodeState, exclude: int | None) -> Work:
        hb = node.heartbeat
        work = Work()
        if hb is not None:
            work = Work(hb.queued_tokens, hb.queued_attention, hb.queued_forwards)
        for key, entry in self._admitted.items():
            if entry.node == node.name and key != exclude:
                work = work.plus(entry.work)
        return work

    # ---- admission ---------------------------------------------------------------------------
    async def admit(self, req: RouterRequest, ready_prefill: Callable[[], list[NodeState]]) -> None:
        """Returns once the request may start; RouterError 503 (code "sla_unmet") when the
        policy refuses it. Its work counts as queued on the best node from here on (so a burst
        admitted together sees itself), until `dispatched` moves it or `forget` drops it."""
        policy = self.sla.admission
        target_s = self.sla.ttft_ms / 1000.0
        deadline = time.monotonic() + self.sla.queue_s
        prompt_ids = req.attempt_prompt_ids
        while True:
            nodes = ready_prefill()
            best = self.ranked(nodes, prompt_ids)[:1]
            if not best or policy == "none" or best[0].ttft_s <= target_s:
                node = next((n for n in nodes if best and n.name == best[0].node), None)
                self._hold(req, node, prompt_ids)
                return
            left = deadline - time.monotonic()
            if policy == "reject" or left <= 0:
                self._refuse(best[0], target_s, policy)
            self.num_waiting += 1
            try:
                await self._wait_for_heartbeat(left)
            finally:
                self.num_waiting -= 1

    def _hold(
        self, req: RouterRequest, node: NodeState | None, prompt_ids: list[int], cached=None
    ) -> _Admitted:
        name = node.name if node is not None else ""
        if cached is None:
            cached = self.cached_len(node, prompt_ids) if node is not None else 0
        chunk = self.chunk_size.get(name, 1)
        tokens, attention, forwards = prompt_features(len(prompt_ids), cached, chunk)
        entry = self._admitted[id(req)] = _Admitted(name, Work(tokens, attention, forwards))
        return entry

    def _refuse(self, best: Prediction, target_s: float, policy: str) -> None:
        self.metrics.rejections.labels("sla").inc()
        waited = f" after waiting {self.sla.queue_s:g} s" if policy == "queue" else ""
        message = (
            f"the TTFT SLA cannot be met now{waited}: predicted time to first token "
            f"{best.ttft_s * 1000:.1f} ms on the best prefill node ({best.node}: queue "
            f"{best.queue_s * 1000:.1f} ms, prefill {best.prefill_s * 1000:.1f} ms, transfer "
            f"{best.transfer_s * 1000:.1f} ms), target ttft_ms = {self.sla.ttft_ms:g}; retry later"
        )
        # The queue ahead is what has to drain before the prediction fits.
        retry_after = max(1, math.ceil(best.ttft_s - target_s))
        raise RouterError(503, message, SLA_CODE, retry_after)

    async def _wait_for_heartbeat(self, timeout_s: float) -> None:
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        try:  # shielded: one waiter's cancellation must not wake (or break) the others
            await asyncio.wait_for(asyncio.shield(self._changed), max(0.0, timeout_s))
        except asyncio.TimeoutError:  # not the builtin before Python 3.11
            pass

    # ---- the request's later moves -----------------------------------------------------------
    def candidates(self, req: RouterRequest, nodes: list[NodeState]) -> list[NodeState]:
        """The prefill nodes the pairing policy may choose from: with admission on, those
        predicted to meet ttft_ms (the best alone when none does: load changed since `admit`);
        with "none", all of them."""
        if self.sla.admission == "none" or not nodes:
            return nodes
        target_s = self.sla.ttft_ms / 1000.0
        preds = self.ranked(nodes, req.attempt_prompt_ids, exclude=id(req))
        fits = {p.node for p in preds if p.ttft_s <= target_s} or {preds[0].node}
        return [n for n in nodes if n.name in fits]

    def arrival_rate(self, node: str, now: float | None = None) -> float:
        """Prompt tokens per second the router sent `node` over the last ARRIVAL_WINDOW_S."""
        now = time.monotonic() if now is None else now
        recent = self._arrivals.get(node)
        if not recent:
            return 0.0
        while recent and recent[0][0] < now - ARRIVAL_WINDOW_S:
            recent.popleft()
        return sum(tokens for _, tokens in recent) / ARRIVAL_WINDOW_S

    def next_seq(self, node: str) -> int:
        """The `seq` of the next Prefill to `node` (1, 2, ...)."""
        self._last_seq[node] = self._last_seq.get(node, 0) + 1
        return self._last_seq[node]

    def dispatched(self, req: RouterRequest, node: NodeState, cached_len: int, seq: int) -> None:
        """The request's Prefill went to `node`, expected to serve `cached_len` of its tokens
        from its prefix cache: its work is queued there until a heartbeat counts it; its
        predicted TTFT (from arrival) is kept for the error metric."""
        now, prompt_ids = time.monotonic(), req.attempt_prompt_ids
        pred = self.predict(node, len(prompt_ids), exclude=id(req), cached_len=cached_len)
        entry = self._hold(req, node, prompt_ids, cached_len)
        entry.seq = seq
        arrivals = self._arrivals.setdefault(node.name, deque())
        arrivals.append((now, max(0, len(prompt_ids) - cached_len)))
        entry.predicted_ttft_s = (now - req.timings.arrival) + pred.ttft_s

    def first_token(self, req: RouterRequest) -> None:
        """P's first token: records measured - predicted TTFT (first attempts: a moved request
        keeps the TTFT its client saw); the node has counted its work since."""
        entry = self._admitted.pop(id(req), None)
        if entry is not None and entry.seq > 0 and req.attempt == 0:
            measured = req.timings.first_token - req.timings.arrival
            self.metrics.ttft_prediction_error.observe(measured - entry.predicted_ttft_s)

    def forget(self, req: RouterRequest) -> None:
        """The request ended or was refused: nothing of it is queued any more."""
        self._admitted.pop(id(req), None)


def _kv_bytes_per_token(node: NodeState) -> int:
    """Latent KV bytes per token, from the KV layout in the node's NodeReady fingerprint (0
    before it is known: the transfer term is then left out)."""
    fp = node.info.get("fingerprint")
    if not isinstance(fp, dict):
        return 0
    layers, width = fp.get("num_layers"), fp.get("row_width")
    size = DTYPE_BYTES.get(str(fp.get("dtype")), 0)
    if not isinstance(layers, int) or not isinstance(width, int):
        return 0
    return max(0, layers) * max(0, width) * size


class CostModelCollector:
    """/metrics: each node's fitted cost model (weights by term, samples seen), read at scrape
    time, so an operator (or `duet plan`) sees what the router believes about its nodes."""

    TERMS = {"prefill": ("fixed", "per_token", "per_token_x_prefix"),
             "decode": ("fixed", "per_request", "per_context_token")}  # fmt: skip

    def __init__(self, admission: AdmissionControl):
        self.admission = admission

    def collect(self):
        weights = GaugeMetricFamily(
            "duet_cost_model_weight",
            "Seconds per unit of each term of a node's online cost model (prefill forward, "
            "decode step)",
            labels=["node", "role", "term"],
        )
        samples = GaugeMetricFamily(
            "duet_cost_model_samples",
            "Timing samples a node's cost model has seen",
            labels=["node", "role"],
        )
        models = [("prefill", self.admission.prefill_cost), ("decode", self.admission.decode_cost)]
        for role, costs in models:
            for name, cost in costs.items():
                for term, w in zip(self.TERMS[role], cost.model.weights, strict=True):
                    weights.add_metric([name, role, term], w)
                samples.add_metric([name, role], cost.num_samples)
        yield from (weights, samples)
