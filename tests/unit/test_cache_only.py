"""Cache-only steps (the draft answers from its speculation cache alone, drafting nothing on the
critical path) are as lossless as any: greedy output equals target-only's token for token, and
sampled output follows the target's distribution (chi-square). The controller is made to ask
for cache-only answers on every other step, so full, partial and empty blocks are all verified.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.reference import reference_generate

from .test_sampling_lossless import NUM_SAMPLES, PROMPT, chi2_pvalue, exact_distributions, small_vocab_pair  # noqa: F401

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], list(range(12, 40)), [3], [20, 21, 22, 20, 21, 22, 20]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def cache_only_every_other_step(llm: LLM) -> list[list[int]]:
    """Make the engine's controller ask for cache-only answers on every other speculative step;
    returns the block lengths the drafts answered on those steps, one list per step."""
    core = llm._engine.loop.core
    controller, pool = core.controller, core.pool
    choose, propose = controller.choose, pool.propose
    answered: list[list[int]] = []
    calls = [0]

    def choose_alternating(*args, **kwargs):
        k = choose(*args, **kwargs)
        calls[0] += 1
        controller.cache_only = bool(k) and calls[0] % 2 == 0
        return k

    def propose_recording(step, wants, draft_misses=True, budget_s=0.0, **kwargs):
        outcome = propose(step, wants, draft_misses, budget_s, **kwargs)
        if not draft_misses:
            answered.append([len(b.draft_token_ids) for b in outcome.blocks.values()])
        return outcome

    controller.choose, pool.propose = choose_alternating, propose_recording
    return answered


def test_cache_only_steps_keep_greedy_output_exact(tiny_pair, ordered_draft_ahead):
    target = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], dtype=torch.float64).eval()
    reference = [reference_generate(target, p, GREEDY) for p in PROMPTS]
    with LLM(tiny_pair["target"], draft=tiny_pair["perturbed"], num_speculative_tokens=3, dtype="float64", adaptive=False,
             draft_ahead=True, fanout=3, draft_ahead_preempt=False) as llm:
        answered = cache_only_every_other_step(llm)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    lengths = [n for step in answered for n in step]
    assert answered and 0 in lengths and max(lengths) > 0  # cache-only steps answered both empty and drafted blocks


def test_cache_only_steps_keep_sampling_exact(small_vocab_pair, ordered_draft_ahead):  # noqa: F811
    target, draft = small_vocab_pair
    with LLM(target, draft=draft, num_speculative_tokens=3, dtype="float64", adaptive=False, draft_ahead=True,
             draft_ahead_preempt=False, fanout=4) as llm:
        answered = cache_only_every_other_step(llm)
        # 6 tokens: room for blocks on the cache-only steps that decide the second and third tokens
        params = [SamplingParams(temperature=1.0, max_tokens=6, seed=s, ignore_eos=True) for s in range(NUM_SAMPLES)]
        outs = llm.generate([PROMPT] * NUM_SAMPLES, params, use_tqdm=False)
    lengths = [n for step in answered for n in step]
    assert 0 in lengths and max(lengths) > 0
    p1, p2, p3 = exact_distributions(target, 1.0, 0, 1.0)
    assert chi2_pvalue([o.token_ids[0] for o in outs], p1) > 1e-4
    assert chi2_pvalue([o.token_ids[1] for o in outs], p2) > 1e-4
    assert chi2_pvalue([o.token_ids[2] for o in outs], p3) > 1e-4


@pytest.mark.parametrize("batch_size", [1, 8])
def test_the_model_prefers_cache_only_where_it_pays(batch_size):
    """A draft that hides its work (hits) but whose misses cost the whole batch a wait: at batch 8
    answering from the cache alone beats drafting the misses; at batch 1, with near-free misses, not."""
    from specserve.adaptive import Arm, SpeculationController

    c = SpeculationController(4)
    miss = 0.02 if batch_size > 1 else 0.0004  # seconds the misses of a drafting cycle add
    for _ in range(12):
        for arm, seconds in ((Arm(0, False), 0.010), (Arm(4, False), 0.012 + miss), (Arm(4, True), 0.012)):
            for _ in range(4):
                c.observe_cycle(batch_size, batch_size, seconds, arm)
        for pos in range(4):
            c.observe_coverage(4, 4 if pos % 2 else 0, batch_size)  # half the cache-only blocks are full, half empty
        c.observe_acceptance(4, 3)
    rates = {a: r for a, r in c.rates(batch_size, True).items() if a.k}
    assert max(rates, key=rates.get).cache_only is (batch_size > 1), rates