"""One request as the router sees it: a forward-only state machine, its events and its timings.

    CREATED -> RESERVING -> PREFILLING -> DECODING -> FINISHED
         \\____________\\____________\\___________\\--> FAILED (sticky)

A request only moves to a later state; FINISHED and FAILED are terminal, so a late message
(a token after an abort, a second error) can never revive it or end it twice. The HTTP handler
consumes `events`: `TokenEvent`s in output order, then exactly one terminal event (a
`TokenEvent` with `finish_reason` set, or an `ErrorEvent`).
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from engine.sampling import SamplingParams


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


@dataclass(frozen=True)
class TokenEvent:
    """New output tokens; `finish_reason` ("stop" | "length") on the last one."""

    token_ids: list[int]
    finish_reason: str | None = None


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
    room: int
    prompt_ids: list[int]
    sampling: SamplingParams
    stop_ids: frozenset[int]  # tokens that end the request with "stop" (EOS + stop_token_ids)
    state: RequestState = RequestState.CREATED
    prefill_node: str | None = None
    decode_node: str | None = None
    kv_endpoint: str = ""  # the decode node's, from its ReserveReply
    reserved_pages: int = 0  # what the decode node reserved (the router's load estimate)
    holds_prefill: bool = False  # counted in the prefill node's queued tokens
    holds_decode: bool = False  # counted in the decode node's reserved pages
    num_output_tokens: int = 0
    finish_reason: str | None = None
    error: ErrorEvent | None = None
    pending_tokens: list[int] = field(default_factory=list)  # D's tokens that beat P's first
    pending_finish: str | None = None
    timings: RequestTimings = field(default_factory=RequestTimings)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def is_done(self) -> bool:
        return self.state.is_terminal

    def accept_tokens(self, tokens: list[int], max_positions: int) -> tuple[list[int], str | None]:
        """The router's own stop check over newly arrived tokens: the prefix up to and including
        the first stop token ("stop") or the token reaching max_new_tokens or the context end
        ("length"), so a request ends on time even if a node's finish comes late or never."""
        for i, token in enumerate(tokens):
            total = self.num_output_tokens + i + 1
            if token in self.stop_ids:
                return tokens[: i + 1], "stop"
            if total >= self.sampling.max_new_tokens or self.prompt_len + total >= max_positions:
                return tokens[: i + 1], "length"
        return list(tokens), None

    def overdue(
        self, now: float, prefill_limit_s: float, decode_limit_s: float
    ) -> ErrorEvent | None:
        """The error for a request past its stage deadline: no first token `prefill_limit_s`
        after dispatch, or still decoding `decode_limit_s` after the first token."""
        t = self.timings
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
