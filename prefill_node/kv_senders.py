"""One KV sender per decode endpoint, connected lazily (the handshake checks compatibility)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvtransfer import KVSender, KVTransferError, Rendezvous

log = logging.getLogger(__name__)


class SenderPool:
    """Maps decode KV endpoints to connected senders.

    `get` connects on first use (blocking at most `handshake_timeout` seconds) and raises
    KVTransferError when the handshake fails, e.g. a fingerprint mismatch, which names the
    differing field. A sender that broke is `drop`ped (by the caller, or by `get` itself when
    its connection dropped); the next `get` connects a new one.
    """

    def __init__(
        self,
        factory: Callable[[], KVSender],
        fingerprint: dict[str, Any],
        handshake_timeout: float,
    ):
        self._factory = factory
        self._fingerprint = fingerprint
        self._handshake_timeout = handshake_timeout
        self._senders: dict[str, KVSender] = {}

    def get(self, endpoint: str) -> KVSender:
        sender = self._senders.get(endpoint)
        if sender is not None and not sender.is_broken:
            return sender
        if sender is not None:  # its connection dropped: the decode node may be back, anew
            self.drop(endpoint)
        sender = self._factory()
        try:
            sender.connect(endpoint, self._fingerprint, self._handshake_timeout)
        except KVTransferError:
            sender.close(timeout=0.1)
            raise
        except Exception as exc:  # a malformed endpoint string, a zmq error
            sender.close(timeout=0.1)
            raise KVTransferError(f"KV handshake with {endpoint} failed: {exc}") from None
        self._senders[endpoint] = sender
        return sender

    def poll_cancels(self) -> list[tuple[str, Rendezvous, str]]:
        """(endpoint, rendezvous, reason) of every kv_cancel the decode nodes sent since the
        last call (`KVSender.poll_cancels`; never blocks)."""
        return [
            (endpoint, rendezvous, reason)
            for endpoint, sender in self._senders.items()
            for rendezvous, reason in sender.poll_cancels()
        ]

    def peek(self, endpoint: str) -> KVSender | None:
        """The connected sender for `endpoint`, or None (never connects)."""
        return self._senders.get(endpoint)

    def drop(self, endpoint: str) -> None:
        sender = self._senders.pop(endpoint, None)
        if sender is not None:
            log.warning("dropping the KV sender to %s", endpoint)
            sender.close(timeout=0.5)

    def close(self) -> None:
        for endpoint in list(self._senders):
            self._senders.pop(endpoint).close(timeout=0.5)
