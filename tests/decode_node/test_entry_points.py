"""`python -m prefill_node` and `python -m decode_node` as real processes over loopback ZeroMQ
(CURVE with a cluster key file named relative to the config), with this test playing the router:
NodeReady/NodeFailed at start (the decode node advertises its `host`, not the address it bound),
one request served exactly, abort mid-decode returns the pages, SIGTERM stops both cleanly; a
config with neither keys nor `insecure` exits 2 with the fix."""

import signal
import socket
import subprocess
import sys
import time

import pytest

import decode_node.__main__ as decode_main
import prefill_node.__main__ as prefill_main
from control.messaging import PullSocket, PushSocket
from control.protocol import (
    Abort,
    FirstToken,
    Heartbeat,
    NodeFailed,
    NodeReady,
    Prefill,
    RequestError,
    Reserve,
    ReserveReply,
    StepTokens,
    sampling_to_dict,
)
from control.sampling_params import SamplingParams
from control.security import CurveSecurity, read_key_file, write_key_file

START_TIMEOUT = 60.0  # importing torch and loading the model, on a busy machine
TIMEOUT = 20.0
PROMPT = [3, 44, 18, 250, 9, 71, 130, 5, 66, 301, 12, 40, 77, 8]


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def write_config(path, model_dir, security='curve_key_file = "cluster.key"'):
    """The cluster config at `path`, its key file beside it (named relative to the config). The
    decode node binds 127.0.0.1 and is reached (advertises itself) at "localhost"."""
    router, ctl, p, d, kv = free_ports(5)
    write_key_file(path.parent / "cluster.key", force=True)
    path.write_text(
        f"""
model = "{model_dir}"
dtype = "bfloat16"
[security]
{security}
[router]
port = {router}
control_port = {ctl}
[timeouts]
heartbeat_s = 0.1
[[prefill]]
name = "p"
control_port = {p}
chunk_size = 4
max_batch_tokens = 8
page_size = 3
[[decode]]
name = "d"
host = "localhost"
bind_host = "127.0.0.1"
control_port = {d}
kv_port = {kv}
page_size = 5
num_pages = 40
"""
    )
    return ctl, p, d, kv


def keys_of(config) -> CurveSecurity:
    """What the test, playing the router, uses for its sockets: the cluster's keys."""
    return CurveSecurity(read_key_file(config.parent / "cluster.key"))


