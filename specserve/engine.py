"""The step loop that couples a target side and a draft side by messages (continuous batching).

One step: ``plan()`` admits waiting requests (target prefill) and builds one
``ProposeRequest`` with the opens, verify results and closes since the last step; the
caller delivers it to the draft side however it likes (in-process call, Ray actor, a
channel) and hands the ``ProposeReply`` (or ``None`` when the draft is unavailable) to
``finish()``, which verifies every live sequence in one batched target forward and
returns the per-request deltas. Knows nothing of Ray; the same loop runs in both.
"""

from __future__ import annotations

import logging
from collections import deque

from .messages import CloseSeq, OpenSeq, ProposeReply, ProposeRequest, VerifyResult
from .outputs import StepDelta
from .sampling_params import SamplingParams
from .target import TargetSide

logger = logging.getLogger(__name__)


class SpecEngine:
    def __init__(self, target: TargetSide, num_speculative_tokens: int, max_num_seqs: int = 256, has_draft: bool = True):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.target = target
        self.k = num_speculative_tokens if has_draft else 0
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[tuple[str, list[int], SamplingParams]] = deque()
        self.step_id = 0
        self._opens: list[OpenSeq] = []
        self._results: list[VerifyResult] = []
        self._closes: list[CloseSeq] = []

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.target.validate(prompt_token_ids, params)  # fail at submission, never mid-step
        if request_id in self.target.seqs or any(w[0] == request_id for w in self.waiting):
            raise ValueError(f"request_id {request_id!r} is already running")
        self.waiting.append((request_id, list(prompt_token_ids), params))

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; frees its state on both sides. True if it existed."""
        for i, w in enumerate(self.waiting):
            if w[0] == request_id:
                del self.waiting[i]
                return True
        if request_id in self.target.seqs:
            self.target.close(request_id)
            self._forget(request_id, "aborted")
            return True
        return False

    def _forget(self, request_id: str, reason: str) -> None:
        self._opens = [o for o in self._opens if o.request_id != request_id]
        self._results = [r for r in self._results if r.request_id != request_id]
        self._closes.append(CloseSeq(request_id, reason))

    def has_work(self) -> bool:
        return bool(self.waiting or self.target.seqs)

    @property
    def num_running(self) -> int:
        return self.target.num_seqs

    # -- draft resync ---------------------------------------------------------------------
    def resync_draft(self, request_ids: list[str] | None = None) -> None:
        """Re-open sequences on the draft with their full committed tokens (after a restart)."""
        ids = list(self.target.seqs) if request_ids is None else [r for r in request_ids if r in self.target.seqs]
        drop = set(ids)
        self._opens = [o for o in self._opens if o.request_id not in drop]
        self._results = [r for r in self._results if r.request_id not in drop]
        for rid in ids:
            s = self.target.seqs[rid]
            p = s.params
            self._opens.append(OpenSeq(rid, list(s.token_ids), p.temperature, p.top_k, p.top_p, p.seed))

    # -- one step -------------------------------------------------------------------------
    def plan(self) -> ProposeRequest | None:
        """Admit requests and build this step's message to the draft (None: nothing to do)."""
        admitted = []
        while self.waiting and self.target.num_seqs + len(admitted) < self.max_num_seqs:
            admitted.append(self.waiting.popleft())
        if admitted:
            self.target.open(admitted)
            for rid, prompt, p in admitted:
                self._opens.append(OpenSeq(rid, prompt, p.temperature, p.top_k, p.top_p, p.seed))
        if not self.target.seqs:
            return None
        self.step_id += 1
        req = ProposeRequest(self.step_id, self.k, self._opens, self._results, self._closes, list(self.target.seqs))
        self._opens, self._results, self._closes = [], [], []
        return req

    def draft_lost(self, req: ProposeRequest) -> None:
        """The draft failed on ``req``: keep only its closes; live sequences resync on return."""
        self._closes = req.closes + self._closes

    def finish(self, reply: ProposeReply | None, fallback: bool = False) -> list[StepDelta]:
        """Verify every live sequence; returns one delta per sequence (finished ones are freed)."""
        blocks = {b.request_id: b for b in reply.blocks} if reply is not None and reply.step == self.step_id else {}
        deltas, results = self.target.verify(self.step_id, blocks, fallback)
        for d, r in zip(deltas, results):
            if d.finished:
                self.target.close(d.request_id)
                self._closes.append(CloseSeq(d.request_id, "finished"))
            else:
                self._results.append(r)
        if reply is not None and reply.missing:
            self.resync_draft(reply.missing)
        return deltas

    @property
    def has_pending_closes(self) -> bool:
        return bool(self._closes)

    def take_closes(self) -> list[CloseSeq]:
        """Pending closes for the draft when no further step will carry them (idle engine)."""
        closes, self._closes = self._closes, []
        return closes

    def step(self, propose) -> list[StepDelta]:
        """Synchronous step with ``propose(ProposeRequest) -> ProposeReply`` (in-process draft)."""
        req = self.plan()
        if req is None:
            return []
        reply = propose(req) if self.k > 0 else None
        return self.finish(reply)
