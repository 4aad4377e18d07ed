"""Adaptive speculation on the vLLM target path (``RemoteDraftProposer`` + specserve's controller).

The proposer picks each step's k (0 .. num_speculative_tokens) and whether the draft answers
from its speculation cache alone; its warm-up runs both, so even these short runs verify
k = 0 steps (which vLLM runs as it runs a target without speculation), full-k steps and
cache-only steps. Greedy output equals vLLM target-only's token for token, and unseeded sampled
output (seeded requests keep a fixed k) follows the target's exact distribution (chi-square).
"""

from __future__ import annotations

from specserve import LLM, SamplingParams

from ..unit.test_sampling_lossless import chi2_pvalue, exact_distributions
from .conftest import VLLM_OPTIONS, random_prompts, vllm_greedy
from .test_sampling_lossless import NUM_SAMPLES, PROMPT, small_vocab_pair  # noqa: F401

PROMPTS = random_prompts(6) + [[5, 6, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def adaptive_llm(target: str, draft: str, k: int) -> LLM:
    # draft_ahead=True: the test cluster's two nodes share this machine's cores, where "auto" would
    # rightly keep it off, and cache-only steps need a speculation cache.
    return LLM(target, draft=draft, ray=True, target_backend="vllm", target_backend_options=VLLM_OPTIONS,
               num_speculative_tokens=k, target_num_cpus=0.5, draft_num_cpus=0.5, draft_min_timeout_s=5.0,
               adaptive=True, draft_ahead=True, max_num_seqs=256)


def test_adaptive_k_and_cache_only_steps_keep_greedy_output_exact(ray_cluster):
    from specserve.config import resolve_model

    reference = vllm_greedy(resolve_model("demo:target"), PROMPTS, GREEDY.max_tokens)
    llm = adaptive_llm("demo:target", "demo:draft", 4)
    try:
        outs = [llm.generate(PROMPTS[i:i + 2], GREEDY, use_tqdm=False) for i in range(0, len(PROMPTS), 2)]
        m = llm.metrics()
    finally:
        llm.shutdown()
    assert [o.token_ids for batch in outs for o in batch] == reference
    # A bucket's warm-up (its first choices, whatever the timings) runs k = 0, then 4, 2 and 1, each
    # cache-only and not: all of them ran. (Which arm follows depends on measured timings, so is not asserted.)
    assert m["speculation"]["adaptive"] is True
    assert m["num_cache_only_steps"] >= 1 and m["num_proposals"] < m["num_steps"]
    assert m["num_plain_steps"] >= 1  # steps that verified no drafts ran through vLLM's plain sampler


def test_adaptive_k_keeps_sampling_exact(ray_cluster, small_vocab_pair):  # noqa: F811
    target, draft = small_vocab_pair
    llm = adaptive_llm(target, draft, 3)
    try:
        # Unseeded: a seeded sampled request keeps the configured k (its block boundaries are part of
        # what the seed decides), so only unseeded ones let the controller vary k and the mode.
        params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
        outs = llm.generate([PROMPT] * NUM_SAMPLES, params, use_tqdm=False)
        m = llm.metrics()
    finally:
        llm.shutdown()
    p1, p2, p3 = exact_distributions(target, 1.0, 0, 1.0)
    assert chi2_pvalue([o.token_ids[0] for o in outs], p1) > 1e-4
    assert chi2_pvalue([o.token_ids[1] for o in outs], p2) > 1e-4
    assert chi2_pvalue([o.token_ids[2] for o in outs], p3) > 1e-4
    assert m["num_proposals"] > 0  # drafts were asked for and verified
    assert m["num_plain_steps"] > 0  # and steps without drafts sampled through vLLM's plain sampler
