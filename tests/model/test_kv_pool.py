"""Paged KV pool: allocation is all-or-nothing, pages never overlap, rows round-trip."""

import pytest
import torch

from control.errors import OutOfPagesError
from model.kv_pool import KVPool, PageAllocator


def test_allocator_all_or_nothing_and_double_free():
    alloc = PageAllocator(4)
    first = alloc.allocate(3)
    with pytest.raises(OutOfPagesError):
        alloc.allocate(2)
    assert alloc.num_free == 1  # the failed request took nothing
    alloc.free(first)
    assert alloc.num_free == 4
    with pytest.raises(ValueError):
        alloc.free(first)


def test_held_frees_are_handed_out_only_after_release():
    alloc = PageAllocator(4)
    first = alloc.allocate(2)
    alloc.hold_frees()  # a forward may still write these
    alloc.free(first)
    assert alloc.num_held == 2 and alloc.num_free == 2 and alloc.num_used == 0
    assert not set(alloc.allocate(2)) & set(first)  # only the pages never freed
    with pytest.raises(OutOfPagesError):
        alloc.allocate(1)
    with pytest.raises(ValueError):
        alloc.free(first)  # held is not in use: a second free is still a bug
    alloc.release_held()
    assert alloc.num_held == 0 and sorted(alloc.allocate(2)) == sorted(first)
    alloc.free(first)
    assert alloc.num_free == 2  # frees are immediate again


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_rows_round_trip_and_neighbours_untouched(page_size):
    pool = KVPool(num_layers=2, num_pages=40, page_size=page_size, row_width=5, dtype=torch.float32)
    a, b = pool.new_table(), pool.new_table()
    pool.reserve(a, 10)
    pool.reserve(b, 7)
    assert not set(a.pages) & set(b.pages)
    rows_a = torch.randn(2, 10, 5)
    rows_b = torch.randn(2, 7, 5)
    pool.write_rows(a, 0, 0, rows_a)
    pool.write_rows(b, 0, 0, rows_b)
    pool.write_rows(a, 1, 4, torch.full((1, 3, 5), 7.0))
    expected = rows_a.clone()
    expected[1, 4:7] = 7.0
    assert torch.equal(pool.read_rows(a, 0, 2, 0, 10), expected)
    assert torch.equal(pool.read_rows(b, 0, 2, 0, 7), rows_b)


def test_writes_outside_a_reservation_are_refused():
    pool = KVPool(num_layers=1, num_pages=8, page_size=4, row_width=3, dtype=torch.float32)
    table = pool.new_table()
    pool.reserve(table, 5)  # 2 pages = 8 tokens of capacity
    with pytest.raises(IndexError):
        pool.write_rows(table, 0, 6, torch.zeros(1, 3, 3))
    with pytest.raises(IndexError):
        pool.write_rows(table, 1, 0, torch.zeros(1, 1, 3))
    pool.release(table)
    pool.release(table)  # releasing twice is harmless
    assert pool.allocator.num_free == 8


def test_shared_pages_return_only_when_the_last_holder_frees_them():
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.share(pages)
    alloc.share(pages[:1])
    assert [alloc.num_holders(p) for p in pages] == [3, 2]
    alloc.free(pages)
    assert alloc.num_free == 2 and alloc.num_holders(pages[0]) == 2
    alloc.free(pages)
    assert alloc.num_free == 3 and alloc.num_holders(pages[1]) == 0
    alloc.free(pages[:1])
    assert alloc.num_free == 4 and alloc.num_used == 0
    with pytest.raises(ValueError):
        alloc.free(pages[:1])
    with pytest.raises(ValueError):
        alloc.share(pages[:1])


@pytest.mark.parametrize("prompt_len", [7, 8, 9])  # page size 4: ends inside a page, on one
def test_fork_shares_whole_prompt_pages_and_copies_the_last(prompt_len):
    """Oracle: a plain copy of the parent's rows. The fork reads the parent's prompt rows; rows
    either writes after the prompt stay its own."""
    pool = KVPool(num_layers=2, num_pages=12, page_size=4, row_width=3, dtype=torch.float32)
    parent = pool.new_table()
    pool.reserve(parent, prompt_len + 4)
    prompt_rows = torch.randn(2, prompt_len, 3)
    pool.write_rows(parent, 0, 0, prompt_rows)
    own = pool.new_table()
    pool.reserve(own, prompt_len + 4 - (prompt_len // 4) * 4)
    own_pages = list(own.pages)
    pool.fork(parent, prompt_len, own)
    assert own.pages[: prompt_len // 4] == parent.pages[: prompt_len // 4]
    assert own.pages[prompt_len // 4 :] == own_pages and own.capacity >= prompt_len + 4
    assert torch.equal(pool.read_rows(own, 0, 2, 0, prompt_len), prompt_rows)
    mine, theirs = torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    pool.write_rows(own, 0, prompt_len, mine)
    pool.write_rows(parent, 0, prompt_len, theirs)
    assert torch.equal(pool.read_rows(own, 0, 2, prompt_len, prompt_len + 4), mine)
    assert torch.equal(pool.read_rows(parent, 0, 2, prompt_len, prompt_len + 4), theirs)
    assert torch.equal(pool.read_rows(parent, 0, 2, 0, prompt_len), prompt_rows)
    pool.release(parent)
    assert torch.equal(pool.read_rows(own, 0, 2, 0, prompt_len), prompt_rows)  # still held
    pool.release(own)
    assert pool.allocator.num_used == 0
