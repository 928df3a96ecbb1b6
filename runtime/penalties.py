"""What a request's past does to its next logits: logit_bias, min_tokens and the penalties,
batched over a step's rows (vLLM's definitions and order), and the per-request token counts a
sampling node keeps for them.

For a row with sampling params p, generated tokens `out` and prompt tokens `prompt`:
1. logit[t] += p.logit_bias[t];  while len(out) < p.min_tokens: logit[s] = -inf for each stop
   token s (stop_token_ids, and EOS unless ignore_eos);
2. for t in prompt or out:  logit[t] = logit[t] / r if logit[t] > 0 else logit[t] * r
   (r = repetition_penalty), then  logit[t] -= frequency * count(t, out) + presence * (t in out).
Temperature, top-k, top-p and min-p come after (`runtime.sampling`); greedy rows take the argmax
of these logits.

The counts are never rebuilt from the sequence: a decode node keeps them per batch slot in
`TokenCounts`, set once when a request joins the batch and grown by one scatter-add a step. The
penalty math reads and writes only the (row, token) pairs a row has seen: O(tokens seen), not
O(B * V), so it costs little next to the softmax every random row needs anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from control.sampling_params import SamplingParams


def _empty(dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype)


@dataclass(frozen=True)
class PastTokens:
    """Each row's past as the logits processors read it; rows align with the step's logits.

    The penalties touch only the tokens a row has seen, so those come as flat (row, token)
    pairs, not [B, V] tensors: each token of a penalized row's output, and of its prompt when
    its repetition penalty reads it, once, with its count in the output (0: prompt only)."""

    num_generated: list[int]  # [B] tokens generated before the one being sampled
    stop_ids: list[frozenset[int]]  # [B] the tokens min_tokens holds back
    rows: torch.Tensor = field(default_factory=lambda: _empty(torch.long))  # [N]
    token_ids: torch.Tensor = field(default_factory=lambda: _empty(torch.long))  # [N]
    output_counts: torch.Tensor = field(default_factory=lambda: _empty(torch.float32))  # [N]

    @classmethod
    def of_prompts(
        cls,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        eos_ids: Sequence[int],
        vocab_size: int,
    ) -> PastTokens:
        """For the first token: nothing generated yet, only the prompts."""
        stop_ids = [p.stop_ids(eos_ids) for p in params]
        chosen = [i for i, p in enumerate(params) if p.uses_prompt]
        if not chosen:
            return cls([0] * len(prompts), stop_ids)
        mask = torch.zeros(len(chosen), vocab_size, dtype=torch.bool)  # [C, V]
        _mark(mask, range(len(chosen)), [prompts[i] for i in chosen])
        rows, token_ids = mask.nonzero(as_tuple=True)  # [N] each, every token once
        rows = torch.tensor(chosen)[rows]
        return cls([0] * len(prompts), stop_ids, rows, token_ids, torch.zeros(len(token_ids)))


def process_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], past: PastTokens | None
) -> torch.Tensor:
    """logits [B, V] fp32 -> the logits after steps 1 and 2 above: a new tensor, or `logits`
    itself when no row has any of it."""
    if past is None and any(p.uses_penalties or p.min_tokens for p in params):
        raise ValueError("penalties and min_tokens need the rows' past (PastTokens)")
    bias = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias]
    generated = past.num_generated if past is not None else [0] * len(params)
    held = [row for row, p in enumerate(params) if generated[row] < p.min_tokens]
    has_penalties = past is not None and past.rows.numel() > 0
    if not (bias or held or has_penalties):
        return logits
    vocab_size = logits.shape[1]
    out = logits.clone()
    # 1. logit_bias (one accumulate-scatter for every row's pairs), then min_tokens.
    if bias:
        rows, ids, values = zip(*bias, strict=True)
        index = (torch.tensor(rows), torch.tensor(ids))
        out.index_put_(index, torch.tensor(values, dtype=out.dtype), accumulate=True)
    if held:
        pairs = [(row, s) for row in held for s in past.stop_ids[row] if s < vocab_size]
        if pairs:
            rows, ids = zip(*pairs, strict=True)
            out[torch.tensor(rows), torch.tensor(ids)] = float("-inf")
    # 2. penalties, on the tokens each row has seen.
    if has_penalties:
        weights = [(p.repetition_penalty, p.frequency_penalty, p.presence_penalty) for p in params]
        penalties = torch.tensor(weights, dtype=out.dtype)  # [B, 3]
        apply_penalties(out, past.rows, past.token_ids, past.output_counts, penalties)
    return out


def apply_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    token_ids: torch.Tensor,
    output_counts: torch.Tensor,
    penalties: torch.Tensor,
) -> None:
    """Step 2 above, in place. logits [B, V]; rows, token_ids, output_counts [N]: the (row,
    token) pairs seen (each once) and the token's count in that row's output; penalties [B, 3]:
    each row's (repetition, frequency, presence), (1, 0, 0) meaning off."""
    values = logits[rows, token_ids]  # [N]
    repetition, frequency, presence = penalties[rows].unbind(-1)  # [N] each
    values = torch.where(values > 0, values / repetition, values * repetition)
    values = values - frequency * output_counts - presence * (output_counts > 0)
    logits[rows, token_ids] = values


