"""Stops end the output at the right place, and caches stay consistent afterwards."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.reference import reference_generate

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], list(range(12, 40))]


@pytest.fixture(scope="module")
def llm(tiny_pair):
    with LLM(tiny_pair["target"], draft=tiny_pair["same"], num_speculative_tokens=8, dtype="float64", adaptive=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def free_run(tiny_pair):
    target = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], dtype=torch.float64).eval()
    return [reference_generate(target, p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) for p in PROMPTS]


def assert_caches_empty(llm):
    engine = llm._engine
    assert engine.target.num_seqs == 0 and engine.target.backend.num_seqs == 0
    deadline = time.time() + 30  # closes reach the draft with the next request, or when the engine idles (4 times a second)
    while engine.draft_service.num_seqs and time.time() < deadline:
        time.sleep(0.01)
    assert engine.draft_service.num_seqs == 0 and engine.draft_service.drafter.backend.num_seqs == 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7, 9, 17])
def test_max_tokens_never_exceeded(llm, free_run, max_tokens):
    # k=8 with a perfect draft: every block crosses small max_tokens limits.
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    for o, ref in zip(outs, free_run):
        assert o.token_ids == ref[:max_tokens] and o.finish_reason == "length"
    assert_caches_empty(llm)


def test_stop_token_ids_cut_inside_an_accepted_block(llm, free_run):
    for o, ref, p in zip(llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                               stop_token_ids=[r[5]]) for r in free_run], use_tqdm=False), free_run, PROMPTS):
        cut = ref.index(ref[5]) + 1
        assert o.token_ids == ref[:cut] and o.finish_reason == "stop" and o.stop_reason == ref[5]
    assert_caches_empty(llm)


def test_eos_stops_unless_ignored(tiny_pair, free_run):
    eos = free_run[0][3]
    with LLM(tiny_pair["target"], draft=tiny_pair["same"], num_speculative_tokens=8, dtype="float64", adaptive=False) as llm:
        llm._engine.target.eos_token_ids = {eos}
        out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
        assert out.token_ids == free_run[0][: free_run[0].index(eos) + 1] and out.finish_reason == "stop"
        out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
        assert out.token_ids == free_run[0] and out.finish_reason == "length"


def test_stop_strings(llm, free_run):
    tok = llm.tokenizer
    full = tok.decode(free_run[0], skip_special_tokens=True)
    stop_word = tok.decode([free_run[0][6]])
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop_word]), use_tqdm=False)[0]
    first = free_run[0].index(free_run[0][6])
    assert out.token_ids == free_run[0][: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_word
    assert out.text == full[: full.index(stop_word)]
    assert stop_word not in out.text
    assert_caches_empty(llm)


def test_string_prompts_and_text(llm):
    out = llm.generate(["w1 w2 w3"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt == "w1 w2 w3" and len(out.token_ids) == 5
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_later_requests_unaffected_by_earlier_stops(llm, free_run):
    # Mixed stops in one batch, then a fresh batch: outputs still match the reference.
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 40, 11)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [free_run[0][:3], free_run[1], free_run[2][:11]]
    outs = llm.generate(PROMPTS[::-1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == free_run[::-1]


def test_context_limit_finishes_with_length(tiny_pair):
    with LLM(tiny_pair["target"], draft=tiny_pair["same"], num_speculative_tokens=8, dtype="float64", max_model_len=20,
             adaptive=False) as llm:
        out = llm.generate([list(range(5, 15))], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_incremental_text_equals_a_full_decode():
    """The streamed text (DecodeStream) is exactly what decoding the whole output gives,
    also when multi-byte characters are split across tokens."""
    from transformers import AutoTokenizer

    from specserve.demo_models import TARGET_PATH
    from specserve.stopping import StopChecker

    tok = AutoTokenizer.from_pretrained(TARGET_PATH)
    text = 'def grüße(x):\n    return "héllo ✓ 日本" + x  # ünïcödé\n' * 3
    ids = tok.encode(text)
    checker = StopChecker(SamplingParams(max_tokens=10_000), set(), tok, 1, 100_000)
    assert checker._detok.stream is not None  # the incremental path, not the fallback
    streamed = ""
    for i in ids:
        checker.append([i])
        streamed += checker.text_delta()
    assert checker.text == tok.decode(ids) == streamed
