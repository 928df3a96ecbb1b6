"""Wire format: round trips, and every kind of bad header rejected with a one-line WireError."""

import random

import msgpack
import pytest
import torch
import xxhash

from kvtransfer.wire import (
    PROTOCOL_VERSION,
    Hello,
    HelloAck,
    KVAbort,
    KVCancel,
    KVChunk,
    KVDone,
    Rendezvous,
    WireError,
    build_chunk,
    decode,
    encode,
    fingerprint_mismatch,
    header_checksum,
    make_fingerprint,
    payload_rows,
)

RDV = Rendezvous("req-7", (1 << 64) - 1)


def _chunk_head(**overrides):
    head = {
        "v": PROTOCOL_VERSION, "kind": "kv_chunk", "rid": "req-7", "room": 5, "seq": 0,
        "l0": 0, "l1": 2, "t0": 3, "t1": 7, "dtype": "bfloat16", "w": 8, "len": 2 * 4 * 8 * 2,
        "crc": 0,
    }  # fmt: skip
    head.update(overrides)
    head = {k: v for k, v in head.items() if v is not ...}
    return head if "hcrc" in overrides else _sealed(head)


def _cancel_head(**fields):
    return {
        "v": PROTOCOL_VERSION,
        "kind": "kv_cancel",
        "rid": "r",
        "room": 1,
        "reason": "",
        **fields,
    }


def _sealed(head):
    """`head` with the header checksum of its fields (what `encode` adds)."""
    return {**head, "hcrc": header_checksum(head)}


@pytest.mark.parametrize(
    "msg",
    [
        Hello("prefill-0", {"model.x": 1, "dtype": "bfloat16", "f": 0.5, "b": True, "n": None}),
        HelloAck(False, {"row_width": 576}, "fingerprint field 'row_width' differs"),
        KVChunk(RDV, 3, 0, 27, 256, 512, "bfloat16", 576, 27 * 256 * 576 * 2, 0xDEADBEEF),
        KVDone(RDV, 9, 2048, 151_000),
        KVDone(RDV, 9, 2048, 151_000, (0, 7, 151_000)),
        KVDone(RDV, 9, 2048, 151_000, (), (42, 7)),  # MTP: P's drafts
        KVAbort(RDV, 2, "client went away"),
        KVCancel(RDV, "aborted: the client went away"),
        KVCancel(RDV, ""),
    ],
)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_build_chunk_matches_rows():
    rows = torch.randn(3, 5, 8).to(torch.bfloat16)
    chunk, payload = build_chunk(RDV, 4, 1, 10, rows[:, :, :])
    assert (chunk.layer_start, chunk.layer_end, chunk.token_start, chunk.token_end) == (
        1,
        4,
        10,
        15,
    )
    assert chunk.payload_len == rows.numel() * 2 == len(payload)
    assert chunk.checksum == xxhash.xxh3_64_intdigest(rows.view(torch.uint8).numpy().tobytes())
    assert decode(encode(chunk)) == chunk
    assert torch.equal(payload_rows(chunk, bytes(payload)), rows)  # read-only buffers work too


def test_build_chunk_of_non_contiguous_rows():
    full = torch.randn(4, 6, 8)
    chunk, payload = build_chunk(RDV, 0, 0, 2, full[1:3, 2:5])
    assert torch.equal(payload_rows(chunk, payload), full[1:3, 2:5])


