"""``specserve.vllm.patches._add_bias``: vLLM's flat logit-bias entries land on every verified row of their
own request, and nowhere else (requests with no drafts own no rows). Plain torch: no vLLM needed."""

from __future__ import annotations

import types

import torch

from specserve.vllm.patches import _add_bias


def test_each_request_s_bias_reaches_exactly_its_own_verified_rows():
    biases = {0: {3: 1.0, 5: -2.0}, 2: {1: 0.5}, 3: {7: 4.0, 0: -1.5}, 5: {2: 3.0}}  # request index -> {token: bias}
    num_draft_tokens = [2, 3, 0, 1, 4, 2]  # request 2 drafted nothing this step: its bias has no row here
    entries = [(r, t, v) for r, b in biases.items() for t, v in b.items()]
    processor = types.SimpleNamespace(  # the two flat tensors vLLM's LogitBiasLogitsProcessor keeps
        logits_slice=(torch.tensor([e[0] for e in entries], dtype=torch.int32), torch.tensor([e[1] for e in entries], dtype=torch.int32)),
        bias_tensor=torch.tensor([e[2] for e in entries]))
    logits = torch.randn(sum(num_draft_tokens), 8)
    expected = logits.clone()
    start = 0
    for r, n in enumerate(num_draft_tokens):
        for row in range(start, start + n):
            for t, v in biases.get(r, {}).items():
                expected[row, t] += v
        start += n
    _add_bias(logits, processor, num_draft_tokens)
    assert torch.equal(logits, expected)
