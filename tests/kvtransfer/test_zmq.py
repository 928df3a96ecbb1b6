"""ZeroMQ transport only: bounded waits when the peer is missing or goes away, clean shutdown."""

import socket
import time

import pytest
import torch
from kv_helpers import TIMEOUT, fingerprint, make_pool, random_rows, reserve, wait_until

from kvtransfer import KVTransferError, Rendezvous, ZmqReceiver, ZmqSender


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connect_to_nobody_times_out():
    sender = ZmqSender()
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    start = time.monotonic()
    with pytest.raises(KVTransferError, match=f"{endpoint}.*timed out"):
        sender.connect(endpoint, fingerprint(), timeout=0.3)
    assert time.monotonic() - start < 2.0
    sender.close()


def test_bad_endpoint_is_a_clear_error():
    sender = ZmqSender()
    with pytest.raises(KVTransferError, match="KV handshake with nowhere failed"):
        sender.connect("nowhere", fingerprint(), timeout=0.3)
    sender.close()


def test_bind_twice_is_a_clear_error():
    first = ZmqReceiver(make_pool(page_size=3), fingerprint())
    try:
        with pytest.raises(KVTransferError, match="cannot bind KV endpoint"):
            ZmqReceiver(make_pool(page_size=3), fingerprint(), first.endpoint)
    finally:
        first.close()


def test_receiver_gone_breaks_the_sender_within_its_timeout():
    receiver = ZmqReceiver(make_pool(page_size=3), fingerprint())
    sender = ZmqSender(send_timeout=0.3, queue_size=2, sndhwm=1)
    sender.connect(receiver.endpoint, fingerprint(), TIMEOUT)
    receiver.close()
    rdv = Rendezvous("orphan", 1)
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="no progress|full|dropped"):
        for i in range(100):  # zmq buffers a few; then the sender must notice, not hang
            sender.send_chunk(rdv, 0, i, random_rows(1, seed=i))
        sender.flush(TIMEOUT)
    assert time.monotonic() - start < TIMEOUT
    with pytest.raises(KVTransferError):
        sender.send_done(rdv, 1, 1)  # broken for good
    sender.close()
    assert not sender._thread.is_alive()


def test_close_joins_threads_and_is_idempotent():
    receiver = ZmqReceiver(make_pool(page_size=3), fingerprint())
    sender = ZmqSender()
    sender.connect(receiver.endpoint, fingerprint(), TIMEOUT)
    table = reserve(receiver.pool, 4)
    rdv = Rendezvous("r", 1)
    receiver.expect(rdv, table, 4, time.monotonic() + TIMEOUT)
    sender.send_chunk(rdv, 0, 0, random_rows(4, seed=1))
    sender.send_done(rdv, 4, 1)
    sender.flush(TIMEOUT)
    assert receiver.poll(TIMEOUT)[0].is_ready
    for _ in range(2):
        sender.close(timeout=TIMEOUT)
        receiver.close(timeout=TIMEOUT)
    assert not sender._thread.is_alive() and not receiver._thread.is_alive()


def test_two_senders_one_receiver():
    receiver = ZmqReceiver(make_pool(page_size=3, num_pages=32), fingerprint())
    senders = [ZmqSender(f"prefill-{i}") for i in range(2)]
    try:
        rows = {}
        for i, sender in enumerate(senders):
            sender.connect(receiver.endpoint, fingerprint(), TIMEOUT)
            rdv = Rendezvous(f"req-{i}", i)
            table = reserve(receiver.pool, 20)
            receiver.expect(rdv, table, 20, time.monotonic() + TIMEOUT)
            rows[rdv] = (table, random_rows(20, seed=i))
        for i, sender in enumerate(senders):
            rdv = Rendezvous(f"req-{i}", i)
            sender.send_chunk(rdv, 0, 0, rows[rdv][1][:, :10])
            sender.send_chunk(rdv, 0, 10, rows[rdv][1][:, 10:])
            sender.send_done(rdv, 20, i)
        events = []
        while len(events) < 2:
            events += receiver.poll(TIMEOUT) or pytest.fail("no event")
        assert all(e.is_ready for e in events)
        for table, expected in rows.values():
            assert receiver.pool.read_rows(table, 0, 4, 0, 20).equal(expected)
    finally:
        for sender in senders:
            sender.close()
        receiver.close()


def test_wildcard_bind_advertises_a_reachable_host():
    receiver = ZmqReceiver(
        make_pool(page_size=3), fingerprint(), "tcp://0.0.0.0:0", advertise_host="127.0.0.1"
    )
    sender = ZmqSender()
    try:
        assert receiver.endpoint.startswith("tcp://127.0.0.1:")
        sender.connect(receiver.endpoint, fingerprint(), TIMEOUT)
    finally:
        sender.close()
        receiver.close()


def test_no_write_after_cancel_returns():
    """The guarantee the decode node frees pages on: once cancel returns, the pages stay still."""
    receiver = ZmqReceiver(make_pool(page_size=3, num_pages=80), fingerprint())
    sender = ZmqSender()
    try:
        sender.connect(receiver.endpoint, fingerprint(), TIMEOUT)
        rdv, num_tokens = Rendezvous("racy", 1), 200
        table = reserve(receiver.pool, num_tokens)
        receiver.expect(rdv, table, num_tokens, time.monotonic() + TIMEOUT)
        rows = random_rows(num_tokens, seed=3)
        for t in range(num_tokens):
            sender.send_chunk(rdv, 0, t, rows[:, t : t + 1])
        wait_until(lambda: receiver.stats().chunks_written >= 5, "some chunks written")
        assert receiver.cancel(rdv)
        snapshot = receiver.pool.read_rows(table, 0, 4, 0, num_tokens)
        sender.flush(TIMEOUT)  # every chunk handed to zmq, or skipped once the kv_cancel came
        # A barrier: one DEALER's messages are handled in order, so once a later transfer from
        # the same sender is ready, every chunk of `rdv` that went on the wire was handled.
        barrier = Rendezvous("barrier", 2)
        receiver.expect(barrier, reserve(receiver.pool, 1), 1, time.monotonic() + TIMEOUT)
        sender.send_chunk(barrier, 0, 0, random_rows(1, seed=4))
        sender.send_done(barrier, 1, 1)
        assert receiver.poll(TIMEOUT)[0].rendezvous == barrier
        assert torch.equal(receiver.pool.read_rows(table, 0, 4, 0, num_tokens), snapshot)
        stats = receiver.stats()  # each chunk of `rdv` written, dropped, or kept off the wire
        assert stats.chunks_written - 1 + stats.dropped.get("unknown_rendezvous", 0) <= num_tokens
    finally:
        sender.close()
        receiver.close()
