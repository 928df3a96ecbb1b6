"""Tiny synchronous ZeroMQ PUSH/PULL wrappers for the control plane (protocol messages only).

Every call is bounded: `recv` waits at most its timeout, `send` waits at most the socket's send
timeout for room in zmq's queue and then drops the message (counted in `num_dropped`), so a
node never hangs on a router that is gone. LINGER is 0: closing never blocks. A socket belongs
to the thread that uses it (zmq sockets are not thread-safe).

Queues with the same interface (`QueueInbox`, `QueueOutbox`) let tests run a node loop with no
sockets at all.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any, Protocol

import zmq

from engine import protocol
from engine.protocol import ProtocolError
from engine.security import CurveSecurity, curve_client, curve_server

log = logging.getLogger(__name__)


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
    """Connects (or binds) a PUSH socket that sends protocol messages.

    Up to `sndhwm` messages queue while the peer is slow or not yet up; beyond that `send`
    waits `send_timeout` seconds, then drops the message and returns False. With `security`,
    the socket is CURVE (the client when connecting).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        bind: bool = False,
        send_timeout: float = 1.0,
        sndhwm: int = 10000,
        context: zmq.Context | None = None,
        security: CurveSecurity | None = None,
    ):
        self._sock = (context or zmq.Context.instance()).socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, sndhwm)
        (curve_server if bind else curve_client)(self._sock, security)
        try:
            self._sock.bind(endpoint) if bind else self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            verb = "bind" if bind else "connect to"
            raise OSError(f"cannot {verb} {endpoint}: {exc}") from None
        self.endpoint = endpoint
        self.send_timeout = send_timeout
        self.num_dropped = 0

    def send(self, msg: Any) -> bool:
        frame = protocol.encode(msg)
        if self._sock.poll(int(self.send_timeout * 1000), zmq.POLLOUT):
            try:
                self._sock.send(frame, flags=zmq.NOBLOCK)
                return True
            except zmq.Again:
                pass
        self.num_dropped += 1
        log.warning("dropped %s to %s: peer not reading", type(msg).__name__, self.endpoint)
        return False

    def linger(self, timeout: float) -> None:
        """Give queued messages up to `timeout` seconds to leave before a close (best effort)."""
        self._sock.setsockopt(zmq.LINGER, int(timeout * 1000))

    def close(self) -> None:
        self._sock.close()


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
