"""control.security: the key file (round trip, 0600, refusals, one-line errors naming the file),
the config rules (keys, insecure, neither), and CURVE on real sockets: the cluster keys deliver;
a peer without CURVE, one with another server key, and one with the right server key but its
own key pair all fail the handshake (seen on the peer's socket monitor, no sleeps) and nothing
of theirs reaches the socket; the router's zmq.asyncio PULL is guarded the same way."""

import asyncio
import logging
import os
import re
import stat
import time

import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from control.cluster_config import ClusterConfig, SecurityConfig
from control.errors import ConfigError
from control.messaging import PullSocket, PushSocket
from control.protocol import Abort, Shutdown, encode
from control.security import (
    FIX,
    KEY_FILE_NAME,
    CurveKeys,
    CurveSecurity,
    cluster_security,
    key_path,
    kv_link,
    read_key_file,
    security_toml,
    with_ephemeral_keys,
    write_key_file,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
}
TIMEOUT = 10.0


@pytest.fixture
def ctx():
    """A private context per test: its ZAP handler is stopped and the context terminated."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def cluster(ctx):
    security = CurveSecurity(CurveKeys.generate())
    yield security
    security.close()


def handshake(sock: zmq.Socket, endpoint: str, send=(), timeout: float = TIMEOUT) -> int:
    """Connects `sock`, queues the frames of `send` (they leave only after a handshake), and
    returns the first handshake outcome (a zmq.EVENT_HANDSHAKE_* value)."""
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(endpoint)
        for frame in send:
            sock.send(frame, flags=zmq.NOBLOCK)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if monitor.poll(100):
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED or event in HANDSHAKE_FAILED:
                    return event
        raise AssertionError(f"no handshake outcome within {timeout} s")
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


def rogue_push(ctx, setup=None) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if setup is not None:
        setup(sock)
    return sock


def impostor(keys: CurveKeys):
    """A client that knows the cluster's public key but holds its own key pair."""
    own = CurveKeys.generate()

    def setup(sock):
        sock.curve_serverkey = keys.public
        sock.curve_publickey, sock.curve_secretkey = own.public, own.secret

    return setup


# ---- the key file ----------------------------------------------------------------------------
def test_key_file_round_trip_is_private_and_readable_by_pyzmq(tmp_path):
    path = tmp_path / KEY_FILE_NAME
    keys = write_key_file(path)
    assert read_key_file(path) == keys
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert zmq.auth.load_certificate(str(path)) == (keys.public, keys.secret)


def test_key_file_is_not_overwritten_without_force(tmp_path):
    path = tmp_path / KEY_FILE_NAME
    first = write_key_file(path)
    with pytest.raises(ConfigError, match="already exists.*--force"):
        write_key_file(path)
    assert read_key_file(path) == first
    second = write_key_file(path, force=True)
    assert second != first and read_key_file(path) == second
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == [KEY_FILE_NAME]


def _flip_last_char(text: str) -> str:
    start = text.index('public-key = "') + len('public-key = "')
    key = text[start : start + 40]
    swapped = key[:-1] + ("a" if key[-1] != "a" else "b")
    return text.replace(key, swapped)


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "cannot read the CURVE key file"),
        (b"", "not a CURVE key file"),
        (b"\xff\xfe\x00 binary", "not a CURVE key file"),
        (b'curve\n    public-key = "abc"\n', "not a CURVE key file"),
        (b'curve\n    public-key = "abc"\n    secret-key = "def"\n', "corrupt CURVE key file"),
        ("mismatched", "corrupt CURVE key file"),
    ],
    ids=["missing", "empty", "binary", "no-secret", "short-keys", "mismatched"],
)
def test_bad_key_files_give_one_line_errors_naming_the_file(tmp_path, content, match):
    path = tmp_path / "cluster.key"
    if content == "mismatched":
        write_key_file(path)
        path.write_text(_flip_last_char(path.read_text()))
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=match) as err:
        read_key_file(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


# ---- the config ------------------------------------------------------------------------------
def test_neither_keys_nor_insecure_is_a_config_error_with_the_fix():
    with pytest.raises(ConfigError) as err:
        cluster_security(SecurityConfig())
    assert FIX in str(err.value) and "duet keygen" in str(err.value)


def test_insecure_is_plain_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="control.security"):
        assert cluster_security(SecurityConfig(insecure=True), who="node d") is None
    assert "insecure = true" in caplog.text and "node d" in caplog.text
    assert "unauthenticated" in caplog.text
    with pytest.raises(ConfigError, match="pick one"):
        cluster_security(SecurityConfig(curve_key_file="k", insecure=True))


