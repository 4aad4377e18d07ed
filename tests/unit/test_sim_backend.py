"""The latency-model simulator backend: bookkeeping like a real backend, exact greedy pairs, the time model."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.backends.sim import SimBackend
from specserve.backends.sim_latency import link_names, load_link, load_profile, profile_names

SIM = dict(target_backend="sim", draft_backend="sim", target_backend_options={"time_scale": 0.0}, cpu_threads=1)


def random_contexts(n: int, seed: int = 0, vocab: int = 1024) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(vocab) for _ in range(r.randrange(1, 40))] for _ in range(n)]


def sim_llm(draft: bool, acceptance: float = 0.8, **kw) -> LLM:
    if not draft:
        return LLM("sim:qwen3-32b-dgx-spark", draft=None, target_backend="sim", target_backend_options={"time_scale": 0.0},
                   cpu_threads=1, **kw)
    return LLM("sim:qwen3-32b-dgx-spark", draft="sim:qwen3-1.7b-rtx5090",
               draft_backend_options={"time_scale": 0.0, "acceptance": acceptance}, **SIM, **kw)


@pytest.mark.parametrize("ahead,adaptive", [(True, False), (False, False), (True, True)])
def test_sim_pair_greedy_equals_sim_target_only(ahead, adaptive, ordered_draft_ahead):
    # Drafting ahead is ordered before each request (ordered_draft_ahead) and never preempted, so
    # hits follow from the outputs and the k chosen. Under adaptive k the k after the warm-up moves
    # with timings, but the warm-up's first steps (k = max, max // 2 and max again, deterministic)
    # already draft and hit, so both assertions below hold whatever the machine.
    prompts = random_contexts(6, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with sim_llm(False) as target_only:
        ref = [o.token_ids for o in target_only.generate(prompts, params, use_tqdm=False)]
    with sim_llm(True, num_speculative_tokens=4, draft_ahead=ahead, draft_ahead_preempt=False, adaptive=adaptive) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        hits = llm.metrics()["num_cache_hits"]
    assert [o.token_ids for o in outs] == ref
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert (hits > 0) == ahead  # forward_branches ran and its blocks were used


def test_a_prefill_that_rides_in_the_verify_is_recorded_with_its_cycle(monkeypatch):
    """The controller learns a cycle's prompt tokens and the sequences that left before it as terms of
    the cycle model: the cycle that admitted every prompt must not count as a slow cycle of whichever
    arm it met."""
    monkeypatch.setenv("SPECSERVE_TRACE", "1")
    prompts = random_contexts(6, seed=4)
    with sim_llm(True, num_speculative_tokens=4, adaptive=True) as llm:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        trace = llm.metrics()["speculation"]["trace"]
    cycles = [e for e in trace if e[0] == "cycle"]
    assert sum(e[6] for e in cycles) == sum(len(p) for p in prompts)  # (however the steps admitted them)
    # and so are the departures, each in the cycle after its last (the last cycle's have no cycle after)
    assert sum(e[7] for e in cycles) == len(prompts) - cycles[-1][1]


@pytest.mark.parametrize("acceptance", [0.3, 0.8, 0.95])
def test_draft_agrees_with_target_argmax_at_the_configured_rate(acceptance):
    contexts = random_contexts(20000)
    target, draft = SimBackend(time_scale=0.0), SimBackend(role="draft", acceptance=acceptance, time_scale=0.0)
    p, q = target.logits_for(contexts), draft.logits_for(contexts)
    agree = (p.argmax(1) == q.argmax(1)).mean()
    assert abs(agree - acceptance) < 0.015  # 20000 Bernoulli draws: sd <= 0.0035
    # Sampled: proper distributions, q close to p, overlap (the acceptance probability) at least the configured rate.
    overlap = torch.minimum(torch.softmax(torch.from_numpy(p), -1), torch.softmax(torch.from_numpy(q), -1)).sum(-1).mean()
    assert acceptance - 0.015 < overlap < acceptance + (1 - acceptance) * 0.5


def test_acceptance_through_llm_is_geometric_in_the_configured_rate():
    prompts = random_contexts(8, seed=2)
    with sim_llm(True, acceptance=0.7, num_speculative_tokens=1, adaptive=False) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True), use_tqdm=False)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    assert drafted > 400 and abs(accepted / drafted - 0.7) < 0.07


def test_logits_are_a_deterministic_function_of_the_context():
    contexts = random_contexts(50)
    a, b = SimBackend(time_scale=0.0), SimBackend(time_scale=0.0)
    assert np.array_equal(a.logits_for(contexts), b.logits_for(contexts))
    assert not np.array_equal(a.logits_for(contexts), SimBackend(seed=1, time_scale=0.0).logits_for(contexts))
    # Only the last context_window tokens and the position matter.
    c = SimBackend(time_scale=0.0, context_window=2)
    assert np.array_equal(c.logits_for([[1, 2, 3]]), c.logits_for([[9, 2, 3]]))
    assert not np.array_equal(c.logits_for([[1, 2, 3]]), c.logits_for([[2, 3]]))


def test_forward_matches_logits_for_and_tracks_lengths_like_a_real_backend():
    b = SimBackend(time_scale=0.0, max_model_len=32)
    seqs = {"a": [1, 2, 3, 4, 5], "b": [7, 8], "c": list(range(9, 16))}
    for s in seqs:
        b.add(s)
    with pytest.raises(KeyError):
        b.add("a")
    out = b.forward(list(seqs), list(seqs.values()), [1, 2, 3])  # right-aligned, zero padding on the left
    assert out.shape == (3, 3, 1024) and out.dtype == torch.float32
    assert torch.equal(out[1, -2:], torch.from_numpy(b.logits_for([[7], [7, 8]])))
    assert torch.equal(out[2], torch.from_numpy(b.logits_for([seqs["c"][:5], seqs["c"][:6], seqs["c"]])))
    assert not out[0, :2].any()
    b.truncate("a", 3)
    assert b.num_cached("a") == 3
    out = b.forward(["a"], [[20, 21]], [2])
    assert torch.equal(out[0], torch.from_numpy(b.logits_for([[1, 2, 3, 20], [1, 2, 3, 20, 21]])))
    b.free("b")
    with pytest.raises(KeyError):
        b.num_cached("b")
    with pytest.raises(ValueError, match="max_model_len"):
        b.forward(["a", "c"], [[1], list(range(30))], [1, 1])
    assert b.num_cached("a") == 5 and b.num_cached("c") == 7  # a failed forward commits nothing
    with pytest.raises(ValueError, match="exceeds"):
        SimBackend(max_model_len=10**6)


def test_forward_branches_equal_forward_on_each_branch():
    contexts = {"a": list(range(1, 12)), "b": list(range(40, 47))}
    tree = SimBackend(role="draft", time_scale=0.0)
    for s, toks in contexts.items():
        tree.add(s)
    tree.forward(list(contexts), list(contexts.values()), [1, 1])
    # Lanes: (prefix length, tokens per depth). Row b has fewer lanes than num_lanes (padding).
    lanes = {"a": [(11, [5, 6, 7]), (9, [8, 9, 10]), (4, [3, 3, 3])], "b": [(7, [1, 2, 3])]}
    for depth in range(3):
        out = tree.forward_branches(list(lanes), [[t[depth] for _, t in lanes[s]] for s in lanes],
                                    [[p for p, _ in lanes[s]] for s in lanes], depth, num_lanes=3)
        assert out.shape == (2, 3, 1024)
        for row, s in enumerate(lanes):
            for lane, (p, toks) in enumerate(lanes[s]):
                expected = tree.logits_for([contexts[s][:p] + toks[: depth + 1]])[0]
                assert torch.equal(out[row, lane], torch.from_numpy(expected))
    assert tree.num_cached("a") == 11 and tree.num_cached("b") == 7  # scratch is never committed


def test_time_model_grows_with_batch_context_and_new_tokens():
    m = load_profile("qwen3-32b-dgx-spark")
    assert m.forward_s([1], [100]) < m.forward_s([1], [4000]) < m.forward_s([1] * 8, [4000] * 8) < m.forward_s([1] * 32, [4000] * 32)
    assert m.forward_s([1] * 32, [100] * 32) <= m.forward_s([5] * 32, [100] * 32) < m.forward_s([512] * 32, [512] * 32)
    # Memory bound: a 32B bf16 step on a DGX Spark ~0.25-0.3 s, a 1.7B step on an RTX 5090 ~2-3 ms.
    assert 0.22 < m.decode_step_s() < 0.32
    assert 1.5e-3 < load_profile("qwen3-1.7b-rtx5090").decode_step_s() < 3.5e-3
    assert load_profile("qwen3-8b-h100").decode_step_s() < load_profile("qwen3-8b-dgx-spark").decode_step_s()
    b = SimBackend(time_scale=0.0)
    b.add("s")
    b.forward(["s"], [[1] * 8], [1])
    first = b.modelled_s
    b.forward(["s"], [[1] * 8], [1])  # same tokens, longer context
    assert b.modelled_s - first == 0.0  # time_scale 0: no time at all


def test_forward_sleeps_its_modelled_time():
    b = SimBackend(profile="qwen3-1.7b-dgx-spark", time_scale=0.5)  # ~7.5 ms
    b.add("s")
    start = time.perf_counter()
    b.forward(["s"], [[1, 2, 3]], [1])
    assert time.perf_counter() - start >= b.modelled_s > 5e-3


def test_profiles_links_and_errors():
    assert {"qwen3-32b-dgx-spark", "qwen3-1.7b-rtx5090", "qwen3-8b-h100"} <= set(profile_names())
    for name in profile_names():
        assert load_profile(name).decode_step_s() > 0
    assert {"same-host", "10gbe", "1gbe"} <= set(link_names())
    assert load_link("1gbe").one_way_s(125_000) == pytest.approx(0.15e-3 + 1e-3)
    with pytest.raises(ValueError, match="qwen3-32b-dgx-spark"):
        load_profile("qwen3-32b-nowhere")
    custom = {"model": {"num_params": 1e9, "bytes_per_param": 2, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                        "head_dim": 64, "max_model_len": 128}, "hardware": {"memory_bandwidth_gb_s": 1, "peak_tflops": 1}}
    assert load_profile(custom).decode_step_s(context=1) == pytest.approx(2.0, rel=1e-3)
    with pytest.raises(ValueError, match="role"):
        SimBackend(role="verifier")
    with pytest.raises(ValueError, match="acceptance"):
        SimBackend(role="draft", acceptance=1.5)


def test_config_path_needs_no_model_directory():
    from specserve.build import build_draft_service, build_target
    from specserve.config import SpecserveConfig
    from specserve.preflight import preflight

    cfg = SpecserveConfig.load(target="sim:qwen3-8b-h100", draft="sim:qwen3-0.6b-h100", **SIM,
                               draft_backend_options={"acceptance": 0.6, "time_scale": 0.0})
    preflight(cfg, distributed=True)
    target = build_target(cfg)
    assert target.tokenizer is None and target.eos_token_ids == set()
    assert target.backend.latency.name == "qwen3-8b-h100" and target.backend.role == "target"
    service = build_draft_service(cfg)
    assert service.drafter.backend.role == "draft" and service.drafter.backend.acceptance == 0.6
    with pytest.raises(ValueError, match="unknown sim profile"):
        build_target(SpecserveConfig.load(target="sim:nope", target_backend="sim"))


def test_acceptance_after_a_long_stretch_at_k_zero_equals_acceptance_before():
    """Speculation that resumes after hundreds of target-only steps finds the draft current: its blocks are
    accepted as often as before the stretch (a draft left stale would be rejected, or resynced at a cost)."""
    from specserve.adaptive import TARGET_ONLY, Arm, SpeculationController

    class Scripted(SpeculationController):  # k = 4, then 300 steps of k = 0, then k = 4 again
        def __init__(self):
            super().__init__(4)
            self.step, self.by_phase = 0, {0: [0, 0], 1: [0, 0], 2: [0, 0]}

        def _choose(self, batch_size, have_draft, cache):
            self.step += 1
            return TARGET_ONLY if 100 < self.step <= 400 else Arm(4, False)

        def observe_acceptance(self, num_draft_tokens, num_accepted):
            phase = self.by_phase[0 if self.step <= 100 else 2]
            phase[0] += num_draft_tokens
            phase[1] += num_accepted
            super().observe_acceptance(num_draft_tokens, num_accepted)

    prompts = random_contexts(4, seed=3)
    with sim_llm(True, acceptance=0.7, num_speculative_tokens=4, adaptive=True) as llm:
        core = llm._engine.loop.core
        core.controller = Scripted()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True), use_tqdm=False)
        pushed = llm.metrics()["drafts"]
    with sim_llm(False) as target_only:
        reference = target_only.generate(prompts, SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    before, after = (accepted / drafted for drafted, accepted in (core.controller.by_phase[0], core.controller.by_phase[2]))
    assert core.controller.step > 450 and core.controller.by_phase[2][0] > 400
    assert abs(after - before) < 0.08, (before, after, pushed)
