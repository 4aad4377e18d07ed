"""Verifier cases, table-driven, and the exact output distribution of one batched verification."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specserve.rng import MAX_SEED, TARGET_ACCEPT, uniforms
from specserve.sampling import processed_probs, sample_with_uniforms
from specserve.verifier import SamplingBatch, sample_next, verify


def one_hot_logits(ids, vocab=8):
    logits = torch.full((len(ids), vocab), -5.0)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return logits


def greedy_batch(n):
    return SamplingBatch([0.0] * n, [0] * n, [1.0] * n, [0] * n, [0] * n)


GREEDY_CASES = [
    ([1, 2, 3, 4], [1, 2, 3], 3, 4),  # all accepted + bonus
    ([1, 2, 3, 4], [1, 5, 3], 1, 2),  # rejected at 2: recovered = target's argmax
    ([1, 2, 3, 4], [7, 2, 3], 0, 1),  # first rejected
    ([6, 0, 0, 0], [], 0, 6),  # no drafts: plain decoding
    ([1, 1, 0, 0], [1], 1, 1),
    ([1, 2, 3, 4], [1, 2, 99], 2, 3),  # an id past the target's vocabulary is rejected, never clamped
]


def test_verify_greedy_table_in_one_batch():
    """Every case as one row of a single batched call: rows never influence each other."""
    k = 3
    logits = torch.stack([one_hot_logits((a + [0] * 4)[: k + 1]) for a, *_ in GREEDY_CASES])
    drafts = torch.tensor([d + [0] * (k - len(d)) for _, d, *_ in GREEDY_CASES])
    num = torch.tensor([len(d) for _, d, *_ in GREEDY_CASES])
    acc, nxt = verify(logits, drafts, num, greedy_batch(len(GREEDY_CASES)))
    assert acc.tolist() == [c[2] for c in GREEDY_CASES]
    assert nxt.tolist() == [c[3] for c in GREEDY_CASES]


def sampled_batch(n, temperature=1.0, seeds=None, positions=None):
    return SamplingBatch([temperature] * n, [0] * n, [1.0] * n, seeds or list(range(n)), positions or [0] * n)


def test_point_mass_on_a_zero_probability_token_is_always_rejected():
    p = torch.log(torch.tensor([[1e-30, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64))
    n = 200
    acc, nxt = verify(p[None].expand(n, 2, 3), torch.zeros(n, 1, dtype=torch.long), torch.ones(n, dtype=torch.long),
                      sampled_batch(n))
    assert acc.sum() == 0 and set(nxt.tolist()) <= {1, 2}


def test_identical_draft_distribution_is_always_accepted():
    logits = torch.randn(3, 6, dtype=torch.float64)
    p = torch.softmax(logits, -1)
    n = 200
    g = torch.Generator().manual_seed(1)
    drafts = torch.stack([torch.multinomial(p[:2], 1, generator=g).squeeze(1) for _ in range(n)])
    acc, _ = verify(logits[None].expand(n, 3, 6), drafts, torch.full((n,), 2), sampled_batch(n),
                    p[None, :2].expand(n, 2, 6), torch.ones(n, dtype=torch.bool))
    assert acc.tolist() == [2] * n


@pytest.mark.parametrize("with_probs", [True, False])
def test_first_token_follows_target_distribution(with_probs):
    """Over many seeded rows of one batch the first emitted token is distributed exactly as p_1.

    Chi-square goodness of fit at significance 1e-4 (seeded, so deterministic in CI).
    """
    torch.manual_seed(0)
    vocab, k, trials = 6, 3, 6000
    logits = torch.randn(k + 1, vocab, dtype=torch.float64) * 1.5
    p = torch.softmax(logits, -1)
    q = torch.softmax(torch.randn(k, vocab, dtype=torch.float64) * 1.5, -1)
    if with_probs:
        u = uniforms(np.arange(trials) + 10**6, 9, np.arange(k)[None].repeat(trials, 0))
        drafts = torch.stack([sample_with_uniforms(q[i][None].expand(trials, vocab), u[:, i]) for i in range(k)], 1)
        probs, has = q[None].expand(trials, k, vocab), torch.ones(trials, dtype=torch.bool)
    else:
        drafts = q.argmax(-1)[None].expand(trials, k)  # deterministic draft: point mass
        probs = has = None
    acc, nxt = verify(logits[None].expand(trials, k + 1, vocab), drafts, torch.full((trials,), k),
                      sampled_batch(trials, seeds=list(range(trials))), probs, has)
    first = torch.where(acc > 0, drafts[:, 0], nxt)
    counts = torch.bincount(first, minlength=vocab).double()
    assert chisquare(counts.numpy(), (p[0] * trials).numpy()).pvalue > 1e-4
    assert 0 < acc.float().mean() < k  # both the accept and the reject paths ran


def test_sampled_rows_and_greedy_rows_share_a_batch():
    logits = torch.randn(4, 3, 10, dtype=torch.float64)
    drafts = logits[:, :2].argmax(-1)
    batch = SamplingBatch([0.0, 1.0, 0.0, 0.7], [0, 0, 0, 3], [1.0, 0.9, 1.0, 1.0], [1, 2, 3, 4], [5, 6, 7, 8])
    acc, nxt = verify(logits, drafts, torch.tensor([2, 2, 1, 0]), batch)
    assert acc[0] == 2 and nxt[0] == logits[0, 2].argmax()  # greedy row: argmax drafts all accepted
    assert acc[2] == 1 and nxt[2] == logits[2, 1].argmax()
    assert acc[3] == 0  # no drafts
    again = verify(logits, drafts, torch.tensor([2, 2, 1, 0]), batch)
    assert acc.tolist() == again[0].tolist() and nxt.tolist() == again[1].tolist()  # same seeds, same answer


def test_randomness_is_keyed_by_seed_and_position():
    u = uniforms([1, 1, 2], TARGET_ACCEPT, [[0, 1], [0, 1], [0, 1]])
    assert (u[0] == u[1]).all() and (u[0] != u[2]).all() and u[0, 0] != u[0, 1]
    assert ((u >= 0) & (u < 1)).all()
    big = uniforms([MAX_SEED], TARGET_ACCEPT, [[10**12]])
    assert 0 <= big[0, 0] < 1
    spread = uniforms(np.arange(20000), TARGET_ACCEPT, np.zeros((20000, 1), dtype=np.int64))[:, 0]
    assert abs(spread.mean() - 0.5) < 0.01 and abs(spread.var() - 1 / 12) < 0.005


def test_sample_next_is_plain_decoding():
    logits = torch.tensor([[0.0, 10.0, 0.0], [5.0, 0.0, 0.0]])
    assert sample_next(logits, greedy_batch(2)).tolist() == [1, 0]


def test_processed_probs_top_k_top_p():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert processed_probs(logits, 1.0, 2, 1.0).tolist()[0] == pytest.approx([4 / 7, 3 / 7, 0, 0])
    assert processed_probs(logits, 1.0, 0, 0.6).tolist()[0] == pytest.approx([4 / 7, 3 / 7, 0, 0])
    assert processed_probs(logits, 1.0, 0, 0.4).tolist()[0] == pytest.approx([1, 0, 0, 0])
    assert processed_probs(logits, 1.0, 0, 0.75).tolist()[0] == pytest.approx([4 / 9, 3 / 9, 2 / 9, 0])
    hot = processed_probs(logits, 0.5, 0, 1.0)[0]
    assert hot[0] > 0.4 and hot.sum().item() == pytest.approx(1.0)


def test_processed_probs_per_row_parameters():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 3))
    rows = processed_probs(logits, [1.0, 1.0, 1.0], [2, 0, 0], [1.0, 0.4, 1.0])
    assert rows[0].tolist() == pytest.approx([4 / 7, 3 / 7, 0, 0])
    assert rows[1].tolist() == pytest.approx([1, 0, 0, 0])
    assert rows[2].tolist() == pytest.approx([0.4, 0.3, 0.2, 0.1])


@pytest.mark.parametrize("top_p, temperature", [(1e-46, 1.0), (1e-300, 1.0), (0.5, 1e-4), (1.0, 1e-30)])
def test_extreme_parameters_keep_one_token(top_p, temperature):
    """vLLM's rule: top-p always keeps the most likely token; tiny temperatures do not overflow."""
    logits = torch.tensor([[3.0, 1.0, 2.0, -1e4]])
    probs = processed_probs(logits, temperature, 0, top_p)
    assert torch.isfinite(probs).all() and probs[0, 0] == pytest.approx(1.0, abs=1e-6)
    assert sample_with_uniforms(probs, [0.999]).item() == 0
