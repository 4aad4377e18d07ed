"""Choose each step's speculation by measured goodput: how many draft tokens (k), and whether a
draft that cannot answer from its speculation cache drafts on the critical path.

For a batch of B sequences (a_j: measured acceptance at position j; c_j: measured share of
cache-only blocks holding at least j + 1 tokens), per sequence:

    E[tokens | k]             = sum_{i=0..k} prod_{j<i} a_j          (the 1 is the recovered/bonus token)
    E[tokens | k, cache only] = 1 + sum_{i=1..k} c_{i-1} prod_{j<i} a_j
    cost(0)                   = t_target(B, 1)                      (target-only: nothing sent)
    cost(k)                   = t_target(B, k + 1) + link + draft overhead + k * t_miss(B)
    cost(k, cache only)       = t_target(B, k + 1) + link + draft overhead

t_target is the whole step but the wait for the drafts, per batch-size bucket and width;
t_miss(B) the draft's critical-path forward time per drafted position (one miss makes the
whole batch wait); cache-only is what keeps a remote draft paying at serving batch sizes. The
model picks the k and mode with the most E / cost (vLLM's and SGLang's rule, costs measured
online). Whether to speculate at all is then settled by what each choice delivered: realized
tokens per second of wall time, per bucket, over each choice's last ``REALIZED_WINDOW`` steady
cycles (three cycles in a row with the same choice; a cycle over 3 x the median left out),
which carries every cost the model does not see (the engine's scheduling and output handling, bookkeeping, arrivals). The first ``warmup_steps`` of each bucket cycle through
k and both modes; one choice in ``probe_every`` probes (less often, down to one in 16 x ``probe_every``, while probes
of the other choice keep confirming this one): the other choice for ``probe_len``
steps (so it gets measured), or a neighbouring k, or the other mode. Costs are learned on warm
steps only (the step before asked the same sequences for at least as much). ``budget`` is the
time a draft has between its reply and the next request (verify + the link's floor): the draft
sizes its tree to it. Both target engines (``EngineCore``, the vLLM proposer) decide with
``plan_draft_lengths`` and report each step as a ``StepRecord`` and a cycle. Pure Python;
knows nothing of models or transports.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field


REALIZED_WINDOW = 32  # cycles per choice and bucket that the realized rates are taken over


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


class SpeculationController:
    def __init__(self, max_k: int, adaptive: bool = True, warmup_steps: int = 16, probe_every: int = 64,
                 prior_acceptance: float = 0.7, prior_token_cost: float = 0.1, hysteresis: float = 0.03, probe_len: int = 6):
        self.max_k = max_k
        self.adaptive = adaptive
        self.warmup_steps, self.probe_every = warmup_steps, probe_every
        self.prior_token_cost = prior_token_cost
        self.hysteresis = hysteresis
        self.probe_len = probe_len
        self.realized: dict[tuple[int, bool], deque] = {}  # (bucket, speculating) -> the last cycles' (tokens per sequence, seconds)
        self._cycles: list[tuple[int, bool]] = []  # (bucket, speculating) of the last cycles observed
        self.acceptance = [prior_acceptance] * max(max_k, 1)
        self.coverage = [0.5] * max(max_k, 1)  # cache-only blocks: P(at least j + 1 tokens)
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
        self._chosen = 0
        self._bucket_chosen: dict[int, int] = {}  # batch bucket -> choices made there (its warm-up)
        self._probe = 0
        self._since_probe: dict[int, int] = {}  # batch bucket -> choices since its last probe
        self._probe_gap: dict[int, int] = {}  # batch bucket -> choices between probes (doubles while the choice holds)
        self._arm_probed: set[int] = set()
        self._quiet_pushes = 0  # buckets whose other choice was just probed
        self._queued: list[tuple[int, bool]] = []  # (k, cache only) of the next probe steps

    # -- observations --------------------------------------------------------------------------
    def observe_acceptance(self, num_draft_tokens: int, num_accepted: int) -> None:
        for pos in range(min(num_accepted + 1, num_draft_tokens)):
            self.acceptance[pos] = _ema(self.acceptance[pos], 1.0 if pos < num_accepted else 0.0, 0.02)

    def observe_coverage(self, num_asked: int, num_got: int) -> None:
        """A cache-only block: ``num_got`` of the ``num_asked`` draft tokens were in the cache."""
        for pos in range(min(num_asked, len(self.coverage))):
            self.coverage[pos] = _ema(self.coverage[pos], 1.0 if pos < num_got else 0.0, 0.05)

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

    def observe_cycle(self, batch_size: int, num_tokens: int, seconds: float, speculating: bool, pure: bool = True) -> None:
        """One engine step's whole cycle (everything between the ends of two steps): what it produced and
        took. ``pure``: every part of the cycle ran the same choice (a cycle that verifies one choice's
        drafts while waiting on another's is a switch, and left out); counted once the same choice held
        for three cycles (the first cycle after a switch still pays for it: vLLM's first plain step
        after speculative ones took 2-3x a steady one)."""
        b = _bucket(batch_size)
        self._cycles = (self._cycles + [(b, speculating)])[-3:] if pure else []
        if seconds <= 0 or len(self._cycles) < 3 or len(set(self._cycles)) != 1:
            return
        # Per sequence: a bucket spans batch sizes (5 to 8 share one), and a probe caught in a draining
        # batch must not look slow for it.
        self.realized.setdefault((b, speculating), deque(maxlen=REALIZED_WINDOW)).append((num_tokens / batch_size, seconds))

    def realized_rate(self, bucket: int, speculating: bool) -> float | None:
        """Tokens/s per sequence over the arm's last cycles, a rate of totals, without the cycles that took
        over 3 times the median: those carry a cost of the batch's churn (requests finishing, arriving,
        their output handled) that falls on whichever choice it meets, and a single one of them must not
        decide between the choices (it did: one 12 ms cycle among 3 ms ones flipped batch 8 to speculating)."""
        window = self.realized.get((bucket, speculating))
        if not window or len(window) < 3:
            return None
        cap = 3.0 * statistics.median(s for _, s in window)
        kept = [(t, s) for t, s in window if s <= cap]
        return sum(t for t, _ in kept) / sum(s for _, s in kept)

    def _measured(self, batch_size: int) -> tuple[float, float] | None:
        """(realized tokens/s per sequence speculating, not speculating) at this batch size, once both are measured."""
        b = _bucket(batch_size)
        on, off = self.realized_rate(b, True), self.realized_rate(b, False)
        return (on, off) if on is not None and off is not None else None

    # -- the model -----------------------------------------------------------------------------
    def expected_tokens(self, k: int, cache_only: bool = False) -> float:
        total, reach = 1.0, 1.0
        for j in range(k):
            reach *= self.acceptance[j]
            total += reach * (self.coverage[j] if cache_only else 1.0)
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
                e = self.expected_tokens(k, cache_only)
                tps = batch_size * e / c if c else None
                rows.append({"k": k, "cache_only": cache_only, "expected_tokens": e, "step_s": c, "tokens_per_s": tps,
                             "speedup": (tps * base / batch_size) if (tps and base) else None})
        return rows

    def choose(self, batch_size: int, have_draft: bool = True, cache: bool = False) -> int:
        """This step's k (the same for every sequence; rows cap it by their room); sets ``cache_only``.
        ``cache``: some draft drafts ahead, so answering from its cache alone is an option."""
        self.cache_only = False
        if not have_draft or self.max_k == 0:
            return 0
        if not self.adaptive:
            return self.max_k
        self._chosen += 1
        b = _bucket(batch_size)
        seen = self._bucket_chosen[b] = self._bucket_chosen.get(b, 0) + 1
        if seen <= self.warmup_steps:  # cycle k and the mode so every estimate of this batch size has data
            # (each speculative step follows one that asked for at least as much: it is warm; each choice
            # holds for a few steps, so its realized rate is measured too)
            cycle = ((self.max_k, False), (self.max_k, False), (self.max_k, cache), (max(1, self.max_k // 2), False),
                     (0, False), (0, False), (0, False), (0, False))
            k, self.cache_only = cycle[(seen - 1) % len(cycle)]
            return k
        if self._queued:
            k, self.cache_only = self._queued.pop(0)
            return k
        table = [r for r in self.predict(batch_size, cache) if r["tokens_per_s"] is not None]
        speculative = [r for r in table if r["k"]]
        best_on = max(speculative, key=lambda r: r["tokens_per_s"]) if speculative else {"k": self.max_k, "cache_only": False}
        since = self._since_probe[b] = self._since_probe.get(b, 0) + 1
        if since >= self._probe_gap.get(b, self.probe_every):  # keep measuring
            self._since_probe[b] = 0
            self._probe += 1
            if not self.k or self._probe % 2:  # the other choice, long enough for steady cycles (the realized rates)
                other = (0, False) if self.k else (best_on["k"], best_on["cache_only"] and cache)
                self._queued += [other] * (self.probe_len - 1)
                self._arm_probed.add(b)
                k, self.cache_only = other
            elif cache and self._probe % 4 == 0:  # the other mode (the model's coverage and costs)
                k, self.cache_only = self.k, not self._cache_only_choice
            else:  # a neighbouring k
                k = max(1, min(self.max_k, self.k + (1 if self._probe % 8 == 3 else -1)))
                self.cache_only = self._cache_only_choice and cache
            return k
        if not table:
            self.cache_only = self._cache_only_choice and cache
            return self.k
        best = max(table, key=lambda r: r["tokens_per_s"])
        measured = self._measured(batch_size)
        if measured is not None:  # what was delivered overrules the model on whether to speculate at all
            on, off = measured
            if best["k"] and off > on * (1 + self.hysteresis):
                best = next(r for r in table if r["k"] == 0)
            elif not best["k"] and speculative and on > off * (1 + self.hysteresis):
                best = best_on
        current = next((r for r in table if r["k"] == self.k and r["cache_only"] == (self._cache_only_choice and cache)), None)
        switch_arm = current is not None and bool(current["k"]) != bool(best["k"]) and measured is not None
        if b in self._arm_probed:  # a probe of the other choice has run: it either won or costs less often
            self._arm_probed.discard(b)
            gap = self._probe_gap.get(b, self.probe_every)
            self._probe_gap[b] = self.probe_every if switch_arm else min(gap * 2, self.probe_every * 16)
        if current is None or switch_arm or best["tokens_per_s"] > current["tokens_per_s"] * (1 + self.hysteresis):
            self.k, self._cache_only_choice = best["k"], best["cache_only"]
        self.cache_only = self._cache_only_choice and cache and self.k > 0
        return self.k

    def push_due(self, batch_size: int, lead: int = 4) -> bool:
        """Whether a k = 0 step should hand the drafts its deltas (unawaited): during a bucket's warm-up,
        and ``lead`` choices before its next probe, so the probe starts warm; never otherwise (k = 0
        steps send nothing)."""
        b = _bucket(batch_size)
        if not self.adaptive or self._bucket_chosen.get(b, 0) < self.warmup_steps:
            self._quiet_pushes += 1
            return self._quiet_pushes % 4 == 0  # every 4th k = 0 step
        return self._probe_gap.get(b, self.probe_every) - self._since_probe.get(b, 0) == lead

    _cache_only_choice = False  # the mode of the current choice (as opposed to this step's, which probes may change)

    def state(self) -> dict:
        realized = {f"{b}/{'on' if on else 'off'}": round(rate, 1) for b, on in sorted(self.realized)
                    if (rate := self.realized_rate(b, on)) is not None}
        return {"k": self.k, "max_k": self.max_k, "cache_only": self.cache_only, "realized_tokens_per_s": realized,
                "acceptance_per_pos": list(self.acceptance),  # (realized: tokens/s per sequence, by bucket)
                "coverage_per_pos": list(self.coverage), "link_ms": (self.link_s or 0.0) * 1e3,
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
                controller.observe_coverage(k, len(block.draft_token_ids))
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
