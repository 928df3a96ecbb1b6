"""Sampling parameters as plain data: what a request asks of the sampler, checked on arrival.

The router builds them from the HTTP body and every node receives them in its messages, so
they import no torch; the sampler that applies them is `runtime.sampling`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from control.errors import InvalidRequestError
from control.logprobs import MAX_LOGPROBS
from control.structured_output import StructuredOutput

MAX_PENALTY = 2.0  # presence and frequency penalties, as OpenAI bounds them
MAX_BIAS = 100.0  # logit_bias values, as OpenAI bounds them
MAX_SEQUENCES = 16  # n (and best_of): sequences one request may fork into


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; temperature 0 means greedy. Defaults follow the OpenAI API and mean
    "off" for vLLM's extensions (top_k, min_p, repetition_penalty, min_tokens)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    seed: int | None = None
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # logit -= presence * (token in the output)
    frequency_penalty: float = 0.0  # logit -= frequency * (times the token is in the output)
    repetition_penalty: float = 1.0  # over prompt and output: logit / p if logit > 0 else * p
    min_p: float = 0.0  # drop tokens whose probability < min_p * the largest one
    min_tokens: int = 0  # the stop tokens (EOS included unless ignore_eos) wait for this many
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # (token id, bias)
    # Raw logprobs (`control.logprobs`): None = off, k = the sampled token's and the top k.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    # Structured output (`control.structured_output`): (kind, spec), e.g. ("json_schema",
    # "{...}"), or (kind, spec, after) to start after a reasoning model's "</think>"; the
    # sampling nodes mask each token to the grammar. None = free text.
    structured: tuple[str, ...] | None = None
    # A restarted attempt of a structured request (`router.state`): its last `structured_resume`
    # prompt tokens are output already streamed, which the grammar consumes before anything new.
    structured_resume: int = 0
    # A restarted attempt (`router.state`): the tokens the request sampled in its earlier
    # attempts. Its draw indices go on after them, so a seeded request draws the same tokens
    # whether or not it was preempted or moved to another pair.
    draw_offset: int = 0
    # n > 1 / best_of: one prefill, the KV forked on the decode node into `n` sequences;
    # sequence i samples as a request of its own with `for_sequence(i)`.
    n: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 (no limit) or >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be in [0, 2^63), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise InvalidRequestError(
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens = {self.max_new_tokens}], "
                f"got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.structured is not None:
            self._check_structured()
        if not isinstance(self.draw_offset, int) or self.draw_offset < 0:
            raise InvalidRequestError(f"draw_offset must be an int >= 0, got {self.draw_offset!r}")
        if self.structured_resume < 0 or (self.structured_resume and self.structured is None):
            raise InvalidRequestError(
                f"structured_resume must be >= 0 and needs structured, got {self.structured_resume}"
            )
        if not 1 <= self.n <= MAX_SEQUENCES:
            raise InvalidRequestError(f"n must be in [1, {MAX_SEQUENCES}], got {self.n}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise InvalidRequestError(f"logit_bias: token id {token} is negative")
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise InvalidRequestError(
                    f"logit_bias: the bias of token {token} must be in [-100, 100], got {bias}"
                )

    def _check_structured(self) -> None:
        if not (
            isinstance(self.structured, tuple)
            and len(self.structured) in (2, 3)
            and all(isinstance(part, str) for part in self.structured)
        ):
            raise InvalidRequestError(
                "structured must be (kind, spec) or (kind, spec, after), all strings"
            )
        StructuredOutput.of(self.structured)  # the kind and the size; compiling is the node's
        if self.min_tokens:  # EOS is the only token a complete grammar allows
            raise InvalidRequestError(
                "min_tokens cannot be combined with structured output: the grammar decides "
                "where the output ends"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """Reads the output token counts (and the prompt, for the repetition penalty)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def uses_prompt(self) -> bool:
        """The sampling node must know the prompt's token ids (repetition_penalty, and the
        output a resumed grammar replays)."""
        return self.repetition_penalty != 1.0 or self.structured_resume > 0

    def resumed_output(self, prompt_ids: list[int]) -> list[int]:
        """The output a restarted structured attempt replays into its grammar: the prompt's
        last `structured_resume` tokens."""
        if self.structured_resume > len(prompt_ids):
            raise InvalidRequestError(
                f"structured_resume {self.structured_resume} exceeds the prompt's "
                f"{len(prompt_ids)} tokens"
            )
        return prompt_ids[len(prompt_ids) - self.structured_resume :]

    def for_sequence(self, index: int) -> SamplingParams:
        """The sampling of sequence `index` of an n > 1 request: one sequence (n = 1) whose seed,
        when there is one, is seed + index (mod 2^63). So sequence i of a seeded request gives
        exactly what a single request with seed + i gives, and the n sequences differ."""
        if not 0 <= index < self.n:
            raise ValueError(f"sequence {index} of a request with n = {self.n}")
        seed = None if self.seed is None else (self.seed + index) % 2**63
        return dataclasses.replace(self, n=1, seed=seed)

    def check_vocab(self, vocab_size: int) -> None:
        """InvalidRequestError for a logit_bias token outside [0, vocab_size)."""
        bad = [token for token, _ in self.logit_bias if token >= vocab_size]
        if bad:
            raise InvalidRequestError(
                f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
            )

    def stop_ids(self, eos_ids: Iterable[int]) -> frozenset[int]:
        """The tokens that end the request (and that min_tokens holds back). A structured
        request always ends at EOS, ignore_eos or not: its grammar allows EOS only once
        complete, and then nothing else, so going on could only produce garbage."""
        ignore_eos = self.ignore_eos and self.structured is None
        return frozenset(self.stop_token_ids) | (frozenset() if ignore_eos else set(eos_ids))
