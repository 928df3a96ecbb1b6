"""Sealed KV transfers (kvtransfer.sealing: AES-256-GCM per message, a key per transfer), over both
transports: a sealed transfer lands bit for bit; a frame sealed with another key, a tampered
header or payload, a message moved to another position, an unsealed message, a replay and a
stranger's frames are each dropped as unauthenticated (or as a duplicate) and never written; the
transfer of the rightful sender still completes beside them. The oracle is the sent rows and the
AESGCM reference of the `cryptography` package."""

import pytest
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from kv_helpers import (
    NUM_LAYERS,
    TIMEOUT,
    chunk_frames,
    done_frames,
    make_pool,
    random_rows,
    reserve,
)

from kvtransfer import Rendezvous
from kvtransfer.faults import KVFaultPlan, inject
from kvtransfer.interface import DropReason
from kvtransfer.sealing import KEY_BYTES, TAG_BYTES, SealError, new_key, open_sealed, seal
from kvtransfer.sender_core import ChunkItem, SealedItem, frames_of

PROMPT = 40


def _expect(link, rdv, key, num_tokens=PROMPT):
    table = reserve(link.pool, num_tokens)
    link.receiver.expect(rdv, table, num_tokens, float("inf"), key)
    return table


def _send_all(sender, rdv, rows, key, chunk=16):
    for start in range(0, rows.shape[1], chunk):
        sender.send_chunk(rdv, 0, start, rows[:, start : start + chunk].clone(), key)
    sender.send_done(rdv, rows.shape[1], 7, key=key)


def _event(link):
    events = link.receiver.poll(TIMEOUT)
    assert len(events) == 1, events
    return events[0]


def _sealed(frames, key, seq):
    header, *payload = frames
    return [header, bytes(seal(key, seq, header, payload[0] if payload else None))]


def test_seal_matches_aesgcm_and_refuses_every_change():
    key, header, payload = new_key(), b"header bytes", bytes(range(256)) * 3
    assert len(key) == KEY_BYTES and new_key() != key
    sealed = bytes(seal(key, 5, header, payload))
    assert sealed == AESGCM(key).encrypt((5).to_bytes(12, "little"), payload, header)
    assert len(sealed) == len(payload) + TAG_BYTES
    assert open_sealed(key, 5, header, sealed) == payload
    assert open_sealed(key, 0, header, seal(key, 0, header)) == b""  # kv_done: the tag alone
    reused = bytearray(len(payload) + 100)  # a receiver thread's buffer: opened in its front
    assert open_sealed(key, 5, header, sealed, reused) == payload
    flipped = bytearray(sealed)
    flipped[17] ^= 1
    for bad_key, seq, bad_header, frame in [
        (new_key(), 5, header, sealed),  # another key
        (key, 6, header, sealed),  # another position in the stream
        (key, 5, b"header bytez", sealed),  # a tampered header
        (key, 5, header, bytes(flipped)),  # a tampered payload
        (key, 5, header, sealed[:-1]),  # a cut tag
        (key, 5, header, b"short"),
    ]:
        with pytest.raises(SealError):
            open_sealed(bad_key, seq, bad_header, frame)


def test_sealed_transfer_lands_bit_for_bit(make_link):
    link = make_link(make_pool(page_size=3))
    rdv, key = Rendezvous("sealed", 1), new_key()
    table = _expect(link, rdv, key)
    rows = random_rows(PROMPT, seed=1)
    _send_all(link.sender, rdv, rows, key)
    event = _event(link)
    assert event.is_ready and event.first_token == 7
    assert torch.equal(link.pool.read_rows(table, 0, NUM_LAYERS, 0, PROMPT), rows)
    assert not link.dropped()


