"""The planner's predictions: a discrete-event simulation of an xPyD cluster under Poisson load.

The nodes are the fitted cost models of `control.cost_model`: a prompt's prefill takes
`PrefillCost.predict_prompt(L, 0, chunk)` seconds, a decode step of n running requests holding C
context tokens in all takes `DecodeCost.predict(n, C)`. The simulated cluster behaves as the
real one schedules:
- the router sends each request to the prefill node with the fewest queued tokens (it pairs by
  them) and to the decode node with the fewest requests;
- a prefill node runs chunked prefill as its scheduler does: each forward takes, in arrival
  order, a chunk of at most `chunk_size` tokens of every queued prompt until `max_batch_tokens`
  are used, so later arrivals share (and slow) an earlier prompt's forwards; a forward takes
  `PrefillCost.predict_forward(its tokens, its attention, 1)`;
- the first token reaches the client `overhead_s` after its prefill ends (router, reservation,
  the last chunk's KV transfer), and the request joins its decode node's batch then;
- a decode node runs continuous batching: at every step boundary the waiting requests join, up
  to `max_batch`, each step adds one token to every member, a request leaves after its last.
Per request: TTFT = first token - arrival, TPOT = (end - first token) / (output_len - 1), as
bench-serve measures them. Closed forms checked in tests/deploy/test_plan_model.py: the M/D/1
mean wait (Pollaczek-Khinchine) for the prefill side and TPOT = s(n) for a fixed batch.

Simulation, not a queueing formula, because decode's service time depends on its own load
(a step slows with every request in the batch): the M/D/infinity approximations are off by up to
0.3 in attainment near saturation, where the choice between layouts is made.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass

from control.cost_model import DecodeCost, PrefillCost

DEFAULT_OVERHEAD_S = 0.010
DEFAULT_NUM_REQUESTS = 2000
WARMUP_FRACTION = 0.1  # the first requests see an empty cluster: not counted


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    rate: float  # requests/s, Poisson
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class Layout:
    num_prefill: int
    num_decode: int
    max_batch: int
    chunk_size: int
    max_batch_tokens: int = 512  # a prefill forward's token budget (`[[prefill]]` default)


@dataclass(frozen=True)
class Prediction:
    attainment: float  # fraction of requests meeting both SLAs
    p_ttft: float  # fraction meeting the TTFT target
    p_tpot: float
    median_ttft_s: float
    mean_ttft_s: float
    median_tpot_s: float
    prefill_load: float  # rate * prefill time / prefill nodes (>= 1: the queue grows forever)

    def goodput(self, rate: float) -> float:
        return rate * self.attainment


def simulate(
    workload: Workload,
    layout: Layout,
    prefill: PrefillCost,
    decode: DecodeCost,
    overhead_s: float = DEFAULT_OVERHEAD_S,
    num_requests: int = DEFAULT_NUM_REQUESTS,
    seed: int = 0,
) -> Prediction:
    """Simulates `num_requests` Poisson arrivals; deterministic for a seed."""
    w, lay = workload, layout
    rng = random.Random(seed)
    service = prefill.predict_prompt(w.input_len, 0, lay.chunk_size)
    arrivals, now = [], 0.0
    for _ in range(num_requests):
        now += rng.expovariate(w.rate)
        arrivals.append(now)
    done = _simulate_prefill(arrivals, w, lay, prefill)
    first_token = [(done[i] + overhead_s, arrivals[i], i) for i in range(num_requests)]
    ttft = [t - arrival for t, arrival, _ in first_token]
    ends = _simulate_decode(sorted(first_token), w, lay, decode)
    counted = range(int(num_requests * WARMUP_FRACTION), num_requests)
    tpot = [
        (ends[i] - first_token[i][0]) / max(1, w.output_len - 1) if w.output_len > 1 else 0.0
        for i in counted
    ]
    ttft = [ttft[i] for i in counted]
    meets = [a <= w.ttft_s and b <= w.tpot_s for a, b in zip(ttft, tpot, strict=True)]
    n = len(meets)
    return Prediction(
        attainment=sum(meets) / n,
        p_ttft=sum(t <= w.ttft_s for t in ttft) / n,
        p_tpot=sum(t <= w.tpot_s for t in tpot) / n,
        median_ttft_s=statistics.median(ttft),
        mean_ttft_s=statistics.fmean(ttft),
        median_tpot_s=statistics.median(tpot),
        prefill_load=w.rate * service / lay.num_prefill,
    )


def _simulate_prefill(
    arrivals: list[float], w: Workload, lay: Layout, cost: PrefillCost
) -> list[float]:
    """When each request's prefill ends. Events: arrivals and forward ends, per node."""
    queues: list[list[list[int]]] = [[] for _ in range(lay.num_prefill)]  # [index, computed]
    busy_until = [None] * lay.num_prefill  # end of the running forward, with its chunks
    events: list[tuple[float, int, int]] = [(t, 0, i) for i, t in enumerate(arrivals)]
    heapq.heapify(events)  # (time, kind 0 arrival / 1 forward end, request index or node)
    done = [0.0] * len(arrivals)
    chunks_of: list[list[tuple[list[int], int]]] = [[] for _ in range(lay.num_prefill)]

    def queued(p: int) -> int:
        return sum(w.input_len - computed for _, computed in queues[p])

    def start(p: int, t: float) -> None:
        budget, chunks, tokens, attention = lay.max_batch_tokens, [], 0, 0
        for entry in queues[p]:
            if budget == 0:
                break
            size = min(lay.chunk_size, w.input_len - entry[1], budget)
            chunks.append((entry, size))
            tokens, attention, budget = tokens + size, attention + size * entry[1], budget - size
        if chunks:
            chunks_of[p] = chunks
            busy_until[p] = t + max(cost.predict_forward(tokens, attention, 1), 1e-9)
            heapq.heappush(events, (busy_until[p], 1, p))

    while events:
        t, kind, who = heapq.heappop(events)
        if kind == 0:
            p = min(range(lay.num_prefill), key=lambda n: (queued(n), n))
            queues[p].append([who, 0])
        else:
            p = who
            for entry, size in chunks_of[p]:
                entry[1] += size
                if entry[1] >= w.input_len:
                    done[entry[0]] = t
            queues[p] = [e for e in queues[p] if e[1] < w.input_len]
            busy_until[p] = None
        if busy_until[p] is None:
            start(p, t)
    return done