BAD_HEADERS = {
    "not msgpack": b"\xc1\xc1garbage",
    "not a map": msgpack.packb([1, 2, 3]),
    "empty": b"",
    "too big": msgpack.packb(
        {"v": PROTOCOL_VERSION, "kind": "hello", "sender": "x" * 70000, "fp": {}}
    ),
    "unknown kind": msgpack.packb(_chunk_head(kind="kv_teleport")),
    "missing field": msgpack.packb(_chunk_head(crc=...)),
    "extra field": msgpack.packb(_chunk_head(extra=1)),
    "bool as int": msgpack.packb(_chunk_head(seq=True)),
    "str as int": msgpack.packb(_chunk_head(l0="0")),
    "negative token": msgpack.packb(_chunk_head(t0=-1)),
    "negative room": msgpack.packb(_chunk_head(room=-5)),
    "empty layer range": msgpack.packb(_chunk_head(l0=2, l1=2, len=0)),
    "reversed tokens": msgpack.packb(_chunk_head(t0=7, t1=3)),
    "unknown dtype": msgpack.packb(_chunk_head(dtype="complex64")),
    "dtype a list": msgpack.packb(_chunk_head(dtype=["bfloat16"])),
    "kind a list": msgpack.packb(_chunk_head(kind=["kv_chunk"])),
    "zero width": msgpack.packb(_chunk_head(w=0, len=0)),
    "length not the shape": msgpack.packb(_chunk_head(len=129)),
    "header checksum": msgpack.packb(_chunk_head(hcrc=12345)),
    "checksum not an int": msgpack.packb(_chunk_head(hcrc="12345")),
    "empty request id": msgpack.packb(_chunk_head(rid="")),
    "bytes request id": msgpack.packb(_chunk_head(rid=b"req"), use_bin_type=True),
    "token id too big": msgpack.packb(
        _sealed(
            {
                "v": PROTOCOL_VERSION,
                "kind": "kv_done",
                "rid": "r",
                "room": 1,
                "seq": 0,
                "num_tokens": 4,
                "first_token": 1 << 40,
                "fork": [],
                "draft": [],
            }
        )
    ),
    "zero tokens done": msgpack.packb(
        _sealed(
            {
                "v": PROTOCOL_VERSION,
                "kind": "kv_done",
                "rid": "r",
                "room": 1,
                "seq": 0,
                "num_tokens": 0,
                "first_token": 1,
                "fork": [],
                "draft": [],
            }
        )
    ),
    **{
        f"fork {name}": msgpack.packb(
            _sealed(
                {
                    "v": PROTOCOL_VERSION,
                    "kind": "kv_done",
                    "rid": "r",
                    "room": 1,
                    "seq": 0,
                    "num_tokens": 4,
                    "first_token": 1,
                    "fork": fork,
                    "draft": [],
                }
            )
        )
        for name, fork in [
            ("not a list", 5),
            ("a string id", [1, "2"]),
            ("a bool id", [True]),
            ("id too big", [1 << 40]),
            ("negative id", [-1]),
            ("too long", [1] * 65),
        ]
    },
    **{
        f"draft {name}": msgpack.packb(
            _sealed(
                {
                    "v": PROTOCOL_VERSION,
                    "kind": "kv_done",
                    "rid": "r",
                    "room": 1,
                    "seq": 0,
                    "num_tokens": 4,
                    "first_token": 1,
                    "fork": [],
                    "draft": draft,
                }
            )
        )
        for name, draft in [
            ("not a list", 5),
            ("a string id", ["2"]),
            ("negative id", [-1]),
            ("too long", [1] * 17),
        ]
    },
    "kv_done without draft": msgpack.packb(
        _sealed(
            {
                "v": PROTOCOL_VERSION,
                "kind": "kv_done",
                "rid": "r",
                "room": 1,
                "seq": 0,
                "num_tokens": 4,
                "first_token": 1,
                "fork": [],
            }
        )
    ),
    "cancel with a seq": msgpack.packb(_sealed(_cancel_head(seq=0))),
    "cancel without hcrc": msgpack.packb(_cancel_head()),
    "cancel reason too long": msgpack.packb(_sealed(_cancel_head(reason="x" * 1025))),
    "fingerprint not a map": msgpack.packb(
        {"v": PROTOCOL_VERSION, "kind": "hello", "sender": "p", "fp": [1]}
    ),
    "fingerprint nested": msgpack.packb(
        {"v": PROTOCOL_VERSION, "kind": "hello", "sender": "p", "fp": {"a": {"b": 1}}}
    ),
}


@pytest.mark.parametrize("name", list(BAD_HEADERS))
def test_bad_header_rejected(name):
    with pytest.raises(WireError) as err:
        decode(BAD_HEADERS[name])
    assert "\n" not in str(err.value)


