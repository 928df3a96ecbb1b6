"""The router's exact index of what each node's prefix cache holds, from the nodes' KV events.

Every node that caches prompts' KV (prefill nodes, and decode nodes with `prefix_cache`) sends
`KVEvents` as its cache changes: the chained names of the pages it stored or removed
(`control.kv_events`). They travel on the node's control socket, in order with its other
messages, so the index is exact as of the last message heard from the node: a prompt's pages
are in it before its first token (prefill) or its last tokens (decode) reach the router.

A match names the prompt's pages the same way and counts how many leading ones the node holds.
The index forgets a node when it (re)starts (its NodeReady: an empty cache) or dies, and a
node's snapshot (`cleared`, then every name) rebuilds it after a router restart.

Bounded memory: a node holds at most the pages of its pool, so the index keeps at most that many
names per node (`max_pages`, from its NodeReady; `DEFAULT_MAX_PAGES` until then); names past the
bound are dropped and counted, never stored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from control.kv_events import page_hashes
from control.protocol import KVEvents

log = logging.getLogger("router")

DEFAULT_MAX_PAGES = 1 << 20


@dataclass
class _NodeIndex:
    page_size: int
    names: set[bytes] = field(default_factory=set)
    num_stored: int = 0  # names added, cumulative
    num_removed: int = 0  # names removed, cumulative
    num_dropped: int = 0  # names past the bound (never stored), cumulative
    num_unknown_removed: int = 0  # removals of names it did not hold, cumulative


class KVIndex:
    """Per-node sets of cached page names (see the module docstring). Not thread-safe: the
    router's event loop is its only caller."""

    def __init__(self) -> None:
        self._nodes: dict[str, _NodeIndex] = {}

    def apply(self, msg: KVEvents, max_pages: int = DEFAULT_MAX_PAGES) -> None:
        """One node's change: `cleared`, then its removals, then its stores."""
        entry = self._nodes.get(msg.node)
        if msg.page_size <= 0:
            log.warning("KV events of %s with page size %d: ignored", msg.node, msg.page_size)
            return
        if entry is None or msg.cleared or entry.page_size != msg.page_size:
            entry = self._nodes[msg.node] = _NodeIndex(msg.page_size)
        for name in msg.removed:
            if name in entry.names:
                entry.names.discard(name)
                entry.num_removed += 1
            else:
                entry.num_unknown_removed += 1
        for name in msg.stored:
            if name in entry.names:
                continue
            if len(entry.names) >= max_pages:
                if not entry.num_dropped:
                    log.warning(
                        "KV index of %s is full (%d pages): further pages are not indexed",
                        msg.node,
                        max_pages,
                    )
                entry.num_dropped += 1
                continue
            entry.names.add(name)
            entry.num_stored += 1

    def forget(self, node: str) -> None:
        """The node's cache is gone (it restarted or died)."""
        self._nodes.pop(node, None)

    def page_size(self, node: str) -> int:
        """The page size of the node's cache (0: it published nothing yet)."""
        entry = self._nodes.get(node)
        return entry.page_size if entry is not None else 0

    def match(self, node: str, token_ids: list[int], names: dict[int, list[bytes]]) -> int:
        """Leading tokens of `token_ids` whose pages the node holds (whole pages). `names`
        memoizes the prompt's page names by page size across the calls for one prompt."""
        entry = self._nodes.get(node)
        if entry is None or not entry.names:
            return 0
        ps = entry.page_size
        if ps not in names:
            names[ps] = page_hashes(token_ids, ps)
        count = 0
        for name in names[ps]:
            if name not in entry.names:
                break
            count += 1
        return count * ps

    def summary(self) -> dict[str, dict[str, Any]]:
        """For GET /v1/kv_index/summary: per node, what it holds now and the events so far."""
        return {
            node: {
                "page_size": entry.page_size,
                "pages": len(entry.names),
                "tokens": len(entry.names) * entry.page_size,
                "stored_events": entry.num_stored,
                "removed_events": entry.num_removed,
                "dropped": entry.num_dropped,
                "unknown_removed": entry.num_unknown_removed,
            }
            for node, entry in sorted(self._nodes.items())
        }


def kv_index_summary(index: KVIndex, nodes: list[Any]) -> dict[str, Any]:
    """The JSON body of `GET /v1/kv_index/summary`: per node (router.nodes.NodeState) that
    caches prompts, what the index holds of it and the node's own hit figures (heartbeat)."""
    held = index.summary()
    out = {}
    for node in nodes:
        hb = node.heartbeat
        if node.name not in held and (hb is None or not hb.num_prefix_lookups):
            continue  # keeps no cache, or has published nothing yet
        entry = {"role": node.role, **held.get(node.name, {"pages": 0, "tokens": 0})}
        if hb is not None:
            lookups = hb.num_prefix_lookups
            entry["lookups"] = lookups
            entry["hits"] = hb.num_prefix_hits
            entry["hit_tokens"] = hb.num_prefix_hit_tokens
            entry["hit_ratio"] = hb.num_prefix_hits / lookups if lookups else 0.0
            if node.role == "prefill":
                entry["kv_rows_sent"] = hb.kv_rows_sent
                entry["kv_rows_skipped"] = hb.kv_rows_skipped
                if hb.num_disk_lookups:  # the disk tier's own
                    entry["disk_lookups"] = hb.num_disk_lookups
                    entry["disk_hit_tokens"] = hb.num_disk_hit_tokens
                    entry["disk_hit_ratio"] = hb.num_disk_hits / hb.num_disk_lookups
            else:
                entry["kv_rows_received"] = hb.kv_rows_received
        out[node.name] = entry
    return {"object": "kv_index.summary", "nodes": out}
