"""The decode node's scheduler: admission by free KV pages, then continuous batching.

Pure bookkeeping (no model, no sockets): `reserve` / `kv_ready` / `kv_failed` / `abort` /
`expire` / `schedule` -> running batch / `update(batch, tokens)` -> outputs.

Admission reserves pages by `control.kv_reservation`'s rule: "worst_case" holds the prompt plus
every token the request may still generate (clipped to the context), so an admitted request
always finishes without waiting for pages; "on_demand" (the default) holds the prompt plus
`headroom_tokens`, and `schedule` grows each batch member's pages to cover the position it
writes in the step. Either way a request whose worst case exceeds the whole pool is refused:
it could not finish here even alone.

Preemption (on_demand only): when a batch member needs a page and none is free, the READY or
RUNNING request that arrived last at the router (`priority`; ties: the most recently admitted)
is preempted (as vLLM's FCFS policy and SGLang do), possibly
the one that needs the page; victims are taken until the page is found or the requester itself
went. A request whose KV is still arriving (AWAITING_KV) is never preempted: its pages are lent
to the receiver (taking them back means cancelling the transfer on P), its admission already
counted them, and it is never needed for progress: growth is only asked by a runnable request,
and preempting that request (the youngest runnable one at worst) frees what it holds, so the
oldest runnable request always goes on and the awaiting ones run once their KV is in. A
preempted request's pages are freed at once; the node sends the router `Preempted` after the
tokens it already sent, and the router re-prefills it elsewhere or here (prompt + output).

Prefix reuse (`prefix_cache`, a `runtime.prefix_cache.PrefixCache` that holds its pages): the
prompt's whole pages of every request whose KV came in stay cached when it ends (finished,
aborted or preempted after its KV was complete), so a later prompt starting with them reserves
only the rest and its prefill node sends only the rows after them (`DecodeRequest.num_cached`).
Only prompt rows are cached: they came from a prefill node, bit for bit what it would send again,
whereas the rows of generated tokens were computed by the decode step. A match is locked while
its request lives; unlocked pages are evicted (least recently used first) before a reservation
is refused and before any request is preempted.

Requests join the running batch at every step (oldest ready first, up to `max_batch`) and
leave it the step they finish; their pages are freed at once, as they are on abort and failure.
A running request holds a batch slot in [0, max_batch) (the row of the node's per-slot sampling
state, `runtime.penalties.TokenCounts`), given back the same way.

An n > 1 request (`reserve(..., fork_ids)`) reserves for all its sequences at once: its own
pages as any request, and for each fork its own part (the prompt's whole pages are shared,
`KVPool.fork`). The forks wait on the request (`DecodeRequest.forks`), holding their own
pages, until its KV is in; `kv_ready` then makes each a request of its own (READY, with its
own first token, id and batch slot), which decodes, finishes, is aborted or preempted alone.
Until then the request's abort, failure or expiry frees its forks with it.

A request's state only moves forward: AWAITING_KV -> READY -> RUNNING -> FINISHED, READY or
RUNNING -> PREEMPTED, and any state -> FAILED. FINISHED, FAILED (abort included) and PREEMPTED
are terminal: the request has left the scheduler and its pages are free. While AWAITING_KV its
pages are lent to the KV receiver: the node must take them back (`KVReceiver.cancel`) before
calling `abort`.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from control import kv_reservation
from control.errors import OutOfPagesError
from control.finish import finish_reason
from control.sampling_params import SamplingParams
from model.kv_pool import KVPool, PageTable
from runtime.prefix_cache import PrefixCache


class DecodeState(enum.IntEnum):
    AWAITING_KV = 0  # pages reserved and lent to the receiver
    READY = 1  # KV complete, first token known; waiting for a batch slot
    RUNNING = 2  # in the running batch
    FINISHED = 3  # stopped; pages freed
    FAILED = 4  # aborted, incomplete KV, timed out; pages freed (sticky)
    PREEMPTED = 5  # the pool ran out (on_demand): pages freed, the router re-prefills it


TERMINAL = (DecodeState.FINISHED, DecodeState.FAILED, DecodeState.PREEMPTED)


@dataclass
class DecodeRequest:
    request_id: str
    room: int
    prompt_len: int
    params: SamplingParams
    table: PageTable
    num_reserved: int  # tokens reserved at admission (`control.kv_reservation`); pages may grow
    arrival: float
    stop_ids: frozenset[int]
    seed: int = 0  # the random stream (runtime.sampling.request_seed), resolved at reservation
    prompt_ids: list[int] = field(default_factory=list)  # when the sampling or the cache reads them
    priority: float = 0.0  # the router's arrival time of the request: larger is preempted first
    # Structured output: the grammar's matcher (runtime.grammar), past every output token
    # (P's first one included once the KV is ready); None for free text.
    grammar: Any = None
    slot: int = -1  # batch slot while RUNNING
    forks: list[DecodeRequest] = field(default_factory=list)  # n > 1: until the KV is in
    state: DecodeState = DecodeState.AWAITING_KV
    output_ids: list[int] = field(default_factory=list)  # the first token (from P) included
    decode_deadline: float = float("inf")
    ready_time: float | None = None
    finish_reason: str | None = None
    error: str = ""
    # MTP (runtime.speculative): the drafted tokens after output_ids[-1], verified next step.
    drafts: list[int] = field(default_factory=list)
    # Prefix reuse: the leading prompt rows held from the cache (whole pages, never received)
    # and the tree node its lock pins (None: no match).
    num_cached: int = 0
    cache_handle: Any = None

    @property
    def next_position(self) -> int:
        """Position of the last output token, which the next decode step feeds."""
        return self.prompt_len + len(self.output_ids) - 1

    @property
    def is_joining(self) -> bool:
        """In its first decode step: the only output so far is P's first token."""
        return self.state == DecodeState.RUNNING and len(self.output_ids) == 1

    def advance(self, state: DecodeState) -> None:
        if self.state in TERMINAL or state < self.state:
            raise RuntimeError(f"request {self.request_id}: {self.state.name} -> {state.name}")
        self.state = state


