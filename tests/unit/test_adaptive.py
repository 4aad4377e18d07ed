"""The speculation controller: one model (per-position acceptance, a cycle-time line fitted to measured
cycles), the arm with the most predicted tokens per second, exploration at a bounded cost, and
decisions that replay from their observations. Cycles come from a seeded simulator, so every
assertion is deterministic."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import numpy as np
import pytest

from specserve.adaptive import (DECIDE_EVERY, _Bucket, EXPLORE_BUDGET, EXPLORE_MAX, PROBE, PUSH_EVERY, RUN, SETTLE, TARGET_ONLY, Arm, SpeculationController,
                                replay)
from specserve.cycle_model import CycleModel, bucket_of


class Pair:
    """A simulated draft/target pair: per-position acceptance, the cache's coverage (P(a cache-only
    block holds at least j + 1 tokens) = coverage ** (j + 1)) and each arm's mean cycle seconds."""

    def __init__(self, acceptance: float, seconds, coverage: float = 0.8):
        self.acceptance, self.seconds, self.coverage = acceptance, seconds, coverage

    def expected(self, arm) -> float:
        k, cache_only = arm
        total, reach = 1.0, 1.0
        for j in range(k):
            reach *= self.acceptance
            total += reach * (self.coverage ** (j + 1) if cache_only else 1.0)
        return total

    def rate(self, arm, batch: int) -> float:
        return batch * self.expected(arm) / self.seconds(arm, batch)

    def best(self, max_k: int, batch: int) -> Arm:
        arms = [TARGET_ONLY] + [Arm(k, m) for k in range(1, max_k + 1) for m in (False, True)]
        return max(arms, key=lambda a: self.rate(a, batch))


def costs(t_target: float, per_token: float, link: float, miss: float, hit_rate: float = 0.8, per_seq: float = 0.0):
    """Cycle seconds: a verify that grows with its width; arms that draft their misses wait for them."""
    def seconds(arm, batch):
        k, cache_only = arm
        base = t_target + per_seq * batch
        if not k:
            return base
        return base + per_token * k * batch + link + (0.0 if cache_only else (1 - hit_rate ** batch) * k * miss)
    return seconds


def run(ctrl: SpeculationController, batch, pair: Pair, steps: int, cache: bool = True, seed: int = 0,
        noise: float = 0.1, prompts=None) -> list[Arm]:
    """Drive the controller like an engine: per step the arm it chose is verified (acceptance and coverage
    drawn per sequence) and its cycle takes ``pair.seconds`` +- ``noise``; ``batch``: a size or a
    function of the step; ``prompts``: (prompt tokens, tokens per request, seconds per prompt token of
    an arm): each request's worth of tokens generated brings a new prompt, prefilled in the cycle that
    completed it; returns the arms run."""
    r, arms, owed = random.Random(seed), [], 0.0
    for step in range(steps):
        b = batch(step) if callable(batch) else batch
        ctrl.choose(b, True, cache)
        arm = ctrl.arm
        arms.append(arm)
        k, cache_only = arm
        tokens = 0
        for _ in range(b):
            got = k
            if cache_only:
                got = next((j for j in range(k) if r.random() > pair.coverage), k)
                ctrl.observe_coverage(k, got, b)
            accepted = next((j for j in range(got) if r.random() > pair.acceptance), got)
            if got:
                ctrl.observe_acceptance(got, accepted)
            tokens += 1 + accepted
        prefill, extra = 0, 0.0
        if prompts is not None:
            length, per_request, per_token = prompts
            owed += tokens / per_request
            prefill = length * int(owed)
            owed -= int(owed)
            extra = prefill * per_token(arm)
        ctrl.observe_cycle(b, tokens, pair.seconds(arm, b) * r.uniform(1 - noise, 1 + noise) + extra, arm, prefill_tokens=prefill)
    return arms


def delivered(arms: list[Arm], pair: Pair, batch: int) -> float:
    """The rate the choices imply (noise-free): tokens over seconds of the arms run."""
    return sum(batch * pair.expected(a) for a in arms) / sum(pair.seconds(a, batch) for a in arms)


