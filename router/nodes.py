"""The router's view of its nodes: liveness (NodeReady, heartbeats, NodeFailed) and load.

Load has two sources. Heartbeats carry the node's own figures (queued tokens, free pages),
which lag by up to one heartbeat interval. The router adds what it knows exactly and at once:
the prompt tokens it sent to each prefill node that have not produced a first token yet, and
the pages each decode node reserved for the router's unfinished requests. Pairing uses the
router's figures, so a burst of requests spreads out instead of piling onto whichever node
looked idlest in the last heartbeat.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from control.cluster_config import ClusterConfig
from control.kv_reservation import MODES as KV_RESERVATION_MODES
from control.kv_reservation import (
    WORST_CASE,
    reservation_tokens,
    sequences_tokens,
    worst_case_tokens,
)
from control.protocol import Heartbeat
from router.state import RouterRequest


class NodeStatus:
    STARTING = "starting"  # configured, never heard from
    READY = "ready"
    DRAINING = "draining"  # finishing its requests before it stops: gets no new ones
    DEAD = "dead"  # NodeFailed, silent for node_timeout_s, or its connection dropped


@dataclass
class NodeState:
    name: str
    role: str  # "prefill" | "decode"
    control_endpoint: str
    page_size: int  # tokens per page (from the config; NodeReady may refine it)
    total_pages: int  # decode: from the config; NodeReady / heartbeats refine it
    status: str = NodeStatus.STARTING
    last_seen: float = 0.0  # monotonic
    info: dict[str, Any] = field(default_factory=dict)
    heartbeat: Heartbeat | None = None
    error: str = ""
    queued_tokens: int = 0  # prefill: prompt tokens sent, first token not seen yet
    reserved_pages: int = 0  # decode: pages held for the router's unfinished requests
    num_active: int = 0  # the router's unfinished requests on this node
    num_served: int = 0  # requests ever sent to this node (cumulative)
    # On-demand decode KV: the decode node's reservation rule, from the
    # config, then from its NodeReady; the router's estimate of a reservation follows it.
    kv_reservation: str = WORST_CASE
    kv_headroom_tokens: int = 0
    # prefill: the prompts sent and not yet done (first token not seen), by request: what the
    # node's prefix cache will hold once they finish (cache-aware routing)
    in_flight: dict[int, list[int]] = field(default_factory=dict)
    joined: bool = False  # not in the config: joined at run time, forgotten when it leaves

    @property
    def is_ready(self) -> bool:
        return self.status == NodeStatus.READY

    @property
    def is_alive(self) -> bool:
        """Ready or draining: it still serves the requests it holds."""
        return self.status in (NodeStatus.READY, NodeStatus.DRAINING)

    @property
    def free_pages(self) -> int:
        """The router's estimate of pages a new reservation may take."""
        return max(0, self.total_pages - self.reserved_pages)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def reservation_tokens(
        self, prompt_len: int, max_new_tokens: int, max_positions: int, n: int = 1
    ) -> int:
        """Tokens this decode node reserves up front for such a request (its own rule), for
        all `n` sequences (the forks share the prompt's whole pages)."""
        one = reservation_tokens(
            self.kv_reservation,
            self.kv_headroom_tokens,
            prompt_len,
            max_new_tokens,
            max_positions,
        )
        return sequences_tokens(one, prompt_len, self.page_size, n)

    def worst_case_tokens(
        self, prompt_len: int, max_new_tokens: int, max_positions: int, n: int = 1
    ) -> int:
        """Every position the request's `n` sequences may ever hold on this node."""
        one = worst_case_tokens(prompt_len, max_new_tokens, max_positions)
        return sequences_tokens(one, prompt_len, self.page_size, n)


