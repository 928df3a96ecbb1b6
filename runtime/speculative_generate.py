"""Offline generation with MTP speculative decoding: the oracle-side twin of what a prefill
node with MTP and a decode node with `mtp = true` do together (`runtime.speculative`).

The prefill runs the MTP layer behind each prompt chunk, so the layer's cache holds every
prompt position and the first decode step already has a draft; each step then verifies, accepts
and drafts again. Requests that cannot be speculated (`speculative.draftable`) fall back to
`OfflineGenerator.generate`.
"""

from __future__ import annotations

from control.errors import InvalidRequestError
from control.prompt import validate_prompt
from control.sampling_params import SamplingParams
from model.batch import ForwardBatch
from model.deepseek import DeepseekModel
from model.kv_pool import KVPool, PageTable
from runtime.generate import GenerationResult, OfflineGenerator
from runtime.sampling import request_seed, sample
from runtime.speculative import (
    accept_tokens,
    ahead_tokens,
    draft,
    draftable,
    rows_batch,
    truncate_at_stop,
)


def prefill_with_draft(
    model: DeepseekModel,
    pool: KVPool,
    table: PageTable,
    prompt_ids: list[int],
    chunk_size: int,
    first_token_of,
) -> tuple[int, int]:
    """Chunked prefill of the main model and, behind each chunk, the MTP layer at the same
    positions (fed the tokens one ahead: the next chunk's first, or, after the last chunk, the
    first output token). `first_token_of(logits [V])` samples that token. Returns it and the
    MTP layer's draft of the token after it."""
    n = len(prompt_ids)
    pool.reserve(table, n)
    token = mtp_logits = None
    for start in range(0, n, chunk_size):
        chunk = prompt_ids[start : start + chunk_size]
        batch = ForwardBatch.build(pool, [table], [chunk], [start], is_decode=False)
        logits, hidden = model.forward_with_hidden(batch, pool)
        end = start + len(chunk)
        if end == n:
            token = first_token_of(logits[0])
        ahead = ahead_tokens(prompt_ids, start, end, token)
        mtp_batch = ForwardBatch.build(pool, [table], [ahead], [start], is_decode=False)
        mtp_logits, _ = model.forward_mtp(mtp_batch, hidden, pool)
    return token, int(mtp_logits[0].argmax())


class SpeculativeGenerator(OfflineGenerator):
    """OfflineGenerator whose decode steps verify up to `num_draft` MTP drafts at a time.
    `model` must be loaded with its MTP layer (`from_pretrained(..., mtp=True)`)."""

    def __init__(self, model: DeepseekModel, num_draft: int = 1, **kwargs):
        if model.mtp is None:
            raise InvalidRequestError("speculative generation needs the model's MTP layer")
        if num_draft < 1:
            raise InvalidRequestError(f"num_draft must be >= 1, got {num_draft}")
        super().__init__(model, **kwargs)
        self.num_draft = num_draft
        self.num_steps = 0  # decode steps taken (verify forwards), over every request
        self.num_drafted = 0
        self.num_accepted = 0

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        if not draftable(params):
            return super().generate(prompt_ids, params)
        cfg, pool = self.model.cfg, self.pool
        validate_prompt(prompt_ids, cfg.vocab_size, cfg.max_position_embeddings)
        params.check_vocab(cfg.vocab_size)
        stop_ids = params.stop_ids(cfg.eos_token_id)
        seed = request_seed(params)
        max_pos = cfg.max_position_embeddings
        table = pool.new_table()
        try:
            first, next_draft = prefill_with_draft(
                self.model,
                pool,
                table,
                prompt_ids,
                self.chunk_size,
                lambda logits: sample(logits[None], [params], [seed], [params.draw_offset])[0],
            )
            tokens = [first]
            if first in stop_ids:
                return GenerationResult(prompt_ids, tokens, "stop")
            drafts = [next_draft]
            while True:
                position = len(prompt_ids) + len(tokens) - 1  # of tokens[-1], not yet cached
                room = min(params.max_new_tokens - len(tokens), max_pos - 1 - position)
                if room <= 0:
                    return GenerationResult(prompt_ids, tokens, "length")
                drafts = drafts[: min(self.num_draft, room - 1)]
                pool.reserve(table, position + len(drafts) + 1)
                batch = rows_batch(pool, [table], [[tokens[-1], *drafts]], [position])
                logits, hidden = self.model.forward_with_hidden(batch, pool)
                emitted = accept_tokens(
                    logits, drafts, params, seed, params.draw_offset + len(tokens)
                )
                self.num_steps += 1
                self.num_drafted += len(drafts)
                self.num_accepted += len(emitted) - 1
                kept, stopped = truncate_at_stop(emitted, stop_ids, room)
                tokens.extend(kept)
                if stopped:
                    return GenerationResult(prompt_ids, tokens, "stop")
                if len(kept) == room:
                    return GenerationResult(prompt_ids, tokens, "length")
                num_next = min(self.num_draft, max_pos - 1 - (position + len(kept)))
                pool.reserve(table, position + len(kept) + num_next)
                drafts = draft(
                    self.model, pool, [table], [kept], [position], hidden[: len(kept)], [num_next]
                )[0]
        finally:
            pool.release(table)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0
