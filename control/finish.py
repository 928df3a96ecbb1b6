"""When a request is finished: the one rule the decode node, the offline generators and the
router all apply to each token a request emits."""

from __future__ import annotations

from collections.abc import Container


def finish_reason(
    token: int,
    stop_ids: Container[int],
    num_output: int,
    sequence_len: int,
    max_new_tokens: int,
    max_positions: int,
) -> str | None:
    """Why a request ends at the `token` it just emitted, or None while it goes on: a stop token
    ends it ("stop"); else its output reaching `max_new_tokens` tokens, or the sequence (prompt
    and output, `token` included: `sequence_len`) reaching the model's context, ("length").
    `num_output` counts `token` too."""
    if token in stop_ids:
        return "stop"
    if num_output >= max_new_tokens or sequence_len >= max_positions:
        return "length"
    return None