class NodeRegistry:
    """The cluster's nodes by name: every configured one, and those that joined at run time
    (`router.membership`: admitted by their NodeReady, removed when they leave). Only these
    names are accepted from the wire."""

    def __init__(self, cfg: ClusterConfig):
        self.nodes: dict[str, NodeState] = {}
        for p in cfg.prefill:
            self.nodes[p.name] = NodeState(p.name, "prefill", p.control_endpoint, p.page_size, 0)
        for d in cfg.decode:
            self.nodes[d.name] = NodeState(
                d.name,
                "decode",
                d.control_endpoint,
                d.page_size,
                d.num_pages,
                kv_reservation=d.kv_reservation,
                kv_headroom_tokens=d.kv_headroom_tokens,
            )

    def add_joined(self, name: str, role: str, endpoint: str, page_size: int) -> NodeState:
        """A node that joined at run time (not in the config), starting as configured ones do."""
        node = NodeState(name, role, endpoint, page_size, 0, joined=True)
        self.nodes[name] = node
        return node

    def remove(self, name: str) -> None:
        """A joined node that left (drained or died): forgotten."""
        self.nodes.pop(name, None)

    def get(self, name: str, role: str) -> NodeState | None:
        """The node, if `name` is configured with this role (anything else is ignored)."""
        node = self.nodes.get(name)
        return node if node is not None and node.role == role else None

    def of_role(self, role: str) -> list[NodeState]:
        return [n for n in self.nodes.values() if n.role == role]

    def ready(self, role: str) -> list[NodeState]:
        return [n for n in self.nodes.values() if n.role == role and n.is_ready]

    # ---- liveness --------------------------------------------------------------------------
    def mark_ready(self, node: NodeState, info: dict[str, Any]) -> None:
        node.status = NodeStatus.READY
        node.error = ""
        node.info = dict(info)
        node.last_seen = time.monotonic()
        node.page_size = int(info.get("page_size", node.page_size)) or node.page_size
        if node.role == "decode":
            node.total_pages = int(info.get("num_pages", node.total_pages))
            mode = info.get("kv_reservation", node.kv_reservation)
            if mode in KV_RESERVATION_MODES:  # an older node sends none: keep the config's
                node.kv_reservation = mode
                node.kv_headroom_tokens = int(
                    info.get("kv_headroom_tokens", node.kv_headroom_tokens)
                )

    def on_heartbeat(self, node: NodeState, hb: Heartbeat) -> bool:
        """Records the heartbeat; True if it revived a node (first sign of life or back from dead).

        A heartbeat implies the node finished starting, so a router that (re)started after its
        nodes still learns about them without their NodeReady.
        """
        revived = not node.is_alive and not hb.draining
        node.heartbeat = hb
        node.last_seen = time.monotonic()
        node.status = NodeStatus.DRAINING if hb.draining else NodeStatus.READY
        node.error = ""
        if node.role == "decode" and hb.total_pages > 0:
            node.total_pages = hb.total_pages
            if hb.page_size > 0:
                node.page_size = hb.page_size
        return revived

    def mark_draining(self, node: NodeState) -> None:
        if node.is_ready:
            node.status = NodeStatus.DRAINING

    def mark_dead(self, node: NodeState, error: str) -> None:
        node.status = NodeStatus.DEAD
        node.error = error

    def expired(self, timeout_s: float, now: float | None = None) -> list[NodeState]:
        """Ready or draining nodes silent for longer than `timeout_s`."""
        now = time.monotonic() if now is None else now
        return [n for n in self.nodes.values() if n.is_alive and now - n.last_seen > timeout_s]

    # ---- the router's load accounting (each hold is released exactly once) -----------------
    def hold_decode(self, req: RouterRequest, node: NodeState, pages: int) -> None:
        req.decode_node, req.reserved_pages, req.holds_decode = node.name, pages, True
        node.reserved_pages += pages
        node.num_active += 1

    def hold_prefill(self, req: RouterRequest, node: NodeState) -> None:
        req.prefill_node, req.holds_prefill = node.name, True
        node.in_flight[id(req)] = req.attempt_prompt_ids
        node.queued_tokens += req.prompt_len
        node.num_active += 1
        node.num_served += 1

    def release_decode(self, req: RouterRequest) -> None:
        node = self.nodes.get(req.decode_node or "")
        if req.holds_decode and node is not None:
            node.reserved_pages -= req.reserved_pages
            node.num_active -= 1
        req.holds_decode = False

    def release_prefill(self, req: RouterRequest) -> None:
        """At P's first token (P is done with it) or when the request ends."""
        node = self.nodes.get(req.prefill_node or "")
        if req.holds_prefill and node is not None:
            node.in_flight.pop(id(req), None)
            node.queued_tokens -= req.prompt_len
            node.num_active -= 1
        req.holds_prefill = False

    def summary(self) -> dict[str, dict[str, Any]]:
        """For /health: each node's role, status, error and load."""
        out = {}
        for n in self.nodes.values():
            entry: dict[str, Any] = {"role": n.role, "status": n.status, "active": n.num_active}
            if n.error:
                entry["error"] = n.error
            if n.role == "prefill":
                entry["queued_tokens"] = n.queued_tokens
            else:
                entry["free_pages"] = n.free_pages
                entry["total_pages"] = n.total_pages
            out[n.name] = entry
        return out
