"""What specserve changes in vLLM (0.32) where its proposer runs: ``min_p`` and ``logit_bias``
under speculation, and two CPU bugs of the rejection sampler.

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
    try:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.sample import rejection_sampler
        from vllm.v1.sample.logits_processor import builtin
        from vllm.v1.worker import gpu_model_runner
    except ImportError:
        return False
    return (hasattr(SamplingParams, "_validate_spec_decode") and hasattr(gpu_model_runner, "build_logitsprocs")
            and hasattr(rejection_sampler, "apply_sampling_constraints") and hasattr(rejection_sampler, "expand_batch_to_tokens")
            and hasattr(rejection_sampler.RejectionSampler, "apply_logits_processors")
            and hasattr(builtin, "MinPLogitsProcessor") and hasattr(builtin, "LogitBiasLogitsProcessor"))


def allow_in_validation() -> None:
    """vLLM's request validation lets min_p and logit_bias through to engines whose proposer is ours."""
    if "validation" in _applied or not logits_processing_supported():
        return
    _applied.append("validation")
    from vllm.sampling_params import SamplingParams

    original = SamplingParams._validate_spec_decode

    def _validate_spec_decode(self, speculative_config) -> None:
        if not ours(speculative_config):
            original(self, speculative_config)
    SamplingParams._validate_spec_decode = _validate_spec_decode


def _processor(processors, cls):
    return next((p for p in processors if isinstance(p, cls)), None)


def _apply_logits_processing() -> None:
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinPLogitsProcessor
    from vllm.v1.worker import gpu_model_runner

    original_build = gpu_model_runner.build_logitsprocs

    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, *args, **kwargs):
        procs = original_build(vllm_config, device, is_pin_memory, is_pooling_model, *args, **kwargs)
        if is_pooling_model or not ours(vllm_config.speculative_config):
            return procs
        have = {type(p) for p in procs.all}
        extra = [cls(vllm_config, device, is_pin_memory) for cls in (MinPLogitsProcessor, LogitBiasLogitsProcessor) if cls not in have]
        return LogitsProcessors([*procs.all, *extra])

    sampler = rejection_sampler.RejectionSampler
    original_processors = sampler.apply_logits_processors

    def apply_logits_processors(self, logits, sampling_metadata, metadata):
        # [num_draft_tokens, vocab] float32: each request's verified rows get its bias first, as vLLM's sampler
        # adds it before the penalties (the masks after it commute with a finite bias)
        bias = _processor(sampling_metadata.logitsprocs.non_argmax_invariant, LogitBiasLogitsProcessor)
        if bias is not None and bias.biases:
            _add_bias(logits, bias, metadata.num_draft_tokens)
        return original_processors(self, logits, sampling_metadata, metadata)

    original_constraints = rejection_sampler.apply_sampling_constraints

    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        min_p = _processor(sampling_metadata.logitsprocs.argmax_invariant, MinPLogitsProcessor)
        if min_p is not None and min_p.min_p_count and not sampling_metadata.all_greedy:
            _mask_min_p(logits, cu_num_draft_tokens, sampling_metadata, min_p.min_p_cpu[:cu_num_draft_tokens.shape[0]])
        return original_constraints(logits, cu_num_draft_tokens, sampling_metadata)

    gpu_model_runner.build_logitsprocs = build_logitsprocs
    sampler.apply_logits_processors = apply_logits_processors
    rejection_sampler.apply_sampling_constraints = apply_sampling_constraints
    logger.info("specserve: min_p and logit_bias apply under vLLM speculation with specserve's proposer")


def _add_bias(logits, processor, num_draft_tokens: list[int]) -> None:
    """The bias processor's entries (request index, token id, bias: its flat tensors, as vLLM's own ``apply``
    reads them) on every verified row of their request; request i owns rows cu[i] .. cu[i] + n[i] - 1."""
    import torch

    request_index, token_ids = processor.logits_slice  # [num_entries] int32 each
    n = torch.tensor(num_draft_tokens, device=logits.device)  # [batch_size]
    starts = torch.cumsum(n, 0) - n
    counts = n[request_index.long()]  # rows per entry
    entry = torch.repeat_interleave(torch.arange(counts.numel(), device=logits.device), counts)  # [num_rows]
    within = torch.arange(entry.numel(), device=logits.device) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    rows = starts[request_index.long()[entry]] + within
    logits[rows, token_ids.long()[entry]] += processor.bias_tensor[entry]


def _mask_min_p(logits, cu_num_draft_tokens, sampling_metadata, min_p) -> None:
    """vLLM's min-p at draft positions: a token whose probability at the row's temperature is under min_p times
    the row's top one is masked (the same arithmetic as its sampler's, on the rows whose request has a min_p)."""
    import torch
    from vllm.v1.sample import rejection_sampler

    num_tokens = logits.shape[0]
    expand = rejection_sampler.expand_batch_to_tokens
    per_row = expand(torch.from_numpy(min_p).to(logits.device), cu_num_draft_tokens, num_tokens)  # [num_tokens] float32
    rows = per_row.nonzero().squeeze(-1)
    if rows.numel() == 0:
        return
    temperature = expand(sampling_metadata.temperature, cu_num_draft_tokens, num_tokens,
                         replace_from=rejection_sampler.GREEDY_TEMPERATURE, replace_to=1)
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
