"""Pairing policy: which decode node reserves a request's KV and which prefill node computes it.

A policy is a small object with two methods over the ready nodes; the router asks it for an
ordered list of decode candidates (it tries them in turn until one admits the request) and for
one prefill node. Swap in another policy (prefix affinity, SLA-aware) by passing it to `Router`.
"""

from __future__ import annotations

from typing import Protocol

from router.nodes import NodeState


class PairingPolicy(Protocol):
    def rank_decode(self, nodes: list[NodeState], num_tokens: int) -> list[NodeState]:
        """Decode nodes to try, best first, for a request holding `num_tokens` tokens of KV.
        Nodes that cannot fit it may be left out; an empty list means "no room" (503)."""
        ...

    def pick_prefill(self, nodes: list[NodeState], prompt_len: int) -> NodeState | None:
        """The prefill node for a prompt of `prompt_len` tokens; None if `nodes` is empty."""
        ...


class LeastLoadedPolicy:
    """Prefill: fewest queued tokens (ties: fewest active requests, then name). Decode: most free
    pages among those that fit the request (ties: fewest active requests, then name)."""

    def rank_decode(self, nodes: list[NodeState], num_tokens: int) -> list[NodeState]:
        fits = [n for n in nodes if n.pages_for(num_tokens) <= n.free_pages]
        return sorted(fits, key=lambda n: (-n.free_pages, n.num_active, n.name))

    def pick_prefill(self, nodes: list[NodeState], prompt_len: int) -> NodeState | None:
        if not nodes:
            return None
        return min(nodes, key=lambda n: (n.queued_tokens, n.num_active, n.name))
