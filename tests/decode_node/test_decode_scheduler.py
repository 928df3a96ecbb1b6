"""DecodeScheduler with hand-made tokens: admission by free pages, continuous batching, stop
rules (the same as OfflineGenerator's), and pages freed on every path."""

import pytest
import torch

from control.sampling_params import SamplingParams
from decode_node.scheduler import DecodeScheduler, DecodeState, StepOutput
from model.kv_pool import KVPool

EOS = 2
MAX_POS = 64


def make_scheduler(num_pages=32, page_size=4, max_batch=2, max_requests=0):
    """In worst_case reservation (the old rule: these tests pin it down unchanged); on-demand
    reservation and preemption: test_preemption_scheduler.py."""
    pool = KVPool(1, num_pages, page_size, 1, torch.float32)
    return DecodeScheduler(
        pool, max_batch, MAX_POS, frozenset({EOS}), max_requests, reservation="worst_case"
    )


def params(max_new=8, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, **kw)


def admit(sched, rid, prompt_len=5, first=10, now=0.0, **kw):
    request, reason = sched.reserve(rid, 7, prompt_len, params(**kw), now)
    assert request is not None, reason
    assert sched.kv_ready(rid, first, now, decode_timeout=100.0) == []
    return request


def step(sched, tokens_by_id):
    batch = sched.schedule()
    ids = [r.request_id for r in batch]
    outs = sched.update(batch, [tokens_by_id[i] for i in ids])
    return ids, outs


def test_reserve_takes_pages_for_prompt_and_all_new_tokens():
    sched = make_scheduler(page_size=4)
    request, reason = sched.reserve("a", 7, 10, params(max_new=7), now=0.0)
    assert reason == "" and request.state == DecodeState.AWAITING_KV
    assert request.num_reserved == 17 and sched.pool.allocator.num_used == 5
    # Clipped to the context: a 60-token prompt can only ever hold 64 positions.
    long, _ = sched.reserve("b", 7, 60, params(max_new=100), now=0.0)
    assert long.num_reserved == MAX_POS and len(long.table.pages) == 16


@pytest.mark.parametrize(
    "setup, prompt_len, match",
    [
        ("full", 5, "no room: needs 3 KV pages, 1 free"),
        ("dup", 5, "already"),
        ("none", 64, "does not fit the context"),
        ("none", 0, "does not fit the context"),
        ("many", 5, "too many requests"),
    ],
)
def test_refusals_say_why_and_take_nothing(setup, prompt_len, match):
    sched = make_scheduler(num_pages=4, page_size=4, max_batch=1, max_requests=2)
    if setup == "full":
        sched.reserve("x", 1, 8, params(max_new=4), now=0.0)  # 3 of 4 pages
    if setup in ("dup", "many"):
        sched.reserve("a", 1, 1, params(max_new=1), now=0.0)
        sched.reserve("b", 1, 1, params(max_new=1), now=0.0)
    used = sched.pool.allocator.num_used
    rid = "a" if setup == "dup" else "new"
    request, reason = sched.reserve(rid, 7, prompt_len, params(max_new=4), now=0.0)
    assert request is None and match in reason
    assert sched.pool.allocator.num_used == used


def test_requests_join_and_leave_the_batch_at_every_step():
    sched = make_scheduler(max_batch=2)
    admit(sched, "a", max_new=3)  # first token + 2 decoded
    admit(sched, "b", max_new=5)
    admit(sched, "c", max_new=2)
    ids, outs = step(sched, {"a": 11, "b": 21})
    assert ids == ["a", "b"] and sched.get("c").state == DecodeState.READY  # batch is full
    assert outs == [StepOutput("a", [11], None), StepOutput("b", [21], None)]
    ids, outs = step(sched, {"a": 12, "b": 22})
    assert outs[0] == StepOutput("a", [12], "length") and sched.get("a") is None
    ids, outs = step(sched, {"b": 23, "c": 31})  # c joins the step a left
    assert ids == ["b", "c"] and outs[1] == StepOutput("c", [31], "length")
    ids, outs = step(sched, {"b": 24})
    assert ids == ["b"] and outs == [StepOutput("b", [24], "length")]
    assert sched.pool.allocator.num_used == 0 and not sched.requests


def test_positions_follow_the_outputs():
    sched = make_scheduler()
    request = admit(sched, "a", prompt_len=5, first=10)
    assert request.next_position == 5  # the first token sits at position 5
    step(sched, {"a": 11})
    assert request.next_position == 6 and request.output_ids == [10, 11]
    assert request.table.capacity >= request.next_position + 1


def test_stop_on_eos_and_stop_ids_unless_ignored():
    sched = make_scheduler(max_batch=4)
    admit(sched, "eos")
    admit(sched, "stopid", stop_token_ids=(42,))
    admit(sched, "ignore", ignore_eos=True)
    _, outs = step(sched, {"eos": EOS, "stopid": 42, "ignore": EOS})
    assert [o.finish_reason for o in outs] == ["stop", "stop", None]
    assert outs[0].token_ids == [EOS]  # the stop token itself is reported, as offline


def test_first_token_can_end_the_request_without_decoding():
    sched = make_scheduler()
    for rid, first, kw, reason in [
        ("eos", EOS, {}, "stop"),
        ("one", 10, {"max_new": 1}, "length"),
    ]:
        sched.reserve(rid, 7, 5, params(**kw), now=0.0)
        out = sched.kv_ready(rid, first, now=0.0, decode_timeout=10.0)
        assert out == [StepOutput(rid, [], reason)]
    edge, _ = sched.reserve("edge", 7, MAX_POS - 1, params(), now=0.0)  # context end
    assert sched.kv_ready("edge", 10, 0.0, 10.0) == [StepOutput("edge", [], "length")]
    assert sched.schedule() == [] and sched.pool.allocator.num_used == 0


