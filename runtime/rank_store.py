"""The rendezvous of a node's ranks (`runtime.rank_group`): a `torch.distributed` store that only
the node's own ranks can use.

torch's TCPStore answers anyone who reaches its port: a stranger could read where each rank's
gloo sockets listen, or write another address there and sit between the ranks. This store is
served by rank 0 over ZeroMQ (`StoreServer`, on the group's port), and every request carries
the group's token, checked in constant time; a request without it is refused (counted, logged)
and changes nothing. With the cluster's CURVE keys ([security]) the socket is CURVE too: only a
holder of the cluster key gets a frame through at all, and the token never crosses the wire in
clear.

The token (`group_token`): rank 0 draws one per run when it starts its ranks itself, and they
inherit it in their environment (TOKEN_ENV), so only the processes of this run of this node
hold it. Ranks started by hand on other hosts (`rank_hosts`) cannot inherit it: they use a key
derived from the cluster's secret key and the node's name, which only holders of the cluster
key can compute. Without CURVE keys (`insecure = true`) such ranks use no token: insecure
clusters authenticate nothing.

After the rendezvous the ranks talk over gloo's own sockets, which learned their peers from this
store; a stranger's connection there leaves the group working (tests/runtime/test_rank_store.py
sends junk to every port of a working group). Gloo's traffic itself is not encrypted.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import secrets
import socket
import threading
import time

import msgpack
import torch.distributed as dist
import zmq

from control.security import CurveSecurity, curve_client, curve_server

log = logging.getLogger(__name__)

TOKEN_ENV = "DUET_RANK_TOKEN"  # the group's token (hex), inherited by the ranks rank 0 starts
MAX_FRAME_BYTES = 1 << 20  # gloo's rendezvous values are addresses: a few hundred bytes
WAIT_SLICE_S = 0.01  # a waiting rank asks again this often
REPLY_TIMEOUT_S = 30.0  # a store request unanswered this long: rank 0 is gone


def group_token(node: str, security: CurveSecurity | None) -> bytes:
    """This process's token for `node`'s group: inherited (TOKEN_ENV), else derived from the
    cluster key, else none (an insecure cluster)."""
    inherited = os.environ.get(TOKEN_ENV)
    if inherited:
        return bytes.fromhex(inherited)
    if security is None:
        return b""
    return hmac.new(security.keys.secret, b"rank-group:" + node.encode(), hashlib.sha256).digest()


def new_run_token() -> None:
    """Rank 0 starting its ranks itself: a fresh token for this run, in the environment its
    children inherit."""
    os.environ[TOKEN_ENV] = secrets.token_hex(32)


class StoreServer:
    """Rank 0's side: the keys, served from a thread on `listener` (its bound socket, which
    this takes over) until `close`."""

    def __init__(self, listener: socket.socket, token: bytes, security: CurveSecurity | None):
        host, port = listener.getsockname()[:2]
        self.endpoint = f"tcp://{host}:{port}"
        self._token = token
        self._security = security
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        curve_server(self._sock, security)
        self._sock.setsockopt(zmq.USE_FD, listener.detach())  # the port the ranks were told
        self._sock.bind(self.endpoint)
        self._data: dict[str, bytes] = {}
        self.num_refused = 0  # requests without the group's token
        self.num_malformed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="rank-store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._sock.close(linger=0)
        if self._security is not None:
            self._security.release(self._ctx)
        self._ctx.term()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50, zmq.POLLIN):
                continue
            frames = self._sock.recv_multipart()
            reply = self._answer(frames[1:])
            if reply is not None:
                self._sock.send_multipart([frames[0], msgpack.packb(reply)])

    def _answer(self, frames: list[bytes]) -> list | None:
        if len(frames) != 2:
            self.num_malformed += 1
            return None
        token, body = frames
        if not hmac.compare_digest(token, self._token):
            self.num_refused += 1
            if self.num_refused == 1 or self.num_refused % 100 == 0:
                log.warning(
                    "rank store: refused %d requests without the group's token", self.num_refused
                )
            return ["refused"]
        try:
            op, *args = msgpack.unpackb(body)
            return ["ok", self._apply(op, *args)]
        except Exception as exc:  # a member's bad request: say so, change nothing
            self.num_malformed += 1
            return ["error", f"{type(exc).__name__}: {exc}"]

    def _apply(self, op: str, *args):
        data = self._data
        if op == "set":
            key, value = args
            data[str(key)] = bytes(value)
            return None
        if op == "get":  # None when absent: the client waits
            return data.get(str(args[0]))
        if op == "add":
            key, amount = str(args[0]), int(args[1])
            value = int(data.get(key, b"0")) + amount
            data[key] = str(value).encode()
            return value
        if op == "check":
            return all(str(k) in data for k in args[0])
        if op == "compare_set":
            key, expected, desired = str(args[0]), bytes(args[1]), bytes(args[2])
            current = data.get(key)
            if (current is None and not expected) or current == expected:
                data[key] = desired
                return desired
            return expected if current is None else current
        if op == "delete":
            return data.pop(str(args[0]), None) is not None
        if op == "num_keys":
            return len(data)
        raise ValueError(f"unknown store operation {op!r}")


class AuthStore(dist.Store):
    """A rank's client of the group's `StoreServer` (rank 0 is a client of its own server too).
    Thread-safe; every request waits at most REPLY_TIMEOUT_S, every wait its timeout."""

    def __init__(
        self,
        endpoint: str,
        token: bytes,
        security: CurveSecurity | None,
        timeout: datetime.timedelta,
    ):
        super().__init__()
        self._token = token
        self._timeout_s = timeout.total_seconds()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        curve_client(self._sock, security)
        self._sock.connect(endpoint)
        self._lock = threading.Lock()

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def _call(self, *request):
        with self._lock:
            self._sock.send_multipart([self._token, msgpack.packb(request)])
            if not self._sock.poll(int(REPLY_TIMEOUT_S * 1000), zmq.POLLIN):
                raise dist.DistStoreError(f"the rank store did not answer {request[0]!r}")
            status, *value = msgpack.unpackb(self._sock.recv())
        if status != "ok":
            raise dist.DistStoreError(f"the rank store refused {request[0]!r}: {status} {value}")
        return value[0]

    # ---- the torch.distributed.Store interface -----------------------------------------
    def set(self, key: str, value) -> None:
        self._call("set", key, _bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._call("get", key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call("compare_set", key, _bytes(expected), _bytes(desired))

    def delete_key(self, key: str) -> bool:
        return self._call("delete", key)

    def num_keys(self) -> int:
        return self._call("num_keys")

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = self._timeout_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"waited {limit:g} s for the rank store's {keys}")
            time.sleep(WAIT_SLICE_S)


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
