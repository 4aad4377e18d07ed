"""Per-request sampling parameters, with vLLM's names and semantics.

A frozen dataclass validated in ``__post_init__``: every bad value raises ``ValueError``
naming the field, before any request reaches a model. The ranges are the ones the engine,
the generator and the wire accept, so a valid value can never fail later.
"""

from __future__ import annotations

from dataclasses import dataclass

from .rng import MAX_SEED

_GREEDY_EPS = 1e-5  # vLLM treats temperatures below this as greedy
_MAX_INT32 = 2**31 - 1
MAX_LOGPROBS = 20  # top logprobs per token (vLLM's default max_logprobs)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    # Logits processing (vLLM's names, order and semantics; ``logits_processing.py``): applied to the
    # target's distribution at every verified position, each seeing its own prefix, so lossless.
    presence_penalty: float = 0.0  # [-2, 2]: minus this for every token already in the output
    frequency_penalty: float = 0.0  # [-2, 2]: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # > 0 (1: off): logits of prompt and output tokens divided (> 0) or multiplied (< 0) by it
    min_p: float = 0.0  # [0, 1]: drop tokens below min_p x the most likely one's probability (sampling only)
    min_tokens: int = 0  # EOS and stop token ids are masked, stop strings unchecked, until this many tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits
    allowed_token_ids: tuple[int, ...] | None = None  # only these tokens (None: all)
    bad_words: tuple[str, ...] = ()  # words never generated (their last token masked after the rest)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # report each generated token's logprob and the top-N (0: the token's only); raw model logprobs, as vLLM
    prompt_logprobs: int | None = None  # the same for each prompt token (the first has none), computed by the prefill
    # (kind, constraint): kind json (a JSON schema, as JSON text), json_object, regex, choice (a JSON list
    # of strings) or grammar (EBNF); masks the target's distribution at every position (``structured.py``)
    structured_outputs: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        # Accept lists and single strings the way vLLM does, but store tuples (hashable, frozen).
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if not -1 <= self.top_k <= _MAX_INT32:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or in [1, {_MAX_INT32}], got {self.top_k}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if not 1 <= self.max_tokens <= _MAX_INT32:
            raise ValueError(f"max_tokens must be in [1, {_MAX_INT32}], got {self.max_tokens}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= _MAX_INT32:
                raise ValueError(f"stop_token_ids must be integers in [0, {_MAX_INT32}], got {t!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, {MAX_SEED}] or None, got {self.seed!r}")
        if self.temperature < _GREEDY_EPS:
            object.__setattr__(self, "temperature", 0.0)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name))
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        pairs = []
        for token, value in bias:
            token = int(token) if isinstance(token, str) and token.strip().lstrip("-").isdigit() else token
            _check_token("logit_bias", token)
            _check_number("logit_bias", value)
            pairs.append((token, min(100.0, max(-100.0, float(value)))))  # OpenAI's and vLLM's clamp
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs)))
        if self.allowed_token_ids is not None:
            allowed = tuple(self.allowed_token_ids)
            if not allowed:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
            for t in allowed:
                _check_token("allowed_token_ids", t)
            object.__setattr__(self, "allowed_token_ids", allowed)
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.prompt_logprobs!r}")
        if self.structured_outputs is not None:
            from .structured import check_spec

            so = self.structured_outputs
            if not isinstance(so, (tuple, list)) or len(so) != 2:
                raise ValueError(f"structured_outputs must be (kind, constraint), got {so!r}")
            check_spec(*so)
            object.__setattr__(self, "structured_outputs", tuple(so))
        words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words or ())
        if any(not isinstance(w, str) or not w.strip() for w in words):
            raise ValueError(f"bad_words must be non-empty strings, got {list(words)!r}")
        object.__setattr__(self, "bad_words", words)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether anything but temperature/top-k/top-p/min-p shapes the target's distribution."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.min_tokens
                    or self.logit_bias or self.allowed_token_ids is not None or self.bad_words or self.structured_outputs)

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def _check_token(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_INT32:
        raise ValueError(f"{name}: token ids must be integers in [0, {_MAX_INT32}], got {value!r}")


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be a finite number, got {value}")
