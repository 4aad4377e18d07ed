"""The vLLM target resumes a request from the output another replica committed (``vllm/resume.py``):
by continuing the prompt where that is exact, by replaying it otherwise, and says so when neither
way can. Each case runs undisturbed once, then again from one or two of its delta boundaries with
the deltas so far as its committed output: the resumed deltas must be exactly the rest. A vLLM
target with a remote draft, in a Ray actor, the demo pair.
"""

from __future__ import annotations

import json

import pytest

from specserve import LLM, SamplingParams
from specserve.outputs import CannotResume, Committed

from .conftest import VLLM_OPTIONS

PROMPT_TEXT = "def parse(text):\n"
CASES = {  # name -> (parameters, how the target resumes it)
    "greedy, logprobs": (dict(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2, repetition_penalty=1.2), "continue"),
    "greedy, penalties, stop string": (dict(temperature=0, max_tokens=40, ignore_eos=True, presence_penalty=0.5, stop=("zzz",)), "replay"),
    "seeded": (dict(temperature=0.8, seed=3, max_tokens=32, ignore_eos=True), "replay"),
    "json schema": (dict(temperature=0, max_tokens=40, structured_outputs=("json", json.dumps(
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "size": {"type": "integer"}},
         "required": ["name", "size"]}))), "replay"),
}


@pytest.fixture(scope="module")
def llm(ray_cluster):
    with LLM("demo:target", draft="demo:draft", ray=True, target_backend="vllm", num_speculative_tokens=3, adaptive=False,
             target_num_cpus=0.5, draft_num_cpus=0.5, draft_min_timeout_s=5.0, target_backend_options=VLLM_OPTIONS) as llm:
        yield llm


def stream(llm, prompt, params: SamplingParams, committed: Committed | None, rid: str) -> list[dict]:
    import ray

    gen = llm._engine.target.stream.options(num_returns="streaming").remote(rid, prompt, params.to_dict(),
                                                                           committed.to_dict() if committed else None)
    return [ray.get(ref) for ref in gen]


def tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d["token_ids"]]


def text(deltas) -> str:
    return "".join(d["text"] for d in deltas)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_resumed_request_goes_on_exactly(llm, name):
    from specserve.vllm import resume

    kwargs, way = CASES[name]
    params, prompt = SamplingParams(**kwargs), llm.tokenizer.encode(PROMPT_TEXT)
    whole = stream(llm, prompt, params, None, f"{name}-whole")
    assert len(whole) > 2 and whole[-1]["finished"]
    for cut in sorted({1, len(whole) // 2}):
        before = whole[:cut]
        committed = Committed(tuple(tokens(before)), len(text(before)))
        assert resume.continues(params, committed, llm.tokenizer) == (way == "continue")
        rest = stream(llm, prompt, params, committed, f"{name}-from-{cut}")
        assert tokens(before) + tokens(rest) == tokens(whole), (name, cut)
        assert text(before) + text(rest) == text(whole), (name, cut)
        assert rest[-1]["finish_reason"] == whole[-1]["finish_reason"]
        if params.logprobs is not None:
            lps = [e for d in before + rest for e in d["logprobs"]]
            want = [e for d in whole for e in d["logprobs"]]
            assert [[t for t, *_ in e] for e in lps] == [[t for t, *_ in e] for e in want]
            assert max(abs(a[1] - b[1]) for x, y in zip(lps, want) for a, b in zip(x, y)) < 1e-4


def test_an_unseeded_request_that_needs_a_replay_says_it_cannot_resume(llm):
    params = SamplingParams(temperature=1.0, max_tokens=16, presence_penalty=0.5)
    prompt = llm.tokenizer.encode(PROMPT_TEXT)
    first = stream(llm, prompt, params, None, "unseeded-whole")[:1]
    with pytest.raises(CannotResume, match="give the request a seed"):
        stream(llm, prompt, params, Committed(tuple(tokens(first)), len(text(first))), "unseeded-resumed")


def test_an_unseeded_plain_request_continues_to_its_length(llm):
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    prompt = llm.tokenizer.encode(PROMPT_TEXT)
    first = stream(llm, prompt, params, None, "plain-whole")[:1]
    rest = stream(llm, prompt, params, Committed(tuple(tokens(first)), len(text(first))), "plain-resumed")
    assert len(tokens(first) + tokens(rest)) == 20 and rest[-1]["finish_reason"] == "length"
