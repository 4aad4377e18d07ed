"""Turn logits into the distribution plain decoding samples from (temperature, top-k, top-p).

The verifier, target-only decoding and the draft share these functions, so every path
shapes a distribution identically. Batched with per-row parameters; torch only.
"""

from __future__ import annotations

import torch


def _column(value, n: int, dtype, device) -> torch.Tensor:  # [n, 1]
    return torch.as_tensor(value, dtype=dtype, device=device).reshape(-1, 1).expand(n, 1)


def processed_probs(
    logits: torch.Tensor,  # [n, vocab] float
    temperature,  # float or [n], every value > 0
    top_k,  # int or [n]; 0 (or >= vocab) disables
    top_p,  # float or [n] in (0, 1]
    min_p=0.0,  # float or [n] in [0, 1]; 0 disables
) -> torch.Tensor:  # [n, vocab] float32 (float64 for float64 logits), rows sum to 1
    """Probabilities after temperature, then min-p, then top-k, then top-p (vLLM's order: min-p
    drops tokens less likely than ``min_p`` x the most likely one).

    Top-p always keeps the most likely token (vLLM's rule), so no row can end up empty
    however small ``top_p`` is; subtracting the row maximum first keeps tiny temperatures
    from overflowing.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    n, vocab = logits.shape
    x = logits.to(dtype)
    temperature = _column(temperature, n, dtype, x.device)
    assert bool((temperature > 0).all()), "greedy rows take argmax, not probabilities"
    x = (x - x.max(dim=-1, keepdim=True).values) / temperature
    min_p = _column(min_p, n, dtype, x.device)
    if bool((min_p > 0).any()):  # exp(x) is the probability relative to the most likely token's
        x = x.masked_fill(torch.exp(x) < min_p, float("-inf"))
    top_k = _column(top_k, n, torch.long, x.device)
    top_p = _column(top_p, n, dtype, x.device)
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1.0
    if not bool(use_k.any()) and not bool(use_p.any()):  # .any(): skip the sort when no row needs it
        return torch.softmax(x, dim=-1)
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    kth = sorted_x.gather(1, torch.where(use_k, top_k - 1, vocab - 1))
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))  # ties with the k-th are kept
    sorted_probs = torch.softmax(sorted_x, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass strictly
    # before it reaches top_p; the first (most likely) token always stays.
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop = (mass_before >= top_p) & use_p
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.empty_like(sorted_probs).scatter_(1, order, sorted_probs)


def sample_with_uniforms(
    probs: torch.Tensor,  # [n, vocab], rows sum to 1 (up to rounding)
    u,  # [n] uniforms in [0, 1) (numpy or torch)
) -> torch.Tensor:  # [n] long
    """Inverse-CDF sampling: token i with probability probs[i], decided by one uniform per row.

    A zero-probability token is never returned (the first index whose cumulative mass
    exceeds u * total always carries mass).
    """
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    u = torch.as_tensor(u, dtype=torch.float64, device=probs.device).reshape(-1, 1)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return idx.clamp_max(probs.shape[-1] - 1).reshape(-1)
