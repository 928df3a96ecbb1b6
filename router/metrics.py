"""Prometheus metrics of the router (text format at GET /metrics).

Request latencies are measured by the router (client-visible): TTFT, TPOT (mean per request)
and inter-token latency histograms, per-stage timings, outcomes, rejections, failures by stage
and the share of finished requests within the SLA. Per-node figures (queued and running
requests, KV pages, KV bytes moved, dropped chunks, malformed control frames, prefix-cache
lookups, hits, tokens served from it and evictions) come from the nodes' latest heartbeats
and are read at scrape time by `NodeCollector`, as is the count of malformed frames the
router's own control socket dropped.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from control.cluster_config import SlaConfig
from control.quant_schemes import QUANT_SCHEMES, WEIGHT_BACKINGS
from router.nodes import NodeRegistry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
GOODPUT_WINDOW_S = 60.0
_ERROR_BUCKETS = (
    -5.0, -1.0, -0.5, -0.25, -0.1, -0.05, -0.025, -0.01, 0.0,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
)  # fmt: skip

disable_created_metrics()  # the *_created series only add noise to a scrape

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class RouterMetrics:
    def __init__(
        self, nodes: NodeRegistry, sla: SlaConfig, num_bad_frames: Callable[[], int] = lambda: 0
    ):
        self.sla = sla
        self.num_bad_frames = num_bad_frames  # malformed frames the router's PULL dropped
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "duet_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "duet_tpot_seconds",
            "Mean time per output token after the first, per request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "duet_inter_token_latency_seconds",
            "Time between consecutive output tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "duet_request_latency_seconds",
            "Arrival to last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.stage = Histogram(
            "duet_stage_seconds",
            "Per-stage time (reserve: router<->decode; queue/prefill/transfer: prefill node)",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "duet_requests", "Requests ended, by outcome", ["outcome"], registry=r
        )
        self.rejections = Counter(
            "duet_rejections",
            "Requests refused before starting, by reason",
            ["reason"],
            registry=r,
        )
        self.migrations = Counter(
            "duet_request_migrations",
            "Requests moved to another node pair after a node was lost, by the stage they were in",
            ["stage"],
            registry=r,
        )
        self.failures = Counter(
            "duet_request_failures",
            "Accepted requests that failed, by stage",
            ["stage"],
            registry=r,
        )
        self.dispatched = Counter(
            "duet_node_requests", "Requests sent to each node", ["node", "role"], registry=r
        )
        self.prompt_tokens = Counter("duet_prompt_tokens", "Prompt tokens accepted", registry=r)
        self.output_tokens = Counter("duet_output_tokens", "Tokens generated", registry=r)
        self.sla_met = Counter(
            "duet_sla_met_requests", "Finished requests within the TTFT and TPOT SLA", registry=r
        )
        # On-demand decode KV: Preempted messages acted on (each restarts
        # the request; one past [router] max_preemptions fails it, stage "preemption").
        self.preemptions = Counter(
            "duet_router_preemptions",
            "Requests a decode node preempted (its KV pool ran out)",
            registry=r,
        )
        # Waiting for decode room, in turn (router/room_queue.py): how many wait now (set by the
        # router to its queue's length) and how long each waited.
        self.waiting_for_room = Gauge(
            "duet_router_waiting_for_room",
            "Requests waiting at the router for decode KV room, in turn",
            registry=r,
        )
        self.room_wait = Histogram(
            "duet_router_room_wait_seconds",
            "How long a request waited for decode KV room (those that waited)",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.num_finished = 0  # plain counts for the SLA share (read at scrape time)
        self.num_sla_met = 0
        self.num_ttft_met = 0  # and for each part of it (the autoscaler's bottleneck)
        self.num_tpot_met = 0
        # ---- SLA admission: goodput and the TTFT prediction's error ------
        # Goodput as a counter is duet_sla_met_requests (rate() gives requests/s); this gauge is
        # the same over the last GOODPUT_WINDOW_S, for a dashboard without PromQL.
        self._sla_met_times: deque[float] = deque()
        self.goodput = Gauge(
            "duet_goodput_requests_per_second",
            f"Finished requests within both SLAs per second, over the last {GOODPUT_WINDOW_S:g} s",
            registry=r,
        )
        self.goodput.set_function(self._goodput)
        self.ttft_prediction_error = Histogram(
            "duet_ttft_prediction_error_seconds",
            "Measured minus predicted TTFT of each request (router/admission.py)",
            buckets=_ERROR_BUCKETS,
            registry=r,
        )
        r.register(NodeCollector(nodes, self))

    def observe_finished(self, ttft: float, tpot: float | None, latency: float) -> None:
        """A request completed normally: record its latencies and whether it met the SLA."""
        self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
        self.e2e.observe(latency)
        self.num_finished += 1
        ttft_met = ttft * 1000 <= self.sla.ttft_ms
        tpot_met = tpot is None or tpot * 1000 <= self.sla.tpot_ms
        self.num_ttft_met += ttft_met
        self.num_tpot_met += tpot_met
        if ttft_met and tpot_met:
            self.num_sla_met += 1
            self.sla_met.inc()
            self._sla_met_times.append(time.monotonic())
            self._goodput()  # prunes the window, so it stays bounded without scrapes

    def _goodput(self) -> float:
        horizon = time.monotonic() - GOODPUT_WINDOW_S
        while self._sla_met_times and self._sla_met_times[0] < horizon:
            self._sla_met_times.popleft()
        return len(self._sla_met_times) / GOODPUT_WINDOW_S

    def render(self) -> bytes:
        return generate_latest(self.registry)


class NodeCollector:
    """Per-node gauges and counters, read from the registry when /metrics is scraped."""

    def __init__(self, nodes: NodeRegistry, metrics: RouterMetrics):
        self.nodes = nodes
        self.metrics = metrics

    def collect(self):
        labels = ["node", "role"]
        up = GaugeMetricFamily("duet_node_up", "1 if the node is ready and alive", labels=labels)
        queued = GaugeMetricFamily(
            "duet_node_queued_requests", "Requests waiting on the node (heartbeat)", labels=labels
        )
        running = GaugeMetricFamily(
            "duet_node_running_requests", "Requests running on the node (heartbeat)", labels=labels
        )
        queued_tokens = GaugeMetricFamily(
            "duet_node_queued_tokens", "Prompt tokens queued on a prefill node", labels=labels
        )
        pages_used = GaugeMetricFamily(
            "duet_kv_pages_used", "KV pages in use on a decode node (heartbeat)", labels=labels
        )
        pages_total = GaugeMetricFamily(
            "duet_kv_pages_total", "KV pages of a decode node", labels=labels
        )
        sent = CounterMetricFamily(
            "duet_kv_bytes_sent", "KV bytes sent by a prefill node", labels=labels
        )
        received = CounterMetricFamily(
            "duet_kv_bytes_received", "KV bytes received by a decode node", labels=labels
        )
        dropped = CounterMetricFamily(
            "duet_kv_chunks_dropped", "KV messages a decode node dropped", labels=labels
        )
        malformed = CounterMetricFamily(
            "duet_node_malformed_frames", "Malformed control frames a node dropped", labels=labels
        )
        cancelled = CounterMetricFamily(
            "duet_prefill_cancelled_by_decode",
            "Prefills a prefill node stopped because the decode node gave up on the KV",
            labels=labels,
        )
        draining = GaugeMetricFamily("duet_node_draining", "1 while the node drains", labels=labels)
        stage_ms = GaugeMetricFamily(
            "duet_node_stage_ms",
            "Recent per-stage latency reported by a node",
            labels=["node", "role", "stage"],
        )
        # On-demand decode KV: each decode node's own count.
        preempted = CounterMetricFamily(
            "duet_node_preemptions", "Requests a decode node preempted (heartbeat)", labels=labels
        )
        prefix = PrefixCacheFamilies(labels)  # prefix cache
        mtp = MtpFamilies(labels)  # MTP speculative decoding
        # Weight quantization: 1 with the scheme a ready node reported in NodeReady.
        quant = GaugeMetricFamily(
            "duet_node_quant_info",
            "The node's weight quantization (1; label quant)",
            labels=[*labels, "quant"],
        )
        backing = GaugeMetricFamily(
            "duet_node_weights_backing_info",
            "Where the node's weights live (1; label backing: heap, file, file_hugepages, "
            "shmem, shmem_hugepages)",
            labels=[*labels, "backing"],
        )
        for n in self.nodes.nodes.values():
            lv = [n.name, n.role]
            up.add_metric(lv, 1.0 if n.is_ready else 0.0)
            if n.info.get("quant") in QUANT_SCHEMES:  # a known name only: labels stay bounded
                quant.add_metric([*lv, n.info["quant"]], 1.0)
            if n.info.get("weights_backing") in WEIGHT_BACKINGS:
                backing.add_metric([*lv, n.info["weights_backing"]], 1.0)
            hb = n.heartbeat
            if hb is None:
                continue
            queued.add_metric(lv, hb.num_waiting)
            malformed.add_metric(lv, hb.num_malformed)
            running.add_metric(lv, hb.num_running)
            draining.add_metric(lv, 1.0 if hb.draining else 0.0)
            if hb.num_prefix_lookups or n.role == "prefill":
                prefix.add(lv, hb)
            if n.role == "prefill":
                queued_tokens.add_metric(lv, hb.queued_tokens)
                sent.add_metric(lv, hb.kv_bytes_sent)
                cancelled.add_metric(lv, hb.num_cancelled_by_decode)
                prefix.add_rows(lv, hb)
            else:
                pages_used.add_metric(lv, hb.total_pages - hb.free_pages)
                pages_total.add_metric(lv, hb.total_pages)
                received.add_metric(lv, hb.kv_bytes_received)
                dropped.add_metric(lv, hb.kv_chunks_dropped)
                preempted.add_metric(lv, hb.num_preempted)
                prefix.rows_received.add_metric(lv, hb.kv_rows_received)
                if hb.mtp_request_steps:
                    mtp.add(lv, hb)
            for stage, ms in hb.stage_ms.items():
                stage_ms.add_metric([*lv, stage], float(ms))
        router_malformed = CounterMetricFamily(
            "duet_router_malformed_frames", "Malformed control frames the router dropped"
        )
        router_malformed.add_metric([], self.metrics.num_bad_frames())
        finished = self.metrics.num_finished
        share = GaugeMetricFamily(
            "duet_sla_attainment_ratio",
            "Share of finished requests within the SLA (1 before any finished)",
        )
        share.add_metric([], self.metrics.num_sla_met / finished if finished else 1.0)
        sla = GaugeMetricFamily("duet_sla_target_seconds", "The SLA targets", labels=["metric"])
        sla.add_metric(["ttft"], self.metrics.sla.ttft_ms / 1000)
        sla.add_metric(["tpot"], self.metrics.sla.tpot_ms / 1000)
        yield from (up, queued, running, queued_tokens, pages_used, pages_total, sent, received)
        yield from (dropped, malformed, router_malformed, cancelled, draining, stage_ms)
        yield from (share, sla)
        yield preempted
        yield quant
        yield backing
        yield from prefix.families()
        yield from mtp.families()


class MtpFamilies:
    """A decode node's MTP speculative-decoding figures, from its heartbeat."""

    def __init__(self, labels: list[str]):
        self.drafted = CounterMetricFamily(
            "duet_mtp_draft_tokens", "MTP draft tokens a decode node verified", labels=labels
        )
        self.accepted = CounterMetricFamily(
            "duet_mtp_accepted_tokens", "MTP draft tokens accepted", labels=labels
        )
        self.acceptance = GaugeMetricFamily(
            "duet_mtp_acceptance_ratio", "Share of MTP drafts accepted (cumulative)", labels=labels
        )
        self.per_step = GaugeMetricFamily(
            "duet_mtp_tokens_per_step",
            "Tokens a speculating request gains per decode step (cumulative mean; 1 = no gain)",
            labels=labels,
        )

    def add(self, lv: list[str], hb) -> None:
        self.drafted.add_metric(lv, hb.mtp_drafted)
        self.accepted.add_metric(lv, hb.mtp_accepted)
        self.acceptance.add_metric(lv, hb.mtp_accepted / hb.mtp_drafted if hb.mtp_drafted else 0.0)
        self.per_step.add_metric(lv, hb.mtp_emitted / hb.mtp_request_steps)

    def families(self) -> tuple:
        return (self.drafted, self.accepted, self.acceptance, self.per_step)


