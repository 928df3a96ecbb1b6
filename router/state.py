"""One request as the router sees it: a forward-only state machine, its events and its timings.

    CREATED -> RESERVING -> PREFILLING -> DECODING -> FINISHED
         \\____________\\____________\\___________\\--> FAILED (sticky)

A request only moves to a later state; FINISHED and FAILED are terminal, so a late message
(a token after an abort, a second error) can never revive it or end it twice. The one way back
is `restart()`: when a node dies under a request that is not terminal, or a decode node
preempts it (its KV pool ran out), the router restarts it as a new *attempt* (RESERVING again)
on another pair or the same one, with its own wire id, so messages still in flight for the old
attempt find nothing; a decode-side restart re-prefills the prompt plus the tokens already
streamed, and the stream goes on where it stopped. The HTTP handler
consumes `events`: `TokenEvent`s in output order, then exactly one terminal event (a
`TokenEvent` with `finish_reason` set, or an `ErrorEvent`).

n > 1: the request is sequence 0; sequences 1 .. n-1 are `forks`, RouterRequests of their own
(id `<request id>/<i>`, sampling `for_sequence(i)`) that wait in CREATED while the request is
reserved and prefilled (the decode node forks them from its KV), follow its restarts (their
wire ids carry its attempt), and end with it if it ends before its first token. At P's first
token each starts DECODING on the same decode node and is on its own from then on: its own
tokens, finish, abort, preemption and restarts (as one sequence: prompt + its output).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from dataclasses import dataclass, field

from control.finish import finish_reason
from control.logprobs import TokenLogprobs
from control.sampling_params import SamplingParams


class RequestState(enum.IntEnum):
    CREATED = 0
    RESERVING = 1  # Reserve sent to a decode node, waiting for its reply
    PREFILLING = 2  # Prefill sent; waiting for the first token
    DECODING = 3  # first token seen; the decode node streams the rest
    FINISHED = 4  # terminal: a completion (EOS, length, stop string)
    FAILED = 5  # terminal and sticky: an error, a timeout or a client that went away

    @property
    def is_terminal(self) -> bool:
        return self >= RequestState.FINISHED


# The stage an error names for a request that fails (or moves) in each running state.
STAGE_OF_STATE = {
    RequestState.CREATED: "reserve",
    RequestState.RESERVING: "reserve",
    RequestState.PREFILLING: "prefill",
    RequestState.DECODING: "decode",
}


@dataclass(frozen=True)
class TokenEvent:
    """New output tokens; `finish_reason` ("stop" | "length") on the last one. `logprobs`: one
    per token when the sampling asked for them (else empty)."""

    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed at `stage` (reserve, prefill_queue, prefill, transfer, decode, node)."""

    stage: str
    message: str


@dataclass
class RequestTimings:
    """Monotonic seconds; 0.0 until the moment happened."""

    arrival: float = field(default_factory=time.monotonic)
    reserved: float = 0.0
    dispatched: float = 0.0  # Prefill sent
    first_token: float = 0.0
    last_token: float = 0.0
    finished: float = 0.0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    def tpot(self, num_tokens: int) -> float | None:
        """Mean time per output token after the first (None below two tokens)."""
        if num_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (num_tokens - 1)


