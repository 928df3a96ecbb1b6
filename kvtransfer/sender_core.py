"""Transport-independent half of a KV sender: argument checks, sequence numbers, framing.

Subclasses implement `_submit(item)` (deliver or queue one outgoing message) and `connect`,
`flush`, `close`. An item is turned into wire frames by `frames_of`, on whichever thread sends
it, so the expensive part (checksum, and a copy for non-contiguous rows) runs off the caller's
thread in the ZeroMQ sender. Between numbering and `_submit` sits the one test hook: a sender
whose `faults` is set (`kvtransfer.faults.inject`) hands every item to it instead.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvtransfer.interface import KVSender
from kvtransfer.wire import (
    DTYPE_NAMES,
    MAX_ID_LEN,
    MAX_LAYERS,
    MAX_REASON_LEN,
    MAX_TOKEN_ID,
    MAX_TOKENS,
    U64_MAX,
    Hello,
    HelloAck,
    KVAbort,
    KVDone,
    KVTransferError,
    Message,
    Rendezvous,
    build_chunk,
    encode,
    fingerprint_mismatch,
)

if TYPE_CHECKING:
    from kvtransfer.faults import FaultInjector


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


def frames_of(item: ChunkItem | FramedItem | Message) -> list[Any]:
    """The multipart frames of one outgoing item: [header] or [header, payload]."""
    if isinstance(item, FramedItem):
        return list(item.frames)
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
        self.faults: FaultInjector | None = None

    def _hello(self, fingerprint: dict[str, Any]) -> Hello:
        return Hello(sender=self.name, fingerprint=fingerprint)

    def _submit(self, item: ChunkItem | FramedItem | Message) -> None:
        raise NotImplementedError

    def _deliver(self, item: ChunkItem | Message) -> None:
        if self.faults is None:
            self._submit(item)
        else:
            self.faults.submit(item)

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
        self, rendezvous: Rendezvous, layer_start: int, token_start: int, rows: torch.Tensor
    ) -> None:
        self._check_usable()
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
        self._deliver(ChunkItem(rendezvous, seq, layer_start, token_start, rows))

    def send_done(self, rendezvous: Rendezvous, num_tokens: int, first_token: int) -> None:
        self._check_usable()
        if not 0 < num_tokens <= MAX_TOKENS:
            raise ValueError(f"num_tokens must be in [1, {MAX_TOKENS}], got {num_tokens}")
        if not 0 <= first_token <= MAX_TOKEN_ID:
            raise ValueError(f"first_token must be a token id, got {first_token}")
        seq = self._next_seq(rendezvous, is_last=True)
        self._deliver(KVDone(rendezvous, seq, num_tokens, first_token))

    def send_abort(self, rendezvous: Rendezvous, reason: str) -> None:
        self._check_usable()
        seq = self._next_seq(rendezvous, is_last=True)
        self._deliver(KVAbort(rendezvous, seq, reason[:MAX_REASON_LEN]))
