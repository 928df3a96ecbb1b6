"""Control-plane messages between the router and the prefill/decode nodes (msgpack, no pickle).

Bulk KV rows do not travel here (see `kvtransfer.wire`). Every message is a frozen dataclass;
`encode` packs it as a msgpack map with a "type" key, `decode` validates the field names and
types and raises `ProtocolError` for anything else, so a bad frame never reaches a loop.

Links (each a ZeroMQ PUSH -> PULL; the receiver binds):
  router -> decode:  Reserve, Abort, Shutdown, RouterPing
  router -> prefill: Prefill, Abort, Shutdown, RouterPing
  decode -> router:  NodeReady, NodeFailed, Heartbeat, ReserveReply, StepTokens, RequestError,
                     Preempted
  prefill -> router: NodeReady, NodeFailed, Heartbeat, FirstToken, RequestError
  prefill -> decode KV traffic goes through kvtransfer, never through the router.

Evolving the wire: every node and the router of a cluster run one package version (NodeReady's
`info["version"]`, shown by `GET /v1/cluster`). A field added with a default still decodes from
an older peer; a message type a peer does not know is a malformed frame to it (dropped, counted).
StepTokens replaced the per-request Tokens message of earlier versions.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import msgpack

from control.sampling_params import SamplingParams

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a prompt of a few million token ids at most


class ProtocolError(ValueError):
    """A frame that is not a valid control message."""


# ---- lifecycle (node -> router) ---------------------------------------------------------------


@dataclass(frozen=True)
class NodeReady:
    """A node finished loading and listens. `info` holds role-specific facts: for a decode node
    `kv_endpoint`, `num_pages`, `page_size`, `ranks`; for both `fingerprint`, `dtype`."""

    node: str
    role: str  # "prefill" | "decode"
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeFailed:
    """A node could not start or hit a fatal error; the router fails its requests at once."""

    node: str
    role: str
    error: str


@dataclass(frozen=True)
class Heartbeat:
    """Sent every heartbeat interval; a node silent for `node_timeout_s` is declared dead."""

    node: str
    role: str
    queued_tokens: int = 0  # prefill: prompt tokens waiting or in progress
    num_waiting: int = 0
    num_running: int = 0
    free_pages: int = 0  # decode
    total_pages: int = 0  # decode
    page_size: int = 0  # decode
    kv_bytes_sent: int = 0  # prefill, cumulative
    kv_bytes_received: int = 0  # decode, cumulative
    kv_chunks_dropped: int = 0  # decode, cumulative
    num_cancelled_by_decode: int = 0  # prefill, cumulative: requests stopped by D's kv_cancel
    num_malformed: int = 0  # control frames the node dropped as malformed, cumulative
    stage_ms: dict[str, float] = field(default_factory=dict)  # recent per-stage latencies
    draining: bool = False  # SIGTERMed: finishing what it holds, takes no new requests
    # On-demand decode KV: decode, cumulative: requests it preempted.
    num_preempted: int = 0
    # Prefix cache (a prefill node's, or a decode node's of finished prompts): cumulative
    # counters, then the cache's current size. On a decode node a hit's tokens are KV rows
    # it did not receive.
    num_prefix_lookups: int = 0  # prefills that looked their prompt up in the cache
    num_prefix_hits: int = 0  # of which found a cached prefix
    num_prefix_hit_tokens: int = 0  # prompt tokens served from the cache (not computed)
    num_prefix_evicted_pages: int = 0  # cached pages evicted to make room
    num_prefix_cached_pages: int = 0  # now
    num_prefix_cached_tokens: int = 0  # now (whole pages only)
    # The prefix cache's disk tier (prefill, cumulative): lookups that asked it for the pages
    # after the pool's match, of which found some, the prompt tokens loaded from it, the pages
    # this node wrote to it, and files that failed a check (deleted and computed instead).
    num_disk_lookups: int = 0
    num_disk_hits: int = 0
    num_disk_hit_tokens: int = 0
    num_disk_pages_stored: int = 0
    num_disk_corrupt: int = 0
    # KV rows: prefill, cumulative: rows sent, and rows not sent because the decode node held
    # them (Prefill.skip_rows); decode: rows received.
    kv_rows_sent: int = 0
    kv_rows_skipped: int = 0
    kv_rows_received: int = 0
    # ---- SLA admission: what the router's cost models learn from ---------
    # The node's forwards since its previous heartbeat (the newest `control.cost_model.
    # MAX_TIMING_SAMPLES`): prefill [new tokens, sum of new*prefix over its chunks, seconds],
    # decode [batch size, total context tokens, seconds].
    timing_samples: list[list[float]] = field(default_factory=list)
    queued_attention: float = 0.0  # prefill: sum of new*prefix over the chunks still to compute
    queued_forwards: int = 0  # prefill: forwards its queued work needs at least
    # prefill: per router replica (`control.router_links`), the highest Prefill.seq taken from
    # it (0 after that router changed)
    prefill_seqs: list[int] = field(default_factory=list)
    # ---- MTP speculative decoding: decode, cumulative (decode_node.speculative_step)
    mtp_drafted: int = 0  # draft tokens verified
    mtp_accepted: int = 0  # of which accepted
    mtp_emitted: int = 0  # tokens the speculating requests emitted
    mtp_request_steps: int = 0  # (speculating request, step) pairs


@dataclass(frozen=True)
class KVEvents:
    """Node -> router: one change of the node's prefix cache, by page names
    (`control.kv_events`): `cleared` (it forgot every page: the index of it starts over), then
    the pages `removed`, then those `stored`. Sent as the change happens, before the messages
    of the requests that caused it (the same socket, in order)."""

    node: str
    role: str
    page_size: int
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    cleared: bool = False


# ---- request flow ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Reserve:
    """Router -> decode: reserve pages for a prompt of `prompt_len` tokens (admission control).
    The decode node answers ReserveReply; on success it expects the KV under (request_id, room)
    until `timeout_s` from now, then fails the request (stage "transfer")."""

    request_id: str
    room: int
    prompt_len: int
    sampling: dict[str, Any]  # SamplingParams fields
    timeout_s: float
    # The prompt's ids, only when the sampling reads them (repetition_penalty); else empty.
    prompt_ids: list[int] = field(default_factory=list)
    # Preemption order (on-demand KV): the request's arrival at the router, kept across its
    # restarts; a decode node short of pages preempts the latest arrival first.
    priority: float = 0.0
    # n > 1: the wire ids of sequences 1 .. n-1, forked from this request's KV once it is in
    # (sampling["n"] - 1 of them); each then streams its tokens under its own id.
    fork_ids: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ReserveReply:
    request_id: str
    ok: bool
    kv_endpoint: str = ""
    rank: int = 0
    reason: str = ""  # why it was refused (no pages, too many requests, shutting down)
    # kv_security = "aead": the key the decode node will open this transfer's KV frames with
    # (kvtransfer.sealing), for the prefill node to seal them; b"" for a CURVE or plain link.
    kv_key: bytes = field(default=b"", repr=False)
    draining: bool = False  # refused because the node is draining: ask another, or later
    # Decode-side prefix reuse: the leading prompt rows the node already holds (whole pages of
    # its prefix cache), which the prefill node then does not send (Prefill.skip_rows).
    cached_rows: int = 0


@dataclass(frozen=True)
class Prefill:
    """Router -> prefill: run the prompt and stream its KV to `kv_endpoint` under (id, room)."""

    request_id: str
    room: int
    token_ids: list[int]
    sampling: dict[str, Any]
    kv_endpoint: str
    timeout_s: float
    # The router's count of Prefills sent to this node (1, 2, ...): the node's heartbeat says
    # the last it took (`Heartbeat.prefill_seqs`), so the router knows which dispatched
    # requests that heartbeat's queued work includes (SLA admission).
    seq: int = 0
    kv_key: bytes = field(default=b"", repr=False)  # the decode node's (ReserveReply.kv_key)
    # The leading rows the decode node holds already (ReserveReply.cached_rows): computed
    # here as any other (from this node's own cache or anew), but never sent.
    skip_rows: int = 0


@dataclass(frozen=True)
class FirstToken:
    """Prefill -> router: the token sampled after the prompt (the client's first token)."""

    request_id: str
    token: int
    prompt_len: int
    stage_ms: dict[str, float] = field(default_factory=dict)  # queue, prefill, transfer
    # Prompt tokens the node served from its prefix cache (pool or disk tier), not computed:
    # the API's usage.prompt_tokens_details.cached_tokens.
    cached_tokens: int = 0
    # Raw logprobs (`control.logprobs`), when the sampling asked: the token's own (one entry),
    # its top ids and their logprobs; with `prompt_logprobs`, the same per prompt token after
    # the first (prompt_len - 1 entries each).
    logprob: list[float] = field(default_factory=list)
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_ids: list[list[int]] = field(default_factory=list)
    prompt_top_logprobs: list[list[float]] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)  # each prompt token's rank (vLLM's)
    # n > 1: the first tokens of sequences 1 .. n-1 (Reserve.fork_ids' order), and their raw
    # logprobs when asked (one entry per fork in each).
    fork_tokens: list[int] = field(default_factory=list)
    fork_logprobs: list[float] = field(default_factory=list)
    fork_top_ids: list[list[int]] = field(default_factory=list)
    fork_top_logprobs: list[list[float]] = field(default_factory=list)


