"""The way back (`kv_cancel`), over both transports: when the receiver gives up on a transfer in
progress (cancel, deadline, incomplete KV at kv_done) it tells the sender of that rendezvous, and
only that one; with no frame seen, or nothing left to give up, it tells nobody; the sender keeps
what it would still send for it off the wire; frames that are not a valid kv_cancel are dropped
and counted by the sender, which goes on working.

Waits on zmq are a condition with a bound; "nothing else arrived" is checked behind a barrier (a
real cancel sent after the frames in question: one ROUTER -> DEALER pipe keeps its order).
"""

import time

import msgpack
import pytest
from kv_helpers import (
    TIMEOUT,
    cancels_of,
    chunk_frames,
    fingerprint,
    make_pool,
    random_rows,
    reserve,
    wait_until,
)

from kvtransfer import DropReason, Rendezvous, sender_core
from kvtransfer.wire import PROTOCOL_VERSION, HelloAck, KVCancel, KVDone, encode

DEFAULT_REASON = "cancelled by the decode node"


def expect(link, rdv, num_tokens=8, deadline_s=TIMEOUT):
    table = reserve(link.pool, num_tokens)
    link.receiver.expect(rdv, table, num_tokens, time.monotonic() + deadline_s)
    return table


def send_first_chunk(link, sender, rdv):
    """One chunk of `rdv` (tokens 0..3) from `sender`, handled by the receiver."""
    written = link.receiver.stats().chunks_written
    sender.send_chunk(rdv, 0, 0, random_rows(4, seed=rdv.room))
    wait_until(lambda: link.receiver.stats().chunks_written == written + 1, f"a chunk of {rdv}")


def barrier(link, sender=None, name="barrier"):
    """A real cancel to `sender` (the link's by default), after everything sent to it before:
    returns once it arrived, with whatever else arrived before it."""
    sender = sender or link.sender
    rdv = Rendezvous(name, 999)
    expect(link, rdv)
    send_first_chunk(link, sender, rdv)
    assert link.receiver.cancel(rdv, "barrier")
    cancels = cancels_of(sender, 1)
    deadline = time.monotonic() + TIMEOUT
    while cancels[-1][0] != rdv:
        assert time.monotonic() < deadline, f"the barrier never came: {cancels}"
        cancels += sender.poll_cancels()
    return cancels[:-1]


def test_cancel_reaches_the_sender_of_that_rendezvous(make_link):
    link = make_link(make_pool(page_size=3))
    other = link.connect_sender("other-prefill")
    try:
        a, b = Rendezvous("a", 1), Rendezvous("b", 2)
        expect(link, a)
        expect(link, b)
        send_first_chunk(link, link.sender, a)
        send_first_chunk(link, other, b)
        assert link.receiver.cancel(b, "aborted: client gone") is True
        assert cancels_of(other, 1) == [(b, "aborted: client gone")]
        assert link.receiver.cancel(a) is True
        assert cancels_of(link.sender, 1) == [(a, DEFAULT_REASON)]
        assert link.receiver.stats().num_cancels_sent == 2
        assert a not in link.sender._seq  # finished on the sender: its numbering is forgotten
        # What the prefill side would still send for them stays off the wire.
        link.sender.send_chunk(a, 0, 4, random_rows(4, seed=3))
        link.sender.send_done(a, 8, 1)
        other.send_abort(b, "too late")
        assert barrier(link) == [] and barrier(link, other, "barrier-2") == []
        assert link.dropped() == {}
    finally:
        other.close()


def test_expiry_and_incomplete_kv_tell_the_sender(make_link):
    link = make_link(make_pool(page_size=3))
    slow, short = Rendezvous("slow", 1), Rendezvous("short", 2)
    expect(link, slow, deadline_s=0.5)
    expect(link, short)
    send_first_chunk(link, link.sender, slow)
    send_first_chunk(link, link.sender, short)
    link.sender.send_done(short, 8, 3)  # tokens 4..7 never sent
    events = []
    while len(events) < 2:
        events += link.receiver.poll(TIMEOUT) or pytest.fail("no event")
    assert not any(e.is_ready for e in events)
    told = dict(cancels_of(link.sender, 2))
    assert "timed out" in told[slow]
    assert "incomplete, layer 0 token 4 never arrived" in told[short]
    assert link.receiver.stats().num_cancels_sent == 2


