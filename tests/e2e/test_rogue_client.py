"""End to end: node traffic of a `duet up` cluster (ephemeral CURVE keys) is closed to peers
without the cluster's keys, and survives an authenticated peer that sends garbage.

Rogue clients (plain ZeroMQ; CURVE with another cluster's keys; CURVE with the cluster's public
key but a key pair of their own) push Shutdown, a Reserve, NodeFailed and KV frames to every
node socket and the router's control socket: each handshake fails (the rogue socket's monitor
says so), and afterwards every process is alive, no page is reserved, no counter moved, and the
cluster serves a completion through the openai client. A peer holding the keys then gets one
malformed frame through to each socket (the counters move by exactly one: the rogues' frames
were never delivered, the keyed peer's are).

The fuzz test is that authenticated but buggy peer: seeded random bytes, mutated valid msgpack
frames, random msgpack maps and valid message types with fields of random types, to every
control socket and to the KV socket. Every frame is dropped and counted exactly once (node
heartbeats -> the router's /metrics) and the cluster keeps serving."""

from __future__ import annotations

import dataclasses
import random
import re
import time
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
from e2e_helpers import alive, start_cluster
from zmq.utils.monitor import recv_monitor_message

from control import protocol
from control.protocol import (
    Abort,
    Heartbeat,
    NodeFailed,
    Prefill,
    RequestTokens,
    Reserve,
    Shutdown,
    StepTokens,
    sampling_to_dict,
)
from control.sampling_params import SamplingParams
from control.security import CurveKeys, CurveSecurity, read_key_file
from kvtransfer import wire
from kvtransfer.wire import Hello, KVDone, Rendezvous, build_chunk

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ARGS = ["--prefill", "1", "--decode", "1", "--dtype", "bfloat16"]
WAIT_S = 60.0  # bound of every wait for a condition (heartbeats come every 0.5 s)
HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
}
NUM_FUZZ_CONTROL = 150  # frames per control socket
NUM_FUZZ_KV = 100
SAMPLING = sampling_to_dict(SamplingParams(max_new_tokens=4))


@dataclasses.dataclass
class Target:
    name: str  # the node whose counter shows what arrived ("router" for the router)
    endpoint: str
    kind: str  # "control" (PUSH -> PULL) | "kv" (DEALER -> ROUTER)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    up = start_cluster(ARGS, tmp_path_factory)
    config = Path(re.search(r"config (\S+cluster\.toml)", up.log()).group(1))
    raw = tomllib.loads(config.read_text())
    up.keys = read_key_file(raw["security"]["curve_key_file"])
    (p,), (d,) = raw["prefill"], raw["decode"]
    up.targets = [
        Target("router", f"tcp://127.0.0.1:{raw['router']['control_port']}", "control"),
        Target(p["name"], f"tcp://127.0.0.1:{p['control_port']}", "control"),
        Target(d["name"], f"tcp://127.0.0.1:{d['control_port']}", "control"),
        Target(d["name"], f"tcp://127.0.0.1:{d['kv_port']}", "kv"),
    ]
    up.decode = d["name"]
    yield up
    up.stop()


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


