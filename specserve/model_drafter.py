"""Autoregressive drafting with a small causal LM, and its speculation cache (drafting ahead).

On the critical path (``propose``): answer each sequence's block from the speculation cache
when the verdict is one the drafter prepared for (a *hit*), else draft now (a *miss*,
possibly continuing a partial hit). A target that asks for cache-only answers gets what
the cache holds (possibly a shorter block, or none) and nothing is drafted on the critical
path. Off it (``prepare``, after the reply has left, while the target verifies;
SSD/Saguaro's idea): one *glue* forward feeds the block just sent, then the likeliest
verdicts (j drafts accepted then recovered token r; all accepted then bonus r; for an empty
block, the target's own next token) are drafted ahead as branches of a tree, one batched
forward per depth; where a call is mostly fixed cost, the tree's first depth rides in the glue's
own forward for every branch that does not need the glue's output (``_glue_and_grow``). The tree's
width (branches per sequence) and depth are sized to the target's budget, the time until its next
request, from the measured cost of a tree forward by rows: the most expected accepted tokens that
fit; with no budget known, the whole tree until the next request arrives. Draws are keyed by
token position (``rng``), so a block drafted ahead equals the block drafted on demand: hits and
misses never change output. Logits stay in the draft's own vocabulary width; the target aligns
q rows to its own.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from .backends.base import ModelBackend
from .draft import Branch, DraftSeq, Proposal
from .rng import DRAFT_SAMPLE, uniforms
from .sampling import processed_probs, sample_with_uniforms


def _bucket(batch_size: int) -> int:
    return 1 << max(0, batch_size - 1).bit_length()


class LinearCost:
    """Seconds of one tree depth by its rows, t(n) = a + b * n: a running estimate per n seen, and a
    line through them (weighted by how often each n was seen) for the n not seen."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.points: dict[float, tuple[float, int]] = {}  # n -> (running seconds, samples)

    @property
    def samples(self) -> list[tuple[float, float]]:
        return [(n, t) for n, (t, _) in sorted(self.points.items())]

    def add(self, n: float, seconds: float) -> None:
        old = self.points.get(n)
        self.points[n] = (seconds, 1) if old is None else ((1 - self.weight) * old[0] + self.weight * seconds, old[1] + 1)

    def predict(self, n: float) -> float | None:
        if not self.points:
            return None
        if n in self.points and self.points[n][1] >= 2:
            return self.points[n][0]
        xs, ys, ws = zip(*[(x, y, min(c, 8)) for x, (y, c) in self.points.items()])
        total = sum(ws)
        mean_x, mean_y = sum(w * x for w, x in zip(ws, xs)) / total, sum(w * y for w, y in zip(ws, ys)) / total
        var = sum(w * (x - mean_x) ** 2 for w, x in zip(ws, xs))
        # One n seen so far: a mild slope (a tenth of the cost per row at that n).
        slope = max(0.0, sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(ws, xs, ys)) / var) if var > 0 else 0.1 * mean_y / max(mean_x, 1)
        return max(1e-6, mean_y + slope * (n - mean_x))


