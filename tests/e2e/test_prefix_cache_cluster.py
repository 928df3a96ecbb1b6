"""The prefix cache in a real 2P1D `duet up` (deploy/configs/2p1d.toml): prompts sharing a long
prefix, sent twice one after another; the second time the prefill nodes report cache hits in
/metrics, and every output equals the first time's and `duet generate`'s (the decode node,
which keeps no cache, got the whole KV). Prefill chunks are one page (16 tokens), so a cached
prefix ends on a chunk boundary and bf16 sums run exactly as in the cold prefill."""

from pathlib import Path

import pytest
from e2e_helpers import free_port, free_port_pair, generate_reference, start_cluster, wait_until

from deploy.local_cluster import dump_toml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SYSTEM = [(7 * i + 3) % 290 + 5 for i in range(96)]  # six pages of 16
PROMPTS = [SYSTEM + [11, 12, 13, 14, 15], SYSTEM + [200, 201], SYSTEM + [42, 43, 44]]
MAX_NEW = 8
NODES = ("prefill-0", "prefill-1")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    raw = tomllib.loads((DEPLOY / "configs" / "2p1d.toml").read_text())
    raw["router"]["control_port"] = free_port()
    raw["prefill"][0].update(control_port=free_port_pair(), chunk_size=16)
    raw["decode"][0].update(name="decode-0", control_port=free_port(), kv_port=free_port())
    config = tmp_path_factory.mktemp("cfg") / "2p1d-prefix.toml"
    config.write_text(dump_toml(raw))
    up = start_cluster(["--config", str(config)], tmp_path_factory)
    yield up
    up.stop()


def _complete(cluster, prompt):
    out = cluster.greedy(prompt, MAX_NEW)
    return out.choices[0].text


def _total(cluster, name):
    return sum(cluster.metric(name, node=node, role="prefill") for node in NODES)


def test_a_repeated_prefix_is_served_from_the_cache_with_the_same_output(cluster):
    lookups = lambda: _total(cluster, "duet_prefix_cache_lookups_total")  # noqa: E731
    first = [_complete(cluster, p) for p in PROMPTS]
    assert wait_until(lambda: lookups() == len(PROMPTS), 30)  # a heartbeat after the first pass
    hits = _total(cluster, "duet_prefix_cache_hits_total")
    hit_tokens = _total(cluster, "duet_prefix_cache_hit_tokens_total")
    assert _total(cluster, "duet_prefix_cache_pages") >= 6
    second = [_complete(cluster, p) for p in PROMPTS]
    assert second == first
    assert wait_until(lambda: lookups() == 2 * len(PROMPTS), 30)
    # The second pass: each prompt's six system pages (its tail is under a page) from the cache.
    assert _total(cluster, "duet_prefix_cache_hits_total") == hits + len(PROMPTS)
    assert _total(cluster, "duet_prefix_cache_hit_tokens_total") == hit_tokens + 3 * len(SYSTEM)
    ratio = max(
        cluster.metric("duet_prefix_cache_hit_ratio", node=n, role="prefill") for n in NODES
    )
    assert 0 < ratio <= 1


def test_outputs_equal_duet_generate(cluster):
    for prompt in PROMPTS:
        ref = generate_reference(
            "bfloat16", MAX_NEW, prompt_ids=prompt, extra=("--ignore-eos", "--chunk-size", "16")
        )
        assert _complete(cluster, prompt) == ref["text"]


def test_usage_reports_the_prompt_tokens_served_from_the_cache(cluster):
    """OpenAI's `usage.prompt_tokens_details.cached_tokens`: the six system pages once a prompt
    sharing them was prefilled (the index sends it to the node holding them), none cold; a
    chat sent twice, its whole pages the second time."""
    cold = [3, 1, 4, 1, 5, 9, 2, 6] * 4  # shares no page with SYSTEM
    warm = SYSTEM + [77, 78]
    _complete(cluster, SYSTEM + [1])  # the system pages are cached somewhere (if not already)
    for prompt, cached in ((cold, 0), (warm, len(SYSTEM))):
        out = cluster.client().completions.create(
            model="tiny-model", prompt=prompt, max_tokens=2, temperature=0.0
        )
        assert out.usage.prompt_tokens_details.cached_tokens == cached
    messages = [{"role": "user", "content": " ".join(f"w{i}" for i in range(40))}]
    usages = [
        cluster.client()
        .chat.completions.create(
            model="tiny-model", messages=messages, max_tokens=2, temperature=0.0
        )
        .usage
        for _ in range(2)
    ]
    whole_pages = (usages[1].prompt_tokens - 1) // 16 * 16  # never the last token
    assert whole_pages > 0
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [0, whole_pages]
