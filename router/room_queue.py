"""Requests waiting for decode room, in turn order: preempted ones first (they already streamed
output to a client), then the rest in arrival order. Only the head asks the decode nodes; the
others wait for their turn, so a request that arrives later never takes the room that freed up
for an earlier one (vLLM's FCFS). Each waiter has an event, set when its turn comes (or when it
must look again: it was aborted). Pure bookkeeping: no sockets, no node messages."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from dataclasses import dataclass, field


@dataclass(order=True)
class _Entry:
    priority: int  # 0: preempted, 1: new
    seq: int
    wire_id: str = field(compare=False)
    joined: float = field(compare=False)
    turn: asyncio.Event = field(compare=False)


class RoomQueue:
    def __init__(self) -> None:
        self._entries: list[_Entry] = []
        self._by_id: dict[str, _Entry] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, wire_id: str) -> bool:
        return wire_id in self._by_id

    def join(self, wire_id: str, preempted: bool) -> None:
        """Takes a place (once: a second join keeps the first place)."""
        if wire_id in self._by_id:
            return
        entry = _Entry(
            0 if preempted else 1, next(self._seq), wire_id, time.monotonic(), asyncio.Event()
        )
        bisect.insort(self._entries, entry)
        self._by_id[wire_id] = entry
        self._entries[0].turn.set()  # the head may have changed (a preempted one went first)

    def leave(self, wire_id: str) -> float:
        """Gives the place up; the seconds it was held (0 if it held none). The next head is
        told its turn has come."""
        entry = self._by_id.pop(wire_id, None)
        if entry is None:
            return 0.0
        self._entries.remove(entry)
        if self._entries:
            self._entries[0].turn.set()
        return time.monotonic() - entry.joined

    def is_head(self, wire_id: str) -> bool:
        return bool(self._entries) and self._entries[0].wire_id == wire_id

    def position(self, wire_id: str) -> int:
        """0 for the head; -1 when not waiting."""
        entry = self._by_id.get(wire_id)
        return -1 if entry is None else self._entries.index(entry)

    def wake(self, wire_id: str) -> None:
        """Makes the waiter look again now (it was aborted, or the router stops)."""
        entry = self._by_id.get(wire_id)
        if entry is not None:
            entry.turn.set()

    async def wait_turn(self, wire_id: str, timeout_s: float) -> None:
        """Until the waiter is the head, is woken, or `timeout_s` passed."""
        entry = self._by_id.get(wire_id)
        if entry is None or self.is_head(wire_id):
            return
        entry.turn.clear()
        if self.is_head(wire_id):
            return
        try:
            await asyncio.wait_for(entry.turn.wait(), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            pass
