"""Single-process reference decoding: the oracle every other path is compared against.

Plain torch over transformers models, no KV cache, no batching, no messages: each step
runs the draft and the target on the whole sequence, then the same verifier functions.
Slow and obviously correct. ``num_speculative_tokens=0`` (or no draft) is target-only.
"""

from __future__ import annotations

import torch

from .ngram import ngram_propose
from .sampling import make_generator, processed_probs, sample
from .sampling_params import SamplingParams
from .verifier import verify_greedy, verify_sampled


@torch.no_grad()
def _last_logits(model, token_ids: list[int]) -> torch.Tensor:  # [vocab]
    return model(torch.tensor([token_ids], device=model.device)).logits[0, -1]


@torch.no_grad()
def reference_generate(
    target, prompt_token_ids: list[int], params: SamplingParams, draft=None, num_speculative_tokens: int = 0,
    eos_token_ids: set[int] = frozenset(),
) -> list[int]:
    """Generated token ids (stops: max_tokens, EOS unless ignore_eos, stop_token_ids).

    ``draft`` is a transformers model, ``"ngram"`` or ``None``.
    """
    k = num_speculative_tokens if draft is not None else 0
    g_target = None if params.greedy else make_generator(params.seed, target.device)
    g_draft = None if params.greedy or params.seed is None else make_generator(params.seed + 0x5EED, target.device)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    tokens, out = list(prompt_token_ids), []
    while True:
        room = min(k, params.max_tokens - len(out) - 1)
        drafts, qs = [], []
        if room > 0 and draft == "ngram":
            drafts = ngram_propose(tokens, room)
        elif room > 0:
            ctx = list(tokens)
            for _ in range(room):
                logits = _last_logits(draft, ctx)[: target.config.vocab_size]
                if params.greedy:
                    d = int(logits.argmax())
                else:
                    q = processed_probs(logits[None], params.temperature, params.top_k, params.top_p)[0]
                    d = sample(q, g_draft)
                    qs.append(q)
                drafts.append(d)
                ctx.append(d)
        logits = target(torch.tensor([tokens + drafts], device=target.device)).logits[0, len(tokens) - 1 :]
        if params.greedy:
            verdict = verify_greedy(logits, drafts)
        else:
            probs = processed_probs(logits, params.temperature, params.top_k, params.top_p)
            verdict = verify_sampled(probs, drafts, torch.stack(qs) if qs else None, g_target)
        for t in verdict.token_ids:
            out.append(t)
            tokens.append(t)
            if t in stop_ids or len(out) >= params.max_tokens:
                return out
