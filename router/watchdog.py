"""The router's watchdog, every quarter second (at most half a heartbeat interval): it finds
lost nodes and overdue requests, and renews the nodes' leases on the router's requests.

- a node whose control connection dropped (its process exited;
  `RouterTransport.lost_connections`), found at once;
- a node silent past `node_timeout_s` (hung: its connection stays up);
- a request past its stage deadline (no first token `prefill_queue_s + transfer_s` after
  dispatch, still decoding `decode_s` after its first token), failed naming the stage;
- every heartbeat interval, a `RouterPing` to each live node renews its lease (`control.lease`):
  a node that stops hearing from the router drops the router's requests on its own.

A lost node is marked dead and its requests move to surviving pairs (`router.recovery`).

`Watchdog` keeps no state of its own: the nodes, the unfinished requests, the timeouts, the
router's id, a `send` to the nodes, the transport's `lost_connections`, recovery's `node_lost`
and the coordinator's `fail` come in through its constructor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from control.cluster_config import TimeoutConfig
from control.protocol import RouterPing
from router.nodes import NodeRegistry, NodeState
from router.state import RouterRequest

log = logging.getLogger("router")


class Watchdog:
    """Finds lost nodes and overdue requests; renews the nodes' leases."""

    def __init__(
        self,
        nodes: NodeRegistry,
        requests: Mapping[str, RouterRequest],
        timeouts: TimeoutConfig,
        router_id: str,
        *,
        replica: int = 0,
        send: Callable[[str, Any], bool],
        lost_connections: Callable[[], Iterable[str]],
        node_lost: Callable[[NodeState, str], None],
        fail: Callable[[RouterRequest, str, str], None],
    ):
        self.nodes = nodes
        self.requests = requests
        self.timeouts = timeouts
        self.router_id = router_id
        self.replica = replica  # which router of the cluster's (`control.router_links`)
        self.send = send
        self.lost_connections = lost_connections  # nodes whose connection dropped since asked
        self.node_lost = node_lost  # (node, what happened to it): its requests move
        self.fail = fail

    async def run(self) -> None:
        period = min(0.25, self.timeouts.heartbeat_s / 2)
        next_ping = 0.0
        while True:
            await asyncio.sleep(period)
            try:
                now = time.monotonic()
                self.check_deadlines(now)
                if now >= next_ping:  # renew every node's lease on our requests
                    next_ping = now + self.timeouts.heartbeat_s
                    ping = RouterPing(self.router_id, self.timeouts.lease_s, self.replica)
                    for node in self.nodes.nodes.values():
                        if node.is_alive:  # a dead one's queue would only fill up
                            self.send(node.name, ping)
            except Exception:
                log.exception("watchdog error")

    def check_deadlines(self, now: float) -> None:
        """Declares silent nodes dead and fails requests past their stage deadline."""
        for name in self.lost_connections():
            node = self.nodes.nodes.get(name)
            if node is not None and node.is_alive:
                log.error("node %s (%s) closed its connection: declared dead", name, node.role)
                self.nodes.mark_dead(node, "connection lost (the process exited)")
                self.node_lost(node, "exited (connection lost)")
        for node in self.nodes.expired(self.timeouts.node_timeout_s, now):
            silent = now - node.last_seen
            log.error("node %s (%s) silent for %.1f s: declared dead", node.name, node.role, silent)
            self.nodes.mark_dead(node, f"no heartbeat for {silent:.1f} s")
            self.node_lost(node, f"stopped answering (no heartbeat for {silent:.1f} s)")
        prefill_limit = self.timeouts.prefill_queue_s + self.timeouts.transfer_s
        for req in list(self.requests.values()):
            error = req.overdue(now, prefill_limit, self.timeouts.decode_s)
            if error is not None:
                self.fail(req, error.stage, error.message)
