"""The prefill node's scheduler: chunked prefill of several requests packed under a token budget.

Pure bookkeeping (no model, no sockets): `add` / `abort` / `expire` / `schedule` -> chunks /
`update(chunks)` -> finished requests. Pages come from the node's `KVPool` allocator: a request
gets pages for its whole prompt when it is first scheduled (so a started prefill never stalls
for pages) and gives them back the moment it finishes, fails or is aborted.

A request's state only moves forward: WAITING -> RUNNING -> FINISHED, and any state -> FAILED
(sticky; an abort is a failure with the reason "aborted").
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from engine.cost_model import prompt_features
from engine.errors import InvalidRequestError, OutOfPagesError
from engine.kv_pool import KVPool, PageTable
from engine.logprobs import TokenLogprobs
from engine.sampling import SamplingParams


class PrefillState(enum.IntEnum):
    WAITING = 0  # queued, no pages yet
    RUNNING = 1  # holds pages for the whole prompt; some chunks computed
    FINISHED = 2  # every chunk computed; pages freed
    FAILED = 3  # aborted, timed out or errored; pages freed (sticky)


@dataclass
class PrefillRequest:
    request_id: str
    room: int
    token_ids: list[int]
    params: SamplingParams
    kv_endpoint: str
    arrival: float  # time.monotonic() when it arrived
    queue_deadline: float  # must start before this (stage "prefill_queue")
    generator: Any = None  # the request's torch.Generator (None when greedy)
    state: PrefillState = PrefillState.WAITING
    num_computed: int = 0  # prompt tokens whose KV is in the cache
    table: PageTable | None = None
    start_time: float | None = None  # first scheduled
    error: str = ""
    # With params.prompt_logprobs: one entry per prompt token after the first, chunk by chunk.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.token_ids)

    @property
    def num_remaining(self) -> int:
        return self.prompt_len - self.num_computed

    def advance(self, state: PrefillState) -> None:
        """Moves the state forward; FAILED is sticky and nothing moves backwards."""
        if self.state == PrefillState.FAILED or state < self.state:
            raise RuntimeError(f"request {self.request_id}: {self.state.name} -> {state.name}")
        self.state = state


@dataclass(frozen=True)
class Chunk:
    """Prompt positions [start, end) of one request, computed in this forward."""

    request: PrefillRequest
    start: int
    end: int

    @property
    def tokens(self) -> list[int]:
        return self.request.token_ids[self.start : self.end]

    @property
    def is_last(self) -> bool:
        return self.end == self.request.prompt_len


@dataclass
class PrefillScheduler:
    """FIFO chunked prefill. Each `schedule` packs chunks of at most `chunk_size` tokens, first
    continuing running requests, then starting waiting ones, until `max_batch_tokens` is used
    up or the pool cannot hold the next waiting prompt (head-of-line: order is kept)."""

    pool: KVPool
    chunk_size: int
    max_batch_tokens: int
    _requests: OrderedDict[str, PrefillRequest] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if not 1 <= self.chunk_size <= self.max_batch_tokens:
            raise ValueError("need 1 <= chunk_size <= max_batch_tokens")

    # ---- queries ---------------------------------------------------------------------------
    def get(self, request_id: str) -> PrefillRequest | None:
        return self._requests.get(request_id)

    @property
    def requests(self) -> list[PrefillRequest]:
        return list(self._requests.values())

    @property
    def num_waiting(self) -> int:
        return sum(r.state == PrefillState.WAITING for r in self._requests.values())

    @property
    def num_running(self) -> int:
        return sum(r.state == PrefillState.RUNNING for r in self._requests.values())

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens not yet computed (the router pairs by this)."""
        return sum(r.num_remaining for r in self._requests.values())

    def has_work(self) -> bool:
        return bool(self._requests)

    def queued_work(self) -> tuple[int, int, int]:
        """(tokens, sum of new*prefix, forwards at least) still to compute: what the router's
        cost model turns into this node's queue time (SLA admission, issue 10 part 2)."""
        tokens = attention = longest = 0
        for r in self._requests.values():
            new, attn, forwards = prompt_features(r.prompt_len, r.num_computed, self.chunk_size)
            tokens, attention, longest = tokens + new, attention + attn, max(longest, forwards)
        return tokens, attention, max(longest, -(-tokens // self.max_batch_tokens))

    # ---- changes ---------------------------------------------------------------------------
    def add(self, request: PrefillRequest) -> None:
        """Queues a request. InvalidRequestError for a duplicate id or a prompt that could never
        fit this node's pool."""
        if request.request_id in self._requests:
            raise InvalidRequestError(f"request {request.request_id} is already on this node")
        if request.prompt_len == 0:
            raise InvalidRequestError("the prompt is empty")
        num_pages = -(-request.prompt_len // self.pool.page_size)
        if num_pages > self.pool.num_pages:
            raise InvalidRequestError(
                f"the prompt needs {num_pages} KV pages, this prefill node has {self.pool.num_pages}"
            )
        self._requests[request.request_id] = request

    def abort(self, request_id: str, reason: str = "aborted") -> PrefillRequest | None:
        """Removes the request, frees its pages and marks it FAILED; None if unknown."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._fail(request, reason)
        return request

    def expire(self, now: float) -> list[PrefillRequest]:
        """Waiting requests past their queue deadline, removed and FAILED."""
        late = [
            r
            for r in self._requests.values()
            if r.state == PrefillState.WAITING and now > r.queue_deadline
        ]
        for r in late:
            waited = now - r.arrival
            self.abort(r.request_id, f"waited {waited:.1f}s in the prefill queue (timed out)")
        return late

    def schedule(self, now: float = 0.0) -> list[Chunk]:
        """The chunks of the next forward (empty when idle or out of pages)."""
        budget = self.max_batch_tokens
        chunks: list[Chunk] = []
        for request in self._requests.values():
            if budget == 0:
                break
            if request.state == PrefillState.WAITING:
                if not self._start(request, now):
                    break  # keep FIFO order: nobody overtakes a prompt waiting for pages
            size = min(self.chunk_size, request.num_remaining, budget)
            chunks.append(Chunk(request, request.num_computed, request.num_computed + size))
            budget -= size
        return chunks

    def update(self, chunks: list[Chunk]) -> list[PrefillRequest]:
        """Records that `chunks` were computed (and their rows read). Returns the requests whose
        prompt is now complete: FINISHED, removed, their pages freed."""
        finished = []
        for chunk in chunks:
            request = chunk.request
            if request.state != PrefillState.RUNNING or request.num_computed != chunk.start:
                continue  # aborted meanwhile (its pages are already free)
            request.num_computed = chunk.end
            if chunk.is_last:
                self._release(request)
                request.advance(PrefillState.FINISHED)
                del self._requests[request.request_id]
                finished.append(request)
        return finished

    # ---- internals -------------------------------------------------------------------------
    def _start(self, request: PrefillRequest, now: float) -> bool:
        table = self.pool.new_table()
        try:
            self.pool.reserve(table, request.prompt_len)
        except OutOfPagesError:
            return False
        request.table = table
        request.start_time = now
        request.advance(PrefillState.RUNNING)
        return True

    def _release(self, request: PrefillRequest) -> None:
        if request.table is not None:
            self.pool.release(request.table)
            request.table = None

    def _fail(self, request: PrefillRequest, reason: str) -> None:
        self._release(request)
        if request.state != PrefillState.FAILED:
            request.error = reason
            request.state = PrefillState.FAILED