def test_what_does_not_open_is_dropped_and_never_written(make_link):
    """Beside the rightful transfer, every kind of unauthenticated frame for the same rendezvous
    arrives first; none is written (the rows stay the sender's) and the transfer completes."""
    link = make_link(make_pool(page_size=4))
    rdv, key = Rendezvous("attacked", 2), new_key()
    table = _expect(link, rdv, key)
    rows, junk = random_rows(PROMPT, seed=2), random_rows(PROMPT, seed=3)
    plain = chunk_frames(rdv, 0, 0, junk[:, :16])
    sealed_right = _sealed(plain, key, 0)
    tampered = [sealed_right[0], bytes(b ^ 0xFF for b in sealed_right[1][:8]) + sealed_right[1][8:]]
    attacks = [
        plain,  # not sealed at all
        _sealed(plain, new_key(), 0),  # a stranger's key
        _sealed(plain, key, 1),  # sealed as another position (frames moved)
        tampered,
        [sealed_right[0]],  # the seal frame missing
        _sealed(done_frames(rdv, 0, PROMPT, 9), new_key(), 0),  # a forged kv_done
    ]
    for frames in attacks:
        link.raw_send(frames)
    assert link.dropped() == {DropReason.UNAUTHENTICATED: len(attacks)}
    assert link.receiver.poll(0.0) == []  # no forged kv_done finished it
    _send_all(link.sender, rdv, rows, key)
    event = _event(link)
    assert event.is_ready and event.first_token == 7
    assert torch.equal(link.pool.read_rows(table, 0, NUM_LAYERS, 0, PROMPT), rows)


def test_a_replayed_sealed_message_is_a_duplicate(make_link):
    link = make_link(make_pool(page_size=4))
    rdv, key = Rendezvous("replayed", 3), new_key()
    _expect(link, rdv, key)
    rows = random_rows(PROMPT, seed=4)
    first = frames_of(SealedItem(ChunkItem(rdv, 0, 0, 0, rows[:, :16].clone()), key))
    link.raw_send(first)
    link.raw_send(first)  # the same sealed frames again: it opens, and is refused as seen
    assert link.dropped() == {DropReason.DUPLICATE: 1}


def test_unsealed_rendezvous_beside_sealed_ones_still_work(make_link):
    """A receiver may hold sealed and unsealed expectations at once (a key is per transfer);
    an unsealed one takes unsealed frames as before."""
    link = make_link(make_pool(page_size=4))
    plain_rdv, sealed_rdv, key = Rendezvous("plain", 4), Rendezvous("sealed", 5), new_key()
    _expect(link, plain_rdv, None)
    _expect(link, sealed_rdv, key)
    rows = random_rows(PROMPT, seed=5)
    _send_all(link.sender, plain_rdv, rows, None)
    _send_all(link.sender, sealed_rdv, rows, key)
    events = []
    while len(events) < 2:
        events += link.receiver.poll(TIMEOUT)
    assert all(e.is_ready for e in events) and not link.dropped()


def test_corrupted_in_flight_fails_authentication(make_link):
    """The fault injector flips a byte of each sealed chunk on the wire: each is dropped as
    unauthenticated, and kv_done then finds the rows missing."""
    link = make_link(make_pool(page_size=4))
    rdv, key = Rendezvous("corrupt", 6), new_key()
    _expect(link, rdv, key)
    inject(link.sender, KVFaultPlan(rates={("chunk", "corrupt"): 1.0}, seed=1))
    _send_all(link.sender, rdv, random_rows(PROMPT, seed=6), key)
    event = _event(link)
    assert not event.is_ready and "unauthenticated" in event.reason
    assert link.dropped()[DropReason.UNAUTHENTICATED] == 3


def test_bad_keys_are_refused(make_link):
    link = make_link(make_pool(page_size=4))
    rdv = Rendezvous("badkey", 7)
    with pytest.raises(ValueError, match="32 bytes"):
        link.receiver.expect(rdv, reserve(link.pool, 8), 8, float("inf"), b"short")
    with pytest.raises(ValueError, match="32 bytes"):
        link.sender.send_chunk(rdv, 0, 0, random_rows(8, seed=7), b"x" * 31)
