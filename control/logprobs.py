"""Logprobs of sampled tokens and their top alternatives, as vLLM's default "raw" logprobs:
the values as they travel (plain data).

The values are the log-softmax of the model's fp32 logits, before logit_bias, min_tokens,
the penalties and the temperature (`runtime.sampling`): what the model itself gave each token.
One batched op over the rows that asked; the rest pay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20  # the most alternatives a request may ask for (vLLM's max_logprobs default)


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the chosen token's logprob and the `k` most likely tokens (ids and
    logprobs, most likely first; the chosen token may or may not be among them); `rank`: how
    many tokens have a logprob at least the chosen one's (1 = the most likely; vLLM's count,
    ties counted), 0 where it did not travel."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
    rank: int = 0
