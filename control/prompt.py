"""The checks every prompt passes before any node spends work on it (the router's and each
node's, one rule)."""

from __future__ import annotations

from control.errors import InvalidRequestError


def validate_prompt(prompt_ids: list[int], vocab_size: int, max_positions: int) -> None:
    """Raises InvalidRequestError for an empty, out-of-vocabulary or too-long prompt."""
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty")
    if len(prompt_ids) >= max_positions:
        raise InvalidRequestError(
            f"the prompt has {len(prompt_ids)} tokens; the model's context is "
            f"{max_positions} (max_position_embeddings), leaving no room to generate"
        )
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
