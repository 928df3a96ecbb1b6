"""The ranks' rendezvous store (`runtime.rank_store`): the store's operations against a plain
dict's semantics; a request without the group's token is refused and changes nothing; with
CURVE keys a stranger without them gets no answer at all; and two real ranks meet and work
while a stranger pokes at the store's port (during the rendezvous) and at gloo's own port
(after it), with a wrong token, with no handshake and with junk."""

import datetime
import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from listeners import listening_sockets

from control.cluster_config import DecodeNodeConfig
from control.security import CurveKeys, CurveSecurity
from runtime import rank_store
from runtime.rank_group import RankGroup, rendezvous_listener
from runtime.rank_store import TOKEN_ENV, AuthStore, StoreServer, group_token

TOKEN = b"t" * 32
WAIT = datetime.timedelta(seconds=5)


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    return sock


@pytest.fixture
def served():
    """(server, a client with the token, a client factory) on a plain socket."""
    server = StoreServer(_listener(), TOKEN, None)
    clients = []

    def client(token=TOKEN, security=None):
        clients.append(AuthStore(server.endpoint, token, security, WAIT))
        return clients[-1]

    yield server, client(), client
    for c in clients:
        c.close()
    server.close()


def test_operations_follow_a_dicts_semantics(served):
    _, store, _ = served
    store.set("a", b"1")
    store.set("s", "text")
    assert store.get("a") == b"1" and store.get("s") == b"text"
    assert store.add("n", 2) == 2 and store.add("n", 5) == 7 and store.get("n") == b"7"
    assert store.check(["a", "n"]) and not store.check(["a", "missing"])
    assert store.compare_set("c", b"", b"x") == b"x"  # absent and expected empty: set
    assert store.compare_set("c", b"y", b"z") == b"x"  # mismatch: the current value
    assert store.compare_set("c", b"x", b"z") == b"z"
    assert store.num_keys() == 4
    assert store.delete_key("c") and not store.delete_key("c")
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="waited"):
        store.wait(["never"], datetime.timedelta(seconds=0.2))
    assert time.monotonic() - started < 2.0


def test_a_request_without_the_token_is_refused_and_changes_nothing(served):
    server, store, client = served
    store.set("rank1", b"the real address")
    stranger = client(token=b"w" * 32)
    with pytest.raises(dist.DistStoreError, match="refused"):
        stranger.set("rank1", b"the stranger's address")
    with pytest.raises(dist.DistStoreError, match="refused"):
        stranger.check(["rank1"])
    with pytest.raises(dist.DistStoreError, match="refused"):
        client(token=b"").add("n", 1)
    assert server.num_refused == 3
    assert store.get("rank1") == b"the real address" and store.num_keys() == 1
    with socket.create_connection(server.endpoint[6:].rsplit(":", 1)) as junk:  # no handshake
        junk.sendall(os.urandom(512))
    store.set("after", b"ok")
    assert store.get("after") == b"ok"


def test_with_curve_a_stranger_without_the_key_gets_no_answer(monkeypatch):
    monkeypatch.setattr(rank_store, "REPLY_TIMEOUT_S", 0.5)
    cluster = CurveSecurity(CurveKeys.generate())
    server = StoreServer(_listener(), TOKEN, cluster)
    member = AuthStore(server.endpoint, TOKEN, CurveSecurity(cluster.keys), WAIT)
    stranger = AuthStore(server.endpoint, TOKEN, CurveSecurity(CurveKeys.generate()), WAIT)
    try:
        member.set("k", b"v")
        with pytest.raises(dist.DistStoreError, match="did not answer"):
            stranger.set("k", b"forged")  # even with the token: no handshake, no frame
        assert member.get("k") == b"v"
    finally:
        member.close()
        stranger.close()
        server.close()
        cluster.close()


def test_the_token_is_inherited_else_derived_from_the_cluster_key(monkeypatch):
    keys = CurveKeys.generate()
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert group_token("d", None) == b""  # an insecure cluster
    derived = group_token("d", CurveSecurity(keys))
    assert len(derived) == 32 and derived == group_token("d", CurveSecurity(keys))
    assert derived != group_token("e", CurveSecurity(keys))  # another node's group
    assert derived != group_token("d", CurveSecurity(CurveKeys.generate()))
    monkeypatch.setenv(TOKEN_ENV, "ab" * 32)
    assert group_token("d", CurveSecurity(keys)) == bytes.fromhex("ab" * 32)


