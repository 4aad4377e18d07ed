"""Sampled speculative output follows the target's exact distribution (end to end through LLM).

Thousands of seeded requests; the first three generated tokens are compared with the exact
target distributions (p(t1), sum_t1 p(t1) p(t2 | t1), and likewise p(t3)) by a chi-square
test at significance 1e-4. The third token is often verified from a block the draft drafted
ahead (a speculation-cache hit), so the test covers that path too. The draft is an unrelated model, so most drafts are rejected and the
recovered-token path carries most of the mass.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.sampling import processed_probs

from ..conftest import make_model

VOCAB = 12
PROMPT = [3, 7, 1]
NUM_SAMPLES = 3000


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("smallvocab")
    make_model(root / "t", seed=10, vocab_size=VOCAB)
    make_model(root / "d", seed=11, vocab_size=VOCAB)
    with torch.no_grad():  # the models' raw logits are too peaked for a useful test: tame them
        for name, scale in (("t", 0.1), ("d", 0.5)):
            m = AutoModelForCausalLM.from_pretrained(root / name)
            m.get_output_embeddings().weight.mul_(scale)
            m.save_pretrained(root / name)
    return str(root / "t"), str(root / "d")


def _enumerated(target_path, next_probs):
    """p(t1), p(t2), p(t3), marginalised exactly over the earlier tokens, and p(t2 | t1) as a [VOCAB, VOCAB]
    table; ``next_probs(logits, outputs)``: the next-token distributions after each output ([n, VOCAB] rows)."""
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float64).eval()

    def probs(outputs: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            return next_probs(model(torch.tensor([PROMPT + o for o in outputs])).logits[:, -1], outputs)

    p1 = probs([[]])[0]
    p2_given = probs([[t] for t in range(VOCAB)])  # [VOCAB, VOCAB]
    p3_given = probs([[a, b] for a in range(VOCAB) for b in range(VOCAB)])  # [VOCAB * VOCAB, VOCAB]
    joint12 = (p1[:, None] * p2_given).reshape(-1)  # p(t1, t2)
    return p1, p1 @ p2_given, joint12 @ p3_given, p2_given


def exact_distributions(target_path, temperature, top_k, top_p):
    """p(t1), p(t2) and p(t3), marginalised exactly over the earlier tokens."""
    return _enumerated(target_path, lambda logits, _: processed_probs(logits, temperature, top_k, top_p))[:3]


def processed_distributions(target_path, params, min_p: float | None = None):
    """p(t1), p(t2), p(t3) at temperature 1 after ``params``' logits processing (penalties, bias, masks:
    ``SeqProcessor``, each position with its own prefix) and min-p (``min_p``, default the params'), by
    enumeration; also p(t2 | t1) as a [VOCAB, VOCAB] table."""
    from specserve.logits_processing import SeqProcessor

    proc = SeqProcessor(params, PROMPT, VOCAB, set(), [])

    def next_probs(logits, outputs):
        rows = torch.stack([proc.apply(logits[i:i + 1], PROMPT + o, [])[0] for i, o in enumerate(outputs)]).double()
        return processed_probs(rows, 1.0, 0, 1.0, params.min_p if min_p is None else min_p)

    return _enumerated(target_path, next_probs)


def chi2_pvalue(samples, expected_probs):
    counts = torch.bincount(torch.tensor(samples), minlength=VOCAB).double()
    expected = expected_probs * len(samples)
    keep = expected > 5  # merge rare bins into one so the chi-square approximation holds
    obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    exp = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
    if exp[-1] == 0:
        assert obs[-1] == 0, "sampled a token the target gives zero probability"
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue


@pytest.mark.parametrize(
    "temperature, top_k, top_p, draft_probs, ahead",
    [(1.0, 0, 1.0, True, True), (1.0, 0, 1.0, False, True), (0.8, 5, 1.0, True, False), (1.0, 0, 0.8, True, True)],
)
def test_first_two_tokens_follow_target(small_vocab_pair, temperature, top_k, top_p, draft_probs, ahead, ordered_draft_ahead):
    # k fixed, preempt off, drafting ahead ordered before each request (ordered_draft_ahead): the
    # cache-hit count follows from the seeded outputs, not from thread scheduling.
    target, draft = small_vocab_pair
    with LLM(target, draft=draft, num_speculative_tokens=3, dtype="float64", draft_probs=draft_probs, adaptive=False,
             draft_ahead=ahead, draft_ahead_preempt=False, fanout=VOCAB) as llm:  # fanout = vocab: frequent cache hits
        params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=3, seed=s, ignore_eos=True)
                  for s in range(NUM_SAMPLES)]
        outs = llm.generate([PROMPT] * NUM_SAMPLES, params, use_tqdm=False)
        m = llm.metrics()
    if ahead:
        assert 0 < m["num_cache_hits"] < m["num_blocks"]  # drafted-ahead blocks and on-demand blocks both verified
    p1, p2, p3 = exact_distributions(target, temperature, top_k, top_p)
    assert chi2_pvalue([o.token_ids[0] for o in outs], p1) > 1e-4
    assert chi2_pvalue([o.token_ids[1] for o in outs], p2) > 1e-4
    assert chi2_pvalue([o.token_ids[2] for o in outs], p3) > 1e-4  # often decided from a drafted-ahead block
    accepted = sum(o.metrics.num_accepted_tokens for o in outs) / sum(o.metrics.num_draft_tokens for o in outs)
    assert accepted < 0.9  # the draft is often rejected, so the residual path is exercised


def test_same_seed_same_output(small_vocab_pair):
    target, draft = small_vocab_pair
    with LLM(target, draft=draft, num_speculative_tokens=3, dtype="float64") as llm:
        params = SamplingParams(temperature=1.0, max_tokens=20, seed=7, ignore_eos=True)
        first = llm.generate([PROMPT, PROMPT[:2]], params, use_tqdm=False)
        again = llm.generate([PROMPT[:2], PROMPT], params, use_tqdm=False)
        assert first[0].token_ids == again[1].token_ids and first[1].token_ids == again[0].token_ids
        other = llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=20, seed=8, ignore_eos=True), use_tqdm=False)
        assert other[0].token_ids != first[0].token_ids


@pytest.mark.parametrize("draft_probs", [True, False])
def test_seeded_output_equals_the_reference_whatever_the_path(small_vocab_pair, draft_probs):
    """Draws are keyed by (seed, position): the engine's sampled output equals the single-process
    oracle token for token, with and without drafting ahead, batched, with adaptive k."""
    from specserve.reference import reference_generate

    target, draft = small_vocab_pair
    tm = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
    dm = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float64).eval()
    prompts = [PROMPT, PROMPT[:2], [5, 5, 5, 5], [0]]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=16, seed=s, ignore_eos=True)
              for s, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.7, 4, 1.0), (1.2, 0, 0.7), (0.0, 0, 1.0)])]
    ref = [reference_generate(tm, pr, sp, dm, 3, draft_probs=draft_probs) for pr, sp in zip(prompts, params)]
    for ahead in (False, True):
        with LLM(target, draft=draft, num_speculative_tokens=3, dtype="float64", adaptive=False, draft_ahead=ahead,
                 draft_probs=draft_probs) as llm:
            assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref


def test_sampled_with_penalties_and_biases_follows_the_processed_target(small_vocab_pair):
    """Penalties, a logit bias and min-p: each verified position is processed with its own prefix,
    so the first three tokens follow the processed target distributions (exact, by enumeration)."""
    target, draft = small_vocab_pair
    extra = {"repetition_penalty": 1.6, "presence_penalty": 0.8, "frequency_penalty": 0.5, "logit_bias": ((2, 1.5), (5, -0.7)),
             "min_p": 0.05}
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=s, ignore_eos=True, **extra) for s in range(NUM_SAMPLES)]
    with LLM(target, draft=draft, num_speculative_tokens=3, dtype="float64", adaptive=False, draft_ahead=False) as llm:
        outs = llm.generate([PROMPT] * NUM_SAMPLES, params, use_tqdm=False)
    p1, p2, p3, _ = processed_distributions(target, params[0])
    for pos, expected in enumerate((p1, p2, p3)):
        assert chi2_pvalue([o.token_ids[pos] for o in outs], expected) > 1e-4, pos
    plain = exact_distributions(target, 1.0, 0, 1.0)
    assert (p2 - plain[1]).abs().max() > 0.05  # the processing matters: the plain distribution would fail here
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


def test_sampled_output_with_an_eagle_head_follows_the_target(small_vocab_pair, tmp_path):
    """A head's sampled drafts (with its probabilities) are verified like a draft model's: tokens 1-3
    follow the target's distribution, and the head's drafts are both accepted and rejected."""
    from ..heads import make_eagle3_head

    target, _ = small_vocab_pair
    head = make_eagle3_head(tmp_path / "head", target, layer_ids=[0, 1], seed=5)
    with LLM(target, draft=head, num_speculative_tokens=3, dtype="float64", adaptive=False) as llm:
        params = [SamplingParams(temperature=1.0, max_tokens=3, seed=s, ignore_eos=True) for s in range(NUM_SAMPLES)]
        outs = llm.generate([PROMPT] * NUM_SAMPLES, params, use_tqdm=False)
    p1, p2, p3 = exact_distributions(target, 1.0, 0, 1.0)
    for pos, expected in enumerate((p1, p2, p3)):
        assert chi2_pvalue([o.token_ids[pos] for o in outs], expected) > 1e-4, pos
    accepted = sum(o.metrics.num_accepted_tokens for o in outs) / sum(o.metrics.num_draft_tokens for o in outs)
    assert 0.0 < accepted < 0.9