def _simulate_decode(
    joins: list[tuple[float, float, int]], w: Workload, lay: Layout, cost: DecodeCost
) -> dict[int, float]:
    """End time of every request: events are joins (first tokens) and step ends per node."""
    num_steps = max(0, w.output_len - 1)  # the first token came from the prefill node
    if num_steps == 0:
        return {i: t for t, _, i in joins}
    held = [0] * lay.num_decode  # requests on each node (waiting or running)
    waiting: list[list[int]] = [[] for _ in range(lay.num_decode)]
    running: list[list[list[int]]] = [[] for _ in range(lay.num_decode)]  # [index, steps left]
    busy = [False] * lay.num_decode
    events: list[tuple[float, int, int, int]] = []  # (time, kind 0 join / 1 step end, node, idx)
    for t, _, i in joins:
        events.append((t, 0, -1, i))
    heapq.heapify(events)
    ends: dict[int, float] = {}
    while events:
        t, kind, node, idx = heapq.heappop(events)
        if kind == 0:
            node = min(range(lay.num_decode), key=lambda d: (held[d], d))
            held[node] += 1
            waiting[node].append(idx)
        else:
            still = []
            for member in running[node]:
                member[1] -= 1
                if member[1] == 0:
                    ends[member[0]] = t
                    held[node] -= 1
                else:
                    still.append(member)
            running[node] = still
            busy[node] = False
        if not busy[node]:
            _start_step(t, node, waiting, running, busy, events, w, lay, cost, num_steps)
    return ends


def _start_step(t, node, waiting, running, busy, events, w, lay, cost, num_steps) -> None:
    batch = running[node]
    while waiting[node] and len(batch) < lay.max_batch:
        batch.append([waiting[node].pop(0), num_steps])
    if not batch:
        return
    # Context: each member's prompt plus the tokens it holds so far.
    context = sum(w.input_len + 1 + num_steps - left for _, left in batch)
    step = cost.predict(len(batch), context)
    busy[node] = True
    heapq.heappush(events, (t + max(step, 1e-9), 1, node, -1))


def mean_wait_md1(rate: float, service_s: float) -> float:
    """Pollaczek-Khinchine: the mean wait of an M/D/1 queue (inf at load >= 1)."""
    load = rate * service_s
    return math.inf if load >= 1 else load * service_s / (2 * (1 - load))
