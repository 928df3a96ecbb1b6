"""A node's links to the routers of its cluster (`[router] replicas`; one by default).

Every router serves every node. A node tells the routers apart by the request ids they send:
router replica 0 uses its requests' ids as they are, replica i > 0 puts `r<i>.` in front
(`wire_prefix`), so no two routers' ids can meet on a node (client ids start with `cmpl-`,
`chatcmpl-` or `resp_`), and a node needs no table to answer: `replica_of` reads the router
back from the id. What a node says about one request goes to that request's router; what it
says about itself (NodeReady, Heartbeat, KVEvents, NodeFailed) goes to every router.
"""

from __future__ import annotations

import re
from typing import Any

from control.cluster_config import MAX_ROUTERS
from control.messaging import Outbox, PushSocket
from control.protocol import StepTokens
from control.security import CurveSecurity

_PREFIX = re.compile(r"r([1-7])\.")  # replicas 1 .. MAX_ROUTERS - 1


def wire_prefix(replica: int) -> str:
    """What router replica `replica` puts in front of its requests' wire ids."""
    if not 0 <= replica < MAX_ROUTERS:
        raise ValueError(f"router replica {replica} is not in 0..{MAX_ROUTERS - 1}")
    return f"r{replica}." if replica else ""


def replica_of(request_id: str) -> int:
    """The router replica that owns a wire id (`wire_prefix`'s inverse)."""
    match = _PREFIX.match(request_id)
    return int(match.group(1)) if match else 0


def connect_routers(endpoints: list[str], security: CurveSecurity | None) -> RouterLinks:
    """A node's links: a PushSocket to each router's control endpoint (`RouterConfig.
    control_endpoints`)."""
    return RouterLinks([PushSocket(endpoint, security=security) for endpoint in endpoints])


def by_replica(values: dict[int, int]) -> list[int]:
    """Per-replica figures as a list indexed by replica, 0 where a replica has none (the
    wire form of `Heartbeat.prefill_seqs`)."""
    return [values.get(r, 0) for r in range(max(values, default=-1) + 1)]


class RouterLinks:
    """An `Outbox` over one outbox per router replica (index = replica), routing as the module
    says. A StepTokens of requests from several routers is split into one per router, each in
    the step's order."""

    def __init__(self, outboxes: list[Outbox]):
        if not outboxes:
            raise ValueError("a node needs a link to at least one router")
        self.outboxes = outboxes

    @property
    def endpoint(self) -> str:
        return ", ".join(str(getattr(box, "endpoint", "?")) for box in self.outboxes)

    @property
    def num_dropped(self) -> int:
        return sum(getattr(box, "num_dropped", 0) for box in self.outboxes)

    def send(self, msg: Any) -> bool:
        if len(self.outboxes) == 1:
            return self.outboxes[0].send(msg)
        if isinstance(msg, StepTokens):
            return self._send_step(msg)
        request_id = getattr(msg, "request_id", None)
        if isinstance(request_id, str):
            return self.send_to(replica_of(request_id), msg)
        sent = [box.send(msg) for box in self.outboxes]  # one message per box, every box
        return all(sent)

    def send_to(self, replica: int, msg: Any) -> bool:
        """`msg` to one router; False if the cluster has no such router (dropped)."""
        if not 0 <= replica < len(self.outboxes):
            return False
        return self.outboxes[replica].send(msg)

    def _send_step(self, msg: StepTokens) -> bool:
        by_router: dict[int, list] = {}
        for out in msg.outputs():
            by_router.setdefault(replica_of(out.request_id), []).append(out)
        sent = [self.send_to(r, StepTokens.of(outs)) for r, outs in by_router.items()]
        return all(sent)

    def linger(self, timeout: float) -> None:
        for box in self.outboxes:
            if hasattr(box, "linger"):
                box.linger(timeout)

    def close(self) -> None:
        for box in self.outboxes:
            box.close()
