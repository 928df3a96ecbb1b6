"""Transport-independent half of a KV receiver: expectations, validation, writes, events.

Both receivers (in-process and ZeroMQ) subclass `ReceiverCore` and feed it whole messages (a list
of frames: header [, payload]) through `receive`, from their I/O thread, naming the peer each came
from; they implement `_send_to_peer`, through which the core sends `kv_cancel` back to the peer of
a transfer it gives up on. See `KVReceiver` for the threading and page-ownership contract this
implements.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtransfer.interface import DropReason, KVReceiver, ReceiverStats, TransferEvent
from kvtransfer.sealing import SealError, check_key, open_sealed
from kvtransfer.wire import (
    DTYPE_NAMES,
    MAX_REASON_LEN,
    HeaderChecksumError,
    Hello,
    HelloAck,
    KVAbort,
    KVCancel,
    KVChunk,
    KVDone,
    Rendezvous,
    WireError,
    checksum,
    decode,
    encode,
    fingerprint_mismatch,
    payload_rows,
    peek_kind,
)
from model.kv_pool import KVPool, PageTable

log = logging.getLogger(__name__)


@dataclass
class _Expectation:
    rendezvous: Rendezvous
    table: PageTable  # a snapshot of the lent pages: the caller's table may change, this may not
    num_tokens: int
    deadline: float
    covered: torch.Tensor  # bool [pool layers, num_tokens]: rows written so far
    last_seq: int = -1
    first_drop: str = ""  # why the first chunk of this request was dropped, for the failure text
    is_active: bool = True  # False once handed back (ready, failed, cancelled): no more writes
    peer: Any = None  # the transport's name for the sender of its first frame (None: none yet)
    key: bytes | None = None  # sealed transfer (kvtransfer.sealing): every message opens with it
    lock: threading.Lock = field(default_factory=threading.Lock)


class ReceiverCore(KVReceiver):
    """Bookkeeping shared by the receivers; `receive` is called by the transport's I/O thread."""

    def __init__(self, pool: KVPool, fingerprint: dict[str, Any]):
        if fingerprint.get("dtype") != DTYPE_NAMES.get(pool.dtype):
            raise ValueError("fingerprint dtype does not match the pool's dtype")
        if fingerprint.get("row_width") != pool.row_width:
            raise ValueError("fingerprint row_width does not match the pool's row width")
        if fingerprint.get("num_layers") != pool.num_layers:
            raise ValueError("fingerprint num_layers does not match the pool's layers")
        self.pool = pool
        self.fingerprint = fingerprint
        # Whether the node seals its transfers (draws a key per `expect`): a transport's choice.
        self.seals = False
        self._opened = threading.local()  # per receiving thread: the buffer sealed chunks open in
        self._dtype_name = DTYPE_NAMES[pool.dtype]
        self._lock = threading.Lock()  # guards everything below (never held during a copy)
        self._has_events = threading.Condition(self._lock)
        self._expected: dict[Rendezvous, _Expectation] = {}
        self._events: list[TransferEvent] = []
        self._dropped: Counter[str] = Counter()
        self._bytes_received = 0
        self._bytes_written = 0
        self._chunks_written = 0
        self._num_ready = 0
        self._num_failed = 0
        self._num_cancels_sent = 0

    # ---- decode-loop side ----------------------------------------------------------------

    def expect(
        self,
        rendezvous: Rendezvous,
        page_table: PageTable,
        num_tokens: int,
        deadline: float,
        key: bytes | None = None,
        first_row: int = 0,
    ) -> None:
        if key is not None:
            check_key(key)
        if not isinstance(rendezvous, Rendezvous):
            raise ValueError("rendezvous must be a Rendezvous")
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        if page_table.page_size != self.pool.page_size:
            raise ValueError("page table is not of this receiver's pool (page size differs)")
        if page_table.capacity < num_tokens:
            raise ValueError(
                f"page table holds {page_table.capacity} tokens, {num_tokens} expected"
            )
        if not 0 <= first_row <= num_tokens:
            raise ValueError(f"first_row {first_row} outside [0, {num_tokens}]")
        num_pages = -(-num_tokens // page_table.page_size)
        exp = _Expectation(
            rendezvous,
            PageTable(page_table.page_size, list(page_table.pages[:num_pages])),
            num_tokens,
            float(deadline),
            torch.zeros(self.pool.num_layers, num_tokens, dtype=torch.bool),
            key=key,
        )
        exp.covered[:, :first_row] = True
        with self._lock:
            if rendezvous in self._expected:
                raise ValueError(f"rendezvous {rendezvous} is already expected")
            self._expected[rendezvous] = exp

    def cancel(self, rendezvous: Rendezvous, reason: str = "") -> bool:
        with self._lock:
            exp = self._expected.pop(rendezvous, None)
            num_events = len(self._events)
            self._events = [e for e in self._events if e.rendezvous != rendezvous]
            had_event = len(self._events) != num_events
        if exp is None:
            return had_event
        with exp.lock:  # waits for a write in progress into these pages
            exp.is_active = False
            self._tell_peer(exp, reason or "cancelled by the decode node")
        return True

    def poll(self, timeout: float = 0.0) -> list[TransferEvent]:
        end = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            self._expire(now)
            with self._lock:
                if self._events or now >= end:
                    events, self._events = self._events, []
                    return events
                # Sleep until an event, the caller's timeout, or the next deadline to expire.
                wake = min([end] + [e.deadline for e in self._expected.values()])
                self._has_events.wait(max(0.0, wake - now) + 1e-3)

    def stats(self) -> ReceiverStats:
        with self._lock:
            return ReceiverStats(
                bytes_received=self._bytes_received,
                bytes_written=self._bytes_written,
                chunks_written=self._chunks_written,
                num_ready=self._num_ready,
                num_failed=self._num_failed,
                num_cancels_sent=self._num_cancels_sent,
                dropped=dict(self._dropped),
            )

    def _expire(self, now: float) -> None:
        with self._lock:
            late = [e for e in self._expected.values() if e.deadline < now]
        for exp in late:
            with exp.lock:
                reason = f"KV transfer of {exp.rendezvous} timed out"
                if self._finish(exp, "failed", reason=reason):
                    self._tell_peer(exp, reason)

    # ---- I/O-thread side -----------------------------------------------------------------

    def receive(self, frames: list[Any], is_peer_known: bool, peer: Any = None) -> HelloAck | None:
        """Handle one multipart message: frames[0] the header, frames[1] the payload of a chunk
        (bytes-like; a writable buffer avoids a copy), from `peer` (the transport's handle for
        `_send_to_peer`; None: not one to answer). Returns the ack to send back for a `hello`,
        else None. Never raises: what cannot be used is dropped and counted."""
        try:
            return self._receive(frames, is_peer_known, peer)
        except Exception:  # a bug here must not kill the I/O thread; it is logged and counted
            log.exception("KV receiver: unexpected error while handling a message")
            self._drop(DropReason.INTERNAL)
            return None

    def _receive(self, frames: list[Any], is_peer_known: bool, peer: Any) -> HelloAck | None:
        if len(frames) > 1:
            self._count_received(sum(len(f) for f in frames[1:]))
        if not frames:
            return self._drop(DropReason.MALFORMED)
        try:
            msg = decode(frames[0])
        except HeaderChecksumError:  # corrupted in flight: its rendezvous cannot be trusted
            return self._drop(DropReason.BAD_CHECKSUM)
        except WireError as exc:
            if not str(exc).startswith("protocol version"):
                return self._drop(DropReason.MALFORMED)
            self._drop(DropReason.BAD_VERSION)
            if peek_kind(frames[0]) != "hello" or len(frames) != 1:
                return None
            error = f"{exc} in the peer's hello: upgrade one side"
            return HelloAck(ok=False, fingerprint=self.fingerprint, error=error)
        if isinstance(msg, Hello):
            return self._hello(msg) if len(frames) == 1 else self._drop(DropReason.MALFORMED)
        if isinstance(msg, (HelloAck, KVCancel)):
            return self._drop(DropReason.MALFORMED)  # only a sender receives those
        if not is_peer_known:
            return self._drop(DropReason.NO_HANDSHAKE)
        with self._lock:
            exp = self._expected.get(msg.rendezvous)
        if exp is not None and exp.key is not None:  # sealed: nothing is read before it opens
            if len(frames) != 2:
                return self._drop(DropReason.UNAUTHENTICATED, msg.rendezvous, exp)
            try:
                payload = open_sealed(exp.key, msg.seq, frames[0], frames[1], self._buffer(frames))
            except SealError:
                return self._drop(DropReason.UNAUTHENTICATED, msg.rendezvous, exp)
            frames = [frames[0], payload] if isinstance(msg, KVChunk) else [frames[0]]
        if isinstance(msg, KVChunk):
            if len(frames) < 2:
                return self._drop(DropReason.TRUNCATED)
            if len(frames) > 2:
                return self._drop(DropReason.MALFORMED)
            return self._chunk(msg, frames[1], peer)
        if len(frames) != 1:
            return self._drop(DropReason.MALFORMED)
        return self._end(msg, peer)

    def _buffer(self, frames: list[Any]) -> bytearray:
        """This thread's buffer for opening sealed chunks, grown to the largest seen (a chunk's
        rows are copied into the pool before the thread opens the next one)."""
        need = len(frames[1]) if len(frames) > 1 else 0
        buffer = getattr(self._opened, "buffer", None)
        if buffer is None or len(buffer) < need:
            buffer = self._opened.buffer = bytearray(need)
        return buffer

    def _hello(self, msg: Hello) -> HelloAck:
        mismatch = fingerprint_mismatch(msg.fingerprint, self.fingerprint)
        if mismatch:
            log.warning("KV receiver: refused %r: %s", msg.sender, mismatch)
        return HelloAck(ok=mismatch is None, fingerprint=self.fingerprint, error=mismatch or "")

    def _chunk(self, chunk: KVChunk, payload: Any, peer: Any) -> None:
        # Cheap checks first; the checksum (one pass over the bytes) only for rows we would write.
        if chunk.dtype != self._dtype_name:
            return self._drop(DropReason.BAD_DTYPE, chunk.rendezvous)
        if chunk.row_width != self.pool.row_width:
            return self._drop(DropReason.BAD_ROW_WIDTH, chunk.rendezvous)
        if len(payload) != chunk.payload_len:
            short = len(payload) < chunk.payload_len
            return self._drop(
                DropReason.TRUNCATED if short else DropReason.OVERSIZED, chunk.rendezvous
            )
        with self._lock:
            exp = self._expected.get(chunk.rendezvous)
        if exp is None:
            return self._drop(DropReason.UNKNOWN_RENDEZVOUS)
        with exp.lock:
            if exp.peer is None:  # the sender of its first frame: the one a kv_cancel goes to
                exp.peer = peer
            reason = self._check_chunk(exp, chunk, payload)
            if reason:
                return self._drop(reason, chunk.rendezvous, exp)
            rows = payload_rows(chunk, payload).to(self.pool.buffer.device)  # no-op on CPU
            self.pool.write_rows(exp.table, chunk.layer_start, chunk.token_start, rows)
            exp.covered[
                chunk.layer_start : chunk.layer_end, chunk.token_start : chunk.token_end
            ] = True
            exp.last_seq = chunk.seq
        with self._lock:
            self._bytes_written += chunk.payload_len
            self._chunks_written += 1

    def _check_chunk(self, exp: _Expectation, chunk: KVChunk, payload: Any) -> str | None:
        """The drop reason for `chunk`, or None if it may be written (caller holds exp.lock)."""
        if not exp.is_active:
            return DropReason.UNKNOWN_RENDEZVOUS
        if time.monotonic() > exp.deadline:
            return DropReason.EXPIRED
        if chunk.layer_end > self.pool.num_layers:
            return DropReason.LAYERS_OUT_OF_RANGE
        if chunk.token_end > exp.num_tokens:
            return DropReason.TOKENS_OUT_OF_RANGE
        if chunk.seq <= exp.last_seq:
            return DropReason.DUPLICATE
        region = exp.covered[
            chunk.layer_start : chunk.layer_end, chunk.token_start : chunk.token_end
        ]
        if bool(region.any()):
            return DropReason.DUPLICATE
        if exp.key is None and checksum(payload) != chunk.checksum:  # sealed: the tag covers it
            return DropReason.BAD_CHECKSUM
        return None

    def _end(self, msg: KVDone | KVAbort, peer: Any) -> None:
        with self._lock:
            exp = self._expected.get(msg.rendezvous)
        if exp is None:
            return self._drop(DropReason.UNKNOWN_RENDEZVOUS)
        with exp.lock:
            if exp.peer is None:
                exp.peer = peer
            if not exp.is_active:
                return self._drop(DropReason.UNKNOWN_RENDEZVOUS)
            if msg.seq <= exp.last_seq:
                return self._drop(DropReason.DUPLICATE, msg.rendezvous, exp)
            if isinstance(msg, KVAbort):  # P gave up itself: nothing to tell it
                self._finish(exp, "failed", reason=f"prefill aborted: {msg.reason}")
                return
            problem = self._incomplete(exp, msg.num_tokens)
            if problem:
                reason = f"KV of {exp.rendezvous}: {problem}"
                if self._finish(exp, "failed", reason=reason):
                    self._tell_peer(exp, reason)
                return
            self._finish(
                exp,
                "ready",
                first_token=msg.first_token,
                fork_tokens=msg.fork_tokens,
                draft_tokens=msg.draft_tokens,
            )

    def _incomplete(self, exp: _Expectation, num_tokens: int) -> str | None:
        if num_tokens != exp.num_tokens:
            return f"kv_done says {num_tokens} tokens, {exp.num_tokens} were reserved"
        if bool(exp.covered.all()):
            return None
        layer, token = (~exp.covered).nonzero()[0].tolist()
        why = f" (first dropped chunk: {exp.first_drop})" if exp.first_drop else ""
        return f"incomplete, layer {layer} token {token} never arrived{why}"

    def _finish(
        self,
        exp: _Expectation,
        kind: str,
        first_token=None,
        reason: str = "",
        fork_tokens=(),
        draft_tokens=(),
    ) -> bool:
        """Hand the pages back with one event (caller holds exp.lock); True if done here, False
        (a no-op) if another path (cancel, expiry, kv_done) already did."""
        with self._lock:
            if not exp.is_active or self._expected.get(exp.rendezvous) is not exp:
                return False
            del self._expected[exp.rendezvous]
            exp.is_active = False
            event = TransferEvent(
                kind,  # type: ignore[arg-type]
                exp.rendezvous,
                first_token,
                reason,
                tuple(fork_tokens),
                tuple(draft_tokens),
            )
            self._events.append(event)
            if kind == "ready":
                self._num_ready += 1
            else:
                self._num_failed += 1
            self._has_events.notify_all()
        return True

    def _tell_peer(self, exp: _Expectation, reason: str) -> None:
        """Best effort `kv_cancel` to the sender of the rendezvous's first frame, so it stops
        computing and sending it (caller holds exp.lock, which orders this after the pages came
        back). No frame seen yet: no peer to tell."""
        if exp.peer is None:
            return
        frame = encode(KVCancel(exp.rendezvous, reason[:MAX_REASON_LEN]))
        try:
            self._send_to_peer(exp.peer, [frame])
        except Exception:  # the channel is best effort: never let it fail a cancel or a poll
            log.exception("KV receiver: could not queue kv_cancel for %s", exp.rendezvous)
            return
        with self._lock:
            self._num_cancels_sent += 1

    def _send_to_peer(self, peer: Any, frames: list[bytes]) -> None:
        """Queue `frames` for `peer` (what the transport passed to `receive`); never blocks, and
        drops them silently if the peer is gone. Called from the loop or the I/O thread."""
        raise NotImplementedError

    def _drop(self, reason: str, rendezvous: Rendezvous | None = None, exp=None) -> None:
        if exp is not None and not exp.first_drop:
            exp.first_drop = reason
        with self._lock:
            self._dropped[reason] += 1
        if rendezvous is not None:
            log.debug("KV receiver: dropped a message of %s (%s)", rendezvous, reason)

    def _count_received(self, num_bytes: int) -> None:
        with self._lock:
            self._bytes_received += num_bytes
