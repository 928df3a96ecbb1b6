"""engine.messaging: PUSH/PULL round trips over loopback, malformed frames dropped and counted,
every wait bounded (recv with nothing to read, send to a peer that is not reading)."""

import time

import msgpack
import zmq

from engine.messaging import PullSocket, PushSocket, QueueInbox, QueueOutbox, StageTimes
from engine.protocol import Abort, Heartbeat, Tokens, encode


def test_push_pull_round_trip_over_tcp():
    pull = PullSocket("tcp://127.0.0.1:0")
    push = PushSocket(pull.endpoint)
    try:
        sent = [Tokens("a", [1, 2], None), Abort("a", "gone"), Heartbeat("n", "decode")]
        for msg in sent:
            assert push.send(msg)
        got = [pull.recv(5.0) for _ in sent]
        assert got == sent
    finally:
        push.close()
        pull.close()


def test_malformed_frames_are_dropped_and_counted():
    pull = PullSocket("tcp://127.0.0.1:0")
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(pull.endpoint)
    try:
        raw.send(b"\xc1 not msgpack")
        raw.send_multipart([b"two", b"frames"])
        # Found by the e2e fuzzer: bytes and str field names together once raised TypeError.
        raw.send(msgpack.packb({"type": "Abort", b"x": 1, "y": 2}, use_bin_type=True))
        raw.send(encode(Abort("ok")))  # the same pipe: it arrives after the bad frames
        msg = pull.recv(5.0)
        while msg is None:  # the bad frames come first; recv drops them and keeps waiting
            msg = pull.recv(5.0)
        assert msg == Abort("ok") and pull.num_malformed == 3
    finally:
        raw.close()
        pull.close()


def test_recv_with_nothing_to_read_returns_none_in_time():
    pull = PullSocket("tcp://127.0.0.1:0")
    started = time.monotonic()
    assert pull.recv(0.05) is None
    assert time.monotonic() - started < 1.0
    pull.close()


def test_send_to_a_peer_that_is_gone_drops_after_the_timeout():
    # Port 1 is privileged and unused: the connection is refused forever, and no other test can
    # bind it in the meantime (a freed ephemeral port could be taken by a parallel test).
    endpoint = "tcp://127.0.0.1:1"
    push = PushSocket(endpoint, send_timeout=0.05, sndhwm=1)
    try:
        started = time.monotonic()
        results = [push.send(Tokens("a", [1])) for _ in range(5)]
        # zmq queues up to sndhwm messages for the pending connection; the rest time out.
        assert results.count(False) >= 3 and push.num_dropped == results.count(False)
        assert time.monotonic() - started < 2.0
    finally:
        push.close()


def test_a_bad_endpoint_is_one_line_error():
    try:
        PullSocket("tcp://256.0.0.1:1")
    except OSError as exc:
        assert "cannot bind tcp://256.0.0.1:1" in str(exc)
    else:
        raise AssertionError("expected OSError")


def test_queues_round_trip_through_the_codec():
    inbox, outbox = QueueInbox(), QueueOutbox()
    inbox.put(Abort("a"))
    assert inbox.recv(0.0) == Abort("a") and inbox.recv(0.0) is None
    outbox.send(Abort("b"))
    outbox.send(Tokens("b", [1]))
    assert outbox.take(Tokens) == [Tokens("b", [1])] and outbox.take() == [Abort("b")]


def test_stage_times_keep_a_window_of_recent_means():
    times = StageTimes(window=2)
    for seconds in (1.0, 0.002, 0.004):
        times.add("queue", seconds)
    assert times.means() == {"queue": 3.0}
