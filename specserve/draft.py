"""The draft side: each sequence's committed tokens, and the protocol every drafter speaks.

Data flow per ``ProposeRequest`` (``DraftSide.handle``, on the critical path): close and
open sequences; apply each ``VerifyResult`` in O(1) (keep the KV of ``base_len +
num_accepted`` tokens, splice ``token_ids`` onto the committed list); answer a block of
``k`` draft tokens per wanted sequence from the drafter. After the reply has left,
``DraftSide.prepare`` lets the drafter work ahead (``model_drafter.ModelDrafter``: the
speculation cache). ``NgramDrafter`` (prompt lookup) needs no model.

KV asymmetry (stated once): a block drafted now leaves the KV holding the committed tokens
plus d_1..d_{k-1}; if i < k drafts are accepted the KV is cut to base_len + i; if all k are,
the draft has not yet seen d_k nor the bonus token and feeds both next time. Both cases are
"keep min(num_fed, base_len + num_accepted), feed the rest". Knows nothing of transports.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from .logits_processing import SeqProcessor
from .messages import (MAX_DRAFT_TOKENS, MAX_TREE_BRANCHES, DraftBlock, DraftProcessing, DraftStats, DraftTree, OpenSeq, ProposeReply, ProposeRequest,
                       SeqTree, VerifyResult)
from .ngram import ngram_propose

logger = logging.getLogger(__name__)


@dataclass
class Branch:
    """A block drafted ahead for one possible verdict."""

    token_ids: list[int]  # drafts continuing the verdict's token
    probs: list[np.ndarray]  # [len(token_ids)] q rows (sampled requests with probabilities), else empty
    cands: list[tuple[list[int], list[float]]]  # per draft slot: the draft's likeliest tokens and their q
    rows: list = field(default_factory=list)  # a draft head's own output row per draft (its next input), else empty


@dataclass
class DraftSeq:
    request_id: str
    key: str  # the backend's sequence id (unique across every target connected to this draft)
    token_ids: list[int]  # committed tokens, as the target last reported them
    temperature: float
    top_k: int
    top_p: float
    seed: int
    num_fed: int = 0  # KV entries the backend holds: committed tokens, then block tokens
    block: list[int] = field(default_factory=list)  # the drafts last sent
    block_base: int = -1  # committed length the block continues
    block_probs: list[np.ndarray] = field(default_factory=list)
    block_cands: list[tuple[list[int], list[float]]] = field(default_factory=list)  # per block slot + bonus slot
    cache: dict[tuple[int, int], Branch] = field(default_factory=dict)  # (num_accepted, token) -> branch
    num_asked: int = 0  # draft tokens the target last asked for (the depth drafting ahead aims at)
    vocab_limit: int | None = None  # the target emits ids below this only (a wider draft LM head is masked to it)
    verdict: tuple[int, int, int] | None = None  # (base_len, num_accepted, last token) of the last result
    hidden: list = field(default_factory=list)  # [(first position, [rows, width] tensor)]: target rows a head has not read
    seeded: bool = False  # the request's own seed (a head keeps no speculation cache for it when sampled)
    rows_combined: bool = False  # the target sends a head's rows through its fc already (speculation.head_fc)
    processing: DraftProcessing | None = None  # the target's processing beyond temperature / top-k / top-p, if any
    _processor: tuple | None = None  # (logits width, its SeqProcessor), built on first use

    def processor(self, width: int) -> SeqProcessor | None:
        """The processing as a ``SeqProcessor`` over logits ``width`` wide (None: no processing)."""
        if self.processing is None:
            return None
        if self._processor is None or self._processor[0] != width:
            p = self.processing
            self._processor = (width, SeqProcessor(p, self.token_ids[: p.prompt_len], width, set(p.stop_token_ids), p.bad_words))
        return self._processor[1]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def new_block(self, k: int) -> None:
        """Start an empty block of up to ``k`` drafts after the committed tokens (its cache is the caller's)."""
        self.block, self.block_base, self.num_asked, self.block_probs, self.block_cands = [], len(self.token_ids), k, [], []


@dataclass
class Proposal:
    token_ids: list[int]  # [num_draft]
    probs: np.ndarray | None = None  # [num_draft, vocab] float32, or None for a point mass
    num_cached: int = 0  # the first this many came from the speculation cache


class Drafter(Protocol):
    """Proposes draft tokens; ``prepare`` (optional work off the critical path) may be a no-op."""

    def open(self, seq: DraftSeq) -> None: ...

    def close(self, seq: DraftSeq) -> None: ...

    def propose(self, seqs: list[DraftSeq], ks: list[int], draft_misses: bool = True) -> list[Proposal]: ...

    def prepare(self, seqs: list[DraftSeq], should_stop: Callable[[], bool], budget_s: float = 0.0) -> None: ...

    def rollback(self, seq: DraftSeq, num_tokens: int) -> None: ...

    def step_time(self, batch_size: int) -> float: ...  # one forward at this batch size (hidden time, controller)

    num_forwards: int  # forwards of the last propose (the critical path) ...
    forward_s: float  # ... and their time
    step_time_s: float  # step_time(1), for metrics


class NgramDrafter:
    """Prompt lookup; proposals are deterministic, so only token ids cross the wire."""

    num_forwards = 0
    forward_s = 0.0
    step_time_s = 0.0

    def step_time(self, batch_size: int) -> float:
        return 0.0

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= ngram_min <= ngram_max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def open(self, seq: DraftSeq) -> None:
        pass

    def close(self, seq: DraftSeq) -> None:
        pass

    def propose(self, seqs: list[DraftSeq], ks: list[int], draft_misses: bool = True) -> list[Proposal]:
        return [Proposal(ngram_propose(s.token_ids, k, self.min_n, self.max_n) if k else []) for s, k in zip(seqs, ks)]

    def prepare(self, seqs, should_stop, budget_s: float = 0.0) -> None:
        pass

    def rollback(self, seq: DraftSeq, num_tokens: int) -> None:
        pass


class DraftSide:
    """Owns one target connection's sequences; speaks ``ProposeRequest`` -> ``ProposeReply``."""

    def __init__(self, drafter: Drafter, namespace: str = "", vocab_limit: int | None = None, max_seqs: int | None = None,
                 rows_combined: bool = False):
        self.drafter = drafter
        self.namespace = namespace
        self.rows_combined = rows_combined  # this target applies the head's fc to the rows it sends
        self.max_seqs = max_seqs  # sequences this connection may hold open; the rest are refused
        backend = getattr(drafter, "backend", None)
        self.max_len = getattr(backend, "max_model_len", None)  # a sequence past the draft's context cannot be drafted for
        self.vocab_limit = vocab_limit  # the target's vocabulary size when the draft's LM head is wider
        self.seqs: dict[str, DraftSeq] = {}
        self._proposed: list[DraftSeq] = []  # sequences whose block prepare() continues
        self._behind: list[DraftSeq] = []  # sequences given tokens without a block: prepare() feeds them
        self._budget_s = 0.0  # the target's estimate of the time until its next request
        self._recent_k = 0  # the k last asked: a new sequence's first block when its open comes with no ask
        self._tree_seqs: list[DraftSeq] = []  # the sequences of the last request with ``tree`` set (``tree``)

    def open(self, msg: OpenSeq) -> None:
        if msg.request_id in self.seqs:  # re-open (resync): start from the target's tokens
            self.close(msg.request_id)
        seq = DraftSeq(msg.request_id, f"{self.namespace}{msg.request_id}", list(msg.token_ids), msg.temperature,
                       msg.top_k, msg.top_p, msg.seed, vocab_limit=self.vocab_limit, seeded=msg.seeded,
                       rows_combined=self.rows_combined, processing=msg.processing)
        if msg.hidden_states is not None:
            seq.hidden.append((len(msg.token_ids) - 1 - msg.hidden_states.shape[0], msg.hidden_states))
        self.drafter.open(seq)
        self.seqs[msg.request_id] = seq

    def close(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.drafter.close(seq)

    def close_all(self) -> None:
        for rid in list(self.seqs):
            self.close(rid)

    def apply(self, seq: DraftSeq, r: VerifyResult) -> None:
        """O(1) rollback: keep the KV of base_len + num_accepted tokens, splice the new ones."""
        assert r.base_len <= len(seq.token_ids)
        valid = min(seq.num_fed, r.base_len + r.num_accepted)
        if valid < seq.num_fed:
            seq.num_fed = valid
            self.drafter.rollback(seq, valid)
        del seq.token_ids[r.base_len :]
        seq.token_ids.extend(r.token_ids)
        if r.hidden_states is not None:
            seq.hidden.append((r.committed_len - 1 - r.hidden_states.shape[0], r.hidden_states))
        seq.verdict = r.verdict

    def handle(self, req: ProposeRequest) -> ProposeReply:
        start = time.perf_counter()
        for c in req.closes:
            self.close(c.request_id)
        if req.live is not None:  # reconcile: free whatever the target no longer has here
            keep = set(req.live) | {o.request_id for o in req.opens}
            for rid in [r for r in self.seqs if r not in keep]:
                self.close(rid)
        refused = []
        for o in req.opens:
            if (self.max_seqs is not None and o.request_id not in self.seqs and len(self.seqs) >= self.max_seqs) or (
                    self.max_len is not None and len(o.token_ids) >= self.max_len):
                refused.append(o.request_id)
                continue
            self.open(o)
        missing = []
        for r in req.results:
            seq = self.seqs.get(r.request_id)
            if r.request_id in refused:
                continue
            if seq is None or len(seq.token_ids) < r.base_len:
                missing.append(r.request_id)
                continue
            if self.max_len is not None and r.committed_len >= self.max_len:  # past the draft's context: let it go
                self.close(r.request_id)
                refused.append(r.request_id)
                continue
            self.apply(seq, r)
        lost = set(missing) | set(refused)
        wanted = [(self.seqs[rid], k) for rid, k in zip(req.request_ids, req.num_draft_tokens) if rid in self.seqs and rid not in lost]
        missing += [rid for rid in req.request_ids if rid not in self.seqs and rid not in lost]
        missing = [rid for rid in missing if rid not in refused]
        seqs, ks = [s for s, _ in wanted], [k for _, k in wanted]
        asked = {s.request_id for s in seqs}
        # Sequences told of without a block (new ones, or given tokens while the target asked nothing):
        # prepare() feeds them, so their next block starts warm.
        told = [r.request_id for r in req.results] + [o.request_id for o in req.opens]
        self._behind = [self.seqs[rid] for rid in dict.fromkeys(told) if rid in self.seqs and rid not in asked]
        proposals = self.drafter.propose(seqs, ks, req.draft_misses)
        blocks = [DraftBlock(s.request_id, len(s.token_ids), p.token_ids, p.probs, p.num_cached) for s, p in zip(seqs, proposals)]
        # Asked-for sequences get drafted ahead, an empty block too (a cache-only miss): its next
        # verdict is the target's own next token, which the tree can foresee.
        self._proposed = [s for s, p in zip(seqs, proposals) if p.token_ids or s.num_asked]
        k = max(ks, default=0)
        if k:  # (a push asks nothing and sends no budget: its first blocks take the last ones)
            self._recent_k, self._budget_s = k, req.budget_s
            if req.acceptance and hasattr(self.drafter, "acceptance"):  # the target's estimate sizes the trees
                self.drafter.acceptance[: len(req.acceptance)] = req.acceptance
        self._proposed += self._first_blocks(req, asked, k or self._recent_k)
        self._tree_seqs = list(self._proposed) if req.tree else []
        step = self.drafter.step_time(max(1, len(seqs)))
        hidden = sum(p.num_cached for p in proposals) * step
        stats = DraftStats(compute_s=time.perf_counter() - start, forward_s=self.drafter.forward_s,
                           num_forwards=self.drafter.num_forwards, hidden_s=hidden, draft_step_s=step)
        return ProposeReply(req.step, blocks, missing, stats, refused)

    def _first_blocks(self, req: ProposeRequest, asked: set[str], k: int) -> list[DraftSeq]:
        """Sequences opened with no block asked (a prompt the target prefills in this step's verify, or
        whose first token a vLLM target just took from its prefill): drafted ahead from an empty block at
        their prompt's end, so their first block is cached when the target asks. Drafted when asked
        instead, it held up the whole batch for k forwards (at batch 32 on the simulated Spark + 5090 a
        new request arrives nearly every step). ``k``: the step's, or with nothing asked (the open
        pushed alone) the last k asked."""
        fresh = []
        for o in req.opens if k else ():
            s = self.seqs.get(o.request_id)
            if s is not None and o.request_id not in asked and not s.block:
                s.new_block(k)
                fresh.append(s)
        return fresh

    def tree(self, step: int, elapsed_s: float = 0.0) -> DraftTree:
        """The speculation cache of the last ``tree`` request's greedy sequences, as it stands (call it once
        drafting ahead stops: the next request's blocks come from exactly this cache). Each branch is cut
        where ``propose`` would cut it, at the draft's context."""
        trees = []
        for s in self._tree_seqs:
            if self.seqs.get(s.request_id) is not s or not s.greedy:
                continue
            accepted, tokens, branches = [], [], []
            for (j, token), branch in list(s.cache.items())[:MAX_TREE_BRANCHES]:
                room = len(branch.token_ids) if self.max_len is None else self.max_len - (s.block_base + j + 1)
                accepted.append(j)
                tokens.append(token)
                branches.append(list(branch.token_ids[:max(0, min(room, MAX_DRAFT_TOKENS))]))
            trees.append(SeqTree(s.request_id, s.block_base, accepted, tokens, branches))
        self._tree_seqs = []
        return DraftTree(step, trees, elapsed_s)

    def prepare(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Work for the next request, off the critical path (the speculation cache)."""
        seqs = [s for s in self._proposed if self.seqs.get(s.request_id) is s]
        behind = [s for s in self._behind if self.seqs.get(s.request_id) is s]
        self._proposed, self._behind = [], []
        if seqs:
            self.drafter.prepare(seqs, should_stop, self._budget_s)
        catch_up = getattr(self.drafter, "catch_up", None)
        if behind and catch_up is not None:
            catch_up(behind, should_stop)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)
