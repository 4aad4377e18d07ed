"""Verify blocks of draft tokens against the target, all sequences at once: the lossless core.

Vocabulary (Leviathan et al., arXiv 2211.17192; Chen et al., arXiv 2302.01318), used
verbatim in messages, metrics and logs:

- *draft tokens*: the ``k`` tokens d_1..d_k the draft proposes after a committed prefix.
- *accepted*: the leading draft tokens the target keeps. Greedy: while d_i equals the
  target's argmax. Sampled: each d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)).
- *recovered*: on the first rejection, a token drawn from norm(max(0, p_i - q_i)) (greedy:
  the target's argmax), which replaces the rejected draft token.
- *bonus*: when every draft token is accepted, one more token drawn from p_{k+1}.

Every verification appends ``num_accepted + 1`` tokens. ``p`` is the target's distribution
after its logits processing (penalties, logit_bias ...: ``logits_processing``, applied by the
caller, row j with the drafts before it) and temperature/min-p/top-k/top-p
(``sampling.processed_probs``), exactly what plain decoding samples from. A draft that sends no probabilities is a point mass at its token
(q_i(d_i) = 1), lossless when the draft chose that token deterministically (greedy, n-gram).
Uniforms are keyed by (seed, token position) (``rng``): the acceptance test of the token at
position P draws ``TARGET_ACCEPT`` at P, the recovered/bonus token at P draws
``TARGET_SAMPLE`` at P, and target-only decoding is the ``k = 0`` case of the same rule.

Pure torch + numpy; knows nothing of models, caches or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .rng import TARGET_ACCEPT, TARGET_SAMPLE, uniforms
from .sampling import processed_probs, sample_with_uniforms


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of one verification (row order = the logits' rows)."""

    temperature: list[float]  # [batch_size]; 0.0 means greedy
    top_k: list[int]  # [batch_size]
    top_p: list[float]  # [batch_size]
    seeds: list[int]  # [batch_size] in [0, rng.MAX_SEED]
    positions: list[int]  # [batch_size]: position of the first token this verification decides
    min_p: list[float] | None = None  # [batch_size]; None: 0 everywhere

    @property
    def greedy(self) -> list[bool]:
        return [t == 0.0 for t in self.temperature]