PAIRS = {  # (pair, batch, what the best arm is)
    "misses make the batch wait: cache-only pays": (Pair(0.6, costs(0.0068, 0.0002, 0.001, 0.0015)), 8),
    "a slow target and a fast draft: long blocks": (Pair(0.8, costs(0.25, 0.0001, 0.001, 0.002)), 1),
    "a compute-bound batch: target-only": (Pair(0.7, costs(0.02, 0.0008, 0.002, 0.004)), 16),
    "an intermediate k": (Pair(0.7, costs(0.01, 0.0, 0.0005, 0.003, per_seq=0.0004)), 32),
    "speculation never pays": (Pair(0.3, costs(0.003, 0.001, 0.003, 0.003)), 1),
}


@pytest.mark.parametrize("name", PAIRS)
def test_runs_within_a_few_percent_of_the_best_fixed_arm(name):
    pair, batch = PAIRS[name]
    ctrl = SpeculationController(max_k=4)
    run(ctrl, batch, pair, 300, seed=1)  # warm-up, as a server's first requests
    arms = run(ctrl, batch, pair, 600, seed=2)
    best = pair.best(4, batch)
    assert delivered(arms, pair, batch) > 0.95 * pair.rate(best, batch), (best, {a: arms.count(a) for a in set(arms)})
    settled = max(set(arms[-200:]), key=arms[-200:].count)
    assert pair.rate(settled, batch) > 0.95 * pair.rate(best, batch), (settled, best)
    assert ctrl.state()["arm_by_bucket"][str(1 << round(np.log2(batch)))] == f"{settled.k}{'c' if settled.cache_only else ''}"


def test_a_slow_target_with_a_fast_draft_speculates_deeply():
    ctrl = SpeculationController(max_k=8)
    arms = run(ctrl, 1, Pair(0.8, costs(0.25, 0.0001, 0.001, 0.002)), 300)
    assert max(set(arms[-100:]), key=arms[-100:].count).k >= 6


def test_where_speculation_never_pays_it_is_measured_rarely():
    pair, batch = PAIRS["speculation never pays"]
    ctrl = SpeculationController(max_k=4)
    arms = run(ctrl, batch, pair, 4 * EXPLORE_MAX)
    tail = arms[-3 * EXPLORE_MAX:]
    speculative = sum(1 for a in tail if a.k)
    assert 0 < speculative <= 4 * RUN  # still measuring, at a bounded cost
    assert delivered(tail, pair, batch) > (1 - 2 * EXPLORE_BUDGET) * pair.rate(TARGET_ONLY, batch)


def test_an_exploration_is_spaced_by_its_predicted_cost():
    """From target-only, the forced exploration runs the ends of the line by turns (k = 1, k = max in
    each mode), and one predicted to lose much waits longer than one predicted to lose little."""
    pair, batch = PAIRS["a compute-bound batch: target-only"]
    ctrl = SpeculationController(max_k=4)
    arms = run(ctrl, batch, pair, 3 * EXPLORE_MAX)
    explored = {a for a in arms[-2 * EXPLORE_MAX:] if a.k}
    assert explored and explored <= {Arm(1, True), Arm(4, False), Arm(4, True)}, explored
    rates = ctrl.rates(batch, True)
    mine = rates[TARGET_ONLY]
    speculative = sorted((a for a in rates if a.k), key=rates.get)
    dear, cheap = speculative[0], speculative[-1]
    assert 0 < ctrl._spacing(rates, cheap, mine) < ctrl._spacing(rates, dear, mine) <= 4 / EXPLORE_BUDGET


def test_speculation_measured_slow_at_start_is_measured_again_and_taken():
    """A warm-up that met a slow moment (a cold draft, a busy host: every speculative cycle 3 x its
    cost) settles on target-only; the forced explorations reach k = max, whose cycles, measured
    afresh, replace the stale ones, and the controller speculates."""
    fast = costs(0.005, 0.0, 0.0035, 0.002)  # k = 1 about target-only's rate, k = 4 five thirds of it
    ctrl = SpeculationController(max_k=4)
    run(ctrl, 1, Pair(0.8, lambda arm, b: fast(arm, b) * (3.0 if arm[0] else 1.0)), 60)
    assert ctrl.buckets[0].current == TARGET_ONLY
    pair = Pair(0.8, fast)
    arms = run(ctrl, 1, pair, 6 * EXPLORE_MAX, seed=1)
    assert delivered(arms[-2 * EXPLORE_MAX:], pair, 1) > 0.85 * pair.rate(pair.best(4, 1), 1) > 1.4 * pair.rate(TARGET_ONLY, 1)


