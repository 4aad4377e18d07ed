"""The ``vllm serve`` path: a plain vLLM engine configured with ``specserve.vllm.RemoteDraftProposer``.

The draft is a specserve ``DraftWorker`` on the node labelled ``specserve.io/role=draft``;
the vLLM engine (an actor on the ``target`` node, configured exactly as ``vllm serve
--speculative-config`` would configure it) finds it through ``SPECSERVE_DRAFT_ADDRESS``.
Greedy output equals vLLM's target-only output; killing the draft mid-run fails no request
(the rest is decoded target-only, still exact); a draft restarted at the same address is
found again.
"""

from __future__ import annotations

import socket
import time

import pytest

from specserve.config import SpecserveConfig

from .conftest import ROLE, random_prompts, start_runner, vllm_greedy

PROMPTS = random_prompts(8, seed=1)
GREEDY = {"temperature": 0.0, "max_tokens": 160, "ignore_eos": True}
SPEC = {"method": "custom_class", "model": "specserve.vllm.RemoteDraftProposer", "num_speculative_tokens": 4}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
                          speculative_config=SPEC, disable_log_stats=False)
    deadline = time.time() + 60
    while (ray.get(runner.proposer.remote()) or {}).get("num_drafts_up", 0) == 0 and time.time() < deadline:
        time.sleep(0.2)
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
    while ray.get(runner.proposer.remote())["num_proposals"] < before + 15:  # mid-run: drafts flowing
        time.sleep(0.02)
    ray.kill(served["draft"])
    assert ray.get(pending, timeout=300) == reference  # every request finished, target-only after the kill
    status = ray.get(runner.proposer.remote())
    assert status["num_draft_failures"] == 1 and status["num_drafts_up"] == 0

    served["draft"], _ = start_draft(config)  # the same address again: the proposer reconnects by itself
    deadline = time.time() + 30
    while ray.get(runner.proposer.remote())["num_drafts_up"] == 0 and time.time() < deadline:
        time.sleep(0.2)
    blocks = ray.get(runner.proposer.remote())["num_blocks"]
    assert ray.get(runner.generate.remote(PROMPTS, GREEDY)) == reference
    status = ray.get(runner.proposer.remote())
    assert status["num_draft_connects"] == 2 and status["num_blocks"] > blocks
