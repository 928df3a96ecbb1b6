"""ZeroMQ KV transfer, the prefill side: one DEALER per decode node's ROUTER
(`kvtransfer.zmq_receiver`), fed by a bounded queue and a send thread.

The payload is sent zero-copy (`copy=False` on a byte view of the contiguous rows tensor).
With a `security` (control.security.CurveSecurity) the DEALER is a CURVE client. The send thread
reads the receiver's `kv_cancel` frames between sends (within POLL_MS when idle).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import zmq

from kvtransfer.sender_core import ChunkItem, SenderCore, check_ack, frames_of
from kvtransfer.wire import (
    MAX_HEADER_BYTES,
    HelloAck,
    KVTransferError,
    Message,
    WireError,
    decode,
    encode,
)

if TYPE_CHECKING:
    from control.security import CurveSecurity

log = logging.getLogger(__name__)

POLL_MS = 50  # how often blocked loops look at their stop flag
INBOUND_HWM = 256  # messages a DEALER buffers from its receiver before zmq drops more


_STOP = object()


class ZmqSender(SenderCore):
    """One DEALER to one decode endpoint, fed by a bounded queue and a background send thread.

    `queue_size` chunks may wait in the queue (and `sndhwm` messages in zmq's buffers) before
    `send_chunk` blocks; a send that makes no progress for `send_timeout` seconds (decode node
    gone, or not reading) breaks the sender.
    """

    def __init__(
        self,
        name: str = "prefill",
        *,
        queue_size: int = 8,
        send_timeout: float = 30.0,
        sndhwm: int = 16,
        context: zmq.Context | None = None,
        security: CurveSecurity | None = None,
    ):
        super().__init__(name)
        self._ctx = context or zmq.Context.instance()
        self._security = security
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._send_timeout = send_timeout
        self._sndhwm = sndhwm
        self._pending = 0  # submitted, not yet handed to zmq (or discarded)
        self._idle = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sock: zmq.Socket | None = None

    # ---- caller side ---------------------------------------------------------------------

    def connect(self, endpoint: str, fingerprint: dict[str, Any], timeout: float) -> None:
        if self.endpoint is not None:
            raise KVTransferError(f"KV sender is already connected to {self.endpoint}")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self._sndhwm)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a live connection: a dead peer blocks
        # What comes back is small (hello_ack, kv_cancel): zmq disconnects a peer sending more.
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_HEADER_BYTES)
        sock.setsockopt(zmq.RCVHWM, INBOUND_HWM)
        # A fixed routing id keeps the handshake valid across a TCP reconnect.
        sock.setsockopt(zmq.ROUTING_ID, f"{self.name}-{uuid.uuid4().hex}".encode())
        if self._security is not None:
            self._security.client(sock)
        try:
            sock.connect(endpoint)
            ack = self._handshake(sock, endpoint, fingerprint, time.monotonic() + timeout)
            check_ack(endpoint, fingerprint, ack)
        except zmq.ZMQError as exc:  # a malformed endpoint, mostly
            sock.close(linger=0)
            raise KVTransferError(f"KV handshake with {endpoint} failed: {exc}") from None
        except Exception:
            sock.close(linger=0)
            raise
        self._sock, self.endpoint = sock, endpoint
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    def _handshake(
        self, sock: zmq.Socket, endpoint: str, fingerprint: dict[str, Any], deadline: float
    ) -> HelloAck:
        if not sock.poll(_ms_left(deadline), zmq.POLLOUT):
            raise KVTransferError(
                f"KV handshake with {endpoint}: no connection (timed out; unreachable, or its "
                "CURVE keys differ)"
            )
        sock.send(encode(self._hello(fingerprint)), flags=zmq.NOBLOCK)
        while True:  # skip stray frames (none expected) until the ack or the deadline
            if not sock.poll(_ms_left(deadline), zmq.POLLIN):
                raise KVTransferError(f"KV handshake with {endpoint}: no hello_ack (timed out)")
            frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            try:
                msg = decode(frames[0]) if len(frames) == 1 else None
            except WireError as exc:
                raise KVTransferError(
                    f"KV handshake with {endpoint}: bad hello_ack: {exc}"
                ) from None
            if isinstance(msg, HelloAck):
                return msg

    def _submit(self, item: ChunkItem | Message) -> None:
        with self._idle:
            self._pending += 1
        try:
            self._queue.put(item, timeout=self._send_timeout)
        except queue.Full:
            self._done_one()
            if self._error is None:  # no progress for send_timeout: as broken as a failed send
                self._error = KVTransferError(
                    f"KV send queue to {self.endpoint} full for {self._send_timeout:g}s"
                )
            raise self._error from None

    def flush(self, timeout: float) -> None:
        self._check_usable()
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KVTransferError(f"KV flush to {self.endpoint} timed out")
                self._idle.wait(left)
        self._check_usable()

    def close(self, timeout: float = 1.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            try:
                self._queue.put_nowait(_STOP)
            except queue.Full:
                pass  # the thread sees the stop flag within POLL_MS anyway
            self._thread.join(timeout)
        elif self._sock is not None:
            self._sock.close(linger=0)
        if self._error is None:
            self._error = KVTransferError("KV sender is closed")

    # ---- background thread ---------------------------------------------------------------

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        # The decode node's receiver knows us only from our hello: if the connection drops (it
        # restarted, or died), break, so the pool connects and says hello again rather than
        # send KV that a restarted receiver drops as coming from a stranger.
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while not self._stop.is_set():
                if self._error is None and monitor.poll(0, zmq.POLLIN):
                    monitor.recv_multipart()
                    self._error = KVTransferError(
                        f"KV connection to {self.endpoint} dropped (the decode node restarted "
                        "or died)"
                    )
                    log.warning("%s", self._error)
                self._recv_inbound(sock)
                try:
                    item = self._queue.get(timeout=POLL_MS / 1000)
                except queue.Empty:
                    continue
                if item is _STOP:
                    break
                try:
                    # Once broken, drain the queue without sending; and what the receiver
                    # cancelled meanwhile it would drop: skip it.
                    if self._error is None and not self._is_cancelled(item):
                        self._send(sock, frames_of(item))
                except Exception as exc:  # any failure breaks the sender, loudly
                    self._error = KVTransferError(f"KV send to {self.endpoint} failed: {exc}")
                    log.error("%s", self._error)
                finally:
                    self._done_one()
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            with self._idle:
                self._idle.notify_all()

    def _recv_inbound(self, sock: zmq.Socket) -> None:
        """Hand what the receiver sent (kv_cancels) to the core, a bounded burst at a time."""
        for _ in range(64):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:  # a dead socket: the next send breaks the sender
                log.warning("KV sender: cannot read from %s: %s", self.endpoint, exc)
                return
            self._on_peer_frames(frames)

    def _send(self, sock: zmq.Socket, frames: list[Any]) -> None:
        deadline = time.monotonic() + self._send_timeout
        while True:
            if self._stop.is_set():
                raise KVTransferError("sender closed")
            if sock.poll(POLL_MS, zmq.POLLOUT):
                try:
                    sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:
                    pass
            self._recv_inbound(sock)  # the receiver is slow: it may be cancelling
            if time.monotonic() > deadline:
                raise KVTransferError(
                    f"no progress for {self._send_timeout:g}s (decode node gone or not reading)"
                )

    def _done_one(self) -> None:
        with self._idle:
            self._pending -= 1
            if self._pending == 0:
                self._idle.notify_all()


def _ms_left(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000))
