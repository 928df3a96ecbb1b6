"""The router's guess of what each prefill node's prefix cache holds (as SGLang's router does).

The router never sees a node's cache. It remembers, per node, the prompts it sent there, in a
radix tree over token ids, and trims that tree by LRU to about the size the node reports it
caches (heartbeats), so prompts the node has evicted fade from the router's view as well. A
match is an estimate: the node may have evicted more, or not yet finished the prompt; the
policy only uses it to prefer a node, never for correctness.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...] = ()  # the edge from the parent
    parent: _Node | None = None
    children: dict[int, _Node] = field(default_factory=dict)  # by first token
    last_used: int = 0


class PrefixAffinityTree:
    """Token-level radix tree of the prompts sent to one node, with LRU trimming."""

    def __init__(self) -> None:
        self._root = _Node()
        self.num_tokens = 0  # tokens held on all edges

    def match(self, token_ids: list[int]) -> int:
        """Length of the longest remembered prefix of `token_ids` (a query: changes nothing;
        the prompt's `insert` on the chosen node marks the path used)."""
        node, pos = self._root, 0
        while pos < len(token_ids):
            child = node.children.get(token_ids[pos])
            if child is None:
                break
            common = _common_len(child.tokens, token_ids, pos)
            pos += common
            if common < len(child.tokens):
                break
            node = child
        return pos

    def insert(self, token_ids: list[int], tick: int) -> None:
        """Remembers `token_ids` (a prompt just sent to the node), used at `tick`."""
        node, pos = self._root, 0
        while pos < len(token_ids):
            child = node.children.get(token_ids[pos])
            if child is None:
                leaf = _Node(tuple(token_ids[pos:]), node, last_used=tick)
                node.children[token_ids[pos]] = leaf
                self.num_tokens += len(leaf.tokens)
                return
            common = _common_len(child.tokens, token_ids, pos)
            if common < len(child.tokens):
                child = self._split(child, common)
            child.last_used = tick
            pos += common
            node = child

    def trim(self, max_tokens: int) -> None:
        """Drops least recently used leaves until at most `max_tokens` tokens remain."""
        if self.num_tokens <= max_tokens:
            return
        heap = [(n.last_used, i, n) for i, n in enumerate(self._leaves())]
        heapq.heapify(heap)
        order = len(heap)
        while self.num_tokens > max_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.tokens[0]]
            self.num_tokens -= len(leaf.tokens)
            if parent is not self._root and not parent.children:
                order += 1
                heapq.heappush(heap, (parent.last_used, order, parent))

    def clear(self) -> None:
        self._root = _Node()
        self.num_tokens = 0

    def _split(self, child: _Node, cut: int) -> _Node:
        upper = _Node(child.tokens[:cut], child.parent, last_used=child.last_used)
        child.parent.children[child.tokens[0]] = upper
        child.tokens, child.parent = child.tokens[cut:], upper
        upper.children[child.tokens[0]] = child
        return upper

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if not node.children:
                out.append(node)
            stack.extend(node.children.values())
        return out


def _common_len(edge: tuple[int, ...], token_ids: list[int], pos: int) -> int:
    n = min(len(edge), len(token_ids) - pos)
    for i in range(n):
        if edge[i] != token_ids[pos + i]:
            return i
    return n