class PrefixCacheFamilies:
    """A node's prefix-cache figures (a prefill node's, or a decode node's of finished
    prompts), and the KV rows moved and not moved for them, from its heartbeat."""

    def __init__(self, labels: list[str]):
        self.lookups = CounterMetricFamily(
            "duet_prefix_cache_lookups", "Prefills that looked their prompt up", labels=labels
        )
        self.hits = CounterMetricFamily(
            "duet_prefix_cache_hits", "Prefills that found a cached prefix", labels=labels
        )
        self.hit_tokens = CounterMetricFamily(
            "duet_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache",
            labels=labels,
        )
        self.evicted = CounterMetricFamily(
            "duet_prefix_cache_evicted_pages", "Cached KV pages evicted", labels=labels
        )
        self.pages = GaugeMetricFamily(
            "duet_prefix_cache_pages", "KV pages the prefix cache holds", labels=labels
        )
        self.hit_ratio = GaugeMetricFamily(
            "duet_prefix_cache_hit_ratio",
            "Share of lookups that hit (0 before any)",
            labels=labels,
        )
        self.rows_sent = CounterMetricFamily(
            "duet_kv_rows_sent", "Prompt KV rows a prefill node sent", labels=labels
        )
        self.rows_skipped = CounterMetricFamily(
            "duet_kv_rows_skipped",
            "Prompt KV rows a prefill node did not send: the decode node held them",
            labels=labels,
        )
        self.rows_received = CounterMetricFamily(
            "duet_kv_rows_received", "Prompt KV rows a decode node received", labels=labels
        )
        # The disk tier (a prefill node's `disk_cache_dir`).
        self.disk_lookups = CounterMetricFamily(
            "duet_prefix_cache_disk_lookups",
            "Prefills that asked the disk tier for the pages after the pool's match",
            labels=labels,
        )
        self.disk_hits = CounterMetricFamily(
            "duet_prefix_cache_disk_hits", "Of which got pages from it", labels=labels
        )
        self.disk_hit_tokens = CounterMetricFamily(
            "duet_prefix_cache_disk_hit_tokens",
            "Prompt tokens loaded from the disk tier",
            labels=labels,
        )
        self.disk_stored = CounterMetricFamily(
            "duet_prefix_cache_disk_pages_stored",
            "Evicted pages the node wrote to the disk tier",
            labels=labels,
        )
        self.disk_hit_ratio = GaugeMetricFamily(
            "duet_prefix_cache_disk_hit_ratio",
            "Share of disk-tier lookups that got pages (0 before any)",
            labels=labels,
        )
        self.disk_corrupt = CounterMetricFamily(
            "duet_prefix_cache_disk_corrupt",
            "Disk-tier files that failed a check (deleted, computed instead)",
            labels=labels,
        )

    def add(self, lv: list[str], hb) -> None:
        self.lookups.add_metric(lv, hb.num_prefix_lookups)
        self.hits.add_metric(lv, hb.num_prefix_hits)
        self.hit_tokens.add_metric(lv, hb.num_prefix_hit_tokens)
        self.evicted.add_metric(lv, hb.num_prefix_evicted_pages)
        self.pages.add_metric(lv, hb.num_prefix_cached_pages)
        lookups = hb.num_prefix_lookups
        self.hit_ratio.add_metric(lv, hb.num_prefix_hits / lookups if lookups else 0.0)

    def add_rows(self, lv: list[str], hb) -> None:
        self.rows_sent.add_metric(lv, hb.kv_rows_sent)
        self.rows_skipped.add_metric(lv, hb.kv_rows_skipped)
        if hb.num_disk_lookups or hb.num_disk_pages_stored:
            self.disk_lookups.add_metric(lv, hb.num_disk_lookups)
            self.disk_hits.add_metric(lv, hb.num_disk_hits)
            self.disk_hit_tokens.add_metric(lv, hb.num_disk_hit_tokens)
            self.disk_stored.add_metric(lv, hb.num_disk_pages_stored)
            self.disk_corrupt.add_metric(lv, hb.num_disk_corrupt)
            lookups = hb.num_disk_lookups
            self.disk_hit_ratio.add_metric(lv, hb.num_disk_hits / lookups if lookups else 0.0)

    def families(self) -> tuple:
        return (
            *(self.lookups, self.hits, self.hit_tokens, self.evicted, self.pages, self.hit_ratio),
            *(self.rows_sent, self.rows_skipped, self.rows_received),
            *(self.disk_lookups, self.disk_hits, self.disk_hit_tokens, self.disk_stored),
            *(self.disk_corrupt, self.disk_hit_ratio),
        )
