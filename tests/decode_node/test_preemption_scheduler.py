"""DecodeScheduler with on-demand KV reservation: the prompt plus a headroom
up front, pages grown as requests generate, LIFO preemption when the pool runs out (never a
request whose KV is still arriving), pages back to baseline on every path. The worst-case rule
is pinned down by test_decode_scheduler.py."""

import random

import pytest
import torch

from control.sampling_params import SamplingParams
from decode_node.scheduler import DecodeScheduler, DecodeState
from model.kv_pool import KVPool

EOS = 2
MAX_POS = 64
PAGE = 4


def make_scheduler(num_pages=32, max_batch=4, headroom=0, reservation="on_demand"):
    pool = KVPool(1, num_pages, PAGE, 1, torch.float32)
    return DecodeScheduler(
        pool,
        max_batch,
        MAX_POS,
        frozenset({EOS}),
        reservation=reservation,
        headroom_tokens=headroom,
    )


def params(max_new=8):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)


def reserve(sched, rid, prompt_len, max_new=8):
    request, reason = sched.reserve(rid, 7, prompt_len, params(max_new), now=0.0)
    assert request is not None, reason
    return request


def admit(sched, rid, prompt_len, max_new=8, first=10):
    request = reserve(sched, rid, prompt_len, max_new)
    assert sched.kv_ready(rid, first, 0.0, decode_timeout=100.0) == []
    return request


def step(sched, token=11):
    """One decode step: every batch member must have room for the position it writes."""
    batch = sched.schedule()
    for r in batch:
        assert r.table.capacity >= r.next_position + 1, r.request_id
    sched.update(batch, [token] * len(batch))
    return [r.request_id for r in batch]


def test_reservation_is_prompt_plus_headroom_never_more_than_worst_case():
    sched = make_scheduler(headroom=4)
    assert reserve(sched, "a", 5, max_new=20).num_reserved == 9  # 5 + 4, not 25
    assert len(sched.get("a").table.pages) == 3 and sched.pages_for(5, 20) == 3
    assert reserve(sched, "b", 5, max_new=2).num_reserved == 7  # the worst case is less
    assert sched.pages_for(60, 20) == 16  # clipped to the context
    worst = make_scheduler(headroom=4, reservation="worst_case")
    assert reserve(worst, "a", 5, max_new=20).num_reserved == 25 and worst.pages_for(5, 20) == 7


@pytest.mark.parametrize(
    "prompt_len, max_new, match",
    [
        (5, 20, "cannot fit at all: needs 7 KV pages to finish, the pool has 4"),
        (20, 1, "cannot fit at all: needs 6 KV pages"),
    ],
)
def test_a_request_that_cannot_finish_in_the_whole_pool_is_refused(prompt_len, max_new, match):
    sched = make_scheduler(num_pages=4)
    request, reason = sched.reserve("a", 7, prompt_len, params(max_new), now=0.0)
    assert request is None and match in reason and sched.pool.allocator.num_used == 0


def test_no_admission_without_room_for_prompt_and_headroom():
    sched = make_scheduler(num_pages=4, headroom=4)
    reserve(sched, "a", 6, max_new=8)  # 10 tokens: 3 pages
    request, reason = sched.reserve("b", 7, 4, params(8), now=0.0)  # 8 tokens: 2 pages
    assert request is None and reason == "no room: needs 2 KV pages, 1 free"
    assert sched.pool.allocator.num_used == 3


def test_pages_grow_one_page_when_the_position_written_needs_it():
    sched = make_scheduler(num_pages=8)
    request = admit(sched, "a", 4, max_new=12)
    assert len(request.table.pages) == 1  # the prompt only (no headroom)
    pages = []
    while sched.get("a") is not None:
        step(sched)
        pages.append(sched.pool.allocator.num_used)
    # 11 steps write positions 4..14: a new page at 4, 8 and 12; all freed at the finish
    assert pages == [2] * 4 + [3] * 4 + [4] * 2 + [0]
    assert sched.num_preempted == 0 and not sched.take_preempted()


def test_with_equal_priorities_the_newest_admission_goes_first_then_the_requester():
    sched = make_scheduler(num_pages=5)
    a = admit(sched, "a", 4, max_new=8)  # 1 page; needs a second one at its first step
    b = admit(sched, "b", 5, max_new=8)  # 2 pages
    c = admit(sched, "c", 5, max_new=8)  # 2 pages: the pool is full
    assert step(sched) == ["a", "b"]  # a's page came from c, the newest
    (gone,) = sched.take_preempted()
    assert gone is c and c.state == DecodeState.PREEMPTED and c.output_ids == [10]
    assert "ran out: request a needed a page for position 4" in c.error
    assert not c.table.pages and sched.get("c") is None and c.slot == -1
    for _ in range(3):
        assert step(sched) == ["a", "b"]  # a at 5, 6, 7; b at 6, 7, 8 (its page 3: the last)
    assert step(sched) == ["a"]  # a needs a page at 8: b is now the newest runnable
    (gone,) = sched.take_preempted()
    assert gone is b and b.output_ids == [10, 11, 11, 11, 11] and sched.num_preempted == 2
    while sched.get("a") is not None:
        step(sched)
    assert a.state == DecodeState.FINISHED and len(a.output_ids) == 8
    assert sched.pool.allocator.num_used == 0 and not sched.requests


