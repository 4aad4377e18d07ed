"""Draft and target as Ray actors on separate labelled nodes (the batch API): placement, losslessness, failure."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.distributed import PlacementError
from specserve.reference import reference_generate

from ..conftest import assert_admitted_as_slots_freed, make_model, wait_until
from .conftest import node_labels

PROMPTS = [list(range(3 + i % 7, 3 + i % 7 + 1 + (5 * i) % 23)) for i in range(18)]  # 18 prompts, 1..23 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def ray_llm(tiny_pair, draft="perturbed", k=4, **kw):
    # draft_min_timeout_s: on a loaded machine a slow draft reply must not count as a dead draft
    # (that would move the failure, connect and fallback counts below); a killed draft's socket
    # closes, which is noticed at once whatever the timeout.
    kw = {"draft_min_timeout_s": 10.0, "draft_timeout_s": 60.0, **kw}
    return LLM(tiny_pair["target"], draft=tiny_pair.get(draft, draft), num_speculative_tokens=k, dtype="float64",
               target_num_cpus=0.25, draft_num_cpus=0.25, ray=True, **kw)


LONG = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_pair):
    target = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], dtype=torch.float64).eval()
    return [reference_generate(target, p, GREEDY) for p in PROMPTS]


@pytest.fixture(scope="module")
def long_reference(tiny_pair):
    target = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], dtype=torch.float64).eval()
    return [reference_generate(target, p, LONG) for p in PROMPTS]


@pytest.fixture(scope="module")
def llm(ray_cluster, tiny_pair):
    # Fixed k: the speculation counts asserted below are then a function of the greedy outputs (with
    # adaptive k they follow measured timings; exactness under adaptive k is tested in tests/unit).
    llm = ray_llm(tiny_pair, draft_num_replicas=2, adaptive=False)
    yield llm
    llm.shutdown()


def test_sides_run_on_their_labelled_nodes(llm):
    engine = llm._engine
    assert node_labels(engine.target_info["node_id"])["specserve.io/role"] == "target"
    for info in engine.draft_info:
        assert node_labels(info["node_id"])["specserve.io/role"] == "draft"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="lowering a niceness needs CAP_SYS_NICE (root here)")
def test_model_actors_run_at_normal_priority(llm):
    """Ray starts workers at niceness 15, below its own daemons; the sides bring themselves to 0 (and
    every thread, the engine's included, starts from there)."""
    engine = llm._engine
    assert engine.target_info["niceness"] == 0
    assert [info["niceness"] for info in engine.draft_info] == [0, 0]


def test_greedy_equals_reference_for_concurrent_requests(llm, reference):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    m = llm.metrics()
    assert m["num_draft_tokens"] > 0 and 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]
    assert m["num_running"] == 0
    assert sum(o.metrics.num_draft_tokens for o in outs) == m["num_draft_tokens"]  # the engine's totals are the requests'
    # The LLM is ready once one draft is connected; the second may connect a moment later.
    drafts = wait_until(lambda: (d := llm.metrics()["drafts"])["num_drafts_up"] == 2 and d, 60, 0.2, "both drafts connected")
    assert drafts["num_draft_connects"] == 2  # and none was dropped and reconnected


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


def test_seeded_sampling_matches_the_in_process_engine(llm, tiny_pair):
    params = [SamplingParams(temperature=0.9, top_k=20, max_tokens=12, seed=s, ignore_eos=True) for s in range(8)]
    remote = [o.token_ids for o in llm.generate(PROMPTS[:8], params, use_tqdm=False)]
    with LLM(tiny_pair["target"], draft=tiny_pair["perturbed"], num_speculative_tokens=4, dtype="float64") as local:
        assert remote == [o.token_ids for o in local.generate(PROMPTS[:8], params, use_tqdm=False)]


def test_cancelled_stream_frees_both_sides(llm):
    import ray

    async def main():
        agen = llm.stream(PROMPTS[2], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        await agen.__anext__()
        await agen.aclose()

    asyncio.run(main())
    engine = llm._engine
    deadline = time.time() + 60  # closes reach the draft when the target idles (checked 4 times a second)
    while time.time() < deadline:
        draft_seqs = sum(ray.get([d.num_seqs.remote() for d in engine.drafts]))
        if ray.get(engine.target.num_seqs.remote()) == 0 and draft_seqs == 0:
            break
        time.sleep(0.1)
    assert ray.get(engine.target.num_seqs.remote()) == 0
    assert sum(ray.get([d.num_seqs.remote() for d in engine.drafts])) == 0  # closes reach the draft when the target idles


def test_bad_request_is_a_value_error_and_loses_nothing(llm, reference):
    with pytest.raises(ValueError, match="request 1: prompt has 300 tokens"):
        llm.generate([PROMPTS[0], [1] * 300], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)] == reference[:2]


