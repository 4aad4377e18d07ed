"""Trees: a draft that drafts ahead over a socket sends its speculation cache after each request,
and the target takes the next blocks from it without waiting for a reply; exact either way."""

from __future__ import annotations

import dataclasses
import time

import msgpack
import pytest

from specserve.adaptive import SpeculationController
from specserve.build import build_draft_service, build_target
from specserve.config import SpecserveConfig
from specserve.engine import EngineCore, EngineLoop
from specserve.messages import DraftTree, Hello, OpenSeq, ProtocolError, SeqTree, VerifyResult, decode, encode
from specserve.pool import DraftPool, _Draft
from specserve.sampling_params import SamplingParams
from specserve.transport import DraftServer, SocketEndpoint

from ..conftest import Sinks, greedy_references, wait_until

PROMPTS = [list(range(3 + i % 5, 3 + i % 5 + 2 + (7 * i) % 19)) for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_pair):
    return greedy_references(tiny_pair["target"], PROMPTS, GREEDY)


class FixedArm(SpeculationController):
    """k drafts every step, answered from the speculation cache alone (``cache_only``) or drafting misses."""

    def __init__(self, k: int, cache_only: bool):
        super().__init__(k, adaptive=False)
        self.fixed_cache_only = cache_only

    def choose(self, batch_size: int, have_draft: bool = True, cache: bool = False) -> int:
        k = super().choose(batch_size, have_draft, cache)
        if k:
            self.cache_only = self.fixed_cache_only and cache
            self.arm = (k, self.cache_only)
        return k


def run(tiny_pair, trees: bool = True, corrupt=None, wait_for_trees: bool = True, k: int = 3, cache_only: bool = True):
    """Generate PROMPTS through specserve's engine with one draft over TCP that drafts ahead (its
    whole tree: no preemption). ``wait_for_trees``: before each lookup the target waits (up to 30 s)
    for the tree of its last request, so which steps find a tree does not depend on the machine's
    speed. ``corrupt``: what the draft does to each tree before it leaves."""
    cfg = SpecserveConfig.load(target=tiny_pair["target"], draft=tiny_pair["perturbed"], dtype="float64", num_speculative_tokens=k,
                               adaptive=False, draft_ahead=True, draft_ahead_preempt=False, draft_trees=trees)
    service = build_draft_service(cfg, "d0")
    if corrupt is not None:
        tree = service.tree
        service.tree = lambda conn, step, elapsed_s=0.0: corrupt(tree(conn, step, elapsed_s))
    server = DraftServer(service, host="127.0.0.1", advertise_host="127.0.0.1")
    target = build_target(cfg)
    core = EngineCore(target, None, FixedArm(k, cache_only), 64)
    core.pool = pool = DraftPool(discover=lambda: {"d0": server.address}, connect=lambda name, address: SocketEndpoint(address),
                                 hello=Hello("t0", target.vocab_fingerprint()), reopen=core.reopen, background=True, refresh_s=0.1,
                                 min_timeout_s=30.0, max_timeout_s=60.0, trees=trees)
    from_tree, taken = pool._from_tree, []  # (drafts taken, drafts asked) per block taken from a tree

    def waiting(d, rids, ks, draft_misses, now):
        if wait_for_trees and d.sent_at:  # a tree is owed: read up to it
            deadline = time.monotonic() + 30
            while d.sent_at and time.monotonic() < deadline:
                pool._read_pushed(d, wait=False)
                time.sleep(0.001)
        blocks = from_tree(d, rids, ks, draft_misses, now)
        asked = dict(zip(rids, ks))
        taken.extend((len(b.draft_token_ids), asked[rid]) for rid, b in (blocks or {}).items())
        return blocks
    pool._from_tree = waiting
    loop = EngineLoop(core)
    try:
        wait_until(lambda: pool.drafts, 60, 0.05, "the draft connected")
        sinks = Sinks()
        loop.submit_many([(f"r{i}", p, GREEDY, sinks(i)) for i, p in enumerate(PROMPTS)])
        wait_until(lambda: len(sinks.done) + len(sinks.errors) == len(PROMPTS), 180, 0.02, "every request finished")
        assert sinks.errors == []
        core.taken = taken
        return [sinks.outs[i] for i in range(len(PROMPTS))], pool.status(), service.counters, core
    finally:
        loop.shutdown()
        server.close()


