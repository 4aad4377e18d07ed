"""The shipped demo pair: plain transformers loads it, and speculation over it is lossless."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve import LLM, SamplingParams
from specserve.demo import DEMO_PROMPTS
from specserve.demo_models import DRAFT_PATH, TARGET_PATH


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
    target_only = LLM(target="demo:target").generate(DEMO_PROMPTS, params, use_tqdm=False)
    llm = LLM(target="demo:target", draft="demo:draft", num_speculative_tokens=4)
    outs = llm.generate(DEMO_PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in target_only]
    assert [o.text for o in outs] == [o.text for o in target_only]
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert accepted / drafted > 0.3  # a trained, distilled draft: speculation visibly works


def test_plain_transformers_greedy_matches_specserve():
    tok = AutoTokenizer.from_pretrained(TARGET_PATH)
    model = AutoModelForCausalLM.from_pretrained(TARGET_PATH, dtype=torch.float32).eval()
    prompt = DEMO_PROMPTS[0]
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
    out = LLM(str(TARGET_PATH), draft=str(DRAFT_PATH), num_speculative_tokens=4).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == ref
