"""Decode-side prefix reuse through a prefill and a decode node (in-process): turn 2 of a
conversation reserves on D with its whole prompt, D says how many leading rows it still holds
from turn 1 (`ReserveReply.cached_rows`), P sends only the rest, and the output is the offline
generator's, greedy and seeded. Plus the KV events of both caches.

P's pages and chunks are 4 tokens (a cached prefix ends on a chunk boundary, so P's rows are the
offline generator's bit for bit, as in test_pd_prefix.py); D's pages are 5 tokens, so what D
holds is cut at its own page boundaries."""

import pytest
from pd_harness import Pair

from control.kv_events import page_hashes
from control.sampling_params import SamplingParams
from runtime.generate import OfflineGenerator

SYSTEM = [3, 44, 18, 250, 9, 71, 130, 5, 66, 301, 12, 40, 77, 8, 19, 23, 31]  # 17 tokens
PAIR = {"p_page_size": 4, "chunk_size": 4, "max_batch_tokens": 4, "d_page_size": 5}


def greedy(max_new=6):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)


def seeded(max_new=6, seed=1234):
    return SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=max_new, seed=seed)


@pytest.fixture(scope="module")
def offline(model):
    generator = OfflineGenerator(model, page_size=16, chunk_size=4)
    return lambda prompt, params: generator.generate(list(prompt), params).token_ids


@pytest.fixture
def pair(model):
    pair = Pair(model, **PAIR, d_prefix_cache=True)
    yield pair
    pair.close()


def rows_received(pair) -> int:
    return pair.decode.receiver.stats().bytes_written // pair.decode.pool.bytes_per_token


@pytest.mark.parametrize("params", [greedy(), seeded()], ids=["greedy", "seeded"])
def test_turn_two_receives_only_the_rows_after_what_decode_holds(pair, offline, params):
    turn1 = SYSTEM + [5, 6, 7]  # 20 tokens: D keeps 4 whole pages of 5
    assert pair.submit("t1", turn1, params).cached_rows == 0
    pair.run_all()
    assert pair.seen["t1"].output == offline(turn1, params)
    assert rows_received(pair) == 20
    assert pair.decode.prefix_cache.num_cached_tokens == 20

    turn2 = turn1 + pair.seen["t1"].output + [100, 200, 300]  # 29 tokens
    reply = pair.submit("t2", turn2, params)
    assert reply.ok and reply.cached_rows == 20
    pair.run_all()
    seen = pair.seen["t2"]
    assert not seen.errors and seen.output == offline(turn2, params)
    assert rows_received(pair) == 20 + 9  # the 9 rows after the 20 D held
    assert pair.prefill.kv_rows_sent == 20 + 9 and pair.prefill.kv_rows_skipped == 20
    cache = pair.decode.prefix_cache
    assert (cache.num_lookups, cache.num_hits, cache.num_hit_tokens) == (2, 1, 20)
    assert cache.num_cached_tokens == 25  # turn 2's five whole pages
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0
    heartbeat = pair.decode.heartbeat()
    assert heartbeat.num_prefix_hit_tokens == 20 and heartbeat.kv_rows_received == 29
    assert heartbeat.free_pages == pair.decode.pool.num_pages  # cached pages are evictable


def test_a_prompt_shorter_than_a_page_of_what_is_held_gets_every_row(pair, offline):
    assert pair.submit("long", SYSTEM + [1, 2, 3], greedy(2)).ok
    pair.run_all()
    prompt = SYSTEM[:4]  # inside D's first page: no whole page of it is held
    reply = pair.submit("short", prompt, greedy())
    assert reply.cached_rows == 0
    pair.run_all()
    assert pair.seen["short"].output == offline(prompt, greedy())


def test_forks_share_the_cached_prefix(pair, offline):
    turn1 = SYSTEM + [5, 6, 7]
    assert pair.submit("t1", turn1, greedy(2)).ok
    pair.run_all()
    params = SamplingParams(temperature=0.9, max_new_tokens=4, seed=7, n=3)
    turn2 = turn1 + [8, 9, 10, 11]
    reply = pair.submit("t2", turn2, params)
    assert reply.cached_rows == 20
    pair.run_all()
    expected = OfflineGenerator(pair.model, page_size=16, chunk_size=4)
    for index, rid in enumerate(["t2", "t2/1", "t2/2"]):
        want = expected.generate(turn2, params.for_sequence(index)).token_ids
        assert pair.seen[rid].output == want, rid
    assert pair.decode_pages_used == 0


def test_an_abort_while_the_rest_arrives_keeps_the_cache_and_frees_the_request(pair):
    turn1 = SYSTEM + [5, 6, 7]
    assert pair.submit("t1", turn1, greedy(2)).ok
    pair.run_all()
    reply = pair.submit("t2", turn1 + [8, 9, 10, 11, 12, 13], greedy())
    assert reply.cached_rows == 20
    pair.abort("t2", prefill=False)
    pair.settle()
    cache = pair.decode.prefix_cache
    assert cache.num_cached_tokens == 20  # nothing of t2's (its KV never completed) was cached
    assert pair.decode_pages_used == 0
    assert cache.clear() == 4 and pair.decode.pool.allocator.num_used == 0  # no lock left


def test_both_caches_publish_what_they_store_and_evict(pair):
    prompt = SYSTEM + [5, 6, 7]
    assert pair.submit("t1", prompt, greedy(2)).ok
    pair.run_all()
    by_node = {"p": [], "d": []}
    for event in pair.kv_events:
        assert not event.removed and not event.cleared
        by_node[event.node] += event.stored
    assert by_node["p"] == page_hashes(prompt, 4)  # P: 5 whole pages of 4
    assert by_node["d"] == page_hashes(prompt, 5)  # D: 4 whole pages of 5
    pair.kv_events.clear()
    pair.decode.prefix_cache.clear()
    pair.collect()
    (event,) = pair.kv_events
    assert event.node == "d" and event.page_size == 5
    assert sorted(event.removed) == sorted(page_hashes(prompt, 5))


def test_a_prompt_the_decode_node_holds_whole_moves_no_row(pair, offline):
    prompt = SYSTEM + [5, 6, 7]  # 20 tokens: exactly D's four pages
    assert pair.submit("first", prompt, greedy(2)).ok
    pair.run_all()
    reply = pair.submit("again", prompt, greedy())
    assert reply.cached_rows == 20
    pair.run_all()
    assert pair.seen["again"].output == offline(prompt, greedy())
    assert rows_received(pair) == 20  # the first request's only
    assert pair.decode_pages_used == 0
