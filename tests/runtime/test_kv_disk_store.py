"""The disk tier's store alone (runtime.kv_disk_store): pages round-trip bit for bit, a file
that fails a check is deleted and read as a miss, layouts do not mix, two stores over one
directory share pages, and the size bound drops the least recently used files."""

import os
import time

import pytest
import torch

from control.kv_events import page_hashes
from runtime.kv_disk_store import HEADER, DiskKVStore

SHAPE = (3, 4, 8)  # layers, page size, row width
LAYOUT = {"model.hidden_size": 64, "num_layers": 3, "row_width": 8, "page_size": 4}


def make_store(root, layout=LAYOUT, max_bytes=1 << 20):
    return DiskKVStore(root, layout, SHAPE, torch.bfloat16, max_bytes)


def page(seed):
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


NAMES = page_hashes(list(range(40)), 4)  # ten chained page names


def test_a_page_comes_back_bit_for_bit_and_a_missing_one_is_a_miss(tmp_path):
    store = make_store(tmp_path)
    rows = page(1)
    store.put(NAMES[0], rows)
    back = store.get(NAMES[0])
    assert torch.equal(back.view(torch.int16), rows.view(torch.int16))
    assert store.get(NAMES[1]) is None
    assert (store.num_stored, store.num_loaded, store.num_corrupt) == (1, 1, 0)
    with pytest.raises(ValueError, match="not this layout"):
        store.put(NAMES[2], page(2)[:2])


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_a_damaged_file_is_deleted_and_read_as_a_miss(tmp_path, damage):
    store = make_store(tmp_path)
    store.put(NAMES[0], page(1))
    path = store._path(NAMES[0])
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[HEADER.size + 17] ^= 0x04
    elif damage == "truncate":
        data = data[:-3]
    else:
        data[0:4] = b"XXXX"
    path.write_bytes(bytes(data))
    assert store.get(NAMES[0]) is None
    assert not path.exists() and store.num_corrupt == 1
    store.put(NAMES[0], page(1))  # written again by the next spill
    assert store.get(NAMES[0]) is not None


def test_two_stores_of_one_layout_share_pages_and_other_layouts_do_not(tmp_path):
    a, b = make_store(tmp_path), make_store(tmp_path)
    a.put(NAMES[3], page(3))
    assert torch.equal(b.get(NAMES[3]), page(3))
    other = make_store(tmp_path, {**LAYOUT, "quant": "int8"})
    assert other.dir != a.dir and other.get(NAMES[3]) is None


def test_the_bound_drops_the_least_recently_used_pages(tmp_path):
    one = HEADER.size + 3 * 4 * 8 * 2
    store = make_store(tmp_path, max_bytes=5 * one)
    for i in range(5):
        store.put(NAMES[i], page(i))
        past = time.time() - 100 + i  # distinct, increasing times: 0 oldest
        os.utime(store._path(NAMES[i]), (past, past))
    assert store.get(NAMES[0]) is not None  # used now: the newest
    for i in range(5, 8):
        store.put(NAMES[i], page(i))
    assert store.num_bytes() <= 5 * one
    assert store.contains(NAMES[0]) and not store.contains(NAMES[1])  # 1 was the oldest unused
    assert store.num_trimmed >= 3
    reopened = make_store(tmp_path, max_bytes=2 * one)  # a smaller bound trims at open
    assert reopened.num_bytes() <= 2 * one


def drain(store):
    """Waits for the helper thread to finish what it was asked (it runs jobs in order)."""
    store._reader.submit(lambda: None).result(timeout=30)


def test_pages_read_ahead_come_from_memory_until_one_is_missing(tmp_path):
    store = make_store(tmp_path)
    for i in (0, 1, 3):
        store.put(NAMES[i], page(i))
    store.prefetch(NAMES[:4])  # 2 is missing: 3 is of no use after it, and is not read
    drain(store)
    assert store.num_prefetched == 2
    for i in (0, 1):
        store._path(NAMES[i]).unlink()  # gone from disk: still in memory
        assert torch.equal(store.get(NAMES[i]), page(i))
    assert store.get(NAMES[0]) is None  # taken once, and its file is gone
    assert torch.equal(store.get(NAMES[3]), page(3))  # read when asked
    assert store.num_loaded == 3
    store.close()


def test_the_read_ahead_is_bounded_and_a_damaged_page_counted_once(tmp_path, monkeypatch):
    import runtime.kv_disk_store as module

    monkeypatch.setattr(module, "STAGING_BYTES", 2 * (3 * 4 * 8 * 2))  # two pages
    store = make_store(tmp_path)
    for i in range(5):
        store.put(NAMES[i], page(i))
    store.prefetch(NAMES[:5])
    drain(store)
    assert list(store._staged) == NAMES[3:5]  # the oldest went
    store.put(NAMES[5], page(5))
    path = store._path(NAMES[5])
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 1
    path.write_bytes(bytes(damaged))
    store.prefetch([NAMES[5]])
    assert store.get(NAMES[5]) is None  # waits for the helper's read: one check, one count
    assert store.num_corrupt == 1
    store.close()
