"""Benchmark prompts of controlled token length, made with the served model's tokenizer.

Prompts are random sequences of *word tokens*: ids whose text is a space followed by letters
and which encode back to themselves alone (" the", " book"). A byte-level pre-tokenizer splits
such text at each space, so a sequence of k word tokens encodes to exactly those k ids: the
prompt's token length is exact, not approximate, and a random sequence shares no prefix with
another one (no accidental prefix-cache hits).

Three datasets:
- `random`: every request has `input_len` prompt tokens and `output_len` output tokens;
- `synthetic-chat`: log-normal input and output lengths with medians `input_len` and
  `output_len` and a long right tail (a few requests several times the median), the shape of
  ShareGPT's conversation lengths; sent as one user message to the chat endpoint by default;
- `shared-prefix`: the synthetic chat mix behind one shared prefix of `prefix_len` tokens (a
  long system prompt every conversation starts with): what a prefix cache is for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from control.errors import ConfigError
from control.tokenizer import Tokenizer

DATASETS = ("random", "synthetic-chat", "shared-prefix")
DEFAULT_PREFIX_LEN = 1024
# Log-normal shape of the synthetic chat mix (sigma of log length), and the tail cut-off in
# multiples of the median; ShareGPT's input lengths spread about this wide.
CHAT_INPUT_SIGMA, CHAT_OUTPUT_SIGMA = 1.0, 0.8
CHAT_TAIL = 8.0
MIN_WORD_TOKENS = 8


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: prompt text, its token length (text alone, no bos or template),
    and the number of tokens to ask for (`max_tokens`)."""

    prompt: str
    prompt_len: int
    output_len: int


def word_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids whose text is " " + letters and that encode back to exactly themselves.

    Raises ConfigError when the tokenizer has fewer than MIN_WORD_TOKENS of them.
    """
    ids = []
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if len(text) > 1 and text[0] == " " and text[1:].isalpha() and text[1:].isascii():
            if tokenizer.encode(text) == [token_id]:
                ids.append(token_id)
    if len(ids) < MIN_WORD_TOKENS:
        raise ConfigError(
            f"the tokenizer has only {len(ids)} word tokens (' ' + letters); "
            f"random prompts need at least {MIN_WORD_TOKENS}"
        )
    return ids


class PromptMaker:
    """Random prompts of an exact token length from a tokenizer's word tokens."""

    def __init__(self, tokenizer: Tokenizer, seed: int = 0):
        self.tokenizer = tokenizer
        self._words = [
            tokenizer.decode([i], skip_special_tokens=False) for i in word_token_ids(tokenizer)
        ]
        self._rng = np.random.default_rng(seed)

    def prompt(self, num_tokens: int) -> str:
        """Text of exactly `num_tokens` tokens (`tokenizer.encode`, no bos), num_tokens >= 1."""
        if num_tokens < 1:
            raise ValueError(f"a prompt needs at least 1 token, got {num_tokens}")
        picks = self._rng.integers(0, len(self._words), size=num_tokens)
        # The first word keeps its space: it is the token that was drawn.
        return "".join(self._words[i] for i in picks)


def random_requests(
    maker: PromptMaker, num_prompts: int, input_len: int, output_len: int
) -> list[BenchRequest]:
    """`num_prompts` requests of `input_len` prompt tokens and `output_len` output tokens."""
    return [
        BenchRequest(maker.prompt(input_len), input_len, output_len) for _ in range(num_prompts)
    ]


def lognormal_lengths(
    rng: np.random.Generator, n: int, median: int, sigma: float, cap: int
) -> list[int]:
    """`n` integer lengths, log-normal with the given median, clipped to [1, cap]."""
    raw = rng.lognormal(mean=np.log(median), sigma=sigma, size=n)
    return [int(v) for v in np.clip(np.rint(raw), 1, cap)]


def synthetic_chat_requests(
    maker: PromptMaker,
    num_prompts: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    max_input_len: int | None = None,
) -> list[BenchRequest]:
    """Requests with long-tailed lengths: medians `input_len`/`output_len`, tails cut at
    CHAT_TAIL x the median (and at `max_input_len` if given)."""
    rng = np.random.default_rng(seed + 1)
    in_cap = int(CHAT_TAIL * input_len)
    if max_input_len is not None:
        in_cap = max(1, min(in_cap, max_input_len))
    ins = lognormal_lengths(rng, num_prompts, input_len, CHAT_INPUT_SIGMA, in_cap)
    outs = lognormal_lengths(
        rng, num_prompts, output_len, CHAT_OUTPUT_SIGMA, int(CHAT_TAIL * output_len)
    )
    return [BenchRequest(maker.prompt(i), i, o) for i, o in zip(ins, outs, strict=True)]


def make_requests(
    tokenizer: Tokenizer,
    dataset: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    prefix_len: int = DEFAULT_PREFIX_LEN,
) -> list[BenchRequest]:
    """The request list of a benchmark run (deterministic in `seed`); `prefix_len` is the shared
    prefix of `shared-prefix` (ignored by the others)."""
    if dataset not in DATASETS:
        raise ConfigError(f"unknown dataset {dataset!r} (choose from {', '.join(DATASETS)})")
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ConfigError("num_prompts, input_len and output_len must be >= 1")
    maker = PromptMaker(tokenizer, seed)
    if dataset == "random":
        return random_requests(maker, num_prompts, input_len, output_len)
    if dataset == "synthetic-chat":
        return synthetic_chat_requests(maker, num_prompts, input_len, output_len, seed)
    if prefix_len < 1:
        raise ConfigError("prefix_len must be >= 1")
    prefix = maker.prompt(prefix_len)
    # Word tokens split at their leading space: prefix + suffix encodes to both id lists joined.
    return [
        BenchRequest(prefix + r.prompt, prefix_len + r.prompt_len, r.output_len)
        for r in synthetic_chat_requests(maker, num_prompts, input_len, output_len, seed)
    ]
