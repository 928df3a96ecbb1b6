"""A node's prefix cache (a prefill node's; a decode node's of finished prompts with
`[[decode]] prefix_cache`): a radix tree over token ids whose edges hold KV pages.

Page-granular: an edge holds k whole pages (k * page_size tokens) of the node's own `KVPool`,
so a match, an insert and a split always fall on a page boundary and a cached page is never
partly valid. The tree owns its pages: they leave the allocator when a finished prefill hands
them over (`insert`) and return to it only through eviction.

Reference counts: `lock(handle)` pins the path from a matched node up to the root while a
running prefill reads those pages; `evict` only ever takes pages of unlocked leaves, from their
tail, least recently used leaf first (LRU by a logical tick the caller passes: the tree reads no
clock). A split copies the
child's count to the new parent, so a lock taken before a split still pins every page it did.

Who owns what: a request's PageTable starts with the matched (shared, locked) pages, followed
by pages of its own. On finish it inserts its whole prompt pages: the tree takes the ones it did
not have and returns the duplicates (pages of positions it already holds under another id) for
the caller to free; the shared pages are the tree's own and are neither taken nor returned.

Two ways to own a page. The prefill node's tree is the page's only owner: a request reading a
cached page just lists it, and frees only what follows. A decode node's tree (`holds_pages`)
counts as one holder of the page in the allocator (`PageAllocator.share`), beside every request
whose table lists it, so a request frees its whole table on any path, as it does without a
cache, and a page goes back to the pool when its last holder (tree or request) lets go.

KV events: with `on_change`, every change is reported as the page names it stored or removed
(`control.kv_events`), in the order it happened, for the router's exact index.

A second tier (`store`, a `runtime.kv_disk_store.DiskKVStore`): every page evicted from the
pool is first written there under its name, and `load_from_store` brings the pages that follow a
pool match back into a request's own pages (the request then caches them in the pool again when
it finishes, as pages it computed).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from control.kv_events import page_hashes
from model.kv_pool import KVPool, PageTable
from runtime.kv_disk_store import WAIT_FOR_READ_S, DiskKVStore

# (stored, removed) page names of one change
ChangeSink = Callable[[list[bytes], list[bytes]], None]


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...] = ()  # the edge from the parent: len(pages) * page_size tokens
    pages: list[int] = field(default_factory=list)
    names: list[bytes] = field(default_factory=list)  # the pages' chained names (with events)
    parent: _Node | None = None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)  # by first page
    lock_count: int = 0  # running prefills whose match ends at or below this node
    last_used: int = 0  # the logical tick of its last match or insert

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass(frozen=True)
class PrefixMatch:
    """A match: the first `num_tokens` tokens are cached in `pages` (in token order).
    `handle` is what `lock`/`unlock` take (the tree node the match ends at)."""

    num_tokens: int
    pages: list[int]
    handle: _Node


class PrefixCache:
    """Radix tree of cached prompt prefixes over `pool`'s pages. Not thread-safe: the
    scheduler is its only caller."""

    def __init__(
        self,
        pool: KVPool,
        holds_pages: bool = False,
        on_change: ChangeSink | None = None,
        store: DiskKVStore | None = None,
    ):
        self.pool = pool
        self.page_size = pool.page_size
        self.holds_pages = holds_pages
        self.on_change = on_change
        self.store = store
        self.num_store_lookups = 0  # lookups that asked the store for pages after the pool's
        self.num_store_hits = 0  # of which got at least one page from it
        self.num_store_hit_tokens = 0  # prompt tokens loaded from it (not computed)
        self._held: set[bytes] = set()  # the names of the pages in the tree (when it names them)
        self._root = _Node()
        self._root.lock_count = 1  # never evicted
        self.num_cached_pages = 0
        # Cumulative counters (the heartbeat reports them).
        self.num_lookups = 0  # prefills that looked their prompt up
        self.num_hits = 0  # of which found at least one cached page
        self.num_hit_tokens = 0  # prompt tokens served from the cache (not computed)
        self.num_evicted_pages = 0

    @property
    def num_cached_tokens(self) -> int:
        return self.num_cached_pages * self.page_size

    # ---- lookups ---------------------------------------------------------------------------
    def match(self, token_ids: list[int], tick: int) -> PrefixMatch:
        """The longest cached prefix of `token_ids` in whole pages. Marks the matched path as
        used at `tick`; counts nothing (see `record_lookup`) and locks nothing."""
        node, pages, pos = self._root, [], 0
        while True:
            child = node.children.get(self._page_key(token_ids, pos))
            if child is None:
                break
            num_pages = self._common_pages(child.tokens, token_ids, pos)
            if num_pages < len(child.pages):
                child = self._split(child, num_pages)
            child.last_used = tick
            pages.extend(child.pages)
            pos += len(child.tokens)
            node = child
        return PrefixMatch(pos, pages, node)

    def record_lookup(self, num_hit_tokens: int) -> None:
        """Counts one prefill that used the cache, `num_hit_tokens` of its prompt from it."""
        self.num_lookups += 1
        if num_hit_tokens > 0:
            self.num_hits += 1
            self.num_hit_tokens += num_hit_tokens

    def lock(self, handle: _Node) -> None:
        """Pins the pages from the root down to `handle` (a running prefill reads them)."""
        node = handle
        while node is not None:
            node.lock_count += 1
            node = node.parent

    def unlock(self, handle: _Node) -> None:
        node = handle
        while node is not None:
            if node.lock_count <= 0:
                raise RuntimeError("prefix cache: unlock without a lock")
            node.lock_count -= 1
            node = node.parent

    # ---- changes ---------------------------------------------------------------------------
    def insert(self, token_ids: list[int], pages: list[int], tick: int) -> list[int]:
        """Caches `pages`, holding the rows of `token_ids` (exactly len(pages) whole pages).
        Returns the pages the tree did not take (it held those positions already under other
        ids): the caller frees them. Pages the tree already holds under the same id (the
        caller's shared prefix) are neither taken nor returned."""
        if len(token_ids) != len(pages) * self.page_size:
            raise ValueError("insert takes whole pages: len(token_ids) != pages * page_size")
        node, pos, not_taken = self._root, 0, []
        names = page_hashes(token_ids, self.page_size) if self._names_pages else []
        while pos < len(token_ids):
            child = node.children.get(self._page_key(token_ids, pos))
            page_index = pos // self.page_size
            if child is None:
                leaf = _Node(
                    tuple(token_ids[pos:]), list(pages[page_index:]), names[page_index:], node
                )
                leaf.last_used = tick
                node.children[self._page_key(token_ids, pos)] = leaf
                self.num_cached_pages += len(leaf.pages)
                if self.holds_pages:
                    self.pool.allocator.share(leaf.pages)
                self._held.update(leaf.names)
                if self.on_change is not None:
                    self.on_change(list(leaf.names), [])
                break
            num_pages = self._common_pages(child.tokens, token_ids, pos)
            if num_pages < len(child.pages):
                child = self._split(child, num_pages)
            mine = pages[page_index : page_index + num_pages]
            not_taken += [p for p, held in zip(mine, child.pages, strict=True) if p != held]
            child.last_used = tick
            pos += len(child.tokens)
            node = child
        return not_taken

    def evict(self, num_pages: int) -> int:
        """Frees `num_pages` pages back to the pool (fewer if too few are unlocked): the tail
        pages of unlocked leaves, least recently used leaf first. Returns the pages freed."""
        heap = [(n.last_used, i, n) for i, n in enumerate(self._leaves()) if n.lock_count == 0]
        heapq.heapify(heap)
        freed, order, removed = 0, len(heap), []
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            if len(leaf.pages) > num_pages - freed:  # its head stays cached
                keep = len(leaf.pages) - (num_pages - freed)
                self._spill(leaf.names[keep:], leaf.pages[keep:])
                self._free(leaf.pages[keep:])
                removed += leaf.names[keep:]
                freed += len(leaf.pages) - keep
                leaf.pages, leaf.tokens = leaf.pages[:keep], leaf.tokens[: keep * self.page_size]
                leaf.names = leaf.names[:keep]
                break
            parent = leaf.parent
            del parent.children[leaf.tokens[: self.page_size]]
            self._spill(leaf.names, leaf.pages)
            self._free(leaf.pages)
            removed += leaf.names
            freed += len(leaf.pages)
            if parent is not self._root and parent.is_leaf and parent.lock_count == 0:
                order += 1
                heapq.heappush(heap, (parent.last_used, order, parent))
        self._held.difference_update(removed)
        if removed and self.on_change is not None:
            self.on_change([], removed)
        return freed

    def num_evictable_pages(self) -> int:
        """Pages `evict` could free now: those of unlocked nodes (a lock pins all ancestors, so
        an unlocked node has no locked descendant). Walks the tree."""
        total, stack = 0, list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.lock_count == 0:
                total += len(node.pages)
            stack.extend(node.children.values())
        return total

    def clear(self) -> int:
        """Evicts every unlocked page; returns how many."""
        return self.evict(self.num_cached_pages)

    def page_names(self) -> list[bytes]:
        """The names of every cached page, each after its parent's (a snapshot for an index
        that starts over: a new router)."""
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            out += node.names
            stack.extend(node.children.values())
        return out

    # ---- internals -------------------------------------------------------------------------
    @property
    def _names_pages(self) -> bool:
        """Whether the tree keeps its pages' names: events and the store key by them."""
        return self.on_change is not None or self.store is not None

    def prefetch(self, token_ids: list[int]) -> None:
        """Starts reading from the store, on its helper thread, the pages of `token_ids` (whole
        pages) after those the tree holds now: a prompt that just arrived, so they are in
        memory by the time it starts (`load_from_store`). Changes nothing in the tree."""
        if self.store is None:
            return
        names = page_hashes(token_ids, self.page_size)
        held = 0
        while held < len(names) and names[held] in self._held:
            held += 1
        self.store.prefetch(names[held:])

    def load_from_store(self, token_ids: list[int], table: PageTable, start: int) -> int:
        """Reads the pages of `token_ids` (whole pages) from `start` (a page boundary: where
        the pool's match ended) on, as long as the store holds them, into `table`'s pages
        (which must hold those positions); returns the tokens loaded."""
        if self.store is None:
            return 0
        names = page_hashes(token_ids, self.page_size)
        first = start // self.page_size
        if first >= len(names):
            return 0
        loaded, deadline = 0, time.monotonic() + WAIT_FOR_READ_S  # one wait for the whole load
        for index in range(first, len(names)):
            rows = self.store.get(names[index], deadline - time.monotonic())
            if rows is None:
                break
            self.pool.write_rows(table, 0, index * self.page_size, rows.to(self.pool.dtype))
            loaded += self.page_size
        self.num_store_lookups += 1
        if loaded:
            self.num_store_hits += 1
            self.num_store_hit_tokens += loaded
        return loaded

    def _spill(self, names: list[bytes], pages: list[int]) -> None:
        """Writes evicted pages to the store (before the pool can hand them out again)."""
        if self.store is None:
            return
        ps, layers = self.page_size, self.pool.num_layers
        for name, page in zip(names, pages, strict=True):
            self.store.put(name, self.pool.read_rows(PageTable(ps, [page]), 0, layers, 0, ps))

    def _free(self, pages: list[int]) -> None:
        self.pool.allocator.free(pages)
        self.num_cached_pages -= len(pages)
        self.num_evicted_pages += len(pages)

    def _page_key(self, token_ids: list[int], pos: int) -> tuple[int, ...]:
        """The child key of the page at `pos`; a short tail (no whole page) keys nothing."""
        return tuple(token_ids[pos : pos + self.page_size])

    def _common_pages(self, edge: tuple[int, ...], token_ids: list[int], pos: int) -> int:
        """Whole pages `edge` shares with token_ids[pos:] (the first is known to match)."""
        ps, num_pages = self.page_size, 1
        while num_pages * ps < len(edge):
            a, b = num_pages * ps, (num_pages + 1) * ps
            if tuple(token_ids[pos + a : pos + b]) != edge[a:b]:
                break
            num_pages += 1
        return num_pages

    def _split(self, child: _Node, num_pages: int) -> _Node:
        """Cuts `child`'s edge after `num_pages` pages; returns the new upper node."""
        cut = num_pages * self.page_size
        upper = _Node(
            child.tokens[:cut], child.pages[:num_pages], child.names[:num_pages], child.parent
        )
        upper.lock_count, upper.last_used = child.lock_count, child.last_used
        child.parent.children[child.tokens[: self.page_size]] = upper
        child.tokens, child.pages, child.parent = child.tokens[cut:], child.pages[num_pages:], upper
        child.names = child.names[num_pages:]
        upper.children[child.tokens[: self.page_size]] = child
        return upper

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.is_leaf:
                out.append(node)
            stack.extend(node.children.values())
        return out


def prefix_cache_figures(cache: PrefixCache | None) -> dict[str, int]:
    """The Heartbeat's prefix-cache fields (none without a cache: they stay zero)."""
    if cache is None:
        return {}
    return {
        "num_prefix_lookups": cache.num_lookups,
        "num_prefix_hits": cache.num_hits,
        "num_prefix_hit_tokens": cache.num_hit_tokens,
        "num_prefix_evicted_pages": cache.num_evicted_pages,
        "num_prefix_cached_pages": cache.num_cached_pages,
        "num_prefix_cached_tokens": cache.num_cached_tokens,
        **(store_figures(cache) if cache.store is not None else {}),
    }


def store_figures(cache: PrefixCache) -> dict[str, int]:
    """The Heartbeat's disk-tier fields."""
    store = cache.store
    return {
        "num_disk_lookups": cache.num_store_lookups,
        "num_disk_hits": cache.num_store_hits,
        "num_disk_hit_tokens": cache.num_store_hit_tokens,
        "num_disk_pages_stored": store.num_stored,
        "num_disk_corrupt": store.num_corrupt,
    }
