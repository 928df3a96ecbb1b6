"""The prefix cache's disk tier in a real `duet up` (1P1D): a prefill node whose pool holds eight
pages spills a prompt's pages to `disk_cache_dir` when the next prompt needs the room, is then
SIGKILLed (its pool is gone with it) and restarted by the launcher, and serves the first prompt
again from the disk tier: its six whole pages read back, none computed, and the output is
`duet generate`'s. Prefill chunks are one page (16 tokens), so a cached prefix ends on a chunk
boundary and bf16 sums run exactly as in a cold prefill."""

import os
import re
import signal

import pytest
from e2e_helpers import cluster_shorthand, generate_reference, start_cluster, wait_until

from deploy.local_cluster import dump_toml

PROMPT_A = [(7 * i + 3) % 290 + 5 for i in range(100)]  # six whole pages, then four tokens
PROMPT_B = [(11 * i + 5) % 290 + 5 for i in range(120)]  # seven pages and a part: all eight
MAX_NEW = 6
LABELS = {"node": "prefill-0", "role": "prefill"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    raw = cluster_shorthand(1, 1)
    disk = tmp_path_factory.mktemp("kv-disk")
    raw["prefill"][0].update(num_pages=8, chunk_size=16, disk_cache_dir=str(disk))
    config = tmp_path_factory.mktemp("cfg") / "1p1d-disk.toml"
    config.write_text(dump_toml(raw))
    up = start_cluster(["--config", str(config)], tmp_path_factory)
    yield up
    up.stop()


def _complete(cluster, prompt):
    out = cluster.greedy(prompt, MAX_NEW)
    return out.choices[0].text


def _prefill_pids(cluster) -> list[int]:
    return [int(pid) for pid in re.findall(r"started prefill-0 \(pid (\d+)\)", cluster.log())]


def test_a_restarted_prefill_node_serves_from_the_disk_tier(cluster):
    extra = ("--ignore-eos", "--chunk-size", "16")
    want = generate_reference("bfloat16", MAX_NEW, prompt_ids=PROMPT_A, extra=extra)["text"]
    assert _complete(cluster, PROMPT_A) == want
    _complete(cluster, PROMPT_B)  # needs all eight pages: A's six go to disk
    stored = lambda: cluster.metric("duet_prefix_cache_disk_pages_stored_total", **LABELS)  # noqa: E731
    assert wait_until(lambda: stored() == 6, 30)

    (pid,) = _prefill_pids(cluster)
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: len(_prefill_pids(cluster)) == 2, 60)  # the launcher restarted it
    assert wait_until(lambda: cluster.metric("duet_node_up", **LABELS) == 1, 120)

    assert _complete(cluster, PROMPT_A) == want
    loaded = lambda: cluster.metric("duet_prefix_cache_disk_hit_tokens_total", **LABELS)  # noqa: E731
    assert wait_until(lambda: loaded() == 96, 30)  # the six pages, from the restarted node's reads
    assert cluster.metric("duet_prefix_cache_hit_tokens_total", **LABELS) == 0  # its pool was cold
    assert cluster.metric("duet_prefix_cache_disk_hit_ratio", **LABELS) == 1.0  # 1 of 1 lookups
