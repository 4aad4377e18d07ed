"""Choose each step's speculation from one model: how many draft tokens (k), and whether a draft that
cannot answer from its speculation cache drafts on the critical path or answers *cache-only* (with
what its cache holds, so one miss cannot make the whole batch wait).

An *arm* is one such choice; (0, False) is target-only. At batch size B an arm yields B x E tokens per
cycle of T seconds: E = 1 + sum over j <= k of a_1 ... a_j x c_j (a_i the per-position acceptance, c_j
the cache's coverage per bucket and k, 1 when misses are drafted); T is the cycle model's prediction
(``cycle_model.py``: a line fitted to measured whole cycles, shared across batch sizes, plus each
arm's own mean residual) for a cycle that also prefills the load's share of prompts: r x B x E
prompt tokens, r the prompt tokens the bucket's cycles prefilled per token they generated (a
speculating cycle may pay more for them). Each step runs the arm with the most predicted tokens per
second; k = 0 whenever target-only has it. The rules (``docs/controller.md`` says why each is there):

- Warm-up: a bucket runs k = max (both modes), k = max / 2 and target-only (last: a bucket's first
  cycles are cold) for ``RUN`` cycles each, but of the speculative arms only those the fit does not
  know when their turn comes (``UNKNOWN``), and target-only unless it measured steady cycles of it
  or even its optimistic prediction (plus ``OPTIMISM`` standard errors) is far behind a known arm.
- Settling: a run of one arm is measured from its ``SETTLE + 1``-th cycle, its switch counted (the first pay for it).
- Outliers: a steady cycle counts at most its arm's median + ``cycle_model.OUTLIER`` MADs.
- Exploration: every ``interval`` choices (``EXPLORE_MIN``, doubled up to ``EXPLORE_MAX`` while
  explorations change nothing) the arm best by its prediction plus ``OPTIMISM`` standard errors runs
  ``PROBE`` cycles if that could change the choice; every ``EXPLORE_MAX`` choices the least recently
  measured neighbour (k +- 1, the other mode, target-only; from target-only k = 1 and k = max in
  each mode, by turns) runs regardless; an arm measured again ``cycle_model.STALE`` cycles after its
  last restarts its window.
- Budget: an exploration's predicted cost (tokens fewer than the running arm's) is spread over enough
  choices to stay within ``EXPLORE_BUDGET`` of them.
- Hysteresis: a switch needs a predicted gain over ``HYSTERESIS``, and from target-only also over
  ``SWITCH_Z`` standard errors of the two predictions' difference; it goes to the best arm that clears its
  own, explored first if the bucket has not measured it.
- Keeping the drafts current: at k = 0 the committed tokens reach the drafts unawaited every
  ``PUSH_EVERY`` steps and just before an exploration into speculation.

Both target engines (``EngineCore``, the vLLM proposer) decide through ``step_plan.py``. Decisions are
a pure function of the observations (``trace``, ``replay``). Pure Python and numpy.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .cycle_model import CycleModel, bucket_of


class Arm(NamedTuple):
    k: int
    cache_only: bool


TARGET_ONLY = Arm(0, False)
SETTLE = 2
RUN = SETTLE + 3  # cycles of a warm-up arm: SETTLE unmeasured, then measured
PROBE = SETTLE + 2  # cycles of an exploration
EXPLORE_MIN, EXPLORE_MAX = 32, 512
EXPLORE_BUDGET = 0.01  # the share of a bucket's cycles its explorations may cost, by prediction
OPTIMISM, HYSTERESIS, SWITCH_Z = 2.0, 0.02, 1.0  # (standard errors, a relative gain, standard errors)
UNKNOWN = 1.0  # a prediction whose standard error is this share of itself or more: the fit does not know that arm
DECIDE_EVERY = PUSH_EVERY = 4  # choices between two looks at the predictions (they move slowly; a look costs ~50 us)
LOAD_CYCLES = 200  # a bucket's r (prompt tokens prefilled per token generated) averages over about this many cycles
OBSERVATIONS = 500  # a position's acceptance and coverage: the mean of the first this many draws, an EMA after
PRIOR_ACCEPTANCE, PRIOR_COVERAGE = 0.7, 0.5
TRACE_EVENTS = 500_000


def _ema(old: float | None, new: float, w: float) -> float:
    return new if old is None else (1 - w) * old + w * new


def _count(estimate: list[float], counts: list[int], num_positions: int, num_hits: int) -> None:
    """One draw of positions 0 .. num_positions - 1, the first ``num_hits`` of them hits."""
    for pos in range(min(num_positions, len(estimate))):
        n = counts[pos] = counts[pos] + 1
        estimate[pos] += (float(pos < num_hits) - estimate[pos]) / min(n + 1, OBSERVATIONS)


@functools.lru_cache(maxsize=64)
def _arms(max_k: int, cache: bool) -> tuple[Arm, ...]:
    return (TARGET_ONLY,) + tuple(Arm(k, m) for k in range(1, max_k + 1) for m in ((False, True) if cache else (False,)))


@dataclass
class _Bucket:
    current: Arm | None = None
    queued: list = field(default_factory=list)  # arms of the next choices (warm-up, an exploration)
    warmup: list = field(default_factory=list)  # the warm-up's arms still to run
    choices: int = 0
    interval: int = EXPLORE_MIN  # choices between explorations
    next_explore: int = EXPLORE_MIN
    explored: Arm | None = None  # the arm of the exploration under way
    next_forced: int = EXPLORE_MAX  # the next exploration that runs whatever the predictions
    last_run: dict = field(default_factory=dict)  # arm -> the choice it last ran at


class SpeculationController:
    def __init__(self, max_k: int, adaptive: bool = True, trace: bool | None = None, cache_only: bool = False):
        """``cache_only``: not adaptive, the fixed arm answers from the drafts' caches alone (where they draft ahead)."""
        self.max_k, self.adaptive, self.fixed_cache_only = max_k, adaptive, cache_only
        self.model = CycleModel()
        self.acceptance = [PRIOR_ACCEPTANCE] * max(max_k, 1)
        self._acceptance_n = [0] * max(max_k, 1)
        self.coverage: dict[tuple[int, int], list[float]] = {}  # (bucket, k asked) -> P(the block holds >= j + 1 tokens)
        self._coverage_n: dict[tuple[int, int], list[int]] = {}
        self.verify_s: dict[tuple[int, int], float] = {}  # (bucket, tokens per row) -> the step's cost but the wait
        self.link_floor_s: float | None = None  # the round trip without the draft's own work: falls fast, rises slowly
        self.link_s = self.draft_step_s = self.hit_rate = None  # reported only
        self.buckets: dict[int, _Bucket] = {}
        self.load: dict[int, list[float]] = {}  # bucket -> [prompt tokens prefilled, tokens generated], faded
        self._run: tuple = (None, 0)  # the arm of the current run of pure cycles, and its length
        self._k0_steps = 0
        self.k, self.cache_only, self.arm = max_k, False, None  # this step's choice (arm None: nothing to measure)
        # SPECSERVE_TRACE=1: every observation and choice, the last TRACE_EVENTS of them (``replay``)
        self.trace = deque(maxlen=TRACE_EVENTS) if (os.environ.get("SPECSERVE_TRACE") if trace is None else trace) else None

    # -- the model -----------------------------------------------------------------------------
    def _coverage(self, batch_size: int, k: int) -> list[float]:
        """Per bucket and k asked: a deeper ask leaves the draft less time for each foreseen branch. One
        not measured yet reads the nearest measured (the same bucket first), as it is now."""
        key = (bucket_of(batch_size), k)
        if key in self.coverage:
            return self.coverage[key]
        near = min(self.coverage, key=lambda c: (abs(c[0] - key[0]), abs(c[1] - k)), default=None)
        old = self.coverage[near] if near is not None else [PRIOR_COVERAGE]
        return [old[min(j, len(old) - 1)] for j in range(k)]

    def expected_tokens(self, k: int, cache_only: bool = False, batch_size: int = 1) -> float:
        """Tokens per sequence a cycle of (k, cache_only) yields (the 1 is the recovered or bonus token)."""
        reach = itertools.accumulate(self.acceptance[:k], lambda x, y: x * y)  # (pure Python: numpy's costs more at k <= 8)
        return 1.0 + sum(r * c for r, c in zip(reach, self._coverage(batch_size, k) if cache_only else [1.0] * k))

    def rates(self, batch_size: int, cache: bool) -> dict[Arm, float]:
        """Predicted tokens per second of every arm at ``batch_size`` (empty: no cycle measured near it)."""
        return {a: r for a, (r, _) in self._predictions(batch_size, cache).items()}

    def _predictions(self, batch_size: int, cache: bool) -> dict[Arm, tuple[float, float]]:
        """Per arm: the load's predicted tokens per second, and its steady cycle's relative standard error."""
        arms = self.arms(cache)
        tokens = np.array([self.expected_tokens(a.k, a.cache_only, batch_size) for a in arms])
        prompts, generated = self.load.get(bucket_of(batch_size), (0.0, 0.0))
        predicted = self.model.predict_all(batch_size, arms, prompts / generated * batch_size * tokens if generated else None)
        if predicted is None:
            return {}
        seconds, uncertainty = predicted
        return dict(zip(arms, zip((batch_size * tokens / seconds).tolist(), uncertainty.tolist())))

    def arms(self, cache: bool) -> tuple[Arm, ...]:
        return _arms(self.max_k, cache)

    # -- choosing ------------------------------------------------------------------------------
    def choose(self, batch_size: int, have_draft: bool = True, cache: bool = False) -> int:
        """This step's k (rows cap it by their room); sets ``cache_only`` and ``arm``. ``cache``: some
        draft drafts ahead, so answering from its cache alone is an option."""
        arm = self._choose(batch_size, have_draft, cache)
        if self.trace is not None:
            self.trace.append(("choose", batch_size, have_draft, cache, None if arm is None else tuple(arm)))
        self.arm = arm
        self.k, self.cache_only = arm if arm is not None else (0, False)
        return self.k

    def _choose(self, batch_size: int, have_draft: bool, cache: bool) -> Arm | None:
        if not have_draft or self.max_k == 0:
            return None
        if not self.adaptive:
            return Arm(self.max_k, self.fixed_cache_only and cache)
        st = self.buckets.setdefault(bucket_of(batch_size), _Bucket())
        st.choices += 1
        if st.current is None:
            k, st.current = self.max_k, TARGET_ONLY
            st.warmup = [Arm(k, False)] + [Arm(k, True)] * cache + [Arm((k + 1) // 2, False)] * (k > 1) + [TARGET_ONLY]
        while st.warmup and not st.queued:  # the next warm-up arm, unless the fit has come to know it meanwhile
            arm, predicted = st.warmup.pop(0), self._predictions(batch_size, cache)
            rate, u = predicted.get(arm, (0.0, UNKNOWN))
            known = u < UNKNOWN
            if not arm.k:  # target-only: measured here, or known from neighbours and behind a known arm even optimistically
                ahead = [r for a, (r, v) in predicted.items() if a.k and v < UNKNOWN and (cache or not a.cache_only)]
                outclassed = known and rate * (1 + OPTIMISM * u) * (1 + HYSTERESIS) < max(ahead, default=0.0)
                known = predicted and (self.model.measured(batch_size, arm) >= RUN - SETTLE or outclassed)
            if not known:
                st.queued = [arm] * RUN
        if not st.queued:
            self._decide(batch_size, st, cache)
        arm = st.queued.pop(0) if st.queued else st.current
        if arm.cache_only and not cache:  # no draft drafts ahead now (or a seeded request): misses get drafted
            arm = Arm(arm.k, False)
        st.last_run[arm] = st.choices
        return arm

    def _decide(self, batch_size: int, st: _Bucket, cache: bool) -> None:
        ended = st.explored is not None
        due = st.choices >= st.next_explore
        if not (ended or due or st.choices % DECIDE_EVERY == 0 or not st.last_run):  # (nothing run yet: a skipped warm-up)
            return
        predicted = self._predictions(batch_size, True)
        if not predicted:  # the warm-up's cycles were not measurable (idle gaps): keep the arm until some are
            return
        rates = {a: r for a, (r, _) in predicted.items()}
        allowed = {a: r for a, r in rates.items() if cache or not a.cache_only}
        best = max(allowed, key=allowed.get)
        mine = rates.get(st.current)
        # the best of the arms that clear their own hysteresis: one the fit knows little of must not block one it knows
        clear = [a for a in allowed if a != st.current and (mine is None or allowed[a] > mine * (1 + self._hysteresis(predicted, a, st.current)))]
        if clear:
            pick = max(clear, key=allowed.get)
            if not (self.model.measured(batch_size, pick) or (ended and st.explored == pick)):
                st.explored, st.queued = pick, [pick] * PROBE  # the line alone predicts it here: measured before it is run
                return
            st.current, mine, st.interval = pick, allowed[pick], EXPLORE_MIN
        if not (ended or due):
            return
        optimistic = {a: r * (1.0 + OPTIMISM * predicted[a][1]) for a, r in allowed.items() if a != st.current}
        if ended:  # explore less often while explorations change nothing
            if best == st.current:
                st.interval = min(2 * st.interval, EXPLORE_MAX)
            st.explored, st.next_explore = None, st.choices + st.interval  # (an interval is at least EXPLORE_MIN)
            return
        forced = st.choices >= st.next_forced
        if forced:  # the least recently measured neighbour, whatever its prediction
            k, mode = st.current
            near = [Arm(k2, mode) for k2 in (k - 1, k + 1) if 1 <= k2 <= self.max_k] + ([Arm(k, not mode)] if cache else [])
            # (from target-only the ends of the line: k = 1 alone could not show a stale k = max wrong)
            ends = [Arm(1, cache), Arm(self.max_k, False)] + [Arm(self.max_k, True)] * cache
            probe = min(near + [TARGET_ONLY] if k else ends, key=lambda a: st.last_run.get(a, -1))
        else:  # the arm with the best optimistic rate, if it could change the choice
            probe = max(optimistic, key=optimistic.get, default=None)
            if probe is not None and optimistic[probe] <= mine * (1 + HYSTERESIS):
                probe = None
        if probe is not None:
            spacing = self._spacing(rates, probe, mine)
            if forced:
                st.next_forced = st.choices + max(EXPLORE_MAX, spacing)
            st.explored, st.queued = probe, [probe] * PROBE
            st.interval = max(st.interval, spacing)
        else:
            st.interval = min(2 * st.interval, EXPLORE_MAX)
            st.next_explore = st.choices + st.interval

    @staticmethod
    def _hysteresis(predicted: dict, best: Arm, current: Arm) -> float:
        """The relative gain a switch needs; from target-only (a cost that cannot surprise) also ``SWITCH_Z`` s.e."""
        if current != TARGET_ONLY or current not in predicted:
            return HYSTERESIS
        return max(HYSTERESIS, SWITCH_Z * float(np.hypot(predicted[best][1], predicted[current][1])))

    @staticmethod
    def _spacing(rates: dict, probe: Arm, mine: float | None) -> int:
        """Choices an exploration of ``probe`` must be spread over so that its predicted cost (the cycles
        it delivers fewer tokens than the running arm would) stays within ``EXPLORE_BUDGET`` of them."""
        theirs = rates.get(probe)
        if not mine or theirs is None or theirs >= mine:
            return 0
        return int(PROBE * (1.0 - theirs / mine) / EXPLORE_BUDGET)

    def push_due(self, batch_size: int) -> bool:
        """Whether a k = 0 step should hand the drafts its deltas (unawaited), so that speculation,
        when it resumes, finds their state and caches current."""
        if not self.adaptive:
            return False
        if self.trace is not None:
            self.trace.append(("push", batch_size))
        self._k0_steps += 1
        st = self.buckets.get(bucket_of(batch_size))
        soon = st is not None and (st.next_explore - st.choices <= 1 or (st.queued and st.queued[0].k))
        return bool(soon) or self._k0_steps % PUSH_EVERY == 0

    # -- observations --------------------------------------------------------------------------
    def observe_acceptance(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Per position, P(accepted | the drafts before it were): the mean of the draws so far (the prior
        counting as one) up to ``OBSERVATIONS`` of them, an EMA after."""
        if self.trace is not None:
            self.trace.append(("acceptance", num_draft_tokens, num_accepted))
        _count(self.acceptance, self._acceptance_n, min(num_accepted + 1, num_draft_tokens), num_accepted)

    def observe_coverage(self, num_asked: int, num_got: int, batch_size: int = 1) -> None:
        """A block: its first ``num_got`` of the ``num_asked`` draft tokens were in the cache (either mode)."""
        if self.trace is not None:
            self.trace.append(("coverage", num_asked, num_got, batch_size))
        if num_asked > 0:
            key = (bucket_of(batch_size), num_asked)
            if key not in self.coverage:  # its first measurement: from the nearest's estimate
                self.coverage[key], self._coverage_n[key] = self._coverage(batch_size, num_asked), [0] * num_asked
            _count(self.coverage[key], self._coverage_n[key], num_asked, num_got)

    def observe_step(self, batch_size: int, tokens_per_row: int, target_s: float, wait_s: float = 0.0,
                     draft_compute_s: float = 0.0, draft_step_s: float = 0.0, num_blocks: int = 0, num_hits: int = 0) -> None:
        """A verify step's cost apart from the wait for the drafts, and the link's floor: the draft's time
        budget. The draft's step time and the cache's hit rate are reported (``state``), not modelled."""
        if self.trace is not None:
            self.trace.append(("step", batch_size, tokens_per_row, target_s, wait_s, draft_compute_s, draft_step_s, num_blocks, num_hits))
        key = (bucket_of(batch_size), tokens_per_row)
        self.verify_s[key] = _ema(self.verify_s.get(key), target_s, 0.2)
        if wait_s > 0.0:
            link = max(0.0, wait_s - draft_compute_s)
            self.link_s = _ema(self.link_s, link, 0.1)
            self.link_floor_s = link if self.link_floor_s is None else min(link, 0.99 * self.link_floor_s + 0.01 * link)
        self.draft_step_s = draft_step_s or self.draft_step_s
        if num_blocks:
            self.hit_rate = _ema(self.hit_rate, num_hits / num_blocks, 0.1)

    def observe_cycle(self, batch_size: int, num_tokens: int, seconds: float, arm, pure: bool = True,
                      prefill_tokens: int = 0, left: int = 0) -> None:
        """One engine cycle (between the ends of two steps): its tokens, seconds and arm; ``pure``: all of
        it ran that arm (not a switch); ``prefill_tokens``: prompt tokens its step also computed; ``left``:
        sequences that left the batch since the cycle before. The tokens weigh the prompts (r), not E."""
        if self.trace is not None:
            self.trace.append(("cycle", batch_size, num_tokens, seconds, None if arm is None else tuple(arm), pure, prefill_tokens, left))
        load = self.load.get(bucket_of(batch_size), (0.0, 0.0))
        self.load[bucket_of(batch_size)] = [x + n - x / LOAD_CYCLES for x, n in zip(load, (prefill_tokens, num_tokens))]
        if arm is None:
            self._run = (None, 0)
            return
        arm = Arm(*arm)  # (a run counts from its switch, the impure cycle where the vLLM target makes it)
        self._run = (arm, self._run[1] + 1) if self._run[0] == arm else (arm, 1)
        if pure and self._run[1] > SETTLE and seconds > 0:
            self.model.add(batch_size, arm, prefill_tokens, seconds, left)

    # -- what the drafts and the metrics read ------------------------------------------------------
    def budget(self, batch_size: int, k: int) -> float:
        """Seconds from the draft's reply to the next request: the verify and the link (0: not known yet)."""
        b = bucket_of(batch_size)
        known = [w for (bb, w) in self.verify_s if bb == b]
        if not known or self.link_floor_s is None:
            return 0.0
        width = min(known, key=lambda w: abs(w - (k + 1)))
        return self.verify_s[(b, width)] + self.link_floor_s

    def state(self) -> dict:
        arms = {str(1 << b): f"{st.current.k}{'c' if st.current.cache_only else ''}"
                for b, st in sorted(dict(self.buckets).items()) if st.current is not None}
        fits = {str(1 << b): c for b in sorted(dict(self.model.fits)) if (c := self.model.coefficients(1 << b)) is not None}
        rates = {f"{1 << b}/{a.k}{'c' if a.cache_only else ''}": round(r, 1) for b in sorted(dict(self.buckets))
                 for a, r in self.rates(1 << b, True).items()}
        out = {"k": self.k, "max_k": self.max_k, "cache_only": self.cache_only, "adaptive": self.adaptive,
               "arm_by_bucket": arms, "acceptance_per_pos": list(self.acceptance),
               "coverage_per_pos": {f"{1 << b}/{k}": list(c) for (b, k), c in sorted(dict(self.coverage).items())},
               "cycle_model": fits,  # seconds = c . [1, B, B*k, speculating, drafting misses * k, prefill tokens, left, speculating * prefill tokens]
               "predicted_tokens_per_s": rates,  # by bucket and arm (k, 'c' for cache-only)
               "link_ms": (self.link_s or 0.0) * 1e3, "link_floor_ms": (self.link_floor_s or 0.0) * 1e3,
               "draft_step_ms": (self.draft_step_s or 0.0) * 1e3, "cache_hit_rate": self.hit_rate or 0.0}
        for _ in range(10 if self.trace is not None else 0):  # (the engine's thread may append meanwhile: a deque then refuses)
            with contextlib.suppress(RuntimeError):
                out["trace"] = list(self.trace)
                break
        return out


def replay(trace: Iterable[tuple], controller: SpeculationController) -> list:
    """Feed a recorded trace's observations to ``controller``, in order; the arms it chose, one per choice."""
    chosen, observe = [], {"acceptance": controller.observe_acceptance, "coverage": controller.observe_coverage,
                           "step": controller.observe_step, "cycle": controller.observe_cycle, "push": controller.push_due}
    for kind, *args in trace:
        if kind == "choose":
            controller.choose(*args[:3])
            chosen.append(None if controller.arm is None else tuple(controller.arm))
        elif kind in observe:
            observe[kind](*args)
    return chosen
