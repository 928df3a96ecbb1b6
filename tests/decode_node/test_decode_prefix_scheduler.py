"""DecodeScheduler with a prefix cache (no model): a prompt's whole pages stay cached when its
request ends with its KV complete, a later prompt starts from them (shared, locked while it
lives), cached pages are evicted before a reservation is refused and before anyone is
preempted, and every page returns to the pool when the cache is cleared."""

import pytest
import torch

from control.sampling_params import SamplingParams
from decode_node.scheduler import DecodeScheduler, DecodeState
from model.kv_pool import KVPool
from runtime.prefix_cache import PrefixCache

EOS = 2
MAX_POS = 64
PAGE = 4
PROMPT = list(range(100, 112))  # 12 tokens: 3 whole pages


def make_scheduler(num_pages=32, max_batch=4, headroom=0):
    pool = KVPool(1, num_pages, PAGE, 1, torch.float32)
    return DecodeScheduler(
        pool,
        max_batch,
        MAX_POS,
        frozenset({EOS}),
        headroom_tokens=headroom,
        prefix_cache=PrefixCache(pool, holds_pages=True),
    )


def params(max_new=8):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)


def reserve(sched, rid, prompt, max_new=8):
    request, reason = sched.reserve(rid, 7, len(prompt), params(max_new), 0.0, prompt_ids=prompt)
    assert request is not None, reason
    return request


def finish(sched, rid, prompt, max_new=2):
    """A whole request: reserved, its KV in, decoded to its end."""
    reserve(sched, rid, prompt, max_new)
    sched.kv_ready(rid, 10, 0.0, decode_timeout=100.0)
    while sched.get(rid) is not None:
        batch = sched.schedule()
        sched.update(batch, [11] * len(batch))


def in_use(sched) -> int:
    return sched.pool.allocator.num_used


def test_a_finished_prompt_is_cached_and_the_next_starts_from_it():
    sched = make_scheduler()
    finish(sched, "a", PROMPT + [1, 2])  # 14 tokens: 3 whole pages cached
    cache = sched.prefix_cache
    assert cache.num_cached_pages == 3 and in_use(sched) == 3
    held = cache.match(PROMPT, 0).pages
    request = reserve(sched, "b", PROMPT + [7, 7, 7, 7, 7])
    assert request.num_cached == 12 and request.table.pages[:3] == held
    assert all(sched.pool.allocator.num_holders(p) == 2 for p in held)  # the tree and b
    sched.abort("b")  # its KV never came: nothing of it is cached, the tree keeps its own
    assert cache.num_cached_pages == 3 and in_use(sched) == 3
    assert all(sched.pool.allocator.num_holders(p) == 1 for p in held)
    assert cache.clear() == 3 and in_use(sched) == 0


def test_a_prompt_without_its_ids_is_neither_looked_up_nor_cached():
    sched = make_scheduler()
    request, _ = sched.reserve("a", 7, 14, params(2), 0.0)
    assert request.num_cached == 0
    sched.kv_ready("a", 10, 0.0, decode_timeout=100.0)
    while sched.get("a") is not None:
        batch = sched.schedule()
        sched.update(batch, [11] * len(batch))
    assert sched.prefix_cache.num_cached_pages == 0 and in_use(sched) == 0


def test_a_locked_prefix_survives_the_eviction_that_makes_room_for_its_rest():
    sched = make_scheduler(num_pages=8)
    finish(sched, "a", PROMPT)  # 3 pages cached
    finish(sched, "x", [5] * 8)  # 2 more, least recently used after the next match
    request = reserve(sched, "b", PROMPT + [9] * 8, max_new=4)  # 3 shared + 2 own
    assert request.num_cached == 12
    # 8 pages: 3 shared with b, 2 of b's own, x's 2 cached, 1 free. c needs 3: x's go.
    reserve(sched, "c", [6] * 12, max_new=4)
    assert sched.prefix_cache.match([5] * 8, 1).num_tokens == 0
    assert sched.prefix_cache.match(PROMPT, 1).num_tokens == 12  # b's lock kept it


def test_cached_pages_go_before_a_reservation_is_refused():
    sched = make_scheduler(num_pages=6)
    finish(sched, "a", PROMPT)
    assert sched.num_free_pages() == 6 and sched.pool.allocator.num_free == 3
    reserve(sched, "b", [9] * 23, max_new=1)  # all 6 pages: the cache is evicted for it
    assert sched.prefix_cache.num_cached_pages == 0
    refused, reason = sched.reserve("c", 7, 4, params(), 0.0, prompt_ids=[1, 2, 3, 4])
    assert refused is None and "no room" in reason


def test_cached_pages_go_before_anyone_is_preempted():
    sched = make_scheduler(num_pages=8)
    finish(sched, "a", PROMPT)  # 3 cached, 5 free
    for rid in ("b", "c"):
        reserve(sched, rid, [ord(rid)] * 8, max_new=16)  # 2 pages each, up to 6 each
        sched.kv_ready(rid, 10, 0.0, decode_timeout=100.0)
    cached_before_step = []
    while sched.num_preempted == 0:
        cached_before_step.append(sched.prefix_cache.num_cached_pages)
        batch = sched.schedule()
        sched.update(batch, [11] * len(batch))
    # The cache shrank as b and c grew, and only once it was gone did c go.
    assert cached_before_step[0] == 3 and cached_before_step[-1] == 0
    assert sorted(cached_before_step, reverse=True) == cached_before_step
    assert [r.request_id for r in sched.take_preempted()] == ["c"]


def test_a_preempted_request_leaves_its_prompt_cached_for_its_restart():
    sched = make_scheduler(num_pages=8)
    for rid, prompt in (("a", [4] * 12), ("b", PROMPT)):  # 3 pages each, up to 7
        reserve(sched, rid, prompt, max_new=16)
        sched.kv_ready(rid, 10, 0.0, decode_timeout=100.0)
    while sched.num_preempted == 0:  # both grow to 4 pages; a's 5th takes b's 4th
        batch = sched.schedule()
        sched.update(batch, [11] * len(batch))
    (victim,) = sched.take_preempted()
    assert victim.request_id == "b" and victim.state == DecodeState.PREEMPTED
    assert sched.prefix_cache.match(PROMPT, 9).num_tokens == 12  # its restart starts here


@pytest.mark.parametrize("n", [1, 3])
def test_every_page_returns_once_the_cache_is_cleared(n):
    sched = make_scheduler()
    finish(sched, "warm", PROMPT)
    sampling = SamplingParams(temperature=0.8, max_new_tokens=3, n=n, seed=1)
    forks = tuple(f"r/{i}" for i in range(1, n))
    prompt = PROMPT + [1, 2, 3, 4, 5]
    request, reason = sched.reserve(
        "r", 7, len(prompt), sampling, 0.0, fork_ids=forks, prompt_ids=prompt
    )
    assert request is not None, reason
    assert request.num_cached == 12
    sched.kv_ready("r", 10, 0.0, 100.0, fork_tokens=tuple([12] * (n - 1)))
    while sched.has_runnable():
        batch = sched.schedule()
        sched.update(batch, [11] * len(batch))
    assert in_use(sched) == sched.prefix_cache.num_cached_pages == 4
    sched.prefix_cache.clear()
    assert in_use(sched) == 0
