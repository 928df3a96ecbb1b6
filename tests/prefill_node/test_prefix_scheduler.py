"""PrefillScheduler with a prefix cache, hand-made requests and a fake forward that writes each
token's id into its KV row: a cache hit starts after the cached pages and reads the rows a cold
prefill wrote for the same tokens; eviction under pressure; refcounts under concurrent requests
sharing a prefix; an abort frees nothing shared; prompt_logprobs bypass; pages back to baseline."""

import torch

from control.sampling_params import SamplingParams
from model.kv_pool import KVPool
from prefill_node.scheduler import PrefillRequest, PrefillScheduler, PrefillState
from runtime.prefix_cache import PrefixCache

PS = 4
PREFIX = list(range(100, 112))  # three whole pages


def make_scheduler(num_pages=64, chunk_size=8, max_batch_tokens=16):
    pool = KVPool(1, num_pages, PS, 1, torch.float32)
    return PrefillScheduler(pool, chunk_size, max_batch_tokens, PrefixCache(pool))


def make_request(rid, tokens, **params):
    return PrefillRequest(rid, 1, list(tokens), SamplingParams(**params), "inproc://d", 0.0, 10.0)


def forward(sched, chunks):
    """The fake model: row value = token id at its position, then the scheduler's update."""
    for c in chunks:
        rows = torch.tensor(c.tokens, dtype=torch.float32).view(1, -1, 1)
        sched.pool.write_rows(c.request.table, 0, c.start, rows)
    return sched.update(chunks)


def kv_of(sched, request):
    """The token ids the request's table holds rows for, up to its computed length."""
    rows = sched.pool.read_rows(request.table, 0, 1, 0, request.num_computed)
    return [int(v) for v in rows.flatten()]


def run(sched, *requests, max_steps=100):
    for r in requests:
        sched.add(r)
    for _ in range(max_steps):
        chunks = sched.schedule()
        if not chunks:
            break
        forward(sched, chunks)
    assert not sched.has_work()


def test_a_repeated_prefix_is_served_from_the_cache():
    sched = make_scheduler()
    cache = sched.prefix_cache
    run(sched, make_request("cold", PREFIX + [1, 2]))
    assert cache.num_cached_pages == 3  # whole pages only; the tail page went back
    assert sched.pool.allocator.num_used == 3 and sched.num_request_pages == 0
    warm = make_request("warm", PREFIX + [7, 8, 9])
    sched.add(warm)
    (chunk,) = sched.schedule()
    assert (chunk.start, chunk.end) == (12, 15) and warm.num_cached == 12
    assert warm.table.pages[:3] == cache.match(PREFIX, 0).pages  # shared, not copied
    assert kv_of(sched, warm) == PREFIX  # the rows the cold prefill wrote
    assert forward(sched, [chunk]) == [warm]
    assert (cache.num_lookups, cache.num_hits, cache.num_hit_tokens) == (2, 1, 12)
    assert sched.num_request_pages == 0 and cache.num_cached_pages == 3


def test_the_last_prompt_token_is_always_computed():
    """A prompt that is all cached pages still computes its last page (its logits give the
    first token); finishing it hands the tree a duplicate, which is freed."""
    sched = make_scheduler()
    cache = sched.prefix_cache
    run(sched, make_request("cold", PREFIX))
    again = make_request("again", PREFIX)
    sched.add(again)
    (chunk,) = sched.schedule()
    assert (chunk.start, chunk.end) == (8, 12)  # 11 tokens may match: two whole pages
    forward(sched, [chunk])
    assert cache.num_cached_pages == 3 and sched.pool.allocator.num_used == 3
    assert cache.num_hit_tokens == 8


def test_prompt_logprobs_bypass_the_lookup():
    sched = make_scheduler()
    cache = sched.prefix_cache
    run(sched, make_request("cold", PREFIX + [1]))
    wants = make_request("wants", PREFIX + [1], prompt_logprobs=1)
    sched.add(wants)
    chunks = sched.schedule()
    assert chunks[0].start == 0 and wants.num_cached == 0  # every prompt logit is computed
    assert cache.num_lookups == 1  # its own start did not look up
    forward(sched, chunks)
    run(sched)
    assert sched.num_request_pages == 0 and cache.num_cached_pages == 3  # duplicates freed


