"""ZeroMQ KV transfer: the decode node binds a ROUTER, each prefill node connects one DEALER.

Wire: every message is multipart, [header] or [header, payload] (see `wire`); the payload is
sent zero-copy (`copy=False` on a byte view of the contiguous rows tensor) and received
zero-copy (the zmq frame's buffer is viewed as a tensor and copied once, into the pool).
The ROUTER learns each DEALER's routing id from its `hello` and drops data from ids that never
completed a handshake. With a `security` (engine.security.CurveSecurity) both ends are CURVE:
the ROUTER the server, each DEALER a client, and a peer without the cluster keys never gets a
frame to the receiver. Every socket wait is a poll with a timeout; `close` joins the threads
with a timeout; LINGER is 0 so closing never hangs on an unreachable peer.

The way back: the ROUTER sends `kv_cancel` to the routing id a rendezvous's first frame came from.
The socket belongs to the I/O thread, so the loop thread queues it and wakes that thread through a
socket pair; the send is NOBLOCK, and a ROUTER drops what is meant for a peer that is gone or
full. Each DEALER's send thread reads those frames between sends (within POLL_MS when idle).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
import uuid
from collections import deque
from typing import TYPE_CHECKING, Any

import zmq

from engine.kv_pool import KVPool
from kvtransfer.receiver_core import ReceiverCore
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
    from engine.security import CurveSecurity

log = logging.getLogger(__name__)

POLL_MS = 50  # how often blocked loops look at their stop flag
# A receiver that sent kv_cancels just before it was closed keeps its socket this long: a DEALER
# (IMMEDIATE) discards what it had not read yet when its connection drops.
CLOSE_GRACE_S = 0.2
INBOUND_HWM = 256  # messages a DEALER buffers from its receiver before zmq drops more


class ZmqReceiver(ReceiverCore):
    """Binds a ROUTER at `endpoint` ("tcp://host:port"; port 0 picks a free one) and runs one
    I/O thread that receives, validates and writes rows. `.endpoint` is the bound address, with
    the host replaced by `advertise_host` if given (bind "tcp://0.0.0.0:5600", advertise the
    address other machines reach)."""

    def __init__(
        self,
        pool: KVPool,
        fingerprint: dict[str, Any],
        endpoint: str = "tcp://127.0.0.1:0",
        *,
        advertise_host: str | None = None,
        rcvhwm: int = 64,
        max_message_bytes: int = 1 << 31,
        context: zmq.Context | None = None,
        security: CurveSecurity | None = None,
    ):
        super().__init__(pool, fingerprint)
        self._sock = (context or zmq.Context.instance()).socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if security is not None:
            security.server(self._sock)
        self._sock.setsockopt(zmq.RCVHWM, rcvhwm)
        # zmq itself disconnects a peer whose frame exceeds this, before buffering it.
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if endpoint.endswith(":0"):
            endpoint = endpoint[:-2] + ":*"
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise KVTransferError(f"cannot bind KV endpoint {endpoint}: {exc}") from None
        self._endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if advertise_host:
            port = self._endpoint.rsplit(":", 1)[1]
            self._endpoint = f"tcp://{advertise_host}:{port}"
        self._peers: set[bytes] = set()  # routing ids with a successful handshake
        # kv_cancels for the I/O thread to send: (routing id, frames). The lock guards the queue
        # and the wake-up pair against `_run` closing it; it is never held for a socket wait.
        self._outbox: deque[tuple[bytes, list[bytes]]] = deque()
        self._outbox_lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._is_closed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-receiver", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def close(self, timeout: float = 1.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _send_to_peer(self, peer: Any, frames: list[bytes]) -> None:
        with self._outbox_lock:
            if self._is_closed:
                return
            self._outbox.append((peer, frames))
            try:
                self._wake_w.send(b"\0")
            except OSError:  # the pair is full: a wake-up is pending anyway
                pass

    def _run(self) -> None:
        # The socket belongs to this thread from here on (zmq sockets are not thread-safe).
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        last_sent = -float("inf")  # time.monotonic() of the last kv_cancel sent
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(POLL_MS))
                if self._send_outbox(sock):
                    last_sent = time.monotonic()
                if sock not in ready:
                    continue
                for _ in range(64):  # drain a burst before looking at the stop flag again
                    try:
                        frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_message(sock, frames)
            # The node cancels its requests just before closing us: give those a chance.
            if self._send_outbox(sock):
                last_sent = time.monotonic()
            time.sleep(max(0.0, last_sent + CLOSE_GRACE_S - time.monotonic()))
        except zmq.ZMQError as exc:  # the context was terminated under us: nothing to serve
            log.error("KV receiver at %s stopped: %s", self._endpoint, exc)
        finally:
            with self._outbox_lock:
                self._is_closed = True
                self._outbox.clear()
                self._wake_r.close()
                self._wake_w.close()
            sock.close(linger=0)

    def _send_outbox(self, sock: zmq.Socket) -> int:
        """Send the queued kv_cancels (I/O thread); how many. Wake-ups are cleared first, so one
        that comes while sending is seen at the next poll."""
        with self._outbox_lock:
            try:
                while self._wake_r.recv(4096):
                    pass
            except OSError:  # BlockingIOError: nothing (more) to clear
                pass
            items = list(self._outbox)
            self._outbox.clear()
        for peer, frames in items:
            try:  # a ROUTER never blocks: a message for a peer that is gone or full is dropped
                sock.send_multipart([peer, *frames], flags=zmq.NOBLOCK)
            except zmq.Again:
                log.debug("KV receiver: dropped a kv_cancel (its peer is not reading)")
        return len(items)

    def _on_message(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        peer = frames[0].bytes
        is_known = peer in self._peers
        ack = self.receive([f.buffer for f in frames[1:]], is_known, peer=peer)
        if ack is None:
            return
        if ack.ok:
            self._peers.add(peer)
        else:
            self._peers.discard(peer)
        try:  # a ROUTER never blocks: an ack for a peer that is gone or full is dropped
            sock.send_multipart([peer, encode(ack)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("KV receiver: could not answer a hello: %s", exc)


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
