"""Latency-model simulator backend (``backend: sim``): real bookkeeping, modelled time, synthetic logits.

Data flow: ``forward`` appends each sequence's new tokens to its cached token list (the "KV
cache": lengths are real, so contexts feed the time model and ``max_model_len`` is enforced),
builds logits for the last ``num_logits`` positions, then sleeps until the forward has taken
``LatencyModel.forward_s`` x ``time_scale`` (``sim_latency``; profiles in ``sim_profiles/``).
Logits are a deterministic function of (seed, position, last ``context_window`` tokens): the
*target* row is seeded noise over ``vocab_size`` tokens plus a ``peak`` on one token (its
argmax). The *draft* computes the same row and, at a hashed ``acceptance`` fraction of
contexts, keeps it; elsewhere it swaps the target's two likeliest tokens, so its argmax is
wrong and q stays close to p (sampled acceptance is about acceptance + (1 - acceptance)(1 - p_top)).
Greedy acceptance is therefore ``acceptance`` per position, independent of everything else,
and greedy speculative output equals target-only output exactly. ``forward_branches`` keeps
each tree's lanes in scratch and never commits them. Backends in one process that name the
same ``shared_device`` take turns (a draft colocated with its target). Knows nothing of
drafting or verification.
"""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import torch

from .sim_latency import LatencyModel, load_profile

