"""What one model forward runs on: a batch of sequences, each with new tokens after a cached prefix."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from model.kv_pool import KVPool, PageTable


@dataclass
class ForwardBatch:
    """Tokens of B sequences packed in order (T = sum of new_lens).

    is_decode: every sequence has exactly one new token (the MLA-absorbed decode path); else the
    extend path (prefill chunks, cached prefix + causal new tokens).
    """

    is_decode: bool
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    new_lens: torch.Tensor  # [B] int32
    prefix_lens: torch.Tensor  # [B] int32, tokens already in the cache before this forward
    page_table: torch.Tensor  # [B, max_pages] int32
    slots: torch.Tensor  # [T] int64, cache slot of each new token's row
    prefix_slots: torch.Tensor  # [P] int64, cache slots of every prefix token (extend only)
    # [N] int64 packed indices of more tokens whose logits `forward` returns after the last
    # tokens' (prompt logprobs); None, the default, keeps the lm_head to B rows.
    extra_logit_index: torch.Tensor | None = None
    _seq_lens: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.new_lens.shape[0]

    @property
    def seq_lens(self) -> torch.Tensor:
        """[B] int32: context length after this forward (computed once: every layer asks)."""
        if self._seq_lens is None:
            self._seq_lens = self.prefix_lens + self.new_lens
        return self._seq_lens

    @property
    def last_token_index(self) -> torch.Tensor:
        """[B] int64: index in the packed tokens of each sequence's last new token."""
        return torch.cumsum(self.new_lens.long(), 0) - 1

    @classmethod
    def decode_rows(
        cls,
        tables: Sequence[PageTable],
        tokens: Sequence[int],
        positions: Sequence[int],
        page_table: torch.Tensor,
    ) -> ForwardBatch:
        """A decode-path batch of one token per row: row i feeds tokens[i] at positions[i]
        through tables[i] (which must hold that position); `page_table` its [rows, max_pages]
        (`runtime.block_table`). Python ints all the way to one tensor per field."""
        slots = []
        for table, pos in zip(tables, positions, strict=True):
            page_size = table.page_size
            if not 0 <= pos < table.capacity:
                raise IndexError(f"position {pos} outside capacity {table.capacity}")
            slots.append(table.pages[pos // page_size] * page_size + pos % page_size)
        return cls(
            is_decode=True,
            input_ids=torch.tensor(tokens, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            new_lens=torch.ones(len(tokens), dtype=torch.int32),
            prefix_lens=torch.tensor(positions, dtype=torch.int32),
            page_table=page_table,
            slots=torch.tensor(slots, dtype=torch.int64),
            prefix_slots=torch.zeros(0, dtype=torch.int64),
        )

    @classmethod
    def build(
        cls,
        pool: KVPool,
        tables: list[PageTable],
        new_tokens: list[list[int]],
        prefix_lens: list[int],
        is_decode: bool,
    ) -> ForwardBatch:
        """Packs sequences; each table must already hold prefix_len + len(new) tokens of pages."""
        if not (len(tables) == len(new_tokens) == len(prefix_lens)):
            raise ValueError("tables, new_tokens and prefix_lens must have one entry per sequence")
        if any(len(tokens) == 0 for tokens in new_tokens):
            raise ValueError("every sequence in a forward needs at least one new token")
        if is_decode and any(len(tokens) != 1 for tokens in new_tokens):
            raise ValueError("a decode batch has exactly one new token per sequence")
        ids, positions, slots, prefix_slots = [], [], [], []
        for table, tokens, start in zip(tables, new_tokens, prefix_lens, strict=True):
            end = start + len(tokens)
            ids.extend(tokens)
            positions.append(torch.arange(start, end))
            slots.append(table.slots(start, end))
            if not is_decode and start:
                prefix_slots.append(table.slots(0, start))
        empty = torch.zeros(0, dtype=torch.int64)
        return cls(
            is_decode=is_decode,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.cat(positions),
            new_lens=torch.tensor([len(t) for t in new_tokens], dtype=torch.int32),
            prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
            page_table=pool.page_table_tensor(tables),
            slots=torch.cat(slots),
            prefix_slots=torch.cat(prefix_slots) if prefix_slots else empty,
        )
