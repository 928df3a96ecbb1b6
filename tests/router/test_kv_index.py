"""The router's exact KV index (router.kv_index) and the cache-aware policy over it: events
applied in order, matches of leading whole pages by chained names, a node's entries gone when it
restarts, bounded memory under churn, the summary; prefill and decode pairing by what the nodes
hold, balanced against load."""

import random

from control.cluster_config import ClusterConfig
from control.kv_events import MAX_EVENT_HASHES, batches, page_hashes
from control.protocol import Heartbeat, KVEvents, NodeReady
from router.core import Router
from router.kv_index import KVIndex, kv_index_summary
from router.policy import CacheAwarePolicy, LeastLoadedPolicy, default_policy

PS = 4
PROMPT = list(range(10, 30))  # 5 pages of 4


def stored(node, names, page_size=PS, role="decode"):
    return KVEvents(node, role, page_size, stored=list(names))


def removed(node, names, page_size=PS, role="decode"):
    return KVEvents(node, role, page_size, removed=list(names))


def test_page_names_chain_over_the_prefix():
    names = page_hashes(PROMPT, PS)
    assert len(names) == 5 and len(set(names)) == 5
    assert page_hashes(PROMPT[:11], PS) == names[:2]  # a short tail page has no name
    other = page_hashes([99, *PROMPT[1:]], PS)
    assert all(a != b for a, b in zip(names, other, strict=True))  # page 0 differs: all do
    assert page_hashes(PROMPT, 5) != names[:4]
    assert [len(b) for b in batches(list(range(MAX_EVENT_HASHES + 1)))] == [MAX_EVENT_HASHES, 1]


def test_a_match_counts_the_leading_pages_held():
    index, names = KVIndex(), page_hashes(PROMPT, PS)
    assert index.match("d", PROMPT, {}) == 0
    index.apply(stored("d", names[:3]))
    assert index.match("d", PROMPT, {}) == 12
    index.apply(stored("d", names[4:]))  # page 4 without page 3: not a prefix of the prompt
    assert index.match("d", PROMPT, {}) == 12
    index.apply(removed("d", names[1:2]))
    assert index.match("d", PROMPT, {}) == 4
    assert index.match("e", PROMPT, {}) == 0


def test_events_apply_in_order_and_cleared_starts_over():
    index, names = KVIndex(), page_hashes(PROMPT, PS)
    index.apply(stored("d", names))
    index.apply(removed("d", names[3:]))
    index.apply(stored("d", names[3:4]))
    assert index.match("d", PROMPT, {}) == 16
    index.apply(KVEvents("d", "decode", PS, stored=names[:2], cleared=True))  # a snapshot
    assert index.match("d", PROMPT, {}) == 8
    summary = index.summary()["d"]
    assert summary["pages"] == 2 and summary["tokens"] == 8


def test_memory_stays_bounded_under_churn():
    index, rng = KVIndex(), random.Random(5)
    live: set[bytes] = set()
    for step in range(300):
        prompt = [rng.randrange(50) for _ in range(4 * rng.randrange(1, 9))]
        names = page_hashes(prompt, PS)
        index.apply(stored("d", names), max_pages=64)
        live.update(names)
        if step % 3 == 0:
            gone = rng.sample(sorted(live), k=min(len(live), 5))
            index.apply(removed("d", gone), max_pages=64)
            live.difference_update(gone)
        assert index.summary()["d"]["pages"] <= 64
    assert index.summary()["d"]["dropped"] > 0  # the bound was reached and held


def router_with(raw):
    return Router(ClusterConfig.from_dict(raw), eos_token_ids=[2], max_positions=512)


def ready(router, name, role, **info):
    router.handle(NodeReady(name, role, {"page_size": PS, "num_pages": 64, **info}))
    router.handle(
        Heartbeat(name, role, free_pages=64, total_pages=64, page_size=PS)
        if role == "decode"
        else Heartbeat(name, role)
    )
    return router.nodes.nodes[name]


