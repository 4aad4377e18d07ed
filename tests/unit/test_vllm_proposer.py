"""RemoteDraftProposer's translation of vLLM's per-step view into draft-protocol messages (no vLLM needed).

A fake model runner constructs the proposer the way vLLM's does and drives ``propose`` with
vLLM's arguments; a fake draft endpoint records every ``ProposeRequest`` and answers a
fixed continuation. Checked: opens carry the whole prompt, results carry base_len /
accepted prefix / appended tokens, finished requests are closed, rows are matched by
request id whatever their order, drafts respect max_tokens, a failing draft means empty
proposals instead of an exception, and with adaptive k a k = 0 step sends nothing while the
controller learns the verify's cost from the runner's own steps.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specserve.build import DraftLink
from specserve.messages import DraftBlock, HelloReply, ProposeReply
from specserve.transport import DraftUnavailable
from specserve.vllm import RemoteDraftProposer
from specserve.vllm import link as links

K, MAX_LEN = 3, 64
VOCAB = {"tokenizer_sha": None, "num_tokens": None, "vocab_size": 1000}


class FakeDraft:
    """Answers each wanted sequence with ``last token + 1, + 2, ...``; records what it was sent."""

    def __init__(self):
        self.requests, self.tokens, self.fail = [], {}, False

    def hello(self, msg, timeout_s):
        return HelloReply("fake", VOCAB)

    def send(self, req, awaited=True):
        if self.fail:
            raise DraftUnavailable("down")
        self.requests.append(req)
        for o in req.opens:
            self.tokens[o.request_id] = list(o.token_ids)
        for r in req.results:
            self.tokens[r.request_id] = self.tokens[r.request_id][: r.base_len] + list(r.token_ids)
        for c in req.closes:
            self.tokens.pop(c.request_id, None)
        self.reply = ProposeReply(req.step, [DraftBlock(rid, len(self.tokens[rid]), [self.tokens[rid][-1] + i + 1 for i in range(k)])
                                             for rid, k in zip(req.request_ids, req.num_draft_tokens)])

    def recv(self, timeout_s, awaited=True):
        return self.reply

    def poll(self):
        return True

    def close(self):
        pass


class FakeModelRunner:
    """The parts of vLLM's GPUModelRunner the proposer reads (the seam checks each is there)."""

    speculative_config = use_aux_hidden_state_outputs = None  # (not driven here: plain steps, a head's layers)
    query_start_loc = SimpleNamespace(np=None)

    def __init__(self, draft: FakeDraft, max_tokens: int = 50, adaptive: bool = False, first_step_drafts: bool = False,
                 seeded: frozenset = frozenset()):
        key = links.park(DraftLink(lambda: {"fake": draft}, lambda name, d: d, "target-test", background=False))
        config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=K),
                                 model_config=SimpleNamespace(max_model_len=MAX_LEN),
                                 additional_config={"specserve": {"link": key, "vocab": VOCAB, "adaptive": adaptive,
                                                                  "first_step_drafts": first_step_drafts}})
        self.seeded = seeded  # requests sampled with their own seed
        self.input_batch = SimpleNamespace(req_ids=[])
        self.requests: dict = {}
        self.max_tokens = max_tokens
        self.removed: list[str] = []
        self.drafter = RemoteDraftProposer(config)
        self.tokens = np.zeros((8, MAX_LEN), dtype=np.int32)
        self.lengths = np.zeros(8, dtype=np.int32)

    def _on_request_state_removed(self, req_id, req_state):
        self.removed.append(req_id)

    def execute_model(self, scheduler_output=None):
        """vLLM's worker calls this first each step (the proposer times the verify from here)."""

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        pass

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, sample_hidden_states,
                                aux_hidden_states, *args):
        pass

    def _get_eagle3_aux_layers_from_config(self):
        pass

    def step(self, rows: dict[str, list[int]]):
        """One engine step: ``rows`` maps each request, in batch order, to the tokens it committed
        in this step (a new request: its prompt, then its first token)."""
        self.execute_model()
        self.input_batch.req_ids = list(rows)
        sampled = []
        for i, (rid, new) in enumerate(rows.items()):
            state = self.requests.get(rid)
            if state is None:
                params = SimpleNamespace(max_tokens=self.max_tokens, temperature=1.0 if rid in self.seeded else 0.0,
                                         seed=7 if rid in self.seeded else None)
                state = self.requests[rid] = SimpleNamespace(sampling_params=params, output_token_ids=[], all=[])
                new_output = new[-1:]
            else:
                new_output = list(new)
            state.all += new
            state.output_token_ids += new_output
            sampled.append(new_output)
            self.tokens[i, : len(state.all)] = state.all
            self.lengths[i] = len(state.all)
        return self.drafter.propose(sampled, self.lengths, self.tokens)

    def finish(self, rid: str):
        self.requests.pop(rid)
        self._on_request_state_removed(rid, None)


