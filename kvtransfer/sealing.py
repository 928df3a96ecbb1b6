"""Sealed KV frames: AES-256-GCM on each per-request message, with a key per transfer.

With `kv_security = "aead"` (`[security]`, control.cluster_config) the KV sockets carry no CURVE:
the decode node draws a fresh 32-byte key for each reservation (`new_key`), hands it to the
router in its ReserveReply over its CURVE control channel, and the router hands it to the prefill
node in the Prefill message over that node's CURVE channel. The prefill node seals every message
of that rendezvous with it and the receiver opens them with it, so the bulk rows are encrypted and
authenticated by AES-NI at gigabytes a second instead of by CURVE's per-message crypto_box.

A message's frames: [header, sealed], where `sealed` is the payload's ciphertext followed by the
16-byte tag for a `kv_chunk`, the tag alone for a `kv_done` / `kv_abort`. The header is the
associated data: authenticated, not encrypted (the receiver reads it to find the key). The nonce
is the message's sequence number (unique per rendezvous, and the key is unique per rendezvous),
so no (key, nonce) pair ever repeats. A frame sealed with another key, a tampered header or
payload, or a message moved to another position of its stream (its number is in the nonce) fails
the tag and is dropped; a replayed one fails the receiver's increasing-number check. The way back
(`hello_ack`, `kv_cancel`) is not sealed: a forged cancel can only end a transfer early, which the
peer that could forge it (one on the path) could do by dropping frames anyway.
"""

from __future__ import annotations

import os
from typing import Any

import numpy
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_BYTES = 32  # AES-256
TAG_BYTES = 16


class SealError(Exception):
    """A sealed message that does not open under its rendezvous' key."""


def new_key() -> bytes:
    """A fresh transfer key (os.urandom: the kernel's CSPRNG)."""
    return os.urandom(KEY_BYTES)


def check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a KV transfer key is {KEY_BYTES} bytes")
    return key


def _nonce(seq: int) -> bytes:
    return seq.to_bytes(12, "little")


def seal(key: bytes, seq: int, header: bytes, payload: Any = None) -> Any:
    """The sealed frame of message number `seq` with this header (and payload, if any): a
    fresh uint8 array (sent zero-copy), encrypted into memory that is never zero-filled."""
    data = memoryview(b"" if payload is None else payload).cast("B")
    out = numpy.empty(len(data) + TAG_BYTES, dtype=numpy.uint8)
    AESGCM(key).encrypt_into(_nonce(seq), data, header, out)
    return out


def open_sealed(
    key: bytes, seq: int, header: Any, sealed: Any, buffer: bytearray | None = None
) -> memoryview:
    """The payload of a sealed frame (empty for a header-only message), decrypted straight into
    a writable buffer (the receiver views it as rows without another copy): the front of
    `buffer` when it is large enough (a receiver thread's, reused: no allocation and no page
    faults per chunk), else a fresh one. SealError if the frame, the header or the number is
    not what was sealed under this key."""
    if len(sealed) < TAG_BYTES:
        raise SealError("sealed frame shorter than its tag")
    size = len(sealed) - TAG_BYTES
    out = memoryview(buffer if buffer is not None and len(buffer) >= size else bytearray(size))
    out = out[:size]
    try:
        AESGCM(key).decrypt_into(_nonce(seq), sealed, header, out)
    except InvalidTag:
        raise SealError("KV frame failed authentication (wrong key, tampered or moved)") from None
    return out
