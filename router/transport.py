"""The router's ZeroMQ sockets (zmq.asyncio): one PULL it binds for every node's messages, and
one PUSH per node connected to that node's control endpoint. Frames are `engine.protocol`
messages; a frame that does not decode is dropped and counted, never raised into the loop.

Sends never block the event loop: a PUSH whose queue to a node is full (the node is gone or
stuck) refuses the message at once (`send` returns False), and the node's heartbeat timeout
then fails its requests.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq
import zmq.asyncio

from engine import protocol

log = logging.getLogger("router")

SEND_HWM = 10_000  # messages queued per node before sends are refused


class RouterTransport:
    def __init__(self, bind_endpoint: str, node_endpoints: dict[str, str]):
        self.ctx = zmq.asyncio.Context()
        self.send_ctx = zmq.Context()  # plain sockets: a NOBLOCK send raises at once
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.RCVHWM, 0)  # never drop node messages for lack of queue room
        self.pull.bind(bind_endpoint)
        self.push: dict[str, zmq.Socket] = {}
        for name, endpoint in node_endpoints.items():
            sock = self.send_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.connect(endpoint)
            self.push[name] = sock
        self.num_bad_frames = 0
        self.num_send_refused = 0

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
        """Queues `msg` for `node` without blocking; False if the node's queue is full."""
        try:
            self.push[node].send(protocol.encode(msg), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.num_send_refused += 1
            log.warning("send queue to %s is full; dropped %s", node, type(msg).__name__)
            return False

    def close(self) -> None:
        for sock in (self.pull, *self.push.values()):
            sock.close(linger=0)
        self.ctx.term()
        self.send_ctx.term()
