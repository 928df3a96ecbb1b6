"""Decode-side prefix reuse in a real 1P2D `duet up --decode-prefix-cache`: a conversation's turn
2 goes to the decode node that holds turn 1's prompt (the router's KV index, from the nodes' KV
events), which reserves only the rest, and the prefill node sends only the rows after what it
holds; the output equals `duet generate`. When that decode node dies between turns, the next
turn gets a full transfer elsewhere, and its output is still `duet generate`'s.

Prefill chunks are one page (16 tokens), so a cached prefix ends on a chunk boundary and bf16
sums run exactly as in a cold prefill (tests/e2e/test_prefix_cache_cluster.py)."""

import os
import signal

import httpx
import pytest
from e2e_helpers import cluster_shorthand, generate_reference, start_cluster, wait_until

from deploy.local_cluster import dump_toml

SYSTEM = [(7 * i + 3) % 290 + 5 for i in range(96)]  # six pages of 16
MAX_NEW = 8
DECODE = ("decode-0", "decode-1")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    raw = cluster_shorthand(1, 2)
    raw["prefill"][0]["chunk_size"] = 16
    config = tmp_path_factory.mktemp("cfg") / "1p2d-reuse.toml"
    config.write_text(dump_toml(raw))
    up = start_cluster(["--config", str(config), "--decode-prefix-cache"], tmp_path_factory)
    yield up
    up.stop()


def _reference(prompt: list[int]) -> dict:
    extra = ("--ignore-eos", "--chunk-size", "16")
    return generate_reference("bfloat16", MAX_NEW, prompt_ids=prompt, extra=extra)


def _complete(cluster, prompt: list[int]) -> str:
    out = cluster.greedy(prompt, MAX_NEW)
    return out.choices[0].text


def _decode_figure(cluster, name: str) -> dict[str, float]:
    return {node: cluster.metric(name, node=node, role="decode") for node in DECODE}


def _skipped(cluster) -> float:
    return cluster.metric("duet_kv_rows_skipped_total", node="prefill-0", role="prefill")


def _index(cluster) -> dict:
    response = httpx.get(cluster.url + "/v1/kv_index/summary", timeout=10)
    response.raise_for_status()
    return response.json()["nodes"]


def test_turn_two_reuses_the_decode_nodes_kv_and_then_survives_its_death(cluster):
    turn1 = SYSTEM + [11, 12, 13, 14, 15]  # 101 tokens: six whole pages
    first = _reference(turn1)
    assert _complete(cluster, turn1) == first["text"]
    # The decode node that served it published the six pages; the index lists them.
    assert wait_until(
        lambda: sum(e["pages"] for n, e in _index(cluster).items() if n in DECODE) == 6, 30
    )
    (holder,) = [n for n, e in _index(cluster).items() if n in DECODE and e["pages"] == 6]

    turn2 = turn1 + first["token_ids"] + [200, 201, 202]  # 112 tokens
    second = _reference(turn2)
    assert _complete(cluster, turn2) == second["text"]
    assert wait_until(lambda: _skipped(cluster) == 96, 30)  # the six pages D held: not sent
    hits = lambda: _decode_figure(cluster, "duet_prefix_cache_hit_tokens_total")  # noqa: E731
    assert wait_until(lambda: sum(hits().values()) == 96, 30)  # D's heartbeat after turn 2
    assert hits()[holder] == 96  # turn 2 went to the holder
    summary = _index(cluster)[holder]
    assert summary["role"] == "decode" and summary["pages"] == 7  # turn 2's seven whole pages
    assert summary["hits"] == 1 and summary["hit_tokens"] == 96

    # The holder dies between turns: turn 3 goes to the other decode node (or to the holder
    # restarted, its cache empty), whole.
    os.kill(cluster.child_pids[holder], signal.SIGKILL)
    turn3 = turn2 + second["token_ids"] + [42, 43]
    third = _reference(turn3)
    assert _complete(cluster, turn3) == third["text"]
    lookups = lambda: cluster.metric(  # noqa: E731
        "duet_prefix_cache_lookups_total", node="prefill-0", role="prefill"
    )
    assert wait_until(lambda: lookups() == 3, 30)  # P's heartbeat after turn 3
    assert _skipped(cluster) == 96  # nothing more skipped: a full transfer
