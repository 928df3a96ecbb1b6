"""The two sides of a KV transfer, as small abstract classes (implementations: `inproc`, `zmq_receiver` + `zmq_sender`).

The life of one request's KV (prefill node P, decode node D, router R):

1. R asks D to reserve pages for the prompt. D's loop allocates a `PageTable` holding at least
   `num_tokens` tokens and calls `KVReceiver.expect(rendezvous, table, num_tokens, deadline)`.
   From here until an event for this rendezvous comes out of `poll` (or `cancel` returns), the
   first ceil(num_tokens / page_size) pages of the table are LENT to the receiver: only its I/O
   thread writes them, and D must neither read nor free them.
2. R tells P to prefill, with D's KV endpoint and the rendezvous. P's `KVSender` (one per decode
   endpoint, connected once with a handshake) gets, after each prefill chunk, that chunk's rows for
   all layers (`send_chunk`), then `send_done` with the first sampled token, or `send_abort`.
   P's own pages are never lent: the sender holds the `rows` tensor it was given (P makes it
   with `KVPool.read_rows`, a copy), so P may free or reuse its pages as soon as the call returns.
3. D's receiver writes every valid chunk into the lent pages with `KVPool.write_rows`. On
   `kv_done` it checks that every token in [0, num_tokens) arrived for every layer, exactly once.
4. D's loop calls `poll()`: `ready` gives the pages back to D with their rows complete (D may now
   decode); `failed` (incomplete, aborted, expired) gives them back with garbage in them (D frees
   them and fails the request; it never decodes it). Either way the expectation is gone, and any
   late message for the rendezvous is dropped as unknown.
5. The back channel: when D gives up on a transfer still in progress (`cancel` after an abort or at
   shutdown, its deadline passed, or `kv_done` refused as incomplete), its receiver sends
   `kv_cancel` to the sender that sent the rendezvous's first frame: best effort, never blocking,
   after the pages are back with D, so it changes nothing of who owns them. No frame seen yet means
   no peer to tell (the router's Abort reaches P instead); `kv_abort` from P is not answered. P's
   loop gets it from `KVSender.poll_cancels` and aborts the request: it stops computing it, and
   frees its own pages (never lent) at once.

Messages a receiver cannot use (malformed, truncated, oversized, bad checksum, duplicated, unknown or
cancelled rendezvous, outside the reservation or the pool's layers, wrong dtype or row width) are
dropped and counted by reason in `stats()`; they never raise out of the I/O thread and never
touch any request's pages. Likewise a sender drops and counts (`KVSender.dropped`) any frame from
the receiver that is not a valid `kv_cancel`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvtransfer.wire import Rendezvous
from model.kv_pool import KVPool, PageTable


class DropReason:
    """Why a received message was dropped (keys of `ReceiverStats.dropped`)."""

    MALFORMED = "malformed"  # not a valid header, or wrong frame count
    BAD_VERSION = "bad_version"  # another protocol version
    NO_HANDSHAKE = "no_handshake"  # a peer that never completed (or failed) the hello
    UNKNOWN_RENDEZVOUS = "unknown_rendezvous"  # never expected, cancelled, finished or expired
    EXPIRED = "expired"  # arrived after the expectation's deadline
    BAD_DTYPE = "bad_dtype"  # chunk dtype is not the pool's
    BAD_ROW_WIDTH = "bad_row_width"  # chunk row width is not the pool's
    LAYERS_OUT_OF_RANGE = "layers_out_of_range"  # outside [0, pool.num_layers)
    TOKENS_OUT_OF_RANGE = "tokens_out_of_range"  # outside [0, num_tokens) of the expectation
    TRUNCATED = "truncated"  # payload shorter than the header says (or missing)
    OVERSIZED = "oversized"  # payload longer than the header says
    BAD_CHECKSUM = "bad_checksum"  # the payload's or the header's (`hcrc`)
    DUPLICATE = "duplicate"  # sequence number not increasing, or rows already received
    INTERNAL = "internal"  # a bug in the receiver (logged); the I/O thread keeps going
    OVERFLOW = "overflow"  # sender only: a kv_cancel beyond MAX_PENDING_CANCELS not yet polled
    UNAUTHENTICATED = "unauthenticated"  # a sealed rendezvous' message that fails its tag


@dataclass(frozen=True)
class TransferEvent:
    """What `KVReceiver.poll` reports, once per expected rendezvous.

    kind "ready": every row arrived; `first_token` is the token P sampled after the prompt,
    `fork_tokens` those of the sequences an n > 1 request forks into (sequences 1 .. n-1).
    kind "failed": the request must not be decoded; `reason` is one line naming the stage.
    """

    kind: Literal["ready", "failed"]
    rendezvous: Rendezvous
    first_token: int | None = None
    reason: str = ""
    fork_tokens: tuple[int, ...] = ()
    # MTP: P's draft of the token after first_token (empty without MTP).
    draft_tokens: tuple[int, ...] = ()

    @property
    def is_ready(self) -> bool:
        return self.kind == "ready"


@dataclass(frozen=True)
class ReceiverStats:
    """A snapshot of a receiver's counters (all since it was created)."""

    bytes_received: int = 0  # payload bytes off the wire, used or dropped
    bytes_written: int = 0  # payload bytes written into the pool
    chunks_written: int = 0
    num_ready: int = 0
    num_failed: int = 0
    num_cancels_sent: int = 0  # kv_cancel messages handed to the transport (best effort)
    dropped: dict[str, int] = field(default_factory=dict)  # DropReason -> count

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())