def test_warm_up_runs_both_modes_then_target_only_then_decides():
    ctrl = SpeculationController(max_k=4)
    arms = run(ctrl, 8, PAIRS["misses make the batch wait: cache-only pays"][0], 4 * RUN)
    assert arms == [Arm(4, False)] * RUN + [Arm(4, True)] * RUN + [Arm(2, False)] * RUN + [TARGET_ONLY] * RUN


@pytest.mark.parametrize("target_only_close", [False, True])
def test_a_new_batch_size_is_decided_from_its_neighbours(target_only_close):
    """The neighbours' cycles inform batch 16: its speculative arms need no warm-up. Target-only, the
    baseline, is measured in the bucket itself unless even its optimistic prediction is far behind."""
    per_token = 0.0016 if target_only_close else 0.0001
    pair = Pair(0.8, costs(0.02, per_token, 0.001, 0.002, per_seq=0.0002))
    ctrl = SpeculationController(max_k=4)
    run(ctrl, lambda step: 8 if step % 2 else 32, pair, 600)
    arms = run(ctrl, 16, pair, 20, seed=3)
    fastest = max(pair.rate(a, 16) for a in ctrl.arms(True) if a.k)
    assert (fastest < 1.5 * pair.rate(TARGET_ONLY, 16)) == target_only_close  # (what the two settings are)
    if target_only_close:
        assert arms[:RUN] == [TARGET_ONLY] * RUN, arms
    else:
        assert TARGET_ONLY not in arms, arms
    decided = ctrl.buckets[4].current  # batch 16's bucket, after 20 cycles
    assert pair.rate(decided, 16) > 0.95 * pair.rate(pair.best(4, 16), 16), (decided, arms)


