"""The draft side: O(1) rollback from verify results, and the speculation cache (drafting ahead)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve.backends.hf import HFBackend
from specserve.draft import DraftSide
from specserve.model_drafter import ModelDrafter
from specserve.messages import OpenSeq, ProposeRequest, VerifyResult


def rescan_common_prefix(fed: list[int], committed: list[int]) -> int:
    """The reference rollback rule, by rescanning: compare what was fed with what is committed."""
    n = 0
    while n < min(len(fed), len(committed)) and fed[n] == committed[n]:
        n += 1
    return min(n, len(committed) - 1)


def greedy_drafts(model, context: list[int], k: int) -> list[int]:
    out = []
    with torch.no_grad():
        for _ in range(k):
            out.append(int(model(torch.tensor([context + out])).logits[0, -1].argmax()))
    return out


@pytest.mark.parametrize("ahead", [False, True])
def test_o1_rollback_matches_rescan_on_random_traces(tiny_pair, ahead):
    """Random accept/reject/bonus traces: after every verify result the draft keeps exactly the
    KV the old full rescan kept, and its next block equals greedy drafting from scratch."""
    rng = random.Random(7)
    backend = HFBackend(tiny_pair["perturbed"], dtype="float64")
    model = AutoModelForCausalLM.from_pretrained(tiny_pair["perturbed"], dtype=torch.float64).eval()
    side = DraftSide(ModelDrafter(backend, fanout=2 if ahead else 0))
    prompts = {f"r{i}": [rng.randrange(4, 60) for _ in range(rng.randrange(1, 9))] for i in range(3)}
    for rid, p in prompts.items():
        side.open(OpenSeq(rid, p))
    committed = {rid: list(p) for rid, p in prompts.items()}
    hits = 0
    for step in range(25):
        ks = [rng.randrange(1, 6) for _ in prompts]
        reply = side.handle(ProposeRequest(step, [], [], [], list(prompts), ks))
        for block, k in zip(reply.blocks, ks):
            assert block.base_len == len(committed[block.request_id])
            assert block.draft_token_ids == greedy_drafts(model, committed[block.request_id], k)
            hits += block.cache_hit
        side.prepare()  # drafting ahead moves the KV too (the glue forward feeds the whole block)
        for block in reply.blocks:
            rid, seq = block.request_id, side.seqs[block.request_id]
            drafts = block.draft_token_ids
            fed = (committed[rid] + drafts)[: seq.num_fed]
            assert backend.num_cached(seq.key) == seq.num_fed
            a = rng.randrange(0, len(drafts) + 1)
            # The next token: a genuine rejection never re-emits the rejected draft. Half the time
            # take the draft's own next-likeliest token, so the speculation cache can hit.
            cands = seq.block_cands[a][0] if seq.block_cands and a < len(seq.block_cands) else []
            options = [t for t in (cands if rng.random() < 0.5 else []) + [rng.randrange(4, 60) for _ in range(8)]
                       if a == len(drafts) or t != drafts[a]]
            appended = drafts[:a] + [options[0]]
            new_committed = committed[rid] + appended
            kept_by_rescan = rescan_common_prefix(fed, new_committed)
            before = seq.num_fed
            side.apply(seq, VerifyResult(rid, block.base_len, a, appended))
            assert seq.num_fed == min(before, block.base_len + a) == min(before, kept_by_rescan)
            assert seq.token_ids == new_committed
            assert backend.num_cached(seq.key) == seq.num_fed
            committed[rid] = new_committed
    if ahead:
        assert hits > 0, "the random traces never hit the speculation cache"


def test_apply_is_constant_time_in_the_context_length(tiny_pair):
    """The rollback touches the tail only: a long committed list is never copied or rescanned."""
    backend = HFBackend(tiny_pair["perturbed"], dtype="float64", max_model_len=256)
    side = DraftSide(ModelDrafter(backend))

    class CountingList(list):
        copies = 0

        def __getitem__(self, i):
            if isinstance(i, slice) and (i.stop or len(self)) - (i.start or 0) > 16:
                CountingList.copies += 1
            return super().__getitem__(i)

    side.open(OpenSeq("r", [5] * 200))
    seq = side.seqs["r"]
    seq.token_ids = CountingList(seq.token_ids)
    side.handle(ProposeRequest(1, [], [], [], ["r"], [4]))
    CountingList.copies = 0
    side.apply(seq, VerifyResult("r", 200, 2, seq.block[:2] + [7]))
    assert CountingList.copies == 0 and len(seq.token_ids) == 203


HOST_A, HOST_B = "boot-a", "boot-b"


def _where(host, cpus, device="cpu", gpu=None, simulated=False) -> dict:
    return {"host": host, "cpus": cpus, "device": device, "gpu": gpu, "simulated": simulated}


@pytest.mark.parametrize("target, draft, ahead", [
    (_where(HOST_A, [0]), _where(HOST_A, [1]), True),  # one host, disjoint cores (two pinned Ray nodes)
    (_where(HOST_A, [0, 1]), _where(HOST_A, [1, 2]), False),  # one host, overlapping cores
    (_where(HOST_A, [0, 1]), _where(HOST_A, [0, 1]), False),  # one process (in-process LLM): the same cores
    (_where(HOST_A, [0, 1]), _where(HOST_B, [0, 1]), True),  # two hosts (same core numbers mean nothing)
    (_where(HOST_A, [0], "cuda:0", "GPU-0"), _where(HOST_A, [0], "cuda:1", "GPU-1"), True),  # two GPUs of one host
    (_where(HOST_A, [0], "cuda:0", "GPU-0"), _where(HOST_A, [1], "cuda:0", "GPU-0"), False),  # one GPU
    (_where(HOST_A, [0, 1]), _where(HOST_A, [0, 1], "cuda:0", "GPU-0"), True),  # the draft on a GPU, the target on CPUs
    (_where(HOST_A, [0, 1]), _where(HOST_A, [0, 1], simulated=True), True),  # a modelled device of its own
    (None, _where(HOST_A, [0]), True),  # a target that does not say where it runs: assumed separate
])
def test_auto_drafting_ahead_is_off_only_where_the_draft_shares_its_targets_compute(target, draft, ahead):
    from specserve.draft import NgramDrafter
    from specserve.draft_service import DraftService
    from specserve.messages import Hello

    class CachingDrafter(NgramDrafter):
        fanout = 2  # pretends to keep a speculation cache: only the placement decides

    service = DraftService(CachingDrafter(), None, "d0", {"placement": draft}, ahead="auto")  # no vocabulary to match
    reply = service.hello("c0", Hello("t0", {"tokenizer_sha": None, "vocab_size": 8}, {"placement": target} if target else {}))
    assert reply.error is None
    assert ("c0" not in service.no_ahead) is ahead
    assert reply.info["draft_ahead"] is ahead and reply.info["draft_ahead_reason"].startswith("auto, ")
    assert service.metrics()["by_target"]["t0"]["draft_ahead"] is ahead


def test_placement_reports_this_process():
    import os

    from specserve.devices import placement, shares_compute

    here = placement("cpu")
    assert here["cpus"] == sorted(os.sched_getaffinity(0)) and here["host"] and here["gpu"] is None
    assert shares_compute(here, placement("cpu")) == (True, f"same host, overlapping CPU cores ({len(here['cpus'])} shared)")


@pytest.mark.parametrize("ahead, expected", [(True, True), (False, False)])
def test_explicit_drafting_ahead_overrides_the_placement(ahead, expected):
    from specserve.draft import NgramDrafter
    from specserve.draft_service import DraftService
    from specserve.messages import Hello

    class CachingDrafter(NgramDrafter):
        fanout = 2

    service = DraftService(CachingDrafter(), None, "d0", {"placement": _where(HOST_A, [0])}, ahead=ahead)
    reply = service.hello("c0", Hello("t0", {"tokenizer_sha": None, "vocab_size": 8}, {"placement": _where(HOST_A, [0])}))
    assert reply.info["draft_ahead"] is expected


def test_tokens_sent_without_a_block_request_are_fed_off_the_critical_path(tiny_pair):
    """A pushed delta (results, nothing asked): prepare() feeds it, all but the last token."""
    from specserve.backends.hf import HFBackend
    from specserve.draft import DraftSide
    from specserve.messages import OpenSeq, ProposeRequest, VerifyResult
    from specserve.model_drafter import ModelDrafter

    side = DraftSide(ModelDrafter(HFBackend(tiny_pair["perturbed"], dtype="float64"), fanout=2))
    side.handle(ProposeRequest(1, opens=[OpenSeq("r", [1, 2, 3])], request_ids=["r"], num_draft_tokens=[2]))
    side.prepare()
    seq = side.seqs["r"]
    side.handle(ProposeRequest(2, results=[VerifyResult("r", 3, 0, [9, 10, 11, 12])]))  # nothing asked
    side.prepare()
    assert seq.token_ids == [1, 2, 3, 9, 10, 11, 12] and seq.num_fed == 6  # the KV holds all but the last token
    reply = side.handle(ProposeRequest(3, request_ids=["r"], num_draft_tokens=[2]))
    assert len(reply.blocks[0].draft_token_ids) == 2 and reply.blocks[0].base_len == 7


def test_trees_shrink_when_the_next_request_waits_for_them_and_regrow(tiny_pair):
    """A tree the next request had to wait for was too big for the time the target really left: the
    share of the budget trees get falls (x0.7 each time, not below a tenth) and comes back while
    trees finish in time; the tree itself stops at the first depth boundary after the request came."""
    side = DraftSide(ModelDrafter(HFBackend(tiny_pair["perturbed"], dtype="float64"), fanout=2))
    drafter = side.drafter
    side.handle(ProposeRequest(1, opens=[OpenSeq("r", [1, 2, 3])], request_ids=["r"], num_draft_tokens=[3]))
    # The request arrives during the tree's second depth (its first is in the glue's call: no check before it).
    waiting = iter([False, False, True])
    side.prepare(lambda: next(waiting, True))
    assert drafter.last_tree[1] == 2 and drafter.budget_scale == pytest.approx(0.7)
    for step in range(2, 12):
        block = side.handle(ProposeRequest(step, results=[VerifyResult("r", len(side.seqs["r"].token_ids), 0, [5])],
                                           request_ids=["r"], num_draft_tokens=[3])).blocks[0]
        assert block.base_len == len(side.seqs["r"].token_ids)
        checks = iter([False] if step < 8 else [])  # (before 8: the request comes during the tree)
        side.prepare(lambda: next(checks, step < 8))
    assert drafter.budget_scale == pytest.approx(0.1 * 1.05 ** 4)  # floored at a tenth, then four trees in time
    side.handle(ProposeRequest(12, results=[VerifyResult("r", len(side.seqs["r"].token_ids), 0, [5])], request_ids=["r"],
                               num_draft_tokens=[3]))
    side.prepare(lambda: True)  # a request already waiting: no tree, nothing learnt
    assert drafter.budget_scale == pytest.approx(0.1 * 1.05 ** 4)


@pytest.mark.parametrize("prompt_len", [4, 12])  # glued with the other rows, or alone after their tree
def test_a_prompt_opened_while_others_speculate_gets_its_first_block_drafted_ahead(tiny_pair, prompt_len):
    """A prompt the target prefills inside its verify (opened, nothing asked for it yet) while other
    sequences speculate: prepare() feeds the prompt and grows a tree over its first token's likeliest
    values, so the block after the first token comes from the cache, equal to drafting it afresh."""
    model = AutoModelForCausalLM.from_pretrained(tiny_pair["perturbed"], dtype=torch.float64).eval()
    side = DraftSide(ModelDrafter(HFBackend(tiny_pair["perturbed"], dtype="float64"), fanout=2))
    side.handle(ProposeRequest(1, opens=[OpenSeq("old", [1, 2, 3])], request_ids=["old"], num_draft_tokens=[3]))
    side.prepare()
    prompt = [7 + i % 40 for i in range(prompt_len)]
    side.handle(ProposeRequest(2, results=[VerifyResult("old", 3, 0, [5])], opens=[OpenSeq("new", prompt)],
                               request_ids=["old"], num_draft_tokens=[3]))
    side.prepare()
    assert side.seqs["new"].num_fed == prompt_len  # the whole prompt: its last logits give the first token's candidates
    first = greedy_drafts(model, prompt, 1)[0]  # the target's first token (here the draft's own guess)
    reply = side.handle(ProposeRequest(3, results=[VerifyResult("new", prompt_len, 0, [first])], request_ids=["new"],
                                       num_draft_tokens=[3]))
    block = reply.blocks[0]
    assert block.cache_hit and block.base_len == prompt_len + 1
    assert block.draft_token_ids == greedy_drafts(model, prompt + [first], 3)


def test_a_prompt_pushed_alone_gets_its_first_block_drafted_ahead_with_the_last_k(tiny_pair):
    """A vLLM target takes a new prompt's first token from its prefill and pushes the open with nothing
    asked (a batch of one asks nothing that step): the draft drafts its next block ahead all the same,
    with the k and budget it was last asked for, so the target's next ask is a hit."""
    model = AutoModelForCausalLM.from_pretrained(tiny_pair["perturbed"], dtype=torch.float64).eval()
    side = DraftSide(ModelDrafter(HFBackend(tiny_pair["perturbed"], dtype="float64"), fanout=2))
    pushed = ProposeRequest(1, opens=[OpenSeq("early", [4, 5, 6])])  # before any ask: no k known, nothing ahead
    side.handle(pushed)
    side.prepare()
    assert side.seqs["early"].block == [] and side.seqs["early"].num_fed == 2  # only fed (all but the last token)
    side.handle(ProposeRequest(2, opens=[OpenSeq("old", [1, 2, 3])], request_ids=["old"], num_draft_tokens=[3], budget_s=5.0))
    side.prepare()
    prompt = [9, 10, 11, 12, 13]
    side.handle(ProposeRequest(3, opens=[OpenSeq("new", prompt)], closes=[]))  # the open pushed alone
    side.prepare()
    nxt = greedy_drafts(model, prompt, 1)[0]  # the target's next token (here the draft's own guess)
    reply = side.handle(ProposeRequest(4, results=[VerifyResult("new", len(prompt), 0, [nxt])], request_ids=["new"],
                                       num_draft_tokens=[3]))
    block = reply.blocks[0]
    assert block.cache_hit and block.base_len == len(prompt) + 1
    assert block.draft_token_ids == greedy_drafts(model, prompt + [nxt], 3)


