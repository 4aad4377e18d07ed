"""Speculation length from measured goodput: picks the k the cost model says, and k=0 when it never pays."""

from __future__ import annotations

from specserve.adaptive import SpeculationController


def feed(ctrl: SpeculationController, batch: int, acceptance: float, t_target1: float, per_token: float, link: float,
         draft_step: float, steps: int = 300) -> list[int]:
    """Simulate steps whose costs follow the given model; returns the ks the controller chose."""
    chosen = []
    for _ in range(steps):
        k = ctrl.choose(batch)
        chosen.append(k)
        t_target = t_target1 + per_token * k * batch
        if k:
            accepted = 0
            while accepted < k and (hash((len(chosen), accepted)) % 1000) / 1000 < acceptance:
                accepted += 1
            ctrl.observe_acceptance(k, accepted)
            ctrl.observe_step(batch, k + 1, t_target, wait_s=link + k * draft_step, draft_compute_s=k * draft_step,
                              draft_forward_s=k * draft_step, draft_step_s=draft_step)
        else:
            ctrl.observe_step(batch, 1, t_target)
    return chosen


def settled(chosen: list[int]) -> int:
    tail = chosen[-100:]
    return max(set(tail), key=tail.count)


def test_slow_target_fast_draft_speculates_deeply():
    # A 32B target on a Spark (~250 ms/step, memory bound) and a draft at ~2 ms: long blocks pay.
    ctrl = SpeculationController(max_k=8)
    k = settled(feed(ctrl, batch=1, acceptance=0.8, t_target1=0.25, per_token=0.002, link=0.001, draft_step=0.002))
    assert k >= 6
    table = ctrl.predict(1)
    assert table[k]["speedup"] > 2.0


def test_draft_as_slow_as_target_turns_speculation_off():
    ctrl = SpeculationController(max_k=8)
    k = settled(feed(ctrl, batch=1, acceptance=0.5, t_target1=0.003, per_token=0.001, link=0.002, draft_step=0.003))
    assert k == 0


def test_large_batches_on_a_compute_bound_target_need_less_speculation():
    slow = SpeculationController(max_k=8)
    k_small = settled(feed(slow, batch=1, acceptance=0.7, t_target1=0.02, per_token=0.0005, link=0.0005, draft_step=0.001))
    busy = SpeculationController(max_k=8)
    k_large = settled(feed(busy, batch=32, acceptance=0.7, t_target1=0.02, per_token=0.0005, link=0.0005, draft_step=0.001))
    assert k_large < k_small


def test_fixed_k_when_not_adaptive_and_zero_without_a_draft():
    ctrl = SpeculationController(max_k=5, adaptive=False)
    assert {ctrl.choose(4) for _ in range(50)} == {5}
    assert ctrl.choose(4, have_draft=False) == 0


def test_speculation_off_is_probed_again():
    ctrl = SpeculationController(max_k=4, probe_every=16)
    chosen = feed(ctrl, batch=1, acceptance=0.3, t_target1=0.003, per_token=0.001, link=0.003, draft_step=0.003, steps=200)
    tail = chosen[-100:]
    assert tail.count(0) > 80 and any(k > 0 for k in tail)  # mostly off, but still measuring


def test_expected_tokens_follow_per_position_acceptance():
    ctrl = SpeculationController(max_k=3)
    ctrl.acceptance = [0.5, 0.5, 0.5]
    assert ctrl.expected_tokens(0) == 1.0
    assert ctrl.expected_tokens(3) == 1 + 0.5 + 0.25 + 0.125


def feed_cycles(ctrl: SpeculationController, batch: int, hidden_s: float, steps: int) -> list[int]:
    """Steps the model thinks pay (fast draft, high acceptance) but whose whole cycle carries a cost the
    model does not see (``hidden_s`` per speculative step: e.g. the engine's handling of longer outputs)."""
    chosen = []
    for i in range(steps):
        k = ctrl.choose(batch)
        chosen.append(k)
        t_target = 0.01 + 0.0001 * k * batch
        accepted = k if k and i % 5 else max(0, k - 1)
        if k:
            ctrl.observe_acceptance(k, accepted)
            ctrl.observe_step(batch, k + 1, t_target, wait_s=0.0002, draft_compute_s=0.0001, draft_forward_s=0.0001,
                              draft_step_s=0.0001)
        else:
            ctrl.observe_step(batch, 1, t_target)
        ctrl.observe_cycle(batch, batch * (1 + accepted), t_target + (hidden_s if k else 0.0), bool(k))
    return chosen


def test_what_was_delivered_overrules_the_model_on_whether_to_speculate():
    ctrl = SpeculationController(max_k=4)
    chosen = feed_cycles(ctrl, batch=8, hidden_s=0.1, steps=400)  # speculating pays in the model, not in the cycles
    assert settled(chosen) == 0 and ctrl.predict(8)[4]["speedup"] > 1.2
    assert ctrl.state()["realized_tokens_per_s"]["8/off"] > ctrl.state()["realized_tokens_per_s"]["8/on"]
    honest = SpeculationController(max_k=4)
    assert settled(feed_cycles(honest, batch=8, hidden_s=0.0, steps=400)) > 0  # the model right: it holds


def test_probes_of_a_losing_choice_become_rarer():
    ctrl = SpeculationController(max_k=4, probe_every=16)
    chosen = feed_cycles(ctrl, batch=8, hidden_s=0.1, steps=3000)
    late = chosen[-1000:]
    # one probe of 5 steps in 16 would be ~310 speculative steps in 1,000: probes back off while they confirm k = 0
    assert sum(1 for k in late if k) < 1000 / 16 * 5 / 4
    assert any(k for k in late)  # but never stop


def test_k_zero_steps_hand_the_drafts_their_deltas_only_before_a_probe():
    ctrl = SpeculationController(max_k=4, probe_every=16)
    feed_cycles(ctrl, batch=8, hidden_s=0.1, steps=2000)  # settled on k = 0, probes far apart
    pushes, probes = 0, 0
    for _ in range(1000):
        k = ctrl.choose(8)
        probes += k > 0
        pushes += k == 0 and ctrl.push_due(8)
        ctrl.observe_cycle(8, 8 if not k else 16, 0.01 if not k else 0.2, bool(k))
    assert 0 < pushes <= probes  # one push ahead of each probe, nothing sent on the other k = 0 steps


def test_one_slow_cycle_of_batch_churn_does_not_decide_between_the_choices():
    # batch 8, demo pair as measured: plain cycles 3 ms, speculative ones 12 ms for 2.5 tokens per sequence
    ctrl = SpeculationController(max_k=4)
    for _ in range(12):
        ctrl.observe_cycle(8, 20, 0.012, True)
    for _ in range(12):
        ctrl.observe_cycle(8, 8, 0.003, False)
    ctrl.observe_cycle(8, 8, 0.0126, False)  # requests finished and new ones arrived during this one
    off, on = ctrl.realized_rate(8, False), ctrl.realized_rate(8, True)
    assert off > on
    assert abs(off - 1 / 0.003) < 1.0  # the slow cycle is left out, not averaged in
