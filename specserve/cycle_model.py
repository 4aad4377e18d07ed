"""How long one engine cycle takes, as a function of the batch and the speculation arm.

A cycle is everything between the ends of two engine steps: the verify forward, the wait for the
drafts, the link, scheduling and output handling. Its seconds are modelled as a line in

    x = [1, B, B*k, speculating, drafting misses * k, prompt tokens prefilled, sequences that left,
         speculating * prompt tokens prefilled]

(B sequences, k draft tokens each) plus each arm's own mean residual over its steady cycles in the
bucket itself, shrunk toward the line as far as the other arms sit on it, fitted by least squares
to the last ``WINDOW`` steady cycles of every arm and as many of its cycles that prefilled prompts
or followed departures. A prompt token may cost more in a cycle that speculates (the draft
prefills it too, and the target verifies blocks beside it): the last term. Every batch-size bucket
(1, 2, 4, ...) keeps its own fit, to which a cycle contributes with a weight that falls with its
distance in octaves of batch size, so a bucket that has never run borrows from its neighbours. An
arm not run keeps its windows: what it cost is known until it is measured again, and a window whose
newest cycle is ``STALE`` cycles old restarts then (the host it measured may have moved). Pure
numpy; knows nothing of engines or drafts.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import deque

import numpy as np

NUM_FEATURES = 8
MAX_BUCKET_LOG2 = 12  # buckets 1 .. 4096 sequences
WINDOW = 32  # measured cycles kept per arm, bucket and kind (steady, or prefilling / after departures)
KERNEL_OCTAVES = 1.0  # a cycle B octaves away from a bucket weighs exp(-B^2 / 2 / KERNEL_OCTAVES^2) there
ARM_PRIOR_CYCLES = 8.0  # an arm's mean residual is shrunk toward the line as if by this many cycles at zero, until the noise is known
DAMPING = 1e-6  # ridge on each coefficient relative to its own data: unobserved directions stay 0
SPECULATING_PROMPTS_PRIOR = 0.1  # a prompt token costs the same whatever the arm until target-only's prefills say otherwise
STALE = 512  # a window whose newest cycle is older than this many cycles (any arm's) restarts at its next
OUTLIER = 4.0  # a steady cycle (no prefill, none left) over such cycles' median + this many MADs in its arm window: that much


@functools.lru_cache(maxsize=4096)
def bucket_of(batch_size: int) -> int:
    """The bucket (log2 of a power of two) whose fit decides for ``batch_size``: the nearest in octaves."""
    return min(MAX_BUCKET_LOG2, max(0, round(math.log2(max(1, batch_size)))))


def features(batch_size: int, k: int, cache_only: bool, prefill_tokens: int = 0, left: int = 0) -> np.ndarray:
    spec = 1.0 if k else 0.0
    return np.array([1.0, batch_size, batch_size * k, spec, spec * (not cache_only) * k, prefill_tokens, left, spec * prefill_tokens],
                    dtype=np.float64)


def _steady(row: list) -> bool:
    """A window row of a cycle that prefilled no prompt and followed no departure."""
    return not (row[1][5] or row[1][6])


@functools.lru_cache(maxsize=1024)
def _features_of(batch_size: int, arms: tuple) -> np.ndarray:
    return np.array([features(batch_size, k, c) for k, c in arms])


@functools.lru_cache(maxsize=4096)
def _weights(batch_size: int) -> list[tuple[int, float]]:
    """The buckets a cycle at ``batch_size`` informs, and its weight in each."""
    where = math.log2(max(1, batch_size))
    near = range(max(0, bucket_of(batch_size) - 2), min(MAX_BUCKET_LOG2, bucket_of(batch_size) + 2) + 1)
    return [(b, w) for b in near if (w := math.exp(-0.5 * ((where - b) / KERNEL_OCTAVES) ** 2)) >= 0.2]


class _Fit:
    """One bucket's sums over the windows it sees: X'WX, X'Wy and, per arm, sum w x, sum w y, sum w."""

    __slots__ = ("xx", "xy", "arms", "weight", "theta", "inv", "dirty", "sq", "sqw", "priors")

    def __init__(self):
        self.xx = np.zeros((NUM_FEATURES, NUM_FEATURES))
        self.xy = np.zeros(NUM_FEATURES)
        self.arms: dict[tuple, list] = {}
        self.weight = 0.0
        self.theta = np.zeros(NUM_FEATURES)
        self.inv = np.zeros((NUM_FEATURES, NUM_FEATURES))  # (X'WX)^-1: the coefficients' covariance over the noise
        self.dirty = False
        self.sq = self.sqw = 0.0  # faded sum of squared relative residuals (one cycle's noise) and its weight
        self.priors: dict = {}  # arm -> its shrinkage, in cycles (ARM_PRIOR_CYCLES where not known)

    def add(self, arm: tuple | None, x: np.ndarray, xx: np.ndarray | None, seconds: float, w: float) -> None:
        """A row of weight ``w`` (negative: taken out); ``xx`` None: only its seconds change by ``seconds``;
        ``arm`` None: a row of the line alone, not of any arm's own residual."""
        a = None if arm is None else self.arms.get(arm)
        if a is None and arm is not None:
            a = self.arms[arm] = [np.zeros(NUM_FEATURES), 0.0, 0.0]
        if xx is not None:
            self.xx += w * xx
            self.weight += w
            if a is not None:
                a[0] += w * x
                a[2] += w
        self.xy += (w * seconds) * x
        if a is not None:
            a[1] += w * seconds
        self.dirty = True

    def solve(self) -> np.ndarray:
        if self.dirty:
            ridge = DAMPING * np.diag(self.xx) + 1e-9
            ridge[7] += SPECULATING_PROMPTS_PRIOR * self.xx[7, 7]
            self.inv = np.linalg.inv(self.xx + np.diag(ridge))
            self.theta = self.inv @ self.xy
            self.priors = self._arm_priors()
            self.dirty = False
        return self.theta

    def _arm_priors(self) -> dict:
        """Per arm, the cycles of zero residual its mean residual is shrunk with: one cycle's noise over
        the spread of the *other* arms' mean departures from the line, each less its own noise
        (empirical Bayes, an arm's own cycles left out so a stall cannot vouch for itself). Where the
        arms sit on the line, a new arm is held to it; where they do not (a cost that is no line in k,
        as on a CPU target), an arm is believed from its first measured cycles."""
        if self.sqw < 4:
            return {}
        noise = self.sq / self.sqw
        departures = {arm: ((y - float(self.theta @ x)) / y) ** 2 - noise / n for arm, (x, y, n) in self.arms.items() if n > 0.5 and y > 0}
        total, out = sum(departures.values()), {}
        for arm in self.arms:
            others = len(departures) - (arm in departures)
            if others:
                spread = (total - departures.get(arm, 0.0)) / others
                out[arm] = min(WINDOW, noise / max(spread, noise / WINDOW))
        return out

    def _offset(self, arm: tuple) -> float:
        """The arm's own mean residual over its steady cycles, shrunk toward the line by its prior."""
        a = self.arms.get(arm)
        return 0.0 if a is None else (a[1] - float(self.solve() @ a[0])) / (a[2] + self.priors.get(arm, ARM_PRIOR_CYCLES))

    def predict(self, x: np.ndarray, arm: tuple) -> float:
        return max(1e-6, float(self.solve() @ x) + self._offset(arm))

    def predict_many(self, xs: np.ndarray, arms: list[tuple]) -> tuple[np.ndarray, np.ndarray]:
        """Each arm's seconds, and x' (X'WX)^-1 x: its prediction's variance over the noise's."""
        out = xs @ self.solve()
        for i, arm in enumerate(arms):
            out[i] += self._offset(arm)
        return np.maximum(out, 1e-6), np.maximum(0.0, np.einsum("ij,jk,ik->i", xs, self.inv, xs))