def verify(
    target_logits: torch.Tensor,  # [batch_size, k + 1, vocab]: row i's logits after [last, d_1..d_k]
    draft_token_ids: torch.Tensor,  # [batch_size, k] long; entries past num_draft_tokens[i] are ignored
    num_draft_tokens: torch.Tensor,  # [batch_size] long, each in [0, k]
    sampling: SamplingBatch,
    draft_probs: torch.Tensor | None = None,  # [batch_size, k, vocab] q rows, or None
    has_draft_probs: torch.Tensor | None = None,  # [batch_size] bool: rows whose q is given (else point mass)
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [batch_size] long, next_token_ids [batch_size] long
    """Accepted counts and the recovered/bonus token of every row (one batched pass)."""
    batch_size, width, vocab = target_logits.shape
    k = width - 1
    assert draft_token_ids.shape == (batch_size, k) and num_draft_tokens.shape == (batch_size,)
    device = target_logits.device
    positions = torch.arange(k, device=device)
    valid = positions[None, :] < num_draft_tokens[:, None]  # [batch_size, k]
    num_accepted = torch.zeros(batch_size, dtype=torch.long, device=device)
    next_token_ids = torch.zeros(batch_size, dtype=torch.long, device=device)

    if all(sampling.greedy):  # the common case: one argmax over everything, no row selection
        argmax = target_logits.argmax(dim=-1)  # [batch_size, k + 1]
        match = (draft_token_ids == argmax[:, :k]) & valid
        num_accepted = match.long().cumprod(dim=1).sum(dim=1)
        return num_accepted, argmax.gather(1, num_accepted[:, None]).squeeze(1)
    greedy = torch.tensor(sampling.greedy, device=device)
    if bool(greedy.any()):  # .any(): pick the code paths on the host
        rows = greedy.nonzero().squeeze(1)
        argmax = target_logits[rows].argmax(dim=-1)  # [rows, k + 1]
        match = (draft_token_ids[rows] == argmax[:, :k]) & valid[rows]
        acc = match.long().cumprod(dim=1).sum(dim=1)
        num_accepted[rows] = acc
        next_token_ids[rows] = argmax.gather(1, acc[:, None]).squeeze(1)
    if not bool(greedy.all()):
        rows = (~greedy).nonzero().squeeze(1)
        acc, nxt = _verify_sampled(target_logits, draft_token_ids, valid, sampling, rows, draft_probs, has_draft_probs)
        num_accepted[rows] = acc
        next_token_ids[rows] = nxt
    return num_accepted, next_token_ids


def _verify_sampled(target_logits, draft_token_ids, valid, sampling, rows, draft_probs, has_draft_probs):
    n = rows.numel()
    width, vocab = target_logits.shape[1], target_logits.shape[2]
    k = width - 1
    device = target_logits.device
    # .tolist(): per-row parameters and seeds live on the host.
    idx = rows.tolist()
    pick = lambda values: [values[i] for i in idx]  # noqa: E731
    temperature, top_k, top_p = pick(sampling.temperature), pick(sampling.top_k), pick(sampling.top_p)
    probs = processed_probs(
        target_logits[rows].reshape(n * width, vocab),
        torch.tensor(temperature).repeat_interleave(width),
        torch.tensor(top_k).repeat_interleave(width),
        torch.tensor(top_p).repeat_interleave(width),
        torch.tensor(pick(sampling.min_p) if sampling.min_p is not None else [0.0] * n).repeat_interleave(width),
    ).reshape(n, width, vocab)
    raw = draft_token_ids[rows]
    in_vocab = (raw >= 0) & (raw < vocab)  # a draft id past the target's vocabulary is always rejected
    drafts = raw.clamp(0, vocab - 1)  # [n, k]
    seeds = np.asarray(pick(sampling.seeds), dtype=np.uint64)
    base = np.asarray(pick(sampling.positions), dtype=np.int64)[:, None]
    if k > 0:
        p_draft = probs[:, :k].gather(2, drafts[..., None]).squeeze(2) * in_vocab  # [n, k]
        q_draft = torch.ones_like(p_draft)
        q_rows = None
        if draft_probs is not None:
            with_q = has_draft_probs[rows]
            q_rows = draft_probs[rows].to(probs.dtype)  # [n, k, vocab]
            q_draft = torch.where(with_q[:, None], q_rows.gather(2, drafts[..., None]).squeeze(2), q_draft)
        u = torch.as_tensor(uniforms(seeds, TARGET_ACCEPT, base + np.arange(k)), dtype=probs.dtype, device=device)
        # u < p/q  <=>  u * q < p, which also handles q == 0 (never proposed) without dividing.
        accepted = (u * q_draft < p_draft) & valid[rows]
        acc = accepted.long().cumprod(dim=1).sum(dim=1)
    else:
        acc = torch.zeros(n, dtype=torch.long, device=device)
    p = probs.gather(1, acc[:, None, None].expand(n, 1, vocab)).squeeze(1)  # [n, vocab]
    residual = p
    rejected = acc < valid[rows].sum(dim=1)
    if k > 0 and bool(rejected.any()):
        at = acc.clamp_max(k - 1)
        rejected_token = drafts.gather(1, at[:, None]).squeeze(1)
        # Point-mass draft: p without the rejected token (nothing to remove for an out-of-vocabulary id).
        point = p.scatter(1, rejected_token[:, None], 0.0)
        point = torch.where(in_vocab.gather(1, at[:, None]), point, p)
        residual = torch.where(rejected[:, None], point, p)
        if q_rows is not None:
            q_at = q_rows.gather(1, at[:, None, None].expand(n, 1, vocab)).squeeze(1)
            with_q = (has_draft_probs[rows] & rejected)[:, None]
            residual = torch.where(with_q, (p - q_at).clamp_min(0.0), residual)
        # A rejection has probability 0 when the residual is empty, so any choice is lossless;
        # fall back to p to stay well defined under rounding.
        empty = residual.sum(dim=1, keepdim=True) <= 0
        residual = torch.where(empty, p, residual)
    u_next = uniforms(seeds, TARGET_SAMPLE, base[:, 0] + acc.cpu().numpy())
    return acc, sample_with_uniforms(residual, u_next)


def sample_next(
    logits: torch.Tensor,  # [batch_size, vocab]
    sampling: SamplingBatch,
) -> torch.Tensor:  # [batch_size] long
    """Plain decoding of one token per row (the ``k = 0`` case of ``verify``)."""
    empty = torch.zeros(logits.shape[0], 0, dtype=torch.long, device=logits.device)
    zeros = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    return verify(logits[:, None], empty, zeros, sampling)[1]
