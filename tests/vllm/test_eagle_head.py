"""The shipped EAGLE-3 head (``demo:eagle``) in vLLM's own colocated EAGLE-3 and in specserve: the same acceptance.

Both run the same head on the same target and prompts at the same fixed k, greedy. Equal mean
acceptance lengths say that specserve hands the head the rows vLLM hands it (the target's
layers 1, 2, 3, at the committed positions): rows from the wrong layer or position would
draft worse. With specserve's own target engine, the output equals its own target-only output
(the two engines' float32 kernels differ, so their outputs are not compared token for token);
with a vLLM target and the head on the draft node, it equals vLLM's target-only output.
"""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.config import resolve_model

from .conftest import VLLM_OPTIONS, start_runner, vllm_greedy

K = 3
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def prompts():
    from benchmarks.scenarios import heldout_prompts

    return heldout_prompts(resolve_model("demo:target"), 8, 48)[0]


GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def vllm_mal(ray_cluster, prompts):
    """Mean acceptance length of the head in vLLM's own colocated EAGLE-3."""
    import ray

    runner = start_runner(model=resolve_model("demo:target"), disable_log_stats=False,
                          speculative_config={"method": "eagle3", "model": resolve_model("demo:eagle"), "num_speculative_tokens": K})
    try:
        ray.get(runner.generate.remote(prompts, GREEDY))
        spec = ray.get(runner.spec_metrics.remote())
    finally:
        ray.kill(runner)
    return 1 + spec["vllm:spec_decode_num_accepted_tokens"] / spec["vllm:spec_decode_num_drafts"]


def test_demo_head_accepts_in_specserve_what_it_accepts_in_vllms_eagle(ray_cluster, prompts, vllm_mal):
    greedy = GREEDY

    with LLM("demo:target", draft="demo:eagle", num_speculative_tokens=K, adaptive=False, dtype="float32") as llm:
        outs = llm.generate(prompts, SamplingParams(**greedy), use_tqdm=False)
    with LLM("demo:target", draft=None, dtype="float32") as plain:
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, SamplingParams(**greedy), use_tqdm=False)]
    ours_mal = 1 + sum(o.metrics.num_accepted_tokens for o in outs) / sum(o.metrics.num_drafts for o in outs)
    print(f"mean acceptance length at k={K}: specserve {ours_mal:.3f}, vLLM's EAGLE-3 {vllm_mal:.3f}")
    assert ours_mal > 1.5, ours_mal  # a trained head: real acceptance
    assert abs(ours_mal - vllm_mal) <= 0.05 * vllm_mal, (ours_mal, vllm_mal)


@pytest.fixture(scope="module")
def vllm_reference(ray_cluster, prompts):
    return vllm_greedy(resolve_model("demo:target"), prompts, MAX_TOKENS)


def _vllm_target_with_the_head(**kw) -> LLM:
    return LLM("demo:target", draft="demo:eagle", ray=True, target_backend="vllm", target_backend_options=VLLM_OPTIONS,
               num_speculative_tokens=K, adaptive=False, target_num_cpus=0.5, draft_num_cpus=0.5, draft_min_timeout_s=5.0, **kw)


@pytest.mark.parametrize("fc", ["draft", "target"])
def test_a_head_on_the_draft_node_reads_a_vllm_targets_rows(ray_cluster, prompts, vllm_mal, vllm_reference, fc):
    """vLLM's runner keeps the head's layers and hands each step's rows to specserve's proposer, which sends the
    committed positions' rows to the head on the draft node (through the head's fc first, ``head_fc: target``):
    output equals vLLM target-only, acceptance vLLM's own."""
    with _vllm_target_with_the_head(head_fc=fc) as llm:
        outs = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
        m = llm.metrics()
    assert [o.token_ids for o in outs] == vllm_reference
    assert m["drafts"]["hidden_bytes"] > 0 and m["drafts"]["num_drafts_up"] == 1
    committed = sum(len(p) + len(o.token_ids) - 1 for p, o in zip(prompts, outs))
    print(f"head_fc={fc}: {m['drafts']['hidden_bytes']} hidden bytes for {committed} committed positions")
    width = 256 * (1 if fc == "target" else 3) * 4  # the demo target: 256 wide, float32 here; three layers unless combined
    assert m["drafts"]["hidden_bytes"] % width == 0 and m["drafts"]["hidden_bytes"] <= committed * width
    mal = 1 + m["num_accepted_tokens"] / m["num_drafts"]
    print(f"mean acceptance length at k={K}: specserve with a vLLM target {mal:.3f}, vLLM's EAGLE-3 {vllm_mal:.3f}")
    assert abs(mal - vllm_mal) <= 0.05 * vllm_mal, (mal, vllm_mal)


def test_a_head_drafting_ahead_beside_a_vllm_target_stays_exact(ray_cluster, prompts, vllm_reference):
    """The head's speculation cache on the vLLM path: blocks from it (drafted on the head's own rows) are
    verified by vLLM; output equals vLLM target-only."""
    with _vllm_target_with_the_head(draft_ahead=True, draft_ahead_preempt=False) as llm:
        outs = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
        m = llm.metrics()
    assert [o.token_ids for o in outs] == vllm_reference
    assert m["num_cache_hits"] > 0
