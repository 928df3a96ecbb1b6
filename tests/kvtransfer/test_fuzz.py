"""Hostile and broken input: each bad message is dropped and counted, no page of any request is
touched by it, and the receiver goes on serving (the same request and others) afterwards."""

import time

import msgpack
import pytest
import torch
from kv_helpers import (
    NUM_LAYERS,
    ROW_WIDTH,
    TIMEOUT,
    Link,
    fingerprint,
    make_pool,
    random_rows,
    reserve,
    wait_until,
)

from kvtransfer import DropReason, InprocReceiver, Rendezvous
from kvtransfer.wire import (
    PROTOCOL_VERSION,
    Hello,
    HelloAck,
    KVCancel,
    KVDone,
    build_chunk,
    decode,
    encode,
)

A = Rendezvous("victim", 77)
A_LEN = 12


def chunk_frames(rows, seq=0, layer_start=0, token_start=0, rdv=A):
    chunk, payload = build_chunk(rdv, seq, layer_start, token_start, rows)
    return [encode(chunk), bytes(payload)]


def flipped(frames):
    payload = bytearray(frames[1])
    payload[len(payload) // 2] ^= 0x40
    return [frames[0], bytes(payload)]


def other_version(frames):
    head = msgpack.unpackb(frames[0])
    head["v"] = PROTOCOL_VERSION + 1
    return [msgpack.packb(head), frames[1]]


def with_field(frames, **fields):
    """The message with header fields changed and its `hcrc` left as it was (corrupted)."""
    head = msgpack.unpackb(frames[0])
    head.update(fields)
    return [msgpack.packb(head), *frames[1:]]


ROWS = random_rows(4, seed=100)
GOOD = chunk_frames(ROWS)

# name -> (messages to send, expected drop reason, tokens of A validly written by them)
CASES = {
    "garbage header": ([[b"\xc1\x00junk", GOOD[1]]], DropReason.MALFORMED, 0),
    "header not a map": ([[msgpack.packb([1, 2]), GOOD[1]]], DropReason.MALFORMED, 0),
    "other version": ([other_version(GOOD)], DropReason.BAD_VERSION, 0),
    "truncated payload": ([[GOOD[0], GOOD[1][:-1]]], DropReason.TRUNCATED, 0),
    "missing payload": ([[GOOD[0]]], DropReason.TRUNCATED, 0),
    "oversized payload": ([[GOOD[0], GOOD[1] + b"\0\0"]], DropReason.OVERSIZED, 0),
    "extra frame": ([GOOD + [b"x"]], DropReason.MALFORMED, 0),
    "bad checksum": ([flipped(GOOD)], DropReason.BAD_CHECKSUM, 0),
    "corrupted chunk header": ([with_field(GOOD, seq=5)], DropReason.BAD_CHECKSUM, 0),
    "corrupted done header": (
        [with_field([encode(KVDone(A, 0, A_LEN, 5))], first_token=6)],
        DropReason.BAD_CHECKSUM,
        0,
    ),
    "replayed chunk": ([GOOD, GOOD], DropReason.DUPLICATE, 4),
    "overlapping chunk": (
        [GOOD, chunk_frames(random_rows(4, seed=101), seq=1, token_start=2)],
        DropReason.DUPLICATE,
        4,
    ),
    "unknown room": ([chunk_frames(ROWS, rdv=Rendezvous("victim", 78))], "unknown_rendezvous", 0),
    "tokens past reservation": (
        [chunk_frames(ROWS, token_start=A_LEN - 2)],
        DropReason.TOKENS_OUT_OF_RANGE,
        0,
    ),
    "layers past pool": (
        [chunk_frames(random_rows(4, seed=1, num_layers=3), layer_start=2)],
        DropReason.LAYERS_OUT_OF_RANGE,
        0,
    ),
    "wrong dtype": ([chunk_frames(ROWS.to(torch.float16))], DropReason.BAD_DTYPE, 0),
    "wrong row width": ([chunk_frames(ROWS[:, :, :16])], DropReason.BAD_ROW_WIDTH, 0),
    "done for unknown room": (
        [[encode(KVDone(Rendezvous("victim", 1), 0, A_LEN, 1))]],
        "unknown_rendezvous",
        0,
    ),
    "hello_ack sent to a receiver": (
        [[encode(HelloAck(True, fingerprint()))]],
        DropReason.MALFORMED,
        0,
    ),
    "kv_cancel sent to a receiver": ([[encode(KVCancel(A, "stop"))]], DropReason.MALFORMED, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_message_dropped_counted_and_harmless(make_link, case):
    messages, reason, written = CASES[case]
    link = make_link(make_pool(page_size=3))
    deadline = time.monotonic() + TIMEOUT

    # A neighbour request completes first; its pages must not change afterwards.
    b = Rendezvous("neighbour", 1)
    tb, rows_b = reserve(link.pool, 9), random_rows(9, seed=200)
    link.receiver.expect(b, tb, 9, deadline)
    link.sender.send_chunk(b, 0, 0, rows_b)
    link.sender.send_done(b, 9, 1)
    assert link.receiver.poll(TIMEOUT)[0].is_ready

    ta = reserve(link.pool, A_LEN)
    link.receiver.expect(A, ta, A_LEN, deadline)
    for frames in messages:
        link.raw_send(frames)

    assert link.dropped() == {reason: 1}
    assert link.receiver.poll() == []
    assert torch.equal(link.pool.read_rows(tb, 0, NUM_LAYERS, 0, 9), rows_b)
    rows_a = link.pool.read_rows(ta, 0, NUM_LAYERS, 0, A_LEN)
    assert torch.equal(rows_a[:, :written], ROWS[:, :written])
    assert not rows_a[:, written:].any()

    if written:  # A's numbering is used up by the raw peer: finish another request instead
        assert link.receiver.cancel(A)
        a2, ta = Rendezvous("victim-2", 1), reserve(link.pool, A_LEN)
    else:  # the same request can still complete from its real sender
        a2 = A
    if a2 != A:
        link.receiver.expect(a2, ta, A_LEN, deadline)
    good_rows = random_rows(A_LEN, seed=300)
    link.sender.send_chunk(a2, 0, 0, good_rows[:, :5])
    link.sender.send_chunk(a2, 0, 5, good_rows[:, 5:])
    link.sender.send_done(a2, A_LEN, 9)
    event = link.receiver.poll(TIMEOUT)[0]
    assert event.is_ready and event.rendezvous == a2
    assert torch.equal(link.pool.read_rows(ta, 0, NUM_LAYERS, 0, A_LEN), good_rows)
    assert torch.equal(link.pool.read_rows(tb, 0, NUM_LAYERS, 0, 9), rows_b)


def test_failed_chunk_is_named_when_the_request_fails(make_link):
    link = make_link(make_pool(page_size=3))
    link.receiver.expect(A, reserve(link.pool, A_LEN), A_LEN, time.monotonic() + TIMEOUT)
    link.raw_send(flipped(GOOD))
    link.raw_send([encode(KVDone(A, 1, A_LEN, 3))])
    event = link.receiver.poll(TIMEOUT)[0]
    assert not event.is_ready and "first dropped chunk: bad_checksum" in event.reason


def test_internal_error_is_counted_and_survived(make_link, monkeypatch):
    link = make_link(make_pool(page_size=3))
    table = reserve(link.pool, A_LEN)
    link.receiver.expect(A, table, A_LEN, time.monotonic() + TIMEOUT)
    real_write = link.pool.write_rows
    calls = []

    def failing_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated bug")
        return real_write(*args)

    monkeypatch.setattr(link.pool, "write_rows", failing_once)
    link.raw_send(GOOD)
    assert link.dropped() == {DropReason.INTERNAL: 1}
    rows = random_rows(A_LEN, seed=5)
    link.sender.send_chunk(A, 0, 0, rows)
    link.sender.send_done(A, A_LEN, 2)
    assert link.receiver.poll(TIMEOUT)[0].is_ready
    assert torch.equal(link.pool.read_rows(table, 0, NUM_LAYERS, 0, A_LEN), rows)


def test_zmq_peer_without_handshake_is_ignored():
    link = Link("zmq", make_pool(page_size=3))
    table = reserve(link.pool, A_LEN)
    link.receiver.expect(A, table, A_LEN, time.monotonic() + TIMEOUT)
    stranger = link.raw_socket_without_hello()
    refused = link.raw_socket_without_hello()
    try:
        stranger.send_multipart(GOOD)
        refused.send(encode(Hello("other-model", fingerprint(row_width=ROW_WIDTH + 1))))
        assert refused.poll(int(TIMEOUT * 1000))
        assert not decode(refused.recv()).ok
        refused.send_multipart(GOOD)
        wait_until(lambda: link.dropped().get("no_handshake", 0) == 2, "two no_handshake drops")
        assert not link.pool.read_rows(table, 0, NUM_LAYERS, 0, A_LEN).any()
    finally:
        stranger.close(linger=0)
        refused.close(linger=0)
        link.close()


def test_hello_of_another_version_gets_a_refusal():
    receiver = InprocReceiver(make_pool(page_size=3), fingerprint())
    try:
        head = msgpack.unpackb(encode(Hello("future-prefill", fingerprint())))
        head["v"] = PROTOCOL_VERSION + 1
        ack = receiver.receive([msgpack.packb(head)], is_peer_known=False)
        assert isinstance(ack, HelloAck) and not ack.ok
        assert f"protocol version {PROTOCOL_VERSION + 1}" in ack.error
        assert receiver.stats().dropped == {DropReason.BAD_VERSION: 1}
    finally:
        receiver.close()