def start(module, config, node, *extra):
    cmd = [sys.executable, "-m", module, "--config", str(config), "--node", node, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def recv_until(sock, kind, timeout=TIMEOUT, keep=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = sock.recv(0.2)
        if isinstance(msg, kind):
            return msg
        if keep is not None and msg is not None:
            keep.append(msg)
    raise AssertionError(f"no {kind} within {timeout}s")


def stop(procs):
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(10))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
            codes.append("killed")
    return codes


def test_nodes_serve_a_request_and_stop_cleanly(tmp_path, tiny_dir, offline):
    config = tmp_path / "cluster.toml"
    ctl, p_port, d_port, kv = write_config(config, tiny_dir)
    security = keys_of(config)
    router = PullSocket(f"tcp://127.0.0.1:{ctl}", security=security)
    procs = [start("prefill_node", config, "p"), start("decode_node", config, "d")]
    try:
        ready = {}
        for _ in range(2):
            msg = recv_until(router, (NodeReady, NodeFailed), START_TIMEOUT)
            ready[msg.node] = msg
        assert all(isinstance(m, NodeReady) for m in ready.values()), ready
        info = ready["d"].info
        assert info["num_pages"] == 40 and info["page_size"] == 5
        assert info["kv_endpoint"] == f"tcp://localhost:{kv}"  # its host, not what it bound
        to_p = PushSocket(f"tcp://127.0.0.1:{p_port}", security=security)
        to_d = PushSocket(f"tcp://127.0.0.1:{d_port}", security=security)

        # One request, exactly as offline.
        params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
        to_d.send(Reserve("a", 11, len(PROMPT), sampling_to_dict(params), 5.0))
        reply = recv_until(router, ReserveReply)
        assert reply.ok and reply.kv_endpoint == info["kv_endpoint"]
        to_p.send(Prefill("a", 11, PROMPT, sampling_to_dict(params), reply.kv_endpoint, 5.0))
        first = recv_until(router, FirstToken)
        tokens = []
        while True:
            msg = recv_until(router, (StepTokens, RequestError))
            assert isinstance(msg, StepTokens) and msg.request_ids == ["a"], msg
            tokens += msg.token_ids[0]
            if msg.finish_reasons[0]:
                break
        assert [first.token, *tokens] == offline(PROMPT, params)

        # A long request aborted mid-decode: the decode node's pages all come back.
        long = SamplingParams(temperature=0.0, max_new_tokens=150, ignore_eos=True)
        to_d.send(Reserve("b", 12, len(PROMPT), sampling_to_dict(long), 5.0))
        assert recv_until(router, ReserveReply).ok
        to_p.send(Prefill("b", 12, PROMPT, sampling_to_dict(long), reply.kv_endpoint, 5.0))
        recv_until(router, StepTokens)
        to_d.send(Abort("b", "client gone"))
        to_p.send(Abort("b", "client gone"))
        deadline = time.monotonic() + TIMEOUT
        while True:  # heartbeats of D until one shows every page free again
            hb = recv_until(router, Heartbeat)
            if hb.role == "decode" and hb.free_pages == hb.total_pages == 40:
                break
            assert time.monotonic() < deadline, "pages never came back"
        to_p.close()
        to_d.close()
    finally:
        codes = stop(procs)
        router.close()
        security.close()
    assert codes == [0, 0], [p.stderr.read().decode()[-2000:] for p in procs]


@pytest.mark.parametrize("mode", ["curve", "insecure"])
def test_a_node_that_cannot_start_reports_node_failed(tmp_path, tiny_dir, mode):
    config = tmp_path / "cluster.toml"
    insecure = {"curve": 'curve_key_file = "cluster.key"', "insecure": "insecure = true"}[mode]
    ctl, *_ = write_config(config, tmp_path / "no-such-model", security=insecure)
    security = keys_of(config) if mode == "curve" else None
    router = PullSocket(f"tcp://127.0.0.1:{ctl}", security=security)
    proc = start("decode_node", config, "d")
    try:
        msg = recv_until(router, (NodeReady, NodeFailed), START_TIMEOUT)
        assert isinstance(msg, NodeFailed) and msg.node == "d" and msg.role == "decode"
        assert "no-such-model" in msg.error
        assert proc.wait(TIMEOUT) == 1
    finally:
        stop([proc])
        router.close()
        if security is not None:
            security.close()
    warned = "insecure = true: node d talks plain ZeroMQ" in proc.stderr.read().decode()
    assert warned == (mode == "insecure")


@pytest.mark.parametrize(
    "main, node, match",
    [
        (prefill_main.main, "nobody", "no node named 'nobody'"),
        (prefill_main.main, "d", "is not a [[prefill]] node"),
        (decode_main.main, "p", "is not a [[decode]] node"),
    ],
)
def test_bad_node_names_exit_2_with_one_line(tmp_path, tiny_dir, capsys, main, node, match):
    config = tmp_path / "cluster.toml"
    write_config(config, tiny_dir)
    assert main(["--config", str(config), "--node", node]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1


@pytest.mark.parametrize("main", [prefill_main.main, decode_main.main])
def test_a_config_without_keys_or_insecure_exits_2_with_the_fix(tmp_path, tiny_dir, capsys, main):
    config = tmp_path / "cluster.toml"
    write_config(config, tiny_dir, security="")
    node = "p" if main is prefill_main.main else "d"
    assert main(["--config", str(config), "--node", node]) == 2
    err = capsys.readouterr().err
    assert "duet keygen" in err and "insecure = true" in err and err.count("\n") == 1
