"""A broken draft costs speed, never a request: fault injection in the spirit of vLLM's failing-forward test.

Each fault corrupts every draft reply (or the socket) while concurrent greedy and sampled
requests run: no request fails, greedy output equals the target-only reference token for
token, every sampled request finishes, and the repairs are counted. Under the drafts whose
probability rows are broken, sampled output still follows the target's distribution
(chi-square). Reply faults are injected in-process (the target checks replies the same
way whatever carried them); the socket fault runs over TCP.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.messages import DraftBlock
from specserve.reference import reference_generate

from .test_sampling_lossless import NUM_SAMPLES, PROMPT, chi2_pvalue, exact_distributions, small_vocab_pair  # noqa: F401

PROMPTS = [list(range(3 + i % 7, 3 + i % 7 + 1 + (5 * i) % 23)) for i in range(8)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SAMPLED = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=s) for s in range(len(PROMPTS))]


def _blocks(reply, fn):
    return dataclasses.replace(reply, blocks=[fn(b) for b in reply.blocks])


def _probs(fn):
    return lambda b: dataclasses.replace(b, draft_probs=fn(np.array(b.draft_probs))) if b.draft_probs is not None else b


FAULTS = {
    "ids out of range": lambda req, r: _blocks(r, lambda b: dataclasses.replace(
        b, draft_token_ids=[b.draft_token_ids[0], 10**9, -5][: len(b.draft_token_ids)] if b.draft_token_ids else [])),
    "longer than asked": lambda req, r: _blocks(r, lambda b: dataclasses.replace(b, draft_token_ids=b.draft_token_ids * 3)),
    "stale base_len": lambda req, r: _blocks(r, lambda b: dataclasses.replace(b, base_len=b.base_len - 1)),
    "sequences never asked about": lambda req, r: dataclasses.replace(
        r, blocks=list(r.blocks) + [DraftBlock("ghost", 3, [1, 2]), *(r.blocks[:1] if r.blocks else [])]),
    "NaN probabilities": lambda req, r: _blocks(r, _probs(lambda q: q * np.float32("nan"))),
    "negative probabilities": lambda req, r: _blocks(r, _probs(lambda q: q - 0.5)),
    "unnormalised probabilities": lambda req, r: _blocks(r, _probs(lambda q: q * 3)),
}


def faulty(llm: LLM, fault) -> None:
    """Every reply the in-process draft sends goes through ``fault(request, reply)`` first."""
    service = llm._engine.draft_service
    handle = service.handle
    service.handle = lambda conn, req: fault(req, handle(conn, req))


def run_mixed(llm: LLM) -> tuple[list, list]:
    """Greedy and sampled requests at once, through one engine (each batch mixes both)."""
    results: dict[str, list] = {}

    def sampled():
        results["sampled"] = llm.generate(PROMPTS, SAMPLED, use_tqdm=False)

    t = threading.Thread(target=sampled)
    t.start()
    greedy = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    t.join()
    return greedy, results["sampled"]


@pytest.fixture(scope="module")
def reference(tiny_pair):
    target = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], dtype=torch.float64).eval()
    return [reference_generate(target, p, GREEDY) for p in PROMPTS]


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_a_broken_draft_fails_no_request(tiny_pair, reference, name):
    with LLM(tiny_pair["target"], draft=tiny_pair["same"], num_speculative_tokens=3, dtype="float64", adaptive=False,
             draft_min_timeout_s=30.0) as llm:
        faulty(llm, FAULTS[name])
        greedy, sampled = run_mixed(llm)  # a failed request would raise here
        m = llm.metrics()
    assert [o.token_ids for o in greedy] == reference
    assert all(len(o.token_ids) == 24 for o in sampled)
    assert m["num_requests_failed"] == 0 and m["drafts"]["draft_replies_rejected"] > 0


@pytest.mark.parametrize("name", ["NaN probabilities", "negative probabilities", "unnormalised probabilities"])
def test_broken_probabilities_do_not_bend_the_sampled_distribution(small_vocab_pair, name):  # noqa: F811
    target, draft = small_vocab_pair
    with LLM(target, draft=draft, num_speculative_tokens=3, dtype="float64", adaptive=False, draft_probs=True) as llm:
        faulty(llm, FAULTS[name])
        params = [SamplingParams(temperature=1.0, max_tokens=3, seed=s, ignore_eos=True) for s in range(NUM_SAMPLES)]
        outs = llm.generate([PROMPT] * NUM_SAMPLES, params, use_tqdm=False)
        m = llm.metrics()
    assert m["drafts"]["draft_replies_rejected"] > 0 and m["num_accepted_tokens"] > 0  # repaired blocks were verified
    p1, p2, p3 = exact_distributions(target, 1.0, 0, 1.0)
    assert chi2_pvalue([o.token_ids[0] for o in outs], p1) > 1e-4
    assert chi2_pvalue([o.token_ids[1] for o in outs], p2) > 1e-4
    assert chi2_pvalue([o.token_ids[2] for o in outs], p3) > 1e-4


def test_a_draft_that_closes_the_socket_mid_frame(tiny_pair, reference):
    """Over TCP: the draft sends half a reply and hangs up; the target decodes on, target-only, exact."""
    from specserve import transport
    from specserve.build import build_draft_service
    from specserve.config import SpecserveConfig
    from specserve.engine import EngineLoop

    from .test_engine import make_core

    cfg = SpecserveConfig.load(target=tiny_pair["target"], draft=tiny_pair["same"], dtype="float64")
    server = transport.DraftServer(build_draft_service(cfg, "cut"), host="127.0.0.1", advertise_host="127.0.0.1")
    sent, send = [0], server._send

    def cut(sock, data, kind=transport.MESSAGE, timeout_s=10.0):
        sent[0] += 1
        if sent[0] == 6:  # the challenge, the hello, then a few replies: now half a frame, and hang up
            sock.settimeout(timeout_s)
            sock.sendall(transport._HEADER.pack(len(data), kind) + data[: len(data) // 2])
            sock.close()
            return False
        return send(sock, data, kind, timeout_s)

    server._send = cut
    core, _ = make_core(tiny_pair, {"cut": server.address})
    loop = EngineLoop(core)
    try:
        core.pool.wait_for_drafts(60)
        done, outs, errors, finished = threading.Event(), {}, [], set()

        def sink_for(i):
            def sink(item):
                if isinstance(item, Exception):
                    errors.append(item)
                else:
                    outs.setdefault(i, []).extend(item.token_ids)
                if isinstance(item, Exception) or item.finished:
                    finished.add(i)
                    if len(finished) == len(PROMPTS):
                        done.set()
            return sink

        loop.submit_many([(f"r{i}", p, GREEDY, sink_for(i)) for i, p in enumerate(PROMPTS)])
        assert done.wait(120)
        assert errors == [] and [outs[i] for i in range(len(PROMPTS))] == reference
        assert core.pool.status()["num_draft_failures"] >= 1
    finally:
        loop.shutdown()
        server.close()
