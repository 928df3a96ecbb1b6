"""Pairing policy: which decode node reserves a request's KV and which prefill node computes it.

A policy is a small object with two methods over the ready nodes; the router asks it for an
ordered list of decode candidates (it tries them in turn until one admits the request) and for
one prefill node, and shows it every heartbeat. Swap in another policy (SLA-aware) by passing
it to `Router`; `default_policy` picks cache-aware routing when any node caches prefixes.
"""

from __future__ import annotations

import os
from typing import Protocol

from control.cluster_config import ClusterConfig
from router.kv_index import KVIndex
from router.nodes import NodeState


class PairingPolicy(Protocol):
    def rank_decode(
        self, nodes: list[NodeState], num_tokens: int, prompt_ids: list[int] = ()
    ) -> list[NodeState]:
        """Decode nodes to try, best first, for a request of `prompt_ids` holding `num_tokens`
        tokens of KV. Nodes that cannot fit it may be left out; an empty list means "no room"
        (503)."""
        ...

    def pick_prefill(self, nodes: list[NodeState], prompt_ids: list[int]) -> NodeState | None:
        """The prefill node for the prompt `prompt_ids`; None if `nodes` is empty."""
        ...

    def observe_heartbeat(self, node: NodeState) -> None:
        """`node.heartbeat` was just updated (the router's load figures are as of it)."""
        ...

    def cached_len(self, node: NodeState, prompt_ids: list[int]) -> int:
        """Prompt tokens `node` is expected to serve from its prefix cache (SLA admission's
        TTFT prediction leaves them out)."""
        ...


class LeastLoadedPolicy:
    """Prefill: fewest queued tokens (ties: fewest active requests, then name). Decode: most free
    pages among those that fit the request (ties: fewest active requests, then name)."""

    def rank_decode(
        self, nodes: list[NodeState], num_tokens: int, prompt_ids: list[int] = ()
    ) -> list[NodeState]:
        fits = [n for n in nodes if n.pages_for(num_tokens) <= n.free_pages]
        return sorted(fits, key=lambda n: (-n.free_pages, n.num_active, n.name))

    def pick_prefill(self, nodes: list[NodeState], prompt_ids: list[int]) -> NodeState | None:
        if not nodes:
            return None
        return min(nodes, key=_load)

    def observe_heartbeat(self, node: NodeState) -> None:
        pass

    def cached_len(self, node: NodeState, prompt_ids: list[int]) -> int:
        return 0  # it keeps no picture of the nodes' caches


class CacheAwarePolicy(LeastLoadedPolicy):
    """Pairs by what the nodes' prefix caches hold (`router.kv_index`, exact from their KV
    events), balanced against load.

    Prefill: among the nodes whose queue is at most `balance_tokens` longer than the shortest,
    the one expected to serve the longest prefix of the prompt from its cache (ties by load);
    with no cached prefix anywhere among them, the least loaded node. A node is expected to
    serve what its cache holds now and what the prompts queued on it will leave there (they
    are cached when they finish), so a burst sharing a system prompt lands together.

    Decode (nodes with `prefix_cache`): among the nodes that fit the request and hold at most
    `balance_tokens` more KV than the least loaded, the one holding the longest prefix of the
    prompt first (the prefill node then sends only the rest); the others by LeastLoadedPolicy."""

    def __init__(self, index: KVIndex, balance_tokens: int):
        self.index = index
        self.balance_tokens = balance_tokens
        self._memo: tuple[list[int] | None, dict[int, list[bytes]]] = (None, {})

    def cached_len(self, node: NodeState, prompt_ids: list[int]) -> int:
        """The prompt tokens the prefill node is expected to serve from its cache: whole pages,
        at most len - 1 (the node always computes the last token)."""
        if not prompt_ids or node.role != "prefill":
            return 0
        held = self.index.match(node.name, prompt_ids, self._names(prompt_ids))
        queued = max((_common_len(p, prompt_ids) for p in node.in_flight.values()), default=0)
        ps = self.index.page_size(node.name) or node.page_size
        return min(max(held, queued // ps * ps), (len(prompt_ids) - 1) // ps * ps)

    def decode_cached_len(self, node: NodeState, prompt_ids: list[int]) -> int:
        """The prompt's leading tokens whose KV the decode node holds (whole pages)."""
        if not prompt_ids:
            return 0
        return self.index.match(node.name, prompt_ids, self._names(prompt_ids))

    def pick_prefill(self, nodes: list[NodeState], prompt_ids: list[int]) -> NodeState | None:
        if not nodes:
            return None
        shortest = min(n.queued_tokens for n in nodes)
        fair = [n for n in nodes if n.queued_tokens <= shortest + self.balance_tokens]
        scored = [(self.cached_len(n, prompt_ids), n) for n in fair]
        best = max(length for length, _ in scored)
        if best == 0:
            return min(nodes, key=_load)
        return min((n for length, n in scored if length == best), key=_load)

    def rank_decode(
        self, nodes: list[NodeState], num_tokens: int, prompt_ids: list[int] = ()
    ) -> list[NodeState]:
        ranked = super().rank_decode(nodes, num_tokens)
        if not ranked or not prompt_ids:
            return ranked
        least = min(_held_tokens(n) for n in ranked)
        fair = [n for n in ranked if _held_tokens(n) <= least + self.balance_tokens]
        held = {n.name: self.decode_cached_len(n, prompt_ids) for n in fair}
        return sorted(ranked, key=lambda n: -held.get(n.name, 0))  # stable: load order within

    def _names(self, prompt_ids: list[int]) -> dict[int, list[bytes]]:
        """The prompt's page names by page size, kept while the router asks about one prompt
        (the same list object)."""
        if self._memo[0] is not prompt_ids:
            self._memo = (prompt_ids, {})
        return self._memo[1]


def default_policy(cfg: ClusterConfig, index: KVIndex) -> PairingPolicy:
    """Cache-aware when any node keeps a prefix cache, else least loaded."""
    if any(p.prefix_cache for p in cfg.prefill) or any(d.prefix_cache for d in cfg.decode):
        return CacheAwarePolicy(index, cfg.router.cache_balance_tokens)
    return LeastLoadedPolicy()


def _held_tokens(node: NodeState) -> int:
    """KV tokens a decode node's requests hold (its pool less what is free or evictable)."""
    return (node.total_pages - node.free_pages) * node.page_size


def _common_len(a: list[int], b: list[int]) -> int:
    return len(os.path.commonprefix([a, b]))


def _load(node: NodeState) -> tuple:
    return (node.queued_tokens, node.num_active, node.name)
