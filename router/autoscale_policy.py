"""When to add or drain a node of each role (`[autoscale]`): pure decisions from the signals the
autoscaler reads each interval (no clock, no sockets: the caller passes `now`).

Per role, the load is one number with an "up" and a "down" mark (`control.cluster_config.
AutoscaleConfig`): prefill, the prompt tokens queued per ready node; decode, the share of the
KV pages the router holds for requests. Hysteresis: a role scales up once its load has been at
or above its up mark for `sustain_s`, down once it has been at or below its down mark for
`idle_s`; a single spike or lull changes nothing. Cool-down: a role changes at most once per
`cooldown_s`, and not while a node it started is still starting. SLA: when the share of finished
requests within the SLA over the window falls below `sla_target`, the role that misses its part
scales up even below its mark: prefill when more requests missed the TTFT target than the TPOT
one (the TTFT is the prefill queue's and compute's), else decode; the role whose load is the
higher share of its up mark when both parts are missed alike. Bounds: the ready
and starting nodes of a role stay within [min, max]; only nodes the autoscaler started are
drained, never the config's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from control.cluster_config import AutoscaleConfig

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RoleSignals:
    """A role as the autoscaler sees it now."""

    ready: int  # ready nodes (the config's and the started ones)
    starting: int  # nodes it started that are not ready yet
    drainable: int  # ready nodes it started (the only ones it may drain)
    load: float  # prefill: queued prompt tokens per ready node; decode: KV share held


@dataclass(frozen=True)
class Attainment:
    """The requests finished within the window: the shares that met the whole SLA, its TTFT
    target and its TPOT target."""

    met: float
    ttft: float
    tpot: float


@dataclass(frozen=True)
class Decision:
    role: str
    delta: int  # +1: start a node; -1: drain one
    reason: str


@dataclass
class _RoleState:
    above_since: float | None = None
    below_since: float | None = None
    last_change: float = float("-inf")


@dataclass
class AutoscalePolicy:
    cfg: AutoscaleConfig
    _state: dict[str, _RoleState] = field(default_factory=lambda: {r: _RoleState() for r in ROLES})

    def marks(self, role: str) -> tuple[float, float]:
        """(up, down) marks of the role's load."""
        c = self.cfg
        if role == "prefill":
            return float(c.prefill_up_tokens), float(c.prefill_down_tokens)
        return c.decode_up_share, c.decode_down_share

    def bounds(self, role: str) -> tuple[int, int]:
        c = self.cfg
        return (c.min_prefill, c.max_prefill) if role == "prefill" else (c.min_decode, c.max_decode)

    def decide(
        self, signals: dict[str, RoleSignals], attainment: Attainment | None, now: float
    ) -> list[Decision]:
        """At most one decision per role; `attainment` over the window (None when nothing
        finished in it)."""
        bottleneck = None
        if attainment is not None and attainment.met < self.cfg.sla_target:
            missed = {"prefill": 1.0 - attainment.ttft, "decode": 1.0 - attainment.tpot}
            if missed["prefill"] != missed["decode"]:
                bottleneck = max(missed, key=missed.get)
            else:
                pressure = {r: s.load / max(self.marks(r)[0], 1e-9) for r, s in signals.items()}
                bottleneck = max(pressure, key=pressure.get)
        out = []
        for role, s in signals.items():
            decision = self._decide_role(role, s, now, role == bottleneck)
            if decision is not None:
                self._state[role].last_change = now
                self._state[role].above_since = self._state[role].below_since = None
                out.append(decision)
        return out

    def _decide_role(self, role: str, s: RoleSignals, now: float, sla: bool) -> Decision | None:
        st, (up, down), (low, high) = self._state[role], self.marks(role), self.bounds(role)
        st.above_since = (
            (st.above_since if st.above_since is not None else now) if s.load >= up else None
        )
        st.below_since = (
            (st.below_since if st.below_since is not None else now) if s.load <= down else None
        )
        if s.starting:  # the change is not in effect yet: the load is measured again after it
            st.above_since = st.below_since = None
            return None
        if now - st.last_change < self.cfg.cooldown_s:
            return None
        total = s.ready + s.starting
        if total < low:
            return Decision(role, +1, f"{total} nodes, below min_{role} = {low}")
        sustained = st.above_since is not None and now - st.above_since >= self.cfg.sustain_s
        if total < high and sustained:
            return Decision(
                role, +1, f"load {s.load:.4g} >= {up:g} for {now - st.above_since:.1f} s"
            )
        if total < high and sla:
            part = "TTFT" if role == "prefill" else "TPOT"
            return Decision(
                role,
                +1,
                f"SLA attainment under {self.cfg.sla_target:g}, its {part} part missed most, "
                f"load {s.load:.4g}",
            )
        idle = st.below_since is not None and now - st.below_since >= self.cfg.idle_s
        if idle and s.drainable and total > low:
            return Decision(
                role, -1, f"load {s.load:.4g} <= {down:g} for {now - st.below_since:.1f} s"
            )
        return None
