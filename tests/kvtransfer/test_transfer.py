"""End-to-end transfers through both transports: prefill pool (page 16) -> decode pool (page 3).

The oracle is the prefill pool itself: rows written there, read back from the decode pool with
`read_rows`, must be equal bit for bit.
"""

import time

import pytest
import torch
from kv_helpers import (
    NUM_LAYERS,
    TIMEOUT,
    chunk_frames,
    done_frames,
    fingerprint,
    make_pool,
    random_rows,
    reserve,
    wait_until,
)

from kvtransfer import InprocSender, KVTransferError, Rendezvous, ZmqSender


def prefill_and_send(sender, rdv, prompt_len, chunk_len, seed, first_token=11, done=True):
    """What a prefill node does: compute (here: random rows into its own page-16 pool) chunk
    by chunk, read each chunk's rows for all layers and send them. Returns all rows."""
    pool = make_pool(page_size=16)
    table = reserve(pool, prompt_len)
    rows = random_rows(prompt_len, seed)
    for start in range(0, prompt_len, chunk_len):
        end = min(start + chunk_len, prompt_len)
        pool.write_rows(table, 0, start, rows[:, start:end])
        sender.send_chunk(rdv, 0, start, pool.read_rows(table, 0, NUM_LAYERS, start, end))
    if done:
        sender.send_done(rdv, prompt_len, first_token)
    return rows


def poll_one(receiver):
    events = receiver.poll(TIMEOUT)
    assert len(events) == 1, events
    return events[0]


@pytest.mark.parametrize("prompt_len,chunk_len", [(50, 16), (1, 8), (33, 33), (48, 7)])
def test_round_trip_different_page_sizes(make_link, prompt_len, chunk_len):
    link = make_link(make_pool(page_size=3))
    table = reserve(link.pool, prompt_len + 5)  # decode reserves room to grow, too
    rdv = Rendezvous("req-1", 0xABCDEF)
    link.receiver.expect(rdv, table, prompt_len, time.monotonic() + TIMEOUT)
    rows = prefill_and_send(link.sender, rdv, prompt_len, chunk_len, seed=1, first_token=42)
    event = poll_one(link.receiver)
    assert event.is_ready and event.rendezvous == rdv and event.first_token == 42
    assert torch.equal(link.pool.read_rows(table, 0, NUM_LAYERS, 0, prompt_len), rows)
    stats = link.receiver.stats()
    assert stats.dropped == {} and stats.num_ready == 1
    assert stats.bytes_written == rows.numel() * 2 == stats.bytes_received


def test_layer_split_chunks_and_interleaved_requests(make_link):
    link = make_link(make_pool(page_size=3))
    a, b = Rendezvous("a", 1), Rendezvous("b", 2)
    ta, tb = reserve(link.pool, 10), reserve(link.pool, 12)
    link.receiver.expect(a, ta, 10, time.monotonic() + TIMEOUT)
    link.receiver.expect(b, tb, 12, time.monotonic() + TIMEOUT)
    ra, rb = random_rows(10, seed=2), random_rows(12, seed=3)
    link.sender.send_chunk(a, 0, 0, ra[:2])  # layers [0, 2) of all tokens
    link.sender.send_chunk(b, 0, 0, rb[:, :6])
    link.sender.send_chunk(a, 2, 0, ra[2:])  # layers [2, 4)
    link.sender.send_chunk(b, 0, 6, rb[:, 6:])
    link.sender.send_done(b, 12, 5)
    link.sender.send_done(a, 10, 6)
    events = []
    while len(events) < 2:
        events += link.receiver.poll(TIMEOUT) or pytest.fail("no event")
    assert [(e.rendezvous, e.first_token) for e in events] == [(b, 5), (a, 6)]
    assert torch.equal(link.pool.read_rows(ta, 0, NUM_LAYERS, 0, 10), ra)
    assert torch.equal(link.pool.read_rows(tb, 0, NUM_LAYERS, 0, 12), rb)


def test_done_with_missing_tokens_fails(make_link):
    link = make_link(make_pool(page_size=3))
    rdv = Rendezvous("short", 9)
    link.receiver.expect(rdv, reserve(link.pool, 20), 20, time.monotonic() + TIMEOUT)
    link.sender.send_chunk(rdv, 0, 0, random_rows(16, seed=4))
    link.sender.send_done(rdv, 20, 3)
    event = poll_one(link.receiver)
    assert not event.is_ready and "token 16 never arrived" in event.reason


def test_done_with_missing_layer_fails(make_link):
    link = make_link(make_pool(page_size=3))
    rdv = Rendezvous("nolayer", 9)
    link.receiver.expect(rdv, reserve(link.pool, 8), 8, time.monotonic() + TIMEOUT)
    link.sender.send_chunk(rdv, 0, 0, random_rows(8, seed=4)[:3])
    link.sender.send_done(rdv, 8, 3)
    event = poll_one(link.receiver)
    assert not event.is_ready and "layer 3 token 0" in event.reason


def test_done_with_other_token_count_fails(make_link):
    link = make_link(make_pool(page_size=3))
    rdv = Rendezvous("count", 9)
    link.receiver.expect(rdv, reserve(link.pool, 8), 8, time.monotonic() + TIMEOUT)
    prefill_and_send(link.sender, rdv, 8, 8, seed=5, done=False)
    link.sender.send_done(rdv, 9, 3)
    event = poll_one(link.receiver)
    assert not event.is_ready and "9 tokens, 8 were reserved" in event.reason


