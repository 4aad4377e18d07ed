"""A vLLM draft with ``tensor_parallel_size=2`` on the draft node, for a transformers target.

The draft's parallelism is its own: two vLLM worker processes (one OpenMP core group each,
``VLLM_CPU_OMP_THREADS_BIND`` set by specserve on a one-NUMA-node machine) inside the draft
actor, while the target runs unsharded. Greedy output equals the target-only reference;
the drafts are the same as the unsharded draft's, so they are accepted as often.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.config import resolve_model
from specserve.reference import reference_generate

from .conftest import ROLE, VLLM_OPTIONS, random_prompts

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
