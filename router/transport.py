"""The router's ZeroMQ sockets (zmq.asyncio): one PULL it binds for every node's messages, and
one PUSH per node connected to that node's control endpoint. Frames are `control.protocol`
messages; a frame that does not decode is dropped and counted, never raised into the loop.

Sends never block the event loop: a PUSH whose queue to a node is full (the node is gone or
stuck) refuses the message at once (`send` returns False), and the node's heartbeat timeout
then fails its requests. A node whose connection drops (its process died) is reported by
`lost_connections` at once.

With a `security` (control.security.CurveSecurity) every socket is CURVE: the PULL a server that
admits only the cluster key, each PUSH a client; `None` is plain (in-process tests).
"""

from __future__ import annotations

import logging
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from control import protocol
from control.security import CurveSecurity, curve_client, curve_server

log = logging.getLogger("router")

SEND_HWM = 10_000  # messages queued per node before sends are refused


class RouterTransport:
    def __init__(
        self,
        bind_endpoint: str,
        node_endpoints: dict[str, str],
        security: CurveSecurity | None = None,
    ):
        self.security = security
        self.ctx = zmq.asyncio.Context()
        self.send_ctx = zmq.Context()  # plain sockets: a NOBLOCK send raises at once
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.RCVHWM, 0)  # never drop node messages for lack of queue room
        curve_server(self.pull, security)
        self.pull.bind(bind_endpoint)
        self.push: dict[str, zmq.Socket] = {}
        # A node process that dies closes its end of our connection at once (the kernel does
        # it even on SIGKILL): the router hears of it here, well before the heartbeat timeout.
        # A hung node (SIGSTOP) keeps its connection and is found by the heartbeat timeout.
        self._monitors: dict[str, zmq.Socket] = {}
        for name, endpoint in node_endpoints.items():
            self.add_node(name, endpoint)
        self.num_bad_frames = 0
        self.num_send_refused = 0

    def add_node(self, name: str, endpoint: str) -> None:
        """A PUSH to the node's control endpoint (and its connection watch)."""
        sock = self._push_socket(endpoint)
        self.push[name] = sock
        self._monitors[name] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def remove_node(self, name: str) -> None:
        """Closes the node's PUSH (a node that left): nothing more is sent to it."""
        sock, monitor = self.push.pop(name, None), self._monitors.pop(name, None)
        if sock is not None:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    def tell(self, endpoint: str, msg: Any, linger_s: float = 5.0) -> None:
        """One message to a node the router does not keep (a refused join), on a socket of its
        own that closes at once and delivers in the background for `linger_s` at most."""
        sock = self._push_socket(endpoint)
        try:
            sock.send(protocol.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        sock.close(linger=int(linger_s * 1000))

    def _push_socket(self, endpoint: str) -> zmq.Socket:
        sock = self.send_ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        curve_client(sock, self.security)
        sock.connect(endpoint)
        return sock

    async def recv(self) -> Any:
        """The next valid message from any node (waits; cancel the task to stop it)."""
        while True:
            frames = await self.pull.recv_multipart(copy=True)
            if len(frames) != 1:
                self.num_bad_frames += 1
                log.warning("dropped a control message of %d frames", len(frames))
                continue
            try:
                return protocol.decode(frames[0])
            except protocol.ProtocolError as exc:
                self.num_bad_frames += 1
                log.warning("dropped a bad control message: %s", exc)

    def send(self, node: str, msg: Any) -> bool:
        """Queues `msg` for `node` without blocking; False if the node's queue is full (or it
        left)."""
        sock = self.push.get(node)
        if sock is None:
            return False
        try:
            sock.send(protocol.encode(msg), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.num_send_refused += 1
            log.warning("send queue to %s is full; dropped %s", node, type(msg).__name__)
            return False

    def lost_connections(self) -> list[str]:
        """Nodes whose control connection dropped since the last call (never blocks)."""
        lost = []
        for name, monitor in self._monitors.items():
            while True:
                try:
                    frames = monitor.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                if parse_monitor_message(frames)["event"] == zmq.EVENT_DISCONNECTED:
                    lost.append(name)
        return lost

    def close(self) -> None:
        for name, sock in self.push.items():
            sock.disable_monitor()
            self._monitors[name].close(linger=0)
        for sock in (self.pull, *self.push.values()):
            sock.close(linger=0)
        if self.security is not None:  # the ZAP thread holds a socket of ctx: stop it first
            self.security.release(self.ctx)
        self.ctx.term()
        self.send_ctx.term()
