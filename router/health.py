"""Node health as the router hears it: NodeReady, NodeFailed and heartbeats, and whether the
cluster serves (a ready prefill node and a ready decode node).

A node that reports another model than the router's (its fingerprint) is marked dead at
NodeReady and stays out until it restarts; a NodeReady from a node that held requests means it
restarted, and a NodeFailed that it failed: either way its requests move (`router.recovery`).
Heartbeats feed the node's load (`router.nodes`), the pairing policy and SLA admission's cost
models. Finding nodes that went silent or lost their connection is the watchdog's
(`router.watchdog`).

`NodeHealth` owns the "a node became ready" signal that `wait_for_nodes` waits on; the nodes,
the policy and SLA admission (which learn from heartbeats), the model's fingerprint, recovery's
`node_lost` (move the requests a lost node held) and the coordinator's `is_closing` come in
through its constructor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from control.protocol import Heartbeat, KVEvents, NodeFailed, NodeReady
from router.admission import AdmissionControl
from router.kv_index import DEFAULT_MAX_PAGES, KVIndex
from router.membership import fingerprint_mismatch
from router.nodes import NodeRegistry, NodeState
from router.policy import PairingPolicy

log = logging.getLogger("router")


class NodeHealth:
    """Applies the nodes' lifecycle messages (see the module docstring)."""

    def __init__(
        self,
        nodes: NodeRegistry,
        policy: PairingPolicy,
        admission: AdmissionControl,
        fingerprint: dict[str, Any] | None,
        index: KVIndex,
        *,
        node_lost: Callable[[NodeState, str], None],
        is_closing: Callable[[], bool],
        admit: Callable[[NodeReady], NodeState | None] | None = None,
    ):
        self.nodes = nodes
        self.policy = policy
        self.admission = admission
        self.fingerprint = fingerprint
        self.index = index
        self.node_lost = node_lost  # (node, what happened to it): its requests move
        self.is_closing = is_closing
        self.admit = admit  # a node not in the config joins (router.membership); None: refused
        self._nodes_changed = asyncio.Event()  # set when a node becomes ready

    @property
    def is_serving(self) -> bool:
        return bool(self.nodes.ready("prefill")) and bool(self.nodes.ready("decode"))

    def on_heartbeat(self, msg: Heartbeat) -> None:
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

    def on_node_ready(self, msg: NodeReady) -> None:
        node = self.nodes.get(msg.node, msg.role)
        if node is None and msg.node not in self.nodes.nodes and self.admit is not None:
            node = self.admit(msg)  # a join: checked, registered and connected, or refused
            if node is None:
                return
        if node is None:
            log.warning(
                "NodeReady from %r (%s), which is not in the cluster config", msg.node, msg.role
            )
            return
        if node.num_active:  # it restarted: whatever it held is gone
            self.node_lost(node, "restarted")
        self.index.forget(node.name)  # its cache starts empty (a snapshot may follow)
        mismatch = fingerprint_mismatch(self.fingerprint, msg.info.get("fingerprint"))
        if mismatch:
            self.nodes.mark_dead(node, f"incompatible model: {mismatch}")
            log.error(
                "node %s serves another model; it gets no requests (%s)", node.name, node.error
            )
            return
        self.nodes.mark_ready(node, msg.info)
        self._nodes_changed.set()
        log.info("node %s (%s) is ready", node.name, node.role)

    def on_node_failed(self, msg: NodeFailed) -> None:
        node = self.nodes.get(msg.node, msg.role)
        if node is None:
            return
        log.error("node %s (%s) failed: %s", node.name, node.role, msg.error)
        self.nodes.mark_dead(node, msg.error)
        self.index.forget(node.name)
        self.node_lost(node, f"failed: {msg.error}")

    def on_kv_events(self, msg: KVEvents) -> None:
        """A change of the node's prefix cache, into the router's index of it."""
        node = self.nodes.get(msg.node, msg.role)
        if node is None or node.status == "dead":
            return
        self.index.apply(msg, int(node.info.get("num_pages", 0)) or DEFAULT_MAX_PAGES)

    async def wait_for_nodes(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for a ready prefill and a ready decode node (one may be
        restarting or draining); True if the cluster serves."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.is_serving and not self.is_closing():
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._nodes_changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._nodes_changed.wait(), left)
        return self.is_serving and not self.is_closing()
