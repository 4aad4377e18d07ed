"""A vLLM target (Ray actor on the target node) verifying drafts from a draft on the draft node.

Greedy output equals vLLM's own target-only greedy output token for token, for concurrent
requests, with a transformers draft and with a vLLM draft; streams, cancellation and
seeded sampling go through the same worker surface as specserve's own engine.
"""

from __future__ import annotations

import asyncio

import pytest

from specserve import LLM, SamplingParams

from .conftest import ROLE, VLLM_OPTIONS, random_prompts, vllm_greedy

TARGET, DRAFT = "demo:target", "demo:draft"
PROMPTS = random_prompts(10) + [[5, 6, 7], list(range(40, 90))]  # 12 concurrent requests, 3..50 prompt tokens
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(ray_cluster):
    from specserve.config import resolve_model

    return vllm_greedy(resolve_model(TARGET), PROMPTS, GREEDY.max_tokens)


def ray_llm(draft_backend: str, **kw) -> LLM:
    draft_options = {"draft_backend_options": VLLM_OPTIONS} if draft_backend == "vllm" else {}
    # Shared CPU cores: never time a slow draft out here. Fixed k: the speculation counts asserted
    # below then follow from the greedy outputs (with adaptive k they follow measured timings).
    return LLM(TARGET, draft=DRAFT, ray=True, target_backend="vllm", target_backend_options=VLLM_OPTIONS,
               draft_backend=draft_backend, num_speculative_tokens=4, target_num_cpus=0.5, draft_num_cpus=0.5,
               draft_min_timeout_s=5.0, adaptive=False, **draft_options, **kw)


@pytest.fixture(scope="module")
def hf_draft_llm(ray_cluster):
    llm = ray_llm("hf")
    yield llm
    llm.shutdown()


def test_sides_on_their_nodes_and_greedy_exact_with_a_transformers_draft(hf_draft_llm, reference):
    import ray

    engine = hf_draft_llm._engine
    labels = {n["NodeID"]: n["Labels"] for n in ray.nodes()}
    assert labels[engine.target_info["node_id"]][ROLE] == "target"
    assert labels[engine.draft_info[0]["node_id"]][ROLE] == "draft"
    outs = hf_draft_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    m = hf_draft_llm.metrics()
    assert m["backend"] == "vllm" and m["num_running"] == 0
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]
    assert m["drafts"]["num_drafts_up"] == 1 and m["num_fallback_steps"] == 0
    assert sum(o.metrics.num_draft_tokens for o in outs) == m["num_draft_tokens"]


def test_streams_join_the_running_batch_and_cancelling_frees_the_draft(hf_draft_llm, reference):
    import time

    async def one(i, delay):
        await asyncio.sleep(delay)
        toks = []
        async for d in hf_draft_llm.stream(PROMPTS[i], GREEDY):
            toks += d.token_ids
        return toks

    async def cancelled():
        async for _ in hf_draft_llm.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)):
            break

    async def main():
        await cancelled()
        return await asyncio.gather(*[one(i, 0.03 * i) for i in range(len(PROMPTS))])

    assert asyncio.run(main()) == reference
    deadline = time.time() + 60  # the close reaches the draft when the target idles
    while time.time() < deadline:
        m = hf_draft_llm.metrics()
        if m["num_running"] == 0 and m["drafts"]["num_seqs"] == 0:
            break
        time.sleep(0.2)
    assert m["num_running"] == 0 and m["drafts"]["num_seqs"] == 0  # the aborted request was closed on the draft too


def test_seeded_sampling_is_reproducible(hf_draft_llm):
    params = [SamplingParams(temperature=0.9, top_k=50, max_tokens=24, seed=s, ignore_eos=True) for s in range(6)]
    first = [o.token_ids for o in hf_draft_llm.generate(PROMPTS[:6], params, use_tqdm=False)]
    again = [o.token_ids for o in hf_draft_llm.generate(PROMPTS[:6], params, use_tqdm=False)]
    assert first == again and len({tuple(t) for t in first}) == 6


def test_greedy_exact_with_a_vllm_draft(ray_cluster, hf_draft_llm, reference):
    hf_draft_llm.shutdown()  # one target engine at a time: two would share the cores
    llm = ray_llm("vllm")
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == reference
        m = llm.metrics()
        assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]
        assert m["drafts"]["drafts"]["draft-0"]["backend"] == "vllm"
    finally:
        llm.shutdown()
