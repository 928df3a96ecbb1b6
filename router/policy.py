"""Pairing policy: which decode node reserves a request's KV and which prefill node computes it.

A policy is a small object with two methods over the ready nodes; the router asks it for an
ordered list of decode candidates (it tries them in turn until one admits the request) and for
one prefill node, and shows it every heartbeat. Swap in another policy (SLA-aware) by passing
it to `Router`; `default_policy` picks cache-aware routing when prefill nodes cache prefixes.
"""

from __future__ import annotations

from typing import Protocol

from control.cluster_config import ClusterConfig
from router.nodes import NodeState
from router.prefix_affinity import PrefixAffinityTree


class PairingPolicy(Protocol):
    def rank_decode(self, nodes: list[NodeState], num_tokens: int) -> list[NodeState]:
        """Decode nodes to try, best first, for a request holding `num_tokens` tokens of KV.
        Nodes that cannot fit it may be left out; an empty list means "no room" (503)."""
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

    def rank_decode(self, nodes: list[NodeState], num_tokens: int) -> list[NodeState]:
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
    """Prefill: prefix affinity balanced against load. Among the nodes whose queue is at most
    `balance_tokens` longer than the shortest, the one with the longest cached prefix of the
    prompt (by the router's per-node `PrefixAffinityTree`; ties by load); with no cached
    prefix anywhere among them, the least loaded node. Decode: as LeastLoadedPolicy.

    The trees hold what the node caches, as far as the router can tell: the whole pages of
    each prompt sent there, trimmed at each heartbeat (LRU) to what the node reports caching
    plus the tokens still queued on it (those prompts are cached when they finish)."""

    def __init__(self, caching_nodes: set[str], balance_tokens: int):
        self.balance_tokens = balance_tokens
        self.trees = {name: PrefixAffinityTree() for name in caching_nodes}
        self._num_lookups: dict[str, int] = {}  # the last heartbeat's, to notice a restart
        self._tick = 0

    def cached_len(self, node: NodeState, prompt_ids: list[int]) -> int:
        """The prompt tokens the router expects `node` to serve from its cache: whole pages,
        at most len - 1 (the node always computes the last token)."""
        tree = self.trees.get(node.name)
        if tree is None or not prompt_ids:
            return 0
        matched = min(tree.match(prompt_ids), len(prompt_ids) - 1)
        return matched // node.page_size * node.page_size

    def pick_prefill(self, nodes: list[NodeState], prompt_ids: list[int]) -> NodeState | None:
        if not nodes:
            return None
        shortest = min(n.queued_tokens for n in nodes)
        fair = [n for n in nodes if n.queued_tokens <= shortest + self.balance_tokens]
        scored = [(self.cached_len(n, prompt_ids), n) for n in fair]
        best = max(length for length, _ in scored)
        if best == 0:
            choice = min(nodes, key=_load)
        else:
            choice = min((n for length, n in scored if length == best), key=_load)
        tree = self.trees.get(choice.name)
        if tree is not None:
            self._tick += 1
            whole = len(prompt_ids) // choice.page_size * choice.page_size
            tree.insert(prompt_ids[:whole], self._tick)  # what the node will cache of it
        return choice

    def observe_heartbeat(self, node: NodeState) -> None:
        tree, hb = self.trees.get(node.name), node.heartbeat
        if tree is None or hb is None or node.role != "prefill":
            return
        if hb.num_prefix_lookups < self._num_lookups.get(node.name, 0):
            tree.clear()  # its counters went back: it restarted with an empty cache
        self._num_lookups[node.name] = hb.num_prefix_lookups
        # A prompt whose first token the router has seen was cached before this heartbeat was
        # sent (same socket, in order); the others are still queued on the node.
        tree.trim(hb.num_prefix_cached_tokens + node.queued_tokens)


def default_policy(cfg: ClusterConfig) -> PairingPolicy:
    """Cache-aware when any prefill node keeps a prefix cache, else least loaded."""
    caching = {p.name for p in cfg.prefill if p.prefix_cache}
    if caching:
        return CacheAwarePolicy(caching, cfg.router.cache_balance_tokens)
    return LeastLoadedPolicy()


def _load(node: NodeState) -> tuple:
    return (node.queued_tokens, node.num_active, node.name)