def test_a_prompt_logprobs_request_evicts_what_it_needs_too():
    sched = make_scheduler(num_pages=8)
    run(sched, make_request("a", [1] * 25))  # 6 whole pages stay cached, 2 free
    wants = make_request("wants", [1] * 25, prompt_logprobs=0)  # 7 pages, computed whole
    run(sched, wants)
    assert wants.state == PrefillState.FINISHED
    assert sched.prefix_cache.num_evicted_pages == 5  # a's tail pages: its first page stays
    assert sched.num_request_pages == 0


def test_pool_pressure_evicts_least_recently_used_prefixes():
    sched = make_scheduler(num_pages=8)
    cache = sched.prefix_cache
    run(sched, make_request("a", [1] * 8 + [0]))  # caches 2 pages
    run(sched, make_request("b", [2] * 8 + [0]))  # 2 more
    run(sched, make_request("a2", [1] * 8 + [5]))  # a's prefix used again: b is now the oldest
    assert cache.num_cached_pages == 4 and sched.pool.allocator.num_free == 4
    big = make_request("big", [3] * 21)  # 6 pages: 4 free, b's 2 must go
    run(sched, big)
    assert cache.num_evicted_pages == 2
    assert cache.match([2] * 8, 0).num_tokens == 0 and cache.match([1] * 8, 0).num_tokens == 8
    assert sched.num_request_pages == 0
    assert cache.clear() == 2 + 5  # a's prefix and big's whole pages
    assert sched.pool.allocator.num_used == 0  # baseline


def test_concurrent_requests_share_a_locked_prefix():
    sched = make_scheduler(num_pages=16)
    cache = sched.prefix_cache
    run(sched, make_request("seed", PREFIX + [0]))
    b, c = make_request("b", PREFIX + [1] * 9), make_request("c", PREFIX + [2] * 9)
    d = make_request("d", [9] * 16)  # 4 pages
    for r in (b, c, d):
        sched.add(r)
    blocker = sched.pool.allocator.allocate(4)  # 16 - 3 cached - 3 (b) - 3 (c) - 4 = 3 free
    chunks = sched.schedule()
    assert [(ch.request.request_id, ch.start) for ch in chunks] == [("b", 12), ("c", 12)]
    assert b.table.pages[:3] == c.table.pages[:3] == cache.match(PREFIX, 0).pages
    assert kv_of(sched, b) == kv_of(sched, c) == PREFIX
    assert d.state == PrefillState.WAITING
    assert cache.num_evictable_pages() == 0  # both lock the shared path: nothing for d
    run(sched)  # b and c finish, give their pages to the tree or back; then d runs
    assert [r.state for r in (b, c, d)] == [PrefillState.FINISHED] * 3
    assert cache.match(PREFIX + [1] * 8, 0).num_tokens == 20
    assert cache.match(PREFIX + [2] * 8, 0).num_tokens == 20
    assert sched.num_request_pages == len(blocker)
    sched.pool.allocator.free(blocker)
    cache.clear()
    assert sched.pool.allocator.num_used == 0  # baseline: every lock was released


def test_abort_of_a_request_sharing_a_prefix_frees_only_its_own_pages():
    sched = make_scheduler(num_pages=16)
    cache = sched.prefix_cache
    run(sched, make_request("seed", PREFIX + [0]))
    b, c = make_request("b", PREFIX + [1] * 9), make_request("c", PREFIX + [2] * 9)
    sched.add(b)
    sched.add(c)
    forward(sched, sched.schedule())
    shared = b.table.pages[:3]
    own_b = b.table.pages[3:]
    used = sched.pool.allocator.num_used
    sched.abort("b")
    assert b.state == PrefillState.FAILED and b.table is None
    assert sched.pool.allocator.num_used == used - len(own_b)  # only b's own pages came back
    assert cache.clear() == 0  # c still locks the shared prefix
    assert kv_of(sched, c)[:12] == PREFIX and c.table.pages[:3] == shared
    run(sched)
    assert c.state == PrefillState.FINISHED
    assert cache.clear() == 3 + 2 and sched.pool.allocator.num_used == 0  # PREFIX + c's own


def test_a_prompt_that_cannot_start_yet_evicts_nothing():
    sched = make_scheduler(num_pages=8)
    run(sched, make_request("a", [1] * 8 + [0]))  # 2 pages cached
    blocker = sched.pool.allocator.allocate(5)  # 1 free; evicting a's 2 still leaves 3 < 4
    sched.add(make_request("big", [3] * 13))
    assert sched.schedule() == []
    assert sched.prefix_cache.num_cached_pages == 2 and sched.prefix_cache.num_evicted_pages == 0
    sched.pool.allocator.free(blocker)
    run(sched)
    assert sched.num_request_pages == 0
