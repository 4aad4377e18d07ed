"""Choose each step's speculation by measured goodput: how many draft tokens (k), and whether a
draft that cannot answer from its speculation cache drafts on the critical path (or answers
*cache-only*, with what its cache holds, so one miss cannot make the whole batch wait).

An *arm* is one such choice, (k, cache only); (0, False) is target-only (nothing sent). Per
batch-size bucket, the controller keeps each arm's realized rate: tokens per sequence over the
arm's mean cycle time, both over its last ``REALIZED_WINDOW`` steady cycles (a cycle is everything
between the ends of two engine steps; steady: the third in a row on one arm, since the first
cycles after a switch still pay for it, and target-only's eighth after speculation
(``SETTLE_TO_CYCLES``); cycles over ``SLOW_CYCLE_CAP`` x the window's median count as that; a
draining batch's cycles, smaller than the bucket's last ``RECENT_BATCHES``, are not measured). It
runs the best arm and, every ``probe_every`` choices of the bucket (backing off to ``PROBE_GAP`` x
that while probes confirm the choice, faster and to ``PROBE_GAP_LOST`` x once they lose
outright), probes a neighbour for ``probe_len`` steps (three times that between speculating and
not; cut short once it scores under ``PROBE_CUT`` x the current arm (``_score``), sooner under
``PROBE_LOST`` x): k - 1, k + 1, the other mode, or target-only, the least recently measured
first (target-only first once the bucket has just left it for speculation, and within
``probe_every`` choices once its rating beats the speculative arm's score); a bucket's first
choices run a fixed set of arms (``warmup_arms``) so each has a rate (the best speculative one then
runs as a probe from target-only, measured afresh, before the bucket adopts it), unless a settled
bucket beside it implies the answer (``_inherited``: a draining batch keeps speculating), and
target-only is not probed while the current arm delivers over ``PROBE_BEATEN`` times its recent rate. A
bucket leaves target-only for speculation only on a win beyond the noise of the two rates
(``_beyond_noise``); a closer one is measured on more cycles first. Measured cycle times carry
every cost (the verify's growth with width, waits on misses, the link, the engine's scheduling
and output handling) with nothing modelled, which is what makes the choice hold on both target
engines: on the demo pair at batch 8 the cost model below had picked the worst arm (k = 3,
drafting misses: 0.82x target-only) where cache-only arms delivered 1.1x. Tokens are the arm's
measured mean once its window holds ``MEASURED_TOKENS_ROWS`` sequence-steps, and modelled
before (per-position acceptance and the cache's coverage, pooled over every step): a cycle's
count at batch 1 varies from 1 to k + 1, so a few cycles would rank arms by luck.

The goodput model (vLLM's and SGLang's rule: E[tokens | k] / cost(k) from per-position
acceptance, the cache's coverage, the target's cost per batch size and width, the draft's
critical-path time and the link) is kept for what must be predicted before it happens: the
draft's time ``budget`` (the verify plus the link's floor, to which the draft sizes its tree)
and the ``predict`` table in the metrics. Both target engines (``EngineCore``, the vLLM
proposer) decide with ``plan_draft_lengths`` and report each step as a ``StepRecord`` and each
cycle with its arm. Pure Python; knows nothing of models or transports.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field


REALIZED_WINDOW = 32  # cycles per arm and bucket that the realized rates are taken over
MIN_SWITCH_CYCLES = 8  # measured cycles an arm needs before the controller switches to it
SLOW_CYCLE_CAP = 3.0  # a cycle over this multiple of its window's median counts as this multiple (``realized_rate``)
MEASURED_TOKENS_ROWS = 96  # sequence-steps in an arm's window from which its measured tokens replace the model's
ACCEPTANCE_EMA = 0.02  # weight of a new observation in the per-position acceptance, once it has 50
SPECULATION_MARGIN = 0.10  # how much a speculative arm's rate must beat target-only's by (``_best``)
SWITCH_Z = 1.0  # leaving target-only: the win must exceed this many standard errors of the rates (``_beyond_noise``)
PROBE_BEATEN = 2.0  # target-only is not probed while the current arm's rate is over this multiple of its own
PROBE_CUT = 0.95  # a probe whose rate is under this fraction of the current arm's ends early ...
PROBE_CUT_CYCLES = 4  # ... once it has this many measured cycles
PROBE_LOST = 0.7  # a probe under this fraction of the current arm's rate has lost outright: it ends ...
PROBE_LOST_CYCLES = 2  # ... at this many measured cycles, and probes back off further (``PROBE_GAP_LOST``)
PROBE_GAP = 16  # probes back off to at most this many times ``probe_every`` choices apart ...
PROBE_GAP_LOST = 64  # ... or this many once the last probe lost outright (the gap then grows 4 x a probe, not 2 x)
STALE_RATING = PROBE_GAP_LOST  # target-only's rating, unmeasured for this many x ``probe_every`` choices, bars no probe of it
CHALLENGE_LEAD = 4  # choices from finding a challenger to probing it (a k = 0 step hands the drafts their deltas then)
RECENT_BATCHES = 8  # a cycle whose batch is smaller than one of the bucket's last this many is draining (not measured)
SETTLE_CYCLES = 3  # a run of one arm is measured from its this-many-th cycle (the first pay for the switch) ...
SETTLE_TO_CYCLES = 8  # ... target-only's after speculation from this one (``observe_cycle``)


def _ema(old: float | None, new: float, w: float = 0.1) -> float:
    return new if old is None else (1 - w) * old + w * new


def _bucket(batch_size: int) -> int:
    """Batch sizes share cost estimates by power-of-two bucket (1, 2, 4, 8, ...)."""
    return 1 << max(0, batch_size - 1).bit_length()


class LinearCost:
    """t(n) = a + b * n (n: tokens per row, rows of a tree, ...): a running estimate per n seen,
    and a line through them (weighted by how often each n was seen) for the n not seen. Every n
    measured stays known: a run of k = 0 steps does not erase what k = 4 cost."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.points: dict[float, tuple[float, int]] = {}  # n -> (running seconds, samples)

    @property
    def samples(self) -> list[tuple[float, float]]:
        return [(n, t) for n, (t, _) in sorted(self.points.items())]

    def add(self, n: float, seconds: float) -> None:
        old = self.points.get(n)
        self.points[n] = (seconds, 1) if old is None else ((1 - self.weight) * old[0] + self.weight * seconds, old[1] + 1)

    def predict(self, n: float, prior_slope: float = 0.1) -> float | None:
        if not self.points:
            return None
        if n in self.points and self.points[n][1] >= 2:
            return self.points[n][0]
        xs, ys, ws = zip(*[(x, y, min(c, 8)) for x, (y, c) in self.points.items()])
        total = sum(ws)
        mean_x = sum(w * x for w, x in zip(ws, xs)) / total
        mean_y = sum(w * y for w, y in zip(ws, ys)) / total
        var = sum(w * (x - mean_x) ** 2 for w, x in zip(ws, xs))
        if var > 0:
            slope = max(0.0, sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(ws, xs, ys)) / var)
        else:
            slope = prior_slope * mean_y / max(mean_x, 1)  # one n seen so far: assume a mild slope
        return max(1e-6, mean_y + slope * (n - mean_x))


