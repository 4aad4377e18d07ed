"""What specserve changes in vLLM (0.32) where its proposer runs: ``min_p`` and ``logit_bias``
under speculation, and two CPU bugs of the rejection sampler (each piece of vLLM reached through ``seam``).

**min_p and logit_bias.** vLLM builds neither processor once speculation is configured, and
refuses both at validation. For an engine whose proposer is specserve's (``ours``), the
target's model runner gets them back (``build_logitsprocs``): they apply to every plain step
and every bonus token as without speculation. At draft positions the rejection sampler gets
them as well, in the order vLLM's sampler applies them: the bias per verified row before the
penalties (``RejectionSampler.apply_logits_processors``), min-p on the temperature-scaled
probabilities before top-k / top-p (``apply_sampling_constraints``). Greedy output then
equals vLLM target-only's with the same parameters, and sampling follows the processed
target distribution. ``allow_in_validation`` lifts vLLM's refusal for such engines (the
process that takes requests); the others run on any platform where the proposer samples.

**CPU bugs.** Applied on the CPU platform only, to ``vllm.v1.sample.rejection_sampler``:

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

from . import seam

logger = logging.getLogger("specserve.vllm")
_applied: list[str] = []  # what this process has patched


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):
    """[batch_size] -> [num_tokens]: ``x[i]`` repeated for request i's tokens, ``replace_from`` -> ``replace_to``."""
    import torch

    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(values, counts.long(), output_size=num_tokens)


def ours(speculative_config) -> bool:
    """Whether an engine's speculation is specserve's proposer."""
    from .target import PROPOSER

    return (speculative_config is not None and getattr(speculative_config, "method", None) == "custom_class"
            and getattr(speculative_config, "model", None) == PROPOSER)


def logits_processing_supported() -> bool:
    """Whether this vLLM has what ``_apply_logits_processing`` patches (else min_p and logit_bias stay refused)."""
    return seam.present("validate_spec_decode", "build_logitsprocs", "apply_sampling_constraints", "expand_batch_to_tokens",
                        "apply_logits_processors", "min_p_processor", "logit_bias_processor")


def allow_in_validation() -> None:
    """vLLM's request validation lets min_p and logit_bias through to engines whose proposer is ours."""
    if "validation" in _applied or not logits_processing_supported():
        return
    _applied.append("validation")

    @seam.patch("validate_spec_decode")
    def _validate_spec_decode(original, self, speculative_config) -> None:
        if not ours(speculative_config):
            original(self, speculative_config)


def _apply_logits_processing() -> None:
    @seam.patch("build_logitsprocs")
    def build_logitsprocs(original, vllm_config, device, is_pin_memory, is_pooling_model, *args, **kwargs):
        procs = original(vllm_config, device, is_pin_memory, is_pooling_model, *args, **kwargs)
        if is_pooling_model or not ours(vllm_config.speculative_config):
            return procs
        return seam.with_min_p_and_bias(procs, vllm_config, device, is_pin_memory)

    @seam.patch("apply_logits_processors")
    def apply_logits_processors(original, self, logits, sampling_metadata, metadata):
        # [num_draft_tokens, vocab] float32: each request's verified rows get its bias first, as vLLM's sampler
        # adds it before the penalties (the masks after it commute with a finite bias)
        bias = seam.logit_bias(sampling_metadata, metadata)
        if bias is not None:
            _add_bias(logits, *bias)
        return original(self, logits, sampling_metadata, metadata)

    @seam.patch("apply_sampling_constraints")
    def apply_sampling_constraints(original, logits, cu_num_draft_tokens, sampling_metadata):
        min_p = seam.min_p(sampling_metadata, cu_num_draft_tokens.shape[0])
        if min_p is not None:
            _mask_min_p(logits, cu_num_draft_tokens, sampling_metadata, min_p)
        return original(logits, cu_num_draft_tokens, sampling_metadata)

    logger.info("specserve: min_p and logit_bias apply under vLLM speculation with specserve's proposer")


def _add_bias(logits, processor, num_draft_tokens: list[int]) -> None:
    """The bias processor's entries (request index, token id, bias: its flat tensors, as vLLM's own ``apply``
    reads them) on every verified row of their request; request i owns rows cu[i] .. cu[i] + n[i] - 1."""
    import torch

    request_index, token_ids, bias = seam.bias_entries(processor)  # [num_entries] each
    n = torch.tensor(num_draft_tokens, device=logits.device)  # [batch_size]
    starts = torch.cumsum(n, 0) - n
    counts = n[request_index.long()]  # rows per entry
    entry = torch.repeat_interleave(torch.arange(counts.numel(), device=logits.device), counts)  # [num_rows]
    within = torch.arange(entry.numel(), device=logits.device) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    rows = starts[request_index.long()[entry]] + within
    logits[rows, token_ids.long()[entry]] += bias[entry]


def _mask_min_p(logits, cu_num_draft_tokens, sampling_metadata, min_p) -> None:
    """vLLM's min-p at draft positions: a token whose probability at the row's temperature is under min_p times
    the row's top one is masked (the same arithmetic as its sampler's, on the rows whose request has a min_p)."""
    import torch

    num_tokens = logits.shape[0]
    per_row = seam.expand_to_tokens(torch.from_numpy(min_p).to(logits.device), cu_num_draft_tokens, num_tokens)  # [num_tokens] float32
    rows = per_row.nonzero().squeeze(-1)
    if rows.numel() == 0:
        return
    temperature = seam.draft_temperatures(sampling_metadata, cu_num_draft_tokens, num_tokens)
    selected = logits[rows]  # [num_rows, vocab] (a copy: written back below)
    probs = torch.softmax(selected / temperature[rows].unsqueeze(-1), dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True).mul_(per_row[rows].unsqueeze(-1))
    logits[rows] = selected.masked_fill_(probs < threshold, float("-inf"))


def apply_all() -> None:
    """The proposer's process (where vLLM samples): min_p and logit_bias, and on CPU the bug fixes."""
    if "sampler" in _applied:
        return
    _applied.append("sampler")
    if logits_processing_supported():
        _apply_logits_processing()
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu() or not seam.present("expand_batch_to_tokens", "apply_top_k_top_p"):
            return
    except ImportError:  # another vLLM layout: nothing known to patch
        return

    seam.replace("expand_batch_to_tokens", expand_batch_to_tokens)

    @seam.patch("apply_top_k_top_p")
    def apply_top_k_top_p(original, logits, k, p, *args, **kwargs):
        if logits.shape[0] == 0:
            return logits
        return original(logits, k, p, *args, **kwargs)

    logger.info("specserve: patched vLLM's CPU rejection sampler (per-token sampling parameters, empty batches)")