def test_relative_key_file_resolves_against_the_config_dir_else_cwd(tmp_path, monkeypatch):
    conf_dir, cwd = tmp_path / "conf", tmp_path / "cwd"
    conf_dir.mkdir()
    cwd.mkdir()
    keys = write_key_file(conf_dir / "cluster.key")
    monkeypatch.chdir(cwd)
    cfg = SecurityConfig(curve_key_file="cluster.key")
    assert key_path(cfg, conf_dir / "cluster.toml") == (conf_dir / "cluster.key").resolve()
    assert key_path(cfg) == (cwd / "cluster.key").resolve()
    security = cluster_security(cfg, conf_dir / "cluster.toml")
    assert security.keys == keys
    with pytest.raises(ConfigError, match=re.escape(str(cwd / "cluster.key"))):
        cluster_security(cfg)  # no config file: the working directory, which has none


def test_ephemeral_keys_only_when_the_config_names_none(tmp_path):
    raw = {"router": {"port": 1}}
    out = with_ephemeral_keys(raw, tmp_path)
    assert raw == {"router": {"port": 1}}  # the caller's dict is left alone
    path = out["security"]["curve_key_file"]
    assert path == str(tmp_path / KEY_FILE_NAME)
    first = read_key_file(path)
    with_ephemeral_keys(raw, tmp_path)  # the next start: a fresh pair in the same place
    assert read_key_file(path) != first
    insecure = {"security": {"insecure": True}}
    assert with_ephemeral_keys(insecure, tmp_path / "unused") == insecure
    named = {"security": {"curve_key_file": "keys/cluster.key"}}
    out = with_ephemeral_keys(named, tmp_path / "unused", tmp_path / "conf" / "c.toml")
    assert out["security"]["curve_key_file"] == str(tmp_path / "conf" / "keys" / "cluster.key")


def test_security_toml_names_the_file(tmp_path):
    path = tmp_path / 'odd "dir"' / KEY_FILE_NAME
    raw = tomllib.loads(security_toml(path))
    assert raw == {"security": {"curve_key_file": str(path.resolve())}}


# ---- CURVE on sockets ------------------------------------------------------------------------
def test_cluster_keys_deliver_over_curve(ctx, cluster):
    pull = PullSocket("tcp://127.0.0.1:0", context=ctx, security=cluster)
    push = PushSocket(pull.endpoint, context=ctx, security=cluster)
    try:
        assert push.send(Abort("a", "x"))
        assert pull.recv(TIMEOUT) == Abort("a", "x")
    finally:
        push.close()
        pull.close()


@pytest.mark.parametrize("who", ["plain", "other-cluster", "impostor"])
def test_peers_without_the_cluster_keys_deliver_nothing(ctx, cluster, who):
    pull = PullSocket("tcp://127.0.0.1:0", context=ctx, security=cluster)
    setup = {
        "plain": None,
        "other-cluster": CurveSecurity(CurveKeys.generate()).client,
        "impostor": impostor(cluster.keys),
    }[who]
    rogue = rogue_push(ctx, setup)
    good = PushSocket(pull.endpoint, context=ctx, security=cluster)
    try:
        assert handshake(rogue, pull.endpoint, [encode(Shutdown())]) in HANDSHAKE_FAILED
        if who == "impostor":  # CURVE itself passed: the ZAP check refused its key
            assert cluster.num_refused >= 1
        assert good.send(Abort("ok"))
        assert pull.recv(TIMEOUT) == Abort("ok")  # the first and only message that arrives
        assert pull.recv(0.2) is None and pull.num_malformed == 0
    finally:
        for sock in (rogue, good, pull):
            sock.close()


