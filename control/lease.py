"""A node's leases from the routers that own its requests, one per router replica
(`control.router_links`), each renewed by its router's RouterPing.

A node holds a router's requests only while that router lives: if its pings stop for `lease_s`
(it died or is cut off) or a ping names another router id at its place (it restarted: the new
one knows none of the old requests), the node aborts that router's requests, so no node
decodes for nobody and every page comes back; the other routers' requests go on. A lease
starts with its router's first ping: a node driven without a router (tests) is never orphaned.
"""

from __future__ import annotations


class RouterLeases:
    def __init__(self) -> None:
        self.router_ids: dict[int, str] = {}  # replica -> the id of the router there
        self.expires_at: dict[int, float] = {}  # replica -> when its lease runs out

    def renew(self, replica: int, router_id: str, lease_s: float, now: float) -> bool:
        """Records a ping; True if it comes from another router than the last one at its
        replica's place did (a restart)."""
        replaced = self.router_ids.get(replica, router_id) != router_id
        self.router_ids[replica] = router_id
        self.expires_at[replica] = now + lease_s
        return replaced

    def lapsed(self, now: float) -> list[int]:
        """The replicas whose lease ran out since the last call (each once, until it pings
        again)."""
        gone = [replica for replica, end in self.expires_at.items() if now > end]
        for replica in gone:
            del self.expires_at[replica]
        return gone
