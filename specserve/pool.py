"""The target's view of its drafts: which draft each sequence uses and what each has yet to hear.

Data flow: ``open`` assigns a new sequence to the least-loaded live draft (sticky for the
sequence's life, so that draft's KV stays warm) and queues its ``OpenSeq``; ``result`` and
``close`` queue deltas for that draft (one sequence's results coalesce while nothing is
drafted for it); ``propose`` sends one ``ProposeRequest`` to every draft with wanted
sequences before waiting on any, then collects the replies. With ``trees`` (opt-in), a draft
that drafts ahead over a socket also sends, after each request, the cache it drafted
(``DraftTree``): when that cache holds every wanted sequence's block for the verdict just
reached, ``propose`` takes the blocks from it and sends the request without waiting (the draft
answers from the same cache). A draft that fails, times out or sends garbage is dropped: its
sequences move to another live draft (re-opened with their full tokens) or continue
target-only, and move back when a draft connects. Every block a
draft returns is checked against what was asked before anyone verifies it
(``reply_check.check_block``): repaired or dropped, counted, and said once per draft. Discovery and
reconnection run on a background thread, so a dead address never stalls a step. Knows
nothing of Ray: ``discover`` returns {name: address}, ``connect`` turns one into an endpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .messages import MAX_DRAFT_TOKENS, CloseSeq, DraftBlock, DraftTree, Hello, OpenSeq, ProposeReply, ProposeRequest, VerifyResult
from .reply_check import check_block
from .transport import DraftUnavailable

logger = logging.getLogger(__name__)


@dataclass
class _Draft:
    name: str
    endpoint: object
    info: dict = field(default_factory=dict)
    seqs: set[str] = field(default_factory=set)
    opens: list[OpenSeq] = field(default_factory=list)
    results: dict[str, VerifyResult] = field(default_factory=dict)
    closes: list[CloseSeq] = field(default_factory=list)
    latency_s: float = 0.0  # running estimate of one request's round trip (requests without prompts to catch up on)
    catchup_s: float = 1e-3  # running estimate of the draft's time per prompt token it catches up on
    last_ok: float = field(default_factory=time.monotonic)  # when it last answered
    warned: bool = False  # a rejected reply was logged (once per draft)
    unread: int = 0  # replies to pushed deltas not read yet (read before the next request)
    trees: bool = False  # it sends its speculation cache after drafting ahead (DraftTree), over this endpoint
    floor_s: float | None = None  # the round trip without the draft's lag: falls fast, rises slowly
    sent_at: dict = field(default_factory=dict)  # step -> when a request asking for a tree left (delay emulation)

    @property
    def has_deltas(self) -> bool:
        return bool(self.opens or self.results or self.closes)


@dataclass
class ProposeOutcome:
    blocks: dict[str, DraftBlock]
    fallback: set[str]  # wanted sequences that got no block because no draft could answer
    wait_s: float = 0.0  # send to last reply
    queue_s: float = 0.0  # of which the slowest draft's queueing (waiting for its look-ahead to yield)
    compute_s: float = 0.0  # slowest draft's time answering (reported by the draft)
    forward_s: float = 0.0  # of which forwards
    hidden_s: float = 0.0  # drafting time the speculation caches took off the critical path
    draft_step_s: float = 0.0  # the drafts' estimate of one decode forward
    from_trees: int = 0  # blocks taken from the drafts' trees, without waiting for a reply


class DraftPool:
    def __init__(
        self,
        discover: Callable[[], dict[str, object]],
        connect: Callable[[str, object], object],
        hello: Hello,
        reopen: Callable[[str], OpenSeq | None],
        min_timeout_s: float = 0.5,
        max_timeout_s: float = 10.0,
        refresh_s: float = 1.0,
        background: bool = True,
        keep_hidden: Callable[[tuple[int, ...]], None] | None = None,
        trees: bool = False,
    ):
        """``keep_hidden(layers)``: make the target keep these layers' rows for a draft head that connects;
        ``trees``: take blocks from the trees drafts send (speculation.draft_trees)."""
        self._discover, self._connect, self._hello, self._reopen = discover, connect, hello, reopen
        self._keep_hidden = keep_hidden
        self.hidden_layers: tuple[int, ...] | None = None  # what the target keeps for its draft heads
        self.min_timeout_s, self.max_timeout_s, self.refresh_s = min_timeout_s, max_timeout_s, refresh_s
        self.drafts: dict[str, _Draft] = {}
        self.assignment: dict[str, str] = {}  # request id -> draft name
        self.orphans: set[str] = set()  # live sequences without a draft (target-only until one connects)
        self.declined: set[str] = set()  # live sequences a draft refused (over its limits): target-only for their life
        self.refused: dict[str, str] = {}  # draft name -> why it refused this target (vocabulary)
        self._closed_tensor_bytes = 0  # bytes of probabilities received over links since dropped
        self._closed_hidden_bytes = 0  # bytes of hidden-state rows sent to drafts since dropped
        self.committed: dict[str, int] = {}  # request id -> committed length, as the drafts will have heard it
        self.use_trees = trees
        # request id -> (draft name, base length, {(accepted, token): draft ids}, usable from): the last tree
        self.trees: dict[str, tuple[str, int, dict, float]] = {}
        self.treed: set[str] = set()  # live sequences a tree has held (a step waits for a tree only for them)
        self.vocab_size = int((hello.vocab or {}).get("vocab_size") or 0) or None  # ids the target can emit
        self.counters = {"num_draft_failures": 0, "num_draft_connects": 0, "num_resyncs": 0, "draft_replies_rejected": 0,
                         "num_seqs_refused": 0, "num_tree_steps": 0, "num_tree_blocks": 0}
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._queued: set[str] = set()  # connected, not yet adopted by the engine thread
        self._stop = threading.Event()
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._maintain, name="specserve-draft-pool", daemon=True)
            self._thread.start()
        else:
            self.connect_now()

    # -- connections (background thread) ----------------------------------------------------
    def _try_connect(self, name: str, address) -> None:
        try:
            start = time.perf_counter()
            endpoint = self._connect(name, address)
            reply = endpoint.hello(self._hello, self.max_timeout_s)
            hello_s = time.perf_counter() - start
        except (DraftUnavailable, OSError) as exc:
            logger.debug("draft %s not reachable: %s", name, exc)
            return
        if reply.error is not None:
            endpoint.close()
            if name not in self.refused:
                logger.error("draft %s refused this target: %s", name, reply.error)
            self.refused[name] = reply.error
            return
        self._queued.add(name)
        # The hello's round trip seeds the latency estimate, so the first timeout is measured too.
        self._ready.put(_Draft(name, endpoint, dict(reply.info), latency_s=max(hello_s, 0.05)))

    def connect_now(self) -> None:
        """Discover and connect in the calling thread (start-up and in-process use)."""
        for name, address in self._discover().items():
            if name not in self.drafts and name not in self.refused:
                self._try_connect(name, address)
        self.poll()

    def _maintain(self) -> None:
        delay = 0.0
        while not self._stop.wait(delay):
            delay = self.refresh_s if self.drafts else min(self.refresh_s, 0.2)  # find the first draft fast
            try:
                found = self._discover()
            except Exception as exc:  # discovery is best effort: keep the drafts we have
                logger.debug("draft discovery failed: %s", exc)
                continue
            for name, address in found.items():
                if name in self.drafts or name in self.refused or name in self._queued:
                    continue
                self._try_connect(name, address)

    def wait_for_drafts(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.drafts and not self.refused and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.02)
        self.poll()

    def poll(self) -> None:
        """Adopt drafts that connected since the last call (engine thread)."""
        while True:
            try:
                d = self._ready.get_nowait()
            except queue.Empty:
                return
            self._queued.discard(d.name)
            if d.name in self.drafts or not self._hidden_ok(d):
                d.endpoint.close()
                continue
            d.trees = self.use_trees and bool(d.info.get("trees")) and bool(getattr(d.endpoint, "trees", False))
            self.drafts[d.name] = d
            self.counters["num_draft_connects"] += 1
            logger.info("draft %s connected (%s)", d.name, d.info.get("node_id", "")[:8] or "in-process")
            for rid in sorted(self.orphans):
                self._assign(rid)
            self.orphans.clear()

    def _hidden_ok(self, d: _Draft) -> bool:
        """A draft head reads the target's rows: the first one sets which; one that wants others is refused."""
        layers = tuple(d.info.get("hidden_layers") or ())
        if not layers or layers == self.hidden_layers:
            return True
        error = None
        if self.hidden_layers is not None:
            error = f"it reads the target's layers {list(layers)}, another draft head here reads {list(self.hidden_layers)}"
        elif self._keep_hidden is None:
            error = "this target cannot send hidden states to a draft head"
        else:
            try:
                self._keep_hidden(layers)
                self.hidden_layers = layers
            except ValueError as exc:
                error = str(exc)
        if error is not None:
            logger.error("draft %s refused: %s", d.name, error)
            self.refused[d.name] = error
            return False
        return True

    # -- sequences ----------------------------------------------------------------------------
    def _least_loaded(self) -> _Draft | None:
        return min(self.drafts.values(), key=lambda d: (len(d.seqs), d.name), default=None)

    def _assign(self, rid: str) -> None:
        if rid in self.declined:
            return
        msg = self._reopen(rid)
        d = self._least_loaded()
        if msg is None:
            return
        self.committed[rid] = len(msg.token_ids)
        if d is None:
            self.orphans.add(rid)
            return
        d.seqs.add(rid)
        d.opens.append(msg)
        self.assignment[rid] = d.name

    def open(self, rid: str) -> None:
        self._assign(rid)

    def result(self, r: VerifyResult) -> None:
        self.committed[r.request_id] = r.committed_len
        name = self.assignment.get(r.request_id)
        if name is None:
            return  # orphan: it will be re-opened with its full tokens
        pending = self.drafts[name].results
        prev = pending.get(r.request_id)
        pending[r.request_id] = r if prev is None else prev.then(r)

    def close(self, rid: str) -> None:
        self.trees.pop(rid, None)
        self.treed.discard(rid)
        self.orphans.discard(rid)
        self.declined.discard(rid)
        self.committed.pop(rid, None)
        name = self.assignment.pop(rid, None)
        if name is None:
            return
        d = self.drafts[name]
        d.seqs.discard(rid)
        d.results.pop(rid, None)
        d.opens = [o for o in d.opens if o.request_id != rid]
        d.closes.append(CloseSeq(rid))  # also when an open was still queued: the draft may hold an older copy

    def _lost(self, d: _Draft, exc: BaseException) -> None:
        if self.drafts.pop(d.name, None) is None:
            return
        self.counters["num_draft_failures"] += 1
        self._closed_tensor_bytes += getattr(d.endpoint, "tensor_bytes", 0)
        self._closed_hidden_bytes += getattr(d.endpoint, "hidden_bytes", 0)
        logger.warning("draft %s unavailable (%s): %d sequences move to %s", d.name, exc, len(d.seqs),
                       ", ".join(self.drafts) or "target-only decoding")
        d.endpoint.close()
        for rid in sorted(d.seqs):
            self.trees.pop(rid, None)
            self.assignment.pop(rid, None)
            self.counters["num_resyncs"] += 1
            self._assign(rid)

    @property
    def has_drafts(self) -> bool:
        return bool(self.drafts)

    # -- a step -------------------------------------------------------------------------------
    def _timeout(self, d: _Draft, req: ProposeRequest) -> float:
        """From measurements: 20x the usual round trip, plus 4x the measured catch-up time of the
        prompts this request opens; never above ``max_timeout_s``."""
        catchup = sum(len(o.token_ids) for o in req.opens) * d.catchup_s * 4.0
        return min(self.max_timeout_s, max(self.min_timeout_s, 20.0 * d.latency_s) + catchup)

    @property
    def drafts_ahead(self) -> bool:
        """Some connected draft drafts ahead for this target (so a cache-only request can be answered)."""
        return any(d.info.get("draft_ahead") for d in self.drafts.values())

    def _request(self, d: _Draft, step: int, rids: list[str], ks: list[int], live: list[str] | None = None,
                 draft_misses: bool = True, budget_s: float = 0.0, tree: bool = False, acceptance=()) -> ProposeRequest:
        opens, results = d.opens, list(d.results.values())
        if self.hidden_layers is not None and not d.info.get("hidden_layers"):  # rows only to the drafts that read them
            opens = [dataclasses.replace(o, hidden_states=None) for o in opens]
            results = [dataclasses.replace(r, hidden_states=None) for r in results]
        req = ProposeRequest(step, opens, results, d.closes, rids, ks, live, draft_misses, min(max(0.0, budget_s), 60.0), tree,
                             [min(1.0, max(0.0, float(a))) for a in acceptance[:MAX_DRAFT_TOKENS]])
        d.opens, d.results, d.closes = [], {}, []
        return req

    def propose(self, step: int, wants: dict[str, int], draft_misses: bool = True, budget_s: float = 0.0,
                acceptance=()) -> ProposeOutcome:
        """One request per draft that holds wanted sequences, all sent before any reply is awaited.
        ``draft_misses`` false: drafts answer from their speculation caches only; ``budget_s``: the
        time until the next request and ``acceptance`` the target's per-position acceptance, which the
        drafts size their drafting ahead to."""
        out = ProposeOutcome({}, set())
        by_draft: dict[str, tuple[list[str], list[int]]] = {}
        for rid, k in wants.items():
            name = self.assignment.get(rid)
            if name is None:
                out.fallback.add(rid)
                continue
            rids, ks = by_draft.setdefault(name, ([], []))
            rids.append(rid)
            ks.append(k)
        start = time.perf_counter()
        sent, tree_wait = [], 0.0
        for name, (rids, ks) in by_draft.items():
            d = self.drafts.get(name)
            if d is None:  # lost while reading another draft's trees
                out.fallback.update(rids)
                continue
            try:
                local = None
                if d.trees and self._may_tree(d, rids):
                    # (capped: the estimate starts from the hello's round trip, tens of ms)
                    began = time.perf_counter()
                    now = self._await_tree(d, rids, start + min(d.latency_s, 0.02 + 2 * getattr(d.endpoint, "delay_s", 0.0)))
                    tree_wait += now - began
                    local = self._from_tree(d, rids, ks, draft_misses, now)
                # A tree is of use when it is back as the verify ends: the draft grows it for a round trip less than
                # the time to the next request it would have without trees (the verify and a round trip).
                budget = max(0.0, budget_s - 2 * (d.floor_s or 0.0)) if d.trees else budget_s
                req = self._request(d, step, rids, ks, None, draft_misses, budget, d.trees, acceptance)
                if d.trees:
                    d.sent_at[step] = start
                if local is not None:  # every block is in the tree this draft sent: it answers from the same cache
                    d.endpoint.send(req, awaited=False)
                    d.unread += 1
                    out.blocks.update(local)
                    out.from_trees += len(local)
                    continue
                self._read_pushed(d)
                d.endpoint.send(req)
                sent.append((d, req))
            except DraftUnavailable as exc:
                out.fallback.update(rids)
                self._lost(d, exc)
        for d, req in sent:
            try:
                reply = self._reply(d, req)
            except DraftUnavailable as exc:
                out.fallback.update(req.request_ids)
                self._lost(d, exc)
                continue
            elapsed = time.perf_counter() - start
            opened = sum(len(o.token_ids) for o in req.opens)
            if opened:
                per_token = max(0.0, elapsed - d.latency_s) / opened
                d.catchup_s = 0.8 * d.catchup_s + 0.2 * max(per_token, 1e-5)
            else:
                d.latency_s = 0.8 * d.latency_s + 0.2 * elapsed
                d.floor_s = elapsed if d.floor_s is None else min(elapsed, 0.99 * d.floor_s + 0.01 * elapsed)
            d.last_ok = time.monotonic()
            self._accept(d, reply, dict(zip(req.request_ids, req.num_draft_tokens)), out.blocks)
            self._resync_missing(d, reply)
            s = reply.stats
            out.compute_s, out.forward_s = max(out.compute_s, s.compute_s), max(out.forward_s, s.forward_s)
            out.queue_s = max(out.queue_s, s.queue_s)
            out.hidden_s += s.hidden_s
            out.draft_step_s = max(out.draft_step_s, s.draft_step_s)
        out.wait_s = time.perf_counter() - start if sent else tree_wait  # (the wait for a tree is the draft's too)
        if out.from_trees:
            self.counters["num_tree_steps"] += not sent
            self.counters["num_tree_blocks"] += out.from_trees
        return out

    def _reply(self, d: _Draft, req: ProposeRequest) -> ProposeReply:
        """The reply to ``req`` (just sent, nothing pushed unread), after any tree sent before the draft read it."""
        deadline = time.perf_counter() + self._timeout(d, req)
        # (read as unawaited: an emulated link's delay is slept once, for the reply, not for each tree before it)
        while isinstance(reply := d.endpoint.recv(max(1e-3, deadline - time.perf_counter()), awaited=False), DraftTree) and d.trees:
            self._store_tree(d, reply)
        if not isinstance(reply, ProposeReply) or reply.step != req.step:
            raise DraftUnavailable(f"answered step {getattr(reply, 'step', '?')} to step {req.step}")
        if getattr(d.endpoint, "delay_s", 0.0):
            time.sleep(d.endpoint.delay_s)
        return reply

    def _may_tree(self, d: _Draft, rids: list[str]) -> bool:
        """Whether a tree from ``d`` can hold every block of ``rids``, so it is worth reading (or waiting)
        for: each has had trees (a sampled sequence never has), a verdict the draft can look up, no open
        on its way."""
        reopening = {o.request_id for o in d.opens}
        for rid in rids:
            r = d.results.get(rid)
            if rid not in self.treed or rid in reopening or r is None or r.verdict is None:
                return False
        return True

    def _await_tree(self, d: _Draft, rids: list[str], deadline: float) -> float:
        """Read the trees that came while the target verified; while the last one asked for is still on
        its way, wait for it until ``deadline`` (a round trip from the step's start: an ask would cost
        one, and would cut the tree short). Emulating a link's delay, wait until the trees of ``rids``
        would have arrived, if that is before ``deadline``. Returns the time they are looked up at."""
        self._read_pushed(d, wait=False)
        while d.sent_at and (left := deadline - time.perf_counter()) > 0 and d.endpoint.poll(left):
            self._read_pushed(d, wait=False)
        now = time.perf_counter()
        due = max((e[3] for rid in rids if (e := self.trees.get(rid)) is not None and e[0] == d.name), default=0.0)
        if now < due <= deadline:
            time.sleep(due - now)
            now = due
        return now

    def _from_tree(self, d: _Draft, rids: list[str], ks: list[int], draft_misses: bool, now: float) -> dict[str, DraftBlock] | None:
        """Each wanted sequence's block from the tree ``d`` sent, as ``d`` would answer it (the branch for
        the verdict it is about to hear, cut to k; none where the tree has none, when it drafts no
        misses), checked as a reply is; None when any is not there to take: no tree yet (or, emulating
        a link's delay, not arrived yet), a tree for another block, a verdict the draft cannot look up
        (results coalesced over steps without drafts), a sequence it has not opened yet."""
        blocks = {}
        reopening = {o.request_id for o in d.opens}
        for rid, k in zip(rids, ks):
            entry, r = self.trees.get(rid), d.results.get(rid)
            verdict = r.verdict if r is not None else None
            if entry is None or entry[0] != d.name or entry[3] > now or rid in reopening or verdict is None or verdict[0] != entry[1]:
                return None
            tokens = entry[2].get(verdict[1:], [])[:k]
            if draft_misses and len(tokens) < k:
                return None
            if tokens:
                block, why = check_block(DraftBlock(rid, r.committed_len, tokens, None, len(tokens)), k, self.committed.get(rid),
                                         self.vocab_size or 1 << 62)
                if block is None or why is not None:
                    self._rejected(d, f"a tree with {why}")
                    return None
                blocks[rid] = block
        for rid in rids:  # a tree answers one verdict
            self.trees.pop(rid, None)
        return blocks

    def _store_tree(self, d: _Draft, tree: DraftTree) -> None:
        """Keep the trees of ``d``'s own sequences. Emulating a link's delay, a tree is usable once it would
        have arrived: its request's send, the draft's time to it and a round trip later."""
        sent = d.sent_at.pop(tree.step, None)
        for step in [s for s in d.sent_at if s < tree.step]:
            del d.sent_at[step]
        delay = getattr(d.endpoint, "delay_s", 0.0)
        usable = sent + 2 * delay + tree.elapsed_s if (delay and sent is not None) else 0.0
        for t in tree.trees:
            if self.assignment.get(t.request_id) == d.name:
                self.treed.add(t.request_id)
                self.trees[t.request_id] = (d.name, t.base_len, {(a, tok): b for a, tok, b in zip(t.accepted, t.tokens, t.branches)},
                                            usable)

    def _rejected(self, d: _Draft, why: str) -> None:
        self.counters["draft_replies_rejected"] += 1
        if not d.warned:
            d.warned = True
            logger.warning("draft %s sent %s: repaired before verification (exact; counted in draft_replies_rejected, "
                           "said once per draft)", d.name, why)

    def _accept(self, d: _Draft, reply: ProposeReply, asked: dict[str, int], blocks: dict[str, DraftBlock]) -> None:
        """The reply's blocks that are safe to verify, into ``blocks`` (see ``reply_check``)."""
        for b in reply.blocks:
            if b.request_id not in asked or b.request_id in blocks:
                why, checked = f"a block for {'a sequence it was not asked about' if b.request_id not in asked else 'the same sequence twice'}", None
            else:
                checked, why = check_block(b, asked[b.request_id], self.committed.get(b.request_id), self.vocab_size or 1 << 62)
            if checked is not None:
                blocks[b.request_id] = checked
            if why is not None:
                self._rejected(d, why)

    def _resync_missing(self, d: _Draft, reply: ProposeReply) -> None:
        for rid in reply.refused:  # over the draft's limits (sequences per target, its context): target-only
            if self.assignment.get(rid) == d.name:
                self.counters["num_seqs_refused"] += 1
                d.seqs.discard(rid)
                self.assignment.pop(rid)
                d.results.pop(rid, None)
                self.declined.add(rid)
                if not d.warned:
                    d.warned = True
                    logger.warning("draft %s refused sequence %s (over its limits: max_draft_seqs, or past its context): "
                                   "it decodes target-only, exact (said once per draft)", d.name, rid)
        for rid in reply.missing:  # the draft lost it (e.g. restarted): resync it
            if self.assignment.get(rid) == d.name:
                self.trees.pop(rid, None)
                self.counters["num_resyncs"] += 1
                d.seqs.discard(rid)
                self.assignment.pop(rid)
                self._assign(rid)

    def push(self, step: int) -> None:
        """Send each draft the deltas it has not heard, without waiting for its answer (read before the
        next request to it): while the target decodes alone, the draft feeds them off the critical
        path, so when speculation resumes the next block starts warm instead of from a long catch-up."""
        for d in list(self.drafts.values()):
            try:
                self._read_pushed(d, wait=False)  # never wait here: a draft busy drafting ahead answers later
                if not d.has_deltas or d.unread >= 4:
                    continue
                d.endpoint.send(self._request(d, step, [], []), awaited=False)
                d.unread += 1
            except DraftUnavailable as exc:
                self._lost(d, exc)

    def _read_pushed(self, d: _Draft, wait: bool = True) -> None:
        """Read the answers to pushed deltas (they were sent before this request, so they arrive first)
        and the trees that came; ``wait`` false: only those already arriving."""
        while (wait and d.unread) or ((d.unread or d.trees) and d.endpoint.poll()):
            reply = d.endpoint.recv(self.max_timeout_s, awaited=False)
            if isinstance(reply, DraftTree) and d.trees:
                self._store_tree(d, reply)
                continue
            if not isinstance(reply, ProposeReply) or not d.unread:
                raise DraftUnavailable(f"sent {type(reply).__name__} unasked")
            d.unread -= 1
            self._resync_missing(d, reply)

    def flush(self, step: int, heartbeat_s: float = 1.0) -> None:
        """Idle engine: deliver queued deltas (closes above all), and ping drafts that have been
        quiet for ``heartbeat_s`` so a hung draft is noticed (and reported) without traffic. Each
        message carries the sequences this target still has there, so the draft frees any other."""
        now = time.monotonic()
        for d in list(self.drafts.values()):
            if not d.has_deltas and now - d.last_ok < heartbeat_s:
                continue
            req = self._request(d, step, [], [], live=sorted(d.seqs))
            try:
                self._read_pushed(d)
                d.endpoint.send(req)
                self._reply(d, req)
                d.last_ok = time.monotonic()
            except DraftUnavailable as exc:
                self._lost(d, exc)

    def status(self) -> dict:
        return {
            "num_drafts_up": len(self.drafts),
            "drafts": {name: {"num_seqs": len(d.seqs), "latency_ms": d.latency_s * 1e3, **d.info}
                       for name, d in list(self.drafts.items())},
            "refused": dict(self.refused),
            "num_orphans": len(self.orphans),
            "tensor_bytes": sum(getattr(d.endpoint, "tensor_bytes", 0) for d in list(self.drafts.values())) + self._closed_tensor_bytes,
            "hidden_bytes": sum(getattr(d.endpoint, "hidden_bytes", 0) for d in list(self.drafts.values())) + self._closed_hidden_bytes,
            **self.counters,
        }

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for d in list(self.drafts.values()):
            d.endpoint.close()
        self.drafts.clear()
