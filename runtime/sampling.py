"""The batched sampler: applies a step's `SamplingParams` to its logits.

One step's rows go through, as vLLM orders it: logit_bias and min_tokens, then the penalties
(`runtime.penalties`); greedy rows take the argmax there, the others divide by their temperature,
keep their top-k, top-p and min-p tokens and draw from their own random stream.

Random streams are counter-based (`native.reference_sampling`): the random numbers of a
request's k-th token (its draw index: the tokens it sampled before) are a pure function of
(seed, k), so all rows of a step draw in one native call, a fixed seed gives the same tokens in
any batch and on any node, and the decode node continues the prefill node's stream by passing
k = the tokens already sampled (P draws the first token with k = 0; a restarted attempt's
k starts at its `draw_offset`, the tokens its earlier attempts sampled).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

from control.sampling_params import SamplingParams
from runtime.penalties import PastTokens, process_logits


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
    from native import ops  # here, as in `draw`

    logits = process_logits(logits.float(), params, past)  # [B, V]
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    if len(greedy) == len(params):  # the common all-greedy step: no scatter into `out`
        return ops.argmax_rows(logits).tolist()
    out = torch.empty(len(params), dtype=torch.long)
    if greedy:
        out[greedy] = ops.argmax_rows(_take_rows(logits, greedy))
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if rows:
        probs = filter_probs(_take_rows(logits, rows), [params[i] for i in rows])  # [R, V]
        tokens = draw(probs, [seeds[i] for i in rows], [draws[i] for i in rows])  # [R]
        out[rows] = tokens
        if bool((tokens < 0).any()):
            empty = [i for i, token in zip(rows, tokens.tolist(), strict=True) if token < 0]
            out[empty] = ops.argmax_rows(logits[empty])
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
        raise ValueError("a random row needs a seed (runtime.sampling.request_seed)")
    seed_t = torch.tensor(seeds, dtype=torch.int64)
    return ops.race_sample(probs, seed_t, torch.tensor(draws, dtype=torch.int64))


def _take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return t if len(rows) == t.shape[0] else t[rows]
