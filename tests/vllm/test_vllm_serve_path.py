"""The ``vllm serve`` path: a plain vLLM engine configured with ``specserve.vllm.RemoteDraftProposer``.

The draft is a specserve ``DraftWorker`` on the node labelled ``specserve.io/role=draft``;
the vLLM engine (an actor on the ``target`` node, configured exactly as ``vllm serve
--speculative-config`` would configure it) finds it through ``SPECSERVE_DRAFT_ADDRESS``.
Greedy output equals vLLM's target-only output; killing the draft mid-run fails no request
(the rest is decoded target-only, still exact); a draft restarted at the same address is
found again.
"""

from __future__ import annotations


import pytest

from specserve.config import SpecserveConfig

from ..conftest import free_port, wait_until
from .conftest import ROLE, random_prompts, start_runner, vllm_greedy

PROMPTS = random_prompts(8, seed=1)
GREEDY = {"temperature": 0.0, "max_tokens": 160, "ignore_eos": True}
SPEC = {"method": "custom_class", "model": "specserve.vllm.RemoteDraftProposer", "num_speculative_tokens": 4}
# The proposer's options (additional_config, as `vllm serve --additional-config` sets them): a
# draft-reply timeout floor, because on shared CPU cores a slow draft must not count as a failed
# one (the failure counts below would move with the load; the killed draft's closed socket is
# noticed at once), and fixed k, so that the proposal and block counts follow from the outputs.
ADDITIONAL = {"specserve": {"min_timeout_s": 10.0, "max_timeout_s": 60.0, "adaptive": False}}


@pytest.fixture(scope="module")
def config():
    return SpecserveConfig.load(None, target="demo:target", draft="demo:draft", draft_port=free_port())


def start_draft(config):
    import ray

    from specserve.distributed.workers import DraftWorker

    actor = ray.remote(DraftWorker).options(num_cpus=0.5, label_selector={ROLE: "draft"}, max_restarts=0)
    actor = actor.remote(config.model_dump(), None, "draft-for-vllm")
    return actor, ray.get(actor.ready.remote())


@pytest.fixture(scope="module")
def reference(ray_cluster, config):
    return vllm_greedy(config.target.model, PROMPTS, GREEDY["max_tokens"])


@pytest.fixture(scope="module")
def served(ray_cluster, config, reference):
    import ray

    draft, info = start_draft(config)
    assert {n["NodeID"]: n["Labels"] for n in ray.nodes()}[info["node_id"]][ROLE] == "draft"
    runner = start_runner(env={"SPECSERVE_DRAFT_ADDRESS": info["address"]}, model=config.target.model,
                          speculative_config=SPEC, additional_config=ADDITIONAL, disable_log_stats=False)
    wait_until(lambda: (ray.get(runner.proposer.remote()) or {}).get("num_drafts_up", 0), 300, 0.2, "the proposer connected")
    yield {"runner": runner, "draft": draft}
    ray.kill(runner)


def test_greedy_equals_target_only(served, reference):
    import ray

    runner = served["runner"]
    assert ray.get(runner.generate.remote(PROMPTS, GREEDY)) == reference
    spec = ray.get(runner.spec_metrics.remote())
    assert 0 < spec["vllm:spec_decode_num_accepted_tokens"] < spec["vllm:spec_decode_num_draft_tokens"]
    status = ray.get(runner.proposer.remote())
    assert status["num_drafts_up"] == 1 and status["num_draft_failures"] == 0


def test_killing_the_draft_mid_run_fails_no_request(served, config, reference):
    import ray

    runner = served["runner"]
    before = ray.get(runner.proposer.remote())["num_proposals"]
    pending = runner.generate.remote(PROMPTS, GREEDY)
    wait_until(lambda: ray.get(runner.proposer.remote())["num_proposals"] >= before + 15, 300, 0.02,
               "drafts flowing")  # mid-run: 160 tokens at most 5 a step leave 15+ steps to go
    ray.kill(served["draft"])
    assert ray.get(pending, timeout=600) == reference  # every request finished, target-only after the kill
    # Dropped once: by the step that met the closed socket, or (had the run ended first) by the idle heartbeat.
    status = wait_until(lambda: (s := ray.get(runner.proposer.remote()))["num_draft_failures"] and s, 60, 0.2, "the draft dropped")
    assert status["num_draft_failures"] == 1 and status["num_drafts_up"] == 0

    served["draft"], _ = start_draft(config)  # the same address again: the proposer reconnects by itself
    wait_until(lambda: ray.get(runner.proposer.remote())["num_drafts_up"], 120, 0.2, "the proposer reconnected")
    blocks = ray.get(runner.proposer.remote())["num_blocks"]
    assert ray.get(runner.generate.remote(PROMPTS, GREEDY)) == reference
    status = ray.get(runner.proposer.remote())
    assert status["num_draft_connects"] == 2 and status["num_blocks"] > blocks


def test_an_eagle_head_behind_vllm_serve(ray_cluster, reference):
    """`specserve draft --draft demo:eagle` and `vllm serve` with SPECSERVE_HEAD naming the head: the proposer sets up
    the head's layers before vLLM loads the target and sends their rows; output equals target-only, the head accepts."""
    import ray

    cfg = SpecserveConfig.load(None, target="demo:target", draft="demo:eagle", draft_port=free_port())
    draft, info = start_draft(cfg)
    runner = start_runner(env={"SPECSERVE_DRAFT_ADDRESS": info["address"], "SPECSERVE_HEAD": "demo:eagle"},
                          model=cfg.target.model, speculative_config=SPEC, additional_config=ADDITIONAL, disable_log_stats=False)
    try:
        wait_until(lambda: (ray.get(runner.proposer.remote()) or {}).get("num_drafts_up", 0), 300, 0.2, "the proposer connected")
        assert ray.get(runner.generate.remote(PROMPTS, GREEDY)) == reference
        status = ray.get(runner.proposer.remote())
        spec = ray.get(runner.spec_metrics.remote())
    finally:
        ray.kill(runner)
        ray.kill(draft)
    assert status["hidden_bytes"] > 0 and status["num_draft_failures"] == 0
    assert spec["vllm:spec_decode_num_accepted_tokens"] > 0.3 * spec["vllm:spec_decode_num_draft_tokens"]  # a trained head