def test_a_restarted_node_starts_with_an_empty_index():
    router = router_with({"prefill": [{"name": "p0"}], "decode": [{"name": "d0"}]})
    ready(router, "p0", "prefill")
    router.handle(stored("p0", page_hashes(PROMPT, PS), role="prefill"))
    assert router.kv_index.match("p0", PROMPT, {}) == 20
    router.handle(NodeReady("p0", "prefill", {"page_size": PS}))  # it restarted
    assert router.kv_index.match("p0", PROMPT, {}) == 0
    assert isinstance(router.policy, CacheAwarePolicy)  # prefill nodes cache by default


def test_prefill_pairing_prefers_the_node_holding_the_prompt_within_the_balance():
    p1 = {"name": "p1", "control_port": 7101}
    raw = {"prefill": [{"name": "p0"}, p1], "decode": [{"name": "d0"}]}
    raw["router"] = {"cache_balance_tokens": 100}
    router = router_with(raw)
    p0, p1 = ready(router, "p0", "prefill"), ready(router, "p1", "prefill")
    policy = router.policy
    assert policy.pick_prefill([p0, p1], PROMPT) is p0  # neither holds it: by load, then name
    router.handle(stored("p1", page_hashes(PROMPT, PS)[:4], role="prefill"))
    assert policy.cached_len(p1, PROMPT) == 16 and policy.pick_prefill([p0, p1], PROMPT) is p1
    p1.queued_tokens = 101  # too far behind the shortest queue: load wins
    assert policy.pick_prefill([p0, p1], PROMPT) is p0
    p1.queued_tokens = 0
    p0.in_flight[1] = PROMPT + [7]  # queued on p0: it will hold all five pages (less the last)
    assert policy.cached_len(p0, PROMPT) == 16  # at most len - 1 tokens, in whole pages
    assert policy.cached_len(p0, PROMPT + [1]) == 20


def test_decode_pairing_prefers_the_node_holding_the_prompt_within_the_balance():
    raw = {
        "prefill": [{"name": "p0", "prefix_cache": False}],
        "decode": [
            {"name": "d0", "prefix_cache": True},
            {"name": "d1", "prefix_cache": True, "control_port": 7201, "kv_port": 7301},
        ],
        "router": {"cache_balance_tokens": 40},
    }
    router = router_with(raw)
    assert isinstance(router.policy, CacheAwarePolicy)
    d0 = ready(router, "d0", "decode", prefix_cache=True)
    d1 = ready(router, "d1", "decode", prefix_cache=True)
    policy = router.policy
    assert [n.name for n in policy.rank_decode([d0, d1], 24, PROMPT)] == ["d0", "d1"]
    router.handle(stored("d1", page_hashes(PROMPT, PS)))
    assert [n.name for n in policy.rank_decode([d0, d1], 24, PROMPT)] == ["d1", "d0"]
    d1.reserved_pages = 14  # 56 tokens held there, 40 more than on d0: load wins
    assert [n.name for n in policy.rank_decode([d0, d1], 24, PROMPT)] == ["d0", "d1"]
    summary = kv_index_summary(router.kv_index, [d0, d1])["nodes"]
    assert list(summary) == ["d1"]  # d0 holds nothing and looked nothing up
    assert summary["d1"]["role"] == "decode" and summary["d1"]["pages"] == 5
    assert summary["d1"]["hit_ratio"] == 0.0 and summary["d1"]["kv_rows_received"] == 0


def test_without_any_cache_the_policy_is_least_loaded():
    raw = {"prefill": [{"name": "p0", "prefix_cache": False}], "decode": [{"name": "d0"}]}
    cfg = ClusterConfig.from_dict(raw)
    assert isinstance(default_policy(cfg, KVIndex()), LeastLoadedPolicy)
    assert not isinstance(default_policy(cfg, KVIndex()), CacheAwarePolicy)
