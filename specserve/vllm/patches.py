"""Workarounds for vLLM bugs that sampled speculative decoding on vLLM's CPU build hits.

Applied once per process, by the proposer (it runs where vLLM samples), on the CPU platform
only, and only to vLLM's rejection sampler (``vllm.v1.sample.rejection_sampler``, 0.32):

- ``expand_batch_to_tokens`` repeats each request's temperature / top-k / top-p once per
  draft token. The CPU kernel behind it converts the output tensor to int64 and writes into
  that copy, so float32 temperatures and top-p and int32 top-k come back uninitialised: the
  target distribution used to verify sampled requests is wrong (not lossless) or the step
  fails. Replaced by the same computation in plain torch.
- ``apply_top_k_top_p`` on a batch without draft tokens (every prefill step) calls
  ``k.max()`` on an empty tensor and fails the step (reproduced with vLLM's own ngram method
  and ``top_k=50``). An empty tensor needs no masking: it is returned unchanged.

Greedy requests never reach either function. ``tests/vllm`` checks the result is lossless.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("specserve.vllm")
_applied: list[bool] = []


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):
    """[batch_size] -> [num_tokens]: ``x[i]`` repeated for request i's tokens, ``replace_from`` -> ``replace_to``."""
    import torch

    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(values, counts.long(), output_size=num_tokens)


def apply_all() -> None:
    if _applied:
        return
    _applied.append(True)
    try:
        from vllm.platforms import current_platform
        from vllm.v1.sample import rejection_sampler
    except ImportError:  # another vLLM layout: nothing known to patch
        return
    if not current_platform.is_cpu() or not hasattr(rejection_sampler, "expand_batch_to_tokens"):
        return
    original_top_k_top_p = rejection_sampler.apply_top_k_top_p

    def apply_top_k_top_p(logits, k, p, *args, **kwargs):
        if logits.shape[0] == 0:
            return logits
        return original_top_k_top_p(logits, k, p, *args, **kwargs)

    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    rejection_sampler.apply_top_k_top_p = apply_top_k_top_p
    logger.info("specserve: patched vLLM's CPU rejection sampler (per-token sampling parameters, empty batches)")
