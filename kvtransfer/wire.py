"""KV transfer wire format: typed messages, msgpack headers, strict validation.

A message is one msgpack header frame, followed (for `kv_chunk` only) by one raw payload frame.
The header is a map with a fixed key set per kind; every field is type-checked and bounded on
decode, so a peer can send anything and the receiver only ever sees a valid message or a
`WireError`. Nothing is pickled; bulk rows never go through msgpack.

Messages (prefill = P, decode = D):

    hello      P -> D  first contact: protocol version, sender name, compatibility fingerprint
    hello_ack  D -> P  ok flag, D's fingerprint, the mismatch (if any) as one line
    kv_chunk   P -> D  rows of layers [l0, l1) x tokens [t0, t1) of one request, then the payload
                       frame: [l1-l0, t1-t0, W] contiguous values of `dtype`, XXH3-checked
    kv_done    P -> D  all chunks sent: total token count and the first sampled token
    kv_abort   P -> D  the prefill gave up on the request (the reason is one line)
    kv_cancel  D -> P  the decode node gave up on the request (aborted, expired, refused KV):
                       stop computing and sending it (the reason is one line)

Each per-request message carries a sequence number (0, 1, 2, ... per rendezvous, in send order);
the receiver drops one whose number does not increase, so a replay is never applied twice. It also
carries `hcrc`, an XXH3-64 of its other header fields: the payload checksum does not cover the
header, and a flipped byte in, say, kv_done's first token would otherwise decode as a valid
message and the decode node would generate from the wrong token.
A request is named by its `Rendezvous`: the request id plus a random 64-bit room number chosen
by the router, so a late message of an earlier attempt with the same request id never matches.

`kv_cancel` is the one message that travels back on the KV connection (besides `hello_ack`). It
carries `hcrc` but no sequence number: acting on it twice is the same as once. It needs no new
protocol version: a sender that predates it never reads its socket after the handshake (zmq drops
what it does not read, past the high-water mark), and a receiver that predates it never sends it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import xxhash

from control.errors import DuetError

# 2: per-request headers carry `hcrc`; 3: kv_done carries `fork`; 4: and `draft` (MTP)
PROTOCOL_VERSION = 4

# Bounds: generous for real models, tight enough that a hostile header cannot make the receiver
# allocate or loop much.
MAX_HEADER_BYTES = 64 * 1024
MAX_ID_LEN = 256
MAX_REASON_LEN = 1024
MAX_LAYERS = 4096
MAX_TOKENS = 1 << 24
MAX_ROW_WIDTH = 1 << 16
MAX_PAYLOAD_BYTES = 1 << 32
MAX_FINGERPRINT_FIELDS = 64
MAX_TOKEN_ID = (1 << 31) - 1
MAX_FORKS = 64  # kv_done's fork tokens (n - 1 of an n > 1 request) at most
MAX_DRAFTS = 16  # kv_done's MTP draft tokens at most
U64_MAX = (1 << 64) - 1
U32_MAX = (1 << 32) - 1

# Row dtypes that may travel, by wire name; the receiver further requires its pool's dtype.
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class WireError(DuetError):
    """A frame is not a valid message (the text says which field and why, in one line)."""


class HeaderChecksumError(WireError):
    """A well-formed per-request header whose `hcrc` does not match its fields (corrupted)."""


class KVTransferError(DuetError):
    """A sender or receiver operation failed (handshake mismatch, timeout, peer gone)."""


@dataclass(frozen=True)
class Rendezvous:
    """Names one request's transfer on both nodes: request id + the router's random room."""

    request_id: str
    room: int

    def __str__(self) -> str:
        return f"{self.request_id}#{self.room:016x}"


@dataclass(frozen=True)
class Hello:
    sender: str
    fingerprint: dict[str, Any]
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class HelloAck:
    ok: bool
    fingerprint: dict[str, Any]
    error: str = ""
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class KVChunk:
    """Header of one chunk; the payload frame holds [layer_end-layer_start, token_end-token_start,
    row_width] values of `dtype`, C-contiguous, `payload_len` bytes, XXH3-64 `checksum`."""

    rendezvous: Rendezvous
    seq: int
    layer_start: int
    layer_end: int
    token_start: int
    token_end: int
    dtype: str
    row_width: int
    payload_len: int
    checksum: int
    version: int = PROTOCOL_VERSION

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class KVDone:
    rendezvous: Rendezvous
    seq: int
    num_tokens: int
    first_token: int
    # n > 1: the first tokens of the sequences forked from this KV (sequences 1 .. n-1).
    fork_tokens: tuple[int, ...] = ()
    # MTP: the draft P's MTP layer made of the token after first_token (empty without MTP).
    draft_tokens: tuple[int, ...] = ()
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class KVAbort:
    rendezvous: Rendezvous
    seq: int
    reason: str
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class KVCancel:
    """D -> P: the decode node no longer wants this rendezvous's KV (see `KVSender.poll_cancels`)."""

    rendezvous: Rendezvous
    reason: str
    version: int = PROTOCOL_VERSION


