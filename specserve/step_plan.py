"""What both target engines do around the controller each step: the draft length of each sequence
(``plan_draft_lengths``), a new sequence's first step without drafts (``hold_first_blocks``), and the
step's record the controller learns from (``StepRecord``, ``observe``). Knows nothing of models."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .adaptive import SpeculationController


@dataclass
class StepRecord:
    """What one verify step measured; the controller learns from it and the engines add it up."""

    batch_size: int  # sequences verified
    tokens_per_row: int  # 1 + the longest draft block verified
    target_s: float  # the step's whole cost but the wait for the drafts: the verify, scheduling, bookkeeping
    outcome: object | None = None  # the drafts' ``ProposeOutcome`` for this step's blocks (None: nothing asked)
    num_blocks: int = 0  # non-empty draft blocks verified
    num_hits: int = 0  # of which answered from the speculation cache
    asked: dict = field(default_factory=dict)  # request id -> k asked of the drafts for these blocks
    cache_only: bool = False  # the drafts were told to answer from their speculation caches only
    warm: frozenset = frozenset()  # the sequences the ask before asked for at least as many tokens


def warm_rows(previous: dict | None, asked: dict) -> frozenset:
    """The sequences asked now that were asked last time for at least as many tokens (the drafts then
    drafted ahead for them): only their blocks say what the cache covers. Per sequence, not per step:
    under sustained load nearly every step also asks a sequence new to speculation."""
    return frozenset(rid for rid, k in asked.items() if previous and previous.get(rid, 0) >= k)


def observe(controller: SpeculationController, record: StepRecord) -> None:
    o = record.outcome
    if o is not None:
        # A block says how much of it the cache held in either mode: the draft looks there first, and
        # drafts ahead in the same time (the verify and the link) whether or not it drafts the misses,
        # so a cache-only arm's coverage stays measured while a drafting arm runs.
        for rid, k in record.asked.items():
            block = o.blocks.get(rid)
            # (no block: that draft failed or lost the sequence, which says nothing of its cache)
            if block is not None and rid in record.warm:
                controller.observe_coverage(k, block.num_cached, record.batch_size)
    if o is None:
        controller.observe_step(record.batch_size, record.tokens_per_row, record.target_s)
    else:
        controller.observe_step(record.batch_size, record.tokens_per_row, record.target_s, o.wait_s, o.compute_s + o.queue_s,
                                o.draft_step_s, record.num_blocks, record.num_hits)


def plan_draft_lengths(controller: SpeculationController, batch_size: int, have_draft: bool,
                       rows: Iterable[tuple[str, int, bool]], cache: bool = False, seeded: bool | None = None) -> dict[str, int]:
    """This step's draft length per sequence, from (request id, room, seeded and sampled) rows;
    ``controller.cache_only`` then says whether the drafts answer from their caches alone.

    Every row gets the controller's k for the batch, capped by its room (max_tokens, context); a
    seeded sampled request keeps the configured k and full blocks, because block boundaries decide
    which draws become which tokens. Rows that get 0 ask the draft nothing this step. ``seeded``
    (whether any row is seeded and sampled), when the caller knows it, spares reading the rows on a
    step whose k is 0."""
    if seeded is None:
        rows = list(rows)
        seeded = any(s for _, _, s in rows)
    k = controller.choose(batch_size, have_draft, cache and not seeded)
    fixed = controller.max_k if have_draft else 0
    if k == 0 and not (seeded and fixed):
        return {}
    out = {}
    for rid, room, seeded_sampled in rows:
        n = min(fixed if seeded_sampled else k, room)
        if n > 0:
            out[rid] = n
    return out


def hold_first_blocks(wants: dict[str, int], new_ids: Iterable[str], speculates_first: Callable) -> bool:
    """A new sequence's first step goes without drafts, so neither its first token nor the batch waits
    for the draft to prefill its prompt (the draft catches up from the verdict and drafts its first
    block ahead meanwhile). ``speculates_first(rid)``: a sequence that keeps its block (a seeded
    sampled request, whose draws follow block boundaries). True when a block was held back: the
    new sequence's open must still go out this step."""
    held = False
    for rid in new_ids:
        if not speculates_first(rid):
            held = wants.pop(rid, None) is not None or held
    return held