@dataclass(frozen=True)
class StepOutput:
    """One token (or none, when the first token already ended it) and the finish reason."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | None while running


@dataclass
class DecodeScheduler:
    pool: KVPool
    max_batch: int
    max_position: int  # the model's context (max_position_embeddings)
    eos_ids: frozenset[int]
    max_requests: int = 0  # reserved + ready + running at most; 0 = 4 * max_batch
    # On-demand KV with preemption: the reservation rule and its headroom.
    reservation: str = kv_reservation.ON_DEMAND
    headroom_tokens: int = 32
    prefix_cache: PrefixCache | None = None  # prompts' KV kept after their requests (reuse)
    num_preempted: int = 0  # cumulative
    _preempted: list[DecodeRequest] = field(default_factory=list)  # not yet taken by the node
    _requests: OrderedDict[str, DecodeRequest] = field(default_factory=OrderedDict)
    _free_slots: list[int] = field(default_factory=list)
    _tick: int = 0  # the prefix cache's logical clock (LRU)

    def __post_init__(self) -> None:
        if self.max_requests <= 0:
            self.max_requests = 4 * self.max_batch
        if self.reservation not in kv_reservation.MODES or self.headroom_tokens < 0:
            raise ValueError(f"bad KV reservation {self.reservation!r} / {self.headroom_tokens}")
        if self.prefix_cache is not None and not self.prefix_cache.holds_pages:
            raise ValueError("a decode node's prefix cache must hold its pages (holds_pages)")
        self._free_slots = list(range(self.max_batch - 1, -1, -1))

    # ---- queries ---------------------------------------------------------------------------
    def get(self, request_id: str) -> DecodeRequest | None:
        return self._requests.get(request_id)

    def count(self, state: DecodeState) -> int:
        return sum(r.state == state for r in self._requests.values())

    @property
    def requests(self) -> list[DecodeRequest]:
        return list(self._requests.values())

    def has_runnable(self) -> bool:
        return any(
            r.state in (DecodeState.READY, DecodeState.RUNNING) for r in self._requests.values()
        )

    def pages_for(self, prompt_len: int, max_new_tokens: int, n: int = 1) -> int:
        """Pages a reservation of `n` sequences takes now (the node's reservation rule)."""
        return self._sequence_pages(self._reserve_len(prompt_len, max_new_tokens), prompt_len, n)

    def num_free_pages(self) -> int:
        """Pages a reservation may take now: the free ones and the cache's evictable ones."""
        cache = self.prefix_cache
        return self.pool.allocator.num_free + (cache.num_evictable_pages() if cache else 0)

    @property
    def num_held(self) -> int:
        """Requests held, the forks still waiting for their parent's KV included."""
        return sum(1 + len(r.forks) for r in self._requests.values())

    def take_preempted(self) -> list[DecodeRequest]:
        """The requests preempted since the last call (PREEMPTED, pages already freed), in the
        order they were preempted; the node tells the router about each."""
        out, self._preempted = self._preempted, []
        return out

    # ---- admission -------------------------------------------------------------------------
    def reserve(
        self,
        request_id: str,
        room: int,
        prompt_len: int,
        params: SamplingParams,
        now: float,
        priority: float = 0.0,
        fork_ids: tuple[str, ...] = (),
        prompt_ids: list[int] | tuple[int, ...] = (),
    ) -> tuple[DecodeRequest | None, str]:
        """Reserves pages; returns (request, "") or (None, why it was refused). `priority`
        orders preemption (see `_victim`). With `fork_ids` (n > 1: params.n - 1 ids), the
        pages of every fork too, all or nothing; each fork samples by
        `params.for_sequence(i)`, and the request itself by `params.for_sequence(0)`.
        `prompt_ids` (all `prompt_len` of them, or none): the prompt, looked up in the prefix
        cache (the request starts with the pages of its longest cached prefix, `num_cached`)
        and cached when the request ends."""
        ids = (request_id, *fork_ids)
        if len(fork_ids) != params.n - 1 or len(set(ids)) != len(ids):
            return None, f"n = {params.n} needs {params.n - 1} distinct fork ids"
        known = [i for i in ids if i in self._requests or self._is_pending_fork(i)]
        if known:
            return None, f"request {known[0]} is already on this decode node"
        if not 0 < prompt_len < self.max_position:
            return None, (
                f"a prompt of {prompt_len} tokens does not fit the context of {self.max_position}"
            )
        if self.num_held + len(ids) > self.max_requests:
            return None, f"too many requests ({self.num_held} on this decode node)"
        worst = kv_reservation.worst_case_tokens(
            prompt_len, params.max_new_tokens, self.max_position
        )
        worst_pages = self._sequence_pages(worst, prompt_len, params.n)
        if self.reservation == kv_reservation.ON_DEMAND and worst_pages > self.pool.num_pages:
            # (worst_case reserves all of it now: the plain "no room" below says the same)
            return None, (
                f"cannot fit at all: needs {worst_pages} KV pages to finish, the pool "
                f"has {self.pool.num_pages}"
            )
        num_tokens = self._reserve_len(prompt_len, params.max_new_tokens)
        own_tokens = kv_reservation.fork_tokens(num_tokens, prompt_len, self.pool.page_size)
        match = self._lookup(prompt_ids, prompt_len)
        sequences = []
        for index, rid in enumerate(ids):
            table = self.pool.new_table()
            if index == 0 and match is not None:  # pinned before anything is evicted for room
                self.prefix_cache.lock(match.handle)
                self.pool.allocator.share(match.pages)
                table.pages = list(match.pages)
            if not self._reserve_pages(table, num_tokens if index == 0 else own_tokens):
                self.pool.release(table)
                for sequence in sequences:
                    self.pool.release(sequence.table)
                if match is not None:
                    self.prefix_cache.unlock(match.handle)
                need = self._sequence_pages(num_tokens, prompt_len, params.n)
                return None, f"no room: needs {need} KV pages, {self.num_free_pages()} free"
            sequence_params = params.for_sequence(index)
            sequences.append(
                DecodeRequest(
                    rid,
                    room,
                    prompt_len,
                    sequence_params,
                    table,
                    num_tokens,
                    now,
                    sequence_params.stop_ids(self.eos_ids),
                    priority=priority,
                )
            )
        request, request.forks = sequences[0], sequences[1:]
        if len(prompt_ids) == prompt_len:
            for sequence in sequences:
                sequence.prompt_ids = list(prompt_ids)
        if match is not None:
            self.prefix_cache.record_lookup(match.num_tokens)
            request.num_cached, request.cache_handle = match.num_tokens, match.handle
        self._requests[request_id] = request
        return request, ""

    def kv_ready(
        self,
        request_id: str,
        first_token: int,
        now: float,
        decode_timeout: float,
        fork_tokens: tuple[int, ...] = (),
        draft_tokens: tuple[int, ...] = (),
    ) -> list[StepOutput]:
        """The KV is complete: the request joins the ready queue with P's first token, and
        each of its forks (n > 1) with its own (`fork_tokens`, in fork order) right after it.
        A sequence whose first token already ends it finishes here: its StepOutput (no new
        tokens) is returned. `draft_tokens`: P's MTP draft after the first token (the
        request's own; its forks, whose first tokens differ, draft from their first step)."""
        request = self._requests[request_id]
        if len(fork_tokens) != len(request.forks):
            raise ValueError(
                f"request {request_id}: {len(fork_tokens)} fork tokens for "
                f"{len(request.forks)} forks"
            )
        forks, request.forks = request.forks, []
        for fork in forks:  # the prompt's pages are shared before anything can free them
            self.pool.fork(request.table, request.prompt_len, fork.table)
        sequences = [request, *forks]
        for fork in forks:
            self._requests[fork.request_id] = fork
        request.drafts = list(draft_tokens)
        outputs = []
        for sequence, token in zip(sequences, (first_token, *fork_tokens), strict=True):
            sequence.advance(DecodeState.READY)
            sequence.ready_time = now
            sequence.decode_deadline = now + decode_timeout
            sequence.output_ids.append(token)
            reason = self._finish_reason(sequence, token)
            if reason is not None:
                self._finish(sequence, reason)
                outputs.append(StepOutput(sequence.request_id, [], reason))
        return outputs

    def kv_failed(self, request_id: str, reason: str) -> DecodeRequest | None:
        """The receiver gave the pages back with incomplete rows: free them, never decode."""
        return self.abort(request_id, reason)

    def abort(self, request_id: str, reason: str = "aborted") -> DecodeRequest | None:
        """Frees the request's pages at once and marks it FAILED; None if unknown. If it was
        AWAITING_KV the caller must have cancelled the receiver's expectation first."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._leave_pool(request)
            self._free_slot(request)
            request.error = reason
            request.state = DecodeState.FAILED
            for fork in request.forks:  # still waiting for the KV: they go with it
                self.pool.release(fork.table)
                fork.error, fork.state = reason, DecodeState.FAILED
        return request

    def expire(self, now: float) -> list[DecodeRequest]:
        """Ready/running requests past their decode deadline, removed and FAILED."""
        late = [
            r
            for r in self._requests.values()
            if r.state in (DecodeState.READY, DecodeState.RUNNING) and now > r.decode_deadline
        ]
        for r in late:
            self.abort(
                r.request_id, f"decoding took longer than allowed ({len(r.output_ids)} tokens)"
            )
        return late

    # ---- continuous batching ---------------------------------------------------------------
    def schedule(self, batch_cap: int | None = None) -> list[DecodeRequest]:
        """The running batch of the next step: everything running plus the oldest ready
        requests, up to `max_batch` and up to `batch_cap` (the node's cap that keeps the
        predicted step within the TPOT SLA; at least 1, so one request always runs), each with
        pages for the position it writes. A cap below the running count pauses no one: only
        newcomers wait, in READY. Requests preempted to find pages left the scheduler
        (`take_preempted`)."""
        limit = self.max_batch if batch_cap is None else max(1, min(self.max_batch, batch_cap))
        batch = [r for r in self._requests.values() if r.state == DecodeState.RUNNING]
        for request in self._requests.values():
            if len(batch) >= limit:
                break
            if request.state == DecodeState.READY:
                request.advance(DecodeState.RUNNING)
                request.slot = self._free_slots.pop()
                batch.append(request)
        self._grow(batch)
        return [r for r in batch if r.state == DecodeState.RUNNING]

    def update(self, batch: list[DecodeRequest], tokens: list[int]) -> list[StepOutput]:
        """Appends each request's sampled token; finished requests leave (pages freed)."""
        return self.update_many(batch, [[token] for token in tokens])

    def update_many(self, batch: list[DecodeRequest], tokens: list[list[int]]) -> list[StepOutput]:
        """`update` for steps that emit several tokens per request (MTP): each request takes
        its tokens in order up to the first that ends it; the rest are dropped."""
        outputs = []
        for request, new_tokens in zip(batch, tokens, strict=True):
            if request.state != DecodeState.RUNNING:
                continue  # aborted during the step
            kept, reason = [], None
            for token in new_tokens:
                request.output_ids.append(token)
                kept.append(token)
                reason = self._finish_reason(request, token)
                if reason is not None:
                    self._finish(request, reason)
                    break
            outputs.append(StepOutput(request.request_id, kept, reason))
        return outputs

    # ---- on-demand growth and preemption ---------------------------------------------------
    def _grow(self, batch: list[DecodeRequest]) -> None:
        """Gives every batch member room for the position it writes, oldest admitted first,
        preempting the youngest runnable requests (see the module docstring) when short."""
        order = {rid: i for i, rid in enumerate(self._requests)}
        for request in sorted(batch, key=lambda r: order[r.request_id]):
            need = request.next_position + 1
            while request.state == DecodeState.RUNNING and request.table.capacity < need:
                if not self._reserve_pages(request.table, need):
                    victim = self._victim()
                    self._preempt(
                        victim,
                        f"the KV pool ({self.pool.num_pages} pages) ran out: request "
                        f"{request.request_id} needed a page for position {need - 1}",
                    )

    def _victim(self) -> DecodeRequest:
        """The READY or RUNNING request to preempt: the latest arrival at the router (largest
        priority), ties (equal priorities, e.g. all 0) to the most recently admitted. A request
        re-prefilled after a preemption keeps its first arrival, so it is not the next victim
        again just because it was admitted last (which would thrash it into max_preemptions)."""
        runnable = [
            (r.priority, index, r)
            for index, r in enumerate(self._requests.values())
            if r.state in (DecodeState.READY, DecodeState.RUNNING)
        ]  # the requester itself is RUNNING: never empty
        return max(runnable, key=lambda entry: entry[:2])[2]

    def _preempt(self, request: DecodeRequest, reason: str) -> None:
        self._leave_pool(request)  # (its KV was complete: the prompt's pages stay cached)
        request.advance(DecodeState.PREEMPTED)
        request.error = reason
        self._free_slot(request)
        del self._requests[request.request_id]
        self._preempted.append(request)
        self.num_preempted += 1

    # ---- prefix reuse ----------------------------------------------------------------------
    def _lookup(self, prompt_ids, prompt_len: int):
        """The longest cached prefix of the prompt (whole pages), or None (no cache, no ids,
        no page of it cached)."""
        if self.prefix_cache is None or len(prompt_ids) != prompt_len:
            return None
        self._tick += 1
        whole = prompt_len // self.pool.page_size * self.pool.page_size
        match = self.prefix_cache.match(list(prompt_ids[:whole]), self._tick)
        if match.num_tokens == 0:
            self.prefix_cache.record_lookup(0)
            return None
        return match

    def _reserve_pages(self, table: PageTable, num_tokens: int) -> bool:
        """Grows `table` to `num_tokens` tokens, evicting unlocked cached pages when short;
        False (table unchanged) when even that leaves too few."""
        while True:
            try:
                self.pool.reserve(table, num_tokens)
                return True
            except OutOfPagesError:
                short = table.pages_needed(num_tokens) - self.pool.allocator.num_free
                if self.prefix_cache is None or self.prefix_cache.evict(short) == 0:
                    return False

    def _leave_pool(self, request: DecodeRequest) -> None:
        """Frees the request's pages; first, when its KV is complete (READY or RUNNING), hands
        its prompt's whole pages to the prefix cache, which keeps those it lacked."""
        cache = self.prefix_cache
        complete = request.state in (DecodeState.READY, DecodeState.RUNNING)
        if cache is not None and complete and len(request.prompt_ids) == request.prompt_len:
            num_pages = request.prompt_len // self.pool.page_size
            self._tick += 1
            cache.insert(
                request.prompt_ids[: num_pages * self.pool.page_size],
                request.table.pages[:num_pages],
                self._tick,
            )  # (pages it already held, or did not take, stay the request's to free)
        self.pool.release(request.table)
        if request.cache_handle is not None:
            cache.unlock(request.cache_handle)
            request.cache_handle = None

    # ---- internals -------------------------------------------------------------------------
    def _reserve_len(self, prompt_len: int, max_new_tokens: int) -> int:
        return kv_reservation.reservation_tokens(
            self.reservation, self.headroom_tokens, prompt_len, max_new_tokens, self.max_position
        )

    def _pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.pool.page_size)

    def _sequence_pages(self, num_tokens: int, prompt_len: int, n: int) -> int:
        """Pages of a request of `n` sequences reserving `num_tokens` each (forks: their own
        part only)."""
        own = kv_reservation.fork_tokens(num_tokens, prompt_len, self.pool.page_size)
        return self._pages(num_tokens) + (n - 1) * self._pages(own)

    def _is_pending_fork(self, request_id: str) -> bool:
        return any(f.request_id == request_id for r in self._requests.values() for f in r.forks)

    def _finish_reason(self, request: DecodeRequest, token: int) -> str | None:
        """`control.finish.finish_reason` of the token just appended to the output."""
        num_out = len(request.output_ids)
        return finish_reason(
            token,
            request.stop_ids,
            num_out,
            request.prompt_len + num_out,
            request.params.max_new_tokens,
            self.max_position,
        )

    def _finish(self, request: DecodeRequest, reason: str) -> None:
        self._leave_pool(request)
        request.advance(DecodeState.FINISHED)
        request.finish_reason = reason
        self._free_slot(request)
        del self._requests[request.request_id]

    def _free_slot(self, request: DecodeRequest) -> None:
        if request.slot >= 0:
            self._free_slots.append(request.slot)
            request.slot = -1
