"""Transport-independent half of a KV sender: argument checks, sequence numbers, framing.

Subclasses implement `_submit(item)` (deliver or queue one outgoing message) and `connect`,
`flush`, `close`. An item is turned into wire frames by `frames_of`, on whichever thread sends
it, so the expensive part (checksum, and a copy for non-contiguous rows) runs off the caller's
thread in the ZeroMQ sender. Between numbering and `_submit` sits the one test hook: a sender
whose `faults` is set (`kvtransfer.faults.inject`) hands every item to it instead.

The way back: the transport hands each message from the receiver to `_on_peer_frames` (from its
I/O thread); a valid `kv_cancel` is queued for `poll_cancels`, and from then on what is sent for
its rendezvous is discarded before it reaches the wire. Anything else is dropped and counted.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvtransfer.interface import DropReason, KVSender
from kvtransfer.sealing import check_key, seal
from kvtransfer.wire import (
    DTYPE_NAMES,
    MAX_DRAFTS,
    MAX_FORKS,
    MAX_ID_LEN,
    MAX_LAYERS,
    MAX_REASON_LEN,
    MAX_TOKEN_ID,
    MAX_TOKENS,
    U64_MAX,
    HeaderChecksumError,
    Hello,
    HelloAck,
    KVAbort,
    KVCancel,
    KVDone,
    KVTransferError,
    Message,
    Rendezvous,
    WireError,
    build_chunk,
    decode,
    encode,
    fingerprint_mismatch,
)

log = logging.getLogger(__name__)


class ItemInterceptor(Protocol):
    """Takes a sender's numbered items in place of the transport, and puts them out through
    the sender later, changed or not (`kvtransfer.faults.FaultInjector` is one)."""

    def submit(self, item: Any) -> None: ...


# Bounds on what a receiver can make a sender hold: cancels not yet polled (more are dropped and
# counted) and rendezvous remembered as cancelled (the oldest is forgotten first).
MAX_PENDING_CANCELS = 4096
MAX_CANCELLED = 4096


@dataclass(frozen=True)
class ChunkItem:
    """A chunk waiting to be framed: the rows tensor is owned by the sender from now on."""

    rendezvous: Rendezvous
    seq: int
    layer_start: int
    token_start: int
    rows: torch.Tensor

    @property
    def num_bytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()


@dataclass(frozen=True)
class FramedItem:
    """An item already turned into frames (a fault injector's corrupted copy): sent as is."""

    frames: tuple[Any, ...]


@dataclass(frozen=True)
class SealedItem:
    """A per-request item of a sealed rendezvous, framed as [header, sealed]
    (kvtransfer.sealing): its key is taken when it is sent, the sealing done when framed."""

    item: ChunkItem | KVDone | KVAbort
    key: bytes

    @property
    def rendezvous(self) -> Rendezvous:
        return self.item.rendezvous

    @property
    def seq(self) -> int:
        return self.item.seq


def frames_of(item: ChunkItem | FramedItem | SealedItem | Message) -> list[Any]:
    """The multipart frames of one outgoing item: [header] or [header, payload], a sealed
    item's [header, sealed payload or tag]."""
    if isinstance(item, FramedItem):
        return list(item.frames)
    if isinstance(item, SealedItem):
        inner = item.item
        if isinstance(inner, ChunkItem):  # the tag covers the payload: no checksum pass
            chunk, payload = build_chunk(
                inner.rendezvous, inner.seq, inner.layer_start, inner.token_start, inner.rows, False
            )
            header = encode(chunk)
            return [header, seal(item.key, item.seq, header, payload)]
        header = encode(inner)
        return [header, seal(item.key, item.seq, header)]
    if isinstance(item, ChunkItem):
        chunk, payload = build_chunk(
            item.rendezvous, item.seq, item.layer_start, item.token_start, item.rows
        )
        return [encode(chunk), payload]
    return [encode(item)]


def check_ack(endpoint: str, local_fp: dict[str, Any], ack: HelloAck) -> None:
    """Raise KVTransferError if the receiver refused us or its fingerprint differs from ours."""
    mismatch = fingerprint_mismatch(local_fp, ack.fingerprint)
    if not ack.ok or mismatch:
        detail = mismatch or ack.error or "refused without a reason"
        raise KVTransferError(f"KV handshake with {endpoint} failed: {detail}")


class SenderCore(KVSender):
    """Checks arguments and numbers the messages of each rendezvous (0, 1, 2, ... in call order);
    the receiver drops anything whose number does not increase."""

    def __init__(self, name: str = "prefill"):
        if not 0 < len(name) <= 64:
            raise ValueError("sender name must be 1..64 characters")
        self.name = name
        self.endpoint: str | None = None
        self._seq: dict[Rendezvous, int] = {}
        self._seq_lock = threading.Lock()
        self._error: KVTransferError | None = None  # sticky: the first failure breaks the sender
        # Tests only: when set, every numbered item goes through it (it may drop, duplicate,
        # delay, reorder or corrupt it) on its way to `_submit`. None costs one check a message.
        self.faults: ItemInterceptor | None = None
        # The way back (filled by the transport's I/O thread, under _cancel_lock).
        self._cancel_lock = threading.Lock()
        self._cancels: deque[tuple[Rendezvous, str]] = deque()  # not yet polled
        self._cancelled: OrderedDict[Rendezvous, None] = OrderedDict()  # its sends are discarded
        self._dropped: Counter[str] = Counter()

    def _hello(self, fingerprint: dict[str, Any]) -> Hello:
        return Hello(sender=self.name, fingerprint=fingerprint)

    def _submit(self, item: ChunkItem | FramedItem | Message) -> None:
        raise NotImplementedError

    def _deliver(self, item: ChunkItem | KVDone | KVAbort, key: bytes | None = None) -> None:
        if key is not None:  # sealed on the sending thread, when framed
            item = SealedItem(item, key)
        if self._is_cancelled(item):
            return  # the receiver gave up on it and would drop it: keep it off the wire
        if self.faults is None:
            self._submit(item)
        else:
            self.faults.submit(item)

    # ---- the way back --------------------------------------------------------------------

    def poll_cancels(self) -> list[tuple[Rendezvous, str]]:
        with self._cancel_lock:
            cancels = list(self._cancels)
            self._cancels.clear()
        with self._seq_lock:  # finished here, as after send_done: forget its numbering
            for rendezvous, _ in cancels:
                self._seq.pop(rendezvous, None)
        return cancels

    def dropped(self) -> dict[str, int]:
        with self._cancel_lock:
            return dict(self._dropped)

    def _is_cancelled(self, item: Any) -> bool:
        """True for an item of a rendezvous the receiver cancelled (any thread)."""
        rendezvous = getattr(item, "rendezvous", None)  # a FramedItem has none: it goes out
        with self._cancel_lock:
            return rendezvous in self._cancelled

    def _on_peer_frames(self, frames: list[Any]) -> None:
        """Handle one message from the receiver (the transport's I/O thread). Never raises:
        what is not a valid kv_cancel is dropped and counted."""
        try:
            reason = self._peer_message(frames)
        except Exception:  # a bug here must not kill the I/O thread; it is logged and counted
            log.exception("KV sender: unexpected error on a message from %s", self.endpoint)
            reason = DropReason.INTERNAL
        if reason is not None:
            with self._cancel_lock:
                self._dropped[reason] += 1

    def _peer_message(self, frames: list[Any]) -> str | None:
        """Queue the cancel in `frames`; the drop reason if they are not one."""
        if len(frames) != 1:
            return DropReason.MALFORMED
        try:
            msg = decode(frames[0])
        except HeaderChecksumError:
            return DropReason.BAD_CHECKSUM
        except WireError as exc:
            is_version = str(exc).startswith("protocol version")
            return DropReason.BAD_VERSION if is_version else DropReason.MALFORMED
        if not isinstance(msg, KVCancel):
            return DropReason.MALFORMED  # a stray hello_ack, or a message meant for a receiver
        with self._cancel_lock:
            if msg.rendezvous in self._cancelled:
                return None  # told twice: once is enough
            if len(self._cancels) >= MAX_PENDING_CANCELS:
                return DropReason.OVERFLOW
            self._cancels.append((msg.rendezvous, msg.reason))
            self._cancelled[msg.rendezvous] = None
            while len(self._cancelled) > MAX_CANCELLED:
                self._cancelled.popitem(last=False)
        return None

    # ---- sending -------------------------------------------------------------------------

    @property
    def is_broken(self) -> bool:
        """True once a failure broke the sender (every later call raises): make a new one."""
        return self._error is not None

    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self.endpoint is None:
            raise KVTransferError("KV sender is not connected (call connect first)")

    def _next_seq(self, rendezvous: Rendezvous, is_last: bool) -> int:
        rid, room = rendezvous.request_id, rendezvous.room
        if not (isinstance(rid, str) and 0 < len(rid) <= MAX_ID_LEN):
            raise ValueError(f"request id must be a string of 1..{MAX_ID_LEN} characters")
        if not (isinstance(room, int) and 0 <= room <= U64_MAX):
            raise ValueError("room must be an unsigned 64-bit integer")
        with self._seq_lock:
            seq = self._seq.pop(rendezvous, 0) if is_last else self._seq.get(rendezvous, 0)
            if not is_last:
                self._seq[rendezvous] = seq + 1
            return seq

    def send_chunk(
        self,
        rendezvous: Rendezvous,
        layer_start: int,
        token_start: int,
        rows: torch.Tensor,
        key: bytes | None = None,
    ) -> None:
        self._check_usable()
        _check_optional_key(key)
        if not isinstance(rows, torch.Tensor) or rows.dim() != 3 or 0 in rows.shape:
            raise ValueError("rows must be a non-empty [layers, tokens, width] tensor")
        if rows.dtype not in DTYPE_NAMES:
            raise ValueError(f"KV dtype {rows.dtype} cannot travel")
        num_layers, num_tokens, _ = rows.shape
        if not 0 <= layer_start <= MAX_LAYERS - num_layers:
            raise ValueError(f"layers [{layer_start}, {layer_start + num_layers}) out of range")
        if not 0 <= token_start <= MAX_TOKENS - num_tokens:
            raise ValueError(f"tokens [{token_start}, {token_start + num_tokens}) out of range")
        seq = self._next_seq(rendezvous, is_last=False)
        self._deliver(ChunkItem(rendezvous, seq, layer_start, token_start, rows), key)

    def send_done(
        self,
        rendezvous: Rendezvous,
        num_tokens: int,
        first_token: int,
        fork_tokens: tuple[int, ...] = (),
        draft_tokens: tuple[int, ...] = (),
        key: bytes | None = None,
    ) -> None:
        self._check_usable()
        _check_optional_key(key)
        if not 0 < num_tokens <= MAX_TOKENS:
            raise ValueError(f"num_tokens must be in [1, {MAX_TOKENS}], got {num_tokens}")
        if not all(0 <= t <= MAX_TOKEN_ID for t in (first_token, *fork_tokens, *draft_tokens)):
            raise ValueError(
                f"first and draft tokens must be token ids, got {first_token}, {fork_tokens}, "
                f"{draft_tokens}"
            )
        if len(draft_tokens) > MAX_DRAFTS:
            raise ValueError(f"at most {MAX_DRAFTS} draft tokens, got {len(draft_tokens)}")
        if len(fork_tokens) > MAX_FORKS:
            raise ValueError(f"at most {MAX_FORKS} fork tokens, got {len(fork_tokens)}")
        seq = self._next_seq(rendezvous, is_last=True)
        self._deliver(
            KVDone(
                rendezvous, seq, num_tokens, first_token, tuple(fork_tokens), tuple(draft_tokens)
            ),
            key,
        )

    def send_abort(self, rendezvous: Rendezvous, reason: str, key: bytes | None = None) -> None:
        self._check_usable()
        _check_optional_key(key)
        seq = self._next_seq(rendezvous, is_last=True)
        self._deliver(KVAbort(rendezvous, seq, reason[:MAX_REASON_LEN]), key)


def _check_optional_key(key: bytes | None) -> None:
    if key is not None:
        check_key(key)
