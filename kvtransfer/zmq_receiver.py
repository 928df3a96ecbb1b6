"""ZeroMQ KV transfer, the decode side: the node binds one ROUTER, each prefill node connects
one DEALER (`kvtransfer.zmq_sender`).

Wire: every message is multipart, [header] or [header, payload] (see `wire`); the payload is
received zero-copy (the zmq frame's buffer is viewed as a tensor and copied once, into the
pool). The ROUTER learns each DEALER's routing id from its `hello` and drops data from ids that
never completed a handshake. With a `security` (control.security.CurveSecurity) the ROUTER is a
CURVE server, and a peer without the cluster keys never gets a frame to the receiver. Every
socket wait is a poll with a timeout; `close` joins the thread with a timeout; LINGER is 0 so
closing never hangs on an unreachable peer.

The way back: the ROUTER sends `kv_cancel` to the routing id a rendezvous's first frame came from.
The socket belongs to the I/O thread, so the loop thread queues it and wakes that thread through a
socket pair; the send is NOBLOCK, and a ROUTER drops what is meant for a peer that is gone or
full.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import zmq

from kvtransfer.receiver_core import ReceiverCore
from kvtransfer.wire import (
    KVTransferError,
    encode,
)
from model.kv_pool import KVPool

if TYPE_CHECKING:
    from control.security import CurveSecurity

log = logging.getLogger(__name__)

POLL_MS = 50  # how often blocked loops look at their stop flag
# A receiver that sent kv_cancels just before it was closed keeps its socket this long: a DEALER
# (IMMEDIATE) discards what it had not read yet when its connection drops.
CLOSE_GRACE_S = 0.2


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
        seal: bool = False,
    ):
        """`security`: CURVE on the socket; `seal`: the node draws a key per transfer and every
        message must open under it (kvtransfer.sealing; control.security.kv_link picks)."""
        super().__init__(pool, fingerprint)
        self.seals = seal
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
