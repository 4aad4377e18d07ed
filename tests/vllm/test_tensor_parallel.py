"""Each side's tensor parallelism is its own: TP=2 on one side, unsharded on the other.

Two vLLM worker processes (one OpenMP core group each, ``VLLM_CPU_OMP_THREADS_BIND`` set
by specserve on a one-NUMA-node machine) inside the side's actor. A TP=2 vLLM draft serves
a transformers target; a TP=2 vLLM target verifies a transformers draft, its proposer
running in vLLM's rank-0 worker process (the other rank proposes nothing; vLLM uses rank
0's drafts) and reaching the draft by the address it was handed. Greedy output equals the
target-only reference both ways.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.config import resolve_model
from specserve.reference import reference_generate

from .conftest import ROLE, VLLM_OPTIONS, random_prompts, vllm_greedy

PROMPTS = random_prompts(8, seed=2)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def reference():
    target = AutoModelForCausalLM.from_pretrained(resolve_model("demo:target"), dtype=torch.float32).eval()
    return [reference_generate(target, p, GREEDY) for p in PROMPTS]


def test_draft_with_two_tensor_parallel_ranks(ray_cluster, reference):
    import ray

    llm = LLM("demo:target", draft="demo:draft", ray=True, draft_backend="vllm", draft_tensor_parallel_size=2,
              draft_backend_options=VLLM_OPTIONS, num_speculative_tokens=4, adaptive=False, target_num_cpus=0.5,
              draft_num_cpus=0.5, draft_min_timeout_s=5.0)  # two ranks on two shared cores answer slowly
    try:
        assert {n["NodeID"]: n["Labels"] for n in ray.nodes()}[llm._engine.draft_info[0]["node_id"]][ROLE] == "draft"
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == reference
        m = llm.metrics()
        assert m["drafts"]["drafts"]["draft-0"]["backend"] == "vllm"
        assert m["num_draft_tokens"] > 0 and m["acceptance_rate"] > 0.3  # the demo pair's drafts are good
    finally:
        llm.shutdown()


def test_target_with_two_tensor_parallel_ranks(ray_cluster):
    reference = vllm_greedy(resolve_model("demo:target"), PROMPTS, GREEDY.max_tokens)
    llm = LLM("demo:target", draft="demo:draft", ray=True, target_backend="vllm", target_tensor_parallel_size=2,
              target_backend_options=VLLM_OPTIONS, num_speculative_tokens=4, target_num_cpus=0.5, draft_num_cpus=0.5,
              draft_min_timeout_s=5.0, adaptive=False)  # fixed k: the counts asserted below follow from the outputs
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == reference
        m = llm.metrics()  # the proposer lives in vLLM's worker: these are vLLM's own counters
        assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]
    finally:
        llm.shutdown()
