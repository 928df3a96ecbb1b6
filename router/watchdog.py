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

A mixin of `router.core.Router`, whose state it uses (nodes, requests, transport, timeouts,
router_id) and whose recovery and endings it calls (`_fail_node_requests`, `_fail`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from control.protocol import RouterPing

log = logging.getLogger("router")


class Watchdog:
    """Finds lost nodes and overdue requests; renews the nodes' leases."""

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
