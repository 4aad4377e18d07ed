"""The target side: owns every sequence's committed tokens and verifies draft blocks, batched.

Data flow per step: ``open`` prefills new prompts and, for greedy and unseeded requests, takes
their first token from the prefill's last logits, as vLLM does (a seeded sampled request, or one
that copies another's prompt rows, prefills all but its last token, which its first verification
feeds); ``verify(blocks)`` feeds ``[last committed token] + drafts`` for every
live sequence in one forward, runs the batched verifier over all rows at once, then per row
cuts the result at any stop, commits it and rolls the KV back to ``len(tokens) - 1``
(invariant: the cache holds every committed token but the last). ``defer`` admits prompts
whose prefill rides in the next verify forward instead (a row of the whole prompt, first token
from its last logits). A row that fails while being committed fails alone. A resumed request
(``Admission.committed``: the output another replica had already produced) is opened on its
whole context with its state rebuilt from that output (``resume_state``): it goes on exactly as
it would have where it started. Knows nothing of drafts' origin, channels or Ray.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .backends.base import ModelBackend
from .messages import DraftBlock, VerifyResult
from .logits_processing import SeqProcessor, bad_word_token_ids, check_token_ids, logprob_entries
from .models import vocab_fingerprint
from .outputs import Committed, StepDelta
from .sampling_params import SamplingParams
from .stopping import StopChecker
from .verifier import SamplingBatch, verify

logger = logging.getLogger(__name__)


@dataclass
class TargetSeq:
    request_id: str
    token_ids: list[int]  # prompt + committed output
    params: SamplingParams
    stopper: StopChecker
    seed: int  # the request's seed, or one drawn at admission
    processor: SeqProcessor | None = None  # penalties, logit_bias, ... (None: nothing beyond temperature/top-k/top-p)
    prompt_logprobs: list | None = None  # computed by the prefill, sent with the first delta
    open_hidden: torch.Tensor | None = None  # [prefilled positions, width]: the prefill's rows for a draft head (sent once, at open)
    pending: bool = False  # admitted, prompt not prefilled yet: the step's verify forward prefills it and gives its first token


class Admission(NamedTuple):
    """One request entering the target: prompt, parameters, the seed its draws are keyed by, and for
    a resumed request the output it already has."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    committed: Committed | None = None

    @property
    def token_ids(self) -> list[int]:
        """The context the target holds: the prompt and any committed output."""
        return self.prompt_token_ids + list(self.committed.token_ids) if self.committed else self.prompt_token_ids


def resume_state(stopper: StopChecker, grammar, committed: Committed) -> None:
    """Bring a new sequence's stop checker (text, stop-string window, counts) and grammar matcher to
    where they were after ``committed``; penalties, ``min_tokens`` and the position-keyed draws read
    the committed output from the sequence's tokens. ``ValueError`` if that output could not have
    been committed (it ends the request, or the grammar refuses it)."""
    ids = list(committed.token_ids)
    kept = stopper.append(ids)
    if stopper.finish_reason is not None:
        raise ValueError(f"committed: the output already ends the request at its token {len(kept) - 1} "
                         f"(finish_reason {stopper.finish_reason!r}); there is nothing to resume")
    if grammar is not None and grammar.commit(ids) != len(ids):
        raise ValueError("committed: the output does not follow the request's structured_outputs constraint")
    if committed.num_text_chars > len(stopper.text):
        raise ValueError(f"committed: num_text_chars={committed.num_text_chars} exceeds the output's text "
                         f"({len(stopper.text)} characters)")
    stopper.sent_chars = committed.num_text_chars  # the caller has this much of the text: the next delta starts there


