"""End to end: `duet up --kv-security aead`, a CURVE cluster whose KV links are plain sockets with
every KV message sealed by AES-256-GCM under a key per transfer (kvtransfer.sealing), the key
drawn by the decode node and handed to the prefill node over the CURVE control links through the
router. Greedy outputs equal `duet generate` (the offline twin), streamed and not, over the
official openai client; no KV message was dropped; the KV socket takes a plain handshake (it runs
no CURVE), drops a stranger's junk, and the cluster keeps serving."""

import re
from pathlib import Path

import pytest
import zmq
from e2e_helpers import generate_reference, start_cluster, wait_until
from zmq.utils.monitor import recv_monitor_message

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PROMPTS = ["The quick brown fox", "Once upon a time there was", "1, 2, 3, 4,"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    args = ["--prefill", "1", "--decode", "1", "--threads", "1", "--kv-security", "aead"]
    up = start_cluster(args, tmp_path_factory)
    config = Path(re.search(r"config (\S+cluster\.toml)", up.log()).group(1))
    up.raw = tomllib.loads(config.read_text())
    yield up
    up.stop()


def test_the_config_seals_kv_under_curve(cluster):
    security = cluster.raw["security"]
    assert security["kv_security"] == "aead" and security["curve_key_file"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_sealed_transfers_give_the_offline_outputs(cluster, prompt):
    out = cluster.client().completions.create(
        model="tiny-model", prompt=prompt, max_tokens=MAX_NEW, temperature=0.0
    )
    want = generate_reference("bfloat16", MAX_NEW, prompt=prompt, extra=("--threads", "1"))
    assert out.choices[0].text == want["text"]
    stream = cluster.client().completions.create(
        model="tiny-model", prompt=prompt, max_tokens=MAX_NEW, temperature=0.0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == want["text"]


def _dropped(cluster) -> float:
    """The decode node's dropped KV messages (its heartbeat, the router's /metrics): the junk
    test below moves it, so a name that matched nothing could not pass both."""
    return cluster.metric("duet_kv_chunks_dropped_total", node="decode-0", role="decode")


def test_no_kv_message_was_dropped(cluster):
    cluster.client().completions.create(model="tiny-model", prompt="Hi", max_tokens=4)
    assert _dropped(cluster) == 0


def test_the_kv_socket_runs_plain_zmq_and_serving_goes_on(cluster):
    """The KV port completes a plain ZMTP handshake (no CURVE there: the seal protects the
    frames, tests/kvtransfer/test_sealing.py shows a frame under any other key refused); a
    malformed frame from such a peer is dropped and counted, and serving goes on."""
    (decode,) = cluster.raw["decode"]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(f"tcp://{decode.get('host', '127.0.0.1')}:{decode['kv_port']}")
    try:
        assert monitor.poll(10_000, zmq.POLLIN), "no plain handshake with the KV port"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        before = _dropped(cluster)
        sock.send_multipart([b"not a header"])
        assert wait_until(lambda: _dropped(cluster) == before + 1, 30)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
    out = cluster.client().completions.create(
        model="tiny-model", prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0.0
    )
    want = generate_reference("bfloat16", MAX_NEW, prompt=PROMPTS[0], extra=("--threads", "1"))
    assert out.choices[0].text == want["text"]
