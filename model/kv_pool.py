"""Paged latent KV cache: one buffer for all layers, a free-list page allocator, page tables.

Layout: `buffer[layer, page, offset, :]` holds the row `[c_kv | k_pe]` (width W = kv_lora_rank +
qk_rope_head_dim) of token `page_table[pos // page_size] * page_size + offset`. Rows are
addressed by token position, so two pools with different page sizes exchange rows freely.

Ownership: pages belong to the allocator until `allocate` hands them to one request's
`PageTable`; they return on `free`. A request only ever writes through its own page table, so
running out of pages is an `OutOfPagesError` for the caller to handle, never an overwrite.

Sharing (n > 1: the sequences of one request forked from its prompt's KV, `KVPool.fork`): a
page may be in several tables; `share` counts one more holder and `free` returns the page only
when its last holder frees it. Only whole pages of the prompt are shared (read-only from then
on: every sequence writes at positions past the prompt); the page the prompt ends in is copied,
since each sequence writes its own rows into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from control.errors import OutOfPagesError


class PageAllocator:
    """Free list of page ids [0, num_pages). Not thread-safe: one owner (a scheduler) calls it."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._in_use: set[int] = set()
        self._extra_holders: dict[int, int] = {}  # shared pages: holders beyond the first
        self._held: list[int] | None = None  # freed while held back (`hold_frees`)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._in_use)

    @property
    def num_held(self) -> int:
        """Pages freed since `hold_frees`, neither in use nor free yet."""
        return len(self._held or ())

    def hold_frees(self) -> None:
        """From now on a freed page is held back, not handed out again, until `release_held`:
        a forward running beside the loop (the decode node's overlap) may still write a row of
        a request aborted meanwhile, and that row must not land in another request's page."""
        if self._held is None:
            self._held = []

    def release_held(self) -> None:
        """The pages held back since `hold_frees` become free; frees are immediate again."""
        held, self._held = self._held or [], None
        self._free.extend(reversed(held))

    def allocate(self, count: int) -> list[int]:
        """Takes `count` pages, or none at all if fewer are free (raises OutOfPagesError)."""
        if count < 0:
            raise ValueError("page count must not be negative")
        if count > len(self._free):
            raise OutOfPagesError(f"need {count} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        self._in_use.update(pages)
        return pages

    def share(self, pages: list[int]) -> None:
        """One more holder of each page (in use): it returns to the free list only when every
        holder has freed it."""
        for page in pages:
            if page not in self._in_use:
                raise ValueError(f"page {page} shared but not in use")
        for page in pages:
            self._extra_holders[page] = self._extra_holders.get(page, 0) + 1

    def num_holders(self, page: int) -> int:
        return self._extra_holders.get(page, 0) + 1 if page in self._in_use else 0

    def free(self, pages: list[int]) -> None:
        """Returns pages (a shared one: drops one holder); freeing a page that is not in use
        is a bug and raises."""
        for page in pages:
            if page not in self._in_use:
                raise ValueError(f"page {page} freed but not in use")
        for page in pages:
            extra = self._extra_holders.get(page, 0)
            if extra:
                if extra == 1:
                    del self._extra_holders[page]
                else:
                    self._extra_holders[page] = extra - 1
                continue
            self._in_use.remove(page)
            (self._free if self._held is None else self._held).append(page)


@dataclass
class PageTable:
    """The pages of one request, in token order; capacity = len(pages) * page_size tokens."""

    page_size: int
    pages: list[int] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.page_size

    def pages_needed(self, num_tokens: int) -> int:
        """Extra pages to hold `num_tokens` tokens in total."""
        total = -(-num_tokens // self.page_size)
        return max(0, total - len(self.pages))

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Flat slots of positions [start, end): int64 [end - start]."""
        if not 0 <= start <= end <= self.capacity:
            raise IndexError(f"positions [{start}, {end}) outside capacity {self.capacity}")
        pos = torch.arange(start, end)
        pages = torch.tensor(self.pages, dtype=torch.int64)
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size


class KVPool:
    """The cache buffer plus its allocator.  buffer: [num_layers, num_pages, page_size, W]."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        row_width: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ):
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        self.num_layers = num_layers
        self.page_size = page_size
        self.row_width = row_width
        self.dtype = dtype
        self.buffer = torch.zeros(
            num_layers, num_pages, page_size, row_width, dtype=dtype, device=device
        )
        self.allocator = PageAllocator(num_pages)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.row_width * self.buffer.element_size()

    def layer(self, layer_idx: int) -> torch.Tensor:
        """[num_pages, page_size, W] view of one layer (what the attention kernels take)."""
        return self.buffer[layer_idx]

    def new_table(self) -> PageTable:
        return PageTable(self.page_size)

    def reserve(self, table: PageTable, num_tokens: int) -> None:
        """Grows `table` to hold `num_tokens` tokens (all or nothing; OutOfPagesError if short)."""
        table.pages.extend(self.allocator.allocate(table.pages_needed(num_tokens)))

    def release(self, table: PageTable) -> None:
        """Returns every page of `table` to the pool and empties it (safe to call twice)."""
        pages, table.pages = table.pages, []
        self.allocator.free(pages)

    def fork(self, parent: PageTable, prompt_len: int, own: PageTable) -> None:
        """Makes `own` (holding only its own pages) the page table of a sequence forked from
        `parent` after its `prompt_len` prompt tokens: parent's whole prompt pages, shared,
        then `own`'s pages, the first of which gets a copy of the page the prompt ends in (when
        it ends inside one). `own` must hold at least that page."""
        num_shared, partial = divmod(prompt_len, self.page_size)
        if parent.capacity < prompt_len or (partial and not own.pages):
            raise ValueError("fork: the parent does not hold the prompt, or no page to copy to")
        shared = parent.pages[:num_shared]
        self.allocator.share(shared)
        if partial:
            src, dst = parent.pages[num_shared], own.pages[0]
            self.buffer[:, dst, :partial] = self.buffer[:, src, :partial]
        own.pages[:0] = shared

    def write_rows(
        self, table: PageTable, layer_start: int, token_start: int, rows: torch.Tensor
    ) -> None:
        """Stores rows [num_layers_in_rows, num_tokens, W] at layers layer_start.. and positions
        token_start.. of the request owning `table` (IndexError outside its pages)."""
        num_layers, num_tokens, width = rows.shape
        if width != self.row_width or layer_start < 0 or layer_start + num_layers > self.num_layers:
            raise IndexError("rows do not fit the pool's layers or row width")
        slots = table.slots(token_start, token_start + num_tokens)
        flat = self.buffer[layer_start : layer_start + num_layers].view(num_layers, -1, width)
        rows = rows.to(device=flat.device, dtype=self.dtype)
        # Runs of consecutive slots are copied as slices (memcpy speed, ~5x the scatter's);
        # pages too fragmented for that to pay go through one scatter.
        breaks = (torch.nonzero(slots[1:] != slots[:-1] + 1).flatten() + 1).tolist()
        if num_tokens == 0 or len(breaks) >= 32:
            flat.index_copy_(1, slots.to(flat.device), rows)
            return
        bounds = [0, *breaks, num_tokens]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            start = int(slots[a])
            flat[:, start : start + b - a] = rows[:, a:b]

    def read_rows(
        self, table: PageTable, layer_start: int, layer_end: int, token_start: int, token_end: int
    ) -> torch.Tensor:
        """Rows of layers [layer_start, layer_end) and positions [token_start, token_end):
        a new tensor [layers, tokens, W]."""
        slots = table.slots(token_start, token_end).to(self.buffer.device)
        flat = self.buffer[layer_start:layer_end].view(layer_end - layer_start, -1, self.row_width)
        return flat[:, slots]

    def page_table_tensor(self, tables: list[PageTable]) -> torch.Tensor:
        """[B, max_pages] int32 for the attention kernels (unused entries are 0)."""
        width = max((len(t.pages) for t in tables), default=0) or 1
        out = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            out[i, : len(t.pages)] = torch.tensor(t.pages, dtype=torch.int32)
        return out
