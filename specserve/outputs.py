"""What callers get back: per-request outputs, streamed deltas and speculation metrics; and what a
resumed request brings back (``Committed``: the output it already has).

Metric names and definitions follow vLLM's spec-decode metrics: acceptance rate =
accepted / draft tokens; mean acceptance length = 1 + accepted / drafts, where a *draft*
is one verified block of at least one draft token (the 1 counts the bonus/recovered token).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    num_drafts: int = 0  # verification steps that checked >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [k]: accepted at draft position i
    num_steps: int = 0  # all target steps, including those without drafts
    num_fallback_steps: int = 0  # steps decoded target-only because the draft was unavailable

    def record(self, num_draft_tokens: int, num_accepted: int, fallback: bool = False) -> None:
        self.num_steps += 1
        self.num_fallback_steps += int(fallback)
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos += [0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos))
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    def merge(self, other: "SpecMetrics") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_steps += other.num_steps
        self.num_fallback_steps += other.num_fallback_steps
        width = max(len(self.num_accepted_tokens_per_pos), len(other.num_accepted_tokens_per_pos))
        a = self.num_accepted_tokens_per_pos + [0] * (width - len(self.num_accepted_tokens_per_pos))
        b = other.num_accepted_tokens_per_pos + [0] * (width - len(other.num_accepted_tokens_per_pos))
        self.num_accepted_tokens_per_pos = [x + y for x, y in zip(a, b)]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "num_steps": self.num_steps,
            "num_fallback_steps": self.num_fallback_steps,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "SpecMetrics":
        keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos", "num_steps", "num_fallback_steps")
        return cls(**{k: d[k] for k in keys if k in d})


@dataclass
class StepDelta:
    """What one step added to one request (the unit streamed to callers)."""

    request_id: str
    token_ids: list[int]  # [num_new]
    text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    fallback: bool = False
    # Per new token (with SamplingParams.logprobs): [[token, logprob], [top-1 id, logprob], ...]: the
    # target's raw logprobs at that position, the token's own first, then the top-N by rank.
    logprobs: list | None = None
    # The request's first delta only (with SamplingParams.prompt_logprobs): per prompt token, as
    # ``logprobs``; None for the first, which nothing predicts.
    prompt_logprobs: list | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "StepDelta":
        """From the dict a worker streams (which may carry extra keys, e.g. the replica's name)."""
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class CannotResume(Exception):
    """A target that cannot resume this request from its committed output exactly (the message says why)."""


@dataclass(frozen=True)
class Committed:
    """The output a request already has, for another target replica to resume it from: its output
    token ids and how many characters of their text the caller has received (a stop string's
    possible start is held back, so this can be fewer than the text of the tokens)."""

    token_ids: tuple[int, ...] = ()
    num_text_chars: int = 0

    def __post_init__(self) -> None:
        ids = tuple(self.token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"committed token ids must be non-negative integers, got {[t for t in ids if not isinstance(t, int) or t < 0][:3]}")
        if isinstance(self.num_text_chars, bool) or not isinstance(self.num_text_chars, int) or self.num_text_chars < 0:
            raise ValueError(f"committed num_text_chars must be a non-negative integer, got {self.num_text_chars!r}")
        object.__setattr__(self, "token_ids", ids)

    def check(self, prompt_len: int, params, vocab_size: int, max_model_len: int) -> None:
        """``ValueError`` unless a target with this vocabulary and context can resume a request with these
        ``SamplingParams`` from this output."""
        n = len(self.token_ids)
        bad = [t for t in self.token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"committed token ids must be in [0, {vocab_size}), got {bad[:5]}")
        if n >= params.max_tokens or prompt_len + n >= max_model_len:
            raise ValueError(f"committed: {n} output tokens leave no room for another (max_tokens {params.max_tokens}, "
                             f"max_model_len {max_model_len})")
        if params.prompt_logprobs is not None:
            raise ValueError("committed: a resumed request cannot ask for prompt_logprobs again (its first delta carried them)")

    def to_dict(self) -> dict:
        return {"token_ids": list(self.token_ids), "num_text_chars": self.num_text_chars}

    @classmethod
    def from_dict(cls, d: dict | None) -> "Committed | None":
        """From the wire (None, or an empty output: nothing to resume from)."""
        if not d:
            return None
        if not isinstance(d, dict):
            raise ValueError(f"committed must be a map of token_ids and num_text_chars, got {type(d).__name__}")
        return cls(tuple(d.get("token_ids") or ()), d.get("num_text_chars", 0))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated tokens only
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    logprobs: list | None = None  # per generated token, as StepDelta.logprobs (None: not asked for)
    prompt_logprobs: list | None = None  # per prompt token, as StepDelta.prompt_logprobs (None: not asked for)
    # Wall-clock times (``time.time()``, the target host's clock, as vLLM's ``RequestMetrics``): when the
    # engine took the request (a request waiting for a slot of ``generate(max_in_flight=...)`` has not
    # arrived yet), when its first token and its last came out.
    arrival_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: StepDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.metrics.record(delta.num_draft_tokens, delta.num_accepted_tokens, delta.fallback)
        if self.first_token_time is None and delta.token_ids:
            self.first_token_time = time.time()
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            self.finished_time = time.time()

    # vLLM-style aliases, so code written against vLLM's outputs reads the same.
    @property
    def acceptance_rate(self) -> float:
        return self.metrics.acceptance_rate

    @property
    def mean_acceptance_length(self) -> float:
        return self.metrics.mean_acceptance_length
