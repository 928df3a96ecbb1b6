"""ZeroMQ KV transfer over CURVE: with the cluster keys a transfer lands exactly; a sender of
another cluster, an impostor (the cluster's public key, its own key pair) and a plain sender all
fail the handshake with a KVTransferError, and a plain raw peer's hello and chunk never reach the
receiver (its counters stay at zero, the reserved pages stay untouched)."""

import time

import pytest
import zmq
from kv_helpers import TIMEOUT, fingerprint, make_pool, random_rows, reserve, wait_until

from control.security import CurveKeys, CurveSecurity
from kvtransfer import KVTransferError, Rendezvous, ZmqReceiver, ZmqSender
from kvtransfer.wire import Hello, build_chunk, encode

REFUSED_TIMEOUT = 1.0  # a refused sender's handshake wait (it must fail, not hang)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def cluster(ctx):
    security = CurveSecurity(CurveKeys.generate())
    yield security
    security.close()


@pytest.fixture
def receiver(ctx, cluster):
    recv = ZmqReceiver(make_pool(page_size=3), fingerprint(), context=ctx, security=cluster)
    yield recv
    recv.close(timeout=TIMEOUT)


class _Impostor:
    """A client that knows the cluster's public key but holds its own key pair (what a
    ZmqSender asks of its `security`: `client(sock)`)."""

    def __init__(self, cluster_public: bytes):
        self.server_key, self.own = cluster_public, CurveKeys.generate()

    def client(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.server_key
        sock.curve_publickey, sock.curve_secretkey = self.own.public, self.own.secret


def test_a_transfer_with_the_cluster_keys_lands(ctx, cluster, receiver):
    sender = ZmqSender("p", context=ctx, security=cluster)
    try:
        sender.connect(receiver.endpoint, fingerprint(), TIMEOUT)
        table = reserve(receiver.pool, 5)
        rdv, rows = Rendezvous("r", 1), random_rows(5, seed=1)
        receiver.expect(rdv, table, 5, time.monotonic() + TIMEOUT)
        sender.send_chunk(rdv, 0, 0, rows)
        sender.send_done(rdv, 5, 7)
        sender.flush(TIMEOUT)
        (event,) = receiver.poll(TIMEOUT)
        assert event.is_ready and event.first_token == 7
        assert receiver.pool.read_rows(table, 0, 4, 0, 5).equal(rows)
    finally:
        sender.close(timeout=TIMEOUT)


@pytest.mark.parametrize("who", ["other-cluster", "impostor", "plain"])
def test_senders_without_the_cluster_keys_are_refused(ctx, cluster, receiver, who):
    security = {
        "other-cluster": CurveSecurity(CurveKeys.generate()),
        "impostor": _Impostor(cluster.keys.public),
        "plain": None,
    }[who]
    sender = ZmqSender("rogue", context=ctx, security=security)
    try:
        with pytest.raises(KVTransferError, match="no connection"):
            sender.connect(receiver.endpoint, fingerprint(), REFUSED_TIMEOUT)
    finally:
        sender.close(timeout=TIMEOUT)
    if who == "impostor":
        wait_until(lambda: cluster.num_refused >= 1, "the ZAP refusal")
    stats = receiver.stats()
    assert stats.bytes_received == 0 and stats.num_dropped == 0


def test_a_plain_raw_peer_reaches_nothing(ctx, cluster, receiver):
    table = reserve(receiver.pool, 3)
    rdv = Rendezvous("victim", 2)
    receiver.expect(rdv, table, 3, time.monotonic() + TIMEOUT)
    before = receiver.pool.read_rows(table, 0, 4, 0, 3).clone()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    monitor = raw.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    try:
        raw.connect(receiver.endpoint)
        raw.send(encode(Hello(sender="rogue", fingerprint=fingerprint())), flags=zmq.NOBLOCK)
        header, payload = build_chunk(rdv, 0, 0, 0, random_rows(3, seed=9))
        raw.send_multipart([encode(header), payload], flags=zmq.NOBLOCK)
        assert monitor.poll(int(TIMEOUT * 1000)), "the plain peer's handshake never failed"
    finally:
        raw.disable_monitor()
        monitor.close(linger=0)
        raw.close()
    stats = receiver.stats()
    assert stats.bytes_received == 0 and stats.num_dropped == 0
    assert receiver.pool.read_rows(table, 0, 4, 0, 3).equal(before)
    assert receiver.cancel(rdv)  # still expected: nothing completed or failed it
