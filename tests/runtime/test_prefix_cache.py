"""The prefix cache's radix tree alone, over a real page allocator (no model): page-granular
matches, inserts that hand back duplicates, LRU eviction of unlocked leaves only, counters."""

import pytest
import torch

from model.kv_pool import KVPool
from runtime.prefix_cache import PrefixCache

PS = 4  # page size


def make_cache(num_pages=32):
    pool = KVPool(num_layers=1, num_pages=num_pages, page_size=PS, row_width=2, dtype=torch.float32)
    return PrefixCache(pool)


def cached(cache, tokens, tick=0):
    """Computes `tokens` (whole pages) as a cold prefill would, into pages of its own, and
    caches them; frees what the tree hands back. Returns the pages the tree holds for them."""
    pages = cache.pool.allocator.allocate(len(tokens) // PS)
    cache.pool.allocator.free(cache.insert(tokens, pages, tick))
    return cache.match(tokens, tick).pages


def check_pool(cache):
    """Every page in use belongs to the tree (nothing leaked, nothing double-counted)."""
    assert cache.pool.allocator.num_used == cache.num_cached_pages


def test_match_is_page_granular_and_returns_the_pages_in_order():
    cache = make_cache()
    tokens = list(range(12))
    pages = cached(cache, tokens)
    assert cache.match(tokens, 1).num_tokens == 12
    assert cache.match(tokens, 1).pages == pages
    assert cache.match(list(range(11)), 1).pages == pages[:2]  # the partial third page: no
    assert cache.match([*range(9), 99, 10, 11], 1).num_tokens == 8  # differs inside page 3
    assert cache.match([*range(4), 99], 1).num_tokens == 4
    assert cache.match([99, *range(1, 12)], 1).num_tokens == 0
    assert cache.match([], 1).num_tokens == 0
    check_pool(cache)


def test_insert_of_a_shared_prefix_hands_back_only_the_duplicates():
    cache = make_cache()
    a = cached(cache, list(range(8)))
    # A second prompt with the same first page and another second: its first page duplicates.
    b = cache.pool.allocator.allocate(2)
    assert cache.insert([0, 1, 2, 3, 50, 51, 52, 53], b, 2) == [b[0]]
    cache.pool.allocator.free([b[0]])
    assert cache.num_cached_pages == 3
    assert cache.match([0, 1, 2, 3, 50, 51, 52, 53], 3).pages == [a[0], b[1]]
    assert cache.match(list(range(8)), 3).pages == a
    # Inserting pages the tree already holds (a request's shared prefix) hands nothing back.
    own = cache.pool.allocator.allocate(1)
    assert cache.insert([*range(8), 8, 9, 10, 11], [*a, *own], 4) == []
    assert cache.match(list(range(12)), 5).pages == [*a, *own]
    check_pool(cache)


def test_insert_refuses_a_partial_page():
    cache = make_cache()
    with pytest.raises(ValueError, match="whole pages"):
        cache.insert([1, 2, 3], [0], 0)


def test_eviction_takes_least_recently_used_leaves_first():
    cache = make_cache()
    old = cached(cache, [1] * 4 + [2] * 4, tick=1)
    fresh = cache.pool.allocator.allocate(1)  # a prompt sharing old's first page, as a request
    assert cache.insert([1] * 4 + [3] * 4, [old[0], *fresh], 2) == []  # does: a split
    other = cached(cache, [5] * 8, tick=3)
    cache.match([1] * 4 + [2] * 4, tick=4)  # "old" used again: now the most recent
    assert cache.evict(1) == 1  # the [3] page (tick 2) went first
    assert cache.match([1] * 4 + [3] * 4, 5).pages == [old[0]]
    assert cache.num_evicted_pages == 1 and cache.num_cached_pages == 4
    assert cache.evict(1) == 1  # then "other" (tick 3): its tail page; its head stays
    assert cache.match([5] * 8, 6).pages == other[:1]  # (used at tick 6 now)
    assert cache.evict(2) == 2  # old's leaf (tick 4), then the page it shared (tick 5)
    assert cache.match([1] * 8, 7).num_tokens == 0 and cache.match([5] * 4, 7).pages == other[:1]
    check_pool(cache)


def test_a_parent_becomes_evictable_once_its_children_are_gone():
    cache = make_cache()
    cached(cache, [1] * 4 + [2] * 4, tick=1)
    cached(cache, [1] * 4 + [3] * 4, tick=2)
    free_before = cache.pool.allocator.num_free
    assert cache.clear() == 3  # both leaves, then their shared parent
    assert cache.num_cached_pages == 0 and cache.pool.allocator.num_free == free_before + 3
    assert cache.num_evicted_pages == 3
    check_pool(cache)


def test_locked_paths_are_never_evicted_and_split_keeps_the_lock():
    cache = make_cache()
    pages = cached(cache, list(range(12)), tick=1)
    match = cache.match(list(range(12)), 2)
    cache.lock(match.handle)
    # A later match ending mid-edge splits the locked node: both halves stay locked.
    assert cache.match(list(range(4)), 3).num_tokens == 4
    cached(cache, [7] * 4, tick=0)  # older, unlocked
    assert cache.num_evictable_pages() == 1
    assert cache.clear() == 1  # only the [7] page could go
    assert cache.match(list(range(12)), 4).pages == pages
    cache.unlock(match.handle)
    assert cache.clear() == 3
    assert cache.num_cached_pages == 0
    check_pool(cache)
    with pytest.raises(RuntimeError, match="unlock without a lock"):
        cache.unlock(match.handle)


def test_lock_of_an_inner_node_protects_its_path_not_its_other_children():
    cache = make_cache()
    cached(cache, [1] * 4 + [2] * 4, tick=1)
    cached(cache, [1] * 4 + [3] * 4, tick=2)
    inner = cache.match([1] * 4, 3)
    cache.lock(inner.handle)
    assert cache.clear() == 2  # both leaves; the locked shared page stays
    assert cache.match([1] * 8, 4).num_tokens == 4
    cache.unlock(inner.handle)
    assert cache.clear() == 1
    check_pool(cache)


def test_eviction_stops_once_enough_pages_are_free():
    cache = make_cache()
    for i in range(5):
        cached(cache, [10 + i] * 4, tick=i)
    assert cache.evict(2) == 2
    assert [cache.match([10 + i] * 4, 9).num_tokens for i in range(5)] == [0, 0, 4, 4, 4]
    assert cache.evict(0) == 0
    check_pool(cache)


def test_lookup_counters():
    cache = make_cache()
    cache.record_lookup(0)
    cache.record_lookup(8)
    cache.record_lookup(4)
    assert (cache.num_lookups, cache.num_hits, cache.num_hit_tokens) == (3, 2, 12)
    cached(cache, list(range(8)))
    assert cache.num_cached_pages == 2 and cache.num_cached_tokens == 8
