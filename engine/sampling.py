"""Sampling parameters and the batched sampler (greedy, temperature, top-k, top-p, seeds)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; temperature 0 means greedy. Defaults follow the OpenAI API."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    seed: int | None = None
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 (no limit) or >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be in [0, 2^63), got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def make_generator(self) -> torch.Generator | None:
        """The request's own random stream: a fixed seed gives the same tokens in any batch."""
        if self.is_greedy:
            return None
        gen = torch.Generator()
        gen.manual_seed(self.seed if self.seed is not None else torch.seed())
        return gen


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] (already divided by temperature) -> logits with excluded tokens at -inf."""
    if 0 < top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        remove = probs.cumsum(-1) - probs >= top_p
        logits = logits.clone()
        logits[order[remove]] = float("-inf")
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """logits: [B, V] fp32 -> one token id per row."""
    greedy_ids = logits.argmax(-1).tolist()
    out = []
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.is_greedy:
            out.append(greedy_ids[row])
            continue
        scaled = _filter_top_k_top_p(logits[row].float() / p.temperature, p.top_k, p.top_p)
        probs = scaled.softmax(-1)
        out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    return out