def test_a_plain_server_refuses_a_curve_client_and_vice_versa(ctx, cluster):
    plain = PullSocket("tcp://127.0.0.1:0", context=ctx)
    client = rogue_push(ctx, cluster.client)
    try:
        assert handshake(client, plain.endpoint) in HANDSHAKE_FAILED
    finally:
        client.close()
        plain.close()


def test_insecure_mode_is_plain_zeromq(ctx):
    pull = PullSocket("tcp://127.0.0.1:0", context=ctx, security=None)
    raw = rogue_push(ctx)
    try:
        assert handshake(raw, pull.endpoint, [encode(Abort("plain"))]) == (
            zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        assert pull.recv(TIMEOUT) == Abort("plain")
    finally:
        raw.close()
        pull.close()


def test_router_transport_admits_only_the_cluster_keys(cluster):
    from router.transport import RouterTransport

    async def scenario():
        transport = RouterTransport("tcp://127.0.0.1:*", {}, cluster)
        endpoint = transport.pull.getsockopt_string(zmq.LAST_ENDPOINT)
        side = zmq.Context()
        try:
            rogue = rogue_push(side, impostor(cluster.keys))
            outcome = await asyncio.to_thread(handshake, rogue, endpoint, [encode(Abort("x"))])
            node = PushSocket(endpoint, context=side, security=cluster)
            assert node.send(Abort("node"))
            got = await asyncio.wait_for(transport.recv(), TIMEOUT)
            for sock in (rogue, node):
                sock.close()
            return outcome, got
        finally:
            transport.close()  # returns: the ZAP thread is stopped before the context ends
            side.destroy(linger=0)

    outcome, got = asyncio.run(scenario())
    assert outcome in HANDSHAKE_FAILED and got == Abort("node")
    assert cluster.num_refused >= 1


def test_key_file_mode_warning(tmp_path, caplog):
    path = tmp_path / KEY_FILE_NAME
    write_key_file(path)
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="control.security"):
        read_key_file(path)
    assert "readable by others" in caplog.text


# ---- duet keygen -----------------------------------------------------------------------------
def test_duet_keygen_writes_the_key_file_and_prints_the_config_lines(tmp_path, capsys):
    from deploy.cli import main

    out_dir = tmp_path / "keys"
    assert main(["keygen", str(out_dir)]) == 0
    printed = capsys.readouterr().out
    section = tomllib.loads(printed)["security"]  # the '#' lines are TOML comments
    assert section == {"curve_key_file": str((out_dir / KEY_FILE_NAME).resolve())}
    keys = read_key_file(section["curve_key_file"])
    assert cluster_security(SecurityConfig(**section)).keys == keys

    assert main(["keygen", str(out_dir)]) == 1  # never silently replaces a cluster's keys
    err = capsys.readouterr().err
    assert "already exists" in err and "--force" in err and err.count("\n") == 1
    assert read_key_file(section["curve_key_file"]) == keys
    assert main(["keygen", str(out_dir), "--force"]) == 0
    assert read_key_file(section["curve_key_file"]) != keys


def test_kv_link_modes():
    """kv_security: "curve" keeps CURVE on the KV sockets; "aead" runs them plain and seals each
    message instead; an insecure cluster does neither; anything else is a one-line error."""
    security = CurveSecurity(CurveKeys(*zmq.curve_keypair()))
    assert kv_link(SecurityConfig(), security) == (security, False)
    assert kv_link(SecurityConfig(kv_security="aead"), security) == (None, True)
    assert kv_link(SecurityConfig(kv_security="aead", insecure=True), None) == (None, False)
    raw = {
        "prefill": [{"name": "p", "control_port": 1}],
        "decode": [{"name": "d", "control_port": 2, "kv_port": 3}],
        "security": {"insecure": True, "kv_security": "tls"},
    }
    with pytest.raises(ConfigError, match=r"\[security\] kv_security must be one of curve, aead"):
        ClusterConfig.from_dict(raw)
    raw["security"]["kv_security"] = "aead"
    assert ClusterConfig.from_dict(raw).security.kv_security == "aead"
