"""A request resumed from its committed output goes on exactly as it would have: the target rebuilds
its state (stop checker, grammar matcher, penalty counts, position-keyed draws, the draft opened on the
whole context) from the output another replica had already sent.

Each case runs undisturbed once; then, for several of its delta boundaries (where a router holding a
stream can lose its replica), the same request is submitted again with the deltas so far as its
``Committed`` output. What the resumed request adds must be exactly the rest of the undisturbed run:
the same tokens, the same text (no character repeated or missing), the same logprobs and finish.
The demo pair with a draft (speculation on, fixed k), float64.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from specserve import LLM, SamplingParams
from specserve.outputs import Committed

pytest.importorskip("xgrammar")

PROMPT_TEXT = "def parse(text):\n"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "integer"}},
          "required": ["name", "size"]}
CASES = {
    "greedy": dict(temperature=0, max_tokens=28, ignore_eos=True),
    "seeded": dict(temperature=0.9, seed=11, max_tokens=28, ignore_eos=True),
    "penalties": dict(temperature=0.8, seed=5, presence_penalty=0.9, frequency_penalty=0.6, repetition_penalty=1.4,
                      max_tokens=28, ignore_eos=True),
    "bias, min_p, min_tokens, bad words": dict(temperature=1.0, seed=2, min_p=0.05, min_tokens=20, max_tokens=28,
                                               logit_bias=((32, 3.0), (101, -5.0)), bad_words=("the",)),
    "json schema": dict(temperature=0, max_tokens=40, structured_outputs=("json", json.dumps(SCHEMA))),
    "regex, sampled": dict(temperature=1.0, seed=9, max_tokens=40, structured_outputs=("regex", r"(def|class) [a-z_]{1,12}\((x|self)\):")),
    "logprobs": dict(temperature=0.7, seed=4, max_tokens=24, ignore_eos=True, logprobs=3),
}


@pytest.fixture(scope="module")
def llm():
    with LLM("demo:target", draft="demo:draft", dtype="float64", num_speculative_tokens=3, adaptive=False) as llm:
        yield llm


def run(llm, prompt: list[int], params: SamplingParams, committed: Committed | None = None, rid: str = "r") -> list:
    async def main():
        return [d async for d in llm._engine.loop.stream(rid, list(prompt), params, committed)]
    return asyncio.run(main())


def cuts(deltas: list, most: int = 4) -> list[int]:
    """Delta boundaries to resume at: spread over the run, never after the last (finished) delta."""
    inner = list(range(1, len(deltas)))
    step = max(1, len(inner) // most)
    return inner[::step][:most]


def tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def text(deltas) -> str:
    return "".join(d.text for d in deltas)


def logprobs(deltas) -> list:
    return [e for d in deltas for e in (d.logprobs or [])]


def assert_resumes_exactly(llm, prompt, params, name):
    whole = run(llm, prompt, params, rid=f"{name}-whole")
    assert whole[-1].finished and len(whole) > 2, (name, whole)
    for i, cut in enumerate(cuts(whole)):
        before = whole[:cut]
        committed = Committed(tuple(tokens(before)), len(text(before)))
        rest = run(llm, prompt, params, committed, rid=f"{name}-resumed-{i}")
        assert tokens(before) + tokens(rest) == tokens(whole), (name, cut)
        assert text(before) + text(rest) == text(whole), (name, cut)
        assert (rest[-1].finish_reason, rest[-1].stop_reason) == (whole[-1].finish_reason, whole[-1].stop_reason)
        if params.logprobs is not None:
            again, want = logprobs(before) + logprobs(rest), logprobs(whole)
            assert [[t for t, *_ in e] for e in again] == [[t for t, *_ in e] for e in want]
            assert max(abs(a[1] - b[1]) for x, y in zip(again, want) for a, b in zip(x, y)) < 1e-9
        assert rest[0].prompt_logprobs is None


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_resumed_request_goes_on_as_if_undisturbed(llm, name):
    prompt = llm._engine.target.tokenizer.encode(PROMPT_TEXT)
    assert_resumes_exactly(llm, prompt, SamplingParams(**CASES[name]), name)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_that_straddles_the_resume_point_is_found(llm, include):
    """The stop-string window and the text held back for it are rebuilt: the undisturbed run stops
    at a string that begins in the committed output and ends in the resumed one."""
    prompt = llm._engine.target.tokenizer.encode(PROMPT_TEXT)
    free = run(llm, prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), rid=f"free-{include}")
    whole_text = text(free)
    stop = whole_text[len(whole_text) // 2: len(whole_text) // 2 + 5]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=(stop,), include_stop_str_in_output=include)
    whole = run(llm, prompt, params, rid=f"stopped-{include}")
    assert whole[-1].stop_reason == stop
    assert_resumes_exactly(llm, prompt, params, f"stop-{include}")


def test_the_draft_speculates_on_the_resumed_context(llm):
    prompt = llm._engine.target.tokenizer.encode(PROMPT_TEXT)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    whole = run(llm, prompt, params, rid="spec-whole")
    rest = run(llm, prompt, params, Committed(tuple(tokens(whole[:2])), len(text(whole[:2]))), rid="spec-resumed")
    assert sum(d.num_draft_tokens for d in rest) > 0 and sum(d.num_accepted_tokens for d in rest) > 0


@pytest.mark.parametrize("committed, params, message", [
    (Committed((1, 2, 3)), dict(max_tokens=3), "no room"),
    (Committed((5000,)), dict(max_tokens=8), r"committed token ids must be in \[0, 4096\)"),
    (Committed((101, 102), num_text_chars=999), dict(max_tokens=8), "num_text_chars"),
    (Committed((0, 101)), dict(max_tokens=8), "already ends the request"),  # 0 is the demo target's EOS
    (Committed((101,)), dict(max_tokens=8, prompt_logprobs=1), "prompt_logprobs"),
    (Committed((101, 102)), dict(max_tokens=8, structured_outputs=("choice", json.dumps(["yes", "no"]))), "structured_outputs"),
])
def test_an_impossible_committed_output_is_a_value_error_naming_it(llm, committed, params, message):
    with pytest.raises(ValueError, match=message):
        run(llm, [65, 66, 67], SamplingParams(**params), committed, rid="bad")


def test_committed_round_trips_and_rejects_bad_values():
    c = Committed((3, 4, 5), 7)
    assert Committed.from_dict(c.to_dict()) == c and Committed.from_dict(None) is None and Committed.from_dict({}) is None
    for bad in ({"token_ids": [1, -2]}, {"token_ids": [1], "num_text_chars": -1}, {"token_ids": [True]}):
        with pytest.raises(ValueError, match="committed"):
            Committed.from_dict(bad)


def test_an_unseeded_sampled_request_resumes_as_a_valid_sample(llm):
    """Unseeded: the rest is a new draw (it was random to begin with), under the same constraint and limits."""
    prompt = llm._engine.target.tokenizer.encode(PROMPT_TEXT)
    params = SamplingParams(temperature=1.0, max_tokens=60, structured_outputs=("json", json.dumps(SCHEMA)))
    whole = run(llm, prompt, params, rid="unseeded-whole")
    before = whole[:2]
    rest = run(llm, prompt, params, Committed(tuple(tokens(before)), len(text(before))), rid="unseeded-resumed")
    assert len(tokens(before) + tokens(rest)) <= 60
    if rest[-1].finish_reason == "stop":
        value = json.loads(text(before) + text(rest))
        assert isinstance(value["name"], str) and isinstance(value["size"], int)
