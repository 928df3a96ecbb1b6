"""Nodes that join the running cluster and leave it (`duet node`): not in the config, known by
their NodeReady.

A NodeReady from a name the router does not know is a join. It is admitted when
- its role is prefill or decode and its info names its control endpoint (tcp://host:port);
- it serves the router's model (its fingerprint, checked as for configured nodes);
- its KV layout (layers, row width, dtype) is that of the cluster's ready nodes: a node that
  cannot exchange KV with them would fail every request it got.
The cluster key is checked before any of this: the router's socket is CURVE, so a node without
the key never gets a frame through (its own log says the router never answered).

An admitted node joins the registry and the transport (a PUSH to its control endpoint) and from
then on is a node like the others: leased, paired, in /v1/cluster and /metrics. A refused one is
told why (a Shutdown carrying the reason, on a socket of its own, so it logs it and stops) and
the reason is logged here; it is not remembered. A joined node that died, or drained and
exited, is forgotten once its requests have moved (`forget`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from control.protocol import NodeReady, Shutdown
from router.kv_index import KVIndex
from router.nodes import NodeRegistry, NodeState
from router.transport import RouterTransport

log = logging.getLogger("router")

_ENDPOINT = re.compile(r"tcp://[A-Za-z0-9][A-Za-z0-9.\-_]*:\d{1,5}")
KV_LAYOUT = ("num_layers", "row_width", "dtype")  # what two nodes exchanging KV must share


def fingerprint_mismatch(mine: dict[str, Any] | None, theirs: Any) -> str | None:
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


class Membership:
    """Admits joining nodes and forgets those that left (see the module docstring)."""

    def __init__(
        self,
        nodes: NodeRegistry,
        fingerprint: dict[str, Any] | None,
        index: KVIndex,
        transport: Callable[[], RouterTransport | None],
    ):
        self.nodes = nodes
        self.fingerprint = fingerprint
        self.index = index
        self.transport = transport  # the router's, once it started
        self.num_joined = 0  # cumulative
        self.num_refused = 0
        self.num_left = 0

    def admit(self, msg: NodeReady) -> NodeState | None:
        """The joining node, registered and connected; None when it is refused."""
        transport = self.transport()
        endpoint = msg.info.get("control_endpoint")
        if transport is None or not isinstance(endpoint, str) or not _ENDPOINT.fullmatch(endpoint):
            log.warning(
                "NodeReady from unknown node %r names no control endpoint: ignored", msg.node
            )
            return None
        problem = self._refusal(msg)
        if problem:
            self.num_refused += 1
            log.error("node %s (%s) may not join: %s", msg.node, msg.role, problem)
            transport.tell(endpoint, Shutdown(f"the router refused this node: {problem}"))
            return None
        page_size = int(msg.info.get("page_size", 0) or 0)
        node = self.nodes.add_joined(msg.node, msg.role, endpoint, page_size or 16)
        transport.add_node(msg.node, endpoint)
        self.num_joined += 1
        log.info("node %s (%s) joined from %s", msg.node, msg.role, endpoint)
        return node

    def forget(self, node: NodeState) -> None:
        """A joined node left: out of the registry, the transport and the KV index."""
        if not node.joined or self.nodes.nodes.get(node.name) is not node:
            return
        self.nodes.remove(node.name)
        self.index.forget(node.name)
        transport = self.transport()
        if transport is not None:
            transport.remove_node(node.name)
        self.num_left += 1
        log.info("node %s (%s) left the cluster (%s)", node.name, node.role, node.error)

    def _refusal(self, msg: NodeReady) -> str | None:
        if msg.role not in ("prefill", "decode"):
            return f"unknown role {msg.role!r}"
        theirs = msg.info.get("fingerprint")
        mismatch = fingerprint_mismatch(self.fingerprint, theirs)
        if mismatch:
            return f"another model: {mismatch}"
        if not isinstance(theirs, dict):
            return "its NodeReady carries no fingerprint"
        for other in self.nodes.nodes.values():
            ours = other.info.get("fingerprint")
            if not other.is_ready or not isinstance(ours, dict):
                continue
            for key in KV_LAYOUT:
                if theirs.get(key) != ours.get(key):
                    return (
                        f"another KV layout: {key} is {theirs.get(key)!r} on the node, "
                        f"{ours.get(key)!r} on {other.name}"
                    )
            break
        return None
