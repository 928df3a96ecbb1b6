"""The decode node's page tables as one persistent tensor, by batch slot.

Each decode step hands the attention kernel a [rows, max_pages] int32 page table. Building it
anew from every request's page list costs a tensor per request per step; here each batch slot
keeps its row, and a step only copies the pages a request gained since the previous one (a new
page every `page_size` tokens), then gathers the batch's rows in one index. Entries past a
request's pages are stale, never read: the kernels stop at each row's sequence length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model.kv_pool import PageTable


class BlockTable:
    def __init__(self, num_slots: int, max_pages: int):
        if num_slots < 1 or max_pages < 1:
            raise ValueError("a block table needs at least one slot and one page")
        self.tensor = torch.zeros(num_slots, max_pages, dtype=torch.int32)
        self._synced: list[int] = [0] * num_slots  # pages of the slot's table copied so far
        self._owner: list[PageTable | None] = [None] * num_slots

    def rows(self, slots: Sequence[int], tables: Sequence[PageTable]) -> torch.Tensor:
        """[len(slots), width] int32: row i holds tables[i]'s pages (slot slots[i]; a slot may
        repeat, with the same table: the rows of one request's draft tokens)."""
        for slot, table in zip(slots, tables, strict=True):
            self._sync(slot, table)
        width = max((self._synced[s] for s in slots), default=1) or 1
        first = slots[0] if slots else 0
        if list(slots) == list(range(first, first + len(slots))):  # in slot order: a view
            return self.tensor[first : first + len(slots), :width]
        return self.tensor[torch.tensor(slots), :width]

    def _sync(self, slot: int, table: PageTable) -> None:
        num_pages, done = len(table.pages), self._synced[slot]
        if self._owner[slot] is not table or num_pages < done:  # a new request in this slot
            self._owner[slot], done = table, 0
        if num_pages > done:
            if num_pages > self.tensor.shape[1]:  # longer than sized for: grow, keep the rows
                grown = torch.zeros(self.tensor.shape[0], 2 * num_pages, dtype=torch.int32)
                grown[:, : self.tensor.shape[1]] = self.tensor
                self.tensor = grown
            self.tensor[slot, done:num_pages] = torch.tensor(
                table.pages[done:num_pages], dtype=torch.int32
            )
        self._synced[slot] = num_pages
