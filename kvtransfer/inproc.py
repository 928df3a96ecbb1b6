"""In-process KV transfer: the same interface with no sockets, for unit tests of the nodes.

A receiver registers under an endpoint name (`inproc://...`); a sender connected to that name
hands each message straight to the receiver on the caller's thread, through the same header
encoding, validation and `KVPool.write_rows` copy as the ZeroMQ transport. So every send is
complete when the call returns, and `flush` has nothing to wait for. The way back is as direct:
the receiver hands a `kv_cancel`'s frames to the sender object, which queues it at once.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from kvtransfer.receiver_core import ReceiverCore
from kvtransfer.sender_core import ChunkItem, SenderCore, check_ack, frames_of
from kvtransfer.wire import HelloAck, KVTransferError, Message, encode
from model.kv_pool import KVPool

_registry: dict[str, InprocReceiver] = {}
_registry_lock = threading.Lock()
_names = itertools.count()


class InprocReceiver(ReceiverCore):
    """A receiver reachable by in-process senders at `endpoint` (a fresh name if None)."""

    def __init__(self, pool: KVPool, fingerprint: dict[str, Any], endpoint: str | None = None):
        super().__init__(pool, fingerprint)
        self._endpoint = endpoint or f"inproc://kv-receiver-{next(_names)}"
        with _registry_lock:
            if self._endpoint in _registry:
                raise ValueError(f"endpoint {self._endpoint} is already bound")
            _registry[self._endpoint] = self
        self.is_closed = False

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def _send_to_peer(self, peer: Any, frames: list[bytes]) -> None:
        if not self.is_closed and isinstance(peer, InprocSender):
            peer._from_receiver(frames)

    def close(self, timeout: float = 1.0) -> None:
        with _registry_lock:
            if _registry.get(self._endpoint) is self:
                del _registry[self._endpoint]
        self.is_closed = True


class InprocSender(SenderCore):
    """Delivers synchronously to the `InprocReceiver` registered at the connected endpoint."""

    def __init__(self, name: str = "prefill"):
        super().__init__(name)
        self._receiver: InprocReceiver | None = None

    def connect(self, endpoint: str, fingerprint: dict[str, Any], timeout: float) -> None:
        with _registry_lock:
            receiver = _registry.get(endpoint)
        if receiver is None:
            raise KVTransferError(f"KV handshake with {endpoint} failed: no receiver bound there")
        ack = receiver.receive([encode(self._hello(fingerprint))], is_peer_known=False)
        if not isinstance(ack, HelloAck):
            raise KVTransferError(f"KV handshake with {endpoint} failed: no hello_ack")
        check_ack(endpoint, fingerprint, ack)
        self._receiver, self.endpoint = receiver, endpoint

    def _submit(self, item: ChunkItem | Message) -> None:
        receiver = self._receiver
        if receiver is None or receiver.is_closed:
            self._error = KVTransferError(f"KV receiver at {self.endpoint} is closed")
            raise self._error
        receiver.receive(frames_of(item), is_peer_known=True, peer=self)

    def _from_receiver(self, frames: list[bytes]) -> None:
        if self._receiver is not None:  # closed: the peer is gone, the message with it
            self._on_peer_frames(list(frames))

    def flush(self, timeout: float) -> None:
        self._check_usable()

    def close(self, timeout: float = 1.0) -> None:
        self._receiver = None
        if self._error is None:
            self._error = KVTransferError("KV sender is closed")
