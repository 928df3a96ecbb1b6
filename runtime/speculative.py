"""MTP speculative decoding: verify the drafted tokens in one forward, accept, draft again.

A request at position p (its last token t_p not yet in the cache) with drafts d_1..d_k:
1. verify: the main model runs t_p, d_1, ..., d_k at positions p..p+k in one decode-path
   forward, each token a row of the MLA decode kernel over the request's pages (row j sees the
   cache up to p+j: the kernel stores every new row before any row attends). Row j's logits
   are the target distribution of position p+j+1.
2. accept (`accept_tokens`): greedy keeps the drafts while they equal the target's argmax and
   then emits the target's own token; sampling accepts d_j with probability p_j(d_j) (the
   drafts are the MTP layer's argmax, a point mass) and on a rejection draws from p_j without
   d_j, renormalized: the emitted tokens are distributed exactly as plain decoding's. Either
   way 1..k+1 tokens come out. The rows of rejected drafts stay in the cache past the
   sequence's length, never read, and overwritten by the next step's rows at those positions.
3. draft (`draft_batch` + `DeepseekModel.forward_mtp`): the MTP layer runs at positions
   p..p+a (a drafts accepted) on the main hidden states of those verify rows and the emitted
   tokens; its last row's argmax is the next d_1, and k > 1 chains the layer on its own output.

Only requests whose sampling does not read the output so far take drafts (`draftable`):
penalties, min_tokens, structured output and logprobs decode one token a step as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from control.sampling_params import SamplingParams
from model.batch import ForwardBatch
from model.kv_pool import KVPool, PageTable
from native import ops
from runtime.block_table import BlockTable
from runtime.penalties import process_logits
from runtime.sampling import draw, filter_probs


def draftable(params: SamplingParams) -> bool:
    """Whether a request's tokens can be speculated: its sampling reads nothing of the output
    so far (no penalties, min_tokens, grammar) and it asks no per-token logprobs."""
    return not (
        params.uses_penalties
        or params.min_tokens
        or params.structured is not None
        or params.logprobs is not None
    )


def rows_batch(
    pool: KVPool,
    tables: Sequence[PageTable],
    tokens: Sequence[Sequence[int]],
    positions: Sequence[int],
    block_table: BlockTable | None = None,
    slots: Sequence[int] | None = None,
) -> ForwardBatch:
    """A decode-path batch in which request r feeds tokens[r] at positions positions[r],
    positions[r] + 1, ...: one kernel row per token, all over the request's pages (its table
    must already hold the last position). Verify and draft passes are both this shape. With
    `block_table`, the page table comes from its rows by batch slot (`slots`, one a request)."""
    row_tables, row_tokens, row_positions, row_slots = [], [], [], []
    for r, (table, toks, start) in enumerate(zip(tables, tokens, positions, strict=True)):
        for j, token in enumerate(toks):
            row_tables.append(table)
            row_tokens.append(token)
            row_positions.append(start + j)
            if slots is not None:
                row_slots.append(slots[r])
    if block_table is None:
        return ForwardBatch.build(
            pool, row_tables, [[t] for t in row_tokens], row_positions, is_decode=True
        )
    page_table = block_table.rows(row_slots, row_tables)
    return ForwardBatch.decode_rows(row_tables, row_tokens, row_positions, page_table)


ACCEPT_INDEX = -1  # the acceptance test's uniform: a token index the race never uses


def accept_tokens(
    logits: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    seed: int | None,
    num_drawn: int,
) -> list[int]:
    """logits [k+1, V] fp32: the verify rows of one request (row j: after t_p, d_1..d_j);
    drafts: d_1..d_k. Returns the emitted tokens: the accepted drafts, then one token of the
    target's (the correction at the first rejection, or the bonus after all k).

    The random numbers come from the request's stream (`seed`; `runtime.sampling`): the j-th
    emitted token is draw `num_drawn + j` (num_drawn: the tokens the request sampled before),
    its acceptance test that draw's uniform at ACCEPT_INDEX, a correction or bonus token that
    draw's race, so a token's randomness does not depend on how many drafts came before it."""
    k = len(drafts)
    if logits.shape[0] != k + 1:
        raise ValueError(f"{k} drafts need {k + 1} verify rows, got {logits.shape[0]}")
    rows = process_logits(logits.float(), [params] * (k + 1), None)  # logit_bias only
    if params.is_greedy:
        targets = ops.argmax_rows(rows).tolist()
        out = []
        for j in range(k + 1):
            out.append(targets[j])
            if j == k or targets[j] != drafts[j]:
                return out
    probs = filter_probs(rows, [params] * (k + 1))  # [k+1, V], unnormalized
    counters = torch.arange(num_drawn, num_drawn + k + 1, dtype=torch.int64)
    seeds = torch.full((k + 1,), seed, dtype=torch.int64)
    uniforms = ops.random_uniform(seeds, counters, ACCEPT_INDEX).tolist()
    out = []
    for j, d in enumerate(drafts):
        p = probs[j]
        if uniforms[j] * float(p.sum()) < float(p[d]):
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0
        if float(residual.sum()) <= 0.0:  # p is all on d: rounding, not a rejection
            out.append(d)
            continue
        out.append(_drawn(residual, seed, num_drawn + j, rows[j]))
        return out
    out.append(_drawn(probs[k], seed, num_drawn + k, rows[k]))
    return out


def _drawn(probs: torch.Tensor, seed: int, index: int, logits: torch.Tensor) -> int:
    """One token of `probs` [V] by draw `index` of the stream; the argmax when nothing is
    left to draw from (what `runtime.sampling.sample` does: the temperature -> 0 limit)."""
    token = int(draw(probs[None], [seed], [index])[0])
    return token if token >= 0 else int(logits.argmax())


def ahead_tokens(prompt_ids: Sequence[int], start: int, end: int, first_token: int) -> list[int]:
    """What the MTP layer is fed behind the prompt chunk [start, end): the token after each
    position, the first output token after the prompt's last."""
    ahead = list(prompt_ids[start + 1 : end + 1])
    return ahead + [first_token] if end == len(prompt_ids) else ahead


