"""`duet up --autoscale` (router.autoscaler) under a load it cannot keep up with: the only prefill
node is frozen (SIGSTOP) while requests queue on it, so its queued prompt tokens stay above the
up mark; the router starts a second prefill node, which joins and serves the requests that come
next while the first is still frozen. Once the first is thawed and everything is done, the lull
drains the started node and the router forgets it. Every request completes, whole: nothing is
lost scaling up or down; those prefilled alone give `duet generate`'s output (the thawed node
prefills its queue as one batch, whose bf16 sums may round otherwise on this random model).
Deterministic: the freeze, not the speed of this machine, makes the load."""

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from e2e_helpers import cluster_shorthand, generate_reference, start_cluster, wait_until

from deploy.local_cluster import dump_toml

PROMPTS = [" ".join(f"word{i}x{j}" for j in range(60)) for i in range(5)]
MAX_NEW = 8
EXTRA = ("--threads", "1", "--ignore-eos")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    raw = cluster_shorthand(1, 1)
    raw["timeouts"] = {"node_timeout_s": 120.0, "lease_s": 240.0}  # the freeze is no death
    raw["autoscale"] = {
        "max_prefill": 2,
        "max_decode": 1,
        "interval_s": 0.25,
        "sustain_s": 0.5,
        "idle_s": 2.0,
        "cooldown_s": 1.0,
        "prefill_up_tokens": 100,
    }
    config = tmp_path_factory.mktemp("cfg") / "autoscale.toml"
    config.write_text(dump_toml(raw))
    up = start_cluster(["--config", str(config), "--autoscale"], tmp_path_factory)
    yield up
    up.stop()


def _nodes(cluster) -> dict[str, dict]:
    body = httpx.get(cluster.url + "/v1/cluster", timeout=10).json()
    return {n["name"]: n for n in body["nodes"]}


def _complete(cluster, prompt) -> str:
    out = cluster.greedy(prompt, MAX_NEW)
    assert out.usage.completion_tokens == MAX_NEW and out.choices[0].finish_reason == "length"
    return out.choices[0].text


def test_capacity_follows_the_load_and_nothing_is_lost(cluster):
    want = [generate_reference("bfloat16", MAX_NEW, prompt=p, extra=EXTRA)["text"] for p in PROMPTS]
    prefill = cluster.child_pids["prefill-0"]
    pool = ThreadPoolExecutor(len(PROMPTS))
    os.kill(prefill, signal.SIGSTOP)
    try:
        queued = [pool.submit(_complete, cluster, p) for p in PROMPTS[:3]]
        started = lambda: [n for n in _nodes(cluster) if n.startswith("auto-prefill")]  # noqa: E731
        assert wait_until(
            lambda: started() and _nodes(cluster)[started()[0]]["status"] == "ready", 120
        )
        (name,) = started()
        # served by the started node, one after the other, while the first is still frozen
        assert [_complete(cluster, p) for p in PROMPTS[3:]] == want[3:]
        assert cluster.metric("duet_node_requests_total", node=name, role="prefill") == 2
        assert not any(f.done() for f in queued)
    finally:
        os.kill(prefill, signal.SIGCONT)
    assert all(f.result(timeout=120) for f in queued)  # whole (checked in _complete)
    pool.shutdown()
    assert wait_until(lambda: name not in _nodes(cluster), 60)  # the lull drained it
    log = cluster.log()
    assert re.search(r"autoscale: prefill \+1 \(load \S+ >= 100 for", log)
    assert re.search(r"autoscale: prefill -1 \(load 0 <= 0 for", log)
    assert f"node {name} (prefill) left the cluster" in log
    decisions = "duet_autoscale_decisions_total"  # (labels as the exposition sorts them)
    ups = cluster.metric(decisions, direction="up", role="prefill")
    downs = cluster.metric(decisions, direction="down", role="prefill")
    assert (ups, downs) == (1, 1)
    assert _complete(cluster, PROMPTS[0]) == want[0]  # the config's node serves on
