"""n > 1 through the real prefill and decode loops (in-process, float32 tiny model): one
prefill, the KV forked on the decode node into n sequences. Oracle: OfflineGenerator, where
sequence i of a request is the single request sampled by `params.for_sequence(i)` (seed + i).
Pages go back to baseline on every path: finish, abort before and after the fork, preemption."""

import pytest
from pd_harness import Pair

from control.sampling_params import SamplingParams

PROMPT = [3, 44, 18, 250, 9, 71, 130, 5, 66, 301, 12, 40, 77]  # 13 tokens: ends inside a page


def sequence_ids(rid: str, n: int) -> list[str]:
    return [rid, *(f"{rid}/{i}" for i in range(1, n))]


@pytest.mark.parametrize("d_page_size", [5, 13])  # the prompt ends inside a page / on one
def test_greedy_n3_gives_three_identical_sequences(model32, offline32, d_page_size):
    pair = Pair(model32, d_page_size=d_page_size)
    params = SamplingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True, n=3)
    assert pair.submit("g", PROMPT, params).ok
    pair.run_all()
    expected = offline32(PROMPT, params.for_sequence(0)).token_ids
    outputs = [pair.seen[rid].output for rid in sequence_ids("g", 3)]
    assert outputs == [expected] * 3
    assert all(pair.seen[rid].finish_reason == "length" for rid in sequence_ids("g", 3))
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0


def test_seeded_sequences_differ_and_each_is_its_own_seeds_continuation(model32, offline32):
    pair = Pair(model32, max_batch=2)  # 4 sequences, 2 slots: forks wait for a slot
    params = SamplingParams(
        temperature=1.0, seed=21, max_new_tokens=8, ignore_eos=True, n=4, repetition_penalty=1.2
    )
    assert pair.submit("s", PROMPT, params).ok
    pair.run_all()
    outputs = [pair.seen[rid].output for rid in sequence_ids("s", 4)]
    expected = [offline32(PROMPT, params.for_sequence(i)).token_ids for i in range(4)]
    assert outputs == expected
    assert len({tuple(o) for o in outputs}) > 1  # random sequences of 8 tokens differ
    assert pair.decode_pages_used == 0


def test_forks_share_the_prompt_pages(model32):
    """13 prompt tokens at page size 5: two whole pages shared, the third copied per fork."""
    pair = Pair(model32, d_page_size=5, kv_headroom_tokens=2)
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True, n=3)
    reply, _ = pair.reserve("f", len(PROMPT), params)
    assert reply.ok
    # The parent reserves 13 + 2 tokens (3 pages); each fork its own 15 - 10 = 5 (1 page).
    assert pair.decode_pages_used == 3 + 2 * 1
    pair.prefill_only("f", pair.decode.scheduler.get("f").room, PROMPT, params)
    pair.run_until(lambda: pair.decode.scheduler.get("f/2") is not None, "the fork")
    tables = [pair.decode.scheduler.get(rid).table.pages for rid in sequence_ids("f", 3)]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # shared
    assert len({t[2] for t in tables}) == 3  # the page the prompt ends in: one each
    allocator = pair.decode.pool.allocator
    assert allocator.num_holders(tables[0][0]) == 3
    pair.run_all()
    assert pair.decode_pages_used == 0


def test_abort_before_the_kv_frees_every_fork(model32):
    pair = Pair(model32)
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True, n=3)
    reply, _ = pair.reserve("a", len(PROMPT), params)
    assert reply.ok and pair.decode_pages_used > 0
    pair.abort("a", prefill=False)
    pair.settle()
    assert pair.decode_pages_used == 0 and pair.decode.scheduler.num_held == 0


def test_aborting_one_fork_leaves_the_others_running(model32, offline32):
    pair = Pair(model32)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, n=3)
    assert pair.submit("b", PROMPT, params).ok
    pair.run_until(lambda: len(pair.seen["b/1"].token_ids) >= 2, "the forks to decode")
    pair.abort("b/1", prefill=False)
    pair.run_until(lambda: all(pair.seen[r].finish_reason for r in ("b", "b/2")))
    expected = offline32(PROMPT, params.for_sequence(0)).token_ids
    assert pair.seen["b"].output == pair.seen["b/2"].output == expected
    assert pair.seen["b/1"].finish_reason is None
    assert pair.decode_pages_used == 0


def test_a_fork_is_preempted_alone_when_the_pool_runs_out(model32, offline32):
    """On-demand KV, 24 pages of 5: "p" (3 sequences of 13 + 30 tokens: 9 + 7 + 7 pages at
    most) and then "q" (one such sequence: 9) cannot all grow. The forks joined the node last
    (at p's KV), so a fork is the first victim; the rest finish as offline, pages back to 0."""
    pair = Pair(model32, d_page_size=5, d_num_pages=24, kv_headroom_tokens=2, max_batch=4)
    params = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True, n=3)
    assert pair.submit("p", PROMPT, params).ok
    assert pair.submit("q", PROMPT[::-1], params.for_sequence(0)).ok
    pair.run_all()
    preempted = [r for r in pair.seen if pair.seen[r].preempted is not None]
    assert preempted and set(preempted) <= {"p/1", "p/2"}
    for rid, prompt in [("p", PROMPT), ("q", PROMPT[::-1])]:
        assert pair.seen[rid].output == offline32(prompt, params.for_sequence(0)).token_ids
    expected = offline32(PROMPT, params.for_sequence(0)).token_ids
    for rid in preempted:  # what it streamed before it was dropped is the same prefix
        out = pair.seen[rid].output
        assert out == expected[: len(out)]
    assert pair.decode_pages_used == 0


def test_a_bad_fork_reservation_is_refused(model32):
    pair = Pair(model32)
    params = SamplingParams(temperature=0.0, max_new_tokens=4, n=3)
    reply, _ = pair.reserve("x", len(PROMPT), params)
    assert reply.ok
    reply, _ = pair.reserve("x/2", len(PROMPT), SamplingParams(max_new_tokens=4))
    assert not reply.ok and "already on this decode node" in reply.reason
