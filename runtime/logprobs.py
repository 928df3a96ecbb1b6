"""Computes the raw logprobs (`control.logprobs.TokenLogprobs`) of a step's sampled tokens.

The values are the log-softmax of the model's fp32 logits, before logit_bias, min_tokens,
the penalties and the temperature: what the model itself gave each token. One batched op over
the rows that asked; the rest pay nothing.
"""

from __future__ import annotations

import torch

from control.logprobs import TokenLogprobs


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_top: list[int | None], ranks: bool = False
) -> list[TokenLogprobs | None]:
    """logits [B, V] fp32, the token each row chose [B], how many alternatives each row wants
    (None: no logprobs for it) -> per row its TokenLogprobs (None where not asked). `ranks`:
    also each chosen token's rank (one more pass over the rows; only prompt logprobs carry it,
    so the decode step does not pay for it).

    log_softmax and topk run once over the rows that asked, with k = the largest they asked for;
    each row keeps its own k."""
    rows = [i for i, k in enumerate(num_top) if k is not None]
    out: list[TokenLogprobs | None] = [None] * len(token_ids)
    if not rows:
        return out
    index = torch.tensor(rows)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [R, V]
    chosen = torch.tensor([token_ids[i] for i in rows])
    chosen_lp_t = logprobs.gather(1, chosen[:, None])  # [R, 1]
    rank = (logprobs >= chosen_lp_t).sum(dim=-1).tolist() if ranks else [0] * len(rows)
    chosen_lp = chosen_lp_t[:, 0].tolist()
    k = max(num_top[i] for i in rows)
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    top_lp, top_ids = top_lp.tolist(), top_ids.long().tolist()  # [R, k]
    for r, i in enumerate(rows):
        n = num_top[i]
        out[i] = TokenLogprobs(chosen_lp[r], top_ids[r][:n], top_lp[r][:n], rank[r])
    return out
