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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be a finite number, got {value}")
