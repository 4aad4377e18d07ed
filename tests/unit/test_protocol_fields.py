"""specserve's request models know every field of vLLM's, and take vLLM's defaults as no-ops.

Reads the installed vLLM's OpenAI request models (skipped without vLLM), so a field vLLM adds
fails here until specserve decides what it does with it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from specserve.serve.protocol import NEUTRAL, ChatCompletionRequest, CompletionRequest

VLLM_ONLY = {"prompt_embeds"}  # typed fields whose vLLM default specserve takes as-is


def vllm_models():
    completion = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
    chat = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
    return [(completion.CompletionRequest, CompletionRequest), (chat.ChatCompletionRequest, ChatCompletionRequest)]


def test_every_vllm_request_field_is_known():
    for theirs, ours in vllm_models():
        unknown = sorted(set(theirs.model_fields) - set(ours.model_fields))
        assert not unknown, f"{ours.__name__} does not know vLLM's fields {unknown}: implement them or add them to NEUTRAL"


def test_vllm_defaults_are_accepted_as_no_ops():
    base = {"completion": {"prompt": "hello"}, "chat": {"messages": [{"role": "user", "content": "hi"}]}}
    for theirs, ours in vllm_models():
        body = dict(base["chat" if ours is ChatCompletionRequest else "completion"])
        for name, field in theirs.model_fields.items():
            if name in body or field.is_required() or name == "request_id":
                continue
            default = field.get_default(call_default_factory=True)
            if hasattr(default, "model_dump"):
                default = default.model_dump()
            body[name] = default
        req = ours.model_validate(body)  # every default at once
        plain = ours.model_validate(base["chat" if ours is ChatCompletionRequest else "completion"])
        assert req.sampling_params(16) == plain.sampling_params(16)


@pytest.mark.parametrize("name", sorted(NEUTRAL))
def test_a_value_specserve_cannot_honour_is_refused_naming_the_field(name):
    model = ChatCompletionRequest if name in ChatCompletionRequest.model_fields and name not in CompletionRequest.model_fields else CompletionRequest
    body = {"prompt": "x"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ValidationError, match=name):
        model.model_validate({**body, name: 7 if NEUTRAL[name][0][0] not in (7,) else 8})


def test_the_vllm_benchmark_clients_request_is_accepted():
    # what `vllm bench serve --backend openai` sends (vllm/benchmarks/lib/endpoint_request_func.py)
    req = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "repetition_penalty": 1.0, "max_tokens": 8,
                                            "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
                                            "ignore_eos": True})
    assert req.sampling_params(16).repetition_penalty == 1.0


def test_sampling_fields_reach_the_sampling_params():
    req = CompletionRequest.model_validate({"prompt": "hi", "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                                            "min_p": 0.1, "min_tokens": 3, "logit_bias": {"7": 150, "9": -3}, "allowed_token_ids": [1, 2, 7],
                                            "bad_words": ["no"], "include_stop_str_in_output": True, "max_tokens": 8})
    p = req.sampling_params(16)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.min_p, p.min_tokens) == (1.2, 0.5, -0.5, 0.1, 3)
    assert p.logit_bias == ((7, 100.0), (9, -3.0)) and p.allowed_token_ids == (1, 2, 7) and p.bad_words == ("no",)
    assert p.include_stop_str_in_output and p.processes_logits
    for bad in ({"logit_bias": {"x": 1}}, {"repetition_penalty": 0}, {"min_p": 1.5}, {"allowed_token_ids": []}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            CompletionRequest.model_validate({"prompt": "hi", **bad})
    with pytest.raises(ValueError, match="min_tokens"):
        CompletionRequest.model_validate({"prompt": "hi", "min_tokens": 20, "max_tokens": 8}).sampling_params(16)


def test_prompt_truncation_keeps_the_side_asked_for():
    left = CompletionRequest.model_validate({"prompt": "x", "truncate_prompt_tokens": 3})
    right = CompletionRequest.model_validate({"prompt": "x", "truncate_prompt_tokens": 3, "truncation_side": "right"})
    assert left.truncate(list(range(10)), 100) == [7, 8, 9] and right.truncate(list(range(10)), 100) == [0, 1, 2]
    assert CompletionRequest.model_validate({"prompt": "x", "truncate_prompt_tokens": -1}).truncate(list(range(10)), 4) == [6, 7, 8, 9]