def truncate_at_stop(
    emitted: list[int], stop_ids: frozenset[int], room: int
) -> tuple[list[int], bool]:
    """The tokens a request keeps of `emitted`: up to and including the first stop token, and
    at most `room` (what max_new_tokens and the context leave). True when a stop token ended
    it."""
    kept = emitted[: max(0, room)]
    for i, token in enumerate(kept):
        if token in stop_ids:
            return kept[: i + 1], True
    return kept, False


def draft(
    model,
    pool: KVPool,
    tables: Sequence[PageTable],
    tokens: Sequence[Sequence[int]],
    positions: Sequence[int],
    main_hidden: torch.Tensor,
    num_drafts: Sequence[int],
    block_table: BlockTable | None = None,
    slots: Sequence[int] | None = None,
) -> list[list[int]]:
    """The MTP pass of step 3: request r feeds tokens[r] (the tokens after positions[r], ...)
    with the main hidden states of those positions (`main_hidden`, rows packed in request
    order), then chains the layer on its own output until it has num_drafts[r] drafts. Each
    table must hold positions[r] + len(tokens[r]) + num_drafts[r] - 1 positions. `block_table`
    and `slots`: as for `rows_batch`."""
    batch = rows_batch(pool, tables, tokens, positions, block_table, slots)
    # One kernel row per token; only each request's last row drafts (the others fill the
    # layer's cache), so the head runs on those rows only.
    ends = torch.cumsum(torch.tensor([len(t) for t in tokens]), 0) - 1
    logits, hidden = model.forward_mtp(batch, main_hidden, pool, logit_rows=ends)
    drafts = [[t] for t in ops.argmax_rows(logits).tolist()]  # hidden: the `ends` rows' only
    next_pos = [p + len(t) for p, t in zip(positions, tokens, strict=True)]
    for step in range(1, max(num_drafts, default=0)):
        live = [r for r, n in enumerate(num_drafts) if n > step]
        if not live:
            break
        batch = rows_batch(
            pool,
            [tables[r] for r in live],
            [[drafts[r][-1]] for r in live],
            [next_pos[r] + step - 1 for r in live],
            block_table,
            None if slots is None else [slots[r] for r in live],
        )
        logits, out = model.forward_mtp(batch, hidden[live], pool)
        for i, token in zip(live, ops.argmax_rows(logits).tolist(), strict=True):
            drafts[i].append(token)
        hidden = hidden.clone()
        hidden[live] = out
    return [d[:n] for d, n in zip(drafts, num_drafts, strict=True)]
