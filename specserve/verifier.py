"""Verify a block of draft tokens against the target: the lossless core of specserve.

Vocabulary (Leviathan et al., arXiv 2211.17192; Chen et al., arXiv 2302.01318), used
verbatim in messages, metrics and logs:

- *draft tokens*: the ``k`` tokens d_1..d_k the draft proposes after a committed prefix.
- *accepted*: the leading draft tokens the target keeps. Greedy: while d_i equals the
  target's argmax. Sampled: each d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)).
- *recovered*: on the first rejection, a token drawn from norm(max(0, p_i - q_i)) (greedy:
  the target's argmax), which replaces the rejected draft token.
- *bonus*: when every draft token is accepted, one more token drawn from p_{k+1}.

Every verification therefore appends ``num_accepted + 1`` tokens. ``p`` is the target's
distribution after temperature/top-k/top-p (``sampling.processed_probs``), exactly what
plain decoding samples from, so the output distribution equals the target's. A draft that
sends no probabilities is treated as a point mass at its token (q_i(d_i) = 1), which is
lossless only if the draft chose that token deterministically (greedy or n-gram).

Pure torch; knows nothing of models, caches or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample


@dataclass(frozen=True)
class Verdict:
    num_accepted: int
    token_ids: list[int]  # accepted draft tokens + one recovered or bonus token


def verify_greedy(
    target_logits: torch.Tensor,  # [k + 1, vocab]
    draft_token_ids: list[int],  # [k]
) -> Verdict:
    k = len(draft_token_ids)
    assert target_logits.shape[0] == k + 1
    # .tolist(): acceptance is decided on the host, one sync per sequence.
    target_token_ids = target_logits.argmax(dim=-1).tolist()
    num_accepted = 0
    while num_accepted < k and draft_token_ids[num_accepted] == target_token_ids[num_accepted]:
        num_accepted += 1
    return Verdict(num_accepted, list(draft_token_ids[:num_accepted]) + [target_token_ids[num_accepted]])


def verify_sampled(
    target_probs: torch.Tensor,  # [k + 1, vocab], rows sum to 1
    draft_token_ids: list[int],  # [k]
    draft_probs: torch.Tensor | None,  # [k, vocab] or None (point mass at each draft token)
    generator: torch.Generator | None,
) -> Verdict:
    k = len(draft_token_ids)
    assert target_probs.shape[0] == k + 1
    if k == 0:
        return Verdict(0, [sample(target_probs[0], generator)])
    device = target_probs.device
    draft_ids = torch.tensor(draft_token_ids, device=device)
    rows = torch.arange(k, device=device)
    p_draft = target_probs[rows, draft_ids]  # [k]
    q_draft = draft_probs[rows, draft_ids].to(p_draft.dtype) if draft_probs is not None else torch.ones_like(p_draft)
    uniforms = torch.rand(k, generator=generator, device=device, dtype=p_draft.dtype)
    # u < p/q  <=>  u * q < p, which also handles q == 0 (never proposed) without dividing.
    accepted = uniforms * q_draft < p_draft
    # .tolist(): the first rejection decides how many tokens are appended.
    accepted_list = accepted.tolist()
    num_accepted = accepted_list.index(False) if False in accepted_list else k
    if num_accepted == k:
        last = sample(target_probs[k], generator)  # bonus
    else:
        p = target_probs[num_accepted]
        if draft_probs is not None:
            residual = (p - draft_probs[num_accepted].to(p.dtype)).clamp_min(0)
        else:
            residual = p.clone()
            residual[draft_token_ids[num_accepted]] = 0
        total = residual.sum()
        # A rejection has probability 0 when the residual is empty, so any choice is lossless;
        # fall back to p to stay well defined under rounding.
        last = sample(residual / total if total > 0 else p, generator)  # recovered
    return Verdict(num_accepted, list(draft_token_ids[:num_accepted]) + [last])