def test_outputs_finished_together_come_in_one_message(llm, reference):
    """The target sends the outputs finished since its last message together (one Ray object per
    request would cost its cores per request): 16 one-token requests, admitted together and so
    finished by the same step, take fewer messages than requests, and each comes exactly once."""
    import ray

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True).to_dict()
    requests = [[f"together-{i}", PROMPTS[i], params] for i in range(16)]
    stream = llm._engine.target.generate_many.options(num_returns="streaming").remote(requests, 16)
    messages = [ray.get(ref) for ref in stream]
    outputs = {d["request_id"]: d["token_ids"] for message in messages for d in message}
    assert sorted(outputs) == sorted(r[0] for r in requests)
    assert sum(len(m) for m in messages) == 16
    assert len(messages) < 16
    assert [outputs[f"together-{i}"] for i in range(16)] == [r[:1] for r in reference[:16]]


def test_many_prompts_in_input_order(llm):
    prompts = [[i % 50 + 4, (i * 7) % 50 + 4] for i in range(600)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=True)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(len(o.token_ids) == 2 for o in outs)


def test_draft_death_falls_back_then_resumes(ray_cluster, tiny_pair, reference, long_reference):
    import ray

    # Long requests over a slow link (k=2, a perfect draft: 3 tokens per step of at least 2 x 50 ms)
    # run for seconds after the kill: the kill lands mid-generation whatever the machine's speed.
    llm = ray_llm(tiny_pair, draft="same", k=2, channel_delay_ms=50, adaptive=False)
    try:
        engine = llm._engine
        refs = [engine.target.generate.remote(f"kill-{i}", p, LONG.to_dict()) for i, p in enumerate(PROMPTS)]
        wait_until(lambda: llm.metrics()["num_drafts"] >= 2 * len(PROMPTS), 120, 0.05,
                   "every request drafted twice")  # mid-generation: every request has drafted
        ray.kill(engine.drafts[0], no_restart=False)  # Ray restarts it (max_restarts=-1), on a new port
        outs = ray.get(refs, timeout=300)
        assert [o["token_ids"] for o in outs] == long_reference
        m = llm.metrics()
        assert m["drafts"]["num_draft_failures"] == 1 and m["num_fallback_steps"] > 0
        # the draft comes back (restart + model load) and speculation resumes
        wait_until(lambda: llm.metrics()["drafts"]["num_drafts_up"], 120, 0.3, "the restarted draft reconnected")
        out = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
        assert [o.token_ids for o in out] == reference[:4]
        assert llm.metrics()["drafts"]["num_draft_connects"] >= 2
        assert all(o.metrics.num_accepted_tokens > 0 for o in out)
    finally:
        llm.shutdown()


def test_infeasible_placement_fails_fast_naming_the_label(ray_cluster, tiny_pair):
    start = time.time()
    with pytest.raises(PlacementError, match="no node has the label ray.io/accelerator-type=GeForce-RTX-5090") as info:
        LLM(tiny_pair["target"], draft=tiny_pair["same"], target_num_cpus=0.25, draft_num_cpus=0.25, ray=True,
            draft_label_selector={"ray.io/accelerator-type": "GeForce-RTX-5090"}, placement_timeout_s=300)
    # "Fast": it fails from what the nodes offer, without waiting for the placement timeout (set to
    # 300 s here so that the bound can be generous for a loaded machine and still tell the two apart).
    assert time.time() - start < 60
    assert "specserve.io/role" in str(info.value)  # lists what the nodes do offer
    assert "cannot be given to `ray start`" in str(info.value)  # no hint Ray would reject


def test_custom_resource_fallback(ray_cluster, tiny_pair, reference):
    llm = ray_llm(tiny_pair, k=2, use_role_labels=False, draft_resources={"specserve_draft": 0.5})
    try:
        assert node_labels(llm._engine.draft_info[0]["node_id"])["specserve.io/role"] == "draft"
        assert [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)] == reference[:3]
    finally:
        llm.shutdown()
    with pytest.raises(PlacementError, match="offers specserve_draft=5"):
        ray_llm(tiny_pair, use_role_labels=False, draft_resources={"specserve_draft": 5})


def test_probabilities_over_a_gloo_collective_link(ray_cluster, tiny_pair):
    """channel_tensors='collective': draft probabilities travel as one packed tensor per reply over
    ray.util.collective (gloo here, NCCL between GPUs); seeded sampled output is unchanged."""
    params = [SamplingParams(temperature=0.9, max_tokens=10, seed=s, ignore_eos=True) for s in range(6)]
    llm = ray_llm(tiny_pair, k=3, adaptive=False, channel_tensors="collective", collective_backend="gloo")
    try:
        remote = [o.token_ids for o in llm.generate(PROMPTS[:6], params, use_tqdm=False)]
        assert llm.metrics()["drafts"]["tensor_bytes"] > 0
    finally:
        llm.shutdown()
    with LLM(tiny_pair["target"], draft=tiny_pair["perturbed"], num_speculative_tokens=3, dtype="float64", adaptive=False) as local:
        assert remote == [o.token_ids for o in local.generate(PROMPTS[:6], params, use_tqdm=False)]