@dataclass
class RouterRequest:
    """Everything the router holds for one request. Mutated only on the event loop thread."""

    request_id: str
    room: int  # the current attempt's (a fresh one per attempt, so stale KV frames are dropped)
    prompt_ids: list[int]
    sampling: SamplingParams
    stop_ids: frozenset[int]  # tokens that end the request with "stop" (EOS + stop_token_ids)
    state: RequestState = RequestState.CREATED
    prefill_node: str | None = None
    decode_node: str | None = None
    kv_endpoint: str = ""  # the decode node's, from its ReserveReply
    kv_key: bytes = field(default=b"", repr=False)  # its transfer key (kv_security = "aead")
    kv_cached_rows: int = 0  # leading prompt rows the decode node holds (not sent again)
    cached_tokens: int = 0  # prompt tokens the prefill node's cache served (its first attempt)
    reserved_pages: int = 0  # what the decode node reserved (the router's load estimate)
    holds_prefill: bool = False  # counted in the prefill node's queued tokens
    holds_decode: bool = False  # counted in the decode node's reserved pages
    num_output_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)  # every token accepted for the client
    attempt: int = 0  # 0 for the first; +1 at each restart on another node pair
    finish_reason: str | None = None
    error: ErrorEvent | None = None
    pending_tokens: list[int] = field(default_factory=list)  # D's tokens that beat P's first
    pending_finish: str | None = None
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # The prompt logprobs (tokens after the first), when asked, from an attempt that had no
    # output yet; None until then.
    prompt_logprobs: list[TokenLogprobs] | None = None
    timings: RequestTimings = field(default_factory=RequestTimings)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    # On-demand decode KV: restarts because a decode node preempted the
    # request (part of `attempt`, not of the migrations), and a Preempted that beat P's
    # FirstToken (its reason), applied once that token is in.
    num_preemptions: int = 0
    pending_preempt: str | None = None
    room_wait_s: float = 0.0  # waiting for decode room, in turn (`router.room_queue`)
    # n > 1 (see the module docstring): sequences 1 .. n-1, and for a fork its parent.
    forks: list[RouterRequest] = field(default_factory=list, repr=False, compare=False)
    parent: RouterRequest | None = field(default=None, repr=False, compare=False)
    # What this router puts in front of its wire ids (`control.router_links.wire_prefix`).
    wire_prefix: str = ""

    @property
    def pending_forks(self) -> list[RouterRequest]:
        """Every fork (n - 1) until they start at this request's first token (its sampling is
        then one sequence's), then none. One of them may already have ended (router shutdown)."""
        return self.forks if self.sampling.n > 1 else []

    @property
    def num_migrations(self) -> int:
        """Restarts because a node was lost (bounded by `[router] max_migrations`)."""
        return self.attempt - self.num_preemptions

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def wire_id(self) -> str:
        """The id the nodes know the current attempt by (the request id for the first, behind
        the router's wire prefix)."""
        attempt = f"~{self.attempt}" if self.attempt else ""
        return f"{self.wire_prefix}{self.request_id}{attempt}"

    @property
    def attempt_prompt_ids(self) -> list[int]:
        """What the current attempt prefills: the prompt and every token already streamed."""
        return self.prompt_ids + self.output_ids

    @property
    def attempt_sampling(self) -> SamplingParams:
        """The sampling of the current attempt: only the tokens still to come. (The tokens
        already streamed are prompt to it: the repetition penalty still sees them, the presence
        and frequency penalties no longer do.)"""
        done = self.num_output_tokens
        remaining = max(1, self.sampling.max_new_tokens - done)
        min_tokens = min(remaining, max(0, self.sampling.min_tokens - done))
        # A later attempt's prompt holds the output too: prompt logprobs come from an attempt
        # that had none yet (the first, or one restarted before its first token).
        prompt_logprobs = self.sampling.prompt_logprobs if done == 0 else None
        return dataclasses.replace(
            self.sampling,
            max_new_tokens=remaining,
            min_tokens=min_tokens,
            prompt_logprobs=prompt_logprobs,
            # Structured output: the grammar replays the output streamed so far.
            structured_resume=done if self.sampling.structured is not None else 0,
            # Seeded sampling draws on where the earlier attempts stopped.
            draw_offset=done,
        )

    def restart(self, room: int) -> None:
        """Starts a new attempt (RESERVING, nodes unassigned). Only for a request that is not
        terminal; the caller has released the old attempt's nodes."""
        assert not self.is_done and not self.holds_prefill and not self.holds_decode
        self.attempt += 1
        self.room = room
        self.state = RequestState.RESERVING
        self.prefill_node = self.decode_node = None
        self.kv_endpoint = ""
        self.kv_key = b""
        self.kv_cached_rows = 0
        self.reserved_pages = 0
        self.pending_tokens, self.pending_finish = [], None
        self.pending_logprobs = []
        self.pending_preempt = None

    @property
    def is_done(self) -> bool:
        return self.state.is_terminal

    def accept_tokens(self, tokens: list[int], max_positions: int) -> tuple[list[int], str | None]:
        """The router's own stop check over newly arrived tokens: the prefix up to and including
        the first stop token ("stop") or the token reaching max_new_tokens or the context end
        ("length"), so a request ends on time even if a node's finish comes late or never.
        The accepted tokens are appended to `output_ids`."""
        out, finish = list(tokens), None
        for i, token in enumerate(tokens):
            total = self.num_output_tokens + i + 1
            finish = finish_reason(
                token,
                self.stop_ids,
                total,
                self.prompt_len + total,
                self.sampling.max_new_tokens,
                max_positions,
            )
            if finish is not None:
                out = tokens[: i + 1]
                break
        self.output_ids.extend(out)
        return out, finish

    def overdue(
        self, now: float, prefill_limit_s: float, decode_limit_s: float
    ) -> ErrorEvent | None:
        """The error for a request past its stage deadline: no first token `prefill_limit_s`
        after dispatch, or still decoding `decode_limit_s` after the first token."""
        t = self.timings
        parent = self.parent
        if self.state == RequestState.CREATED and parent is not None:
            if parent.is_done or parent.state >= RequestState.DECODING:  # never: a backstop
                return ErrorEvent("prefill", "the forked sequence never started (stage prefill)")
            return None
        if self.state == RequestState.PREFILLING and now - t.dispatched > prefill_limit_s:
            return ErrorEvent(
                "prefill_queue",
                f"no first token within {prefill_limit_s:g} s (stage prefill_queue)",
            )
        if self.state == RequestState.DECODING and now - t.first_token > decode_limit_s:
            return ErrorEvent(
                "decode", f"decoding took longer than {decode_limit_s:g} s (stage decode)"
            )
        return None

    def advance(self, new: RequestState) -> bool:
        """Moves to `new` if it is later than the current state; False (and no change) if not.

        FAILED is reachable from any non-terminal state; nothing leaves a terminal state.
        """
        if self.state.is_terminal or new <= self.state:
            return False
        self.state = new
        if new.is_terminal:
            self.timings.finished = time.monotonic()
        return True


RETRY_AFTER_S = 1  # the Retry-After of a refusal (503): the cluster is busy, not broken


class RouterError(Exception):
    """A request refused before it started; the HTTP layer turns it into an error response."""

    def __init__(self, status: int, message: str, code: str, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after