class KVSender(abc.ABC):
    """Prefill side: streams one node's KV rows to ONE decode endpoint.

    A prefill node keeps one sender per decode endpoint (a dict keyed by endpoint, connected
    lazily on first use). All methods are called from the prefill node's loop thread; the
    actual sending runs on a background thread, in call order, so the transfer of chunk i
    overlaps the compute of chunk i+1. Once a send fails (peer gone, send timeout) the sender
    is broken: every later call raises `KVTransferError` with the first error, and the prefill
    node drops it and connects a new one. The decode side learns of the failure by its deadline.
    The background thread also receives the decode node's `kv_cancel`s, for `poll_cancels`.
    """

    @property
    def is_broken(self) -> bool:
        """True once the sender failed for good (every later call raises): replace it."""
        return False

    @abc.abstractmethod
    def connect(self, endpoint: str, fingerprint: dict[str, Any], timeout: float) -> None:
        """Handshake with the receiver at `endpoint`: sends `hello` with our fingerprint
        (`wire.make_fingerprint`) and waits at most `timeout` seconds for `hello_ack`.
        Raises KVTransferError naming the differing field on a fingerprint mismatch, or the
        endpoint and stage on timeout. Blocks; call once, before any send."""

    @abc.abstractmethod
    def send_chunk(
        self,
        rendezvous: Rendezvous,
        layer_start: int,
        token_start: int,
        rows: torch.Tensor,
        key: bytes | None = None,
    ) -> None:
        """Queue rows [L, T, W] of layers [layer_start, layer_start+L) and token positions
        [token_start, token_start+T). Returns at once unless the bounded queue is full, in which
        case it blocks (back-pressure) for at most the sender's send timeout, then raises.
        Ownership of `rows` passes to the sender: the caller must not modify it afterwards.
        Raises ValueError for a bad shape/dtype/range, KVTransferError if the sender is broken.
        `key` (here and in send_done / send_abort): the rendezvous' transfer key, when its
        receiver expects it sealed (kvtransfer.sealing); the message is sealed with it."""

    @abc.abstractmethod
    def send_done(
        self,
        rendezvous: Rendezvous,
        num_tokens: int,
        first_token: int,
        fork_tokens: tuple[int, ...] = (),
        draft_tokens: tuple[int, ...] = (),
        key: bytes | None = None,
    ) -> None:
        """Queue `kv_done` after this rendezvous's chunks: the prompt had `num_tokens` tokens,
        all sent, and P sampled `first_token` (and `fork_tokens` for the sequences an n > 1
        request forks into; `draft_tokens`: its MTP layer's draft of the next token). The rendezvous is finished on the sender."""

    @abc.abstractmethod
    def send_abort(self, rendezvous: Rendezvous, reason: str, key: bytes | None = None) -> None:
        """Queue `kv_abort` (P gave up: client gone, error). D reports the request failed."""

    @abc.abstractmethod
    def poll_cancels(self) -> list[tuple[Rendezvous, str]]:
        """The (rendezvous, reason) of each `kv_cancel` received since the last call, in arrival
        order. Never blocks, never raises (also once broken). From the moment a cancel is
        received, what is sent for its rendezvous is discarded before the wire (the receiver
        would drop it); once it is returned the rendezvous is finished on the sender, like after
        `send_done`. The caller should stop the request without any `send_abort`. A cancel may
        name a rendezvous the caller has finished meanwhile (D refused its `kv_done`): ignore it."""

    @abc.abstractmethod
    def dropped(self) -> dict[str, int]:
        """Frames from the receiver that were not a valid `kv_cancel`, by `DropReason` (a
        snapshot, since the sender was created)."""

    @abc.abstractmethod
    def flush(self, timeout: float) -> None:
        """Block until everything queued so far has been handed to the transport (zmq may
        still hold it in its buffers). Raises KVTransferError on timeout or if broken."""

    @abc.abstractmethod
    def close(self, timeout: float = 1.0) -> None:
        """Stop the background thread (joined with `timeout`) and release the socket; queued
        messages not yet sent are discarded. Safe to call twice."""


