"""Penalties, logit_bias, min_p, min_tokens, allowed tokens, bad words and grammars under speculation: greedy
output equals target-only greedy output with the same parameters, on both target engines, with a remote draft;
so do the logprobs each engine reports (the target's raw ones), of generated and of prompt tokens.

vLLM's own target-only engine is the reference; a vLLM target verifying remote drafts hands the
parameters to vLLM's sampler (which applies them at every draft position; ``min_p`` and
``logit_bias``, which vLLM leaves out under speculation, through ``specserve.vllm.patches``);
specserve's own engine processes each verified position with its own prefix (``logits_processing.py``).
"""

from __future__ import annotations

import json

import pytest

from specserve import LLM, SamplingParams

from .conftest import VLLM_OPTIONS, random_prompts, start_runner

TARGET, DRAFT = "demo:target", "demo:draft"
PROMPTS = random_prompts(6, length=12)
CASES = {  # name -> the parameters, beyond greedy and 40 tokens
    "penalties": {"repetition_penalty": 1.3, "presence_penalty": 0.6, "frequency_penalty": 0.4},
    "logit_bias": {"logit_bias": {292: 6.0, 367: 4.0, 1764: -100.0}},
    "bias_and_penalties": {"logit_bias": {292: 3.0, 367: -2.0}, "repetition_penalty": 1.3, "min_p": 0.1},
    "min_tokens": {"min_tokens": 30, "stop_token_ids": [292, 367], "ignore_eos": False},
    "allowed_and_bad_words": {"allowed_token_ids": list(range(250, 450)), "bad_words": ["the", "of"]},
    # structured outputs: vLLM's own grammar on its target (it masks draft positions too), xgrammar per verified position on ours
    "json_schema": {"structured_outputs": {"json": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                                                     "size": {"type": "integer"}},
                                                    "required": ["name", "size"]}}, "ignore_eos": False},
    "regex": {"structured_outputs": {"regex": "(def|class) [a-z]{1,6}\\(\\)"}, "ignore_eos": False},
}


def params(case: str) -> dict:
    return {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True, **CASES[case]}


@pytest.fixture(scope="module")
def reference(ray_cluster):
    import ray

    from specserve.config import resolve_model

    runner = start_runner(model=resolve_model(TARGET))
    try:
        ref = {case: ray.get(runner.generate.remote(PROMPTS, params(case))) for case in CASES}
        ref["logprobs"] = ray.get(runner.generate_logprobs.remote(PROMPTS, {**params("penalties"), "logprobs": 2}))
        ref["prompt_logprobs"] = ray.get(runner.generate_prompt_logprobs.remote(PROMPTS, 2))
        yield ref
    finally:
        ray.kill(runner)


def engine(backend: str) -> LLM:
    options = {"target_backend_options": VLLM_OPTIONS} if backend == "vllm" else {}
    return LLM(TARGET, draft=DRAFT, ray=True, target_backend=backend, num_speculative_tokens=4, adaptive=False,
               target_num_cpus=0.5, draft_num_cpus=0.5, draft_min_timeout_s=5.0, **options)


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_greedy_with_sampling_features_equals_vllm_target_only(ray_cluster, reference, backend):
    llm = engine(backend)
    try:
        for case in CASES:
            p = params(case)
            if "structured_outputs" in p:  # specserve's SamplingParams take (kind, constraint)
                (kind, spec), = p["structured_outputs"].items()
                p["structured_outputs"] = (kind, spec if isinstance(spec, str) else json.dumps(spec))
            if "logit_bias" in p:
                p["logit_bias"] = tuple(p["logit_bias"].items())
            outs = llm.generate(PROMPTS, SamplingParams(**p), use_tqdm=False)
            assert [list(o.token_ids) for o in outs] == reference[case], case
        # One batch mixing requests with and without a bias: each request's verified rows get its own.
        mixed = ["logit_bias" if i % 2 else "penalties" for i in range(len(PROMPTS))]
        sp = [SamplingParams(**{**params(c), "logit_bias": tuple(CASES[c].get("logit_bias", {}).items())}) for c in mixed]
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert [list(o.token_ids) for o in outs] == [reference[c][i] for i, c in enumerate(mixed)]
        # Logprobs: the target's raw ones (before the penalties), as vLLM target-only reports them.
        outs = llm.generate(PROMPTS, SamplingParams(**params("penalties"), logprobs=2), use_tqdm=False)
        for out, (tokens, expected) in zip(outs, reference["logprobs"]):
            assert list(out.token_ids) == tokens and len(out.logprobs) == len(expected)
            for got, want in zip(out.logprobs, expected):
                assert [t for t, _ in got] == [t for t, _ in want]
                assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < 1e-3
        # Prompt logprobs (the prefill's): as vLLM target-only reports them, ranks included.
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)
        for out, expected in zip(outs, reference["prompt_logprobs"]):
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(expected)
            for got, want in zip(out.prompt_logprobs[1:], expected[1:]):
                assert got[0][0] == want[0][0] and abs(got[0][1] - want[0][1]) < 1e-3 and got[0][2] == want[0][2]
                assert [t for t, _ in got[1:]] == [t for t, _ in want[1:]]
        m = llm.metrics()
        assert m["num_accepted_tokens"] > 0  # the drafts were verified, not bypassed
    finally:
        llm.shutdown()


def test_the_features_change_the_output(reference):
    plain = reference["penalties"]  # (each case against its own reference above; here: they are not no-ops)
    assert reference["logit_bias"] != plain and reference["bias_and_penalties"] != plain
    allowed = set(CASES["allowed_and_bad_words"]["allowed_token_ids"])
    assert all(set(t) <= allowed and 292 not in t and 367 not in t for t in reference["allowed_and_bad_words"])
    assert all(len(t) >= 30 for t in reference["min_tokens"])


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_the_draft_applies_the_processing_to_its_proposals(ray_cluster, reference, backend):
    """The target drafting for itself: with the processing applied on the draft side too (penalties, bias,
    allowed tokens, bad words, min_tokens), its proposals are the target's own greedy tokens and every one
    is accepted (without it, a bias the draft does not know rejects nearly all of them)."""
    options = {"target_backend_options": VLLM_OPTIONS} if backend == "vllm" else {}
    llm = LLM(TARGET, draft=TARGET, ray=True, target_backend=backend, num_speculative_tokens=4, adaptive=False,
              target_num_cpus=0.5, draft_num_cpus=0.5, draft_min_timeout_s=5.0, **options)
    try:
        for case in ("logit_bias", "penalties", "min_tokens", "allowed_and_bad_words"):
            p = params(case)
            if "logit_bias" in p:
                p["logit_bias"] = tuple(p["logit_bias"].items())
            outs = llm.generate(PROMPTS, SamplingParams(**p), use_tqdm=False)
            assert [list(o.token_ids) for o in outs] == reference[case], case
            drafted = sum(o.metrics.num_draft_tokens for o in outs)
            assert drafted > 0, case
            assert sum(o.metrics.num_accepted_tokens for o in outs) == drafted, case
    finally:
        llm.shutdown()
