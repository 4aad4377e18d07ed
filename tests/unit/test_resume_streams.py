"""The router's resume logic (specserve/serve/resume.py) over real direct streams to two in-process
target engines, without Ray: a replica that dies, hangs, fails the request or stops mid-stream hands
the request to the other, which resumes it from the output already delivered, and the choice's
output is exactly the undisturbed one. The registry is a stand-in that lists what the test says is
up, with each engine's real step counter (what replicas announce).
"""

from __future__ import annotations

import asyncio
import threading
import time
import types

import pytest

from specserve import LLM, SamplingParams
from specserve.config import SpecserveConfig
from specserve.serve.http import APIError
from specserve.serve.metrics import ResumeStats
from specserve.serve.resume import ChoiceStream, Resumes
from specserve.serve.streams import StreamServer
from specserve.serve.targets import TargetDirectory
from specserve.target import TargetSide

SECRET = "resume-secret"
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    "seeded, penalties": SamplingParams(temperature=0.9, seed=21, max_tokens=40, ignore_eos=True, presence_penalty=0.7),
}


@pytest.fixture(scope="module")
def engines():
    with LLM("demo:target", draft="demo:draft", dtype="float64", num_speculative_tokens=3, adaptive=False) as a, \
            LLM("demo:target", draft="demo:draft", dtype="float64", num_speculative_tokens=3, adaptive=False) as b:
        yield {"target-a": a, "target-b": b}


@pytest.fixture(scope="module")
def prompt(engines):
    return engines["target-a"]._engine.target.tokenizer.encode("def parse(text):\n")


class Replicas:
    """The two engines behind stream servers, and the registry's view of them."""

    def __init__(self, engines):
        self.engines = engines
        self.servers = {name: StreamServer(llm._engine.loop, SECRET, "127.0.0.1", name, 8, 1 << 20) for name, llm in engines.items()}
        self.listed = set(engines)

    def snapshot(self) -> dict:
        return {"draft": {}, "target": {name: {"stream_address": self.servers[name].address,
                                               "num_steps": self.engines[name]._engine.loop.core.counters["num_steps"]}
                                        for name in self.listed}}

    def close(self) -> None:
        for s in self.servers.values():
            s.close()


@pytest.fixture
def replicas(engines):
    r = Replicas(engines)
    yield r
    r.close()


def router_side(replicas, **server):
    """A ``Resumes`` as the router builds it, over a registry stand-in that lists ``replicas.listed``."""
    cfg = SpecserveConfig.load({"target": {"model": "demo:target"},
                                "server": {"stream_token": SECRET, "stream_spares": 0, **server}})

    async def snapshot():
        return replicas.snapshot()

    registry = types.SimpleNamespace(snapshot=types.SimpleNamespace(remote=snapshot))
    handle = types.SimpleNamespace(options=lambda **_: pytest.fail("the Serve handle was used: no direct stream could be opened"))
    directory = TargetDirectory(cfg, handle, registry, "demo")
    directory.info = {}  # (no warm-up: nothing to fetch)
    stats = ResumeStats()
    return directory, Resumes(directory, handle, cfg.server, stats), stats


async def collect(choice: ChoiceStream, after_first=None) -> tuple[list[int], str]:
    await choice.start()
    if after_first is not None:
        await after_first(choice)
    while not choice.out.finished:
        await choice.next()
    return list(choice.out.token_ids), choice.out.text


def run_choice(replicas, prompt, params, disturb=None, first_on="target-a", listed_after=None, **server):
    """One choice, started on ``first_on`` (the only replica listed until it has output; then
    ``listed_after``, default all); ``disturb(replicas, choice)`` runs once the first delta is in.
    Returns (tokens, text, the choice, resume stats)."""
    directory, resumes, stats = router_side(replicas, **server)

    async def main():
        keep = replicas.listed if listed_after is None else listed_after
        replicas.listed = {first_on}
        await directory.refresh(1)

        async def refresher():
            while True:
                await asyncio.sleep(0.1)
                await directory.refresh(1)

        poll = asyncio.ensure_future(refresher())
        choice = ChoiceStream(resumes, f"req-{time.monotonic_ns()}", list(prompt), params, time.monotonic() + 120)
        try:
            async def after_first(c):
                replicas.listed = keep
                await directory.refresh(1)
                if disturb is not None:
                    disturb(replicas, c)
            tokens, text = await collect(choice, after_first)
        finally:
            poll.cancel()
            choice.close()
        return tokens, text, choice

    tokens, text, choice = asyncio.run(main())
    return tokens, text, choice, stats


@pytest.fixture(scope="module")
def undisturbed(engines, prompt):
    llm = engines["target-b"]
    return {name: (lambda o: (o.token_ids, o.text))(llm.generate([prompt], p, use_tqdm=False)[0]) for name, p in PARAMS.items()}


def kill(replicas, choice):
    """The serving replica dies: its stream server goes, every connection with it (it stays listed, as a dead
    replica does until its last announcement expires)."""
    replicas.servers[choice.attempt.target].close()


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_a_dead_replica_hands_the_request_to_the_other_exactly(replicas, prompt, undisturbed, name):
    tokens, text, choice, stats = run_choice(replicas, prompt, PARAMS[name], kill)
    assert (tokens, text) == undisturbed[name]
    assert choice.num_resumes == 1 and choice.failed == {"target-a": "death"}
    assert stats.by_cause["death"] == 1 and stats.count == 1