Message = Hello | HelloAck | KVChunk | KVDone | KVAbort | KVCancel


# ---- fingerprints -------------------------------------------------------------------------


def make_fingerprint(
    model_fingerprint: dict[str, Any], num_layers: int, row_width: int, dtype: torch.dtype
) -> dict[str, Any]:
    """The dict two nodes must agree on: the model's fingerprint (`ModelConfig.fingerprint()`)
    plus the KV layout (layers, row width, dtype). Page size is deliberately absent: rows are
    token-addressed, so the two pools may page differently."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"KV dtype {dtype} cannot travel (supported: {', '.join(DTYPES)})")
    fp = {f"model.{k}": v for k, v in model_fingerprint.items()}
    fp.update(num_layers=num_layers, row_width=row_width, dtype=DTYPE_NAMES[dtype])
    _check_fingerprint(fp)
    return fp


def fingerprint_mismatch(local: dict[str, Any], remote: dict[str, Any]) -> str | None:
    """One line naming the first field that differs (local first), or None if they agree."""
    for key in sorted(set(local) | set(remote)):
        a, b = local.get(key, "<missing>"), remote.get(key, "<missing>")
        if a != b or type(a) is not type(b):
            return f"fingerprint field '{key}' differs (here {a!r}, peer {b!r})"
    return None


def _check_fingerprint(fp: Any) -> dict[str, Any]:
    if not isinstance(fp, dict) or len(fp) > MAX_FINGERPRINT_FIELDS:
        raise WireError(f"fingerprint must be a map of at most {MAX_FINGERPRINT_FIELDS} fields")
    for key, value in fp.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_ID_LEN:
            raise WireError(f"fingerprint key {key!r} must be a short string")
        if value is not None and not isinstance(value, (str, int, float, bool)):
            raise WireError(
                f"fingerprint field '{key}' must be a scalar, got {type(value).__name__}"
            )
        if isinstance(value, str) and len(value) > MAX_ID_LEN:
            raise WireError(f"fingerprint field '{key}' is too long")
    return fp


# ---- payload helpers ----------------------------------------------------------------------


def checksum(payload: Any) -> int:
    """64-bit XXH3 of a bytes-like payload: ~40 GB/s on one core, so verifying a chunk costs a
    small fraction of moving it (crc32 ran at ~2 GB/s and capped the transfer rate)."""
    return xxhash.xxh3_64_intdigest(payload)


def rows_payload(rows: torch.Tensor) -> Any:
    """A zero-copy byte view of `rows` [L, T, W] as a flat uint8 numpy array (CPU, contiguous:
    a copy is made only when the tensor is not already so). The array keeps the tensor alive."""
    rows = rows.detach()
    if rows.device.type != "cpu":
        rows = rows.cpu()
    return rows.contiguous().view(torch.uint8).reshape(-1).numpy()


def expected_payload_len(num_layers: int, num_tokens: int, row_width: int, dtype: str) -> int:
    return num_layers * num_tokens * row_width * DTYPES[dtype].itemsize


def payload_rows(chunk: KVChunk, payload: Any) -> torch.Tensor:
    """View a validated payload (writable buffer) as rows [L, T, W] without copying."""
    if memoryview(payload).readonly:  # torch wants a writable buffer; only odd callers copy
        payload = bytearray(payload)
    flat = torch.frombuffer(payload, dtype=torch.uint8)
    return flat.view(chunk.torch_dtype).view(chunk.num_layers, chunk.num_tokens, chunk.row_width)


def build_chunk(
    rendezvous: Rendezvous,
    seq: int,
    layer_start: int,
    token_start: int,
    rows: torch.Tensor,
    with_checksum: bool = True,
) -> tuple[KVChunk, Any]:
    """Header + payload for `rows` [L, T, W] at layers layer_start.. and tokens token_start..
    Costs one pass over the rows (the checksum), plus a copy if `rows` is not contiguous CPU.
    Without `with_checksum` the header's checksum is 0: a sealed chunk (kvtransfer.sealing),
    whose tag already covers every byte, skips the pass."""
    if rows.dim() != 3 or 0 in rows.shape:
        raise ValueError(
            f"rows must be a non-empty [layers, tokens, width] tensor, got {tuple(rows.shape)}"
        )
    if rows.dtype not in DTYPE_NAMES:
        raise ValueError(f"KV dtype {rows.dtype} cannot travel (supported: {', '.join(DTYPES)})")
    num_layers, num_tokens, width = rows.shape
    payload = rows_payload(rows)
    chunk = KVChunk(
        rendezvous,
        seq,
        layer_start,
        layer_start + num_layers,
        token_start,
        token_start + num_tokens,
        DTYPE_NAMES[rows.dtype],
        width,
        payload.nbytes,
        checksum(payload) if with_checksum else 0,
    )
    return chunk, payload


# ---- encode -------------------------------------------------------------------------------


def encode(msg: Message) -> bytes:
    """The msgpack header frame of `msg`."""
    head: dict[str, Any] = {"v": msg.version}
    if isinstance(msg, Hello):
        head.update(kind="hello", sender=msg.sender, fp=msg.fingerprint)
    elif isinstance(msg, HelloAck):
        head.update(kind="hello_ack", ok=msg.ok, fp=msg.fingerprint, error=msg.error)
    elif isinstance(msg, KVChunk):
        head.update(
            kind="kv_chunk",
            **_rdv(msg.rendezvous),
            seq=msg.seq,
            l0=msg.layer_start,
            l1=msg.layer_end,
            t0=msg.token_start,
            t1=msg.token_end,
            dtype=msg.dtype,
            w=msg.row_width,
            len=msg.payload_len,
            crc=msg.checksum,
        )
    elif isinstance(msg, KVDone):
        head.update(
            kind="kv_done",
            **_rdv(msg.rendezvous),
            seq=msg.seq,
            num_tokens=msg.num_tokens,
            first_token=msg.first_token,
            fork=list(msg.fork_tokens),
            draft=list(msg.draft_tokens),
        )
    elif isinstance(msg, KVAbort):
        head.update(kind="kv_abort", **_rdv(msg.rendezvous), seq=msg.seq, reason=msg.reason)
    elif isinstance(msg, KVCancel):
        head.update(kind="kv_cancel", **_rdv(msg.rendezvous), reason=msg.reason)
    else:
        raise TypeError(f"not a KV transfer message: {type(msg).__name__}")
    if "rid" in head:
        head["hcrc"] = header_checksum(head)
    return msgpack.packb(head, use_bin_type=True)


def _rdv(r: Rendezvous) -> dict[str, Any]:
    return {"rid": r.request_id, "room": r.room}


def header_checksum(head: dict[str, Any]) -> int:
    """XXH3-64 of a per-request header's fields other than `hcrc`, in key order (the values are
    ints and strings, whose msgpack encoding is canonical, so both ends compute the same)."""
    values = [head[k] for k in sorted(head) if k != "hcrc"]
    return xxhash.xxh3_64_intdigest(msgpack.packb(values, use_bin_type=True))


# ---- decode -------------------------------------------------------------------------------

_RDV_KEYS = {"v", "kind", "rid", "room", "seq", "hcrc"}
_KEYS = {
    "hello": {"v", "kind", "sender", "fp"},
    "hello_ack": {"v", "kind", "ok", "fp", "error"},
    "kv_chunk": _RDV_KEYS | {"l0", "l1", "t0", "t1", "dtype", "w", "len", "crc"},
    "kv_done": _RDV_KEYS | {"num_tokens", "first_token", "fork", "draft"},
    "kv_abort": _RDV_KEYS | {"reason"},
    "kv_cancel": (_RDV_KEYS - {"seq"}) | {"reason"},
}


def decode(frame: Any) -> Message:
    """Parse and validate one header frame (bytes-like). Raises WireError naming the bad field;
    a header of another protocol version raises WireError starting with 'protocol version', and
    a valid-looking per-request header whose fields do not match its `hcrc` HeaderChecksumError."""
    if len(frame) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        head = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_bin_len=0,
            max_ext_len=0,
            max_str_len=MAX_HEADER_BYTES,
            max_array_len=1024,
            max_map_len=1024,
        )
    except Exception as exc:  # any msgpack/unicode failure means the same thing: not a header
        raise WireError(f"header is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(head, dict):
        raise WireError("header must be a msgpack map")
    version = _int(head, "v", 0, U32_MAX)
    if version != PROTOCOL_VERSION:
        raise WireError(f"protocol version {version} (expected {PROTOCOL_VERSION})")
    kind = head.get("kind")
    if not isinstance(kind, str) or kind not in _KEYS:
        raise WireError(f"unknown message kind {kind!r}")
    if set(head) != _KEYS[kind]:
        extra, missing = set(head) - _KEYS[kind], _KEYS[kind] - set(head)
        raise WireError(f"{kind}: missing fields {sorted(missing)}, unknown {sorted(extra)}")
    if kind == "hello":
        return Hello(sender=_str(head, "sender", MAX_ID_LEN), fingerprint=_fp(head))
    if kind == "hello_ack":
        return HelloAck(
            ok=_bool(head, "ok"),
            fingerprint=_fp(head),
            error=_str(head, "error", MAX_REASON_LEN, 0),
        )
    rdv = Rendezvous(_str(head, "rid", MAX_ID_LEN), _int(head, "room", 0, U64_MAX))
    hcrc = _int(head, "hcrc", 0, U64_MAX)
    seq = _int(head, "seq", 0, U64_MAX) if "seq" in head else 0
    msg: Message
    if kind == "kv_cancel":
        msg = KVCancel(rdv, _str(head, "reason", MAX_REASON_LEN, 0))
    elif kind == "kv_done":
        msg = KVDone(
            rdv,
            seq,
            _int(head, "num_tokens", 1, MAX_TOKENS),
            _int(head, "first_token", 0, MAX_TOKEN_ID),
            _token_list(head, "fork", MAX_FORKS),
            _token_list(head, "draft", MAX_DRAFTS),
        )
    elif kind == "kv_abort":
        msg = KVAbort(rdv, seq, _str(head, "reason", MAX_REASON_LEN, 0))
    else:
        msg = _decode_chunk(head, rdv, seq)
    if hcrc != header_checksum(head):  # last: every field is known to be an int or a string
        raise HeaderChecksumError(f"{kind}: header checksum mismatch (corrupted header)")
    return msg


def _decode_chunk(head: dict[str, Any], rdv: Rendezvous, seq: int) -> KVChunk:
    l0, l1 = _int(head, "l0", 0, MAX_LAYERS - 1), _int(head, "l1", 1, MAX_LAYERS)
    t0, t1 = _int(head, "t0", 0, MAX_TOKENS - 1), _int(head, "t1", 1, MAX_TOKENS)
    if l0 >= l1:
        raise WireError(f"kv_chunk: empty layer range [{l0}, {l1})")
    if t0 >= t1:
        raise WireError(f"kv_chunk: empty token range [{t0}, {t1})")
    dtype = head["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise WireError(f"kv_chunk: unknown dtype {dtype!r}")
    width = _int(head, "w", 1, MAX_ROW_WIDTH)
    length = _int(head, "len", 0, MAX_PAYLOAD_BYTES)
    if length != expected_payload_len(l1 - l0, t1 - t0, width, dtype):
        raise WireError(f"kv_chunk: payload length {length} does not match the row shape")
    crc = _int(head, "crc", 0, U64_MAX)
    return KVChunk(rdv, seq, l0, l1, t0, t1, dtype, width, length, crc)


def peek_kind(frame: Any) -> str | None:
    """The `kind` of a header whatever its version (None if unreadable): lets a receiver answer
    a `hello` of another protocol version with a refusal instead of silence."""
    if len(frame) > MAX_HEADER_BYTES:
        return None
    try:
        head = msgpack.unpackb(frame, raw=False, max_bin_len=0, max_ext_len=0)
    except Exception:  # unreadable is the answer, not an error
        return None
    kind = head.get("kind") if isinstance(head, dict) else None
    return kind if isinstance(kind, str) else None


def _token_list(head: dict[str, Any], key: str, max_len: int) -> tuple[int, ...]:
    tokens = head[key]
    if not isinstance(tokens, list) or len(tokens) > max_len:
        raise WireError(f"kv_done: '{key}' must be a list of at most {max_len} token ids")
    if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in tokens):
        raise WireError(f"kv_done: '{key}' holds something other than token ids")
    return tuple(tokens)


def _int(head: dict[str, Any], key: str, lo: int, hi: int) -> int:
    value = head.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise WireError(f"field '{key}' must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _str(head: dict[str, Any], key: str, max_len: int, min_len: int = 1) -> str:
    value = head.get(key)
    if not isinstance(value, str) or not min_len <= len(value) <= max_len:
        raise WireError(f"field '{key}' must be a string of {min_len}..{max_len} characters")
    return value


def _bool(head: dict[str, Any], key: str) -> bool:
    value = head.get(key)
    if not isinstance(value, bool):
        raise WireError(f"field '{key}' must be a boolean")
    return value


def _fp(head: dict[str, Any]) -> dict[str, Any]:
    return _check_fingerprint(head.get("fp"))
