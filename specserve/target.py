"""The target side: owns every sequence's committed tokens and verifies draft blocks.

Data flow per step: ``open`` prefills new prompts (all but the last token, which the
first verification feeds); ``verify(blocks)`` feeds ``[last committed token] + drafts``
for every live sequence in one batched forward, runs the verifier per row, cuts the
result at any stop, commits it and rolls the KV cache back to ``len(tokens) - 1``
(invariant: the cache holds every committed token but the last). Knows nothing of Ray.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .backends.base import ModelBackend
from .messages import DraftBlock, VerifyResult
from .models import vocab_fingerprint
from .outputs import StepDelta
from .sampling import make_generator, processed_probs
from .sampling_params import SamplingParams
from .stopping import StopChecker
from .verifier import verify_greedy, verify_sampled

logger = logging.getLogger(__name__)


@dataclass
class TargetSeq:
    request_id: str
    token_ids: list[int]  # prompt + committed output
    params: SamplingParams
    stopper: StopChecker
    generator: torch.Generator | None


class TargetSide:
    def __init__(self, backend: ModelBackend, tokenizer=None, eos_token_ids: set[int] | None = None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids or ())
        self.seqs: dict[str, TargetSeq] = {}

    @property
    def max_model_len(self) -> int:
        return self.backend.max_model_len

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ``ValueError`` for a prompt this target cannot run."""
        if not prompt_token_ids:
            raise ValueError("prompt is empty: it must have at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens, but the target's context (max_model_len) is "
                f"{self.max_model_len}: it must be shorter to leave room for one generated token"
            )
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.backend.vocab_size)]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {self.backend.vocab_size}), got {bad[:5]}")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Everything ``open`` would reject, checked up front (at submission)."""
        self.check_prompt(prompt_token_ids)
        StopChecker(params, self.eos_token_ids, self.tokenizer, len(prompt_token_ids), self.max_model_len)

    def vocab_fingerprint(self) -> dict:
        return vocab_fingerprint(self.tokenizer, self.backend.vocab_size)

    def open(self, requests: list[tuple[str, list[int], SamplingParams]]) -> None:
        """Admit sequences and prefill their prompts in one batched forward."""
        for rid, prompt, params in requests:
            self.check_prompt(prompt)
            stopper = StopChecker(params, self.eos_token_ids, self.tokenizer, len(prompt), self.max_model_len)
            generator = None if params.greedy else make_generator(params.seed, self.backend.device)
            self.seqs[rid] = TargetSeq(rid, list(prompt), params, stopper, generator)
            self.backend.add(rid)
        prefill = [(rid, prompt[:-1]) for rid, prompt, _ in requests if len(prompt) > 1]
        if prefill:
            self.backend.forward([r for r, _ in prefill], [t for _, t in prefill], [1] * len(prefill))

    def close(self, request_id: str) -> None:
        if self.seqs.pop(request_id, None) is not None:
            self.backend.free(request_id)

    def room(self, seq: TargetSeq) -> int:
        """How many draft tokens this sequence can still use (context and max_tokens)."""
        remaining = seq.params.max_tokens - len(seq.stopper.output_token_ids) - 1
        return max(0, min(remaining, self.max_model_len - len(seq.token_ids)))

    def verify(
        self, step: int, blocks: dict[str, DraftBlock], fallback: bool = False
    ) -> tuple[list[StepDelta], list[VerifyResult]]:
        """Verify one block per live sequence (missing or stale blocks mean no drafts)."""
        seqs = list(self.seqs.values())
        if not seqs:
            return [], []
        drafts: list[list[int]] = []
        draft_probs: list[torch.Tensor | None] = []
        for s in seqs:
            b = blocks.get(s.request_id)
            ok = b is not None and b.base_len == len(s.token_ids)
            n = min(len(b.draft_token_ids), self.room(s)) if ok else 0
            drafts.append(list(b.draft_token_ids[:n]) if n else [])
            p = b.draft_probs if ok and n and b.draft_probs is not None else None
            draft_probs.append(None if p is None else torch.as_tensor(p[:n] if isinstance(p, torch.Tensor) else p[:n].copy()).to(self.backend.device))
        logits = self.backend.forward(
            [s.request_id for s in seqs],
            [[s.token_ids[-1]] + d for s, d in zip(seqs, drafts)],
            [len(d) + 1 for d in drafts],
        )
        deltas, results = [], []
        for row, (s, d, q) in enumerate(zip(seqs, drafts, draft_probs)):
            k = len(d)
            row_logits = logits[row, logits.shape[1] - (k + 1) :]  # right-aligned: [k + 1, vocab]
            if s.params.greedy:
                verdict = verify_greedy(row_logits, d)
            else:
                probs = processed_probs(row_logits, s.params.temperature, s.params.top_k, s.params.top_p)
                verdict = verify_sampled(probs, d, q, s.generator)
            base_len = len(s.token_ids)
            kept = s.stopper.append(verdict.token_ids)
            s.token_ids.extend(kept)
            self.backend.truncate(s.request_id, len(s.token_ids) - 1)
            finished = s.stopper.finish_reason is not None
            deltas.append(
                StepDelta(
                    s.request_id, kept, s.stopper.text_delta(), finished, s.stopper.finish_reason,
                    s.stopper.stop_reason, k, verdict.num_accepted, fallback,
                )
            )
            results.append(VerifyResult(s.request_id, step, base_len, min(verdict.num_accepted, len(kept)), kept))
        return deltas, results

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)
