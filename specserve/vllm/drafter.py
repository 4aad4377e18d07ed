"""A draft side on a vLLM engine: k greedy draft tokens per sequence per request.

``VLLMDrafter`` implements the ``Drafter`` protocol (``specserve.draft``) rather than the
per-sequence KV ``ModelBackend``: vLLM owns its paged KV cache and exposes no "truncate
this sequence to n tokens". Each ``propose`` submits every wanted sequence's committed
tokens as a prompt (``max_tokens=k``, greedy) in one batch; vLLM's prefix cache holds the KV
of every full block it computed before (the committed tokens and the drafts that were
accepted), so rollback is free and catch-up recomputes only the last partial block plus the
k decode steps (``counters`` measure it). Drafts are point masses for every request, greedy
or sampled: lossless, and no probabilities cross the wire. ``open``/``close``/``rollback``/
``prepare`` have nothing to do (no speculation cache). Knows nothing of transports.
"""

from __future__ import annotations

import logging
import time

from ..draft import DraftSeq, Proposal
from ..models import load_tokenizer, vocab_fingerprint
from . import seam
from .options import engine_kwargs, is_cpu_platform, prepare_env, require_vllm, sync_omp_threads

logger = logging.getLogger("specserve.vllm")
CPU_BLOCK_SIZE = 32  # the smallest block vLLM's CPU attention takes; its default (128) would recompute up to 127 tokens


class VLLMDraftEngine:
    """A ``vllm.LLM`` for drafting, with what the draft service reads of a backend (vocabulary, context)."""

    def __init__(self, side):
        require_vllm()
        from vllm import LLM

        prepare_env(side)
        self.tokenizer = load_tokenizer(side.model, side.trust_remote_code)
        extra = {"enable_prefix_caching": True}
        if is_cpu_platform():
            extra["block_size"] = CPU_BLOCK_SIZE
        self.llm = LLM(**engine_kwargs(side, None, self.tokenizer is not None, **extra))
        config = seam.engine_config(self.llm)
        self.max_model_len = config.model_config.max_model_len
        self.vocab_size = config.model_config.get_vocab_size()
        self.block_size = config.cache_config.block_size
        self.generate_greedy([[0] * 8] * 2, [2, 2])  # warm up: the first steps are slow, and targets time drafts out

    def vocab_fingerprint(self) -> dict:
        return vocab_fingerprint(self.tokenizer, self.vocab_size)

    def generate_greedy(self, prompts: list[list[int]], ks: list[int]):
        """One batch: ``ks[i]`` greedy tokens after each prompt; vLLM ``RequestOutput`` per prompt, in order."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sync_omp_threads()
        params = [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True, detokenize=False) for k in ks]
        return self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


class VLLMDrafter:
    fanout = 0  # no speculation cache: nothing to prepare between requests

    def __init__(self, engine: VLLMDraftEngine):
        self.backend = engine
        self.num_forwards = 0  # engine steps of the last propose (critical path)
        self.forward_s = 0.0  # and their time
        self.step_time_s = 0.0  # running estimate of one engine step
        self.counters = {"num_proposals": 0, "num_context_tokens": 0, "num_recomputed_tokens": 0, "num_draft_tokens": 0}

    def step_time(self, batch_size: int) -> float:
        """One engine step (vLLM batches all sequences in one step; one estimate for every size)."""
        return self.step_time_s

    @classmethod
    def from_config(cls, cfg) -> "VLLMDrafter":
        return cls(VLLMDraftEngine(cfg.draft))

    def open(self, seq: DraftSeq) -> None:
        pass

    def close(self, seq: DraftSeq) -> None:
        pass  # vLLM's prefix cache evicts unused blocks itself

    def rollback(self, seq: DraftSeq, num_tokens: int) -> None:
        pass  # the next prompt is the committed tokens: stale drafts are never reused

    def prepare(self, seqs, should_stop, budget_s: float = 0.0) -> None:
        pass

    def propose(self, seqs: list[DraftSeq], ks: list[int], draft_misses: bool = True) -> list[Proposal]:
        self.num_forwards, self.forward_s = 0, 0.0
        room = self.backend.max_model_len
        jobs = [(i, min(k, room - len(s.token_ids))) for i, (s, k) in enumerate(zip(seqs, ks))]
        jobs = [(i, k) for i, k in jobs if k > 0]
        out = [Proposal([]) for _ in seqs]
        if not jobs:
            return out
        start = time.perf_counter()
        results = self.backend.generate_greedy([seqs[i].token_ids for i, _ in jobs], [k for _, k in jobs])
        elapsed = time.perf_counter() - start
        steps = max(k for _, k in jobs)  # one prefill/append step, then k - 1 decode steps
        self.num_forwards, self.forward_s = steps, elapsed
        per_step = elapsed / steps
        self.step_time_s = per_step if self.step_time_s == 0.0 else 0.9 * self.step_time_s + 0.1 * per_step
        c = self.counters
        c["num_proposals"] += 1
        for (i, _), r in zip(jobs, results):
            out[i] = Proposal(list(r.outputs[0].token_ids))
            context = len(seqs[i].token_ids)
            c["num_context_tokens"] += context
            c["num_recomputed_tokens"] += context - (r.num_cached_tokens or 0)
            c["num_draft_tokens"] += len(out[i].token_ids)
        return out