class ModelDrafter:
    """Autoregressive drafting with a small causal LM behind a ``ModelBackend``.

    ``fanout`` > 0 turns on the speculation cache: up to ``fanout`` candidate tokens per
    verdict position, at most ``max_branches`` branches per sequence (default (k+1) x fanout),
    fewer when the target's budget does not fit them; ``preempt`` stops drafting ahead when
    the next request arrives.
    """

    SAFETY = 0.85  # share of the target's budget a tree may use (the rest absorbs noise)
    ENTRY_SHIFT = 0  # a branch root after c committed tokens sees c - ENTRY_SHIFT KV entries (a head's entry t reads token t + 1)
    FOLD = True  # the glue and the tree's first depth in one call where the backend has ``forward_glue_branches``

    def __init__(self, backend: ModelBackend, send_probs: bool = True, fanout: int = 0, max_branches: int | None = None,
                 preempt: bool = True):
        self.backend = backend
        self.preempt = preempt  # stop drafting ahead when a request waits (else finish the tree)
        self.send_probs = send_probs
        self.fanout = fanout if hasattr(backend, "forward_branches") else 0
        self.max_branches = max_branches
        self.num_forwards = 0  # forwards of the last propose (critical path)
        self.forward_s = 0.0  # and their time
        self.step_times: dict[int, float] = {}  # batch bucket -> running estimate of one single-token forward
        self.acceptance = np.full(64, 0.7)  # per-position acceptance, for choosing branches: the target's (``ProposeRequest``)
        self.tree_cost = LinearCost()  # seconds of one tree depth (forward and choosing) by rows (sequences x branches)
        # Share of the budget trees get: cut when the next request had to wait for the tree (it came
        # sooner than the budget said), regrown while trees finish in time (``_fit_budget``).
        self.budget_scale = 1.0
        self.last_tree: tuple[int, int] = (0, 0)  # (branches per sequence, depth) of the last tree, for metrics
        # Trees grown, those whose first depth shared the glue's call, and tree forwards after the glue's call.
        self.tree_counts = {"num_trees": 0, "num_trees_folded": 0, "num_tree_forwards": 0}
        # Trees a verdict made stale, freed off the critical path by the next prepare: freed in propose,
        # their ~2,500 arrays a step took 0.8 ms of the draft's reply at batch 32 (simulated Spark + 5090).
        self._stale: list[dict] = []

    def open(self, seq: DraftSeq) -> None:
        self.backend.add(seq.key)

    def close(self, seq: DraftSeq) -> None:
        self.backend.free(seq.key)

    def rollback(self, seq: DraftSeq, num_tokens: int) -> None:
        self.backend.truncate(seq.key, num_tokens)

    # -- helpers ----------------------------------------------------------------------------
    def _choose(self, seqs: list[DraftSeq], logits: torch.Tensor, positions: list[int], want_cands: bool,
                prefixes: list[list[int]] | None = None):
        """One draft token per row at the given positions, plus (optionally) each row's candidates.

        logits: [rows, vocab]. Greedy rows (and every row when probabilities are not sent:
        a point mass must be deterministic) take the argmax; sampled rows draw from q with the
        uniform keyed by (seed, position). Ids the target cannot emit (a wider draft LM head)
        are masked first, and a sequence's processing (penalties, ``logit_bias``, ...: what the
        target does to its own distribution) is applied to its rows, with the tokens each row
        follows (``prefixes``; default: the committed tokens and the block so far), so q is
        exactly what the drafts are drawn from.
        """
        logits = self._mask_beyond_target(seqs, logits)
        if any(s.processing is not None for s in seqs):
            logits = self._process(seqs, logits, prefixes)
        tokens = logits.argmax(dim=-1)
        probs_out: list[np.ndarray | None] = [None] * len(seqs)
        sampled = [i for i, s in enumerate(seqs) if not s.greedy and self.send_probs]
        q = None
        if sampled:
            rows = torch.tensor(sampled)
            q = processed_probs(logits[rows], [seqs[i].temperature for i in sampled], [seqs[i].top_k for i in sampled],
                                [seqs[i].top_p for i in sampled])
            u = uniforms([seqs[i].seed for i in sampled], DRAFT_SAMPLE, [positions[i] for i in sampled])
            tokens[rows] = sample_with_uniforms(q, u)
            # .cpu(): q rows cross the wire as numpy.
            q_np = q.float().cpu().numpy()
            for j, i in enumerate(sampled):
                probs_out[i] = q_np[j]
        cands = None
        if want_cands and self.fanout:
            score = torch.softmax(logits.float(), dim=-1)
            if sampled:
                score[torch.tensor(sampled)] = q.float()
            top = torch.topk(score, min(self.fanout + 1, score.shape[-1]), dim=-1)
            # .tolist(): candidates choose next round's branches on the host.
            cands = list(zip(top.indices.tolist(), top.values.tolist()))
        return tokens.tolist(), probs_out, cands

    @staticmethod
    def _mask_beyond_target(seqs: list[DraftSeq], logits: torch.Tensor) -> torch.Tensor:
        width = logits.shape[-1]
        limits = [s.vocab_limit or width for s in seqs]
        if min(limits) >= width:
            return logits
        logits = logits.clone()
        if len(set(limits)) == 1:
            logits[:, limits[0]:] = float("-inf")
        else:
            for row, limit in enumerate(limits):
                logits[row, limit:] = float("-inf")
        return logits

    @staticmethod
    def _process(seqs: list[DraftSeq], logits: torch.Tensor, prefixes: list[list[int]] | None) -> torch.Tensor:
        """The rows of sequences with processing, processed as the target processes its own (for
        acceptance only: the target verifies against its processed distribution whatever q is)."""
        logits = logits.clone()
        for row, s in enumerate(seqs):
            processor = s.processor(logits.shape[-1])
            if processor is not None:
                prefix = prefixes[row] if prefixes is not None else s.token_ids + s.block
                logits[row] = processor.apply(logits[row : row + 1], prefix, [])[0].to(logits.dtype)
        return logits

    def _time(self, start: float, rows: int) -> None:
        elapsed, bucket = time.perf_counter() - start, _bucket(rows)
        old = self.step_times.get(bucket)
        self.step_times[bucket] = elapsed if old is None else 0.9 * old + 0.1 * elapsed

    def step_time(self, batch_size: int) -> float:
        """One decode forward at this batch size: its bucket's estimate, else the nearest bucket's."""
        if not self.step_times:
            return 0.0
        bucket = _bucket(batch_size)
        nearest = min(self.step_times, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))
        return self.step_times.get(bucket, self.step_times[nearest])

    @property
    def step_time_s(self) -> float:
        return self.step_time(1)

    # -- critical path ------------------------------------------------------------------------
    def propose(self, seqs: list[DraftSeq], ks: list[int], draft_misses: bool = True) -> list[Proposal]:
        """Each sequence's block: from the speculation cache when it foresaw the verdict, else
        drafted now, or (``draft_misses`` false) only the part the cache holds."""
        self.num_forwards, self.forward_s = 0, 0.0
        out: list[Proposal | None] = [None] * len(seqs)
        room = self.backend.max_model_len
        work = []  # (index, prefix, k) of sequences that need drafting now
        for i, (s, k) in enumerate(zip(seqs, ks)):
            k = max(0, min(k, room - len(s.token_ids)))  # never draft past the draft model's own context
            prefix: list[int] = []
            branch = self._lookup(s)
            if branch is not None and k:
                prefix = branch.token_ids[:k]
            s.new_block(k)
            if s.cache:
                self._stale.append(s.cache)
            s.cache = {}
            if branch is not None and k:
                s.block_cands = list(branch.cands[: len(prefix)])
                s.block_probs = list(branch.probs[: len(prefix)])
            if k and (len(prefix) >= k or not draft_misses):
                s.block = prefix
                out[i] = self._proposal(s, num_cached=len(prefix))
            elif k:
                work.append((i, prefix, k))
            else:
                out[i] = Proposal([])
        if work:
            self._draft([seqs[i] for i, _, _ in work], [p for _, p, _ in work], [k for _, _, k in work])
            for i, prefix, _ in work:
                out[i] = self._proposal(seqs[i], num_cached=len(prefix))
        return out  # type: ignore[return-value]

    def _lookup(self, s: DraftSeq) -> Branch | None:
        if s.verdict is None or not s.cache:
            return None
        base, accepted, token = s.verdict
        return s.cache.get((accepted, token)) if base == s.block_base else None

    def _proposal(self, s: DraftSeq, num_cached: int) -> Proposal:
        probs = np.stack(s.block_probs) if s.block_probs and not s.greedy and self.send_probs else None
        return Proposal(list(s.block), probs, num_cached)

    def _draft(self, seqs: list[DraftSeq], prefixes: list[list[int]], ks: list[int]) -> None:
        """Draft until each sequence's block holds k tokens, starting from ``prefix`` (a partial hit)."""
        feed = []
        for s, prefix in zip(seqs, prefixes):
            if s.num_fed >= len(s.token_ids):  # need the logits after the last committed token: re-feed it
                s.num_fed = len(s.token_ids) - 1
                self.backend.truncate(s.key, s.num_fed)
            feed.append(s.token_ids[s.num_fed :] + prefix)
            s.block = list(prefix)
        active = list(range(len(seqs)))
        while active:
            # Long catch-up feeds (new or resynced sequences) go in their own forward so the
            # common single-token rows are not padded to a prompt's width.
            for group in ([i for i in active if len(feed[i]) > 2], [i for i in active if len(feed[i]) <= 2]):
                if not group:
                    continue
                start = time.perf_counter()
                logits = self.backend.forward([seqs[i].key for i in group], [feed[i] for i in group], [1] * len(group))
                self.num_forwards += 1
                self.forward_s += time.perf_counter() - start
                if max(len(feed[i]) for i in group) <= 2:
                    self._time(start, len(group))
                group_seqs = [seqs[i] for i in group]
                positions = [s.block_base + len(s.block) for s in group_seqs]
                tokens, probs, cands = self._choose(group_seqs, logits[:, -1], positions, want_cands=True)
                for row, i in enumerate(group):
                    s = seqs[i]
                    s.num_fed += len(feed[i])
                    s.block.append(tokens[row])
                    if probs[row] is not None:
                        s.block_probs.append(probs[row])
                    if cands is not None:
                        s.block_cands.append(cands[row])
                    feed[i] = [tokens[row]]
            active = [i for i in active if len(seqs[i].block) < ks[i]]

    # -- off the critical path -------------------------------------------------------------
    def catch_up(self, seqs: list[DraftSeq], should_stop: Callable[[], bool]) -> None:
        """Feed committed tokens the KV has not seen (sent while the target asked for no drafts),
        all but the last, whose logits the next block starts from: that block then starts warm."""
        seqs = [s for s in seqs if len(s.token_ids) - s.num_fed > 1]
        if not seqs or should_stop():
            return
        feed = [s.token_ids[s.num_fed : -1] for s in seqs]
        self.backend.forward([s.key for s in seqs], feed, [1] * len(seqs))
        for s, f in zip(seqs, feed):
            s.num_fed += len(f)

    def prepare(self, seqs: list[DraftSeq], should_stop: Callable[[], bool], budget_s: float = 0.0) -> None:
        """Glue forward over each block just sent, then the branch tree for its likeliest verdicts,
        as wide and deep as ``budget_s`` (the time until the target's next request) allows."""
        started = time.perf_counter()
        self._stale.clear()
        if not self.preempt:
            should_stop = lambda: False  # noqa: E731
        seqs = self._ahead_seqs(seqs)
        if not seqs or should_stop():
            return
        asked, stopped = should_stop, [False]

        def should_stop() -> bool:
            stopped[0] = stopped[0] or asked()
            return stopped[0]

        try:
            self._prepare(seqs, should_stop, budget_s * self.budget_scale, started)
        finally:
            self._fit_budget(stopped[0] or asked())

    def _fit_budget(self, late: bool) -> None:
        """A request that waited for the tree came sooner than the target's budget said (the budget is
        its verify; the step does more, and a depth cannot be cut short): trees get less of it, down
        to a tenth; while they finish in time they win it back slowly, so a tree rarely makes the next
        request wait."""
        self.budget_scale = max(0.1, self.budget_scale * 0.7) if late else min(1.0, self.budget_scale * 1.05)

    def _ahead_seqs(self, seqs: list[DraftSeq]) -> list[DraftSeq]:
        """The sequences to draft ahead for: those with a block just sent (or asked for)."""
        return [s for s in seqs if (s.block or s.num_asked) and self.fanout]

    @staticmethod
    def _feed_len(feed) -> int:
        return len(feed)

    def _prepare(self, seqs: list[DraftSeq], should_stop: Callable[[], bool], budget_s: float, started: float) -> None:
        feeds = [self._glue_feed(s) for s in seqs]
        # A sequence with a long feed (a new one: its whole prompt) is glued after the others' tree, in
        # its own forward: padded into theirs it made every row as wide as a prompt and the tree late
        # for the whole batch (at batch 32 a new request arrives nearly every step).
        limit = 2 * max(max(s.num_asked, len(s.block)) for s in seqs) + 2
        short = [i for i, f in enumerate(feeds) if self._feed_len(f) <= limit]
        long = [i for i, f in enumerate(feeds) if self._feed_len(f) > limit]
        def left() -> float:  # the budget still unspent (0.0: no budget known, a tree as deep as asked)
            return max(1e-9, budget_s - (time.perf_counter() - started)) if budget_s > 0 else 0.0

        if short and not (self._can_fold() and self._glue_and_grow([seqs[i] for i in short], [feeds[i] for i in short],
                                                                   should_stop, left())):
            self._glue([seqs[i] for i in short], [feeds[i] for i in short])
            self._grow_tree([seqs[i] for i in short], should_stop, left())
        if long and not should_stop():
            self._glue([seqs[i] for i in long], [feeds[i] for i in long])
            if budget_s <= 0 or left() > 1e-9:  # their trees (a new prompt's: its first token's likeliest values) with what is left
                self._grow_tree([seqs[i] for i in long], should_stop, left())

    def _glue_feed(self, s: DraftSeq) -> list[int]:
        """What the KV has not seen of a sequence: committed tokens, then the block just sent."""
        f = s.token_ids[s.num_fed :] + s.block if s.num_fed < len(s.token_ids) else s.block[s.num_fed - len(s.token_ids) :]
        if not f:  # everything is in the KV already (an empty block): re-feed the last token for its logits
            s.num_fed -= 1
            self.backend.truncate(s.key, s.num_fed)
            f = [s.token_ids[-1]]
        return f

    def _glue(self, seqs: list[DraftSeq], feeds: list[list[int]]) -> None:
        """Feed each sequence's unseen tokens; the last logits give the candidates after its block."""
        logits = self.backend.forward([s.key for s in seqs], feeds, [1] * len(seqs))
        self._after_glue(seqs, feeds, logits[:, -1])

    def _after_glue(self, seqs: list[DraftSeq], feeds: list[list[int]], logits: torch.Tensor) -> None:
        """The glue's last logits ([batch, vocab]) give the candidates after each block."""
        bonus_positions = [s.block_base + len(s.block) for s in seqs]
        _, _, cands = self._choose(seqs, logits, bonus_positions, want_cands=True)
        for s, f, c in zip(seqs, feeds, cands):
            s.num_fed += len(f)
            s.block_cands = s.block_cands[: len(s.block)] + [c]

    def _grow_tree(self, seqs: list[DraftSeq], should_stop: Callable[[], bool], budget_s: float) -> None:
        """The branch tree for the likeliest verdicts of each sequence's block, sized to ``budget_s``."""
        started = time.perf_counter()
        scored = [self._roots(s) for s in seqs]
        live = [i for i, r in enumerate(scored) if r]
        if not live:
            return
        seqs, scored = [seqs[i] for i in live], [scored[i] for i in live]
        depth_max = self._depth_max(seqs)
        left = max(1e-9, budget_s - (time.perf_counter() - started)) if budget_s > 0 else 0.0
        width, depth = self._tree_size(scored, depth_max, left)
        roots = [[(j, tok) for _, j, tok in r[:width]] for r in scored]
        lanes = max(len(r) for r in roots)
        hidden = self._root_rows(seqs, roots, lanes)  # a head's input rows per lane, else None
        self._extend(seqs, roots, None, lanes, range(depth), should_stop, hidden)

    def _depth_max(self, seqs: list[DraftSeq]) -> int:
        """The deepest a branch may go: the longest block asked for, short of the draft's context."""
        room = self.backend.max_model_len
        return min(max(max(s.num_asked, len(s.block)) for s in seqs), min(room - s.block_base - len(s.block) - 1 for s in seqs))

    def _extend(self, seqs: list[DraftSeq], roots: list[list[tuple[int, int]]], first: list[list[int]] | None, lanes: int,
                depths, should_stop: Callable[[], bool], hidden: torch.Tensor | None = None, logits: torch.Tensor | None = None) -> None:
        """Grow the tree rooted at ``roots`` through ``depths`` and keep each sequence's branches as its cache: each
        call feeds every lane's last token and appends the draft it picks to the lane's branch. ``first``: the depth
        each lane started at (a lane rooted at a block's bonus position starts one depth late when the glue ran in
        the tree's first call); None, all at 0. ``logits``: the first depth's, already computed
        (``forward_glue_branches``)."""
        branches = [[Branch([], [], []) for _ in r] for r in roots]
        tokens = [[tok for _, tok in r] for r in roots]  # each lane's last token
        self.last_tree = (lanes, 0)
        self.tree_counts["num_trees"] += 1
        starts = [[s.block_base + j for j, _ in r] for s, r in zip(seqs, roots)]  # where each root's token sits
        prefix_lens = [[p - self.ENTRY_SHIFT for p in ps] for ps in starts]
        for d in depths:
            start, ran = time.perf_counter(), logits is None
            if ran:
                if should_stop():
                    break
                extra = {} if hidden is None else {"hidden": hidden}
                if first is not None:
                    extra["starts"] = first
                logits = self.backend.forward_branches([s.key for s in seqs], tokens, prefix_lens, d, lanes, **extra)
                self.tree_counts["num_tree_forwards"] += 1
                if hidden is not None:
                    hidden = self.backend.last_hidden  # [batch, lanes, hidden]: the next depth reads each lane's own row
            self.last_tree = (lanes, d + 1)
            flat_seqs, flat_rows, positions = [], [], []
            for i, s in enumerate(seqs):
                for b in range(len(tokens[i])):
                    if first is not None and first[i][b] > d:
                        continue  # (not started yet)
                    flat_seqs.append(s)
                    flat_rows.append((i, b))
                    positions.append(starts[i][b] + d + 1 - (first[i][b] if first is not None else 0))
            if flat_rows:
                index = torch.tensor([i * lanes + b for i, b in flat_rows])
                prefixes = None
                if any(s.processing is not None for s in seqs):  # each branch's row follows its own verdict and drafts
                    prefixes = [seqs[i].token_ids + seqs[i].block[: roots[i][b][0]] + [roots[i][b][1]] + branches[i][b].token_ids
                                if seqs[i].processing is not None else None for i, b in flat_rows]
                picked, probs, cands = self._choose(flat_seqs, logits.reshape(-1, logits.shape[-1])[index], positions, want_cands=True,
                                                    prefixes=prefixes)
                for n, (i, b) in enumerate(flat_rows):
                    br = branches[i][b]
                    br.token_ids.append(picked[n])
                    if probs[n] is not None:
                        br.probs.append(probs[n])
                    if cands is not None:
                        br.cands.append(cands[n])
                    if hidden is not None:
                        br.rows.append(hidden[i, b])
                    tokens[i][b] = picked[n]
            logits = None
            if ran:  # (choosing costs as much as the forward at batch 32)
                self.tree_cost.add(len(seqs) * lanes, time.perf_counter() - start)
        for s, r, bs in zip(seqs, roots, branches):
            s.cache = {(j, tok): br for (j, tok), br in zip(r, bs) if br.token_ids}

    # -- the glue and the tree's first depth in one call -----------------------------------------
    def _can_fold(self) -> bool:
        return self.FOLD and hasattr(self.backend, "forward_glue_branches")

    def _glue_and_grow(self, seqs: list[DraftSeq], feeds: list[list[int]], should_stop: Callable[[], bool], budget_s: float) -> bool:
        """The glue forward and the first depth of the tree in one call (``forward_glue_branches``), then the
        rest of the tree. A verdict that rejects draft j < k roots a branch the glue does not need: its token
        and the tokens it follows are known before the glue, so it starts in the glue's own call and ends one
        draft deeper than it would after a separate glue. A verdict that accepts the whole block needs the glue's
        last logits for its token, so its lanes start at the next call. A small draft's call is mostly fixed
        cost (the demo draft on one CPU core: 1.6 ms for the glue, 2.1 ms a depth, at batch 1), so at batch 1
        this buys a second draft for most branches within one verify. Where the first depth's rows would cost
        the tree a whole depth (calls that are mostly compute), the glue keeps its own call: False, nothing done."""
        started = time.perf_counter()
        early = [self._roots(s) for s in seqs]  # before the glue: rejections inside the block only
        depth_max, plan = self._depth_max(seqs), None
        if any(early) and depth_max >= 1:
            # The bonus verdicts' probabilities estimated (their tokens are the glue's output): the block accepted
            # whole, spread as the last draft's candidates were.
            estimated = []
            for s, e in zip(seqs, early):
                reach = float(np.prod(self.acceptance[: len(s.block)]))
                shape = s.block_cands[len(s.block) - 1][1] if s.block and s.block_cands else [1.0]
                estimated.append(sorted(e + [(reach * p, len(s.block), -1) for p in shape[: self.fanout]],
                                        key=lambda x: -x[0])[: self._max_roots(s)])
            plan = self._fold_plan(estimated, depth_max, len(seqs), max(len(f) for f in feeds),
                                   budget_s - (time.perf_counter() - started) if budget_s > 0 else 0.0)
        if plan is None:
            return False
        width, depth = plan
        chosen = [x[:width] for x in estimated]
        roots = [[(j, tok) for _, j, tok in c if tok >= 0] for c in chosen]  # early lanes first, bonus lanes after
        num_bonus = [sum(1 for _, _, tok in c if tok < 0) for c in chosen]
        lanes = max(len(r) + b for r, b in zip(roots, num_bonus))
        prefix_lens = [[s.block_base + j - self.ENTRY_SHIFT for j, _ in r] for s, r in zip(seqs, roots)]
        after, logits = self.backend.forward_glue_branches([s.key for s in seqs], feeds, [[t for _, t in r] for r in roots], prefix_lens, lanes)
        self._after_glue(seqs, feeds, after)
        # The bonus lanes' roots: the glue's own candidates after the whole block.
        first = []
        for s, r, b in zip(seqs, roots, num_bonus):
            bonus = [(j, t) for _, j, t in self._roots(s) if j == len(s.block)][:b]
            first.append([0] * len(r) + [1] * len(bonus))
            r += bonus
        self.tree_counts["num_trees_folded"] += 1
        self._extend(seqs, roots, first, lanes, range(depth + 1), should_stop, logits=logits)
        return True

    def _fold_plan(self, estimated: list[list[tuple[float, int, int]]], depth_max: int, num_seqs: int, width_fed: int,
                   left_s: float) -> tuple[int, int] | None:
        """(branches per sequence, depth) of a tree whose first depth shares the glue's call, or None where the
        glue should keep its own. ``estimated``: each sequence's roots, best first, a bonus root's token -1.
        A call costs about what a tree depth of as many rows does (``tree_cost``). Folded, the glue's call
        carries the first depth's rows as well: where those rows would cost the tree a depth (a draft whose
        forward is mostly compute, not fixed cost), or the tree has no root the glue's call can start, None."""
        if left_s > 0 and self.tree_cost.samples:
            apart = self._tree_size(estimated, depth_max, max(1e-9, left_s - self.tree_cost.predict(num_seqs * width_fed)))
            lanes = max(min(apart[0], len(x)) for x in estimated)
            width, depth = self._tree_size(estimated, depth_max, max(1e-9, left_s - self.tree_cost.predict(num_seqs * (width_fed + lanes))))
            if depth < apart[1]:
                return None
        else:
            width, depth = self._tree_size(estimated, depth_max, 0.0)  # no budget known: the whole tree (preemption guards it)
        if not any(tok >= 0 for x in estimated for _, _, tok in x[:width]):
            return None
        return width, depth

    def _root_rows(self, seqs: list[DraftSeq], roots: list[list[tuple[int, int]]], lanes: int) -> torch.Tensor | None:
        return None  # a causal LM reads tokens only

    def _tree_size(self, scored: list[list[tuple[float, int, int]]], depth_max: int, budget_s: float) -> tuple[int, int]:
        """(branches per sequence, depth): the most expected accepted draft tokens whose forwards fit
        the budget. A hit on a branch d deep yields up to d drafts, each kept with the measured
        acceptance; without a budget or a cost estimate yet, the whole tree (preemption guards it)."""
        widest = max(len(r) for r in scored)
        if budget_s <= 0.0 or not self.tree_cost.samples:
            return widest, depth_max
        available = budget_s * self.SAFETY
        reach = np.cumprod(self.acceptance[:depth_max])  # P(the first i + 1 drafts of a block are accepted)
        gain = np.concatenate([[0.0], np.cumsum(reach)])  # expected accepted drafts of a d-deep hit
        mass = np.zeros(widest + 1)  # total verdict probability covered by the top m branches
        for r in scored:
            p = np.array([x for x, _, _ in r] + [0.0] * (widest - len(r)))
            mass[1:] += np.cumsum(p)
        best, best_value = (1, 1), -1.0
        for m in range(1, widest + 1):
            per_depth = self.tree_cost.predict(len(scored) * m)
            for d in range(1, depth_max + 1):
                if d * per_depth > available and (m, d) != (1, 1):
                    break
                value = mass[m] * gain[d]
                if value > best_value * 1.001:  # prefer the cheaper tree on (near) ties
                    best, best_value = (m, d), value
        return best

    def _roots(self, s: DraftSeq) -> list[tuple[float, int, int]]:
        """The likeliest verdicts (probability, num_accepted j, token) of the block just sent, best first.
        An empty block has one: the target's next token (j = 0 with the bonus candidates)."""
        k = len(s.block)
        scored = []
        reach = 1.0  # P(the first j drafts are accepted)
        for j in range(k + 1):
            if j >= len(s.block_cands):
                break
            tokens, q = s.block_cands[j]
            if j < k:
                p_outcome = reach * (1.0 - self.acceptance[j])
                own = s.block[j]
                rest = max(1e-9, 1.0 - sum(p for t, p in zip(tokens, q) if t == own))  # q mass of the other tokens
                scored += [(p_outcome * p / rest, j, t) for t, p in zip(tokens, q) if t != own][: self.fanout]
                reach *= self.acceptance[j]
            else:
                scored += [(reach * p, j, t) for t, p in zip(tokens, q)][: self.fanout]
        scored.sort(key=lambda x: -x[0])
        return scored[: self._max_roots(s)]

    def _max_roots(self, s: DraftSeq) -> int:
        """The most branches a sequence's tree may have: ``max_branches``, else ``fanout`` per verdict position."""
        return self.max_branches if self.max_branches is not None else (max(len(s.block), s.num_asked) + 1) * self.fanout