class TargetSide:
    def __init__(self, backend: ModelBackend, tokenizer=None, eos_token_ids: set[int] | None = None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids or ())
        self.seqs: dict[str, TargetSeq] = {}
        self.forward_s = 0.0  # time in verify forwards, for the engine's step breakdown
        self._grammars = None  # structured.Grammars, built with the first constrained request
        self.hidden_layers: tuple[int, ...] | None = None  # the rows an EAGLE head reads (None: no head connected)
        self.hidden_fc: tuple[torch.Tensor, str] | None = None  # (weight, digest): an EAGLE-3 head's fc, applied here
        # Live sequences by prompt (all but its last token, what a prefill caches): a request with the
        # same prompt (the n choices of one request) copies those rows instead of prefilling them again.
        self._by_prompt: dict[tuple[int, ...], set[str]] = {}
        self.num_prefills_shared = 0

    @property
    def max_model_len(self) -> int:
        return self.backend.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ``ValueError`` for a prompt this target cannot run."""
        if not prompt_token_ids:
            raise ValueError("prompt is empty: it must have at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens, but the target's context (max_model_len) is "
                f"{self.max_model_len}: it must be shorter to leave room for one generated token"
            )
        bad = [t for t in prompt_token_ids if isinstance(t, bool) or not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, committed: Committed | None = None) -> None:
        """Everything ``open`` would reject, checked up front (at submission)."""
        self.check_prompt(prompt_token_ids)
        stopper = StopChecker(params, self.eos_token_ids, self.tokenizer, len(prompt_token_ids), self.max_model_len)
        check_token_ids(params, self.vocab_size, self.tokenizer)
        if params.structured_outputs is not None:
            self.grammars().compile(*params.structured_outputs)
        if committed is not None:
            committed.check(len(prompt_token_ids), params, self.vocab_size, self.max_model_len)
            grammar = self.grammars().matcher(*params.structured_outputs) if params.structured_outputs else None
            resume_state(stopper, grammar, committed)

    def grammars(self):
        if self._grammars is None:
            from .structured import Grammars

            self._grammars = Grammars(self.tokenizer, self.vocab_size)
        return self._grammars

    def hidden_info(self) -> dict:
        """Width, depth and dtype of the hidden states, for a draft head's check at connect ({}: none exposed);
        ``hidden_fc``: the digest of the head's fc the rows went through here."""
        own = getattr(self.backend, "hidden_info", None)
        info = own() if own is not None else {}
        return {**info, "hidden_fc": self.hidden_fc[1]} if info and self.hidden_fc is not None else info

    def _rows_out(self, rows: torch.Tensor) -> torch.Tensor:
        """Committed rows as they leave: through the head's fc when it runs here (one H-wide row for three)."""
        if self.hidden_fc is None:
            return rows.clone()  # (a copy: not the whole batch's tensor)
        return torch.nn.functional.linear(rows, self.hidden_fc[0])

    def keep_hidden(self, layers: tuple[int, ...]) -> None:
        """From now on, every forward keeps these layers' rows for the drafts (an EAGLE head connected)."""
        if not self.hidden_info():
            raise ValueError("this target backend does not expose hidden states (EAGLE heads need specserve's transformers "
                             "or vLLM target engine)")
        self.hidden_layers = self.backend.capture_layers = tuple(layers)

    def _captured(self) -> torch.Tensor | None:
        return getattr(self.backend, "captured", None) if self.hidden_layers else None

    def vocab_fingerprint(self) -> dict:
        own = getattr(self.backend, "vocab_fingerprint", None)  # e.g. the simulator's
        return own() if own is not None else vocab_fingerprint(self.tokenizer, self.vocab_size)

    def _register(self, requests: list[Admission], pending: bool = False) -> None:
        for r in requests:
            rid, prompt, params = r.request_id, r.prompt_token_ids, r.params
            stopper = StopChecker(params, self.eos_token_ids, self.tokenizer, len(prompt), self.max_model_len)
            processor = grammar = None
            if params.processes_logits:
                stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
                grammar = self.grammars().matcher(*params.structured_outputs) if params.structured_outputs else None
                processor = SeqProcessor(params, prompt, self.vocab_size, stop_ids, bad_word_token_ids(params.bad_words, self.tokenizer),
                                         grammar)
            if r.committed is not None:
                resume_state(stopper, grammar, r.committed)
            self.seqs[rid] = TargetSeq(rid, list(r.token_ids), params, stopper, r.seed, processor, pending=pending)
            self.backend.add(rid)

    def defer(self, requests: list[Admission]) -> list[str]:
        """Admit the requests whose prefill can ride in the next verify forward (one weight read for
        both, as vLLM mixes prefills into decode steps) when the backend says that pays
        (``fuses_prefill``); their ids. The verify gives each its first token from the prompt's last
        logits, as ``open(first_tokens=True)`` would. Not deferred: seeded sampled requests (their
        first step speculates), prompt logprobs (the prefill's logits), prompts another sequence
        already holds or shares in this batch (copied, not prefilled), and any prompt while a draft
        head reads the target's rows (it needs them at open). A resumed request's row is its whole
        context, shared with no other."""
        if not getattr(self.backend, "fuses_prefill", False) or self.hidden_layers:
            return []
        keys: dict[tuple[int, ...], int] = {}
        for r in requests:
            keys[tuple(r.prompt_token_ids[:-1])] = keys.get(tuple(r.prompt_token_ids[:-1]), 0) + 1
        deferred = []
        for r in requests:
            rid, prompt, params = r.request_id, r.prompt_token_ids, r.params
            shared = r.committed is None and (keys[tuple(prompt[:-1])] > 1 or (len(prompt) > 1 and tuple(prompt[:-1]) in self._by_prompt))
            if not ((params.greedy or params.seed is None) and params.prompt_logprobs is None and not shared):
                continue
            try:
                self._register([r], pending=True)
            except Exception:  # left to open(), which fails it alone
                self.seqs.pop(rid, None)
                continue
            if len(prompt) > 1 and r.committed is None:
                self._by_prompt.setdefault(tuple(prompt[:-1]), set()).add(rid)
            deferred.append(rid)
        return deferred

    def open(self, requests: list[Admission], first_tokens: bool = False) -> tuple[list[StepDelta], dict[str, Exception]]:
        """Admit (request_id, prompt, params, seed) sequences; prefill their prompts in one forward.

        ``first_tokens``: greedy and unseeded requests that prefill their own prompt get their first
        token from the prefill (returned as deltas, with the requests that failed taking it), so it
        waits for no verify step. Seeded sampled requests do not: which draw becomes which token
        follows the draft blocks from the first step on, and the same seed must give the same output."""
        self._register(requests)
        first = {r.request_id for r in requests if first_tokens and (r.params.greedy or r.params.seed is None)}
        prefill, forks = self._plan_prefill(requests, first)
        first_rows: list[tuple[int, str]] = []  # (prefill row, request) of the sequences whose first token the prefill gives
        logits = None
        if prefill:
            # Prompt logprobs come from the prefill's own logits: every position's, for the rows that ask.
            num_logits = [len(t) if p.prompt_logprobs is not None else 1 for _, t, p in prefill]
            try:
                logits = self.backend.forward([r for r, _, _ in prefill], [t for _, t, _ in prefill], num_logits)
            except BaseException:
                for r in requests:
                    self.close(r.request_id)
                raise
            captured = self._captured()  # [rows, width, hidden], right-aligned like the logits
            for row, ((rid, tokens, params), n) in enumerate(zip(prefill, num_logits)):
                seq = self.seqs[rid]
                if captured is not None:  # the rows of every prefilled position (the first token's input included)
                    seq.open_hidden = self._rows_out(captured[row, captured.shape[1] - len(tokens):])
                prompt = seq.token_ids
                if params.prompt_logprobs is not None and len(prompt) > 1:
                    # positions 0 .. len(prompt) - 2 score prompt[1:] (a first token's row scores that token)
                    at = logits[row, logits.shape[1] - n:][: len(prompt) - 1]
                    seq.prompt_logprobs = [None] + logprob_entries(at, prompt[1:], params.prompt_logprobs, ranks=True)
                if rid in first:
                    first_rows.append((row, rid))
        for dst, src, length in forks:
            self.backend.fork(src, dst, length)
            self.num_prefills_shared += 1
        for r in requests:
            prompt = r.prompt_token_ids
            if r.params.prompt_logprobs is not None and len(prompt) == 1:
                self.seqs[r.request_id].prompt_logprobs = [None]
            if len(prompt) > 1 and r.committed is None:
                self._by_prompt.setdefault(tuple(prompt[:-1]), set()).add(r.request_id)
        if not first_rows:
            return [], {}
        rows = torch.tensor([row for row, _ in first_rows], device=logits.device)
        seqs = [self.seqs[rid] for _, rid in first_rows]
        try:
            deltas, _, failed = self._decide(seqs, [[] for _ in seqs], [None] * len(seqs), logits[rows, -1:], None, set())
        except BaseException:  # as a failed prefill: nothing of this batch stays open (the engine retries one by one)
            for r in requests:
                self.close(r.request_id)
            raise
        return deltas, failed

    def _plan_prefill(self, requests, first: set[str] = frozenset()) -> tuple[list, list]:
        """(rows to prefill, (sequence, source, length) to copy instead): a prompt already cached by a
        live sequence, or prefilled earlier in this batch, is copied. Not with prompt logprobs (they
        need the prefill's logits) nor a draft head (it needs the prefill's hidden rows). A row in
        ``first`` that is prefilled takes its whole prompt (its first token comes from the last logits);
        the others all but the last token, which their first verification feeds. A resumed request
        prefills its whole context (prompt and committed output) and copies nothing."""
        fork = getattr(self.backend, "fork", None)
        prefill, forks, source = [], [], {}
        for r in requests:
            rid, prompt, params = r.request_id, r.token_ids, r.params
            key = tuple(prompt[:-1])
            if key and fork is not None and params.prompt_logprobs is None and not self.hidden_layers and r.committed is None:
                src = source.get(key) or next((r for r in self._by_prompt.get(key, ()) if self.backend.num_cached(r) >= len(key)), None)
                if src is not None:
                    forks.append((rid, src, len(key)))
                    continue
                source[key] = rid
            tokens = list(prompt) if rid in first else prompt[:-1]
            if tokens:
                prefill.append((rid, tokens, params))
        return prefill, forks

    def close(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.backend.free(request_id)
            key = tuple(seq.token_ids[:seq.stopper.prompt_len - 1])
            sharing = self._by_prompt.get(key)
            if sharing is not None:
                sharing.discard(request_id)
                if not sharing:
                    del self._by_prompt[key]

    def room(self, seq: TargetSeq) -> int:
        """How many draft tokens this sequence can still use (context and max_tokens)."""
        remaining = seq.params.max_tokens - len(seq.stopper.output_token_ids) - 1
        return max(0, min(remaining, self.max_model_len - len(seq.token_ids)))

    def verify(
        self, blocks: dict[str, DraftBlock], fallback: set[str] = frozenset(), only: list[str] | None = None
    ) -> tuple[list[StepDelta], list[VerifyResult], dict[str, Exception]]:
        """Verify one block per live sequence (missing or stale blocks mean no drafts).

        ``fallback``: sequences decoded target-only because their draft failed (flagged in
        their deltas); ``only``: verify these sequences only. Returns per-sequence deltas and
        verify results, and the sequences that failed (closed).
        """
        seqs = list(self.seqs.values()) if only is None else [self.seqs[r] for r in only]
        if not seqs:
            return [], [], {}
        drafts: list[list[int]] = []
        probs: list[torch.Tensor | None] = []
        for s in seqs:
            b = blocks.get(s.request_id)
            ok = b is not None and b.base_len == len(s.token_ids) and not s.pending
            n = min(len(b.draft_token_ids), self.room(s)) if ok else 0
            if n and s.processor is not None and s.processor.grammar is not None:
                n = s.processor.grammar.valid_prefix(list(b.draft_token_ids[:n]))  # drafts the grammar forbids are never verified
            drafts.append(list(b.draft_token_ids[:n]) if n else [])
            probs.append(torch.as_tensor(b.draft_probs[:n]) if n and b.draft_probs is not None and not s.params.greedy else None)
        start = time.perf_counter()
        logits = self.backend.forward(  # a pending sequence's row is its whole prompt (its prefill)
            [s.request_id for s in seqs], [list(s.token_ids) if s.pending else [s.token_ids[-1]] + d for s, d in zip(seqs, drafts)],
            [len(d) + 1 for d in drafts]
        )  # [batch_size, width, vocab], right-aligned
        self.forward_s += time.perf_counter() - start
        pending = [s.pending for s in seqs]
        for s in seqs:
            s.pending = False  # (the forward cached their prompts)
        captured = self._captured()  # [batch_size, width, hidden], right-aligned: taken before the logits move
        try:
            return self._decide(seqs, drafts, probs, logits, captured, fallback)
        except Exception:  # nothing was committed: the rows go back to where they were, to be tried again
            for s, was in zip(seqs, pending):
                s.pending = was
                self.backend.truncate(s.request_id, 0 if was else len(s.token_ids) - 1)
            raise

    def _decide(self, seqs: list[TargetSeq], drafts: list[list[int]], probs: list, logits: torch.Tensor,
                captured: torch.Tensor | None, fallback: set[str]):
        """Process, verify and commit the logits of one forward (``[batch_size, width, vocab]``,
        right-aligned; each row's last ``len(drafts[row]) + 1`` belong to it)."""
        batch_size, width, vocab = logits.shape
        k = width - 1
        device = logits.device
        num_draft = torch.tensor([len(d) for d in drafts], device=device)
        if any(len(d) != k for d in drafts):
            # Left-align each row's k_i + 1 logits (padding repeats the last one; the verifier ignores it).
            cols = torch.arange(width, device=device)[None, :]
            index = (width - 1 - num_draft)[:, None] + torch.minimum(cols, num_draft[:, None])
            logits = logits.gather(1, index[..., None].expand(batch_size, width, vocab))
        raw = {row: logits[row, : len(d) + 1].clone() for row, (s, d) in enumerate(zip(seqs, drafts))
               if s.params.logprobs is not None}  # reported as the model gives them (before any processing)
        if any(s.processor is not None for s in seqs):  # each row with the output it follows (drafts included)
            if logits.dtype in (torch.float16, torch.bfloat16):
                logits = logits.float()
            for row, (s, d) in enumerate(zip(seqs, drafts)):
                if s.processor is not None:
                    logits[row, : len(d) + 1] = s.processor.apply(logits[row, : len(d) + 1], s.token_ids, d)
        draft_ids = torch.tensor([d + [0] * (k - len(d)) for d in drafts], dtype=torch.long, device=device).reshape(batch_size, k)
        draft_probs = has_probs = None
        if any(p is not None for p in probs):
            draft_probs = torch.zeros(batch_size, k, vocab, dtype=logits.dtype, device=device)
            for row, p in enumerate(probs):
                if p is not None:
                    draft_probs[row, : p.shape[0], : min(vocab, p.shape[1])] = p[:, :vocab].to(device)
            has_probs = torch.tensor([p is not None for p in probs], device=device)
        sampling = SamplingBatch(
            [s.params.temperature for s in seqs], [s.params.top_k for s in seqs], [s.params.top_p for s in seqs],
            [s.seed for s in seqs], [len(s.token_ids) for s in seqs], [s.params.min_p for s in seqs],
        )
        num_accepted, next_token_ids = verify(logits, draft_ids, num_draft, sampling, draft_probs, has_probs)
        # .tolist(): committing and stop checks run per sequence on the host.
        num_accepted, next_token_ids = num_accepted.tolist(), next_token_ids.tolist()
        deltas, results, failed = [], [], {}
        for row, (s, d, a, nxt) in enumerate(zip(seqs, drafts, num_accepted, next_token_ids)):
            try:
                hidden = captured[row, captured.shape[1] - 1 - len(d):] if captured is not None else None  # [len(d) + 1, hidden]
                deltas_result = self._commit(s, d, a, nxt, s.request_id in fallback, raw.get(row), hidden)
            except Exception as exc:  # one sequence's failure is its own (the engine closes it on both sides)
                logger.exception("request %s failed while committing its tokens", s.request_id)
                failed[s.request_id] = exc
                continue
            deltas.append(deltas_result[0])
            results.append(deltas_result[1])
        return deltas, results, failed

    def _commit(self, s: TargetSeq, drafts: list[int], num_accepted: int, next_token: int, fallback: bool, raw_logits=None,
                hidden=None):
        base_len = len(s.token_ids)
        kept = s.stopper.append(drafts[:num_accepted] + [next_token])
        s.token_ids.extend(kept)
        if s.processor is not None and s.processor.grammar is not None:
            s.processor.grammar.commit(kept)
        self.backend.truncate(s.request_id, len(s.token_ids) - 1)
        finished = s.stopper.finish_reason is not None
        logprobs = logprob_entries(raw_logits, kept, s.params.logprobs) if raw_logits is not None else None
        delta = StepDelta(s.request_id, kept, s.stopper.text_delta(), finished, s.stopper.finish_reason,
                          s.stopper.stop_reason, len(drafts), num_accepted, fallback, logprobs, s.prompt_logprobs)
        s.prompt_logprobs = None  # (sent once)
        # The rows of the positions now committed and read: the verify input and the kept drafts.
        rows = self._rows_out(hidden[: len(kept)]) if hidden is not None else None
        return delta, VerifyResult(s.request_id, base_len, min(num_accepted, len(kept)), kept, rows)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)
