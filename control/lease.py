"""A node's lease from the router that owns its requests, renewed by the router's RouterPing.

A node holds requests only for a live router: if pings stop for `lease_s` (the router died or
is cut off) or a ping names another router (it restarted: the new one knows none of the old
requests), the node aborts everything it holds, so no node decodes for nobody and every page
comes back. The lease starts with the first ping: a node driven without a router (tests) is
never orphaned.
"""

from __future__ import annotations


class RouterLease:
    def __init__(self) -> None:
        self.router_id: str | None = None
        self.expires_at: float | None = None  # None: no lease running

    def renew(self, router_id: str, lease_s: float, now: float) -> bool:
        """Records a ping; True if it comes from another router than the last one did."""
        replaced = self.router_id is not None and router_id != self.router_id
        self.router_id = router_id
        self.expires_at = now + lease_s
        return replaced

    def lapsed(self, now: float) -> bool:
        """True once when the lease runs out (then none runs until the next ping)."""
        if self.expires_at is None or now <= self.expires_at:
            return False
        self.expires_at = None
        return True
