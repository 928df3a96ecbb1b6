"""Fault injection on the KV send path, for tests: drop, duplicate, delay, reorder or corrupt the
messages a sender emits, so the real nodes and sockets meet a bad link.

Off by default and free when off: a sender's `faults` is None, one check a message. `inject(sender,
plan)` turns it on for one sender; a prefill node process turns it on for all its senders when
the environment variable DUET_KV_FAULTS holds a plan (read here, by `plan_from_env`, which logs a
loud warning). A plan is a comma-separated list, the same text in tests and in the environment:

    drop=0.1,dup=0.1,seed=3          every message: dropped with p 0.1, else duplicated with p 0.1
    done.drop=0.5,chunk.corrupt=0.2  per message kind (chunk, done, abort)
    chunk#2=drop,done#0=delay        a schedule: the third chunk is dropped, the first done delayed
    seed=N     the RNG's seed (default 0); one draw a message, so a run is reproducible
    limit=N    only the first N messages may be faulted (held ones still go out later)
    hold=N     a delayed message goes out after N later messages (default 2) ...
    hold_s=T   ... or after T seconds, whichever comes first (default 0: no timer)

Actions, at most one a message (a scheduled one wins over a drawn one):
    drop     it never leaves
    dup      it goes out twice, back to back: a replay with the same sequence number
    delay    it is held until `hold` later messages went out, or `hold_s` passed
    reorder  it goes out right after the next message (a delay of one)
    corrupt  one byte of its frames (payload or header, uniformly) is flipped

Faults act on items already numbered by `SenderCore` and not yet framed by the transport, so on the
wire they look like a lossy, duplicating, reordering, bit-flipping link.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtransfer.sender_core import ChunkItem, FramedItem, SealedItem, SenderCore, frames_of
from kvtransfer.wire import KVAbort, KVDone, Rendezvous

log = logging.getLogger(__name__)

ENV_VAR = "DUET_KV_FAULTS"
KINDS = ("chunk", "done", "abort")
ACTIONS = ("drop", "dup", "delay", "reorder", "corrupt")
_OPTIONS = ("seed", "limit", "hold", "hold_s")


@dataclass(frozen=True)
class KVFaultPlan:
    """What to do to a sender's messages. `rates[(kind, action)]` is a probability (the rates of
    one kind sum to at most 1); `schedule[(kind, index)]` forces an action on the index-th
    message of that kind (0-based, in send order)."""

    rates: Mapping[tuple[str, str], float] = field(default_factory=dict)
    schedule: Mapping[tuple[str, int], str] = field(default_factory=dict)
    seed: int = 0
    limit: int | None = None
    hold: int = 2
    hold_s: float = 0.0

    def __post_init__(self) -> None:
        for (kind, action), p in self.rates.items():
            _check_kind_action(kind, action)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{ENV_VAR}: {kind}.{action}={p} is not a probability")
        for kind in KINDS:
            total = sum(p for (k, _), p in self.rates.items() if k == kind)
            if total > 1.0 + 1e-9:
                raise ValueError(f"{ENV_VAR}: the rates of {kind} messages sum to {total:g} > 1")
        for (kind, index), action in self.schedule.items():
            _check_kind_action(kind, action)
            if index < 0:
                raise ValueError(f"{ENV_VAR}: {kind}#{index}: the index must be >= 0")
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"{ENV_VAR}: limit must be >= 0")
        if self.hold < 1 or self.hold_s < 0:
            raise ValueError(f"{ENV_VAR}: hold must be >= 1 and hold_s >= 0")

    @classmethod
    def parse(cls, text: str) -> KVFaultPlan:
        """The plan written as in the module docstring; ValueError names a bad item."""
        rates: dict[tuple[str, str], float] = {}
        schedule: dict[tuple[str, int], str] = {}
        options: dict[str, Any] = {}
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            key, sep, value = (s.strip() for s in item.partition("="))
            try:
                if not sep:
                    raise ValueError("expected key=value")
                if key in _OPTIONS:
                    options[key] = float(value) if key == "hold_s" else int(value)
                elif "#" in key:
                    kind, _, index = key.partition("#")
                    schedule[(kind, int(index))] = value
                elif "." in key:
                    kind, _, action = key.partition(".")
                    rates[(kind, action)] = float(value)
                elif key in ACTIONS:
                    for kind in KINDS:
                        rates[(kind, key)] = float(value)
                else:
                    raise ValueError(f"unknown key (actions: {', '.join(ACTIONS)})")
            except ValueError as exc:
                raise ValueError(f"{ENV_VAR}: bad item {item!r}: {exc}") from None
        return cls(rates, schedule, **options)

    @property
    def is_active(self) -> bool:
        return any(p > 0 for p in self.rates.values()) or bool(self.schedule)


def _check_kind_action(kind: str, action: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"{ENV_VAR}: unknown message kind {kind!r} (kinds: {', '.join(KINDS)})")
    if action not in ACTIONS:
        raise ValueError(f"{ENV_VAR}: unknown action {action!r} (actions: {', '.join(ACTIONS)})")


@dataclass(frozen=True)
class FaultRecord:
    """One fault done: the index-th message of `kind` (message `seq` of `rendezvous`)."""

    kind: str
    index: int
    rendezvous: Rendezvous
    seq: int
    action: str


@dataclass
class _Held:
    item: Any
    due_tick: int  # goes out once this many messages were submitted ...
    due_time: float  # ... or at this time.monotonic(), whichever comes first


class FaultInjector:
    """Applies a plan to one sender's items and passes what survives to `deliver` (the sender's
    `_submit`). Thread-safe: items are delivered under its lock, in the faulted order, from the
    caller's thread (or, for `hold_s`, a timer thread)."""

    def __init__(self, plan: KVFaultPlan, deliver: Callable[[Any], None]):
        self.plan = plan
        self.records: list[FaultRecord] = []
        self._deliver = deliver
        self._rng = random.Random(plan.seed)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._num_submitted = 0
        self._held: list[_Held] = []

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

    def submit(self, item: ChunkItem | KVDone | KVAbort) -> None:
        with self._lock:
            self._num_submitted += 1
            kind = _kind_of(item)
            index = self._counts[kind]
            self._counts[kind] += 1
            action = self._choose(kind, index)
            if action is not None:
                self.records.append(FaultRecord(kind, index, item.rendezvous, item.seq, action))
            if action is None:
                self._deliver(item)
            elif action == "dup":
                self._deliver(item)
                self._deliver(item)
            elif action == "corrupt":
                self._deliver(self._corrupted(item))
            elif action in ("delay", "reorder"):
                self._hold(item, 1 if action == "reorder" else self.plan.hold)
            # drop: nothing goes out
            self._release_due()

    def release_all(self) -> None:
        """Sends every held message now (a test's way to make late frames arrive)."""
        with self._lock:
            held, self._held = self._held, []
            for entry in held:
                self._deliver(entry.item)

    def _choose(self, kind: str, index: int) -> str | None:
        if self.plan.limit is not None and self._num_submitted > self.plan.limit:
            return None
        draw = self._rng.random()  # one draw a message, scheduled or not: runs stay comparable
        scheduled = self.plan.schedule.get((kind, index))
        if scheduled is not None:
            return scheduled
        for action in ACTIONS:
            draw -= self.plan.rates.get((kind, action), 0.0)
            if draw < 0:
                return action
        return None

    def _corrupted(self, item: Any) -> FramedItem:
        frames = [bytes(f) if not isinstance(f, bytes) else f for f in frames_of(item)]
        pos = self._rng.randrange(sum(len(f) for f in frames))
        for i, frame in enumerate(frames):
            if pos < len(frame):
                damaged = bytearray(frame)
                damaged[pos] ^= self._rng.randrange(1, 256)
                frames[i] = bytes(damaged)
                break
            pos -= len(frame)
        return FramedItem(tuple(frames))

    def _hold(self, item: Any, num_later: int) -> None:
        due_time = time.monotonic() + self.plan.hold_s if self.plan.hold_s else float("inf")
        self._held.append(_Held(item, self._num_submitted + num_later, due_time))
        if self.plan.hold_s:
            timer = threading.Timer(self.plan.hold_s + 1e-3, self._on_timer)
            timer.daemon = True
            timer.start()

    def _release_due(self) -> None:
        """Delivers the held items whose turn has come (caller holds the lock)."""
        now = time.monotonic()
        due, keep = [], []
        for entry in self._held:
            is_due = entry.due_tick <= self._num_submitted or entry.due_time <= now
            (due if is_due else keep).append(entry)
        self._held = keep
        for entry in due:
            self._deliver(entry.item)

    def _on_timer(self) -> None:
        try:
            with self._lock:
                self._release_due()
        except Exception as exc:  # the sender broke or closed meanwhile: the item is lost
            log.warning("KV fault injector: a delayed message could not be sent: %s", exc)


def _kind_of(item: Any) -> str:
    if isinstance(item, SealedItem):
        item = item.item
    if isinstance(item, ChunkItem):
        return "chunk"
    if isinstance(item, KVDone):
        return "done"
    if isinstance(item, KVAbort):
        return "abort"
    raise TypeError(f"not a per-request KV item: {type(item).__name__}")


def inject(sender: SenderCore, plan: KVFaultPlan | None) -> SenderCore:
    """`sender` with `plan` applied to everything it sends from now on (None: unchanged)."""
    if plan is not None and plan.is_active:
        sender.faults = FaultInjector(plan, sender._submit)
    return sender


def plan_from_env(environ: Mapping[str, str] | None = None) -> KVFaultPlan | None:
    """The plan in DUET_KV_FAULTS, or None when it is unset or empty; ValueError if malformed.
    Logs a loud warning when a plan is active: such a node corrupts its own traffic."""
    text = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    if not text:
        return None
    plan = KVFaultPlan.parse(text)
    if plan.is_active:
        log.warning(
            "!!! KV FAULT INJECTION IS ON (%s=%r): this node drops, duplicates, delays, reorders "
            "or corrupts its KV messages on purpose. For tests only. !!!",
            ENV_VAR,
            text,
        )
    return plan
