"""The shipped demo pair: plain transformers loads it, and speculation over it is lossless."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve import LLM, SamplingParams
from specserve.demo import DEMO_PROMPTS
from specserve.demo_models import DRAFT_PATH, TARGET_PATH

from ..conftest import demo_acceptance_range


def test_loads_with_plain_transformers():
    for path in (TARGET_PATH, DRAFT_PATH):
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path)
        ids = tok("def add(a, b):\n", return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False)
        assert out.shape[1] == ids.shape[1] + 8 or tok.eos_token_id in out[0].tolist()
    assert AutoTokenizer.from_pretrained(TARGET_PATH).get_vocab() == AutoTokenizer.from_pretrained(DRAFT_PATH).get_vocab()


def test_readme_batch_example_is_lossless():
    params = SamplingParams(temperature=0.0, max_tokens=48)
    with LLM(target="demo:target") as llm:
        target_only = llm.generate(DEMO_PROMPTS, params, use_tqdm=False)
    with LLM(target="demo:target", draft="demo:draft", num_speculative_tokens=4) as llm:  # adaptive k, as the README
        outs = llm.generate(DEMO_PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in target_only]
    assert [o.text for o in outs] == [o.text for o in target_only]


def test_demo_prompts_at_fixed_k_meet_the_cards_acceptance_range():
    """The model card's demo acceptance range, on the demo's own prompts, tokens and k (4), with k fixed.

    Under adaptive k (the default) each step's k follows measured timings, so the number of
    drafted tokens, and the rate with it, moves with the machine's speed and load: anything in
    [0, 1] is legitimate. With k fixed the rate is a function of the greedy outputs alone (the
    range leaves room for floating-point near-ties that differ between machines)."""
    low, high = demo_acceptance_range()
    params = SamplingParams(temperature=0.0, max_tokens=48)
    with LLM(target="demo:target", draft="demo:draft", num_speculative_tokens=4, adaptive=False) as llm:
        outs = llm.generate(DEMO_PROMPTS, params, use_tqdm=False)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert low <= accepted / drafted <= high, accepted / drafted
    for o in outs:  # fixed k: blocks of at most k in every step but the first token's (from the prefill), the
        # step after it (the draft prefills the prompt meanwhile) and a last one with one token of room left
        m = o.metrics
        assert m.num_steps - 3 <= m.num_drafts <= m.num_steps - 2 and m.num_drafts <= m.num_draft_tokens <= 4 * m.num_drafts
        assert m.num_steps <= len(o.token_ids) <= m.num_steps + m.num_accepted_tokens


def test_plain_transformers_greedy_matches_specserve():
    tok = AutoTokenizer.from_pretrained(TARGET_PATH)
    model = AutoModelForCausalLM.from_pretrained(TARGET_PATH, dtype=torch.float32).eval()
    prompt = DEMO_PROMPTS[0]
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
    with LLM(str(TARGET_PATH), draft=str(DRAFT_PATH), num_speculative_tokens=4) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == ref
