"""Sampling parameters and the batched sampler.

One step's rows go through, as vLLM orders it: logit_bias and min_tokens, then the penalties
(`engine.penalties`); greedy rows take the argmax there, the others divide by their temperature,
keep their top-k, top-p and min-p tokens and draw from their own random stream.

Random streams are counter-based (`native.reference_sampling`): the random numbers of a
request's k-th token (its draw index: the tokens it sampled before) are a pure function of
(seed, k), so all rows of a step draw in one native call, a fixed seed gives the same tokens in
any batch and on any node, and the decode node continues the prefill node's stream by passing
k = the tokens already sampled (P draws the first token with k = 0; a restarted attempt's
k starts at its `draw_offset`, the tokens its earlier attempts sampled).
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from engine.errors import InvalidRequestError
from engine.logprobs import MAX_LOGPROBS
from engine.penalties import PastTokens, process_logits
from engine.structured import StructuredOutput

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
    # Raw logprobs (`engine.logprobs`): None = off, k = the sampled token's and the top k.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    # Structured output (`engine.structured`): (kind, spec), e.g. ("json_schema", "{...}"); the
    # sampling nodes mask each token to the grammar. None = free text.
    structured: tuple[str, str] | None = None
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
            and len(self.structured) == 2
            and all(isinstance(part, str) for part in self.structured)
        ):
            raise InvalidRequestError("structured must be a (kind, spec) pair of strings")
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


def request_seed(params: SamplingParams) -> int:
    """The seed of a request's random stream, resolved once per request: its own seed, or for
    an unseeded request a fresh random one (the prefill and decode nodes then draw theirs
    independently: nothing to reproduce)."""
    return params.seed if params.seed is not None else secrets.randbits(63)


def filter_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each random row draws from: logits [R, V] -> probs [R, V] (not
    renormalized; excluded tokens at 0) after temperature, top-k, top-p, then min-p."""
    vocab_size = logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype)  # [R]
    logits = logits / temperature[:, None]  # a new tensor: filter_probs never writes its input
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    if any(k < vocab_size for k in top_k) or any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)  # [R]
        logits = _top_k_top_p(logits, torch.tensor(top_k), top_p)
    probs = logits.softmax(-1)  # [R, V]
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype)  # [R]
        # Ratios to the top token do not change when top-k/top-p renormalize: no second softmax.
        threshold = min_p[:, None] * probs.amax(-1, keepdim=True)  # [R, 1]
        # keep = 1 where probs >= threshold, else 0, in the scaled logits' memory (no longer
        # needed): arithmetic in place is several times faster on CPU than a bool mask over
        # [R, V] (torch.where, masked_fill) and a fresh tensor.
        keep = torch.sub(probs, threshold, out=logits).sign_().add_(1.0).clamp_(max=1.0)
        probs.mul_(keep)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [R, V]; top_k [R] (V = no limit), top_p [R] (1 = no limit) -> logits with the
    excluded tokens at -inf. Top-k keeps ties with the k-th logit; top-p then keeps the smallest
    prefix (by logit) whose mass reaches top_p, the first token always."""
    sorted_logits, order = logits.sort(-1, descending=True)  # [R, V]
    kth = sorted_logits.gather(-1, (top_k - 1)[:, None])  # [R, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(-1)
    remove = (probs.cumsum(-1) - probs >= top_p[:, None]) & (top_p < 1.0)[:, None]  # [R, V]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: Sequence[int | None],
    draws: Sequence[int],
    past: PastTokens | None = None,
) -> list[int]:
    """logits: [B, V] fp32 -> one token id per row.

    seeds[i], draws[i]: row i's stream (`request_seed`; None is allowed for a greedy row) and
    its draw index (the tokens its request sampled before this one). `past` (rows aligned with
    `logits`) is what the penalties and min_tokens read; it may be None when no row uses them.
    Everything is tensor ops over all rows at once, the random draw one native call. A random
    row left with no probability (a temperature so small that logits / T overflows, NaN
    logits) takes the argmax, the temperature -> 0 limit."""
    logits = process_logits(logits.float(), params, past)  # [B, V]
    out = torch.empty(len(params), dtype=torch.long)
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    if greedy:
        out[greedy] = _take_rows(logits, greedy).argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if rows:
        probs = filter_probs(_take_rows(logits, rows), [params[i] for i in rows])  # [R, V]
        tokens = draw(probs, [seeds[i] for i in rows], [draws[i] for i in rows])  # [R]
        out[rows] = tokens
        if bool((tokens < 0).any()):
            empty = [i for i, token in zip(rows, tokens.tolist(), strict=True) if token < 0]
            out[empty] = logits[empty].argmax(-1)
    return out.tolist()


def draw(probs: torch.Tensor, seeds: Sequence[int | None], draws: Sequence[int]) -> torch.Tensor:
    """probs [R, V] (unnormalized, >= 0) -> [R] token ids, row r drawn with probability
    proportional to probs[r] from the stream (seeds[r], draws[r]): the exponential race
    argmax(p / E), E ~ Exp(1) per token (`ops.race_sample`); -1 for a row with no positive
    probability."""
    # Imported here: the router imports this module for SamplingParams and never samples, so
    # the kernels load only in the processes that do.
    from native import ops

    if any(seed is None for seed in seeds):
        raise ValueError("a random row needs a seed (engine.sampling.request_seed)")
    seed_t = torch.tensor(seeds, dtype=torch.int64)
    return ops.race_sample(probs, seed_t, torch.tensor(draws, dtype=torch.int64))


def _take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return t if len(rows) == t.shape[0] else t[rows]