Arm = tuple  # (k, cache only)
TARGET_ONLY: Arm = (0, False)


@dataclass
class _BucketState:
    """One batch-size bucket's arms: realized cycles, the arm in use, the probe schedule."""

    bucket: int
    realized: dict = field(default_factory=dict)  # arm -> deque of (tokens per sequence, seconds) of steady cycles
    current: Arm | None = None
    queued: list = field(default_factory=list)  # arms of the next steps (warm-up, a probe)
    since_probe: int = 0  # choices since the last probe ended
    gap: int = 0  # choices between probes (doubles while probes confirm the current arm)
    probing: Arm | None = None  # the arm being probed (its steps are queued)
    last_measured: dict = field(default_factory=dict)  # arm -> choice count when it last ran
    choices: int = 0
    settle: bool = False  # a warm-up or probe just ended: choose the arm on the next choice
    confirmed: int = 0  # probes in a row that kept the current arm
    challenger: Arm | None = None  # target-only, rated above the speculative arm now: probed next (``_challenger``)


class SpeculationController:
    def __init__(self, max_k: int, adaptive: bool = True, probe_every: int = 32, probe_len: int = 5,
                 prior_acceptance: float = 0.7, prior_token_cost: float = 0.1, hysteresis: float = 0.03):
        self.max_k = max_k
        self.adaptive = adaptive
        self.probe_every, self.probe_len = probe_every, probe_len
        self.prior_token_cost = prior_token_cost
        self.hysteresis = hysteresis
        self.buckets: dict[int, _BucketState] = {}
        self._run: tuple = (None, None, 0, False)  # the cycles' current run: bucket, arm, length, after speculation
        self._last_arm: Arm | None = None  # the arm of the last pure cycle
        self._recent_batches: dict[int, deque] = {}  # bucket -> batch sizes of its last RECENT_BATCHES cycles
        self.acceptance = [prior_acceptance] * max(max_k, 1)
        self._acceptance_n = [0] * max(max_k, 1)  # observations per position (the prior counts as one)
        # batch bucket -> cache-only blocks' P(at least j + 1 tokens): the tree per sequence shrinks as the batch grows
        self.coverage: dict[int, list[float]] = {}
        self.target_cost: dict[int, LinearCost] = {}
        self.miss_s: dict[int, float] = {}  # batch bucket -> critical-path draft forward time per drafted position
        self.link_s: float | None = None
        self.link_floor_s: float | None = None  # the round trip without the draft's own lag: falls fast, rises slowly
        self.draft_overhead_s: float | None = None
        self.draft_step_s: float | None = None
        self.hit_rate: float = 0.0
        self.steps = 0
        self.k = max_k
        self.cache_only = False  # this step's mode (chosen with k)
        self.arm: Arm | None = None  # this step's arm (None: no draft, nothing to measure)
        self._quiet_pushes = 0  # target-only steps of warm-ups (every 4th pushes the deltas)
        # SPECSERVE_TRACE=1: the last cycles (batch, tokens, ms, arm, pure, prompt tokens) in ``state()``, to see
        # what the controller saw, and its decisions (cycles seen, bucket, arm before, arm probed, arm after, arm
        # probing on, the scores compared).
        self.trace = deque(maxlen=20000) if os.environ.get("SPECSERVE_TRACE") else None
        self.decisions = deque(maxlen=2000) if self.trace is not None else None

    def warmup_arms(self, cache: bool) -> list[Arm]:
        """The arms a bucket runs first: target-only, then k = max, about max / 2 and 1 in each mode."""
        ks = sorted({self.max_k, (self.max_k + 1) // 2, 1}, reverse=True)
        modes = (True, False) if cache else (False,)
        return [TARGET_ONLY] + [(k, m) for k in ks for m in modes]

    # -- observations --------------------------------------------------------------------------
    def observe_acceptance(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Per position: the mean of what was seen (with the prior as one observation) until there are
        ``1 / ACCEPTANCE_EMA`` observations, an EMA after. An EMA from the prior alone took ~50 steps to
        move from 0.7 to 0.45 on a pair that accepted 0.1, while the controller ran arms on that belief."""
        for pos in range(min(num_accepted + 1, num_draft_tokens)):
            n = self._acceptance_n[pos] = self._acceptance_n[pos] + 1
            self.acceptance[pos] = _ema(self.acceptance[pos], 1.0 if pos < num_accepted else 0.0, max(ACCEPTANCE_EMA, 1.0 / (n + 1)))

    def observe_coverage(self, num_asked: int, num_got: int, batch_size: int = 1) -> None:
        """A cache-only block: ``num_got`` of the ``num_asked`` draft tokens were in the cache."""
        coverage = self._coverage(batch_size)
        for pos in range(min(num_asked, len(coverage))):
            coverage[pos] = _ema(coverage[pos], 1.0 if pos < num_got else 0.0, 0.05)

    def _coverage(self, batch_size: int) -> list[float]:
        return self.coverage.setdefault(_bucket(batch_size), [0.5] * max(self.max_k, 1))

    def observe_step(self, batch_size: int, tokens_per_row: int, target_s: float, wait_s: float = 0.0,
                     draft_compute_s: float = 0.0, draft_forward_s: float = 0.0, draft_step_s: float = 0.0,
                     num_blocks: int = 0, num_hits: int = 0, drafted_k: int = 0, warm: bool = True) -> None:
        """``drafted_k``: the k of a step whose misses were drafted on the critical path (0: none were);
        ``warm``: the previous step asked the same sequences for at least as many tokens, so the
        drafts could draft ahead for this one: only such steps say what a steady choice costs."""
        self.steps += 1
        self.target_cost.setdefault(_bucket(batch_size), LinearCost()).add(tokens_per_row, target_s)
        if wait_s > 0.0:
            link = max(0.0, wait_s - draft_compute_s)
            self.link_s = _ema(self.link_s, link)
            self.link_floor_s = link if self.link_floor_s is None else min(link, 0.99 * self.link_floor_s + 0.01 * link)
            self.draft_overhead_s = _ema(self.draft_overhead_s, max(0.0, draft_compute_s - draft_forward_s))
        if drafted_k and warm:
            b = _bucket(batch_size)
            self.miss_s[b] = _ema(self.miss_s.get(b), draft_forward_s / drafted_k, 0.2)
        if draft_step_s > 0.0:
            self.draft_step_s = draft_step_s
        if num_blocks and warm:
            self.hit_rate = _ema(self.hit_rate, num_hits / num_blocks)

    def observe_cycle(self, batch_size: int, num_tokens: int, seconds: float, arm: Arm | None, pure: bool = True,
                      prefill_tokens: int = 0) -> None:
        """One engine step's whole cycle (everything between the ends of two steps): what it produced and
        took, and the arm it ran. ``pure``: every part of the cycle ran that arm (a cycle that verifies one
        arm's drafts while waiting on another's is a switch). Counted once the same arm held for three
        cycles: the first cycles after a switch still pay for it (vLLM's first plain step after
        speculative ones took 2-3x a steady one). ``prefill_tokens``: prompt tokens the cycle's step also
        computed (vLLM mixes them into its steps), whose cost ``realized_rate`` takes out."""
        if self.trace is not None:
            self.trace.append((batch_size, num_tokens, round(seconds * 1e3, 2), arm, pure, prefill_tokens))
        b = _bucket(batch_size)
        if not (pure and arm is not None):  # (whether speculation ran before carries over an impure cycle)
            self._run = (None, None, 0, self._run[3])
        elif self._run[:2] == (b, arm):
            self._run = (b, arm, self._run[2] + 1, self._run[3])
        else:
            self._run = (b, arm, 1, bool(self._last_arm and self._last_arm[0]))
        if pure and arm is not None:
            self._last_arm = arm
        recent = self._recent_batches.setdefault(b, deque(maxlen=RECENT_BATCHES))
        recent.append(batch_size)
        # Target-only right after speculation settles longest: serving the demo pair at 8 clients (one traced
        # level, 2-4 probes) its first 8 cycles ran at 1.2-2.6 x a steady one's time, so a probe of it
        # measured from its third cycle lost outright to the speculative arm (under 0.7 x its score) and
        # came back 64 probe gaps later; in uniform batches the first 2 ran at 1.7 and 1.2 x, the next ~10
        # at ~1.1 x.
        settle = SETTLE_TO_CYCLES if (arm == TARGET_ONLY and self._run[3]) else SETTLE_CYCLES
        if seconds <= 0 or self._run[2] < settle:
            return
        # Per sequence: a bucket spans batch sizes (5 to 8 share one). A cycle of a batch smaller than
        # the bucket's latest cycles ran (one draining: requests finished, none or fewer arrived) is
        # left out: each of its sequences gets a step that costs less (on a CPU target a step's cost
        # grows with its batch), so it flatters whichever arm meets the drain, and speculation meets
        # more of it (its requests finish apart). On the demo pair at batch 8 a probe of k = 2 that ran
        # from batch 8 down to 5 was adopted over target-only, measured at batch 8, and lost 28% of the
        # next run.
        if batch_size < max(recent):
            return
        state = self.buckets.setdefault(b, _BucketState(b, gap=self.probe_every))
        window = state.realized.setdefault(arm, deque(maxlen=REALIZED_WINDOW))
        window.append((num_tokens / batch_size, seconds, batch_size, prefill_tokens))
        if state.probing == arm and state.queued and (
                (len(window) >= PROBE_CUT_CYCLES and self._losing(b, state, PROBE_CUT))
                or (len(window) >= PROBE_LOST_CYCLES and self._losing(b, state, PROBE_LOST))):
            state.queued, state.settle = [], True  # the next choice settles (back on the current arm)

    def _losing(self, b: int, state: _BucketState, fraction: float) -> bool:
        """Whether the arm being probed scores under ``fraction`` times the current arm (``_score``: the
        rates ``_settle`` decides by, a speculative arm's discounted): a probe that cannot win stops
        there (one far behind stops sooner). Its steps are the costliest a settled bucket runs (at batch
        32 on the demo pair a probe into speculation ran 15 steps at 1.6-1.9 x a plain step's time, and
        a run with one probe was ~5% slower than one with none; at batch 8 a probe of k = 4 ran its
        cycles at 3.9 x a plain one's time for 2.75 x the tokens). Measured on raw rates, a probe of
        target-only from a speculative arm 5-10% ahead was cut as losing, then extended by ``_settle``
        as winning on scores, cut again, ...: at batch 8 on the demo pair it alternated 4 target-only
        cycles at 2 x a steady one's time with single speculative ones."""
        probe, current = self._score(b, state.probing), self._score(b, state.current) if state.current else None
        return probe is not None and current is not None and probe < fraction * current

    def _prefill_cost(self, state: _BucketState) -> float:
        """Seconds per prompt token a cycle's step spends prefilling: the slope of cycle time on prompt
        tokens within each arm's window, pooled over the bucket's arms (0 until prompts vary)."""
        cov = var = 0.0
        for window in state.realized.values():
            if len(window) < 3:
                continue
            mean_p = sum(w[3] for w in window) / len(window)
            mean_s = sum(w[1] for w in window) / len(window)
            cov += sum((w[3] - mean_p) * (w[1] - mean_s) for w in window)
            var += sum((w[3] - mean_p) ** 2 for w in window)
        return max(0.0, cov / var) if var > 0 else 0.0

    def realized_rate(self, bucket: int, arm: Arm | bool) -> float | None:
        """Tokens/s per sequence the arm delivers: tokens per sequence over its mean cycle time net of
        the prompts its cycles prefilled (at batch 32 nearly every cycle admits one, and how many a
        few cycles met would otherwise rank the arms), each cycle counted at most 3 times the median:
        a slower one may carry a cost of the batch's churn (requests finishing, arriving, their
        output handled) that falls on whichever arm it meets, and a single one of them must not
        decide between the arms (it did: one 12 ms cycle among 3 ms ones flipped batch 8 to
        speculating). Capped, not left out: an arm's own slow cycles are its cost (a step whose
        blocks were not in the draft's tree waits for them, then for the drafting of its misses),
        and leaving them out rated speculation at batch 32 on the demo pair at 73-80 tokens/s a
        sequence against 53-62 for target-only, while its whole runs were 20% behind.
        Tokens are measured once the window holds ``MEASURED_TOKENS_ROWS`` sequence-steps, modelled
        before (a cycle's count at batch 1 varies from 1 to k + 1: a few cycles would rank the arms
        by luck). ``arm`` True / False: the best speculative arm's rate / target-only's."""
        state = self.buckets.get(_bucket(bucket))
        if state is None:
            return None
        if isinstance(arm, bool):
            arms = [a for a in state.realized if a[0]] if arm else [TARGET_ONLY]
            rates = [r for a in arms if (r := self.realized_rate(bucket, a)) is not None]
            return max(rates, default=None)
        window = state.realized.get(arm)
        if not window or len(window) < 2:
            return None
        per_token = self._prefill_cost(state)
        net = [(t, max(1e-6, s - per_token * p), n) for t, s, n, p in window]
        cap = SLOW_CYCLE_CAP * statistics.median(s for _, s, _ in net)
        kept = [(t, min(s, cap), n) for t, s, n in net]
        rows = sum(n for _, _, n in kept)
        tokens = (sum(t for t, _, _ in kept) / len(kept) if rows >= MEASURED_TOKENS_ROWS
                  else self.expected_tokens(arm[0], arm[1], bucket))
        return tokens * len(kept) / sum(s for _, s, _ in kept)

    # -- the model -----------------------------------------------------------------------------
    def expected_tokens(self, k: int, cache_only: bool = False, batch_size: int = 1) -> float:
        """Tokens per sequence a step with k drafts yields (the 1 is the recovered or bonus token)."""
        total, reach = 1.0, 1.0
        coverage = self._coverage(batch_size) if cache_only else None
        for j in range(k):
            reach *= self.acceptance[j]
            total += reach * (coverage[j] if cache_only else 1.0)
        return total

    def verify_s(self, batch_size: int, k: int) -> float | None:
        fit = self.target_cost.get(_bucket(batch_size))
        return fit.predict(k + 1, self.prior_token_cost) if fit is not None else None

    def cost(self, batch_size: int, k: int, cache_only: bool = False) -> float | None:
        t = self.verify_s(batch_size, k)
        if t is None:
            return None
        if k == 0:
            return t
        if self.link_s is None or self.draft_step_s is None:
            return None
        cost = t + self.link_s + (self.draft_overhead_s or 0.0)
        if not cache_only:
            miss = self.miss_s.get(_bucket(batch_size))
            cost += k * (miss if miss is not None else (1.0 - self.hit_rate ** batch_size) * self.draft_step_s)
        return cost

    def budget(self, batch_size: int, k: int) -> float:
        """Seconds from the draft's reply to the next request: the verify and the link (0: not known yet)."""
        t = self.verify_s(batch_size, k)
        return 0.0 if t is None or self.link_floor_s is None else t + self.link_floor_s

    def predict(self, batch_size: int, cache: bool = True) -> list[dict]:
        """Per k and mode: expected tokens per sequence, predicted seconds per step, tokens/s, speed-up over k=0."""
        rows = []
        base = self.cost(batch_size, 0)
        for k in range(self.max_k + 1):
            for cache_only in ((False, True) if (k and cache) else (False,)):
                c = self.cost(batch_size, k, cache_only)
                e = self.expected_tokens(k, cache_only, batch_size)
                tps = batch_size * e / c if c else None
                rows.append({"k": k, "cache_only": cache_only, "expected_tokens": e, "step_s": c, "tokens_per_s": tps,
                             "speedup": (tps * base / batch_size) if (tps and base) else None})
        return rows

    def choose(self, batch_size: int, have_draft: bool = True, cache: bool = False) -> int:
        """This step's k (the same for every sequence; rows cap it by their room); sets ``cache_only``
        and ``arm``. ``cache``: some draft drafts ahead, so answering from its cache alone is an option."""
        self.cache_only = False
        if not have_draft or self.max_k == 0:
            self.arm = None
            return 0
        if not self.adaptive:
            self.arm = (self.max_k, False)
            return self.max_k
        b = _bucket(batch_size)
        state = self.buckets.get(b) or self.buckets.setdefault(b, _BucketState(b, gap=self.probe_every))
        if not state.choices:  # the bucket's first choice: what a measured bucket implies, or its warm-up
            state.current = self._inherited(b)
            if state.current is None:
                state.queued = [arm for arm in self.warmup_arms(cache) for _ in range(self._steps(arm, (self.max_k, cache)))]
        state.choices += 1
        if state.settle and not state.queued:
            # A settle may queue more of a probe (to extend it, or to measure the warm-up's best arm
            # afresh): those steps start now. Run the current arm for this one step in between, and the
            # probe paid two more switches and lost two more cycles to them each time (on the demo pair
            # at batch 8 one step of k = 2 between every 5 of a cache-only probe being extended).
            self._settle(b, state, cache)
        if state.queued:
            arm = state.queued.pop(0)
            state.settle = not state.queued  # decide on the next choice, once this step's cycle is in
        else:
            state.since_probe += 1
            if state.since_probe % self.probe_every == 0 and state.since_probe + CHALLENGE_LEAD < state.gap:
                # Between backed-off probes: target-only, if its last rating is above what the speculative
                # arm delivers now (that arm slowed, or the box did), is probed soon, not at the gap's end.
                state.challenger = self._challenger(b, state, cache)
                if state.challenger is not None:
                    state.gap = state.since_probe + CHALLENGE_LEAD
            if state.since_probe >= state.gap and (probe := self._next_probe(b, state, cache)) is not None:
                state.probing, state.since_probe = probe, 0
                state.queued = [probe] * (self._steps(probe, state.current or (self.max_k, cache)) - 1)
                state.realized.pop(probe, None)  # measured afresh: conditions may have changed since
                arm = probe
            else:
                arm = state.current or (self.max_k, cache)
        if arm[1] and not cache:  # no draft drafts ahead now (or a seeded request): the misses get drafted
            arm = (arm[0], False)
        state.last_measured[arm] = state.choices
        self.arm = arm
        self.k, self.cache_only = arm
        return arm[0]

    def _best(self, b: int, state: _BucketState, cache: bool, among=None) -> Arm | None:
        """The arm with the best rate, a speculative one discounted by ``SPECULATION_MARGIN`` against
        target-only: cycle rates miss what speculation costs at its edges (the slow cycles after
        switching into it, a sequence's first step without drafts, a batch draining unevenly); on
        the demo pair at batch 32 its cycles were 5% ahead of target-only's and its whole runs 8%
        behind."""
        arms = state.realized if among is None else [a for a in among if a in state.realized]
        scores = {a: s for a in arms if (cache or not a[1]) and (s := self._score(b, a)) is not None}
        return max(scores, key=scores.get) if scores else None

    def _steps(self, arm: Arm, other: Arm) -> int:
        """How long to run ``arm`` when measuring it against ``other``: three probe lengths across
        speculating and not (the choice that matters most, between arms up to tens of percent
        apart, whose first cycles after the switch are not measured), one between neighbours;
        target-only after speculation as many more as its longer settling leaves unmeasured."""
        if bool(arm[0]) == bool(other[0]):
            return self.probe_len
        return 3 * self.probe_len + (SETTLE_TO_CYCLES - SETTLE_CYCLES if not arm[0] else 0)

    def _score(self, b: int, arm: Arm) -> float | None:
        """``arm``'s realized rate, a speculative arm's discounted by ``SPECULATION_MARGIN``."""
        rate = self.realized_rate(b, arm)
        return None if rate is None else rate / (1 + SPECULATION_MARGIN if arm[0] else 1)

    def _settle(self, b: int, state: _BucketState, cache: bool) -> None:
        probed, before = state.probing, state.current
        self._decide(b, state, cache)
        if self.decisions is not None:  # (SPECSERVE_TRACE) what it decided on: the scores of the arms it compared
            scores = {f"{a[0]}{'c' if a[1] else ''}": round(s, 1) for a in state.realized if (s := self._score(b, a)) is not None}
            self.decisions.append((len(self.trace), b, before, probed, state.current, state.probing, scores))

    def _decide(self, b: int, state: _BucketState, cache: bool) -> None:
        """After a warm-up or a probe: run the best measured arm if it beats the current one by the
        hysteresis and on enough cycles (a promising probe is extended until it has them: the best
        of a few noisy short measurements flatters itself); probes back off while they confirm the
        current arm."""
        current = state.current
        # After a probe only the probed arm's measurement is fresh (the others' may predate a change);
        # after the warm-up every arm's is.
        best = self._best(b, state, cache, None if state.probing is None else [current, state.probing])
        if current is None and best is not None and best[0] and TARGET_ONLY in state.realized:
            # The warm-up's best speculative arm is the best of six measured on three cycles each, with
            # modelled tokens at small batches: it flatters itself. It runs from target-only as a probe,
            # measured afresh (and cut when it loses), before the bucket adopts it: on the demo pair at
            # batch 8 the untimed first run rated k = 2 (drafting misses) at 165 tokens/s a
            # sequence against 118 for target-only, and the bucket ran k = 3 at 76-85 for the next run.
            state.current = TARGET_ONLY
            state.realized.pop(best, None)
            state.probing, state.queued, state.settle = best, [best] * self._steps(best, TARGET_ONLY), False
            return
        switched = False
        if best is not None and best != current:
            rate_best, rate_current = self._score(b, best), self._score(b, current) if current else None
            wins = rate_current is None or rate_best > rate_current * (1 + self.hysteresis)
            if wins and current is not None and len(state.realized[best]) < MIN_SWITCH_CYCLES:
                state.probing, state.queued, state.settle = best, [best] * self._steps(best, current), False
                return
            if wins and current == TARGET_ONLY and best[0] and not self._beyond_noise(b, state, best, current):
                if len(state.realized[best]) < REALIZED_WINDOW:  # measured on more cycles first
                    state.probing, state.queued, state.settle = best, [best] * self.probe_len, False
                    return
                wins = False  # still within the noise on a whole window: target-only stays
            if wins:
                state.current, switched = best, current is not None
                if switched and best[0] and not current[0]:
                    # Into speculation on one probe's word, against target-only measured before it: the
                    # first probe from here measures target-only again (it came last among four
                    # neighbours, ~130 steps on, while on the demo pair at batch 8 the box had sped up
                    # target-only's steps by a third and the bucket ran k = 2 at 0.72 x its rate).
                    state.last_measured[TARGET_ONLY] = -1
        if state.probing is not None:  # a probe ended: the schedule adapts
            state.confirmed = 0 if switched else state.confirmed + 1
            if switched:
                state.gap = self.probe_every
            elif state.confirmed % len(self._candidates(state, cache)) == 0:  # every neighbour lost once more
                # A probe that lost outright backs off faster and further: on the demo pair at batch 8
                # (speculation at ~0.6x target-only's rate) each probe cost 10-15% of a 190-step run
                # while the gaps were still short, and at 16 x the probes were still ~1.5% of a run,
                # for an answer that did not change.
                lost = self._losing(b, state, PROBE_LOST)
                state.gap = min(state.gap * 4, self.probe_every * PROBE_GAP_LOST) if lost else min(state.gap * 2, self.probe_every * PROBE_GAP)
        state.probing, state.settle = None, False

    def _beyond_noise(self, b: int, state: _BucketState, arm: Arm, other: Arm) -> bool:
        """Whether ``arm`` out-scores ``other`` by the hysteresis and ``SWITCH_Z`` standard errors of the
        two rates (each from the spread of its window's cycle times). Leaving target-only for speculation
        asks this: on the demo pair at batch 8 the two arms' cycles deliver within a few percent of each
        other, its cycles vary by 20-30% (6 to 30 ms around 9), and a probe of 13 cycles beat target-only
        by the margin often enough that 3 to 5 of 8 runs speculated (losing 10-15% each) on a win that
        the next probe did not see. A speculative arm that wins by more than the noise switches as soon as
        it has ``MIN_SWITCH_CYCLES``; one that wins by less is measured on more cycles (the noise falls
        with the square root of their number) up to a full window, and the bucket stays on target-only
        if it is still within the noise there."""
        def spread(a: Arm) -> float:  # the rate's relative standard error
            seconds = [w[1] for w in state.realized[a]]
            if len(seconds) < 2:
                return float("inf")
            cap = SLOW_CYCLE_CAP * statistics.median(seconds)
            seconds = [min(x, cap) for x in seconds]
            return statistics.stdev(seconds) / statistics.fmean(seconds) / math.sqrt(len(seconds))

        mine, theirs = self._score(b, arm), self._score(b, other)
        if mine is None or theirs is None or mine <= 0 or theirs <= 0:
            return False
        return math.log(mine / theirs) - math.log1p(self.hysteresis) > SWITCH_Z * math.hypot(spread(arm), spread(other))

    def _inherited(self, b: int) -> Arm | None:
        """A new bucket's first arm from the settled buckets beside it, without a warm-up: speculation
        that pays at a larger batch pays at a smaller one (the verify's cost per sequence only falls),
        and where it does not pay at a smaller batch it does not at a larger one. Probes check it as
        usual. (Each bucket warming up from target-only cost a draining batch most of its
        speculation: on the simulated Spark + 5090, 15 target-only steps per bucket at a third of the
        speculative rate.) None: nothing implied, warm up."""
        settled = {c: st.current for c, st in self.buckets.items() if c != b and st.current is not None}
        larger, smaller = [c for c in settled if c > b], [c for c in settled if c < b]
        if larger and settled[min(larger)][0]:
            return settled[min(larger)]
        if smaller and not settled[max(smaller)][0]:
            return TARGET_ONLY
        return None

    def _candidates(self, state: _BucketState, cache: bool) -> list[Arm]:
        """The current arm's neighbours: k - 1, k + 1, the other mode and target-only (from target-only:
        the best speculative arm measured), and the best-rated speculative arm when it is rated above the
        current one. Target-only is left out while the current arm's measured rate is over
        ``PROBE_BEATEN`` times its last measured one: a probe of it costs the most then (the longest
        probe, at a fraction of the rate) and cannot win; the current arm is measured all
        the time, so a fall in acceptance brings the probes back. That rating must be recent: one
        older than ``STALE_RATING`` x ``probe_every`` choices (the longest gap probes back off to)
        leaves target-only among the candidates (the one measured least recently is probed first)."""
        k, mode = state.current or (self.max_k, cache)
        if k == 0:
            rates = {a: r for a in state.realized if a[0] and (cache or not a[1])
                     if (r := self.realized_rate(state.bucket, a)) is not None}
            return [max(rates, key=rates.get)] if rates else [(self.max_k, cache)]
        candidates = [(k2, mode) for k2 in (k - 1, k + 1) if 1 <= k2 <= self.max_k]
        if cache:
            candidates.append((k, not mode))
        plain, current = self.realized_rate(state.bucket, TARGET_ONLY), self.realized_rate(state.bucket, (k, mode))
        # A stale rating bars nothing: in the two-device harness at batch 1 target-only's rating stood at 65-130
        # tokens/s a sequence, against 150-200 for vLLM target-only beside it, for whole runs (speculation
        # always over twice it, so nothing measured it again).
        stale = state.choices - state.last_measured.get(TARGET_ONLY, -1) > STALE_RATING * self.probe_every
        if plain is None or current is None or current <= PROBE_BEATEN * plain or not candidates or stale:
            candidates.insert(0, TARGET_ONLY)
        # Beyond the neighbours: a speculative arm rated above the current one (by the hysteresis) that
        # no neighbour's probe would reach. On the demo pair at batch 1 the bucket adopted k = 4 on its
        # warm-up's word and measured it at 207 tokens/s a sequence for two whole runs, while k = 1 stayed
        # rated at 265-286 from the warm-up and was never measured again: from k = 4 only k = 3 was.
        beyond = self._best(state.bucket, state, cache, [a for a in state.realized if a[0] and a != (k, mode) and a not in candidates])
        mine = self._score(state.bucket, (k, mode))
        if beyond is not None and mine is not None and self._score(state.bucket, beyond) > mine * (1 + self.hysteresis):
            candidates.append(beyond)
        return candidates

    def _next_probe(self, b: int, state: _BucketState, cache: bool) -> Arm | None:
        """The challenger (``_challenger``) if there is one, else the neighbour of the current arm measured
        least recently."""
        challenger, state.challenger = state.challenger or self._challenger(b, state, cache), None
        if challenger is not None:
            return challenger
        return min(self._candidates(state, cache), key=lambda a: state.last_measured.get(a, -1))

    def _challenger(self, b: int, state: _BucketState, cache: bool) -> Arm | None:
        """Target-only, when its last rating beats the speculative arm running now by the hysteresis. A
        probe only compares the arm it measured with the current one, so without this a speculative
        arm kept running after it fell behind target-only's rating, until the backed-off probes came
        round to target-only: on the demo pair at batch 8 cache-only k = 2 scored 79-94 for five whole
        runs while target-only's rating stood at 113-133, with one or two probes a run, none of
        target-only. (Only target-only: stale ratings of the speculative arms, the best of a few noisy
        cycles each, would challenge all the time; the probes reach the best-rated of them anyway.)"""
        current = state.current
        if current is None or not current[0] or len(state.realized.get(current, ())) < MIN_SWITCH_CYCLES:
            return None
        mine, plain = self._score(b, current), self._score(b, TARGET_ONLY)
        return TARGET_ONLY if mine is not None and plain is not None and plain > mine * (1 + self.hysteresis) else None

    def probe_due_in(self, batch_size: int) -> int | None:
        """Choices until this bucket's next probe (None: warming up, or probing now)."""
        state = self.buckets.get(_bucket(batch_size))
        if state is None or state.queued:
            return None
        return state.gap - state.since_probe

    def push_due(self, batch_size: int, lead: int = 4) -> bool:
        """Whether a k = 0 step should hand the drafts its deltas (unawaited): every 4th target-only step
        of a warm-up, and ``lead`` choices before a probe, so the probe starts warm; never otherwise
        (k = 0 steps send nothing)."""
        if not self.adaptive:
            return False
        due = self.probe_due_in(batch_size)
        if due is None:
            self._quiet_pushes += 1
            return self._quiet_pushes % 4 == 0
        return due == lead

    def state(self) -> dict:
        realized = {f"{b}/{a[0]}{'c' if a[1] else ''}": round(rate, 1) for b, st in sorted(self.buckets.items())
                    for a in sorted(st.realized) if (rate := self.realized_rate(b, a)) is not None}
        arms = {str(b): f"{st.current[0]}{'c' if st.current[1] else ''}" for b, st in sorted(self.buckets.items()) if st.current}
        extra = {"trace": list(self.trace), "decisions": list(self.decisions)} if self.trace is not None else {}
        return {**extra, "k": self.k, "max_k": self.max_k, "cache_only": self.cache_only, "realized_tokens_per_s": realized,
                "arm_by_bucket": arms,  # (realized: tokens/s per sequence, by bucket and arm: k, 'c' for cache-only)
                "acceptance_per_pos": list(self.acceptance),
                "coverage_per_pos": {str(b): list(c) for b, c in sorted(self.coverage.items())}, "link_ms": (self.link_s or 0.0) * 1e3,
                "draft_step_ms": (self.draft_step_s or 0.0) * 1e3, "cache_hit_rate": self.hit_rate, "adaptive": self.adaptive}


@dataclass
class StepRecord:
    """What one verify step measured; the controller learns from it and the engines add it up."""

    batch_size: int  # sequences verified
    tokens_per_row: int  # 1 + the longest draft block verified
    target_s: float  # the step's whole cost but the wait for the drafts: the verify, scheduling, bookkeeping
    outcome: object | None = None  # the drafts' ``ProposeOutcome`` for this step's blocks (None: nothing asked)
    num_blocks: int = 0  # non-empty draft blocks verified
    num_hits: int = 0  # of which answered from the speculation cache
    asked: dict = field(default_factory=dict)  # request id -> k asked of the drafts for these blocks
    cache_only: bool = False  # the drafts were told to answer from their speculation caches only
    warm: bool = False  # the ask before asked the same sequences for at least as many tokens


def is_warm(previous: dict | None, asked: dict) -> bool:
    """Whether every sequence asked now was asked last time for at least as many tokens (the drafts
    then drafted ahead for it): what a steady choice costs is measured on such steps only."""
    return bool(previous) and all(previous.get(rid, 0) >= k for rid, k in asked.items())


def observe(controller: SpeculationController, record: StepRecord) -> None:
    o = record.outcome
    if o is None:
        controller.observe_step(record.batch_size, record.tokens_per_row, record.target_s)
        return
    if record.cache_only and record.warm:
        for rid, k in record.asked.items():
            block = o.blocks.get(rid)
            if block is not None:  # (none: that draft failed or lost the sequence, which says nothing of its cache)
                controller.observe_coverage(k, len(block.draft_token_ids), record.batch_size)
    controller.observe_step(record.batch_size, record.tokens_per_row, record.target_s, o.wait_s, o.compute_s + o.queue_s,
                            o.forward_s, o.draft_step_s, record.num_blocks, record.num_hits,
                            0 if record.cache_only else max(record.asked.values(), default=0), record.warm)


def plan_draft_lengths(controller: SpeculationController, batch_size: int, have_draft: bool,
                       rows: Iterable[tuple[str, int, bool]], cache: bool = False, seeded: bool | None = None) -> dict[str, int]:
    """This step's draft length per sequence, from (request id, room, seeded and sampled) rows;
    ``controller.cache_only`` then says whether the drafts answer from their caches alone.

    Every row gets the controller's k for the batch, capped by its room (max_tokens, context);
    a seeded sampled request keeps the configured k and full blocks, because block boundaries
    decide which draws become which tokens, so the same seed gives the same output only with
    the same k. Rows that get 0 are left out: they ask the draft nothing this step. ``seeded``
    (whether any row is seeded and sampled), when the caller knows it, spares reading the rows
    on a step whose k is 0."""
    if seeded is None:
        rows = list(rows)
        seeded = any(s for _, _, s in rows)
    k = controller.choose(batch_size, have_draft, cache and not seeded)
    fixed = controller.max_k if have_draft else 0
    if k == 0 and not (seeded and fixed):
        return {}
    out = {}
    for rid, room, seeded_sampled in rows:
        n = min(fixed if seeded_sampled else k, room)
        if n > 0:
            out[rid] = n
    return out
