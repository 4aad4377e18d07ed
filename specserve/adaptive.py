"""Choose the speculation length each step by measured goodput: expected tokens per second.

For a batch of B sequences and k draft tokens each (a_j: measured acceptance at position j):

    E[tokens | k] = B * sum_{i=0..k} prod_{j<i} a_j          (the 1 is the recovered/bonus token)
    cost(0)       = t_target(B, 1)                          (target-only: no round trip)
    cost(k)       = t_target(B, k + 1) + link + t_draft(k)  (link: round trip minus draft compute)
    t_draft(k)    = draft overhead + (1 - hit rate) * k * t_draft_step

k = argmax E / cost (vLLM's and SGLang's rule, with costs measured online instead of
profiled at start-up). ``t_target`` is a per-batch-size linear fit in the tokens per row;
the first ``warmup_steps`` cycle k over a few values so every estimate has data, and one
step in ``probe_every`` tries a neighbour of the choice (the configured k when speculation is
off) so acceptance, the link and the costs keep being measured. ``predict`` returns the whole table (the benchmark prints it).
Pure Python; knows nothing of models or transports.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


def _ema(old: float | None, new: float, w: float = 0.1) -> float:
    return new if old is None else (1 - w) * old + w * new


def _bucket(batch_size: int) -> int:
    """Batch sizes share cost estimates by power-of-two bucket (1, 2, 4, 8, ...)."""
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class _TargetCost:
    """t(n) = a + b * n for one batch bucket, fitted on recent (n tokens per row, seconds) samples."""

    samples: deque = field(default_factory=lambda: deque(maxlen=64))

    def add(self, n: int, seconds: float) -> None:
        self.samples.append((n, seconds))

    def predict(self, n: int, prior_slope: float) -> float | None:
        if not self.samples:
            return None
        xs = [x for x, _ in self.samples]
        ys = [y for _, y in self.samples]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mean_x) ** 2 for x in xs)
        if var > 0:
            slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var)
        else:
            slope = prior_slope * mean_y / max(mean_x, 1)  # one n seen so far: assume a mild slope
        return max(1e-6, mean_y + slope * (n - mean_x))


class SpeculationController:
    def __init__(self, max_k: int, adaptive: bool = True, warmup_steps: int = 16, probe_every: int = 64,
                 prior_acceptance: float = 0.7, prior_token_cost: float = 0.1, hysteresis: float = 0.03):
        self.max_k = max_k
        self.adaptive = adaptive
        self.warmup_steps, self.probe_every = warmup_steps, probe_every
        self.prior_token_cost = prior_token_cost
        self.hysteresis = hysteresis
        self.acceptance = [prior_acceptance] * max(max_k, 1)
        self.target_cost: dict[int, _TargetCost] = {}
        self.link_s: float | None = None
        self.draft_overhead_s: float | None = None
        self.draft_step_s: float | None = None
        self.hit_rate: float = 0.0
        self.steps = 0
        self.k = max_k
        self._chosen = 0
        self._probe_up = False

    # -- observations --------------------------------------------------------------------------
    def observe_acceptance(self, num_draft_tokens: int, num_accepted: int) -> None:
        for pos in range(min(num_accepted + 1, num_draft_tokens)):
            self.acceptance[pos] = _ema(self.acceptance[pos], 1.0 if pos < num_accepted else 0.0, 0.02)

    def observe_step(self, batch_size: int, tokens_per_row: int, target_s: float, wait_s: float = 0.0,
                     draft_compute_s: float = 0.0, draft_forward_s: float = 0.0, draft_step_s: float = 0.0,
                     num_blocks: int = 0, num_hits: int = 0) -> None:
        self.steps += 1
        self.target_cost.setdefault(_bucket(batch_size), _TargetCost()).add(tokens_per_row, target_s)
        if wait_s > 0.0:
            self.link_s = _ema(self.link_s, max(0.0, wait_s - draft_compute_s))
            self.draft_overhead_s = _ema(self.draft_overhead_s, max(0.0, draft_compute_s - draft_forward_s))
        if draft_step_s > 0.0:
            self.draft_step_s = draft_step_s
        if num_blocks:
            self.hit_rate = _ema(self.hit_rate, num_hits / num_blocks)

    # -- the model -----------------------------------------------------------------------------
    def expected_tokens(self, k: int) -> float:
        total, reach = 1.0, 1.0
        for j in range(k):
            reach *= self.acceptance[j]
            total += reach
        return total

    def cost(self, batch_size: int, k: int) -> float | None:
        fit = self.target_cost.get(_bucket(batch_size))
        t = fit.predict(k + 1, self.prior_token_cost) if fit is not None else None
        if t is None:
            return None
        if k == 0:
            return t
        if self.link_s is None or self.draft_step_s is None:
            return None
        draft = (self.draft_overhead_s or 0.0) + (1.0 - self.hit_rate) * k * self.draft_step_s
        return t + self.link_s + draft

    def predict(self, batch_size: int) -> list[dict]:
        """Per k: expected tokens per sequence, predicted seconds per step, tokens/s, speed-up over k=0."""
        rows = []
        base = self.cost(batch_size, 0)
        for k in range(self.max_k + 1):
            c = self.cost(batch_size, k)
            e = self.expected_tokens(k)
            tps = batch_size * e / c if c else None
            rows.append({"k": k, "expected_tokens": e, "step_s": c, "tokens_per_s": tps,
                         "speedup": (tps * base / batch_size) if (tps and base) else None})
        return rows

    def choose(self, batch_size: int, have_draft: bool = True) -> int:
        """This step's k (the same for every sequence; rows cap it by their room)."""
        if not have_draft or self.max_k == 0:
            return 0
        if not self.adaptive:
            return self.max_k
        self._chosen += 1
        if self._chosen <= self.warmup_steps:  # cycle k so the cost fit sees several widths
            return (self.max_k, 0, self.max_k, max(1, self.max_k // 2))[self._chosen % 4]
        if self._chosen % self.probe_every == 0:  # keep measuring a neighbour of the choice
            self._probe_up = not self._probe_up
            return self.max_k if self.k == 0 else max(0, min(self.max_k, self.k + (1 if self._probe_up else -1)))
        table = self.predict(batch_size)
        known = [r for r in table if r["tokens_per_s"] is not None]
        if not known:
            return self.k
        best = max(known, key=lambda r: r["tokens_per_s"])
        current = next((r for r in known if r["k"] == self.k), None)
        if current is None or best["tokens_per_s"] > current["tokens_per_s"] * (1 + self.hysteresis):
            self.k = best["k"]
        return self.k

    def state(self) -> dict:
        return {"k": self.k, "max_k": self.max_k, "acceptance_per_pos": list(self.acceptance), "link_ms": (self.link_s or 0.0) * 1e3,
                "draft_step_ms": (self.draft_step_s or 0.0) * 1e3, "cache_hit_rate": self.hit_rate,
                "adaptive": self.adaptive}
