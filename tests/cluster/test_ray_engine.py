"""Draft and target as Ray actors on separate labelled nodes: placement, losslessness, failure."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve import LLM, EngineConfig, SamplingParams, SideConfig
from specserve.distributed import Placement, PlacementError
from specserve.reference import reference_generate

from .conftest import node_labels

PROMPTS = [list(range(3 + i % 7, 3 + i % 7 + 1 + (5 * i) % 23)) for i in range(18)]  # 18 prompts, 1..23 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def engine_config(tiny_pair, draft="perturbed", k=4, **kw):
    return EngineConfig(
        target=SideConfig(tiny_pair["target"], dtype="float64", num_cpus=0.25),
        draft=SideConfig(tiny_pair.get(draft, draft), dtype="float64", num_cpus=0.25),
        num_speculative_tokens=k, **kw,
    )


@pytest.fixture(scope="module")
def reference(tiny_pair):
    target = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], dtype=torch.float64).eval()
    return [reference_generate(target, p, GREEDY) for p in PROMPTS]


@pytest.fixture(scope="module", params=["ray", "collective"])
def llm(request, ray_cluster, tiny_pair):
    llm = LLM.from_config(engine_config(tiny_pair), Placement(channel=request.param, draft_timeout_s=5))
    yield llm
    llm.shutdown()


def test_sides_run_on_their_labelled_nodes(llm):
    engine = llm._engine
    assert node_labels(engine.target_info["node_id"])["specserve.io/role"] == "target"
    assert node_labels(engine.draft_info["node_id"])["specserve.io/role"] == "draft"
    assert engine.target_info["node_id"] != engine.draft_info["node_id"]


def test_greedy_equals_reference_for_concurrent_requests(llm, reference):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    m = llm.metrics()
    assert m["num_draft_tokens"] > 0 and 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]
    assert m["num_running"] == 0


def test_streams_join_running_batch(llm, reference):
    async def one(i, delay):
        await asyncio.sleep(delay)
        toks = []
        async for d in llm.stream(PROMPTS[i], GREEDY):
            toks += d.token_ids
        return toks

    async def main():
        return await asyncio.gather(*[one(i, 0.05 * i) for i in range(len(PROMPTS))])

    assert asyncio.run(main()) == reference


def test_sampling_keeps_target_distribution(llm, tiny_pair):
    # Small check (the unit suite has the thorough one): first-token frequencies vs exact p.
    from scipy.stats import chisquare

    from specserve.sampling import processed_probs

    prompt, n = [5, 6, 7], 400
    params = [SamplingParams(temperature=1.0, max_tokens=1, seed=s, ignore_eos=True) for s in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], dtype=torch.float64).eval()
    with torch.no_grad():
        p = processed_probs(model(torch.tensor([prompt])).logits[0, -1:], 1.0, 0, 1.0)[0]
    counts = torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=p.numel()).double()
    keep = p * n > 5
    obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    exp = torch.cat([p[keep], p[~keep].sum(0, keepdim=True)]) * n
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-4


def test_sampled_probs_cross_the_collective_channel(llm):
    params = SamplingParams(temperature=0.8, max_tokens=8, seed=3, ignore_eos=True)
    llm.generate(PROMPTS[:4], params, use_tqdm=False)
    m = llm.metrics()
    if m["channel"] == "collective":
        assert m["channel_tensor_bytes"] > 0
    else:
        assert m["channel_tensor_bytes"] == 0


def test_cancelled_stream_frees_both_sides(llm):
    import ray

    async def main():
        agen = llm.stream(PROMPTS[2], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        await agen.__anext__()
        await agen.aclose()

    asyncio.run(main())
    engine = llm._engine
    deadline = time.time() + 10
    while time.time() < deadline:
        if ray.get(engine.target.num_seqs.remote()) == 0 and ray.get(engine.draft.num_seqs.remote()) == 0:
            break
        time.sleep(0.1)
    assert ray.get(engine.target.num_seqs.remote()) == 0
    # The draft frees its copy on the next message or when the target goes idle.
    assert ray.get(engine.draft.num_seqs.remote()) == 0


def test_bad_bytes_do_not_kill_the_draft(llm, reference):
    import ray

    from specserve.messages import ProtocolError

    with pytest.raises(ProtocolError, match="malformed message bytes"):
        ray.get(llm._engine.draft.handle.remote(b"\xc1\x00garbage"))
    assert ray.get(llm._engine.draft.ping.remote())
    assert [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)] == reference[:3]


def test_bad_request_is_a_value_error_and_loses_nothing(llm, reference):
    with pytest.raises(ValueError, match="request 1: prompt has 300 tokens"):
        llm.generate([PROMPTS[0], [1] * 300], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)] == reference[:2]


def test_many_prompts_in_input_order(llm):
    prompts = [[i % 50 + 4, (i * 7) % 50 + 4] for i in range(600)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=True)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(len(o.token_ids) == 2 for o in outs)


def test_draft_death_falls_back_then_resumes(ray_cluster, tiny_pair, reference):
    import ray

    llm = LLM.from_config(engine_config(tiny_pair, draft="same", k=1),
                          Placement(channel_delay_ms=40, draft_timeout_s=5, draft_probe_interval_s=0.2))
    try:
        engine = llm._engine
        long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        refs = [engine.target.generate.remote(f"kill-{i}", p, long.to_dict()) for i, p in enumerate(PROMPTS)]
        while llm.metrics()["num_drafts"] < 2 * len(PROMPTS):  # mid-generation: every request has drafted
            time.sleep(0.05)
        ray.kill(engine.draft, no_restart=False)  # Ray restarts it (max_restarts=-1)
        outs = ray.get(refs, timeout=120)
        assert [o["token_ids"] for o in outs] == reference
        m = llm.metrics()
        assert m["num_draft_failures"] == 1 and m["num_fallback_steps"] > 0
        # The draft comes back (restart + model load); speculation resumes for new requests.
        deadline = time.time() + 60
        while time.time() < deadline and not llm.metrics()["draft_up"]:
            llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
            time.sleep(0.3)
        out = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
        assert [o.token_ids for o in out] == reference[:4]
        assert llm.metrics()["num_draft_recoveries"] >= 1
        assert all(o.metrics.num_accepted_tokens > 0 for o in out)
    finally:
        llm.shutdown()


def test_infeasible_placement_fails_fast_naming_the_label(ray_cluster, tiny_pair):
    cfg = EngineConfig(
        target=SideConfig(tiny_pair["target"], num_cpus=0.25),
        draft=SideConfig(tiny_pair["same"], num_cpus=0.25, label_selector={"ray.io/accelerator-type": "GeForce-RTX-5090"}),
    )
    start = time.time()
    with pytest.raises(PlacementError, match="no node has the label ray.io/accelerator-type=GeForce-RTX-5090") as info:
        LLM.from_config(cfg, Placement())
    assert time.time() - start < 10
    assert "specserve.io/role" in str(info.value)  # lists what the nodes do offer


def test_custom_resource_fallback(ray_cluster, tiny_pair, reference):
    cfg = EngineConfig(
        target=SideConfig(tiny_pair["target"], dtype="float64", num_cpus=0.25),
        draft=SideConfig(tiny_pair["perturbed"], dtype="float64", num_cpus=0.25, resources={"specserve_draft": 0.5}),
        num_speculative_tokens=2,
    )
    llm = LLM.from_config(cfg, Placement(use_role_labels=False))
    try:
        assert node_labels(llm._engine.draft_info["node_id"])["specserve.io/role"] == "draft"
        assert [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)] == reference[:3]
    finally:
        llm.shutdown()
    with pytest.raises(PlacementError, match="offers specserve_draft=5"):
        LLM.from_config(EngineConfig(target=cfg.target, draft=SideConfig(tiny_pair["same"], num_cpus=0.25, resources={"specserve_draft": 5})),
                        Placement(use_role_labels=False))
