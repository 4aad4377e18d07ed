"""What a target accepts from a draft: every block checked against what was asked, before verification.

A block must answer a sequence this target asked that draft about, continue the sequence's
committed length (``base_len``), hold at most the k asked, and propose token ids the target can
emit; probabilities, when sent, must be one row per draft token, finite, non-negative, summing
to one within ``PROB_TOL`` and positive at the drafted token. What fails is repaired, never
passed on: a block for another sequence or length is dropped; a block is cut at k and at its
first token id outside the target's vocabulary; a block with any bad probability row keeps its
tokens but loses all its probabilities and is verified as point masses. Point-mass verification
keeps the target's distribution exactly for any proposed tokens (the token is kept with
probability p(x), else the target samples p without x), so each repair is lossless whatever the
draft sent; only speed is lost. Knows nothing of transports or models.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .messages import DraftBlock

PROB_TOL = 1e-3  # |sum(q) - 1| allowed per row (float32 softmax over 150k tokens stays well inside)


def _is_token(t, vocab_size: int) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size


def probs_problem(probs, token_ids: list[int]) -> str | None:
    """Why these rows are not q distributions of these draft tokens (None: they are)."""
    if isinstance(probs, np.ndarray):
        finite = bool(np.isfinite(probs).all())
    else:  # a torch tensor from a tensor link
        import torch

        finite = bool(torch.isfinite(probs).all())
    if probs.ndim != 2 or probs.shape[0] != len(token_ids) or probs.shape[1] == 0:
        return f"probabilities of shape {tuple(probs.shape)} for {len(token_ids)} draft tokens"
    if not finite:
        return "probabilities that are not finite"
    if bool((probs < 0).any()):
        return "negative probabilities"
    sums = probs.sum(-1)
    worst = float(abs(sums - 1).max())
    if worst > PROB_TOL:
        return f"probability rows that do not sum to one (off by {worst:.3g})"
    if max(token_ids) >= probs.shape[1]:
        return f"a draft token (id {max(token_ids)}) outside its probability rows ({probs.shape[1]} wide)"
    if bool((probs[list(range(len(token_ids))), token_ids] <= 0).any()):
        return "zero probability at a drafted token"
    return None


def check_block(block: DraftBlock, num_asked: int, base_len: int | None, vocab_size: int) -> tuple[DraftBlock | None, str | None]:
    """(the block to verify, or None; why it was repaired, or None when it was fine)."""
    if base_len is None or block.base_len != base_len:
        return None, f"a block continuing {block.base_len} tokens of a sequence that has {base_len}"
    tokens, probs, why = list(block.draft_token_ids), block.draft_probs, None
    bad = next((i for i, t in enumerate(tokens) if not _is_token(t, vocab_size)), None)
    if bad is not None:  # a cut that depends on what was drafted: verify what is left as point masses
        why = f"token id {tokens[bad]!r} outside the target's vocabulary [0, {vocab_size})"
        tokens, probs = tokens[:bad], None
    if len(tokens) > num_asked:  # a cut at a fixed length: probabilities stay valid
        why = why or f"{len(block.draft_token_ids)} draft tokens where {num_asked} were asked"
        tokens = tokens[:num_asked]
    if probs is not None and tokens:
        problem = probs_problem(probs, list(block.draft_token_ids))  # the rows as sent, for the tokens as sent
        if problem:
            why, probs = why or problem, None
        elif len(tokens) < probs.shape[0]:
            probs = probs[: len(tokens)]
    if why is None:
        return block, None
    return dataclasses.replace(block, draft_token_ids=tokens, draft_probs=probs if tokens else None,
                               num_cached=min(block.num_cached, len(tokens))), why