class KVReceiver(abc.ABC):
    """Decode side: receives rows into pages the decode node reserved for expected requests.

    Threads: `expect`, `cancel`, `poll` and `stats` are called by the decode node's loop
    thread; socket I/O and every write into the pool run on one background I/O thread per
    receiver, and only for expected rendezvous. Locking: a receiver-wide lock guards the table
    of expectations, the events and the counters (held briefly, never during a copy); each
    expectation has its own lock, held by the I/O thread while it writes that request's rows
    and taken by `cancel`/expiry before they hand the pages back, so a write never overlaps a
    free. The pool's allocator is never touched by the receiver.
    """

    pool: KVPool

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """The address senders connect to (what the decode node advertises to the router)."""

    @abc.abstractmethod
    def expect(
        self,
        rendezvous: Rendezvous,
        page_table: PageTable,
        num_tokens: int,
        deadline: float,
        key: bytes | None = None,
        first_row: int = 0,
    ) -> None:
        """Lend the first ceil(num_tokens/page_size) pages of `page_table` (of this receiver's
        pool, holding >= num_tokens tokens) to the receiver for `rendezvous`, until
        `deadline` (a `time.monotonic()` value). Call before the router lets P send: chunks of
        a rendezvous not yet expected are dropped. With `key` (kvtransfer.sealing) every message
        of the rendezvous must open under it, else it is dropped. Rows before `first_row` are
        held already (the node's prefix cache; whole pages, possibly shared with other
        requests): they count as written, and a chunk that would overwrite one is dropped as a
        duplicate. Raises ValueError for a bad argument or a rendezvous already expected.
        Never blocks."""

    @abc.abstractmethod
    def cancel(self, rendezvous: Rendezvous, reason: str = "") -> bool:
        """Take the pages back before the transfer finished (request aborted on D). Blocks only
        while a write into this request's pages is in progress; when it returns no write will
        follow and no event for the rendezvous will come out of `poll` (one already queued is
        discarded). If the transfer was still in progress and a frame of it arrived, `kv_cancel`
        with `reason` is then queued for its sender (never blocks). Returns False if there was
        nothing to take back (the event was already polled, or the rendezvous never expected)."""

    @abc.abstractmethod
    def poll(self, timeout: float = 0.0) -> list[TransferEvent]:
        """Events since the last call, in completion order; expectations past their deadline
        are reported failed here (after any write in progress into their pages has ended), and
        their senders get `kv_cancel` (a transfer refused at `kv_done` is told when refused).
        Waits at most `timeout` seconds for at least one event (0: never blocks)."""

    @abc.abstractmethod
    def stats(self) -> ReceiverStats:
        """A snapshot of the counters."""

    @abc.abstractmethod
    def close(self, timeout: float = 1.0) -> None:
        """Stop the I/O thread (joined with `timeout`) and release the socket. Expectations
        still open are dropped without events: the decode node is shutting down (it `cancel`s
        its requests first; the kv_cancels queued by then still go out, best effort)."""
