"""control.messaging: PUSH/PULL round trips over loopback, malformed frames dropped and counted,
every wait bounded (recv with nothing to read, send to a peer that is not reading: the send
never waits, its I/O thread drops after the timeout; a close is bounded and lets the queued
messages leave within its linger)."""

import time

import msgpack
import zmq

from control.messaging import PullSocket, PushSocket, QueueInbox, QueueOutbox, StageTimes
from control.protocol import Abort, Heartbeat, RequestTokens, StepTokens, encode


def test_push_pull_round_trip_over_tcp():
    pull = PullSocket("tcp://127.0.0.1:0")
    push = PushSocket(pull.endpoint)
    try:
        step = StepTokens.of([RequestTokens("a", [1, 2]), RequestTokens("b", [3], "stop")])
        sent = [step, Abort("a", "gone"), Heartbeat("n", "decode")]
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


# Port 1 is privileged and unused: the connection is refused forever, and no other test can bind
# it in the meantime (a freed ephemeral port could be taken by a parallel test).
GONE = "tcp://127.0.0.1:1"


def wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_send_to_a_peer_that_is_gone_drops_after_the_timeout():
    push = PushSocket(GONE, send_timeout=0.05, sndhwm=1)
    try:
        assert all(push.send(Abort(f"r{i}")) for i in range(5))  # queued: sends never wait
        # zmq queues up to sndhwm messages for the pending connection; the rest time out.
        wait_for(lambda: push.num_dropped >= 3)
    finally:
        push.close()


def test_a_slow_peer_never_blocks_the_sender_and_a_full_queue_drops_at_once():
    send_timeout = 30.0  # each message would wait this long in the sender's thread
    push = PushSocket(GONE, send_timeout=send_timeout, sndhwm=1, max_queued=2)
    started = time.monotonic()
    try:
        results = [push.send(Abort(f"r{i}")) for i in range(10)]
        # One in zmq, one waiting in the I/O thread, two queued: the others refused at once.
        assert results[:2] == [True, True] and results.count(False) >= 10 - 1 - 1 - 2
        assert push.num_dropped == results.count(False)
    finally:
        push.close()  # does not wait out the send timeout: the queued ones are dropped
    assert time.monotonic() - started < send_timeout  # a blocking send would take 30 s each
    assert push.num_dropped >= 8 and not push.send(Abort("late"))


def test_close_lets_queued_messages_leave_within_the_linger():
    pull = PullSocket("tcp://127.0.0.1:0")
    push = PushSocket(pull.endpoint)
    try:
        sent = [Abort(f"r{i}") for i in range(200)]
        for msg in sent:
            assert push.send(msg)
        push.linger(5.0)
        push.close()  # right away: most are still queued in the I/O thread or in zmq
        got = [pull.recv(5.0) for _ in sent]
        assert got == sent and push.num_dropped == 0
    finally:
        pull.close()


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
    step = StepTokens.of([RequestTokens("b", [1])])
    outbox.send(step)
    assert outbox.take(StepTokens) == [step] and outbox.take() == [Abort("b")]


def test_stage_times_keep_a_window_of_recent_means():
    times = StageTimes(window=2)
    for seconds in (1.0, 0.002, 0.004):
        times.add("queue", seconds)
    assert times.means() == {"queue": 3.0}
