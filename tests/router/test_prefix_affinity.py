"""The router's approximate per-node prefix trees and the cache-aware policy: token-level
match and insert, LRU trimming, the choice between affinity and balance, trimming to what a
node reports caching, a restarted node forgotten, and which policy a config gets."""

from router_fakes import fake_config

from control.cluster_config import ClusterConfig
from control.protocol import Heartbeat
from router.nodes import NodeState
from router.policy import CacheAwarePolicy, LeastLoadedPolicy, default_policy
from router.prefix_affinity import PrefixAffinityTree

PS = 4
SYSTEM = list(range(100, 116))  # four pages


def prefill_node(name, queued=0):
    node = NodeState(name, "prefill", f"tcp://{name}", PS, 0, queued_tokens=queued)
    return node


def test_tree_matches_the_longest_remembered_prefix():
    tree = PrefixAffinityTree()
    tree.insert([1, 2, 3, 4, 5], tick=1)
    tree.insert([1, 2, 9], tick=2)  # splits the first edge after [1, 2]
    assert tree.match([1, 2, 3, 4, 5, 6]) == 5
    assert tree.match([1, 2, 3, 7]) == 3
    assert tree.match([1, 2, 9, 9]) == 3
    assert tree.match([2]) == 0 and tree.match([]) == 0
    assert tree.num_tokens == 6  # [1, 2] + [3, 4, 5] + [9]


def test_trim_drops_least_recently_inserted_leaves_first():
    tree = PrefixAffinityTree()
    tree.insert([1, 1, 1, 1], tick=1)
    tree.insert([2, 2, 2, 2], tick=2)
    tree.insert([1, 1, 1, 1], tick=3)  # sent again: now the most recent
    tree.trim(4)
    assert tree.match([1, 1, 1, 1]) == 4 and tree.match([2, 2, 2, 2]) == 0
    tree.insert([1, 1, 5, 5], tick=4)
    tree.trim(2)  # both leaves go, then their shared parent is a leaf of 2 tokens: it stays
    assert tree.num_tokens == 2 and tree.match([1, 1, 1]) == 2
    tree.trim(0)
    assert tree.num_tokens == 0 and tree.match([1, 1]) == 0


def test_policy_prefers_the_node_that_cached_the_prefix():
    policy = CacheAwarePolicy({"a", "b"}, balance_tokens=100)
    a, b = prefill_node("a"), prefill_node("b")
    assert policy.pick_prefill([a, b], SYSTEM + [1, 2]).name == "a"  # cold: least loaded (name)
    a.queued_tokens = 18  # it is computing that prompt: b is idler, but a will have the prefix
    assert policy.pick_prefill([a, b], SYSTEM + [7, 7, 7]).name == "a"
    assert policy.cached_len(a, SYSTEM + [7]) == 16 and policy.cached_len(b, SYSTEM) == 0
    assert policy.pick_prefill([a, b], [5, 5, 5, 5, 5]).name == "b"  # no prefix: least loaded


def test_policy_gives_up_affinity_when_the_queue_is_too_long():
    policy = CacheAwarePolicy({"a", "b"}, balance_tokens=100)
    a, b = prefill_node("a"), prefill_node("b")
    policy.pick_prefill([a, b], SYSTEM + [1])
    a.queued_tokens = 101  # more than balance_tokens beyond b's
    assert policy.pick_prefill([a, b], SYSTEM + [2]).name == "b"
    a.queued_tokens = 100  # within: affinity wins again (b now has the prefix too: tie -> load)
    b.queued_tokens = 0
    policy.trees["b"].clear()
    assert policy.pick_prefill([a, b], SYSTEM + [3]).name == "a"


def test_match_counts_whole_pages_below_the_last_token():
    policy = CacheAwarePolicy({"a"}, balance_tokens=100)
    a = prefill_node("a")
    policy.pick_prefill([a], SYSTEM)
    assert policy.cached_len(a, SYSTEM) == 12  # the node computes at least the last token
    assert policy.cached_len(a, SYSTEM[:7]) == 4
    assert policy.cached_len(a, SYSTEM[:3]) == 0


def test_nodes_without_a_cache_are_paired_by_load_alone():
    policy = CacheAwarePolicy({"a"}, balance_tokens=100)
    a, b = prefill_node("a", queued=50), prefill_node("b")
    assert policy.pick_prefill([a, b], SYSTEM).name == "b"  # least loaded; b keeps no tree
    assert "b" not in policy.trees and policy.cached_len(b, SYSTEM) == 0
    assert policy.pick_prefill([a, b], SYSTEM).name == "b"


def _heartbeat(node, cached_tokens, lookups):
    node.heartbeat = Heartbeat(
        node.name, "prefill", num_prefix_cached_tokens=cached_tokens, num_prefix_lookups=lookups
    )


def test_heartbeats_trim_the_tree_to_what_the_node_caches():
    policy = CacheAwarePolicy({"a"}, balance_tokens=100)
    a = prefill_node("a")
    policy.pick_prefill([a], [1] * 8)
    policy.pick_prefill([a], [2] * 8)
    policy.pick_prefill([a], [3] * 9)  # 8 of it is whole pages
    assert policy.trees["a"].num_tokens == 24
    a.queued_tokens = 9  # the last prompt is still being computed: it is not trimmed
    _heartbeat(a, cached_tokens=8, lookups=2)
    policy.observe_heartbeat(a)
    tree = policy.trees["a"]
    assert tree.num_tokens == 16  # the oldest went: the node kept 8 tokens, 8 are in flight
    assert tree.match([1] * 8) == 0 and tree.match([2] * 8) == 8 and tree.match([3] * 8) == 8
    # The node restarted (its counters went back): everything it had is gone.
    _heartbeat(a, cached_tokens=100, lookups=0)
    policy.observe_heartbeat(a)
    assert policy.trees["a"].num_tokens == 0


def test_the_default_policy_follows_the_prefill_nodes_cache_setting():
    cfg = fake_config(num_prefill=2)
    policy = default_policy(cfg)
    assert isinstance(policy, CacheAwarePolicy) and set(policy.trees) == {"p0", "p1"}
    assert policy.balance_tokens == cfg.router.cache_balance_tokens
    raw = {
        "prefill": [{"name": "p", "prefix_cache": False}],
        "decode": [{"name": "d"}],
    }
    assert isinstance(default_policy(ClusterConfig.from_dict(raw)), LeastLoadedPolicy)
