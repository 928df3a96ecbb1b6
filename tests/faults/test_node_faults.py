"""Node faults under load, on real `duet up` clusters (tiny model, float32, loopback): a prefill
node SIGKILLed before its requests' first token, a decode node SIGKILLed or hung (SIGSTOP)
mid-stream, the router SIGKILLed. Requests go through the official openai client.

After every fault: each stream ended with its full greedy completion (equal to `duet generate`:
no token repeated or missing across a move) or, for the router's own death, a connection error;
the supervisor restarted what died and every node is ready again; every decode node's KV pages
are back at zero; a new request is served. No timing luck: the moment of each fault is fixed by
freezing nodes (SIGSTOP) so that the requests are where the test says they are; every wait is a
bounded wait on a condition.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.e2e_helpers import (
    alive,
    generate_reference,
    processes_mentioning,
    start_cluster,
)
from tests.e2e.e2e_helpers import wait_until as _wait
from tests.faults.fault_helpers import (
    MAX_NEW,
    Streams,
    all_ready,
    assert_all_match,
    assert_recovered,
    child_pids,
    dispatched,
    fault_config,
    signal_all,
)
from tinymodel.make import make_tiny_model

PROMPTS = [f"Request {i}: tell me about the river" for i in range(8)]
# Short heartbeats so a hung node is found in seconds; a long reserve timeout so a moved request
# can wait for a restarting node.
TIMEOUTS = {"heartbeat_s": 0.25, "node_timeout_s": 3.0, "lease_s": 3.0, "reserve_s": 60.0}
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _config(path, num_prefill: int, num_decode: int):
    return fault_config(path, num_prefill, num_decode, TIMEOUTS)


@pytest.fixture(scope="module")
def references():
    return {p: generate_reference("float32", MAX_NEW, prompt=p)["text"] for p in PROMPTS}


@pytest.fixture(scope="module")
def c2p1d(tmp_path_factory):
    path = _config(tmp_path_factory.mktemp("cfg") / "2p1d.toml", 2, 1)
    up = start_cluster(["--config", str(path)], tmp_path_factory)
    yield up
    up.stop()


@pytest.fixture(scope="module")
def c1p2d(tmp_path_factory):
    path = _config(tmp_path_factory.mktemp("cfg") / "1p2d.toml", 1, 2)
    up = start_cluster(["--config", str(path)], tmp_path_factory)
    yield up
    up.stop()


def _warm_decode_handshakes(up) -> None:
    """The prefill node talks to every decode node once (a first contact needs the decode node
    awake; later tests freeze one). While the prefill node is frozen the router spreads the
    reservations over the decode nodes by the pages it holds on each: one each."""
    prefill = child_pids(up)["prefill-0"]
    decodes = [n for n in child_pids(up) if n.startswith("decode")]
    before = {n: dispatched(up, "decode", n) for n in decodes}
    signal_all([prefill], signal.SIGSTOP)
    try:
        streams = Streams(up, PROMPTS[: len(decodes)], max_tokens=2)
        assert _wait(lambda: all(dispatched(up, "decode", n) == before[n] + 1 for n in decodes), 30)
    finally:
        signal_all([prefill], signal.SIGCONT)
    assert all(r[0] == "ok" for r in streams.join().values())


# ---- the faults ----------------------------------------------------------------------------
def test_prefill_node_killed_before_first_token_is_retried_unseen(c2p1d, references):
    up = c2p1d
    assert _wait(lambda: all_ready(up), 60)
    victim = child_pids(up)["prefill-0"]
    moved = up.metric("duet_request_migrations_total", stage="prefill")
    on_victim = dispatched(up, "prefill", "prefill-0")
    signal_all([victim], signal.SIGSTOP)  # its requests stay before their first token
    try:
        streams = Streams(up, PROMPTS)
        assert _wait(lambda: dispatched(up, "prefill", "prefill-0") > on_victim, 30)
        assert _wait(lambda: dispatched(up, "prefill") >= len(PROMPTS) + on_victim, 30)
    finally:
        os.kill(victim, signal.SIGKILL)
    assert_all_match(streams.join(), references)
    num_moved = up.metric("duet_request_migrations_total", stage="prefill") - moved
    assert num_moved == dispatched(up, "prefill", "prefill-0") - on_victim >= 1
    assert _wait(lambda: "prefill-0 exited with status -9; restarting" in up.log(), 30)
    assert_recovered(up)
    assert child_pids(up)["prefill-0"] != victim


def test_router_killed_under_load_leaves_no_orphan(c2p1d):
    """The router dies with 8 requests reserved on the decode node (then frozen, as are the
    prefill nodes, so nothing moves before the kill); the prefill nodes then prefill for nobody. The
    decode node, thawed once its lease ran out, drops all 8 instead of decoding for nobody."""
    up = c2p1d
    assert _wait(lambda: all_ready(up), 60)
    pids = child_pids(up)
    prefill, decode = [pids["prefill-0"], pids["prefill-1"]], pids["decode-0"]
    before = dispatched(up, "prefill")
    frozen = [*prefill]
    signal_all(frozen, signal.SIGSTOP)
    try:
        streams = Streams(up, PROMPTS, max_tokens=400)
        assert _wait(lambda: dispatched(up, "prefill") == before + len(PROMPTS), 30)
        os.kill(decode, signal.SIGSTOP)  # it has reserved all 8 (Prefill follows a reservation)
        frozen.append(decode)
        os.kill(pids["router"], signal.SIGKILL)
        killed_at = time.monotonic()
        results = streams.join()
        assert all(r[0] == "error" for r in results.values()), results  # connections dropped
        signal_all(prefill, signal.SIGCONT)
        frozen = [decode]
        assert _wait(lambda: "restarted router" in up.log(), 60)
        # the decode node is frozen past its lease: thawed, it must find its router gone
        time.sleep(max(0.0, killed_at + TIMEOUTS["lease_s"] + 0.5 - time.monotonic()))
    finally:
        signal_all(frozen, signal.SIGCONT)
    orphaned = (
        r"decode-0 WARNING aborting 8 requests: (no word from the router|the router restarted)"
    )
    assert _wait(lambda: re.search(orphaned, up.log()), 30), up.log()[-3000:]
    assert _wait(lambda: "router exited with status -9; restarting" in up.log(), 30)
    assert_recovered(up)


def test_decode_node_killed_mid_stream_moves_its_requests(c1p2d, references):
    up = c1p2d
    assert _wait(lambda: all_ready(up), 60)
    _warm_decode_handshakes(up)
    pids = child_pids(up)
    prefill, victim = pids["prefill-0"], pids["decode-0"]
    moved = up.metric("duet_request_migrations_total", stage="decode")
    on_victim = dispatched(up, "decode", "decode-0")
    before = dispatched(up, "prefill")
    signal_all([prefill], signal.SIGSTOP)
    try:
        streams = Streams(up, PROMPTS)
        assert _wait(lambda: dispatched(up, "prefill") == before + len(PROMPTS), 30)
        os.kill(victim, signal.SIGSTOP)  # its requests get their first token and no more
    finally:
        signal_all([prefill], signal.SIGCONT)
    try:
        assert streams.first.wait(60), "the streams never got their first token"
    finally:
        os.kill(victim, signal.SIGKILL)
    assert_all_match(streams.join(), references)
    num_moved = up.metric("duet_request_migrations_total", stage="decode") - moved
    assert num_moved == dispatched(up, "decode", "decode-0") - on_victim >= 1
    assert_recovered(up)


def test_hung_decode_node_is_declared_dead_and_its_requests_move(c1p2d, references):
    up = c1p2d
    assert _wait(lambda: all_ready(up), 60)
    _warm_decode_handshakes(up)
    pids = child_pids(up)
    prefill, victim = pids["prefill-0"], pids["decode-1"]
    moved = up.metric("duet_request_migrations_total", stage="decode")
    before = dispatched(up, "prefill")
    signal_all([prefill], signal.SIGSTOP)
    try:
        streams = Streams(up, PROMPTS)
        assert _wait(lambda: dispatched(up, "prefill") == before + len(PROMPTS), 30)
        os.kill(victim, signal.SIGSTOP)  # hangs without dying: only the heartbeat tells
    finally:
        signal_all([prefill], signal.SIGCONT)
    try:
        assert_all_match(streams.join(), references)
        assert up.metric("duet_request_migrations_total", stage="decode") - moved >= 1
        health = httpx.get(up.url + "/health", timeout=5).json()
        assert health["nodes"]["decode-1"]["status"] == "dead"
    finally:
        os.kill(victim, signal.SIGCONT)  # back: it drops the moved requests, rejoins
    assert child_pids(up)["decode-1"] == victim  # not restarted: the same process serves again
    assert_recovered(up)


def test_node_restarted_with_another_model_is_refused_then_rejoins(c2p1d, tmp_path):
    """prefill-0 comes back serving another model (2 layers, not 3): the router refuses it at
    NodeReady, naming the field, and routes nothing to it while prefill-1 keeps serving; the
    right model under the same name then rejoins. The launcher is frozen meanwhile so that it
    does not restart prefill-0 itself."""
    up = c2p1d
    assert _wait(lambda: all_ready(up), 60)
    other = make_tiny_model(tmp_path / "other", seed=0, overrides={"num_hidden_layers": 2})
    config = re.search(r"config (\S+cluster\.toml)", up.log()).group(1)
    pids = child_pids(up)
    os.kill(up.proc.pid, signal.SIGSTOP)
    impostor = None
    try:
        os.kill(pids["prefill-0"], signal.SIGKILL)
        assert _wait(lambda: _node(up, "prefill-0")["status"] == "dead", 30)
        impostor = subprocess.Popen(
            ["bash", str(DEPLOY / "launch_prefill.sh"), config, "prefill-0", "--model", str(other)],
            env={**os.environ, "PYTHON": sys.executable},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        want = "incompatible model: 'num_hidden_layers' is 2 on the node, 3 here"
        assert _wait(lambda: want in _node(up, "prefill-0").get("error", ""), 60)
        served = dispatched(up, "prefill", "prefill-0")
        for prompt in PROMPTS[:4]:  # all on prefill-1
            out = up.client().completions.create(model="tiny-model", prompt=prompt, max_tokens=4)
            assert out.choices[0].finish_reason in ("stop", "length")
        assert dispatched(up, "prefill", "prefill-0") == served
        assert _node(up, "prefill-0")["status"] == "dead"  # its heartbeats do not revive it
    finally:
        if impostor is not None:
            impostor.send_signal(signal.SIGINT)
            impostor.wait(30)
        os.kill(up.proc.pid, signal.SIGCONT)  # the launcher restarts the real prefill-0
    assert_recovered(up)


def _node(up, name: str) -> dict:
    return httpx.get(up.url + "/health", timeout=5).json()["nodes"][name]


@pytest.mark.parametrize("name", ["c2p1d", "c1p2d"])
def test_ctrl_c_after_the_faults_leaves_no_process_behind(name, request):
    """Restarted children are the launcher's too: Ctrl-C stops them all, and nothing of the
    cluster (its private config names every child's command line) is left."""
    up = request.getfixturevalue(name)
    config = re.search(r"config (\S+cluster\.toml)", up.log()).group(1)
    pids = child_pids(up)
    assert "restarted" in up.log() and all(alive(pid) for pid in pids.values())
    assert up.interrupt() == 0
    assert not [n for n, pid in pids.items() if alive(pid)]
    assert processes_mentioning(config) == []
