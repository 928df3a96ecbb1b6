"""How many tokens of KV a decode node reserves for a request up front.

One rule, read by the decode node's scheduler (what it takes from its pool) and by the router
(its estimate of what a reservation takes), so the two agree:

- "worst_case": the prompt plus every token the request may still generate, clipped to the
  context; an admitted request never needs another page.
- "on_demand": the prompt plus `headroom_tokens` (never more than the worst case); the node
  grows the request's pages as it generates and preempts the most recently admitted request
  when its pool runs out (`decode_node.scheduler`).
"""

from __future__ import annotations

ON_DEMAND = "on_demand"
WORST_CASE = "worst_case"
MODES = (ON_DEMAND, WORST_CASE)


def worst_case_tokens(prompt_len: int, max_new_tokens: int, max_position: int) -> int:
    """Every position the request may ever hold. (The last token fed sits at
    prompt_len + max_new_tokens - 2, as the last sampled token is never fed; one spare slot
    keeps the arithmetic obviously safe.)"""
    return min(prompt_len + max_new_tokens, max_position)


def reservation_tokens(
    mode: str, headroom_tokens: int, prompt_len: int, max_new_tokens: int, max_position: int
) -> int:
    """Tokens of KV reserved at admission under `mode` (see the module docstring)."""
    worst = worst_case_tokens(prompt_len, max_new_tokens, max_position)
    if mode == ON_DEMAND:
        return min(prompt_len + headroom_tokens, worst)
    if mode == WORST_CASE:
        return worst
    raise ValueError(f"unknown KV reservation mode {mode!r} (one of {', '.join(MODES)})")


def fork_tokens(reserved_tokens: int, prompt_len: int, page_size: int) -> int:
    """Tokens of KV a forked sequence (n > 1) holds on its own when its parent reserved
    `reserved_tokens`: all but the prompt's whole pages, which it shares (`KVPool.fork`)."""
    return max(0, reserved_tokens - (prompt_len // page_size) * page_size)


def sequences_tokens(reserved_tokens: int, prompt_len: int, page_size: int, n: int) -> int:
    """Tokens of KV an n-sequence request takes: the first sequence's reservation, plus each
    fork's own part, each rounded up to whole pages when n > 1 (the pages are each its own),
    so that this / page_size is the pages the decode node takes."""
    if n == 1:
        return reserved_tokens
    whole = lambda tokens: -(-tokens // page_size) * page_size  # noqa: E731
    return whole(reserved_tokens) + (n - 1) * whole(
        fork_tokens(reserved_tokens, prompt_len, page_size)
    )
