"""Tiny ZeroMQ PUSH/PULL wrappers for the control plane (protocol messages only).

Every call is bounded: `recv` waits at most its timeout. `send` never waits: it encodes the
message and queues it for the socket's own I/O thread, which waits at most the send timeout for
room in zmq's queue and then drops the message; a full queue (the peer has not read for a
while) drops at once. Both drops are counted in `num_dropped`, so a node loop never stalls on a
slow router, nor hangs on one that is gone. Closing is bounded too. A zmq socket belongs to the
one thread that uses it (zmq sockets are not thread-safe): a PullSocket to its caller's, a
PushSocket's to its I/O thread.

Queues with the same interface (`QueueInbox`, `QueueOutbox`) let tests run a node loop with no
sockets at all.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any, Protocol

import zmq

from control import protocol
from control.protocol import ProtocolError
from control.security import CurveSecurity, curve_client, curve_server

log = logging.getLogger(__name__)

POLL_SLICE_MS = 50  # a PushSocket's I/O thread checks for a close this often while it waits


class Inbox(Protocol):
    num_malformed: int  # frames dropped as not a valid message (reported in heartbeats)

    def recv(self, timeout: float) -> Any | None:
        """The next message, or None after `timeout` seconds (0: never blocks)."""

    def close(self) -> None: ...


class Outbox(Protocol):
    def send(self, msg: Any) -> bool:
        """Queue `msg`; False if it had to be dropped (peer gone or not reading)."""

    def close(self) -> None: ...


class PullSocket:
    """Binds (or connects) a PULL socket and yields decoded protocol messages.

    A frame that is not a valid message is dropped, counted in `num_malformed` and logged: a
    bad peer never reaches the loop. With `security`, the socket is CURVE (the server when
    binding): a peer without the cluster keys never gets a frame through.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        bind: bool = True,
        context: zmq.Context | None = None,
        security: CurveSecurity | None = None,
    ):
        self._sock = (context or zmq.Context.instance()).socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        (curve_server if bind else curve_client)(self._sock, security)
        try:
            self._sock.bind(endpoint) if bind else self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            verb = "bind" if bind else "connect to"
            raise OSError(f"cannot {verb} {endpoint}: {exc}") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.num_malformed = 0

    def recv(self, timeout: float) -> Any | None:
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(left_ms, zmq.POLLIN):
                return None
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                continue
            try:
                if len(frames) != 1:
                    raise ProtocolError(f"expected 1 frame, got {len(frames)}")
                return protocol.decode(frames[0])
            except ProtocolError as exc:
                self.num_malformed += 1
                log.warning("dropped a malformed control message on %s: %s", self.endpoint, exc)
                if time.monotonic() >= deadline:
                    return None

    def close(self) -> None:
        self._sock.close(linger=0)