def test_the_glues_call_starts_the_tree_so_a_rejection_inside_the_block_finds_two_drafts_after_one_more_call(tiny_pair):
    """The glue and the tree's first depth share one call: after it and one depth more, a verdict that rejects
    the block's second draft (a branch the glue did not need) finds two cached drafts, each the draft's own
    greedy continuation; the verdict that accepts the whole block (its token is the glue's output) finds one."""
    model = AutoModelForCausalLM.from_pretrained(tiny_pair["perturbed"], dtype=torch.float64).eval()
    side = DraftSide(ModelDrafter(HFBackend(tiny_pair["perturbed"], dtype="float64"), fanout=2))
    prompt = [3, 8, 13, 18]
    block = side.handle(ProposeRequest(1, opens=[OpenSeq("r", prompt)], request_ids=["r"], num_draft_tokens=[3])).blocks[0]
    drafts = block.draft_token_ids
    assert drafts == greedy_drafts(model, prompt, 3)
    checks = iter([False, False])  # before drafting ahead, before the second tree call; then the request is waiting
    side.prepare(lambda: next(checks, True))
    s = side.seqs["r"]
    assert side.drafter.last_tree[1] == 2 and s.num_fed == len(prompt) + 3  # the block was fed (the glue) as well
    with torch.no_grad():
        second = model(torch.tensor([prompt + drafts[:1]])).logits[0, -1].topk(2).indices.tolist()
    rejected = next(t for t in second if t != drafts[1])  # the draft's likeliest other token at the block's 2nd draft
    bonus = greedy_drafts(model, prompt + drafts, 1)[0]
    assert len(s.cache[(1, rejected)].token_ids) == 2 and len(s.cache[(3, bonus)].token_ids) == 1
    reply = side.handle(ProposeRequest(2, results=[VerifyResult("r", len(prompt), 1, [drafts[0], rejected])], request_ids=["r"],
                                       num_draft_tokens=[3], draft_misses=False))
    hit = reply.blocks[0]
    assert hit.cache_hit and hit.draft_token_ids == greedy_drafts(model, prompt + [drafts[0], rejected], 2)


