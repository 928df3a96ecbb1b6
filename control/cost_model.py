"""Online linear cost models of a node's forwards: prefill time by tokens and attention, decode
step time by batch and context. Pure (no clocks, no sockets): the router keeps one per node,
calibrated from the timings the nodes report in their heartbeats; a decode node keeps one of its
own steps to cap its batch under `tpot_ms`; `duet plan` can fit them to a profile.

The fit is exponentially forgotten ridge regression toward a prior:

    w = argmin_w  sum_i decay^(t-i) (y_i - w.x_i)^2  +  p_t |(w - w0) * s|^2,
    p_t = prior_weight * max(decay^t, MIN_PRIOR_FRACTION)

with `s` a typical magnitude of each feature, so `prior_weight` reads as "the prior is worth
this many samples of typical size". Before any sample it answers the prior `w0`; the prior
decays with the data, so noiseless samples of a linear function give its weights back (up to
MIN_PRIOR_FRACTION, which keeps the system solvable in directions the data never explored).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

MIN_PRIOR_FRACTION = 1e-6

# Priors for a CPU node: least squares over timed forwards of the built-in tiny model (bfloat16,
# one kernel thread, `model.deepseek` forwards with prefill chunks of 16..480 tokens after prefixes
# of 0..400, decode batches of 1..32 over contexts of 64..480) on the 2-core development machine,
# November 2026: prefill (0.00087, 5.0e-6, 9.8e-9), decode (0.00071, 3.5e-5, 5.1e-8), rounded.
# Larger models are slower, so before its first timings a node looks faster than it is: the
# router admits rather than rejects (a node that is never sent work would never be measured),
# and a node's own timings replace the prior within a few heartbeats.
PREFILL_PRIOR = (0.001, 5e-6, 1e-8)  # s per forward, s per new token, s per new token x prefix
DECODE_PRIOR = (0.001, 4e-5, 5e-8)  # s per step, s per running request, s per context token
PREFILL_SCALE = (1.0, 256.0, 256.0 * 512.0)  # typical features of one forward
DECODE_SCALE = (1.0, 16.0, 16.0 * 512.0)
DEFAULT_PRIOR_WEIGHT = 4.0
DEFAULT_DECAY = 0.98  # ~50 recent forwards dominate: a node slowed by a neighbour is seen soon
MAX_TIMING_SAMPLES = 32  # forwards a node reports per heartbeat at most (the newest)


class LinearCostModel:
    """Online least squares `y ~ w.x` with exponential forgetting and a ridge toward `prior`."""

    def __init__(
        self,
        prior: list[float] | tuple[float, ...],
        prior_weight: float = DEFAULT_PRIOR_WEIGHT,
        decay: float = DEFAULT_DECAY,
        scale: list[float] | tuple[float, ...] | None = None,
    ):
        if not prior or prior_weight <= 0 or not 0 < decay <= 1:
            raise ValueError("need a non-empty prior, prior_weight > 0 and 0 < decay <= 1")
        self._prior = np.asarray(prior, dtype=np.float64)
        dim = len(self._prior)
        self._scale = np.ones(dim) if scale is None else np.asarray(scale, dtype=np.float64)
        if self._scale.shape != (dim,) or np.any(self._scale <= 0):
            raise ValueError("scale needs one positive entry per feature")
        self.prior_weight = float(prior_weight)
        self.decay = float(decay)
        # Normal equations in scaled features (x / s): better conditioned across magnitudes.
        # Kept as Python floats: a decode node adds one sample a step, and numpy's per-call
        # overhead on 3 x 3 arrays (~25 us an update) was a visible share of a batch-1 step.
        self._inv_scale = [1.0 / float(v) for v in self._scale]
        self._xtx = [[0.0] * dim for _ in range(dim)]
        self._xty = [0.0] * dim
        self._prior_strength = self.prior_weight
        self.num_samples = 0
        self._weights: np.ndarray | None = self._prior.copy()  # None: solve at the next read

    @property
    def weights(self) -> list[float]:
        return [float(w) for w in self._solved()]

    def observe(self, x: list[float] | tuple[float, ...], y: float) -> None:
        """One sample: features `x` (one per prior weight) took `y` (e.g. seconds)."""
        if len(x) != len(self._xty) or not all(map(math.isfinite, (*x, y))):
            raise ValueError(f"a sample needs {len(self._xty)} finite features and a finite y")
        xs = [float(v) * inv for v, inv in zip(x, self._inv_scale, strict=True)]
        d = self.decay
        for row, xi in zip(self._xtx, xs, strict=True):
            row[:] = [d * r + xi * xj for r, xj in zip(row, xs, strict=True)]
        self._xty = [d * r + xi * y for r, xi in zip(self._xty, xs, strict=True)]
        floor = self.prior_weight * MIN_PRIOR_FRACTION
        self._prior_strength = max(self._prior_strength * self.decay, floor)
        self.num_samples += 1
        self._weights = None  # solved lazily: a heartbeat brings dozens of samples at once

    def predict(self, x: list[float] | tuple[float, ...]) -> float:
        """w.x, never negative (a noisy fit may give a tiny negative intercept)."""
        return max(0.0, float(np.dot(self._solved(), np.asarray(x, dtype=np.float64))))

    def _solved(self) -> np.ndarray:
        if self._weights is None:
            self._weights = self._solve()
        return self._weights

    def _solve(self) -> np.ndarray:
        dim = len(self._prior)
        scaled_prior = self._prior * self._scale  # the prior in scaled units
        lhs = np.asarray(self._xtx) + self._prior_strength * np.eye(dim)
        rhs = np.asarray(self._xty) + self._prior_strength * scaled_prior
        return np.linalg.solve(lhs, rhs) / self._scale


class PrefillCost:
    """Seconds of one prefill forward = a + b*new_tokens + c*new_tokens*prefix_len.

    `prefix_len` is the number of tokens before the chunk (its attention reads them); attention
    within the chunk itself is folded into b. For a packed forward of several chunks the new
    tokens and the new*prefix products are summed over its chunks (`observe_forward`)."""

    def __init__(self, prior=PREFILL_PRIOR, prior_weight=DEFAULT_PRIOR_WEIGHT, decay=DEFAULT_DECAY):
        self.model = LinearCostModel(prior, prior_weight, decay, PREFILL_SCALE)

    @property
    def num_samples(self) -> int:
        return self.model.num_samples

    def observe(self, new_tokens: int, prefix_len: int, seconds: float) -> None:
        """One forward of one chunk."""
        self.observe_forward(new_tokens, new_tokens * prefix_len, seconds)

    def observe_forward(self, new_tokens: int, attention: float, seconds: float) -> None:
        """One packed forward: `new_tokens` and `attention` = sum of new*prefix over its chunks."""
        self.model.observe((1.0, float(new_tokens), float(attention)), seconds)

    def predict(self, new_tokens: int, prefix_len: int) -> float:
        return self.predict_forward(new_tokens, new_tokens * prefix_len)

    def predict_forward(self, new_tokens: int, attention: float, num_forwards: int = 1) -> float:
        """Seconds of `num_forwards` forwards that together compute these features."""
        return self.model.predict((float(num_forwards), float(new_tokens), float(attention)))

    def predict_prompt(self, prompt_len: int, cached_len: int, chunk_size: int) -> float:
        """Seconds to prefill positions [cached_len, prompt_len) alone, `chunk_size` at a time."""
        new, attention, forwards = prompt_features(prompt_len, cached_len, chunk_size)
        return self.predict_forward(new, attention, forwards)


def prompt_features(prompt_len: int, cached_len: int, chunk_size: int) -> tuple[int, int, int]:
    """(new tokens, sum of new*prefix, forwards) of prefilling [cached_len, prompt_len) in chunks
    of `chunk_size`. Closed form: chunks start at cached_len + k*chunk_size."""
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    new = max(0, prompt_len - cached_len)
    forwards = -(-new // chunk_size)
    if forwards == 0:
        return 0, 0, 0
    full, last = forwards - 1, new - (forwards - 1) * chunk_size
    # full chunks: sum_k chunk*(cached + k*chunk), k < full; then the last (shorter) chunk.
    attention = chunk_size * (full * cached_len + chunk_size * full * (full - 1) // 2)
    attention += last * (cached_len + full * chunk_size)
    return new, attention, forwards


class DecodeCost:
    """Seconds of one decode step = a + b*batch_size + c*total_context_tokens."""

    def __init__(self, prior=DECODE_PRIOR, prior_weight=DEFAULT_PRIOR_WEIGHT, decay=DEFAULT_DECAY):
        self.model = LinearCostModel(prior, prior_weight, decay, DECODE_SCALE)

    @property
    def num_samples(self) -> int:
        return self.model.num_samples

    def observe(self, batch: int, total_context: int, seconds: float) -> None:
        self.model.observe((1.0, float(batch), float(total_context)), seconds)

    def predict(self, batch: int, total_context: int) -> float:
        return self.model.predict((1.0, float(batch), float(total_context)))

    def max_batch_within(self, tpot_s: float, mean_context: float, upper: int = 1 << 20) -> int:
        """The largest batch whose predicted step, each request holding `mean_context` tokens,
        stays within `tpot_s`; at least 1 (one request always runs), at most `upper`."""
        a, b, c = self.model.weights
        per_request = b + c * max(0.0, mean_context)
        if per_request <= 0:
            return upper
        return max(1, min(upper, math.floor((tpot_s - a) / per_request)))


class RecentSamples:
    """A node's timed forwards since its last heartbeat: `add` per forward, `take` per heartbeat
    (the newest `MAX_TIMING_SAMPLES`, then empty). Bounded, so a heartbeat stays small."""

    def __init__(self, limit: int = MAX_TIMING_SAMPLES):
        self._samples: deque[list[float]] = deque(maxlen=limit)

    def add(self, x1: float, x2: float, seconds: float) -> None:
        self._samples.append([float(x1), float(x2), float(seconds)])

    def take(self) -> list[list[float]]:
        out = list(self._samples)
        self._samples.clear()
        return out
