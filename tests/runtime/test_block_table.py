"""runtime.block_table.BlockTable against the oracle of each request's own page list: slots in
order (a view of the persistent tensor) and in any order or repeated (a gathered copy), pages
gained between steps, a slot handed to a new request, and a table longer than sized for."""

from __future__ import annotations

import torch

from model.kv_pool import PageTable
from runtime.block_table import BlockTable


def _check(rows: torch.Tensor, tables: list[PageTable]) -> None:
    assert rows.dtype == torch.int32 and rows.stride(-1) == 1
    assert rows.shape[1] == max(len(t.pages) for t in tables)
    for row, pages in zip(rows.tolist(), [t.pages for t in tables], strict=True):
        assert row[: len(pages)] == pages


def test_rows_follow_the_page_lists_in_and_out_of_slot_order():
    block = BlockTable(num_slots=4, max_pages=8)
    a, b, c = PageTable(16, [5, 9]), PageTable(16, [1]), PageTable(16, [7, 2, 3])
    in_order = block.rows([0, 1, 2], [a, b, c])
    _check(in_order, [a, b, c])
    assert in_order.data_ptr() == block.tensor.data_ptr()  # slots in order: a view, no copy
    _check(block.rows([2, 0], [c, a]), [c, a])
    _check(block.rows([1, 1, 1], [b, b, b]), [b, b, b])  # one request's draft rows
    a.pages.append(11)  # a page gained since the last step
    b.pages.extend([4, 6, 8])
    _check(block.rows([1, 2], [b, c]), [b, c])
    _check(block.rows([0, 1, 2], [a, b, c]), [a, b, c])


def test_a_new_request_in_a_slot_and_growth_past_the_width():
    block = BlockTable(num_slots=2, max_pages=2)
    old = PageTable(4, [3, 8])
    _check(block.rows([0], [old]), [old])
    new = PageTable(4, [6])  # fewer pages than the slot's last owner
    _check(block.rows([0], [new]), [new])
    long = PageTable(4, list(range(10, 15)))  # 5 pages > max_pages: the tensor grows
    _check(block.rows([0, 1], [new, long]), [new, long])
    _check(block.rows([1, 0], [long, new]), [long, new])
