"""The lifecycle every node server shares, whatever it computes: the loop, the control messages
of the router (its pings and lease, Shutdown), draining, the paced heartbeat, the failure report.

A node (`prefill_node.node.PrefillNode`, `decode_node.node.DecodeNode`) subclasses `NodeLoop`
and supplies its role's part through these hooks:

    step()               one turn of the loop; it calls `take_messages`, `check_lease_and_drain`
                         and `maybe_heartbeat` where its turn has room for them
    handle(msg)          a message of the node's own role (Prefill, Reserve, Abort, ...)
    num_held()           the requests it holds: a drain ends when none is left
    orphan(replica, r)   drops the held requests of one router (`control.router_links`): it
                         is gone or restarted
    heartbeat()          the Heartbeat the router pairs and admits by
    ready_info()         what NodeReady carries
    on_router_restart(replica)  forgets what the old router there numbered (optional)
    prefix_cache         the node's `runtime.prefix_cache.PrefixCache`, if it keeps one: built
                         with `on_change=self.publish_cache_change`, so the router's index
                         (`KVEvents`) follows it, and sent whole to a new router
    close(reason)        fails what is held and frees everything, on every way out of `run`

Rank variants (a node of several processes) override hooks too, never the loop's own state.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from control import kv_events
from control.cluster_config import TimeoutConfig
from control.lease import RouterLeases
from control.messaging import Inbox, Outbox
from control.protocol import Heartbeat, KVEvents, NodeFailed, NodeReady, RouterPing, Shutdown

log = logging.getLogger(__name__)

MAX_DRAIN = 256  # control messages handled per step at most


class NodeLoop:
    role = ""  # "prefill" | "decode": the name the router knows the role by
    prefix_cache: Any = None  # runtime.prefix_cache.PrefixCache, when the node keeps one

    def __init__(self, name: str, timeouts: TimeoutConfig, inbox: Inbox, outbox: Outbox):
        self.name = name
        self.timeouts = timeouts
        self.inbox = inbox
        self.outbox = outbox
        self.leases = RouterLeases()  # one per router replica
        self.is_stopping = False
        self.is_draining = False
        self._drain_deadline = 0.0
        self._next_heartbeat = 0.0
        self.advertised: dict[str, Any] = {}  # added to NodeReady's info (control endpoint)

    # ---- hooks -----------------------------------------------------------------------------
    def step(self) -> None:
        raise NotImplementedError

    def handle(self, msg: Any) -> None:
        log.warning("%s node ignores a %s message", self.role, type(msg).__name__)

    def num_held(self) -> int:
        raise NotImplementedError

    def orphan(self, replica: int, reason: str) -> None:
        raise NotImplementedError

    def heartbeat(self) -> Heartbeat:
        raise NotImplementedError

    def ready_info(self) -> dict[str, Any]:
        raise NotImplementedError

    def on_router_restart(self, replica: int) -> None:
        pass

    def close(self, reason: str) -> None:
        raise NotImplementedError

    # ---- the lifecycle ---------------------------------------------------------------------
    def run(self) -> None:
        """Steps until a Shutdown message (or `is_stopping` set from outside), then closes."""
        try:
            while not self.is_stopping:
                self.step()
        except Exception as exc:
            self.report_failure(exc)
            raise
        finally:
            self.close(f"the {self.role} node is shutting down")

    def report_failure(self, exc: BaseException) -> None:
        """NodeFailed to the router before the per-request errors of close(): the router then
        moves this node's requests to another pair instead of failing them."""
        self.outbox.send(NodeFailed(self.name, self.role, f"{type(exc).__name__}: {exc}"))

    def begin_drain(self) -> None:
        """Takes no new work from now on and stops once the held requests are done (or
        `drain_s` passed); the next heartbeat tells the router at once."""
        if not self.is_draining:
            self.is_draining = True
            self._drain_deadline = time.monotonic() + self.timeouts.drain_s
            self._next_heartbeat = 0.0
            log.info("draining: %d requests to finish", self.num_held())

    def send_ready(self, replica: int | None = None) -> None:
        """NodeReady to every router, or to one (`replica`, a restarted router)."""
        msg = NodeReady(self.name, self.role, {**self.ready_info(), **self.advertised})
        self._send_to(replica, msg)

    def _send_to(self, replica: int | None, msg: Any) -> None:
        if replica is None or not hasattr(self.outbox, "send_to"):  # one router (tests' queues)
            self.outbox.send(msg)
        else:
            self.outbox.send_to(replica, msg)

    def publish_cache_change(
        self, stored: list[bytes], removed: list[bytes], cleared: bool = False
    ) -> None:
        """KVEvents for one change of the prefix cache (in bounded messages, in order)."""
        self._publish(None, stored, removed, cleared)

    def _publish(
        self, replica: int | None, stored: list[bytes], removed: list[bytes], cleared: bool
    ) -> None:
        name, role, page_size = self.name, self.role, self.prefix_cache.page_size
        if cleared:
            self._send_to(replica, KVEvents(name, role, page_size, cleared=True))
        for names in kv_events.batches(removed):
            self._send_to(replica, KVEvents(name, role, page_size, removed=names))
        for names in kv_events.batches(stored):
            self._send_to(replica, KVEvents(name, role, page_size, stored=names))

    def publish_cache_snapshot(self, replica: int | None = None) -> None:
        """The whole cache, for an index that starts over (a new router at `replica`)."""
        if self.prefix_cache is not None:
            self._publish(replica, self.prefix_cache.page_names(), [], cleared=True)

    # ---- parts of a step -------------------------------------------------------------------
    def take_messages(self, wait: float) -> None:
        """The router's messages: waits up to `wait` s for the first, then takes what is queued,
        at most MAX_DRAIN, so a flood of messages cannot starve compute."""
        msg, num_handled = self.inbox.recv(wait), 0
        while msg is not None:
            self.dispatch(msg)
            num_handled += 1
            msg = self.inbox.recv(0.0) if num_handled < MAX_DRAIN else None

    def dispatch(self, msg: Any) -> None:
        """The loop's own messages here; the role's go to `handle`."""
        if isinstance(msg, RouterPing):
            replica = msg.replica
            if self.leases.renew(replica, msg.router_id, msg.lease_s, time.monotonic()):
                # A new router knows none of our requests, and not us either: start over with
                # it (the other routers' requests go on).
                self.orphan(replica, "the router restarted")
                self.on_router_restart(replica)
                self.send_ready(replica)
                self.publish_cache_snapshot(replica)
        elif isinstance(msg, Shutdown):
            if msg.reason:  # e.g. the router refused this node's join: the reason is here too
                log.warning("the router stops this node: %s", msg.reason)
            self.is_stopping = True
        else:
            self.handle(msg)

    def check_lease_and_drain(self, now: float) -> None:
        """Drops a router's requests when its lease lapsed; stops a drain once nothing is held
        or its time is up (close() fails what is left; the router moves it)."""
        for replica in self.leases.lapsed(now):
            self.orphan(replica, f"no word from the router for {self.timeouts.lease_s:g} s")
        if self.is_draining and (not self.num_held() or now >= self._drain_deadline):
            self.is_stopping = True

    def maybe_heartbeat(self) -> None:
        """A heartbeat every `heartbeat_s` at most."""
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.timeouts.heartbeat_s
        self.outbox.send(self.heartbeat())
