"""The prefill node's scheduler: chunked prefill of several requests packed under a token budget.

Pure bookkeeping (no model, no sockets): `add` / `abort` / `expire` / `schedule` -> chunks /
`update(chunks)` -> finished requests. Pages come from the node's `KVPool` allocator: a request
gets pages for its whole prompt when it is first scheduled (so a started prefill never stalls
for pages) and gives them back the moment it finishes, fails or is aborted.

With a prefix cache (`runtime.prefix_cache`), a starting request first looks its prompt up:
the cached whole pages become the first pages of its table (shared with the tree, locked while
it runs) and its computation starts after them; it allocates pages only for the rest, evicting
unlocked cached pages when the pool is short. With the cache's disk tier, the pages that follow
the pool's match are read from disk into the request's own pages (the one place this scheduler
touches more than memory). On finish its whole prompt pages go into the tree
(which takes those it lacks; the tail page and duplicates are freed); on a failure it frees only
its own pages and unlocks the shared ones.

A request's state only moves forward: WAITING -> RUNNING -> FINISHED, and any state -> FAILED
(sticky; an abort is a failure with the reason "aborted").
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from control.cost_model import prompt_features
from control.errors import InvalidRequestError, OutOfPagesError
from control.logprobs import TokenLogprobs
from control.sampling_params import SamplingParams
from model.kv_pool import KVPool, PageTable
from runtime.prefix_cache import PrefixCache, PrefixMatch


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
    state: PrefillState = PrefillState.WAITING
    num_computed: int = 0  # prompt tokens whose KV is in the cache
    table: PageTable | None = None
    start_time: float | None = None  # first scheduled
    error: str = ""
    # With params.prompt_logprobs: one entry per prompt token after the first, chunk by chunk.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Prefix cache: the first `num_cached` prompt tokens came from it; the first
    # `num_shared_pages` pages of `table` are the tree's, locked by `cache_match` until the end.
    num_cached: int = 0
    num_shared_pages: int = 0
    # kv_security = "aead": the decode node's key for this transfer (every KV message sealed
    # with it: kvtransfer.sealing); None: sent as is.
    kv_key: bytes | None = field(default=None, repr=False)
    cache_match: PrefixMatch | None = None
    # The leading rows the decode node holds already (its own prefix cache): not sent.
    skip_rows: int = 0
    # Structured output: the grammar's matcher (runtime.grammar), whose mask constrains the
    # first token; None for free text.
    grammar: Any = None

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
    up or the pool cannot hold the next waiting prompt (head-of-line: order is kept).
    `prefix_cache`: over `pool`, or None to compute every prompt from its first token."""

    pool: KVPool
    chunk_size: int
    max_batch_tokens: int
    prefix_cache: PrefixCache | None = None
    _requests: OrderedDict[str, PrefillRequest] = field(default_factory=OrderedDict)
    _tick: int = 0  # logical clock of the cache's LRU: one tick per start and finish

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

    @property
    def num_request_pages(self) -> int:
        """Pages held by queued or running requests alone (the cache's pages not counted)."""
        cached = self.prefix_cache.num_cached_pages if self.prefix_cache is not None else 0
        return self.pool.allocator.num_used - cached

    def has_work(self) -> bool:
        return bool(self._requests)

    def queued_work(self) -> tuple[int, int, int]:
        """(tokens, sum of new*prefix, forwards at least) still to compute: what the router's
        cost model turns into this node's queue time (SLA admission)."""
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
                self._cache_prompt(request)
                self._release(request)
                request.advance(PrefillState.FINISHED)
                del self._requests[request.request_id]
                finished.append(request)
        return finished

    # ---- internals -------------------------------------------------------------------------
    def _start(self, request: PrefillRequest, now: float) -> bool:
        table = self.pool.new_table()
        match = self._lookup(request)
        if match is not None:
            self.prefix_cache.lock(match.handle)  # not evicted to make room for the rest
            table.pages = list(match.pages)
        short = table.pages_needed(request.prompt_len) - self.pool.allocator.num_free
        cache = self.prefix_cache
        if short > 0 and cache is not None and cache.num_evictable_pages() >= short:
            cache.evict(short)  # (only when that is enough: no cache lost for a prompt that waits)
        try:
            self.pool.reserve(table, request.prompt_len)
        except OutOfPagesError:
            if match is not None:
                self.prefix_cache.unlock(match.handle)
            return False
        if match is not None:
            self.prefix_cache.record_lookup(match.num_tokens)
            request.cache_match, request.num_shared_pages = match, len(match.pages)
            # The disk tier: the pages after the pool's match, read into the request's own.
            limit = self._cacheable_len(request)
            loaded = cache.load_from_store(request.token_ids[:limit], table, match.num_tokens)
            request.num_cached = request.num_computed = match.num_tokens + loaded
        request.table = table
        request.start_time = now
        request.advance(PrefillState.RUNNING)
        return True

    def _lookup(self, request: PrefillRequest) -> PrefixMatch | None:
        """The cached prefix a starting request may use; None without a cache or when its
        prompt logits are wanted (they must be computed)."""
        if self.prefix_cache is None or request.params.prompt_logprobs is not None:
            return None
        self._tick += 1
        return self.prefix_cache.match(
            request.token_ids[: self._cacheable_len(request)], self._tick
        )

    def prefetch(self, request: PrefillRequest) -> None:
        """A request just added: the cache's disk tier starts reading the pages it may load
        when the request starts (none for a request that will not use the cache)."""
        if self.prefix_cache is not None and request.params.prompt_logprobs is None:
            self.prefix_cache.prefetch(request.token_ids[: self._cacheable_len(request)])

    def _cacheable_len(self, request: PrefillRequest) -> int:
        """The prompt's tokens a cache may serve: whole pages, at most prompt_len - 1 (the last
        prompt token is always computed: its logits give the first output token)."""
        ps = self.pool.page_size
        return (request.prompt_len - 1) // ps * ps

    def _cache_prompt(self, request: PrefillRequest) -> None:
        """Hands the finished prompt's whole pages to the tree (it keeps those it lacked); the
        table keeps only what the tree did not take, for `_release` to free."""
        if self.prefix_cache is None or request.table is None:
            return
        num_pages = request.prompt_len // self.pool.page_size
        pages = request.table.pages
        self._tick += 1
        not_taken = self.prefix_cache.insert(
            request.token_ids[: num_pages * self.pool.page_size], pages[:num_pages], self._tick
        )
        request.table.pages = not_taken + pages[num_pages:]
        request.num_shared_pages = 0  # the tree holds its shared pages and took the rest

    def _release(self, request: PrefillRequest) -> None:
        """Frees the request's own pages (never the shared cached ones) and unlocks those."""
        table = request.table
        if table is not None:
            table.pages = table.pages[request.num_shared_pages :]
            self.pool.release(table)
            request.table = None
        if request.cache_match is not None:
            self.prefix_cache.unlock(request.cache_match.handle)
            request.cache_match = None

    def _fail(self, request: PrefillRequest, reason: str) -> None:
        self._release(request)
        if request.state != PrefillState.FAILED:
            request.error = reason
            request.state = PrefillState.FAILED