def test_the_latest_arrival_is_preempted_not_the_latest_admission():
    """A request re-prefilled after a preemption is admitted last but arrived first (its
    priority is its first arrival at the router): the newer arrival goes instead."""
    sched = make_scheduler(num_pages=5)
    for rid, prompt_len, arrival in (("a", 4, 1.0), ("new", 5, 3.0), ("again", 5, 2.0)):
        request, reason = sched.reserve(rid, 7, prompt_len, params(8), 0.0, priority=arrival)
        assert request is not None, reason
        assert sched.kv_ready(rid, 10, 0.0, decode_timeout=100.0) == []
    assert step(sched) == ["a", "again"]  # a's page came from "new", admitted before "again"
    (gone,) = sched.take_preempted()
    assert gone.request_id == "new" and sched.get("again").state == DecodeState.RUNNING


def test_a_request_whose_kv_is_arriving_is_never_preempted():
    sched = make_scheduler(num_pages=3)
    admit(sched, "running", 4, max_new=8)  # 1 page, needs a second at its first step
    awaiting = reserve(sched, "awaiting", 8, max_new=4)  # 2 pages, lent to the receiver
    assert step(sched) == []  # the only runnable request gives its page back, not "awaiting"
    (gone,) = sched.take_preempted()
    assert gone.request_id == "running" and awaiting.state == DecodeState.AWAITING_KV
    assert len(awaiting.table.pages) == 2 and sched.pool.allocator.num_used == 2
    sched.kv_ready("awaiting", 10, 0.0, 100.0)
    while sched.get("awaiting") is not None:  # it runs once its KV is in
        step(sched)
    assert awaiting.state == DecodeState.FINISHED and sched.pool.allocator.num_used == 0


def test_a_ready_request_outside_the_batch_is_preempted_before_the_batch():
    sched = make_scheduler(num_pages=3, max_batch=1)
    admit(sched, "a", 4, max_new=8)
    ready = admit(sched, "b", 8, max_new=4)  # 2 pages; no batch slot for it
    assert step(sched) == ["a"]
    assert sched.take_preempted() == [ready] and ready.state == DecodeState.PREEMPTED


def test_worst_case_mode_never_grows_nor_preempts():
    sched = make_scheduler(num_pages=5, reservation="worst_case")
    a = admit(sched, "a", 4, max_new=8)  # 12 tokens: 3 pages
    request, reason = sched.reserve("b", 7, 5, params(8), now=0.0)
    assert request is None and "no room" in reason
    while sched.get("a") is not None:
        step(sched)
        assert len(a.table.pages) in (3, 0)
    assert sched.num_preempted == 0 and sched.pool.allocator.num_used == 0


def test_preempted_is_terminal():
    sched = make_scheduler(num_pages=2)
    request = admit(sched, "a", 4, max_new=4)  # 8 tokens at most: 2 pages
    reserve(sched, "b", 4, max_new=4)
    step(sched)
    assert sched.take_preempted() == [request]
    for state in (DecodeState.RUNNING, DecodeState.FINISHED, DecodeState.FAILED):
        with pytest.raises(RuntimeError):
            request.advance(state)
    assert sched.abort("a") is None  # gone from the scheduler: nothing to free twice


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_the_books_and_returns_every_page(seed):
    """Reservations, KV arrivals, aborts and steps in random order on a small pool: held pages
    are exactly the live requests' pages, every batch member has room for its position, victims
    are always the newest runnable request and never one awaiting KV, and aborting what is left
    brings the pool back to empty."""
    rng = random.Random(seed)
    sched = make_scheduler(num_pages=12, max_batch=3, headroom=rng.choice([0, 1, 4]))
    num_reserved = 0
    for i in range(300):
        action = rng.random()
        if action < 0.25:
            rid = f"r{i}"
            request, _ = sched.reserve(rid, i, rng.randint(1, 12), params(rng.randint(1, 30)), 0.0)
            num_reserved += request is not None
        elif action < 0.45:
            waiting = [r for r in sched.requests if r.state == DecodeState.AWAITING_KV]
            if waiting:
                sched.kv_ready(rng.choice(waiting).request_id, 10, 0.0, 100.0)
        elif action < 0.5 and sched.requests:
            sched.abort(rng.choice(sched.requests).request_id)
        else:
            runnable = [
                r.request_id
                for r in sched.requests
                if r.state in (DecodeState.READY, DecodeState.RUNNING)
            ]
            step(sched, token=rng.choice([11, 12, EOS]))
            for victim in sched.take_preempted():
                assert victim.request_id == runnable.pop()  # LIFO among the runnable
        held = sum(len(r.table.pages) for r in sched.requests)
        assert sched.pool.allocator.num_used == held <= sched.pool.num_pages
    assert num_reserved > 20 and sched.num_preempted > 0  # the pool was under pressure
    for request in sched.requests:
        sched.abort(request.request_id)
    assert sched.pool.allocator.num_used == 0 and not sched.requests