@dataclass(frozen=True)
class RequestTokens:
    """One request's output in one decode step (not a wire message: StepTokens carries it).
    `token_ids` may be several (speculative decoding accepts more than one per step) or none
    (the first token, P's, already ended it); `finish_reason` is set on its last output. The
    raw logprobs, when the sampling asked, hold one entry per token of `token_ids` each."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | None while running
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


# What one StepTokens holds at most: a step of the largest batch fits many times over, and the
# router's work for one message stays bounded (`step_tokens_messages` splits beyond them).
MAX_STEP_REQUESTS = 1 << 16
MAX_STEP_TOKENS = 1 << 20


@dataclass(frozen=True)
class StepTokens:
    """Decode -> router: the output of one decode step, every request of it in one message,
    column by column (entry i of each list is request i's, `RequestTokens` without the names).
    The logprob columns are empty when no request of the step asked for logprobs; else each
    has one entry per request, empty for the requests that did not ask."""

    request_ids: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str | None]
    logprobs: list[list[float]] = field(default_factory=list)
    top_ids: list[list[list[int]]] = field(default_factory=list)
    top_logprobs: list[list[list[float]]] = field(default_factory=list)

    def __post_init__(self) -> None:  # the columns must line up: ProtocolError, never IndexError
        num = len(self.request_ids)
        if num > MAX_STEP_REQUESTS:
            raise ProtocolError(f"StepTokens: {num} requests, more than {MAX_STEP_REQUESTS}")
        if len(self.token_ids) != num or len(self.finish_reasons) != num:
            raise ProtocolError(
                "StepTokens: request_ids, token_ids, finish_reasons differ in length"
            )
        if sum(len(ids) for ids in self.token_ids) > MAX_STEP_TOKENS:
            raise ProtocolError(f"StepTokens: more than {MAX_STEP_TOKENS} tokens")
        columns = (self.logprobs, self.top_ids, self.top_logprobs)
        if (
            any(len(column) not in (0, num) for column in columns)
            or len(set(map(len, columns))) > 1
        ):
            raise ProtocolError("StepTokens: the logprob columns must be empty or one per request")
        for ids, lps, tops, top_lps in zip(self.token_ids, *columns, strict=False):
            if len(lps) not in (0, len(ids)) or not len(lps) == len(tops) == len(top_lps):
                raise ProtocolError("StepTokens: a request's logprobs do not match its tokens")
            if any(len(a) != len(b) for a, b in zip(tops, top_lps, strict=True)):
                raise ProtocolError("StepTokens: top_ids and top_logprobs differ in length")

    @classmethod
    def of(cls, outputs: list[RequestTokens]) -> StepTokens:
        """The message of these outputs (at most MAX_STEP_REQUESTS / MAX_STEP_TOKENS)."""
        asked = any(out.logprobs for out in outputs)
        return cls(
            [out.request_id for out in outputs],
            [out.token_ids for out in outputs],
            [out.finish_reason for out in outputs],
            [out.logprobs for out in outputs] if asked else [],
            [out.top_ids for out in outputs] if asked else [],
            [out.top_logprobs for out in outputs] if asked else [],
        )

    def outputs(self) -> list[RequestTokens]:
        """One RequestTokens per request, in the message's order."""
        if not self.logprobs:
            return [
                RequestTokens(rid, ids, finish)
                for rid, ids, finish in zip(
                    self.request_ids, self.token_ids, self.finish_reasons, strict=True
                )
            ]
        return [
            RequestTokens(*entry)
            for entry in zip(
                self.request_ids,
                self.token_ids,
                self.finish_reasons,
                self.logprobs,
                self.top_ids,
                self.top_logprobs,
                strict=True,
            )
        ]


def step_tokens_messages(outputs: list[RequestTokens]) -> list[StepTokens]:
    """`outputs` in as few StepTokens as the bounds allow (one for any real batch), in order."""
    messages, start, num_tokens = [], 0, 0
    for i, out in enumerate(outputs):
        full = i - start == MAX_STEP_REQUESTS or num_tokens + len(out.token_ids) > MAX_STEP_TOKENS
        if full and i > start:  # (a single request over the token bound fails in StepTokens)
            messages.append(StepTokens.of(outputs[start:i]))
            start, num_tokens = i, 0
        num_tokens += len(out.token_ids)
    if start < len(outputs):
        messages.append(StepTokens.of(outputs[start:]))
    return messages


@dataclass(frozen=True)
class RequestError:
    """Either node -> router: the request failed at `stage` (reserve, prefill_queue, prefill,
    transfer, decode); the node has already freed everything it held for it."""

    request_id: str
    stage: str
    message: str


@dataclass(frozen=True)
class Preempted:
    """Decode -> router: the node's KV pool ran out (on-demand reservation) and it dropped this
    request, freeing its pages. Sent after every StepTokens holding its output, on the same
    socket, so the router has them all; `num_tokens` counts its output on this node (P's first
    token included). The router re-prefills the prompt plus the output and the stream goes on."""

    request_id: str
    num_tokens: int
    reason: str = ""


@dataclass(frozen=True)
class Abort:
    """Router -> nodes: drop the request and free its pages (client gone, stop string hit)."""

    request_id: str
    reason: str = ""


@dataclass(frozen=True)
class Shutdown:
    reason: str = ""


@dataclass(frozen=True)
class RouterPing:
    """Router -> nodes, every heartbeat interval: renews the node's lease on the requests of
    router replica `replica` for `lease_s` (see `control.lease`); `router_id` changes when
    the router at that place restarts."""

    router_id: str
    lease_s: float
    replica: int = 0


MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        NodeReady,
        NodeFailed,
        Heartbeat,
        Reserve,
        ReserveReply,
        Prefill,
        FirstToken,
        StepTokens,
        RequestError,
        Abort,
        Shutdown,
        RouterPing,
        Preempted,
        KVEvents,
    )
}


