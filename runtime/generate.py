"""Offline generation: chunked prefill through the extend path, then decode through the paged
cache. The same model calls the serving nodes make, without sockets."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from control.errors import InvalidRequestError
from control.finish import finish_reason
from control.prompt import validate_prompt
from control.sampling_params import SamplingParams
from model.batch import ForwardBatch
from model.deepseek import DeepseekModel
from model.kv_pool import PageTable
from runtime.grammar import Grammars
from runtime.penalties import PastTokens, TokenCounts
from runtime.sampling import request_seed, sample


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS / stop token) or "length"


class OfflineGenerator:
    """Runs one request at a time on a private KV pool sized for the model's whole context.

    `decode_model` (default: `model`) runs the decode steps, as a decode node whose weights are
    in another quantization than the prefill node's would: the same checkpoint and dtype, so
    the KV `model` writes is what it reads."""

    def __init__(
        self,
        model: DeepseekModel,
        page_size: int = 16,
        chunk_size: int = 256,
        decode_model: DeepseekModel | None = None,
    ):
        if chunk_size <= 0 or page_size <= 0:
            raise InvalidRequestError("chunk size and page size must be positive")
        if decode_model is not None and (
            decode_model.cfg != model.cfg or decode_model.dtype != model.dtype
        ):
            raise InvalidRequestError("the decode model must be the prefill model's checkpoint")
        self.model = model
        self.decode_model = decode_model or model
        self.chunk_size = chunk_size
        max_pos = model.cfg.max_position_embeddings
        self.pool = model.new_kv_pool(num_pages=-(-max_pos // page_size), page_size=page_size)
        self.grammars = Grammars(model.model_dir, model.cfg.vocab_size, model.cfg.eos_token_id)

    def prefill(self, table: PageTable, prompt_ids: list[int]) -> torch.Tensor:
        """Fills the cache with the prompt, chunk by chunk; returns the last logits [vocab]."""
        self.pool.reserve(table, len(prompt_ids))
        logits = None
        for start in range(0, len(prompt_ids), self.chunk_size):
            chunk = prompt_ids[start : start + self.chunk_size]
            batch = ForwardBatch.build(self.pool, [table], [chunk], [start], is_decode=False)
            logits = self.model.forward(batch, self.pool)
        return logits[0]

    def decode(self, table: PageTable, token: int, position: int) -> torch.Tensor:
        """Feeds `token` at `position` (the cache holds positions < position); returns logits."""
        self.pool.reserve(table, position + 1)
        batch = ForwardBatch.build(self.pool, [table], [[token]], [position], is_decode=True)
        return self.decode_model.forward(batch, self.pool)[0]

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """The first token as the prefill node samples it (the prompt is all its past, draw
        index 0), the rest as the decode node does (output counts kept in a one-slot
        TokenCounts, token k drawn with index k, both after `params.draw_offset`; with
        structured output, each token masked to the grammar first)."""
        cfg = self.model.cfg
        validate_prompt(prompt_ids, cfg.vocab_size, cfg.max_position_embeddings)
        params.check_vocab(cfg.vocab_size)
        grammar = self.grammars.matcher_for(params.structured, params.resumed_output(prompt_ids))
        stop_ids = params.stop_ids(cfg.eos_token_id)
        seed = request_seed(params)
        counts = TokenCounts(1, cfg.vocab_size)
        table = self.pool.new_table()
        try:
            logits = self.prefill(table, prompt_ids)
            past = PastTokens.of_prompts([prompt_ids], [params], cfg.eos_token_id, cfg.vocab_size)
            tokens: list[int] = []
            while True:
                logits = logits[None]  # [1, V]
                if grammar is not None:
                    logits = self.grammars.compute_masks([grammar]).apply(logits)
                draw = params.draw_offset + len(tokens)
                token = sample(logits, [params], [seed], [draw], past)[0]
                if grammar is not None and not grammar.consume(token):
                    raise InvalidRequestError(f"structured output failed: {grammar.error}")
                tokens.append(token)
                if len(tokens) == 1:
                    counts.start([0], [params], [prompt_ids], [tokens])
                else:
                    counts.add([0], [token])
                position = len(prompt_ids) + len(tokens) - 1
                reason = finish_reason(
                    token,
                    stop_ids,
                    len(tokens),
                    position + 1,
                    params.max_new_tokens,
                    cfg.max_position_embeddings,
                )
                if reason is not None:
                    return GenerationResult(prompt_ids, tokens, reason)
                logits = self.decode(table, token, position)
                past = counts.past([0], [params], [len(tokens)], [stop_ids])
        finally:
            self.pool.release(table)
