"""Single-process reference decoding: the oracle every other path is compared against.

Plain torch over transformers models, no KV cache, no batching, no messages: each step
runs the draft and the target on the whole sequence, then the same verifier. Draws are
keyed by (seed, token position) exactly as in the engine, so for a given seed the engine's
output must equal this one token for token, greedy or sampled, whatever the batch, the
speculation cache or the channel. Slow and obviously correct. ``num_speculative_tokens=0``
(or no draft) is target-only decoding.
"""

from __future__ import annotations

import torch

from .ngram import ngram_propose
from .rng import DRAFT_SAMPLE, uniforms
from .sampling import processed_probs, sample_with_uniforms
from .sampling_params import SamplingParams
from .verifier import SamplingBatch, verify


@torch.no_grad()
def _logits(model, token_ids: list[int]) -> torch.Tensor:  # [len(token_ids), vocab]
    return model(torch.tensor([token_ids], device=model.device)).logits[0]


@torch.no_grad()
def reference_generate(
    target, prompt_token_ids: list[int], params: SamplingParams, draft=None, num_speculative_tokens: int = 0,
    eos_token_ids: set[int] = frozenset(), draft_probs: bool = True,
) -> list[int]:
    """Generated token ids (stops: max_tokens, EOS unless ignore_eos, stop_token_ids).

    ``draft`` is a transformers model, ``"ngram"`` or ``None``; ``params.seed`` must be set
    for sampled requests (the engine draws one when a request has none).
    """
    k = num_speculative_tokens if draft is not None else 0
    assert params.greedy or params.seed is not None, "sampled reference runs need a seed"
    seed = params.seed or 0
    sampled_draft = not params.greedy and draft_probs
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    tokens, out = list(prompt_token_ids), []
    while True:
        room = min(k, params.max_tokens - len(out) - 1)
        drafts, qs = [], []
        if room > 0 and draft == "ngram":
            drafts = ngram_propose(tokens, room)
        elif room > 0:
            for _ in range(room):
                logits = _logits(draft, tokens + drafts)[-1:]
                if not sampled_draft:
                    d = int(logits[0].argmax())
                else:
                    q = processed_probs(logits, params.temperature, params.top_k, params.top_p)
                    u = uniforms([seed], DRAFT_SAMPLE, [len(tokens) + len(drafts)])
                    d = int(sample_with_uniforms(q, u)[0])
                    qs.append(q[0])
                drafts.append(d)
        logits = _logits(target, tokens + drafts)[len(tokens) - 1 :]
        vocab, device = logits.shape[-1], logits.device
        probs = None
        if qs:
            probs = torch.zeros(1, len(drafts), vocab, dtype=logits.dtype, device=device)
            for i, q in enumerate(qs):
                probs[0, i, : min(vocab, q.shape[0])] = q[:vocab]
        sampling = SamplingBatch([params.temperature], [params.top_k], [params.top_p], [seed], [len(tokens)])
        num_accepted, nxt = verify(
            logits[None], torch.tensor([drafts], dtype=torch.long, device=device).reshape(1, len(drafts)),
            torch.tensor([len(drafts)], device=device), sampling, probs,
            torch.tensor([True], device=device) if probs is not None else None,
        )
        for t in drafts[: int(num_accepted)] + [int(nxt)]:
            out.append(t)
            tokens.append(t)
            if t in stop_ids or len(out) >= params.max_tokens:
                return out