def test_nobody_is_told_without_a_frame_or_a_transfer_to_stop(make_link):
    link = make_link(make_pool(page_size=3))
    receiver = link.receiver
    quiet = Rendezvous("quiet", 1)  # expected, nothing arrived: no peer to tell
    expect(link, quiet)
    assert receiver.cancel(quiet) is True
    assert receiver.cancel(Rendezvous("never", 2)) is False
    live = Rendezvous("live", 3)  # a cancel naming another room leaves it alone
    expect(link, live)
    send_first_chunk(link, link.sender, live)
    assert receiver.cancel(Rendezvous("live", 4)) is False
    done = Rendezvous("done", 5)  # complete: P is done with it, whether polled yet or not
    expect(link, done, num_tokens=4)
    send_first_chunk(link, link.sender, done)
    link.sender.send_done(done, 4, 7)
    wait_until(lambda: receiver.stats().num_ready == 1, "the complete transfer")
    assert receiver.cancel(done) is True  # takes the unpolled event back; P needs no word
    aborted = Rendezvous("aborted", 6)  # P gave up itself: no answer
    expect(link, aborted)
    send_first_chunk(link, link.sender, aborted)
    link.sender.send_abort(aborted, "client gone")
    (event,) = receiver.poll(TIMEOUT)
    assert event.rendezvous == aborted and not event.is_ready
    assert receiver.cancel(aborted) is False
    assert barrier(link) == []
    assert receiver.stats().num_cancels_sent == 1  # the barrier's
    link.sender.send_chunk(live, 0, 4, random_rows(4, seed=9))  # still served in full
    link.sender.send_done(live, 8, 2)
    (event,) = receiver.poll(TIMEOUT)
    assert event.rendezvous == live and event.is_ready and event.first_token == 2


def test_cancels_queued_just_before_close_still_go_out(make_link):
    """The decode node cancels what it holds, then closes its receiver at once."""
    link = make_link(make_pool(page_size=3))
    rdv = Rendezvous("shutdown", 1)
    expect(link, rdv)
    send_first_chunk(link, link.sender, rdv)
    assert link.receiver.cancel(rdv, "the decode node is shutting down")
    link.receiver.close()
    assert cancels_of(link.sender, 1) == [(rdv, "the decode node is shutting down")]


def test_a_sender_that_is_gone_costs_nothing(make_link):
    link = make_link(make_pool(page_size=3))
    rdv = Rendezvous("orphan", 1)
    expect(link, rdv)
    send_first_chunk(link, link.sender, rdv)
    link.sender.close()
    start = time.monotonic()
    assert link.receiver.cancel(rdv) is True  # best effort: never blocks, never raises
    assert time.monotonic() - start < 0.5
    fresh = link.connect_sender("fresh-prefill")  # the receiver serves on
    try:
        assert barrier(link, fresh) == []
    finally:
        fresh.close()


def _with_field(frame, **fields):
    head = msgpack.unpackb(frame)
    head.update(fields)
    return msgpack.packb(head)


CANCEL = encode(KVCancel(Rendezvous("x", 1), "stop"))

# name -> (frames the receiver's side sends, the sender's drop reason)
BAD = {
    "garbage": ([b"\xc1\x00junk"], DropReason.MALFORMED),
    "not a map": ([msgpack.packb([1, 2])], DropReason.MALFORMED),
    "empty frame": ([b""], DropReason.MALFORMED),
    "other version": ([_with_field(CANCEL, v=PROTOCOL_VERSION + 1)], DropReason.BAD_VERSION),
    "corrupted header": ([_with_field(CANCEL, room=2)], DropReason.BAD_CHECKSUM),
    "missing field": (
        [msgpack.packb({k: v for k, v in msgpack.unpackb(CANCEL).items() if k != "reason"})],
        DropReason.MALFORMED,
    ),
    "extra frame": ([CANCEL, b"x"], DropReason.MALFORMED),
    "a stray hello_ack": ([encode(HelloAck(True, fingerprint()))], DropReason.MALFORMED),
    "a kv_done": ([encode(KVDone(Rendezvous("x", 1), 0, 4, 1))], DropReason.MALFORMED),
    "a kv_chunk": (
        chunk_frames(Rendezvous("x", 1), 0, 0, random_rows(2, seed=1)),
        DropReason.MALFORMED,
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_frames_to_the_sender_are_dropped_and_counted(make_link, case):
    frames, reason = BAD[case]
    link = make_link(make_pool(page_size=3))
    link.to_sender(frames)
    assert barrier(link) == []  # nothing queued for the prefill loop
    assert link.sender.dropped() == {reason: 1}
    rdv = Rendezvous("after", 1)  # the sender works on
    expect(link, rdv, num_tokens=4)
    link.sender.send_chunk(rdv, 0, 0, random_rows(4, seed=2))
    link.sender.send_done(rdv, 4, 5)
    (event,) = link.receiver.poll(TIMEOUT)
    assert event.is_ready and event.rendezvous == rdv


def test_repeated_and_unknown_cancels_are_queued_once(make_link):
    """The sender does not know which rendezvous its caller still holds: a cancel of one it
    never sent is handed on (the prefill node ignores it); the same cancel twice, once."""
    link = make_link(make_pool(page_size=3))
    unknown = Rendezvous("never-sent", 1)
    link.to_sender([encode(KVCancel(unknown, "?"))])
    link.to_sender([encode(KVCancel(unknown, "again"))])
    assert barrier(link) == [(unknown, "?")]
    assert link.sender.dropped() == {}


def test_a_flood_of_cancels_is_bounded(make_link, monkeypatch):
    monkeypatch.setattr(sender_core, "MAX_PENDING_CANCELS", 3)
    link = make_link(make_pool(page_size=3))
    for i in range(5):
        link.to_sender([encode(KVCancel(Rendezvous("flood", i), ""))])
    wait_until(lambda: link.sender.dropped().get(DropReason.OVERFLOW) == 2, "two overflows")
    assert [rdv.room for rdv, _ in link.sender.poll_cancels()] == [0, 1, 2]