_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)
_DRAFT_SALT = np.uint64(0xD1B54A32D192ED03)
_DEVICE_LOCKS: dict[str, threading.Lock] = {}  # shared_device name -> lock: colocated models take turns


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array (wraps modulo 2^64)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class SimBackend:
    """See the module docstring; implements ``ModelBackend`` plus ``forward_branches``."""

    # A forward's time is one weight read plus its tokens' work (the model of a GPU serving engine),
    # so a prefill costs least inside a verify forward (``TargetSide.defer``).
    fuses_prefill = True

    def __init__(self, profile: str | dict = "qwen3-32b-dgx-spark", role: str = "target", acceptance: float = 0.8,
                 vocab_size: int = 1024, seed: int = 0, context_window: int = 4, peak: float = 9.0, time_scale: float = 1.0,
                 max_model_len: int | None = None, eos_token_id: int | None = None, shared_device: str | None = None,
                 device: str = "cpu"):
        if role not in ("target", "draft"):
            raise ValueError(f"sim backend_options role must be 'target' or 'draft', got {role!r}")
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"sim backend_options acceptance must be in [0, 1], got {acceptance!r}")
        if vocab_size < 2 or context_window < 1 or time_scale < 0 or peak <= 0:
            raise ValueError(f"sim backend_options need vocab_size >= 2, context_window >= 1, time_scale >= 0, peak > 0; "
                             f"got {vocab_size}, {context_window}, {time_scale}, {peak}")
        self.latency: LatencyModel = load_profile(profile)
        self.role, self.acceptance, self.seed = role, float(acceptance), int(seed)
        self.vocab_size, self.context_window, self.peak, self.time_scale = int(vocab_size), int(context_window), float(peak), float(time_scale)
        limit = self.latency.model.max_model_len
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the sim profile's context of {limit} tokens")
        self.max_model_len = max_model_len or limit
        if eos_token_id is not None and not 0 <= eos_token_id < vocab_size:
            raise ValueError(f"sim backend_options eos_token_id must be in [0, {vocab_size}), got {eos_token_id}")
        self.eos_token_ids = set() if eos_token_id is None else {int(eos_token_id)}
        self.device = torch.device(device)
        self._lock = _DEVICE_LOCKS.setdefault(shared_device, threading.Lock()) if shared_device else contextlib.nullcontext()
        # Noise kept within +-0.45 peak: the peak token is always the target's strict argmax.
        num_rows = max(16, min(1024, (1 << 22) // self.vocab_size))  # at most 16 MB of noise
        noise = np.random.default_rng(self.seed).standard_normal((num_rows, self.vocab_size))
        self._noise = np.clip(noise, -0.45 * self.peak, 0.45 * self.peak).astype(np.float32)
        self._tokens: dict[str, list[int]] = {}  # seq_id -> cached tokens (the "KV cache")
        self._lanes: dict[str, list[list[int]]] = {}  # seq_id -> branch lanes' tokens (scratch, never committed)
        self.num_forwards, self.modelled_s, self.forward_s = 0, 0.0, 0.0  # forwards, their modelled and real seconds
        self._overshoot_s = 0.0

    @classmethod
    def from_side(cls, side, max_model_len: int | None = None) -> "SimBackend":
        """From a ``SideConfig``: ``backend_options`` are the keyword arguments; a draft side defaults to role draft
        and the profile to the model name after ``sim:`` (e.g. ``sim:qwen3-1.7b-rtx5090``)."""
        from ..config import DraftConfig

        options = dict(side.backend_options)
        options.setdefault("role", "draft" if isinstance(side, DraftConfig) else "target")
        if "profile" not in options and side.model.startswith("sim:"):
            options["profile"] = side.model.removeprefix("sim:")
        return cls(max_model_len=max_model_len, device=side.device, **options)

    def vocab_fingerprint(self) -> dict:
        return {"tokenizer_sha": None, "num_tokens": None, "vocab_size": self.vocab_size}

    # -- sequence bookkeeping -------------------------------------------------------------
    def add(self, seq_id: str) -> None:
        if seq_id in self._tokens:
            raise KeyError(f"sequence {seq_id!r} already exists")
        self._tokens[seq_id] = []

    def free(self, seq_id: str) -> None:
        del self._tokens[seq_id]
        self._lanes.pop(seq_id, None)

    def num_cached(self, seq_id: str) -> int:
        return len(self._tokens[seq_id])

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        tokens = self._tokens[seq_id]
        assert 0 <= num_tokens <= len(tokens), (seq_id, num_tokens, len(tokens))
        del tokens[num_tokens:]

    # -- logits ---------------------------------------------------------------------------
    def logits_for(self, contexts: list[list[int]]) -> np.ndarray:  # [len(contexts), vocab] float32
        """This model's logits for the token after each context (the whole function of the model)."""
        return self._logits([c[-self.context_window:] for c in contexts], [len(c) for c in contexts])

    def _logits(self, tails: list[list[int]], lengths: list[int]) -> np.ndarray:
        """Logits from each context's last ``context_window`` tokens and its length (its position)."""
        w = self.context_window
        window = np.full((len(tails), w), -1, dtype=np.int64)
        for i, tail in enumerate(tails):
            if tail:
                window[i, w - len(tail):] = tail
        h = _mix(np.full(len(tails), self.seed, dtype=np.uint64) + _GOLDEN)
        h = _mix(h ^ (np.array(lengths, dtype=np.uint64) * _GOLDEN))
        for j in range(w):
            h = _mix(h ^ ((window[:, j] + 2).astype(np.uint64) * _GOLDEN))
        v = self.vocab_size
        logits = self._noise[(h % np.uint64(len(self._noise))).astype(np.int64)]
        rows = np.arange(len(tails))
        logits[rows, ((h >> np.uint64(32)) % np.uint64(v)).astype(np.int64)] += self.peak
        if self.role == "draft":
            u = (_mix(h ^ _DRAFT_SALT) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
            miss = np.nonzero(u >= self.acceptance)[0]
            if len(miss):  # swap the target's two likeliest tokens: the draft's argmax is the runner-up
                top2 = np.argpartition(-logits[miss], 1, axis=1)[:, :2]
                first, second = top2[:, 0], top2[:, 1]
                a, b = logits[miss, first].copy(), logits[miss, second].copy()
                logits[miss, first], logits[miss, second] = b, a
        return logits

    # -- compute --------------------------------------------------------------------------
    def forward(self, seq_ids, token_ids, num_logits) -> torch.Tensor:  # [batch_size, max(num_logits), vocab]
        assert len(seq_ids) == len(token_ids) == len(num_logits) > 0
        for sid, toks, n in zip(seq_ids, token_ids, num_logits):
            assert len(toks) >= 1 and 1 <= n <= len(toks)
            if len(self._tokens[sid]) + len(toks) > self.max_model_len:
                raise ValueError(f"sequence {sid!r} would reach {len(self._tokens[sid]) + len(toks)} tokens, "
                                 f"over max_model_len={self.max_model_len}")
            if any(not 0 <= t < self.vocab_size for t in toks):
                raise ValueError(f"sequence {sid!r}: token ids must be in [0, {self.vocab_size})")
        with self._lock:
            start = time.perf_counter()
            width = max(num_logits)
            tails, lengths, where = [], [], []
            for row, (sid, toks, n) in enumerate(zip(seq_ids, token_ids, num_logits)):
                cached = self._tokens[sid]
                recent = cached[-self.context_window:] + list(toks)  # the only tokens the logits can see
                offset = len(cached) - len(recent) + len(toks)  # position of recent[0]
                for j in range(n):
                    length = len(cached) + len(toks) - n + 1 + j  # context of the j-th kept logits row
                    tails.append(recent[max(0, length - self.context_window - offset): length - offset])
                    lengths.append(length)
                    where.append((row, width - n + j))  # right-aligned
            out = np.zeros((len(seq_ids), width, self.vocab_size), dtype=np.float32)
            rows, cols = zip(*where)
            out[list(rows), list(cols)] = self._logits(tails, lengths)
            lengths = [len(self._tokens[s]) + len(t) for s, t in zip(seq_ids, token_ids)]
            self._sleep(start, [len(t) for t in token_ids], lengths)
        for sid, toks in zip(seq_ids, token_ids):  # commit only after the forward succeeded
            self._tokens[sid].extend(toks)
            self._lanes.pop(sid, None)
        return torch.from_numpy(out).to(self.device)

    def forward_branches(self, seq_ids, token_ids, prefix_lens, depth: int, num_lanes: int) -> torch.Tensor:
        """One depth of each sequence's branch tree (see ``HFBackend.forward_branches``). Commits nothing."""
        out = np.zeros((len(seq_ids), num_lanes, self.vocab_size), dtype=np.float32)
        tails, lengths, where = [], [], []
        for row, (sid, toks, lens) in enumerate(zip(seq_ids, token_ids, prefix_lens)):
            committed = self._tokens[sid]
            assert len(toks) == len(lens) <= num_lanes and all(0 < p <= len(committed) for p in lens)
            if max(p + depth for p in lens) >= self.max_model_len:
                raise ValueError(f"branch of {sid!r} would pass max_model_len={self.max_model_len}")
            if depth == 0:
                self._lanes[sid] = [[t] for t in toks]
            else:
                lanes = self._lanes[sid]
                assert len(lanes) == len(toks) and all(len(lane) == depth for lane in lanes), "branch depths out of order"
                for lane, t in zip(lanes, toks):
                    lane.append(t)
            for b, (lane, p) in enumerate(zip(self._lanes[sid], lens)):
                tails.append((committed[max(0, p - self.context_window):p] + lane)[-self.context_window:])
                lengths.append(p + len(lane))
                where.append((row, b))
        with self._lock:
            start = time.perf_counter()
            rows, cols = zip(*where)
            out[list(rows), list(cols)] = self._logits(tails, lengths)
            # Cost: num_lanes new tokens per row over the row's cache plus its scratch (as a tree kernel reads it).
            lengths = [len(self._tokens[s]) + (depth + 1) * num_lanes for s in seq_ids]
            self._sleep(start, [num_lanes] * len(seq_ids), lengths)
        return torch.from_numpy(out).to(self.device)

    def _sleep(self, start: float, num_new: list[int], context: list[int]) -> None:
        """Hold the forward until its modelled time has passed (compute so far counts toward it).

        Sleeping overshoots by tens of microseconds; the overshoot is carried over and taken
        off the next sleeps, so forwards average their modelled time.
        """
        modelled = self.latency.forward_s(num_new, context) * self.time_scale
        remaining = modelled - (time.perf_counter() - start) - self._overshoot_s
        if remaining > 0:
            time.sleep(remaining)
        elapsed = time.perf_counter() - start
        self._overshoot_s = min(max(0.0, self._overshoot_s + elapsed - modelled), modelled)
        self.num_forwards += 1
        self.modelled_s += modelled
        self.forward_s += elapsed
