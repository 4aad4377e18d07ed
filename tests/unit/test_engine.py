"""The one engine loop: concurrent streams, request isolation, and an M:N draft pool over TCP."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from specserve import LLM, SamplingParams
from specserve.adaptive import SpeculationController
from specserve.build import build_draft_service, build_target
from specserve.config import SpecserveConfig
from specserve.engine import EngineCore, EngineLoop, RequestFailed
from specserve.messages import Hello
from specserve.pool import DraftPool
from specserve.target import TargetSide
from specserve.transport import DraftServer, SocketEndpoint

from ..conftest import Sinks, greedy_references, stream_all, wait_until

PROMPTS = [list(range(3 + i % 7, 3 + i % 7 + 1 + (5 * i) % 23)) for i in range(12)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_pair):
    return greedy_references(tiny_pair["target"], PROMPTS, GREEDY)


def test_concurrent_streams_equal_generate(tiny_pair, reference):
    """Two or more LLM.stream() calls at once: each gets exactly its own tokens."""
    with LLM(tiny_pair["target"], draft=tiny_pair["perturbed"], num_speculative_tokens=3, dtype="float64") as llm:
        async def one(i):
            toks = []
            async for d in llm.stream(PROMPTS[i], GREEDY):
                toks += d.token_ids
            return toks

        async def main():
            return await asyncio.gather(*[one(i) for i in range(len(PROMPTS))])

        assert asyncio.run(main()) == reference
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference


def test_one_failing_sequence_fails_alone(tiny_pair, reference, monkeypatch):
    """A sequence that raises while its tokens are committed gets the error; the batch carries on."""
    with LLM(tiny_pair["target"], draft=tiny_pair["perturbed"], num_speculative_tokens=3, dtype="float64") as llm:
        original = TargetSide._commit

        def commit(self, s, *args):
            if s.token_ids[: len(PROMPTS[4])] == PROMPTS[4] and len(s.token_ids) > len(PROMPTS[4]) + 5:
                raise RuntimeError("boom")
            return original(self, s, *args)

        monkeypatch.setattr(TargetSide, "_commit", commit)

        async def one(i):
            toks = []
            try:
                async for d in llm.stream(PROMPTS[i], GREEDY):
                    toks += d.token_ids
            except RequestFailed as exc:
                return exc
            return toks

        async def main():
            return await asyncio.gather(*[one(i) for i in range(len(PROMPTS))])

        results = asyncio.run(main())
        assert isinstance(results[4], RequestFailed) and "boom" in str(results[4])
        assert [r for i, r in enumerate(results) if i != 4] == [r for i, r in enumerate(reference) if i != 4]
        monkeypatch.setattr(TargetSide, "_commit", original)
        assert llm.generate([PROMPTS[4]], GREEDY, use_tqdm=False)[0].token_ids == reference[4]


def test_a_forward_that_raises_is_narrowed_to_its_rows(tiny_pair, reference, monkeypatch):
    """A batched target forward that fails is retried on halves until the failing row is alone."""
    with LLM(tiny_pair["target"], draft=None, dtype="float64") as llm:
        backend = llm._engine.target.backend
        original = type(backend).forward
        poison = PROMPTS[7]

        def forward(self, seq_ids, token_ids, num_logits):
            seqs = llm._engine.target.seqs
            if any(seqs[s].token_ids[: len(poison)] == poison and len(seqs[s].token_ids) > len(poison) + 3
                   for s in seq_ids if s in seqs):
                raise RuntimeError("bad row")
            return original(self, seq_ids, token_ids, num_logits)

        monkeypatch.setattr(type(backend), "forward", forward)
        done, failed = {}, {}

        def sink_for(i):
            def sink(item):
                if isinstance(item, Exception):
                    failed[i] = item
                else:
                    done.setdefault(i, []).extend(item.token_ids)
            return sink

        for i, p in enumerate(PROMPTS):
            llm._engine.loop.submit(f"r{i}", p, GREEDY, sink_for(i))
        wait_until(lambda: len(failed) + sum(len(v) == GREEDY.max_tokens for v in done.values()) == len(PROMPTS), 120, 0.02,
                   "every request finished or failed")
        assert list(failed) == [7]
        assert {i: done[i] for i in done if i != 7} == {i: reference[i] for i in range(len(PROMPTS)) if i != 7}


def make_core(tiny_pair, drafts: dict, k=3) -> EngineCore:
    cfg = SpecserveConfig.load(target=tiny_pair["target"], draft=tiny_pair["perturbed"], dtype="float64",
                               num_speculative_tokens=k, adaptive=False)
    target = build_target(cfg)
    core = EngineCore(target, None, SpeculationController(k, adaptive=False), 64)
    # A generous reply timeout: on a loaded machine a slow (not dead) draft must not be dropped, or
    # the failure and resync counts below would move with the load. A closed draft fails at once.
    core.pool = DraftPool(discover=lambda: dict(drafts), connect=lambda name, address: SocketEndpoint(address),
                          hello=Hello("t0", target.vocab_fingerprint()), reopen=core.reopen, background=True, refresh_s=0.1,
                          min_timeout_s=30.0, max_timeout_s=60.0)
    return core, cfg


def test_two_drafts_over_tcp_share_sequences_and_survive_one_dying(tiny_pair, reference):
    cfg = SpecserveConfig.load(target=tiny_pair["target"], draft=tiny_pair["perturbed"], dtype="float64")
    servers = [DraftServer(build_draft_service(cfg, f"d{i}"), host="127.0.0.1", advertise_host="127.0.0.1") for i in range(2)]
    core, _ = make_core(tiny_pair, {f"d{i}": s.address for i, s in enumerate(servers)})
    # Pause the engine after its third speculative step, so the checks below and the kill happen
    # mid-run whatever the machine's speed (a sleep or a poll could see every request finished).
    paused, resume = threading.Event(), threading.Event()
    step = core.step

    def gated_step():
        result = step()
        if core.counters["num_speculative_steps"] >= 3 and not resume.is_set():
            paused.set()
            resume.wait(120)
        return result

    core.step = gated_step
    loop = EngineLoop(core)
    try:
        wait_until(lambda: len(core.pool.drafts) == 2, 60, 0.05, "both drafts connected")
        sinks = Sinks()
        outs, errors, done = sinks.outs, sinks.errors, sinks.done
        loop.submit_many([(f"r{i}", p, GREEDY, sinks(i)) for i, p in enumerate(PROMPTS)])  # admitted in one step
        assert paused.wait(120), "the engine never made three speculative steps"
        assert not done  # 24 tokens at most 4 per step: nobody has finished after three steps
        assert all(d.seqs for d in core.pool.drafts.values())  # sequences spread over both drafts
        assert {s.service.num_seqs > 0 for s in servers} == {True}
        servers[0].close()  # kill one draft mid-run
        resume.set()
        wait_until(lambda: len(done) + len(errors) == len(PROMPTS), 120, 0.02, "every request finished")
        assert errors == []
        assert [outs[i] for i in range(len(PROMPTS))] == reference
        status = core.pool.status()
        assert status["num_draft_failures"] == 1 and status["num_resyncs"] > 0 and status["num_drafts_up"] == 1
        assert core.totals.num_accepted_tokens > 0
    finally:
        loop.shutdown()
        for s in servers:
            s.close()


def test_a_draft_with_another_vocabulary_is_refused(tiny_pair, tmp_path):
    from ..conftest import make_model

    make_model(tmp_path / "big", vocab_size=80)
    cfg = SpecserveConfig.load(target=str(tmp_path / "big"), draft=str(tmp_path / "big"))
    server = DraftServer(build_draft_service(cfg, "wrong"), host="127.0.0.1", advertise_host="127.0.0.1")
    core, _ = make_core(tiny_pair, {"wrong": server.address})
    try:
        core.pool.wait_for_drafts(60)  # returns as soon as the draft has answered (here: refused)
        assert not core.pool.drafts and "vocab_size 80 (draft) != 64 (target)" in core.pool.refused["wrong"]
    finally:
        core.pool.shutdown()
        server.close()


def test_generate_keeps_at_most_max_in_flight_requests_in_the_engine(tiny_pair, reference):
    with LLM(tiny_pair["target"], draft=tiny_pair["perturbed"], num_speculative_tokens=3, dtype="float64") as llm:
        core = llm._engine.loop.core
        most, step = [0], core.step

        def counting_step():
            most[0] = max(most[0], core.num_running + len(core.waiting))
            return step()

        core.step = counting_step
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, max_in_flight=3)
        assert [o.token_ids for o in outs] == reference and most[0] == 3
        with pytest.raises(ValueError, match="max_in_flight"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False, max_in_flight=0)


def test_a_step_that_fails_after_finishing_requests_fails_them_too(tiny_pair, reference, monkeypatch):
    """A bug late in a step (after some sequences finished and left the batch) fails every request in
    flight, those already finished included: nobody waits forever for a reply that was never sent."""
    with LLM(tiny_pair["target"], draft=tiny_pair["perturbed"], num_speculative_tokens=3, dtype="float64") as llm:
        core = llm._engine.loop.core
        original, broken = core.controller.observe_cycle, [True]

        def observe_cycle(*args, **kwargs):
            if broken[0] and not core.target.seqs:  # every sequence of the step finished: only the reply is left
                broken[0] = False
                raise RuntimeError("bug")
            return original(*args, **kwargs)

        core.controller.observe_cycle = observe_cycle
        short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        with concurrent.futures.ThreadPoolExecutor(1) as pool, pytest.raises(RequestFailed, match="engine step failed"):
            pool.submit(llm.generate, PROMPTS[:2], short, use_tqdm=False).result(timeout=120)  # fails, does not wait forever
        assert [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)] == reference[:3]  # still serving


def test_the_same_prompt_is_prefilled_once(tiny_pair, reference):
    """The n choices of a request (the same prompt) share one prefill: in one admission batch, and
    when a live sequence already holds the prompt; the outputs are what each gives alone."""
    prompt = PROMPTS[5]
    with LLM(tiny_pair["target"], draft=tiny_pair["perturbed"], num_speculative_tokens=3, dtype="float64") as llm:
        shared = lambda: llm.metrics()["num_prefills_shared"]  # noqa: E731
        outs = llm.generate([prompt, PROMPTS[0], prompt, prompt], GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == [reference[5], reference[0], reference[5], reference[5]]
        assert shared() == 2

        seeded = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=s) for s in (1, 2, 3)]
        alone = [llm.generate([prompt], p, use_tqdm=False)[0].token_ids for p in seeded]
        assert shared() == 2  # one at a time: nothing live to share with
        together = [o.token_ids for o in llm.generate([prompt] * 3, seeded, use_tqdm=False)]
        assert together == alone and shared() == 4

        async def joined():  # a second request arrives while the first holds the prompt
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            first = llm.stream(prompt, long)
            await first.__anext__()
            second = [t async for d in llm.stream(prompt, GREEDY) for t in d.token_ids]
            await first.aclose()
            return second

        assert asyncio.run(joined()) == reference[5]
        assert shared() == 5


def test_a_new_sequences_first_token_does_not_wait_for_the_draft(tiny_pair, reference):
    """Greedy and unseeded requests take their first step without drafts (the draft prefills the
    prompt meanwhile); seeded sampled ones speculate from the first step; speculation.first_step_drafts
    restores drafting there. Output is the same either way."""
    seeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=7)
    outs = {}
    for first_step_drafts in (False, True):
        with LLM(tiny_pair["target"], draft=tiny_pair["perturbed"], num_speculative_tokens=3, dtype="float64", adaptive=False,
                 first_step_drafts=first_step_drafts) as llm:
            async def first_deltas():
                greedy = [d async for d in llm.stream(PROMPTS[3], GREEDY)]
                sampled = [d async for d in llm.stream(PROMPTS[3], seeded)]
                return greedy, sampled

            greedy, sampled = asyncio.run(first_deltas())
            assert [t for d in greedy for t in d.token_ids] == reference[3]
            assert greedy[0].num_draft_tokens == (3 if first_step_drafts else 0)
            assert sampled[0].num_draft_tokens == 3
            outs[first_step_drafts] = [t for d in sampled for t in d.token_ids]
    assert outs[False] == outs[True]


def test_the_first_token_comes_from_the_prefill(tiny_pair, reference):
    """Greedy and unseeded requests take their first token from the prefill's last logits, before any
    verify step: a one-token request needs no step and an n-token one n - 1 (with first_step_drafts,
    which verifies every first token, one more). Tokens, logprobs and prompt logprobs are the same."""
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    seen = {}
    for first_step_drafts in (False, True):
        extra = int(first_step_drafts)
        with LLM(tiny_pair["target"], dtype="float64", first_step_drafts=first_step_drafts) as llm:
            steps = lambda: llm.metrics()["num_steps"]  # noqa: E731
            outs = llm.generate(PROMPTS[:4], one, use_tqdm=False)  # (one admission batch)
            assert [o.token_ids for o in outs] == [r[:1] for r in reference[:4]]
            assert steps() == extra
            assert llm.metrics()["num_prefills_apart"] == 4 * (1 - extra)  # (what ``specserve plan --measure`` prices)
            assert llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0].token_ids == reference[2]
            assert steps() == extra + GREEDY.max_tokens - 1 + extra
            unseeded = llm.generate([PROMPTS[2]], SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
            assert len(unseeded[0].token_ids) == 1 and steps() == extra + GREEDY.max_tokens - 1 + 2 * extra
            seen[first_step_drafts] = [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in llm.generate(PROMPTS[:6], scored, use_tqdm=False)]
    for (tokens, lps, plps), (tokens2, lps2, plps2) in zip(seen[False], seen[True]):
        assert tokens == tokens2 and len(lps) == len(tokens) and len(plps) == len(plps2)
        assert all(a[0][0] == b[0][0] and abs(a[0][1] - b[0][1]) < 1e-9 for a, b in zip(lps, lps2))
        assert all(a == b or abs(a[0][1] - b[0][1]) < 1e-9 for a, b in zip(plps, plps2))


@pytest.mark.parametrize("where", ["commit", "batch"])
def test_a_first_token_that_fails_fails_its_request_alone(tiny_pair, reference, monkeypatch, where):
    """The first token from the prefill fails like any step's: one sequence's commit fails that request
    only ("commit"); a failure of the whole batched decision leaves nothing open, and the engine
    admits the prompts one by one, so only the failing one fails ("batch")."""
    poisoned = PROMPTS[4]
    with LLM(tiny_pair["target"], draft=tiny_pair["perturbed"], num_speculative_tokens=3, dtype="float64") as llm:
        if where == "commit":
            original = TargetSide._commit

            def commit(self, s, *args):
                if s.token_ids == poisoned:
                    raise RuntimeError("boom")
                return original(self, s, *args)

            monkeypatch.setattr(TargetSide, "_commit", commit)
        else:
            original = TargetSide._decide

            def decide(self, seqs, *args):
                if any(s.token_ids == poisoned for s in seqs):
                    raise RuntimeError("boom")
                return original(self, seqs, *args)

            monkeypatch.setattr(TargetSide, "_decide", decide)

        results = stream_all(llm, [(PROMPTS[i], GREEDY) for i in (3, 4, 5)])
        assert isinstance(results[1], RequestFailed) and "boom" in str(results[1])
        assert [results[0], results[2]] == [reference[3], reference[5]]
        assert not llm._engine.loop.core.target.seqs  # nothing left open
        monkeypatch.setattr(TargetSide, "_decide" if where == "batch" else "_commit", original)
        assert llm.generate([poisoned], GREEDY, use_tqdm=False)[0].token_ids == reference[4]


def test_the_heap_is_frozen_while_serving_and_given_back(tiny_pair, reference):
    """Once the sides are built their objects leave the collector's sight (a full collection would walk
    them all, a pause longer than a step); shutting down gives them back."""
    import gc

    gc.unfreeze()
    with LLM(tiny_pair["target"], draft=tiny_pair["perturbed"], num_speculative_tokens=3, dtype="float64") as llm:
        assert gc.get_freeze_count() > 1000
        assert llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)[0].token_ids == reference[0]
    assert gc.get_freeze_count() == 0