class CycleModel:
    def __init__(self):
        self.fits: dict[int, _Fit] = {}
        self.windows: dict[tuple, deque] = {}  # (arm, bucket, steady) -> its last WINDOW cycles: [batch size, x, x x', seconds, cycles seen]
        self._seen = 0

    def add(self, batch_size: int, arm: tuple, prefill_tokens: int, seconds: float, left: int = 0) -> None:
        """A measured cycle; ``left``: sequences that left the batch since the cycle before (their output
        handling and closing land in this one). Like prompt tokens, a cost of requests, not of the arm."""
        arm = tuple(arm)
        x = features(batch_size, arm[0], arm[1], prefill_tokens, left)
        own = self.fits.get(bucket_of(batch_size))
        self._seen += 1
        if own is not None and own.weight > 1.0 and self._seen % 4 == 0:  # the noise, sampled: it moves slowly
            predicted = own.predict(x, arm)
            own.sq = 0.97 * own.sq + min(4.0, ((seconds - predicted) / predicted) ** 2)
            own.sqw = 0.97 * own.sqw + 1.0
        row = [batch_size, x, np.outer(x, x), seconds, self._seen]
        # (cycles that prefilled or followed departures keep a window of their own: rarer, they would be pushed out)
        window = self.windows.setdefault((arm, bucket_of(batch_size), _steady(row)), deque())
        stale = window and self._seen - window[-1][4] > STALE  # it measured a host that may have moved since
        window.append(row)
        self._spread(arm, row, seconds, 1.0)
        while len(window) > (1 if stale else WINDOW):
            old = window.popleft()
            self._spread(arm, old, old[3], -1.0)
        plain = window if _steady(row) else ()  # (prompts and departures explain the others)
        if len(plain) >= 5:  # a stall (a garbage collection, a busy host) must not decide between arms
            median = statistics.median(r[3] for r in plain)  # (pure Python: numpy's costs ~10x more on 32 values)
            cap = median + OUTLIER * statistics.median(abs(r[3] - median) for r in plain)
            for r in plain:
                if r[3] > cap:
                    self._spread(arm, r, cap - r[3], 1.0, moved=True)
                    r[3] = cap

    def _spread(self, arm: tuple, row: list, seconds: float, sign: float, moved: bool = False) -> None:
        """Add (sign 1) or take out (-1) a window row in every bucket it informs; ``moved``: only its seconds change."""
        batch_size, x, xx = row[:3]
        own = bucket_of(batch_size) if _steady(row) else None
        for b, w in _weights(batch_size):
            fit = self.fits.get(b)
            if fit is None:
                fit = self.fits[b] = _Fit()
            fit.add(arm if b == own else None, x, None if moved else xx, seconds, sign * w)

    def _fit(self, batch_size: int) -> _Fit | None:
        fit = self.fits.get(bucket_of(batch_size))
        return fit if fit is not None and fit.weight > 0.05 else None

    def measured(self, batch_size: int, arm: tuple) -> int:
        """Steady cycles (no prompt prefilled, none left before) of ``arm`` in this batch size's own
        bucket's window: a draining batch's cycles are mostly departures, and say little of a steady one."""
        return len(self.windows.get((tuple(arm), bucket_of(batch_size), True), ()))

    def seconds(self, batch_size: int, arm: tuple, prefill_tokens: int = 0) -> float | None:
        """Predicted seconds of a cycle of ``arm`` at ``batch_size`` (None: nothing measured near it)."""
        fit = self._fit(batch_size)
        return None if fit is None else fit.predict(features(batch_size, arm[0], arm[1], prefill_tokens), tuple(arm))

    def predict_all(self, batch_size: int, arms: tuple, prefill_tokens: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """``seconds`` of each arm (with ``prefill_tokens[i]`` prompt tokens in arm i's cycle; none by
        default) and the ``uncertainty`` of its steady part (a prompt's cost per token generated moves
        every arm alike, bar the speculating term)."""
        fit = self._fit(batch_size)
        if fit is None:
            return None
        steady = _features_of(batch_size, arms)
        seconds, spread = fit.predict_many(steady, arms)
        if prefill_tokens is not None:
            theta = fit.solve()
            seconds = np.maximum(seconds + prefill_tokens * (theta[5] + theta[7] * steady[:, 3]), 1e-6)
        return seconds, self.noise(batch_size) * np.sqrt(spread)

    def noise(self, batch_size: int) -> float:
        """Relative standard deviation of one cycle around its prediction in this bucket (0.2 before any)."""
        fit = self._fit(batch_size)
        return 0.2 if fit is None or fit.sqw < 4 else math.sqrt(fit.sq / fit.sqw)

    def coefficients(self, batch_size: int) -> list[float] | None:
        fit = self._fit(batch_size)
        return None if fit is None else [float(t) for t in fit.solve()]