def test_opens_results_closes_and_rows_by_request_id():
    draft = FakeDraft()
    runner = FakeModelRunner(draft)
    # step 1: two prompts prefilled, one token each. Their opens go out at once, unawaited, and no block
    # is asked for them yet: the draft prefills them while the target runs step 2.
    out = runner.step({"a": [1, 2, 3, 10], "b": [5, 6, 20]})
    assert out == [[], []]
    (req,) = draft.requests
    assert [(o.request_id, o.token_ids, o.temperature) for o in req.opens] == [("a", [1, 2, 3, 10], 0.0), ("b", [5, 6, 20], 0.0)]
    assert req.request_ids == []
    # step 2: one token each; now both ask
    out = runner.step({"a": [11], "b": [21]})
    assert out == [[12, 13, 14], [22, 23, 24]]
    assert draft.requests[-1].num_draft_tokens == [K, K]
    # step 3, rows swapped: a accepted 2 drafts + recovered 99; b accepted all 3 + bonus 25
    out = runner.step({"b": [22, 23, 24, 25], "a": [12, 13, 99]})
    assert out == [[26, 27, 28], [100, 101, 102]]
    results = {r.request_id: r for r in draft.requests[-1].results}
    assert (results["a"].base_len, results["a"].num_accepted, results["a"].token_ids) == (5, 2, [12, 13, 99])
    assert (results["b"].base_len, results["b"].num_accepted, results["b"].token_ids) == (4, 3, [22, 23, 24, 25])
    assert runner.drafter.step_stats == {"a": (3, 2, False), "b": (3, 3, False)}
    # a finishes: the runner's hook closes it; the close rides on the next request
    runner.finish("a")
    runner.step({"b": [26, 7]})
    assert [c.request_id for c in draft.requests[-1].closes] == ["a"]
    assert draft.tokens["b"] == [5, 6, 20, 21, 22, 23, 24, 25, 26, 7]  # the draft's copy matches the target's


def test_a_new_sequence_joins_a_speculating_batch_without_holding_it_up():
    """The step that prefilled a prompt asks the running sequences' blocks only; the new one's open rides
    along (the draft drafts its first block ahead, ``DraftSide._first_blocks``) and it asks from its next step."""
    draft = FakeDraft()
    runner = FakeModelRunner(draft)
    runner.step({"a": [1, 2, 3]})
    assert runner.step({"a": [4]}) == [[5, 6, 7]]
    out = runner.step({"a": [5, 6, 7, 8], "b": [9, 10]})  # b's prompt prefilled in this step
    assert out == [[9, 10, 11], []]
    req = draft.requests[-1]
    assert req.request_ids == ["a"] and [o.request_id for o in req.opens] == ["b"]
    assert runner.step({"a": [9, 10, 11, 12], "b": [30]}) == [[13, 14, 15], [31, 32, 33]]


def test_first_step_drafts_and_seeded_requests_ask_from_the_prefill_step():
    """``speculation.first_step_drafts`` asks a new sequence's block in its prefill step; a seeded
    sampled request always does (its draws follow block boundaries, as on specserve's own engine)."""
    draft = FakeDraft()
    runner = FakeModelRunner(draft, first_step_drafts=True)
    assert runner.step({"a": [1, 2, 3, 10]}) == [[11, 12, 13]]
    draft = FakeDraft()
    runner = FakeModelRunner(draft, seeded=frozenset({"s"}))
    assert runner.step({"a": [1, 2, 3], "s": [5, 6]}) == [[], [7, 8, 9]]
    assert draft.requests[-1].request_ids == ["s"]


def test_drafts_never_exceed_max_tokens():
    draft = FakeDraft()
    runner = FakeModelRunner(draft, max_tokens=4)
    runner.step({"a": [1, 2, 3]})
    assert runner.step({"a": [4]}) == [[5]]  # 2 output tokens so far: room for 1 draft + the bonus token