class TokenCounts:
    """A sampling node's per-slot past for the penalties, kept across steps:
    counts [num_slots, V] fp32 (times each token was generated) and seen [num_slots, V] bool
    (in the output, or in the prompt when the repetition penalty reads it).

    A request's row is set once when it joins the running batch (`start`), grows by one token a
    step (`add`), and is simply overwritten by the slot's next request. Nothing is allocated
    until a request with penalties starts, so a node that never sees one holds nothing."""

    def __init__(self, num_slots: int, vocab_size: int):
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None

    def start(
        self,
        slots: Sequence[int],
        params: Sequence[SamplingParams],
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
    ) -> None:
        """Rows `slots` now hold these requests (only those with penalties are written)."""
        chosen = [i for i, p in enumerate(params) if p.uses_penalties]
        if not chosen:
            return
        if self.counts is None:
            self.counts = torch.zeros(self.num_slots, self.vocab_size)
            self.seen = torch.zeros(self.num_slots, self.vocab_size, dtype=torch.bool)
        rows = [slots[i] for i in chosen]
        self.counts[rows] = 0.0
        self.seen[rows] = False
        _mark(self.seen, rows, [prompts[i] if params[i].uses_prompt else () for i in chosen])
        flat = [(slots[i], t) for i in chosen for t in outputs[i]]
        self.add([slot for slot, _ in flat], [t for _, t in flat])

    def add(self, slots: Sequence[int], tokens: Sequence[int]) -> None:
        """One more generated token per slot (rows of requests without penalties are ignored
        garbage, so every row of a step may be added at once)."""
        if self.counts is not None and len(slots):
            index = (torch.tensor(slots), torch.tensor(tokens))
            self.counts.index_put_(index, torch.ones(len(slots)), accumulate=True)
            self.seen[index] = True

    def past(
        self,
        slots: Sequence[int],
        params: Sequence[SamplingParams],
        num_generated: list[int],
        stop_ids: list[frozenset[int]],
    ) -> PastTokens:
        """The PastTokens of a step whose rows are these slots."""
        chosen = [i for i, p in enumerate(params) if p.uses_penalties]
        if self.counts is None or not chosen:
            return PastTokens(num_generated, stop_ids)
        slot_index = torch.tensor([slots[i] for i in chosen])  # [C]
        rows, token_ids = self.seen[slot_index].nonzero(as_tuple=True)  # [N] each
        counts = self.counts[slot_index[rows], token_ids]  # [N]
        if len(chosen) < len(params):  # rows of the chosen -> rows of the step
            rows = torch.tensor(chosen)[rows]
        return PastTokens(num_generated, stop_ids, rows, token_ids, counts)


def _mark(mask: torch.Tensor, rows: Sequence[int], token_lists: Sequence[Sequence[int]]) -> None:
    """mask[row, t] = True for each row and each t of its list: one scatter for all rows."""
    flat_rows = [row for row, tokens in zip(rows, token_lists, strict=True) for _ in tokens]
    if flat_rows:
        flat_ids = [t for tokens in token_lists for t in tokens]
        mask[torch.tensor(flat_rows), torch.tensor(flat_ids)] = True
