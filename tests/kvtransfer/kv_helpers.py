"""Test helpers: small pools, a fingerprint, and both transports behind one `Link` class.

`Link` bundles a receiver, a connected sender and a "raw" channel that delivers hand-made
frames as a handshaken peer would, synchronously (for ZeroMQ it waits until the receiver has
handled them), so fuzz tests can assert on counters right after sending. The way back has its
own raw channel, `to_sender`, and `cancels_of` collects what a sender was told.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import zmq

from kvtransfer import (
    InprocReceiver,
    InprocSender,
    KVSender,
    Rendezvous,
    ZmqReceiver,
    ZmqSender,
    make_fingerprint,
)
from kvtransfer.wire import Hello, HelloAck, KVDone, build_chunk, decode, encode
from model.kv_pool import KVPool, PageTable

NUM_LAYERS = 4
ROW_WIDTH = 24
DTYPE = torch.bfloat16
MODEL_FP = {"model_type": "deepseek_v2", "num_hidden_layers": NUM_LAYERS, "kv_lora_rank": 16}
TIMEOUT = 5.0  # upper bound of any wait in these tests; they normally take milliseconds


def fingerprint(**overrides):
    fp = make_fingerprint(MODEL_FP, NUM_LAYERS, ROW_WIDTH, DTYPE)
    fp.update(overrides)
    return fp


def make_pool(page_size: int, num_pages: int = 64, num_layers: int = NUM_LAYERS) -> KVPool:
    return KVPool(num_layers, num_pages, page_size, ROW_WIDTH, DTYPE)


def reserve(pool: KVPool, num_tokens: int) -> PageTable:
    table = pool.new_table()
    pool.reserve(table, num_tokens)
    return table


def random_rows(num_tokens: int, seed: int, num_layers: int = NUM_LAYERS) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_layers, num_tokens, ROW_WIDTH, generator=gen).to(DTYPE)


def wait_until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def chunk_frames(rdv: Rendezvous, seq: int, token_start: int, rows: torch.Tensor) -> list:
    """The frames a sender would put on the wire for this chunk (for `Link.raw_send`)."""
    chunk, payload = build_chunk(rdv, seq, 0, token_start, rows)
    return [encode(chunk), bytes(payload)]


def done_frames(rdv: Rendezvous, seq: int, num_tokens: int, first_token: int) -> list:
    return [encode(KVDone(rdv, seq, num_tokens, first_token))]


def cancels_of(sender: KVSender, num: int) -> list[tuple[Rendezvous, str]]:
    """The next `num` cancels `sender` receives (waits for them: zmq delivers on a thread)."""
    got: list[tuple[Rendezvous, str]] = []

    def arrived() -> bool:
        got.extend(sender.poll_cancels())
        return len(got) >= num

    wait_until(arrived, f"{num} kv_cancels")
    return got


class Link:
    """A receiver on `decode_pool`, a sender connected to it, and a raw handshaken channel."""

    def __init__(self, kind: str, decode_pool: KVPool):
        self.kind = kind
        self.pool = decode_pool
        if kind == "inproc":
            self.receiver = InprocReceiver(decode_pool, fingerprint())
            self.sender = InprocSender("test-prefill")
        else:
            self.receiver = ZmqReceiver(decode_pool, fingerprint())
            self.sender = ZmqSender("test-prefill", send_timeout=2.0)
        self.sender.connect(self.receiver.endpoint, fingerprint(), TIMEOUT)
        # How the receiver names the sender (zmq: its routing id, the one peer so far).
        self._sender_peer = self.sender if kind == "inproc" else next(iter(self.receiver._peers))
        self._raw = None
        self.raw_received: list[list[bytes]] = []  # what came back to the raw peer (zmq)

    def raw_send(self, frames: list) -> None:
        """Deliver `frames` ([header] or [header, payload, ...]) and wait until handled. For zmq
        a hello follows them: its ack comes back only after the frames before it were handled."""
        if self.kind == "inproc":
            self.receiver.receive(list(frames), is_peer_known=True)
            return
        sock = self._raw_socket()
        sock.send_multipart(frames, copy=True)
        self._handshake(sock)

    def to_sender(self, frames: list) -> None:
        """Deliver `frames` to the sender as the receiver's transport would (for zmq: queued for
        the receiver's I/O thread; the sender's thread reads them soon after)."""
        self.receiver._send_to_peer(self._sender_peer, list(frames))

    def connect_sender(self, name: str) -> KVSender:
        """Another sender of this link's kind, connected to its receiver (closed by the test)."""
        sender = InprocSender(name) if self.kind == "inproc" else ZmqSender(name)
        sender.connect(self.receiver.endpoint, fingerprint(), TIMEOUT)
        return sender

    def dropped(self) -> dict[str, int]:
        return dict(self.receiver.stats().dropped)

    def raw_socket_without_hello(self) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.receiver.endpoint)
        return sock

    def _raw_socket(self) -> zmq.Socket:
        if self._raw is None:
            self._raw = self.raw_socket_without_hello()
            self._handshake(self._raw)
        return self._raw

    def _handshake(self, sock: zmq.Socket) -> None:
        sock.send(encode(Hello("raw-peer", fingerprint())))
        while True:  # kv_cancels for rendezvous the raw peer sent may come first: keep them
            assert sock.poll(int(TIMEOUT * 1000)), "no hello_ack for the raw peer"
            frames = sock.recv_multipart()
            msg = decode(frames[0])
            if not isinstance(msg, HelloAck):
                self.raw_received.append(frames)
                continue
            assert msg.ok
            return

    def close(self) -> None:
        if self._raw is not None:
            self._raw.close(linger=0)
        self.sender.close()
        self.receiver.close()
