"""Logprobs are the target's raw logprobs at each generated position, equal with and without
speculation (the verify forward's rows are the plain forward's), and the top-N are ranked."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3], [20, 21, 22, 20, 21, 22, 20]]


def generate(tiny_pair, params, **kw):
    with LLM(tiny_pair["target"], dtype="float64", **kw) as llm:
        return llm.generate(PROMPTS, params, use_tqdm=False)


def test_logprobs_are_the_targets_and_do_not_depend_on_speculation(tiny_pair):
    params = [SamplingParams(temperature=t, max_tokens=16, ignore_eos=True, seed=3, logprobs=3) for t in (0.0, 0.0, 1.0, 0.0)]
    plain = generate(tiny_pair, params, draft=None)
    spec = generate(tiny_pair, params, draft=tiny_pair["perturbed"], num_speculative_tokens=4, adaptive=False)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    assert [spec[i].token_ids for i in greedy] == [plain[i].token_ids for i in greedy]
    assert sum(o.metrics.num_accepted_tokens for o in spec) > 0  # the drafts were verified
    model = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], dtype=torch.float64).eval()
    for prompt, p, outs in [(PROMPTS[i], params[i], (plain[i], spec[i])) for i in range(len(PROMPTS))]:
        for out in outs:  # each output's logprobs are the target's after its own prefix
            assert len(out.logprobs) == len(out.token_ids)
            with torch.no_grad():
                ref = torch.log_softmax(model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1], dim=-1)
            for j, (entry, tok) in enumerate(zip(out.logprobs, out.token_ids)):
                assert entry[0][0] == tok and len(entry) == 1 + p.logprobs
                assert abs(entry[0][1] - ref[j, tok].item()) < 1e-6
                top = ref[j].topk(3)
                assert [t for t, _ in entry[1:]] == top.indices.tolist()
                assert max(abs(v - w) for (_, v), w in zip(entry[1:], top.values.tolist())) < 1e-6
                if p.temperature == 0.0:
                    assert entry[1][0] == tok  # greedy: the token is the top one
    for i in greedy:  # the same tokens, the same logprobs, whether or not they were drafted
        assert max(abs(a[0][1] - b[0][1]) for a, b in zip(plain[i].logprobs, spec[i].logprobs)) < 1e-6


def test_no_logprobs_unless_asked(tiny_pair):
    outs = generate(tiny_pair, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), draft=None)
    assert all(o.logprobs is None for o in outs)


def test_prompt_logprobs_come_from_the_prefill(tiny_pair):
    """Each prompt token's logprob given the tokens before it (the first has none), its rank, and the
    top-N: the target's raw logprobs, the same with and without speculation, sent once per request."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    plain = generate(tiny_pair, params, draft=None)
    spec = generate(tiny_pair, params, draft=tiny_pair["perturbed"], num_speculative_tokens=3, adaptive=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], dtype=torch.float64).eval()
    for prompt, a, b in zip(PROMPTS, plain, spec):
        assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(prompt)
        assert a.logprobs is None  # (generated tokens' logprobs were not asked for)
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1], dim=-1)
        for j, (entry, other) in enumerate(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])):
            tok, lp, rank = entry[0]
            assert tok == prompt[j + 1] and abs(lp - ref[j, tok].item()) < 1e-6 and abs(other[0][1] - lp) < 1e-9
            assert rank == 1 + int((ref[j] > ref[j, tok]).sum())
            assert [t for t, _ in entry[1:]] == ref[j].topk(2).indices.tolist()
