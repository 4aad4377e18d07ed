"""Turn logits into the distribution plain decoding samples from (temperature, top-k, top-p).

The verifier and target-only decoding share these functions, so speculative and plain
decoding shape the target distribution identically. Torch only; knows nothing of models.
"""

from __future__ import annotations

import torch


def processed_probs(
    logits: torch.Tensor,  # [n, vocab] float
    temperature: float,
    top_k: int,
    top_p: float,
) -> torch.Tensor:  # [n, vocab] float32 (float64 if logits are float64), rows sum to 1
    """Probabilities after temperature, then top-k, then top-p (vLLM's order).

    ``temperature`` must be > 0 (greedy requests never need probabilities).
    """
    assert temperature > 0, "greedy rows take argmax, not probabilities"
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(dtype) / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
        # strictly before it already reaches top_p.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from a 1-D distribution."""
    # .item(): the sampled id decides the next step on the host.
    return int(torch.multinomial(probs, 1, generator=generator).item())


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
