"""Two routers in front of one prefill and one decode node (`duet up --routers 2`, tiny model,
float32, loopback); router 1 is SIGKILLed with 16 streams in flight, 8 on each router.

Its 8 clients see their connections drop; router 0's 8 streams all end with their full greedy
completion (equal to `duet generate`); the decode node drops router 1's 8 reservations (its
lease lapsed, or the supervisor's new router 1 announced itself) and keeps router 0's; every KV
page comes back and the prefill node ends holding nothing; the new router 1 serves. No timing luck: the prefill node is frozen (SIGSTOP) until the kill, so all
16 requests are reserved on the decode node and queued on the prefill node when it comes, and
every wait is a bounded wait on a condition.
"""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest

from tests.e2e.e2e_helpers import (
    free_port_pair,
    generate_reference,
    start_cluster,
)
from tests.e2e.e2e_helpers import wait_until as _wait
from tests.faults.fault_helpers import (
    MAX_NEW,
    Streams,
    assert_all_match,
    child_pids,
    decode_pages_used,
    fault_config,
)

PROMPTS = [f"Request {i}: tell me about the river" for i in range(8)]
# A node silent for 30 s is dead (the frozen prefill node is not); a router silent for 2 s has
# lost its requests on the nodes.
TIMEOUTS = {"heartbeat_s": 0.25, "node_timeout_s": 30.0, "lease_s": 2.0, "reserve_s": 60.0}


@pytest.fixture(scope="module")
def references():
    return {p: generate_reference("float32", MAX_NEW, prompt=p)["text"] for p in PROMPTS}


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "two-routers.toml"
    fault_config(path, 1, 1, TIMEOUTS, control_port=free_port_pair(), replicas=2)
    port = free_port_pair()
    up = start_cluster(["--config", str(path)], tmp_path_factory, port=port)
    up.router1 = f"http://127.0.0.1:{port + 1}"
    yield up
    up.stop()


def _ready(url: str) -> bool:
    body = httpx.get(url + "/health", timeout=5).json()
    return body["status"] == "ok" and all(n["status"] == "ready" for n in body["nodes"].values())


def _sent_to_prefill(up, url: str) -> float:
    return up.metric("duet_node_requests_total", url, node="prefill-0", role="prefill")


def _prefill_queued(up) -> float:
    return up.metric("duet_node_queued_tokens", node="prefill-0", role="prefill")


def test_both_routers_see_every_node(up):
    for url in (up.url, up.router1):
        body = httpx.get(url + "/v1/cluster", timeout=10).json()
        assert {n["name"]: n["status"] for n in body["nodes"]} == {
            "prefill-0": "ready",
            "decode-0": "ready",
        }
    assert "duet up: router 1 at " + up.router1 + "/v1" in up.log()


def test_a_router_killed_under_load_ends_only_its_own_streams(up, references):
    assert _wait(lambda: _ready(up.url) and _ready(up.router1), 60)
    pids = child_pids(up)
    prefill, router1 = pids["prefill-0"], pids["router-1"]
    before = [_sent_to_prefill(up, url) for url in (up.url, up.router1)]
    os.kill(prefill, signal.SIGSTOP)
    try:
        mine = Streams(up, PROMPTS)
        theirs = Streams(up, [p + "!" for p in PROMPTS], max_tokens=400, url=up.router1)
        # Reserved on the decode node, Prefill sent: every request of both routers is in.
        assert _wait(lambda: _sent_to_prefill(up, up.url) == before[0] + 8, 30)
        assert _wait(lambda: _sent_to_prefill(up, up.router1) == before[1] + 8, 30)
        os.kill(router1, signal.SIGKILL)
        lost = theirs.join()
        assert all(r[0] == "error" for r in lost.values()), lost  # connections dropped
        # The decode node drops router 1's 8 reservations once its lease lapsed (or the new
        # router 1 said it restarted); router 0's 8 stay.
        orphaned = (
            r"decode-0 WARNING aborting 8 requests: (no word from the router|the router restarted)"
        )
        assert _wait(lambda: re.search(orphaned, up.log()), 30), up.log()[-3000:]
    finally:
        os.kill(prefill, signal.SIGCONT)
    # Thawed, the prefill node finds router 1 gone (its lease, or the new router 1) or its
    # requests refused by the decode node (kv_cancel): it ends holding nothing.
    assert_all_match(mine.join(), references)
    assert _wait(lambda: _prefill_queued(up) == 0, 30)
    assert _wait(lambda: all(u == 0 for u in decode_pages_used(up)), 30), decode_pages_used(up)
    # The supervisor restarted router 1, which serves again.
    assert _wait(lambda: "router-1 exited with status -9; restarting" in up.log(), 30)
    assert _wait(lambda: _ready(up.router1), 120)
    out = httpx.post(
        up.router1 + "/v1/completions",
        json={"model": "tiny-model", "prompt": PROMPTS[0], "max_tokens": MAX_NEW,
              "temperature": 0},
        timeout=60,
    ).json()  # fmt: skip
    assert out["choices"][0]["text"] == references[PROMPTS[0]]
