"""The shipped EAGLE-3 head (``demo:eagle``) in vLLM's own colocated EAGLE-3 and in specserve: the same acceptance.

Both run the same head on the same target and prompts at the same fixed k, greedy. Equal mean
acceptance lengths say that specserve hands the head the rows vLLM hands it (the target's
layers 1, 2, 3, at the committed positions): rows from the wrong layer or position would
draft worse. specserve's output equals its own target-only output (the two engines' float32
kernels differ, so their outputs are not compared token for token).
"""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.config import resolve_model

from .conftest import start_runner

K = 3
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def prompts():
    from benchmarks.scenarios import heldout_prompts

    return heldout_prompts(resolve_model("demo:target"), 8, 48)[0]


def test_demo_head_accepts_in_specserve_what_it_accepts_in_vllms_eagle(ray_cluster, prompts):
    import ray

    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    runner = start_runner(model=resolve_model("demo:target"), disable_log_stats=False,
                          speculative_config={"method": "eagle3", "model": resolve_model("demo:eagle"), "num_speculative_tokens": K})
    try:
        ray.get(runner.generate.remote(prompts, greedy))
        spec = ray.get(runner.spec_metrics.remote())
    finally:
        ray.kill(runner)
    vllm_mal = 1 + spec["vllm:spec_decode_num_accepted_tokens"] / spec["vllm:spec_decode_num_drafts"]

    with LLM("demo:target", draft="demo:eagle", num_speculative_tokens=K, adaptive=False, dtype="float32") as llm:
        outs = llm.generate(prompts, SamplingParams(**greedy), use_tqdm=False)
    with LLM("demo:target", draft=None, dtype="float32") as plain:
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, SamplingParams(**greedy), use_tqdm=False)]
    ours_mal = 1 + sum(o.metrics.num_accepted_tokens for o in outs) / sum(o.metrics.num_drafts for o in outs)
    print(f"mean acceptance length at k={K}: specserve {ours_mal:.3f}, vLLM's EAGLE-3 {vllm_mal:.3f}")
    assert ours_mal > 1.5, ours_mal  # a trained head: real acceptance
    assert abs(ours_mal - vllm_mal) <= 0.05 * vllm_mal, (ours_mal, vllm_mal)