def test_draining_batches_are_cycles_of_their_own_batch_size():
    """Cycles of a batch that shrinks as requests finish are modelled at their own size, not their bucket's."""
    pair = Pair(0.7, costs(0.004, 0.0003, 0.001, 0.002, per_seq=0.0008))
    ctrl = SpeculationController(max_k=4)
    arms = run(ctrl, lambda step: 8 - step // 4 % 4, pair, 800)  # batches 8, 8, 8, 8, 7, ..., 5, 8, ...
    for b in (5, 8):
        predicted = ctrl.model.seconds(b, arms[-1])
        assert abs(predicted - pair.seconds(arms[-1], b)) < 0.1 * pair.seconds(arms[-1], b)


def test_a_run_is_measured_from_its_third_cycle_whether_or_not_its_switch_was_pure():
    """The vLLM target's first cycle of a run still verifies the previous arm's drafts (impure): it is
    the run's first cycle, so an exploration of ``PROBE`` cycles measures as many on either engine."""
    measured = []
    for first_pure in (True, False):
        ctrl = SpeculationController(max_k=4)
        for arm in (TARGET_ONLY, Arm(2, True)):
            for i in range(PROBE):
                ctrl.observe_cycle(8, 8, 0.01, arm, pure=first_pure or i > 0)
        measured.append([ctrl.model.measured(8, a) for a in (TARGET_ONLY, Arm(2, True))])
    assert measured == [[PROBE - SETTLE] * 2] * 2


def test_explorations_that_change_nothing_become_rarer():
    """An arm still predicted, optimistically, to beat the running one after its exploration (a fit that
    learns slowly of it) is explored at doubling intervals, not every ``EXPLORE_MIN`` choices."""
    ctrl = SpeculationController(max_k=4)
    ctrl.buckets[0] = _Bucket(current=TARGET_ONLY, choices=DECIDE_EVERY - 1)
    predicted = {TARGET_ONLY: (100.0, 0.01), Arm(4, False): (99.0, 0.2)}
    ctrl._predictions = lambda batch_size, cache: predicted
    arms = [ctrl.choose(1, True, False) for _ in range(EXPLORE_MAX)]
    starts = [i for i in range(1, len(arms)) if arms[i] and not arms[i - 1]]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert len(starts) >= 3 and all(b >= 2 * a - 4 for a, b in itertools.pairwise(gaps)), starts


def test_one_stalled_cycle_does_not_move_the_choice():
    pair, batch = PAIRS["a slow target and a fast draft: long blocks"]
    ctrl = SpeculationController(max_k=4)
    run(ctrl, batch, pair, 200)
    before = ctrl.state()["arm_by_bucket"]
    for _ in range(SETTLE):
        ctrl.observe_cycle(batch, 4, pair.seconds(ctrl.arm, batch), ctrl.arm)
    ctrl.observe_cycle(batch, 4, 100 * pair.seconds(ctrl.arm, batch), ctrl.arm)  # a stall of 100 x a cycle
    arms = run(ctrl, batch, pair, 20, seed=5)
    assert ctrl.state()["arm_by_bucket"] == before and arms[-1] == arms[0]


def test_without_a_draft_ahead_cache_only_arms_become_drafting_ones():
    ctrl = SpeculationController(max_k=4)
    arms = run(ctrl, 8, PAIRS["misses make the batch wait: cache-only pays"][0], 300, cache=False)
    assert not any(a.cache_only for a in arms)


def test_coverage_is_measured_per_k_asked():
    """A deeper ask leaves the draft less time per foreseen branch: its blocks' coverage is its own, so a
    cache that fills 3-token blocks but rarely 4-token ones rates k = 4 cache-only below k = 3."""
    ctrl = SpeculationController(max_k=4)
    for i in range(200):
        ctrl.observe_coverage(3, 3, 8)
        ctrl.observe_coverage(4, 4 if i % 4 == 0 else 1, 8)
        ctrl.observe_acceptance(4, 4)
    assert ctrl.expected_tokens(3, True, 8) == pytest.approx(4.0, abs=0.02)
    assert ctrl.expected_tokens(4, True, 8) < 3.0 < ctrl.expected_tokens(4, False, 8)
    assert ctrl.expected_tokens(2, True, 8) == pytest.approx(3.0, abs=0.02)  # a k never asked borrows its neighbour's


def test_fixed_k_when_not_adaptive_and_nothing_without_a_draft():
    ctrl = SpeculationController(max_k=3, adaptive=False)
    assert [ctrl.choose(8) for _ in range(5)] == [3] * 5 and ctrl.arm == (3, False)
    assert ctrl.choose(8, have_draft=False) == 0 and ctrl.arm is None
    assert not ctrl.push_due(8)


def test_at_k_zero_the_drafts_hear_the_deltas_every_few_steps():
    ctrl = SpeculationController(max_k=4)
    run(ctrl, 1, PAIRS["speculation never pays"][0], 100)
    pushes = [ctrl.push_due(1) for _ in range(8 * PUSH_EVERY)]
    assert sum(pushes) >= 8 and pushes.index(True) < PUSH_EVERY


def test_acceptance_is_the_mean_of_the_draws_then_a_slow_average():
    ctrl = SpeculationController(max_k=2)
    for _ in range(300):
        ctrl.observe_acceptance(2, 1)  # position 0 accepted, position 1 rejected, every time
    assert ctrl.acceptance[0] > 0.99 and ctrl.acceptance[1] < 0.01
    assert ctrl.expected_tokens(2) == pytest.approx(1 + ctrl.acceptance[0] * (1 + ctrl.acceptance[1]))


def test_decisions_replay_from_the_trace():
    pair, batch = PAIRS["an intermediate k"]
    ctrl = SpeculationController(max_k=4, trace=True)
    arms = run(ctrl, batch, pair, 400)
    again = replay(ctrl.state()["trace"], SpeculationController(max_k=4))
    assert again == [tuple(a) for a in arms]


def test_the_cycle_model_recovers_a_line_and_lends_it_to_neighbouring_batch_sizes():
    """Prompt tokens and departures are requests' costs: learned as terms of the line, and the arms'
    seconds are predicted without them."""
    model, r = CycleModel(), random.Random(0)
    truth = np.array([0.004, 0.0002, 0.0003, 0.001, 0.0015, 0.00001, 0.006])  # [1, B, B*k, speculating, misses*k, prompt tokens, left]

    def seconds(b, k, cache_only, prompt, left=0):
        spec = 1.0 if k else 0.0
        return float(truth @ [1, b, b * k, spec, spec * (not cache_only) * k, prompt, left])

    for _ in range(400):
        b, k, c, p = r.choice([4, 6, 8, 12]), r.randrange(5), r.random() < 0.5, r.choice([0, 0, 64])
        left = r.choice([0, 0, 0, 1, 2])
        model.add(b, (k, c), p, seconds(b, k, c, p, left) * r.uniform(0.97, 1.03), left)
    for b, arm in [(8, (3, False)), (8, (0, False)), (16, (2, True)), (16, (4, False))]:
        assert model.seconds(b, arm) == pytest.approx(seconds(b, *arm, 0), rel=0.05)
    assert model.coefficients(8)[6] == pytest.approx(truth[6], rel=0.2)
    assert model.predict_all(8, ((3, False),))[1][0] < 0.02 and model.predict_all(256, ((3, False),)) is None
    assert model.seconds(1024, (1, False)) is None  # nothing measured within two octaves


@pytest.mark.parametrize("cache_only", [True, False])
def test_coverage_is_learned_from_the_warm_rows_of_a_step_that_also_asks_a_new_sequence(cache_only):
    """Under sustained load nearly every step asks some sequence for the first time; the blocks of the
    sequences asked before still say what the cache covers, the new sequence's do not. Drafting
    misses, a block still says how much of it the cache held, so a cache-only arm stays measured
    while a drafting one runs."""
    from types import SimpleNamespace

    from specserve.messages import DraftBlock
    from specserve.step_plan import StepRecord, observe, warm_rows

    ctrl = SpeculationController(max_k=3)
    previous, asked = {"a": 3, "b": 3}, {"a": 3, "c": 3}
    cached = 3 if cache_only else 1
    blocks = {"a": DraftBlock("a", 5, [1, 2, 3][:cached] if cache_only else [1, 2, 3], num_cached=cached),
              "c": DraftBlock("c", 5, [] if cache_only else [4, 5, 6])}
    outcome = SimpleNamespace(blocks=blocks, wait_s=0.0, compute_s=0.0, queue_s=0.0, draft_step_s=0.0)
    for _ in range(50):
        observe(ctrl, StepRecord(2, 4, 0.01, outcome, 2, 1, asked, cache_only=cache_only, warm=warm_rows(previous, asked)))
    assert warm_rows(previous, asked) == {"a"} and warm_rows(None, asked) == frozenset()
    expected = [1.0, 1.0, 1.0] if cache_only else [1.0, 0.0, 0.0]  # a's blocks only
    assert ctrl.coverage[(bucket_of(2), 3)] == pytest.approx(expected, abs=0.02)


def test_target_only_is_left_only_for_a_gain_the_fit_can_tell_from_its_noise():
    """Where a speculative arm delivers what target-only does, within the noise of single cycles, the
    controller keeps target-only instead of following each wobble of the fit into speculation."""
    pair = Pair(0.5, costs(0.02, 0.0, 0.0, 0.0), coverage=1.0)
    base = pair.seconds
    pair.seconds = lambda arm, b: base(arm, b) * (pair.expected(arm) if arm.k == 1 else 1.0 if not arm.k else 3.0)
    ctrl = SpeculationController(max_k=4)
    arms = run(ctrl, 8, pair, 4 * EXPLORE_MAX, noise=0.2)
    tail = arms[-3 * EXPLORE_MAX:]
    assert sum(1 for a in tail if a.k) <= 8 * RUN, {a: tail.count(a) for a in set(tail)}


def test_a_draining_batch_does_not_stand_for_a_steady_one():
    """Target-only cycles a bucket saw only while a larger batch drained (each after a departure) do not
    count as its measurement of target-only: its warm-up still runs target-only itself (where it is
    close to the speculative arms)."""
    pair = Pair(0.8, costs(0.02, 0.0016, 0.001, 0.002, per_seq=0.0002))
    ctrl = SpeculationController(max_k=4)
    run(ctrl, 16, pair, 300)
    for _ in range(2 * RUN):  # a drain through batch 8: target-only, a sequence leaving before every cycle
        ctrl.observe_cycle(8, 8, 2 * pair.seconds(TARGET_ONLY, 8), TARGET_ONLY, left=1)
    arms = run(ctrl, 8, pair, 4 * RUN, seed=3)
    assert any(arms[i:i + RUN] == [TARGET_ONLY] * RUN for i in range(len(arms))), arms


def test_on_recorded_cycles_the_controller_comes_within_5_percent_of_the_best_fixed_arm():
    """Replayed on a setting of the oracle benchmark's reference run (``bench_oracle --traces``: an 8B
    target and a 0.6B draft on two simulated H100s, 64 recorded cycles of every fixed arm at batch 1,
    8 and 32), where the best arm lies between the extremes (k = 3 and k = 2, cache-only, at batch 8
    and 32): the rate the controller's choices imply, after one untimed load, against the best fixed
    arm's. A fixed k = 4 reaches 0.80x at batch 8. Recorded seconds: no timing of this machine."""
    from pathlib import Path

    from benchmarks.bench_replay import load_traces
    from benchmarks.bench_replay import run as replay_run

    rows = replay_run(load_traces(Path(__file__).parent / "data" / "oracle_h100_pair.json.gz"), {"adaptive": SpeculationController})
    assert [r["batch"] for r in rows] == [1, 8, 32]
    assert all(r["adaptive"]["over_best"] >= 0.95 for r in rows), [(r["batch"], r["adaptive"]) for r in rows]


def test_a_bucket_whose_neighbours_ran_target_only_measures_speculation_in_its_warm_up():
    """A drain can reach batch 1 through batch sizes that ran target-only only: their cycles inform the
    fit's line but say nothing of what speculating costs, so the warm-up measures the speculative arms
    too, and the bucket decides within its warm-up rather than at its first exploration."""
    pair = Pair(0.8, costs(0.02, 0.0001, 0.001, 0.002))
    ctrl = SpeculationController(max_k=4)
    for _ in range(4 * RUN):
        ctrl.observe_cycle(2, 2, pair.seconds(TARGET_ONLY, 2), TARGET_ONLY)
    assert ctrl.model.predict_all(1, (TARGET_ONLY,)) is not None  # the neighbours' cycles inform batch 1's fit
    arms = run(ctrl, 1, pair, 4 * RUN + DECIDE_EVERY)
    assert arms[:RUN] == [Arm(4, False)] * RUN and arms[-1] == pair.best(4, 1), arms


def test_a_k_not_measured_reads_the_nearest_measured_coverage_as_it_is_now():
    """A cache-only k the controller has not run borrows the nearest measured k's coverage as that moves,
    not a copy of it from whenever the arm was first predicted (before anything was measured, the prior)."""
    ctrl = SpeculationController(max_k=4)
    assert ctrl.expected_tokens(2, True, 8) > 1.0  # predicted before any measurement
    for got in (4, 1):
        for _ in range(600):
            ctrl.observe_coverage(4, got, 8)
        assert ctrl._coverage(8, 2) == ctrl.coverage[(bucket_of(8), 4)][:2] and (bucket_of(8), 2) not in ctrl.coverage


def test_leaving_target_only_takes_the_best_arm_whose_gain_is_clear():
    """From target-only a switch needs a gain larger than the standard error of the predictions'
    difference; an arm the fit barely knows must not keep the controller from one it knows, predicted
    nearly as well."""
    ctrl = SpeculationController(max_k=4)
    ctrl.buckets[0] = _Bucket(current=TARGET_ONLY, choices=DECIDE_EVERY - 1)
    predicted = {TARGET_ONLY: (100.0, 0.01), Arm(4, False): (300.0, 0.02), Arm(4, True): (301.0, 50.0)}
    ctrl._predictions = lambda batch_size, cache: predicted
    ctrl.model.measured = lambda batch_size, arm: RUN - SETTLE
    assert ctrl.choose(1, True, True) == 4 and not ctrl.cache_only and ctrl.buckets[0].current == Arm(4, False)


def test_an_arm_the_bucket_never_measured_is_explored_before_it_is_run():
    """Predicted by the line alone (a cost that may be no line in k), the best arm is first explored; it
    becomes the choice when its exploration ends and it still clears the hysteresis."""
    ctrl = SpeculationController(max_k=4)
    ctrl.buckets[0] = _Bucket(current=TARGET_ONLY, choices=DECIDE_EVERY - 1)
    ctrl._predictions = lambda batch_size, cache: {TARGET_ONLY: (100.0, 0.01), Arm(2, True): (150.0, 0.02)}
    arms = [ctrl.choose(1, True, True) for _ in range(PROBE)]
    assert arms == [2] * PROBE and ctrl.buckets[0].current == TARGET_ONLY and ctrl.buckets[0].explored == Arm(2, True)
    ctrl.choose(1, True, True)
    assert ctrl.buckets[0].current == Arm(2, True) and ctrl.arm == Arm(2, True)


def test_an_arm_measured_again_after_a_long_gap_is_measured_afresh():
    """Its old cycles measured a host that may have moved since: they make way for the new ones."""
    from specserve.cycle_model import STALE

    model = CycleModel()
    for _ in range(32):
        model.add(1, (4, False), 0, 0.030)
    for _ in range(STALE + 1):
        model.add(1, (0, False), 0, 0.005)
    assert model.measured(1, (4, False)) == 32  # (kept while it does not run)
    model.add(1, (4, False), 0, 0.010)
    assert model.measured(1, (4, False)) == 1
    assert model.seconds(1, (4, False)) == pytest.approx(0.010, rel=0.05)


def test_an_arms_own_residual_is_of_its_steady_cycles_at_its_own_batch_size():
    """The line's terms for prompts and departures are shared by every arm, but what a departure costs
    need not be (the output handling of a verify differs from a plain step's): an arm's own residual is
    of its steady cycles, so a departure's cost unlike the line's cannot move its steady prediction."""
    model, r = CycleModel(), random.Random(1)
    steady, departure = {(0, False): 0.020, (2, True): 0.036}, {(0, False): 0.016, (2, True): 0.002}
    for _ in range(8):
        for arm, cost in steady.items():
            for left in (0, 0, 1, 0, 1, 0):
                model.add(32, arm, 0, (cost + left * departure[arm]) * r.uniform(0.98, 1.02), left)
    for arm, cost in steady.items():
        assert model.seconds(32, arm) == pytest.approx(cost, rel=0.05)


@pytest.mark.parametrize("off_the_line", [False, True])
def test_an_arm_is_held_to_the_line_as_far_as_the_other_arms_sit_on_it(off_the_line):
    """Where the arms measured sit on a line in k, a new arm's first cycles are held to it (two slow
    ones move it little); where they do not (a CPU target's cycle is no line in k), a new arm's own
    first two cycles are believed over the line's extrapolation."""
    model, r = CycleModel(), random.Random(2)
    if off_the_line:
        measured, true = {(0, False): 0.010, (2, True): 0.014, (3, True): 0.021, (4, True): 0.016}, 0.019
    else:
        measured, true = {(0, False): 0.010, (2, True): 0.015, (3, True): 0.0175, (4, True): 0.020}, 0.0125
    for _ in range(32):
        for arm, cost in measured.items():
            model.add(8, arm, 0, cost * r.uniform(0.95, 1.05))
    for _ in range(2):
        model.add(8, (1, True), 0, true * (1.0 if off_the_line else 1.25))
    assert model.seconds(8, (1, True)) == pytest.approx(true, rel=0.1 if off_the_line else 0.05)


def test_a_load_whose_prompts_cost_more_beside_speculation_is_served_target_only():
    """Steady cycles favour speculation by over 10%, but the load prefills a 64-token prompt for every
    64 tokens it generates, and a prompt token costs 0.5 ms in a cycle that speculates against 0.1 ms
    in one that does not (the draft prefills it too): per token generated, target-only is then the
    fastest, and the model says so: a steady cycle's seconds stay its own (the prompts are a term of
    their own), and target-only's predicted rate is the load's. Without prompts the same pair speculates."""
    pair, batch = Pair(0.8, costs(0.015, 0.0007, 0.002, 0.002)), 8
    spec = [Arm(k, False) for k in range(1, 5)]
    assert max(pair.rate(a, batch) for a in spec) > 1.1 * pair.rate(TARGET_ONLY, batch)
    per_token = lambda arm: 0.0005 if arm[0] else 0.0001  # noqa: E731
    per_generated = lambda arm: pair.seconds(arm, batch) / (batch * pair.expected(arm)) + per_token(arm)  # noqa: E731
    assert per_generated(TARGET_ONLY) < 0.95 * min(per_generated(a) for a in spec)
    ctrl = SpeculationController(max_k=4)
    arms = run(ctrl, batch, pair, 1500, cache=False, prompts=(64, 64, per_token))
    assert Counter(arms[-500:]).most_common(1)[0][0] == TARGET_ONLY
    for arm in (TARGET_ONLY, Arm(2, False), Arm(4, False)):  # the warm-up's arms
        assert ctrl.model.seconds(batch, arm) == pytest.approx(pair.seconds(arm, batch), rel=0.1)
    assert ctrl.rates(batch, False)[TARGET_ONLY] == pytest.approx(1 / per_generated(TARGET_ONLY), rel=0.05)
    arms = run(SpeculationController(max_k=4), batch, pair, 1500, cache=False)
    assert Counter(arms[-500:]).most_common(1)[0][0].k > 0
