"""Admission: prompts prefilled inside the verify forward (backends whose forwards cost one weight
read, ``fuses_prefill``), and ``generate(max_in_flight=B)`` keeping B requests in the engine."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.engine import RequestFailed
from specserve.reference import reference_generate
from specserve.target import TargetSide

from ..conftest import assert_admitted_as_slots_freed, stream_all

PROMPTS = [list(range(3 + i % 7, 3 + i % 7 + 2 + (5 * i) % 23)) for i in range(12)]
LENGTHS = [4 + (7 * i) % 19 for i in range(12)]  # finishes spread over the steps: admissions meet drafting rows


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_pair):
    target = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], dtype=torch.float64).eval()
    return [reference_generate(target, p, greedy(n)) for p, n in zip(PROMPTS, LENGTHS)]


def pair(tiny_pair, fuse: bool) -> LLM:
    """The tiny pair with prefills fused into verify forwards or not. (The transformers backend pads a
    batch's rows to one width, so it does not fuse by default; padded, it computes the same.)"""
    llm = LLM(tiny_pair["target"], draft=tiny_pair["perturbed"], num_speculative_tokens=3, dtype="float64", adaptive=False)
    llm._engine.loop.core.target.backend.fuses_prefill = fuse
    return llm


def count_forwards(llm: LLM) -> list[int]:
    backend, calls = llm._engine.loop.core.target.backend, [0]
    forward = backend.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    backend.forward = counted
    return calls


@pytest.mark.parametrize("fuse", [True, False])
def test_prefills_ride_in_the_verify_forward_and_change_no_token(tiny_pair, reference, fuse):
    """Fused: every target forward is a step's (verify rows with drafts beside whole prompts), and each
    new request's first token comes from it; not fused: admissions add forwards of their own. The
    output equals target-only greedy decoding either way."""
    with pair(tiny_pair, fuse) as llm:
        calls = count_forwards(llm)
        outs = llm.generate(PROMPTS, [greedy(n) for n in LENGTHS], use_tqdm=False, max_in_flight=3)
        assert [o.token_ids for o in outs] == reference
        m = llm.metrics()
        assert m["num_draft_tokens"] > 0
        if fuse:
            assert calls[0] == m["num_steps"]
        else:
            assert calls[0] > m["num_steps"]


def test_what_cannot_ride_is_prefilled_apart_with_the_same_outputs(tiny_pair, reference):
    """Seeded sampled requests (their first step speculates), prompt logprobs and prompts shared with
    another request keep their own prefill; the rest ride. Tokens, logprobs and prompt logprobs are
    those of a run with no fusing at all."""
    params = [greedy(LENGTHS[0]), SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2),
              greedy(LENGTHS[3]), greedy(LENGTHS[3]), SamplingParams(temperature=0.8, max_tokens=9, ignore_eos=True)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[3], PROMPTS[5]]
    seen = {}
    for fuse in (True, False):
        with pair(tiny_pair, fuse) as llm:
            calls = count_forwards(llm)
            outs = llm.generate(prompts, params, use_tqdm=False, max_in_flight=4)
            seen[fuse] = outs
            if fuse:  # the last request (sampled, unseeded) rode in a step once the first ones were done
                assert calls[0] < llm.metrics()["num_steps"] + 2
            assert len(outs[5].token_ids) == 9
    fused, apart = seen[True], seen[False]
    assert fused[0].token_ids == apart[0].token_ids == reference[0]
    assert fused[3].token_ids == fused[4].token_ids == reference[3][:LENGTHS[3]]
    assert fused[1].token_ids == apart[1].token_ids  # the same seed, the same draws
    assert fused[2].token_ids == apart[2].token_ids
    for a, b in zip(fused[2].logprobs, apart[2].logprobs):
        assert a[0][0] == b[0][0] and abs(a[0][1] - b[0][1]) < 1e-9
    assert len(fused[2].prompt_logprobs) == len(apart[2].prompt_logprobs) == len(prompts[2])


@pytest.mark.parametrize("where", ["forward", "decide"])
def test_a_prompt_that_fails_in_a_fused_forward_fails_alone(tiny_pair, reference, monkeypatch, where):
    """A row that breaks the shared forward ("forward"), or the batched decision after it ("decide": every
    row's cache goes back to where it was, the prompt's to empty), is found by halving the batch, as for
    any verify: its request fails, the others (rows with drafts included) finish exact, nothing stays open."""
    poisoned = PROMPTS[4]
    with pair(tiny_pair, True) as llm:
        backend = llm._engine.loop.core.target.backend
        forward = backend.forward

        def breaks(seq_ids, token_ids, num_logits, *args, **kwargs):
            if where == "forward" and any(t == poisoned for t in token_ids):
                raise RuntimeError("boom")
            return forward(seq_ids, token_ids, num_logits, *args, **kwargs)

        backend.forward = breaks
        decide = TargetSide._decide

        def breaks_after(self, seqs, *args):
            if where == "decide" and any(s.token_ids == poisoned for s in seqs):
                raise RuntimeError("boom")
            return decide(self, seqs, *args)

        monkeypatch.setattr(TargetSide, "_decide", breaks_after)

        # (the poisoned one admitted while the others draft)
        results = stream_all(llm, [(PROMPTS[i], greedy(LENGTHS[i])) for i in (3, 4, 5)], [0.0, 0.05, 0.0])
        assert isinstance(results[1], RequestFailed) and "boom" in str(results[1])
        assert [results[0], results[2]] == [reference[3], reference[5]]
        assert not llm._engine.loop.core.target.seqs
        backend.forward = forward
        monkeypatch.setattr(TargetSide, "_decide", decide)
        assert llm.generate([poisoned], greedy(LENGTHS[4]), use_tqdm=False)[0].token_ids == reference[4]


def test_generate_refills_a_finished_slot_before_the_next_step(tiny_pair, reference):
    """``max_in_flight=B``: a request that finishes is replaced before the engine's next step, so every
    step has B requests in flight until the prompts run out (a slot left empty is a step's share of
    throughput lost)."""
    with pair(tiny_pair, False) as llm:
        core = llm._engine.loop.core
        in_flight, step = [], core.step

        def counting_step():
            in_flight.append(core.num_running + len(core.waiting))
            return step()

        core.step = counting_step
        outs = llm.generate(PROMPTS, [greedy(n) for n in LENGTHS], use_tqdm=False, max_in_flight=3)
        assert [o.token_ids for o in outs] == reference
        full = in_flight.index(next(n for n in in_flight if n < 3))  # the first step with a free slot ...
        assert set(in_flight[:full]) == {3}
        assert all(a >= b for a, b in zip(in_flight[full:], in_flight[full + 1:]))  # ... only once the prompts ran out
        assert full >= max(LENGTHS) // 2  # (the runs of the longest requests alone take that many steps)
        assert_admitted_as_slots_freed(outs, 3)
