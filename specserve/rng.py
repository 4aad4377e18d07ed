"""Counter-based randomness: one uniform per (request seed, stream, token position).

Lossless speculative sampling needs every uniform to influence the output at most once;
reproducibility needs a seed to give the same output whatever the batch, the timing or
the draft's cache hits. Keying each draw by the absolute position of the token it decides
gives both: a position is decided once and then committed, and a block drafted ahead of
time (speculation cache) draws exactly what the same block drafted on demand would.
Vectorised splitmix64 in numpy; knows nothing of models.
"""

from __future__ import annotations

import numpy as np

MAX_SEED = 2**63 - 1  # seeds are validated into [0, MAX_SEED] at the edge

# Independent streams: the target's acceptance tests, its recovered/bonus/plain samples, the draft's samples.
TARGET_ACCEPT, TARGET_SAMPLE, DRAFT_SAMPLE = 1, 2, 3

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (array arithmetic wraps modulo 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def uniforms(
    seeds,  # [batch_size] ints in [0, MAX_SEED]
    stream: int,
    positions,  # [batch_size, n] (or [batch_size]) token positions
) -> np.ndarray:  # float64 in [0, 1), shaped like positions
    seeds = np.asarray(seeds, dtype=np.uint64)
    positions = np.asarray(positions, dtype=np.int64)
    assert positions.shape[0] == seeds.shape[0] and (positions >= 0).all()
    key = _mix(seeds * _GOLDEN + np.uint64(stream))
    key = key.reshape(key.shape + (1,) * (positions.ndim - 1))
    z = _mix(key ^ _mix(positions.astype(np.uint64) + _GOLDEN))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def random_seed() -> int:
    """A fresh seed for a request that did not ask for one."""
    return int(np.random.default_rng().integers(0, MAX_SEED, dtype=np.int64, endpoint=True))
