"""Sampled output of a vLLM target with remote drafts follows the target's exact distribution.

The method of ``tests/unit/test_sampling_lossless.py``: thousands of seeded requests of four
tokens on a 12-token vocabulary; the first three generated tokens are compared with the exact
target marginals by a chi-square test at significance 1e-4. The draft is an unrelated model
on the draft node, so most drafts are rejected and the recovered-token path carries most of
the mass; its drafts are greedy point masses, which vLLM verifies as such.
"""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams

from ..conftest import make_model
from ..unit.test_sampling_lossless import chi2_pvalue, exact_distributions, processed_distributions
from .conftest import VLLM_OPTIONS

VOCAB = 12
PROMPT = [3, 7, 1]
NUM_SAMPLES = 3000


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("smallvocab_vllm")
    for name, seed, scale in (("t", 10, 0.1), ("d", 11, 0.5)):  # raw logits are too peaked for a useful test: tame them
        make_model(root / name, seed=seed, vocab_size=VOCAB, hidden=128, max_positions=256)  # vLLM's CPU attention: head_dim 32
        with torch.no_grad():
            m = AutoModelForCausalLM.from_pretrained(root / name)
            m.get_output_embeddings().weight.mul_(scale)
            m.save_pretrained(root / name)
    return str(root / "t"), str(root / "d")


@pytest.fixture(scope="module")
def llm(ray_cluster, small_vocab_pair):
    target, draft = small_vocab_pair
    llm = LLM(target, draft=draft, ray=True, target_backend="vllm", target_backend_options=VLLM_OPTIONS,
              num_speculative_tokens=3, target_num_cpus=0.5, draft_num_cpus=0.5, max_num_seqs=256,
              draft_min_timeout_s=5.0, adaptive=False)  # a slow draft is not a dead one; fixed k: the drafted count stays put
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.8, 5, 1.0), (1.0, 0, 0.8)])
def test_first_three_tokens_follow_the_target(llm, small_vocab_pair, temperature, top_k, top_p):
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=4, seed=s, ignore_eos=True)
              for s in range(NUM_SAMPLES)]
    outs = llm.generate([PROMPT] * NUM_SAMPLES, params, use_tqdm=False)
    p1, p2, p3 = exact_distributions(small_vocab_pair[0], temperature, top_k, top_p)
    assert chi2_pvalue([o.token_ids[0] for o in outs], p1) > 1e-4
    assert chi2_pvalue([o.token_ids[1] for o in outs], p2) > 1e-4  # verified from a draft block
    assert chi2_pvalue([o.token_ids[2] for o in outs], p3) > 1e-4
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert drafted > NUM_SAMPLES and 0 < accepted < 0.9 * drafted  # drafts were verified, and often rejected


def test_sampled_with_penalties_bias_and_min_p_follows_the_processed_target(llm, small_vocab_pair):
    """vLLM leaves min_p and logit_bias out under speculation; with specserve's proposer they apply at
    every verified position (``specserve.vllm.patches``), beside vLLM's own penalties: the first three
    tokens follow the processed target distributions, each position processed with its own prefix."""
    target, _ = small_vocab_pair
    extra = {"repetition_penalty": 1.6, "presence_penalty": 0.8, "logit_bias": ((2, 1.5), (5, -0.7)), "min_p": 0.3}
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=s, ignore_eos=True, **extra) for s in range(NUM_SAMPLES)]
    outs = llm.generate([PROMPT] * NUM_SAMPLES, params, use_tqdm=False)
    p1, p2, p3, p2_given = processed_distributions(target, params[0])
    for pos, expected in enumerate((p1, p2, p3)):
        assert chi2_pvalue([o.token_ids[pos] for o in outs], expected) > 1e-4, pos
    # Each part matters: without the processing, or without min-p's mask, the second token's distribution is another.
    plain = exact_distributions(target, 1.0, 0, 1.0)
    assert (p2 - plain[1]).abs().max() > 0.05
    assert (p2_given == 0).any(dim=1).all() and (p2 - processed_distributions(target, params[0], min_p=0.0)[1]).abs().max() > 0.02
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    assert drafted > NUM_SAMPLES and sum(o.metrics.num_accepted_tokens for o in outs) > 0  # verified from drafts