def test_a_failing_draft_means_empty_proposals():
    draft = FakeDraft()
    runner = FakeModelRunner(draft)
    runner.step({"a": [1, 2, 3]})
    draft.fail = True
    assert runner.step({"a": [4, 5]}) == [[]]
    assert runner.drafter.status()["num_draft_failures"] == 1
    assert runner.step({"a": [6]}) == [[]]  # no draft: target-only, and counted as a fallback step
    assert runner.drafter.step_stats["a"] == (0, 0, True)


def test_without_a_draft_named_the_proposer_refuses_to_start(monkeypatch):
    monkeypatch.delenv(links.ADDRESS_ENV, raising=False)
    monkeypatch.delenv(links.APP_ENV, raising=False)

    class Runner:
        def __init__(self):
            self.input_batch = SimpleNamespace(req_ids=[])
            self._on_request_state_removed = lambda *a: None
            config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=K),
                                     model_config=SimpleNamespace(max_model_len=MAX_LEN), additional_config={})
            RemoteDraftProposer(config)

    with pytest.raises(ValueError, match="SPECSERVE_DRAFT_ADDRESS"):
        Runner()


def test_k_zero_steps_send_nothing_and_the_next_block_catches_the_draft_up():
    draft = FakeDraft()
    runner = FakeModelRunner(draft, adaptive=True)
    controller = runner.drafter.controller
    controller.choose = lambda batch_size, have_draft=True, cache=False: 0  # speculation does not pay: k = 0 for the whole batch
    assert runner.step({"a": [1, 2, 3]}) == [[]]
    assert runner.step({"a": [4]}) == [[]] and runner.step({"a": [5]}) == [[]]
    assert draft.requests == []  # not even the open went out: k = 0 steps cost no round trip
    controller.choose = lambda batch_size, have_draft=True, cache=False: K  # it pays again
    assert runner.step({"a": [6]}) == [[7, 8, 9]]
    (req,) = draft.requests
    assert [o.request_id for o in req.opens] == ["a"] and draft.tokens["a"] == [1, 2, 3, 4, 5, 6]


def test_the_controller_learns_the_verify_cost_from_the_runners_steps():
    draft = FakeDraft()
    runner = FakeModelRunner(draft, adaptive=True)
    controller = runner.drafter.controller
    seen = []
    observe_step = controller.observe_step
    controller.observe_step = lambda batch_size, width, *args: seen.append((batch_size, width)) or observe_step(batch_size, width, *args)
    runner.step({"a": [1, 2, 3], "b": [4, 5]})  # a prefill step: says nothing about a verify's cost
    assert seen == [] and controller.verify_s == {}
    for i in range(8):
        out = runner.step({"a": [10 + i], "b": [20 + i]})
        assert all(len(block) <= K for block in out)
    assert runner.drafter.counters["num_verify_steps"] == 8
    # one sample per verify step after the first (the cost of a step is known once the next one begins), by width
    assert len(seen) >= 7 and {b for b, _ in seen} == {2} and {w for _, w in seen} <= set(range(1, K + 2))
    assert {key[0] for key in controller.verify_s} == {1}  # batch 2's bucket (log2)
    assert runner.drafter.status()["speculation"]["adaptive"] is True


def test_quiet_steps_push_the_deltas_unawaited_and_the_next_block_reads_the_answer_first():
    draft = FakeDraft()
    runner = FakeModelRunner(draft, adaptive=True)
    controller = runner.drafter.controller
    controller.choose = lambda batch_size, have_draft=True, cache=False: 0
    runner.step({"a": [1, 2, 3]})
    for t in range(4, 7):
        assert runner.step({"a": [t]}) == [[]]
    (pushed,) = draft.requests  # the fourth quiet step pushed: the open and the tokens so far, nothing asked
    assert pushed.request_ids == [] and [o.request_id for o in pushed.opens] == ["a"]
    assert draft.tokens["a"] == [1, 2, 3, 4, 5, 6]
    controller.choose = lambda batch_size, have_draft=True, cache=False: K
    assert runner.step({"a": [7]}) == [[8, 9, 10]]  # the pushed answer was read before this one
    assert draft.requests[-1].results[0].base_len == 6 and draft.tokens["a"] == [1, 2, 3, 4, 5, 6, 7]