# ---- helpers ---------------------------------------------------------------------------------
def wait_for(cond, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def counters(up) -> dict[str, float]:
    """What each socket has dropped so far, by target (from the router's /metrics)."""
    out = {"router": up.metric("duet_router_malformed_frames_total")}
    for t in up.targets[1:3]:
        role = "prefill" if t.name != up.decode else "decode"
        out[t.name] = up.metric("duet_node_malformed_frames_total", node=t.name, role=role)
    out["kv"] = up.metric("duet_kv_chunks_dropped_total", node=up.decode, role="decode")
    return out


def counter_key(target: Target) -> str:
    return "kv" if target.kind == "kv" else target.name


def pages_used(up) -> float:
    return up.metric("duet_kv_pages_used", node=up.decode, role="decode")


def assert_cluster_serves(up) -> None:
    assert all(alive(pid) for pid in up.child_pids.values()), up.child_pids
    out = up.client().completions.create(
        model="tiny-model", prompt="Hello world", max_tokens=8, temperature=0
    )
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens
    wait_for(lambda: pages_used(up) == 0, "the completion's pages to come back")
    health = httpx.get(up.url + "/health", timeout=10).json()
    assert health["status"] == "ok"
    assert all(n["status"] == "ready" for n in health["nodes"].values()), health


def socket_for(ctx, target: Target, setup) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER if target.kind == "kv" else zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if setup is not None:
        setup(sock)
    return sock


def handshake(sock: zmq.Socket, endpoint: str, messages) -> int:
    """Connects, queues `messages` (lists of frames; they leave only after a handshake) and
    returns the first handshake outcome seen on the socket's monitor."""
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(endpoint)
        for frames in messages:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if monitor.poll(100):
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED or event in HANDSHAKE_FAILED:
                    return event
        raise AssertionError(f"no handshake outcome for {endpoint}")
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


def rogue_setups(keys: CurveKeys) -> dict:
    other, own = CurveSecurity(CurveKeys.generate()), CurveKeys.generate()

    def impostor(sock):  # knows the cluster's public key, not its secret one
        sock.curve_serverkey = keys.public
        sock.curve_publickey, sock.curve_secretkey = own.public, own.secret

    return {"plain": None, "other-cluster": other.client, "impostor": impostor}


def rogue_messages(target: Target, decode_name: str) -> list[list[bytes]]:
    """What a rogue would like to do to `target`: stop it, take pages, fail a node, write KV;
    plus one malformed frame (it would show in the counters had anything got through)."""
    if target.kind == "kv":
        fp = {"model_type": "rogue"}
        header, payload = build_chunk(Rendezvous("rogue", 1), 0, 0, 0, _rows())
        return [
            [wire.encode(Hello("rogue", fp))],
            [wire.encode(header), bytes(payload)],
            [wire.encode(KVDone(Rendezvous("rogue", 1), 1, 1, 0))],
            [b"\xc1 rogue"],
        ]
    if target.name == "router":
        return [
            [protocol.encode(NodeFailed(decode_name, "decode", "rogue says so"))],
            [protocol.encode(Shutdown("rogue"))],
            [b"\xc1 rogue"],
        ]
    return [
        [protocol.encode(Reserve("rogue-reserve", 1, 64, SAMPLING, 1e6))],
        [protocol.encode(Shutdown("rogue"))],
        [b"\xc1 rogue"],
    ]


def _rows():
    import torch

    return torch.zeros(1, 1, 8, dtype=torch.bfloat16)


# ---- the rogue clients -----------------------------------------------------------------------
def test_rogue_clients_cannot_reach_any_node(cluster, ctx):
    before, pages_before = counters(cluster), pages_used(cluster)
    assert pages_before == 0
    for who, setup in rogue_setups(cluster.keys).items():
        for target in cluster.targets:
            sock = socket_for(ctx, target, setup)
            try:
                outcome = handshake(sock, target.endpoint, rogue_messages(target, cluster.decode))
            finally:
                sock.close()
            assert outcome in HANDSHAKE_FAILED, (who, target)

    # Nothing arrived: every process alive, nothing reserved, no counter moved...
    assert all(alive(pid) for pid in cluster.child_pids.values())
    assert pages_used(cluster) == 0 and counters(cluster) == before
    # ...while a peer with the keys gets one malformed frame through to each socket, counted
    # once; the rogues' malformed frames, queued and closed before it, never were.
    keyed = CurveSecurity(cluster.keys)
    socks = [socket_for(ctx, target, keyed.client) for target in cluster.targets]
    try:
        for sock, target in zip(socks, cluster.targets, strict=True):
            outcome = handshake(sock, target.endpoint, [[b"\xc1 keyed"]])
            assert outcome == zmq.EVENT_HANDSHAKE_SUCCEEDED, target
        want = {k: v + 1 for k, v in before.items()}
        wait_for(lambda: counters(cluster) == want, f"counters {want}")
    finally:
        for sock in socks:  # open until counted: a LINGER 0 close discards what is queued
            sock.close()
    assert "rogue says so" not in cluster.log()
    assert_cluster_serves(cluster)


# ---- the fuzzing peer ------------------------------------------------------------------------
_FIELD_NAMES = ["type", "request_id", "room", "prompt_len", "sampling", "timeout_s", "token_ids"]
_FIELD_NAMES += ["reason", "kv_endpoint", "node", "role", "info"]


def _valid_control_frames() -> list[bytes]:
    msgs = [
        Reserve("f", 1, 5, SAMPLING, 5.0),
        Prefill("f", 1, [1, 2, 3], SAMPLING, "tcp://127.0.0.1:1", 5.0),
        Abort("f", "x"),
        Heartbeat("n", "decode", stage_ms={"a": 1.0}),
        StepTokens.of([RequestTokens("f", [1, 2]), RequestTokens("g", [3], "stop")]),
        Shutdown("x"),
    ]
    return [protocol.encode(m) for m in msgs]


def _valid_kv_frames() -> list[bytes]:
    rdv = Rendezvous("f", 1)
    header, _ = build_chunk(rdv, 0, 0, 0, _rows())
    return [wire.encode(m) for m in (Hello("f", {"a": 1}), header, KVDone(rdv, 1, 1, 0))]


def _mutate(rng: random.Random, frame: bytes) -> bytes:
    b = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        op, i = rng.randrange(4), rng.randrange(len(b) + 1)
        if op == 0 and i < len(b):
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            del b[i:]
        elif op == 2:
            b.insert(i, rng.randrange(256))
        elif i < len(b):
            b[i] = rng.randrange(256)
    return bytes(b)


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(10 if depth < 3 else 7)
    if kind == 0:
        return rng.choice([0, -1, 1, 2**63 - 1, -(2**63), 2**64 - 1])
    if kind == 1:
        return rng.choice(["", "Reserve", "Shutdown", "x" * rng.randint(0, 40)])
    if kind == 2:
        return rng.randbytes(rng.randint(0, 8))
    if kind == 3:
        return rng.choice([0.0, -1.5, float("nan"), float("inf"), 1e308])
    if kind == 4:
        return None
    if kind in (5, 6):
        return rng.random() < 0.5
    if kind in (7, 8):
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return _random_map(rng, depth + 1)


def _random_map(rng: random.Random, depth: int, msg_type: str | None = None) -> dict:
    out = {} if msg_type is None else {"type": msg_type}
    for _ in range(rng.randint(0, 5)):
        key = rng.choice(_FIELD_NAMES) if rng.random() < 0.8 else rng.randbytes(3)
        out[key] = _random_value(rng, depth)
    return out


def fuzz_frames(rng: random.Random, valid: list[bytes], is_malformed, count: int) -> list[list]:
    """`count` messages (mostly one frame, some two) that `is_malformed` confirms the receiver
    must drop: frames that happen to decode into a valid message are skipped, so a fuzzed
    Shutdown never stops a node and every message sent is counted exactly once."""
    types = list(protocol.MESSAGE_TYPES)
    out: list[list] = []
    while len(out) < count:
        kind = rng.randrange(4)
        if kind == 0:
            frame = rng.randbytes(rng.randint(0, 64))
        elif kind == 1:
            frame = _mutate(rng, rng.choice(valid))
        else:
            msg_type = rng.choice(types) if kind == 3 else None
            frame = msgpack.packb(_random_map(rng, 0, msg_type), use_bin_type=True)
        frames = [frame] if rng.random() < 0.9 else [frame, rng.randbytes(rng.randint(0, 16))]
        if is_malformed(frames[0]):
            out.append(frames)
    return out


def _fails(decode):
    def is_malformed(frame: bytes) -> bool:
        try:
            decode(frame)
        except Exception:
            return True
        return False

    return is_malformed


def test_fuzzing_peer_with_the_keys_is_dropped_and_counted(cluster, ctx):
    rng = random.Random(20240611)
    keyed = CurveSecurity(cluster.keys)
    before = counters(cluster)
    want = dict(before)
    for target in cluster.targets:
        if target.kind == "kv":
            # A KV message is dropped once whatever its frames, if its header does not decode.
            msgs = fuzz_frames(rng, _valid_kv_frames(), _fails(wire.decode), NUM_FUZZ_KV)
        else:
            valid = _valid_control_frames()
            msgs = fuzz_frames(rng, valid, _fails(protocol.decode), NUM_FUZZ_CONTROL)
        key = counter_key(target)
        want[key] += len(msgs)
        sock = socket_for(ctx, target, keyed.client)
        try:  # open until counted: a LINGER 0 close discards what is still queued
            assert handshake(sock, target.endpoint, msgs) == zmq.EVENT_HANDSHAKE_SUCCEEDED
            wait_for(lambda k=key: counters(cluster)[k] >= want[k], f"{key} to count the fuzz")
        finally:
            sock.close()
    assert counters(cluster) == want  # exactly once each: nothing else was dropped
    assert_cluster_serves(cluster)