def test_other_protocol_version_named():
    other = PROTOCOL_VERSION + 1
    with pytest.raises(WireError, match=f"^protocol version {other}"):
        decode(msgpack.packb(_chunk_head(v=other)))


PER_REQUEST = [
    KVChunk(RDV, 3, 0, 27, 256, 512, "bfloat16", 576, 27 * 256 * 576 * 2, 0xDEADBEEF),
    KVDone(RDV, 9, 2048, 151_000, (3, 151_000)),
    KVAbort(RDV, 2, "client went away"),
    KVCancel(RDV, "KV transfer timed out"),
]


@pytest.mark.parametrize("msg", PER_REQUEST, ids=["chunk", "done", "abort", "cancel"])
def test_every_flipped_header_byte_is_caught(msg):
    """The payload checksum does not cover the header: without `hcrc`, a flipped byte in
    kv_done's first token (or seq, or room) decoded as another valid message. Now a flip is
    rejected, or gives back the very same message (an unsigned int's tag read as signed)."""
    frame = encode(msg)
    num_rejected = 0
    for pos in range(len(frame)):
        for mask in range(1, 256):
            damaged = bytearray(frame)
            damaged[pos] ^= mask
            try:
                assert decode(bytes(damaged)) == msg
            except WireError:
                num_rejected += 1
    assert num_rejected > 0.99 * len(frame) * 255


def test_header_checksum_ignores_key_order():
    head = msgpack.unpackb(encode(PER_REQUEST[1]))
    reordered = dict(reversed(list(head.items())))
    assert decode(msgpack.packb(reordered)) == PER_REQUEST[1]


def test_valid_hand_made_chunk_header():
    assert decode(msgpack.packb(_chunk_head())).num_tokens == 4


def test_fingerprint_mismatch_names_the_field():
    a = make_fingerprint({"model_type": "deepseek_v2"}, 27, 576, torch.bfloat16)
    assert fingerprint_mismatch(a, dict(a)) is None
    b = make_fingerprint({"model_type": "deepseek_v2"}, 27, 576, torch.float16)
    assert "'dtype'" in fingerprint_mismatch(a, b)
    c = make_fingerprint({"model_type": "deepseek_v3"}, 27, 576, torch.bfloat16)
    assert "'model.model_type'" in fingerprint_mismatch(a, c)
    d = dict(a, extra=1)
    assert "'extra'" in fingerprint_mismatch(a, d)


def _mutations(rng: random.Random, frame: bytes):
    """Random byte flips, cuts and splices of a valid header, plus values of odd types."""
    data = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(3)
        if op == 0 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif op == 1 and data:
            del data[rng.randrange(len(data)) :]
        else:
            data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
    return bytes(data)


ODD_VALUES = [None, True, -1, 1 << 63, 1.5, "", "x" * 300, b"\0", [1], {"a": 1}, [[[]]]]


def test_random_corruption_raises_only_wire_error():
    rng = random.Random(1234)
    valid = [
        encode(KVChunk(RDV, 3, 0, 27, 256, 512, "bfloat16", 576, 27 * 256 * 576 * 2, 1)),
        encode(KVDone(RDV, 9, 2048, 7)),
        encode(Hello("p", {"a": 1})),
    ]
    outcomes = {"ok": 0, "rejected": 0}
    for i in range(3000):
        frame = _mutations(rng, valid[i % len(valid)])
        if i % 3 == 0:  # a well-formed map with one field of an odd type
            head = msgpack.unpackb(valid[i % len(valid)])
            head[rng.choice(sorted(head))] = rng.choice(ODD_VALUES)
            frame = msgpack.packb(head, use_bin_type=True)
        try:
            msg = decode(frame)
        except WireError:
            outcomes["rejected"] += 1
        else:
            assert decode(encode(msg)) == msg  # whatever passes is a fully valid message
            outcomes["ok"] += 1
    assert outcomes["rejected"] > 2000
