"""The draft applies the target's processing (penalties, logit_bias, allowed_token_ids, bad_words,
min_tokens) to its own proposals: a draft with the target's weights then proposes exactly the
target's greedy tokens, so every draft is accepted, drafted on demand or ahead. Without it, the
processing moves the target's argmax away from the draft's and drafts are rejected. Exactness never
rests on it: outputs equal target-only outputs with the same parameters either way."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.draft import DraftSeq
from specserve.logits_processing import SeqProcessor
from specserve.messages import DraftProcessing, OpenSeq, ProtocolError, decode, encode

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], list(range(12, 40)), [20, 21, 22, 20, 21, 22, 20]]
PROCESSING = {
    "repetition": {"repetition_penalty": 1.6},
    "presence_frequency": {"presence_penalty": 1.5, "frequency_penalty": 0.8},
    "logit_bias": {"logit_bias": {7: 4.0, 30: 3.0, 41: -50.0}},
    "allowed": {"allowed_token_ids": [3, 7, 11, 19, 23, 29, 31, 37, 41, 43]},
    "min_tokens": {"min_tokens": 20, "ignore_eos": False},
    "mixed": {"repetition_penalty": 1.3, "presence_penalty": 0.5, "logit_bias": {12: 2.0}},
    # Three boosted tokens taking turns by their counts: each draft depends on the whole path before it (a
    # branch drafted ahead included: its verdict's token and its own drafts).
    "path": {"logit_bias": {7: 8.0, 30: 8.0, 41: 8.0}, "frequency_penalty": 2.0},
}


def _params(name: str) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 24, "ignore_eos": True, **PROCESSING[name]})


@pytest.fixture(scope="module")
def eos_pair(tmp_path_factory):
    """The tiny target with an EOS token (``min_tokens`` masks it), drafting for itself."""
    from ..conftest import make_model

    root = tmp_path_factory.mktemp("eos")
    make_model(root / "target", seed=0, eos_token_id=9)
    return str(root / "target")


@pytest.fixture(scope="module")
def target_only(tiny_pair, eos_pair):
    out = {}
    for name in PROCESSING:
        model = eos_pair if name == "min_tokens" else tiny_pair["target"]
        with LLM(model, draft=None, dtype="float64") as llm:
            out[name] = [o.token_ids for o in llm.generate(PROMPTS, _params(name), use_tqdm=False)]
    return out


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("name", list(PROCESSING))
def test_a_draft_with_the_targets_weights_is_always_accepted(tiny_pair, eos_pair, target_only, name, ahead):
    model = eos_pair if name == "min_tokens" else tiny_pair["target"]
    with LLM(model, draft=model, num_speculative_tokens=4, dtype="float64", adaptive=False, draft_ahead=ahead) as llm:
        outs = llm.generate(PROMPTS, _params(name), use_tqdm=False)
    assert [o.token_ids for o in outs] == target_only[name]
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    assert drafted > 0
    assert sum(o.metrics.num_accepted_tokens for o in outs) == drafted


def test_the_processing_changes_the_targets_greedy_output(tiny_pair, target_only):
    """(What makes the test above able to fail: the processing moves the argmax the draft would pick.)"""
    with LLM(tiny_pair["target"], draft=None, dtype="float64") as llm:
        plain = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                                                   use_tqdm=False)]
    for name in PROCESSING:
        if name != "min_tokens":
            assert target_only[name] != plain, name


def test_processing_crosses_the_wire():
    p = DraftProcessing(3, [5, 9], [1.5, -2.0], [1, 5, 9], [[4, 5], [7]], 2, [0], 0.5, 0.25, 1.2)
    msg = OpenSeq("r", [1, 2, 3, 4], processing=p)
    assert decode(encode(msg)) == msg
    assert decode(encode(OpenSeq("r", [1]))).processing is None


@pytest.mark.parametrize("bad, match", [
    ({"prompt_len": 1, "bias_token_ids": [1, 2], "bias_values": [1.0]}, "bias_values"),
    ({"prompt_len": -1}, "prompt_len"),
    ({"prompt_len": 1, "bad_words": [[1, "x"]]}, "bad_words"),
    ({"prompt_len": 1, "repetition_penalty": 0.0}, "repetition_penalty"),
    ({"prompt_len": 1, "bad_words": [[3], []]}, "empty word"),
    ({"bias_token_ids": []}, "bad DraftProcessing"),
])
def test_malformed_processing_is_a_protocol_error(bad, match):
    import msgpack

    from specserve.messages import PROTOCOL_VERSION

    body = {"request_id": "r", "token_ids": [1, 2], "processing": bad}
    with pytest.raises(ProtocolError, match=match):
        decode(msgpack.packb({"v": PROTOCOL_VERSION, "type": "OpenSeq", "body": body}, use_bin_type=True))


def test_the_draft_processes_as_the_target_does():
    """Row by row, the draft's processor (built from what the target sent) equals the target's own."""
    import torch

    params = SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2,
                            logit_bias={3: 2.0, 8: -1.0}, min_tokens=6)
    prompt, output = [4, 5, 6, 4], [8, 3, 3, 9]
    target = SeqProcessor(params, prompt, 16, {2}, [[3, 9]])
    sent = target.for_draft()
    seq = DraftSeq("r", "r", prompt + output, 0.0, 0, 1.0, 0, processing=sent)
    logits = torch.randn(1, 16, dtype=torch.float64)
    expected = target.apply(logits, prompt + output, [])
    assert torch.equal(seq.processor(16).apply(logits, prompt + output, []), expected)
    assert SeqProcessor(SamplingParams(temperature=0.0, max_tokens=4), prompt, 16, {2}, []).for_draft() is None


def test_the_processing_follows_the_logits_device():
    """Logits on another device than the CPU (a GPU target or draft) are processed there: the processor's
    ids, biases and masks move with them. The meta device stands in for a GPU (it checks devices, not values):
    a processor left on the CPU would fail every request with a bias or penalties at its prefill."""
    import torch

    params = SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4,
                            logit_bias={3: 2.0}, allowed_token_ids=[1, 3, 5], min_tokens=3)
    cpu = SeqProcessor(params, [1, 2, 3], 16, {0}, [[4, 5]]).apply(torch.zeros(3, 16), [1, 2, 3, 5], [3, 5])
    assert cpu[0, 3] > 0 and torch.isinf(cpu[0, 2])  # (the bias and the allowed-token mask applied on the CPU)
    out = SeqProcessor(params, [1, 2, 3], 16, {0}, [[4, 5]]).apply(torch.zeros(3, 16, device="meta"), [1, 2, 3, 5], [3, 5])
    assert out.device.type == "meta" and out.shape == (3, 16)