def test_a_hung_replica_is_cut_off_within_the_stall_bound_and_cannot_emit_later(replicas, prompt, undisturbed, engines):
    """The engine's step blocks (a hung forward): no step counts, no deltas. After stall_timeout_s the
    request resumes on the other replica; the hung one's copy is aborted when it wakes."""
    core = engines["target-a"]._engine.loop.core
    release, step = threading.Event(), type(core).step
    aborted_before = core.counters["num_requests_aborted"]
    detected = {}

    def hang(replicas, choice):
        detected["at"] = time.monotonic()
        core.step = lambda: (release.wait(60), step(core))[1]

    try:
        tokens, text, choice, stats = run_choice(replicas, prompt, PARAMS["greedy"], hang, stall_timeout_s=1.0)
    finally:
        release.set()
        del core.step
    assert (tokens, text) == undisturbed["greedy"]
    assert choice.failed == {"target-a": "stall"} and stats.by_cause["stall"] == 1
    assert stats.sum_s < 5  # the resume itself: the next replica's first delta, once the stall was declared
    deadline = time.monotonic() + 30
    while core.counters["num_requests_aborted"] == aborted_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert core.counters["num_requests_aborted"] > aborted_before  # the woken replica dropped its copy


def test_a_replica_that_fails_the_request_in_a_step_is_not_given_it_again(replicas, prompt, undisturbed, monkeypatch):
    commit = TargetSide._commit

    def failing(self, s, *args, **kwargs):
        if s.request_id.startswith("req-") and self is replicas.engines["target-a"]._engine.target:
            raise RuntimeError("injected failure in a step")
        return commit(self, s, *args, **kwargs)

    def fail_a(replicas, choice):
        monkeypatch.setattr(TargetSide, "_commit", failing)

    tokens, text, choice, stats = run_choice(replicas, prompt, PARAMS["seeded, penalties"], fail_a)
    assert (tokens, text) == undisturbed["seeded, penalties"]
    assert choice.failed == {"target-a": "error"} and stats.by_cause["error"] == 1


def test_a_stopping_replica_hands_its_streams_back(replicas, prompt, undisturbed):
    def stop(replicas, choice):
        server = replicas.servers[choice.attempt.target]
        threading.Thread(target=server.drain, args=(4.0,)).start()

    tokens, text, choice, stats = run_choice(replicas, prompt, PARAMS["greedy"], stop)
    assert (tokens, text) == undisturbed["greedy"]
    assert choice.failed == {"target-a": "scale_down"} and stats.by_cause["scale_down"] == 1


def test_with_one_replica_the_request_waits_for_a_new_one(replicas, prompt, undisturbed):
    """Its only replica dies; a replacement is listed a second later (Serve restarted it): the request
    resumes there instead of failing."""
    def kill_and_replace(replicas, choice):
        kill(replicas, choice)
        threading.Timer(1.0, lambda: setattr(replicas, "listed", {"target-b"})).start()

    tokens, text, choice, stats = run_choice(replicas, prompt, PARAMS["greedy"], kill_and_replace, listed_after={"target-a"})
    assert (tokens, text) == undisturbed["greedy"] and choice.failed == {"target-a": "death"}


def test_after_resume_limit_the_request_fails_saying_why(replicas, prompt, monkeypatch):
    commit = TargetSide._commit

    def failing(self, s, *args, **kwargs):
        if s.request_id.startswith("req-"):
            raise RuntimeError("injected failure in a step")
        return commit(self, s, *args, **kwargs)

    def fail_everywhere(replicas, choice):
        monkeypatch.setattr(TargetSide, "_commit", failing)

    with pytest.raises(APIError, match=r"failed it, after 2 resume\(s\) \(resume_limit=2\)"):
        run_choice(replicas, prompt, PARAMS["greedy"], fail_everywhere, resume_limit=2)


def test_no_replica_back_within_the_restart_wait(replicas, prompt):
    start = time.monotonic()
    with pytest.raises(APIError, match=r"no other came up within target_restart_wait_s \(1 s\)"):
        run_choice(replicas, prompt, PARAMS["greedy"], kill, listed_after={"target-a"}, target_restart_wait_s=1.0)
    assert time.monotonic() - start < 30


def test_a_new_request_waits_out_a_lapse_in_the_listing_but_not_an_absence(replicas, prompt, undisturbed, monkeypatch):
    """The only replica drops out of the listing for a second without being seen to die (its
    announcements were late): a new request waits for it and is served, exactly. Once a replica has
    been unlisted for longer than ``LAPSE_S``, a new request gets the fast 503."""
    import specserve.serve.targets as targets

    monkeypatch.setattr(targets, "LAPSE_S", 3.0)
    directory, resumes, _ = router_side(replicas)

    async def main():
        replicas.listed = {"target-a"}
        await directory.refresh(1)
        replicas.listed = set()
        await directory.refresh(1)
        assert not directory.alive() and directory.lapsed()

        async def refresher():
            while True:
                await asyncio.sleep(0.1)
                await directory.refresh(1)

        poll = asyncio.ensure_future(refresher())
        threading.Timer(1.0, lambda: setattr(replicas, "listed", {"target-a"})).start()
        try:
            await directory.ready()
            out = await collect(ChoiceStream(resumes, f"req-{time.monotonic_ns()}", list(prompt), PARAMS["greedy"], time.monotonic() + 120))
            replicas.listed = set()
            await asyncio.sleep(3.5)
            assert not directory.lapsed()
            with pytest.raises(APIError, match="no target replica is available"):
                await directory.ready()
            with pytest.raises(APIError, match="no target replica is available"):
                await collect(ChoiceStream(resumes, f"req-{time.monotonic_ns()}", list(prompt), PARAMS["greedy"], time.monotonic() + 120))
        finally:
            poll.cancel()
        return out

    assert asyncio.run(main()) == undisturbed["greedy"]