class PushSocket:
    """Connects (or binds) a PUSH socket that sends protocol messages from an I/O thread.

    `send` queues the encoded frame (up to `max_queued` of them) and returns at once; the
    thread hands frames to zmq in order, which queues up to `sndhwm` more while the peer is slow
    or not yet up. Beyond that the thread waits `send_timeout` seconds per frame, then drops it.
    With `security`, the socket is CURVE (the client when connecting).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        bind: bool = False,
        send_timeout: float = 1.0,
        sndhwm: int = 10000,
        max_queued: int = 10000,
        context: zmq.Context | None = None,
        security: CurveSecurity | None = None,
    ):
        sock = (context or zmq.Context.instance()).socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        (curve_server if bind else curve_client)(sock, security)
        try:
            sock.bind(endpoint) if bind else sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            verb = "bind" if bind else "connect to"
            raise OSError(f"cannot {verb} {endpoint}: {exc}") from None
        self.endpoint = endpoint
        self.send_timeout = send_timeout
        self.max_queued = max_queued
        self._frames: collections.deque[tuple[bytes, str]] = collections.deque()
        self._wake = threading.Condition()
        self._close_by: float | None = None  # set by close(): when queued frames are given up
        self._linger_s = 0.0
        self._num_refused = 0  # counted by the caller's thread: the queue was full
        self._num_timed_out = 0  # counted by the I/O thread: zmq had no room in time
        # The socket is handed over before its first use there (starting the thread is the
        # memory barrier zmq asks for) and never touched by this thread again.
        self._thread = threading.Thread(
            target=self._serve, args=(sock,), name=f"push-{endpoint}", daemon=True
        )
        self._thread.start()

    @property
    def num_dropped(self) -> int:
        """Messages dropped so far: refused with the queue full, or timed out in zmq."""
        return self._num_refused + self._num_timed_out

    def send(self, msg: Any) -> bool:
        """Queues `msg` for the I/O thread; False (dropped, counted) if the queue is full or
        the socket is closing. Never blocks."""
        frame = protocol.encode(msg)  # a non-message raises here, in the caller
        name = type(msg).__name__
        with self._wake:
            if self._close_by is None and len(self._frames) < self.max_queued:
                self._frames.append((frame, name))
                self._wake.notify()
                return True
            self._num_refused += 1
        log.warning(
            "dropped %s to %s: %d messages already queued", name, self.endpoint, self.max_queued
        )
        return False

    def linger(self, timeout: float) -> None:
        """Give queued messages up to `timeout` seconds to leave at close (best effort)."""
        self._linger_s = max(0.0, timeout)

    def close(self) -> None:
        """Stops the I/O thread: what was queued before has the linger time to leave (none by
        default), the rest is dropped. Returns within about the linger plus a second."""
        with self._wake:
            if self._close_by is None:
                self._close_by = time.monotonic() + self._linger_s
            self._wake.notify()
        self._thread.join(self._linger_s + 1.0)

    def _serve(self, sock: zmq.Socket) -> None:
        try:
            while True:
                with self._wake:
                    while not self._frames and self._close_by is None:
                        self._wake.wait()
                    if not self._frames:  # closing, and everything queued has been handled
                        break
                    frame, name = self._frames.popleft()
                self._send_frame(sock, frame, name)
        except zmq.ZMQError as exc:  # the context was terminated under it: sends are dropped
            log.error("the socket to %s stopped: %s", self.endpoint, exc)
            with self._wake:
                self._close_by = self._close_by or time.monotonic()
        finally:
            left = 0.0 if self._close_by is None else self._close_by - time.monotonic()
            sock.close(linger=int(max(0.0, left) * 1000))

    def _send_frame(self, sock: zmq.Socket, frame: bytes, name: str) -> None:
        """Waits for room in zmq's queue up to the send timeout (or the close's linger), in
        short slices so that a close never waits for a whole send timeout."""
        give_up = time.monotonic() + self.send_timeout
        while True:
            close_by = self._close_by
            end = give_up if close_by is None else min(give_up, close_by)
            left_ms = int((end - time.monotonic()) * 1000)
            if sock.poll(max(0, min(left_ms, POLL_SLICE_MS)), zmq.POLLOUT):
                try:
                    sock.send(frame, flags=zmq.NOBLOCK)
                    return
                except zmq.Again:
                    pass
            if time.monotonic() >= end:
                break
        self._num_timed_out += 1
        log.warning("dropped %s to %s: peer not reading", name, self.endpoint)


class QueueInbox:
    """An in-process inbox: tests `put` messages (encoded and decoded, as on the wire)."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self.num_malformed = 0  # never: put() takes messages, not frames

    def put(self, msg: Any) -> None:
        self._queue.put(protocol.decode(protocol.encode(msg)))

    def recv(self, timeout: float) -> Any | None:
        try:
            if timeout <= 0:
                return self._queue.get_nowait()
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        pass


class QueueOutbox:
    """An in-process outbox: what a node sent, in order, round-tripped through the codec."""

    def __init__(self) -> None:
        self.messages: list[Any] = []

    def send(self, msg: Any) -> bool:
        self.messages.append(protocol.decode(protocol.encode(msg)))
        return True

    def take(self, kind: type | None = None) -> list[Any]:
        """Remove and return the messages sent so far (only those of type `kind` if given)."""
        taken = [m for m in self.messages if kind is None or isinstance(m, kind)]
        taken_ids = {id(m) for m in taken}
        self.messages = [m for m in self.messages if id(m) not in taken_ids]
        return taken

    def close(self) -> None:
        pass


class StageTimes:
    """Recent per-stage latencies for heartbeats: the mean of the last `window` samples, in ms."""

    def __init__(self, window: int = 64):
        self._window = window
        self._samples: dict[str, list[float]] = {}

    def add(self, stage: str, seconds: float) -> None:
        samples = self._samples.setdefault(stage, [])
        samples.append(seconds * 1000.0)
        if len(samples) > self._window:
            del samples[0]

    def means(self) -> dict[str, float]:
        return {k: sum(v) / len(v) for k, v in self._samples.items() if v}