def test_abort_fails_the_request(make_link):
    link = make_link(make_pool(page_size=3))
    rdv = Rendezvous("aborted", 1)
    link.receiver.expect(rdv, reserve(link.pool, 8), 8, time.monotonic() + TIMEOUT)
    link.sender.send_chunk(rdv, 0, 0, random_rows(4, seed=6))
    link.sender.send_abort(rdv, "client disconnected")
    event = poll_one(link.receiver)
    assert not event.is_ready and event.reason == "prefill aborted: client disconnected"


def test_deadline_fails_and_later_chunks_are_dropped(make_link):
    link = make_link(make_pool(page_size=3))
    rdv = Rendezvous("slow", 3)
    table = reserve(link.pool, 8)
    link.receiver.expect(rdv, table, 8, time.monotonic() + 0.2)
    link.sender.send_chunk(rdv, 0, 0, random_rows(4, seed=7))
    event = poll_one(link.receiver)
    assert not event.is_ready and "timed out" in event.reason
    # The sender was told (kv_cancel: it sends nothing more, test_cancel.py); late frames that
    # were already on their way are dropped.
    link.raw_send(chunk_frames(rdv, 1, 4, random_rows(4, seed=8)))
    link.raw_send(done_frames(rdv, 2, 8, 1))
    assert link.dropped().get("unknown_rendezvous") == 2 and link.receiver.poll() == []
    assert not link.pool.read_rows(table, 0, NUM_LAYERS, 4, 8).any()  # never written


def test_cancel_discards_a_ready_event_not_yet_polled(make_link):
    link = make_link(make_pool(page_size=3))
    rdv = Rendezvous("cancelled", 4)
    link.receiver.expect(rdv, reserve(link.pool, 8), 8, time.monotonic() + TIMEOUT)
    prefill_and_send(link.sender, rdv, 8, 8, seed=9)
    wait_until(lambda: link.receiver.stats().num_ready == 1, "the transfer to finish")
    assert link.receiver.cancel(rdv) is True
    assert link.receiver.poll(0.05) == []
    assert link.receiver.cancel(rdv) is False


def test_cancel_mid_transfer_stops_writes(make_link):
    link = make_link(make_pool(page_size=3))
    rdv = Rendezvous("cancelled", 5)
    table = reserve(link.pool, 8)
    link.receiver.expect(rdv, table, 8, time.monotonic() + TIMEOUT)
    link.sender.send_chunk(rdv, 0, 0, random_rows(4, seed=10))
    wait_until(lambda: link.receiver.stats().chunks_written == 1, "the first chunk")
    assert link.receiver.cancel(rdv) is True
    link.raw_send(chunk_frames(rdv, 1, 4, random_rows(4, seed=11)))  # already on their way
    link.raw_send(done_frames(rdv, 2, 8, 1))
    assert link.dropped() == {"unknown_rendezvous": 2}
    assert link.receiver.poll() == []
    assert not link.pool.read_rows(table, 0, NUM_LAYERS, 4, 8).any()


def test_expect_rejects_bad_arguments(make_link):
    link = make_link(make_pool(page_size=3))
    rdv = Rendezvous("x", 1)
    with pytest.raises(ValueError, match="holds 6 tokens"):
        link.receiver.expect(rdv, reserve(link.pool, 5), 7, time.monotonic() + 1)
    with pytest.raises(ValueError, match="page size"):
        link.receiver.expect(rdv, reserve(make_pool(page_size=16), 5), 5, time.monotonic() + 1)
    link.receiver.expect(rdv, reserve(link.pool, 5), 5, time.monotonic() + 1)
    with pytest.raises(ValueError, match="already expected"):
        link.receiver.expect(rdv, reserve(link.pool, 5), 5, time.monotonic() + 1)


def test_send_rejects_bad_arguments(make_link):
    link = make_link(make_pool(page_size=3))
    rdv = Rendezvous("x", 1)
    with pytest.raises(ValueError, match="layers, tokens, width"):
        link.sender.send_chunk(rdv, 0, 0, torch.zeros(4, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out of range"):
        link.sender.send_chunk(rdv, -1, 0, random_rows(2, seed=1))
    with pytest.raises(ValueError, match="cannot travel"):
        link.sender.send_chunk(rdv, 0, 0, torch.zeros(1, 1, 24, dtype=torch.int64))
    with pytest.raises(ValueError, match="request id"):
        link.sender.send_done(Rendezvous("", 1), 4, 1)


@pytest.mark.parametrize(
    "field,value",
    [("row_width", 512), ("dtype", "float16"), ("num_layers", 61), ("model.kv_lora_rank", 512)],
)
@pytest.mark.parametrize("kind", ["inproc", "zmq"])
def test_handshake_mismatch_is_a_clear_error(kind, field, value):
    from kvtransfer import InprocReceiver, ZmqReceiver

    receiver = (InprocReceiver if kind == "inproc" else ZmqReceiver)(
        make_pool(page_size=3), fingerprint()
    )
    sender = InprocSender() if kind == "inproc" else ZmqSender()
    try:
        with pytest.raises(KVTransferError, match=f"field '{field}' differs") as err:
            sender.connect(receiver.endpoint, fingerprint(**{field: value}), TIMEOUT)
        assert receiver.endpoint in str(err.value)
        with pytest.raises(KVTransferError, match="not connected"):
            sender.send_done(Rendezvous("r", 1), 1, 1)
    finally:
        sender.close()
        receiver.close()