@pytest.fixture(scope="module")
def eagle_pair(tmp_path_factory):
    """A 4-layer target, a random EAGLE-3 head for it, and the target's own greedy outputs."""
    from ..heads import make_eagle3_head

    root = tmp_path_factory.mktemp("remote_head")
    target = make_model(root / "target", seed=0, tokenizer=True, hidden=64, layers=4).double().eval()
    head = make_eagle3_head(root / "head", str(root / "target"), layer_ids=[1, 2, 3])
    return {"target": str(root / "target"), "head": head,
            "reference": [reference_generate(target, p, GREEDY) for p in PROMPTS],
            "long_reference": [reference_generate(target, p, LONG) for p in PROMPTS]}


def head_llm(eagle_pair, **kw):
    kw = {"draft_min_timeout_s": 10.0, "draft_timeout_s": 60.0, "num_speculative_tokens": 3, "adaptive": False, **kw}
    return LLM(eagle_pair["target"], draft=eagle_pair["head"], dtype="float64", ray=True, target_num_cpus=0.25,
               draft_num_cpus=0.25, **kw)


@pytest.mark.parametrize("tensors,fc", [("inline", "draft"), ("collective", "draft"), ("inline", "target")])
def test_a_remote_eagle_head_reads_the_targets_rows_over_the_channel(ray_cluster, eagle_pair, tensors, fc):
    """An EAGLE-3 head in its own actor: the target's rows travel per request (inline in the frames,
    or as one packed tensor over the gloo link) in the target's dtype; greedy output is the target's.
    With the head's fc on the target (``head_fc``), one row per position travels instead of three."""
    llm = head_llm(eagle_pair, channel_tensors=tensors, collective_backend="gloo", head_fc=fc)
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        drafts = llm.metrics()["drafts"]
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == eagle_pair["reference"]
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0 and drafts["num_draft_failures"] == 0
    # Each committed position (but a sequence's last) goes at most once: 3 layers x 64 wide (or, through
    # the fc on the target, 64 wide), float64.
    committed = sum(len(p) + len(o.token_ids) - 1 for p, o in zip(PROMPTS, outs))
    width = 64 if fc == "target" else 3 * 64
    assert 0 < drafts["hidden_bytes"] <= committed * width * 8
    assert drafts["hidden_bytes"] % (width * 8) == 0


def test_a_killed_head_costs_speed_never_a_request(ray_cluster, eagle_pair):
    """The head's actor dies mid-generation: every request finishes exact (target-only meanwhile), and
    the restarted head is re-attached: the sequences re-open without their past rows and it drafts again."""
    import ray

    llm = head_llm(eagle_pair, num_speculative_tokens=2, channel_delay_ms=50)
    try:
        engine = llm._engine
        refs = [engine.target.generate.remote(f"kill-{i}", p, LONG.to_dict()) for i, p in enumerate(PROMPTS)]
        wait_until(lambda: llm.metrics()["num_drafts"] >= 2 * len(PROMPTS), 120, 0.05, "every request drafted twice")
        ray.kill(engine.drafts[0], no_restart=False)
        outs = ray.get(refs, timeout=300)
        assert [o["token_ids"] for o in outs] == eagle_pair["long_reference"]
        assert llm.metrics()["drafts"]["num_draft_failures"] == 1
        wait_until(lambda: llm.metrics()["drafts"]["num_drafts_up"], 120, 0.3, "the restarted head reconnected")
        out = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
        assert [o.token_ids for o in out] == eagle_pair["reference"][:4]
        assert all(o.metrics.num_draft_tokens > 0 for o in out)
    finally:
        llm.shutdown()


def test_a_window_of_requests_is_kept_full_by_the_target(llm, reference):
    """``max_in_flight`` over Ray: one streaming call, the target replaces each finished request before its
    next step; outputs in input order, exact, and nothing left running."""
    import ray

    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, max_in_flight=3)
    assert [o.token_ids for o in outs] == reference
    assert [o.prompt_token_ids for o in outs] == [list(p) for p in PROMPTS]
    assert_admitted_as_slots_freed(outs, 3)
    assert ray.get(llm._engine.target.num_seqs.remote()) == 0


def test_shutting_ray_down_first_leaves_a_quiet_exit(ray_cluster, tiny_pair):
    """A script that calls ``ray.shutdown()`` before it exits: the LLM's exit hook finds Ray gone and has
    nothing to free (its actors went with the driver); it neither logs a failure nor starts a new Ray."""
    import subprocess
    import sys

    script = (
        "import ray\n"
        "from specserve import LLM, SamplingParams\n"
        f"ray.init(address={ray_cluster.address!r}, log_to_driver=False)\n"
        f"llm = LLM({tiny_pair['target']!r}, draft={tiny_pair['perturbed']!r}, dtype='float64', ray=True,\n"
        "          target_num_cpus=0.25, draft_num_cpus=0.25)\n"
        "out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)\n"
        "assert len(out[0].token_ids) == 4\n"
        "ray.shutdown()\n"
        "print('DONE', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DONE" in proc.stdout
    assert "shutting down the engine failed" not in proc.stderr, proc.stderr[-3000:]
    assert "Started a local Ray instance" not in proc.stderr  # (ray.kill at exit would have started one)