@pytest.mark.parametrize("per_call_s, per_row_s, folded", [(0.1, 0.0, True), (0.0, 0.1, False)])
def test_the_glue_shares_its_call_with_the_tree_only_where_the_rows_cost_no_depth(tiny_pair, per_call_s, per_row_s, folded):
    """The plan, from the tree forwards' measured cost by rows: where a call's cost is fixed, the glue's call carries
    the tree's first depth; where rows cost time and the extra rows would cost the tree a depth, the glue keeps its
    own call; and it keeps it where no chosen root can start in it (the bonus verdicts need the glue's output)."""
    drafter = ModelDrafter(HFBackend(tiny_pair["perturbed"], dtype="float64"), fanout=2)
    for rows in (1, 2, 4, 8):
        for _ in range(2):
            drafter.tree_cost.add(rows, per_call_s + per_row_s * rows)
    # One sequence, the glue feeding one token: a root rejecting draft 0 (token 7), or a bonus root (token -1).
    roots = [[(0.6, 0, 7)], [(0.6, 3, -1)]]
    # Apart: 0.85 x (0.4 - c(1 row)) buys 2 depths of one lane either way; folded, flat calls leave it 2 and
    # per-row costs 1 (0.85 x (0.4 - c(2 rows)) = 0.17 < 2 x 0.1).
    assert drafter._fold_plan(roots[:1], 3, 1, 1, 0.4) == ((1, 2) if folded else None)
    assert drafter._fold_plan([roots[1]], 3, 1, 1, 0.4) is None  # only a bonus root: nothing to start in the glue's call
    assert drafter._fold_plan(roots[:1], 3, 1, 1, 0.0) == (1, 3)  # no budget known: the whole tree, folded