def test_steps_take_their_blocks_from_the_trees_and_stay_exact(tiny_pair, reference):
    outs, status, draft, core = run(tiny_pair)
    assert outs == reference
    assert status["num_tree_steps"] > 0 and status["num_tree_blocks"] > 0
    assert len(core.taken) == status["num_tree_blocks"] and all(got <= asked for got, asked in core.taken)
    assert status["draft_replies_rejected"] == 0 and status["num_draft_failures"] == 0
    assert core.totals.num_accepted_tokens > 0
    # The draft answered every request, the tree steps' too, from the same cache: its hits cover the tree blocks.
    assert draft["num_cache_hits"] >= status["num_tree_blocks"]


def test_drafting_misses_a_step_takes_the_tree_only_where_it_holds_every_block_in_full(tiny_pair, reference):
    outs, status, _, core = run(tiny_pair, cache_only=False)
    assert outs == reference
    # (whether a tree held every row's block in full depends on how deep the draft grew it in time)
    assert all(got == asked for got, asked in core.taken) and len(core.taken) == status["num_tree_blocks"]
    assert core.totals.num_accepted_tokens > 0


def test_without_trees_every_step_waits_for_the_reply(tiny_pair, reference):
    outs, status, _, _ = run(tiny_pair, trees=False, wait_for_trees=False)
    assert outs == reference
    assert status["num_tree_steps"] == 0 and status["num_tree_blocks"] == 0


def _shift(tree: DraftTree, by: int) -> DraftTree:
    return dataclasses.replace(tree, trees=[dataclasses.replace(t, branches=[[x + by for x in b] for b in t.branches]) for t in tree.trees])


def test_a_tree_outside_the_vocabulary_is_refused_and_the_output_stays_exact(tiny_pair, reference):
    outs, status, _, _ = run(tiny_pair, corrupt=lambda tree: _shift(tree, 10_000))
    assert outs == reference
    assert status["draft_replies_rejected"] > 0
    assert status["num_tree_blocks"] == 0  # every branch drafted something: every one was refused


def test_a_tree_with_wrong_tokens_costs_acceptance_not_exactness(tiny_pair, reference):
    # In the vocabulary but not what the draft holds: the target verifies them (rejected there), and the
    # draft, answering from its own cache, hears verdicts on blocks it did not send: its next trees miss.
    outs, status, _, _ = run(tiny_pair, corrupt=lambda tree: _shift(tree, 1) if tree.step % 2 else tree)
    assert outs == reference


def test_tree_messages_round_trip_and_malformed_ones_are_refused():
    tree = DraftTree(7, [SeqTree("r0", 12, [0, 1], [5, 9], [[1, 2, 3], [4]])], 0.002)
    assert decode(encode(tree)) == tree
    with pytest.raises(ValueError, match="differ"):
        SeqTree("r0", 12, [0, 1], [5], [[1], [2]])
    bad = msgpack.packb({"v": 6, "type": "DraftTree", "body": {"step": 1, "trees": [{"request_id": "r", "base_len": 1, "accepted": [0],
                                                                                  "tokens": [1, 2], "branches": [[3]]}], "elapsed_s": 0.0}})
    with pytest.raises(ProtocolError):
        decode(bad)
    with pytest.raises(ProtocolError):
        decode(msgpack.packb({"v": 6, "type": "DraftTree", "body": {"step": 1, "trees": [], "elapsed_s": -1.0}}))


class _Endpoint:
    """Stands for a socket to a draft (only what the pool reads here: it sends trees, has a delay)."""

    trees = True

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def poll(self, timeout_s: float = 0.0) -> bool:
        return False


def test_an_emulated_link_delays_a_tree_by_a_round_trip_after_its_request_left():
    pool = DraftPool(discover=dict, connect=None, hello=Hello("t0", {"vocab_size": 64}), reopen=lambda rid: OpenSeq(rid, [1, 2, 3]),
                     background=False, trees=True)
    pool._ready.put(_Draft("d0", _Endpoint(0.05), {"trees": True}))  # adopted as a connected draft is
    pool.poll()
    draft = pool.drafts["d0"]
    assert draft.trees
    pool.open("r0")
    draft.opens = []  # (as if the open went out with an earlier request)
    pool.result(VerifyResult("r0", 3, 0, [7]))
    draft.sent_at[5] = 100.0
    pool._store_tree(draft, DraftTree(5, [SeqTree("r0", 3, [0], [7], [[11, 12, 13]])], 0.01))
    assert pool.trees["r0"][3] == pytest.approx(100.0 + 2 * 0.05 + 0.01)
    assert pool._from_tree(draft, ["r0"], [2], True, now=100.05) is None  # not arrived yet
    blocks = pool._from_tree(draft, ["r0"], [2], True, now=100.2)
    assert blocks["r0"].draft_token_ids == [11, 12] and blocks["r0"].base_len == 4
    assert "r0" not in pool.trees  # a tree answers one verdict