def sampling_to_dict(params: SamplingParams) -> dict[str, Any]:
    out = dataclasses.asdict(params)
    out["stop_token_ids"] = list(params.stop_token_ids)
    out["logit_bias"] = [[token, bias] for token, bias in params.logit_bias]
    # Structured output: (kind, spec[, after]) travels as a list (asdict's copy).
    out["structured"] = None if params.structured is None else list(params.structured)
    return out


def sampling_from_dict(raw: dict[str, Any]) -> SamplingParams:
    """Raises InvalidRequestError / ProtocolError for bad values."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(raw) - names
    if unknown:
        raise ProtocolError(f"unknown sampling fields {sorted(unknown)}")
    raw = dict(raw)
    raw["stop_token_ids"] = tuple(raw.get("stop_token_ids", ()))
    raw["logit_bias"] = tuple(_bias_pair(pair) for pair in raw.get("logit_bias", ()))
    # Structured output: [kind, spec(, after)] -> a tuple; SamplingParams checks the strings.
    structured = raw.get("structured")
    if structured is not None:
        if not isinstance(structured, list) or len(structured) not in (2, 3):
            raise ProtocolError("structured must be [kind, spec] or [kind, spec, after]")
        raw["structured"] = tuple(structured)
    return SamplingParams(**raw)


def _bias_pair(pair: Any) -> tuple[int, float]:
    if (
        not isinstance(pair, list)
        or len(pair) != 2
        or not _type_ok(pair[0], int)
        or not _type_ok(pair[1], float)
    ):
        raise ProtocolError("logit_bias must be a list of [token id, bias] pairs")
    return pair[0], float(pair[1])


def encode(msg: Any) -> bytes:
    name = type(msg).__name__
    if MESSAGE_TYPES.get(name) is not type(msg):
        raise TypeError(f"not a protocol message: {msg!r}")
    body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    return msgpack.packb({"type": name, **body}, use_bin_type=True)


def _type_ok(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """A message type's field annotations and fields, resolved once: typing.get_type_hints
    compiles the annotations' strings anew on every call (the router decodes a message per
    step per decode node)."""
    return typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}


def decode(frame: bytes) -> Any:
    """bytes -> message dataclass; ProtocolError for anything malformed."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"not msgpack: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise ProtocolError("a message must be a map with a 'type'")
    cls = MESSAGE_TYPES.get(raw.pop("type"))
    if cls is None:
        raise ProtocolError("unknown message type")
    if not all(isinstance(k, str) for k in raw):  # bytes keys too (and unsortable with str)
        raise ProtocolError(f"{cls.__name__}: field names must be strings")
    hints, fields_ = _schema(cls)
    if set(raw) - set(fields_):
        raise ProtocolError(f"{cls.__name__}: unknown fields {sorted(set(raw) - set(fields_))}")
    for name, f in fields_.items():
        if name not in raw:
            has_default = f.default is not dataclasses.MISSING or (
                f.default_factory is not dataclasses.MISSING
            )
            if not has_default:
                raise ProtocolError(f"{cls.__name__}: missing field '{name}'")
        elif not _type_ok(raw[name], hints[name]):
            raise ProtocolError(f"{cls.__name__}: field '{name}' has the wrong type")
    return cls(**raw)
