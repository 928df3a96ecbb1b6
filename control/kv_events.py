"""KV events: the names of cached pages, shared by the nodes that cache them and the router.

A cached page is named by a hash chained over the prompt up to and including it: page i of a
token sequence is `H(name of page i-1 || its page_size token ids)`, so one name stands for the
whole prefix that ends with that page and two nodes (or a node and the router) name the same
prefix alike without comparing tokens. blake2b with a 16-byte digest: a collision would only
misroute a request (the node matches by tokens, never by name), and 2^-64 is far below that.

Nodes send `KVEvents` (control.protocol) as their caches change: the names of the pages stored
and removed, in the order they happened, on the same socket as their other messages; the router
keeps an exact per-node index of them (`router.kv_index`).
"""

from __future__ import annotations

import hashlib
import struct

DIGEST_BYTES = 16
MAX_EVENT_HASHES = 4096  # names in one KVEvents message at most (a bounded frame)


def page_hashes(token_ids: list[int] | tuple[int, ...], page_size: int) -> list[bytes]:
    """The chained names of the whole pages of `token_ids` (a short tail page has none)."""
    if page_size <= 0:
        raise ValueError("page_size must be positive")
    names, parent = [], b""
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = struct.pack(f"<{page_size}q", *token_ids[start : start + page_size])
        parent = hashlib.blake2b(parent + page, digest_size=DIGEST_BYTES).digest()
        names.append(parent)
    return names


def batches(names: list[bytes]) -> list[list[bytes]]:
    """`names` cut into message-sized lists, in order (none for none)."""
    return [names[i : i + MAX_EVENT_HASHES] for i in range(0, len(names), MAX_EVENT_HASHES)]