# ---- two real ranks and a stranger ----------------------------------------------------------
def _rank_main(rank: int, out_dir: str, keys: tuple[bytes, bytes]):
    security = CurveSecurity(CurveKeys(*keys))
    cfg = DecodeNodeConfig(name="d", host="127.0.0.1", ranks=2)
    out = Path(out_dir)
    if rank == 0:
        rendezvous = rendezvous_listener(cfg)
        (out / "port").write_text(str(rendezvous.getsockname()[1]))
    else:
        deadline = time.monotonic() + 60
        while not (out / "stranger-done").exists():  # the stranger went first
            assert time.monotonic() < deadline, "the stranger never finished"
            time.sleep(0.05)
        rendezvous = ("127.0.0.1", int((out / "port").read_text()))
    group = RankGroup(rank, 2, rendezvous, timeout_s=30, node="d", security=security)
    try:
        rows = group.all_gather([rank, 10 + rank])
        if rank == 0:
            (out / "gloo-ports").write_text(json.dumps(sorted(listening_sockets())))
        group.all_gather([0])
        deadline = time.monotonic() + 60
        while not (out / "junk-done").exists():
            assert time.monotonic() < deadline, "the junk never came"
            time.sleep(0.05)
        for i in range(20):  # the group keeps working
            after = group.all_gather([rank, i])
        refused = group.server.num_refused if rank == 0 else 0
        result = {"rows": rows, "after": after, "refused": refused}
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        group.close()


def _stranger(out: Path, keys: tuple[bytes, bytes]) -> None:
    """Waits for the store's port, then tries it: the cluster's keys but a wrong token, another
    key pair, and junk without any handshake."""
    deadline = time.monotonic() + 60
    while not (out / "port").exists() or not (out / "port").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    endpoint = f"tcp://127.0.0.1:{(out / 'port').read_text()}"
    rank_store.REPLY_TIMEOUT_S = 1.0
    for security, token in [
        (CurveSecurity(CurveKeys(*keys)), b"w" * 32),  # a cluster member, not of this run
        (CurveSecurity(CurveKeys.generate()), b"w" * 32),
    ]:
        store = AuthStore(endpoint, token, security, WAIT)
        try:
            with pytest.raises(dist.DistStoreError):
                store.set("rank_1/address", b"the stranger")
        finally:
            store.close()
    with socket.create_connection(("127.0.0.1", int((out / "port").read_text()))) as junk:
        junk.sendall(os.urandom(1024))
    (out / "stranger-done").write_text("1")


def test_a_stranger_is_refused_while_the_group_meets_and_works(tmp_path, monkeypatch):
    keys = CurveKeys.generate()
    monkeypatch.setenv(TOKEN_ENV, os.urandom(32).hex())  # this run's, inherited by the ranks
    ranks = mp.start_processes(
        _rank_main, args=(str(tmp_path), (keys.public, keys.secret)), nprocs=2, join=False,
        start_method="spawn",
    )  # fmt: skip
    try:
        _stranger(tmp_path, (keys.public, keys.secret))
        deadline = time.monotonic() + 60
        while not (tmp_path / "gloo-ports").exists():
            assert time.monotonic() < deadline, "the group never met"
            time.sleep(0.05)
        for addr, port in json.loads((tmp_path / "gloo-ports").read_text()):  # gloo's, and ours
            for junk in (b"", b"\x00" * 8, os.urandom(64), os.urandom(4096)):
                with socket.create_connection((addr, port)) as sock:
                    sock.sendall(junk)
        (tmp_path / "junk-done").write_text("1")
        while not ranks.join(timeout=60):
            pass
    finally:
        for proc in ranks.processes:
            if proc.is_alive():
                proc.kill()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rows"] for r in results] == [[[0, 10], [1, 11]]] * 2
    assert [r["after"] for r in results] == [[[0, 19], [1, 19]]] * 2
    assert results[0]["refused"] == 1  # the member without this run's token; the others
    # never got a frame through CURVE