def test_context_end_stops_with_length():
    sched = make_scheduler()
    admit(sched, "a", prompt_len=MAX_POS - 3, max_new=100)
    _, outs = step(sched, {"a": 11})
    assert outs[0].finish_reason is None
    _, outs = step(sched, {"a": 12})
    assert outs[0].finish_reason == "length"  # position MAX_POS - 1 holds the last token


def test_abort_and_kv_failure_free_pages_in_every_state():
    sched = make_scheduler(max_batch=1)
    sched.reserve("awaiting", 7, 5, params(), now=0.0)
    sched.reserve("failed_kv", 7, 5, params(), now=0.0)
    admit(sched, "running")
    admit(sched, "ready")
    sched.schedule()
    assert sched.get("running").state == DecodeState.RUNNING
    assert sched.get("ready").state == DecodeState.READY
    for rid in ("awaiting", "running", "ready"):
        request = sched.abort(rid, "client gone")
        assert request.state == DecodeState.FAILED and request.error == "client gone"
    failed = sched.kv_failed("failed_kv", "incomplete")
    assert failed.state == DecodeState.FAILED and not failed.output_ids
    assert sched.abort("running") is None
    assert sched.pool.allocator.num_used == 0 and not sched.requests


def test_a_request_aborted_mid_step_is_not_updated():
    sched = make_scheduler()
    admit(sched, "a")
    batch = sched.schedule()
    sched.abort("a")
    assert sched.update(batch, [11]) == []


def test_expire_fails_requests_that_decode_too_long():
    sched = make_scheduler()
    sched.reserve("slow", 7, 5, params(), now=0.0)
    sched.kv_ready("slow", 10, now=0.0, decode_timeout=5.0)
    sched.reserve("waiting_kv", 7, 5, params(), now=0.0)  # the receiver times transfers out
    assert sched.expire(now=4.0) == []
    (late,) = sched.expire(now=6.0)
    assert late.request_id == "slow" and late.state == DecodeState.FAILED
    assert sched.get("waiting_kv") is not None


def test_state_only_moves_forward():
    sched = make_scheduler()
    request = admit(sched, "a")
    with pytest.raises(RuntimeError):
        request.advance(DecodeState.AWAITING_KV)
    sched.abort("a")
    with pytest.raises(RuntimeError):
        request.advance(DecodeState.RUNNING)


def test_running_requests_hold_distinct_slots_given_back_on_every_path():
    """The slot is the row of the node's per-slot sampling state: never shared while running,
    free again after finish, abort or expiry, and `is_joining` only in the first step."""
    sched = make_scheduler(max_batch=3, num_pages=64)
    for rid in "abc":
        admit(sched, rid, max_new=3)
    batch = sched.schedule()
    assert sorted(r.slot for r in batch) == [0, 1, 2] and all(r.is_joining for r in batch)
    sched.update(batch, [11, 12, 13])
    assert not any(r.is_joining for r in sched.schedule())
    b, c = sched.get("b"), sched.get("c")
    sched.abort("a")  # its slot back
    admit(sched, "d", max_new=5)
    d = next(r for r in sched.schedule() if r.request_id == "d")
    assert d.slot not in (b.slot, c.slot) and d.is_joining
    sched.update(sched.schedule(), [14, 15, 16])  # b and c finish by length
    assert b.slot == c.slot == -1 and sched.get("b") is None
    admit(sched, "e", now=0.0)
    admit(sched, "f", now=0.0)
    running = sched.schedule()
    assert len({r.slot for r in running}) == 3 and all(0 <= r.slot < 3 for r in running)
    assert [r.request_id for r in sched.expire(1000.0)] == ["d", "e", "f"]
    assert sorted(sched._free_slots) == [0, 1, 2]


def test_batch_cap_holds_newcomers_in_ready_and_never_pauses_running():
    sched = make_scheduler(max_batch=4)
    for rid in "abc":
        admit(sched, rid, max_new=3)
    assert [r.request_id for r in sched.schedule(batch_cap=1)] == ["a"]  # oldest first
    assert sched.count(DecodeState.READY) == 2
    sched.update(sched.requests[:1], [11])
    assert [r.request_id for r in sched.schedule(batch_cap=2)] == ["a", "b"]
    # A tighter cap than the running count pauses no one (they keep their slots).
    assert [r.request_id for r in sched.schedule(batch_cap=1)] == ["a", "b"]
    assert sched.get("c").state == DecodeState.READY
    # Never below one: a cap of 0 still runs a request.
    other = make_scheduler(max_batch=4)
    admit(other, "x")
    assert [r.request_id for r in other.schedule(batch_cap=0)] == ["x"]


def test_requests_waiting_under_a_cap_all_finish():
    sched = make_scheduler(max_batch=4)
    for rid in "abc":
        admit(sched, rid, max_new=3)
    finished, max_batch_seen = {}, 0
    for _ in range(20):
        batch = sched.schedule(batch_cap=1)
        if not batch:
            break
        max_batch_seen = max(max_batch_seen, len(batch))
        for out in sched.update(batch, [11] * len(batch)):
            if out.finish_reason:
                finished[out.request_id] = out.finish_reason
    assert finished == {"a": "length", "b": "length", "c": "length"}
    assert max_batch_seen == 1 and sched.pool.allocator.num_used == 0
