"""n-gram prompt-lookup drafter: no model, proposes what followed the last match.

For each sequence, find the most recent earlier occurrence of its last n tokens (n from
``max_n`` down to ``min_n``) and propose the up-to-k tokens that followed it. Proposals
are deterministic, so the verifier treats them as a point mass (token ids only).
"""

from __future__ import annotations


def ngram_propose(token_ids: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n :]
        # Scan right to left: the most recent match predicts best.
        for start in range(length - n - 1, -1, -1):
            if token_ids[start : start + n] == suffix:
                follow = token_ids[start + n : start + n + k]
                if follow:
                    return list(follow)
    return []
