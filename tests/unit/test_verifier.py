"""Verifier cases, table-driven, and the exact output distribution of one verification."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specserve.sampling import make_generator, processed_probs
from specserve.verifier import verify_greedy, verify_sampled


def one_hot_logits(ids, vocab=8):
    logits = torch.full((len(ids), vocab), -5.0)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return logits


@pytest.mark.parametrize(
    "target_argmax, drafts, num_accepted, tokens",
    [
        ([1, 2, 3, 4], [1, 2, 3], 3, [1, 2, 3, 4]),  # all accepted + bonus
        ([1, 2, 3, 4], [1, 5, 3], 1, [1, 2]),  # rejected at 2: recovered = target's argmax
        ([1, 2, 3, 4], [7, 2, 3], 0, [1]),  # first rejected
        ([6], [], 0, [6]),  # no drafts: plain decoding
        ([1, 1], [1], 1, [1, 1]),
    ],
)
def test_verify_greedy_table(target_argmax, drafts, num_accepted, tokens):
    v = verify_greedy(one_hot_logits(target_argmax), drafts)
    assert (v.num_accepted, v.token_ids) == (num_accepted, tokens)


def test_point_mass_on_a_zero_probability_token_is_always_rejected():
    probs = torch.tensor([[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)
    g = make_generator(0)
    for _ in range(200):
        v = verify_sampled(probs, [0], None, g)
        assert v.num_accepted == 0 and v.token_ids[0] in (1, 2)


def test_identical_draft_distribution_is_always_accepted():
    p = torch.softmax(torch.randn(3, 6, dtype=torch.float64), -1)
    g = make_generator(1)
    for _ in range(200):
        drafts = [int(torch.multinomial(p[i], 1, generator=g)) for i in range(2)]
        assert verify_sampled(p, drafts, p[:2], g).num_accepted == 2


@pytest.mark.parametrize("with_probs", [True, False])
def test_first_token_follows_target_distribution(with_probs):
    """Over many seeded trials the first emitted token is distributed exactly as p_1.

    Chi-square goodness of fit at significance 1e-4 (seeded, so deterministic in CI).
    """
    torch.manual_seed(0)
    vocab, k, trials = 6, 3, 6000
    p = torch.softmax(torch.randn(k + 1, vocab, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab, dtype=torch.float64) * 1.5, -1)
    g = make_generator(1234)
    counts = torch.zeros(vocab)
    for _ in range(trials):
        if with_probs:
            drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
            v = verify_sampled(p, drafts, q, g)
        else:
            drafts = [int(q[i].argmax()) for i in range(k)]  # deterministic draft: point mass
            v = verify_sampled(p, drafts, None, g)
        counts[v.token_ids[0]] += 1
    assert chisquare(counts.numpy(), (p[0] * trials).numpy()).pvalue > 1e-4


def test_processed_probs_top_k_top_p():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert processed_probs(logits, 1.0, 2, 1.0).tolist()[0] == pytest.approx([4 / 7, 3 / 7, 0, 0])
    assert processed_probs(logits, 1.0, 0, 0.6).tolist()[0] == pytest.approx([4 / 7, 3 / 7, 0, 0])
    assert processed_probs(logits, 1.0, 0, 0.4).tolist()[0] == pytest.approx([1, 0, 0, 0])
    assert processed_probs(logits, 1.0, 0, 0.75).tolist()[0] == pytest.approx([4 / 9, 3 / 9, 2 / 9, 0])
    hot = processed_probs(logits, 0.5, 0, 1.0)[0]
    assert hot[0] > 0.4 and hot.sum().item() == pytest.approx(1.0)
