"""One step loop for every deployment: in-process, Ray actor, HTTP.

``EngineCore.step`` (synchronous, one thread): admit waiting requests (one batched prefill, or,
where the backend's forwards cost one weight read, ``fuses_prefill``, as rows of this step's verify
forward; each new sequence is opened on a draft), choose k (``SpeculationController``), ask the
drafts (``DraftPool.propose``: one request per draft, all sent before any is awaited),
verify every live sequence in one forward (``TargetSide.verify``), queue the verify results
for the drafts and free finished sequences. A sequence that fails fails alone: a batched
forward that raises is retried on halves of the batch until the failing rows are found.
``EngineLoop`` runs ``step`` on a dedicated thread and is the only way in: ``submit`` and
``abort`` from any thread, deltas delivered to each request's sink (a queue of an asyncio
loop, a batch collector), so concurrent streams work by construction. Knows nothing of Ray.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from .adaptive import SpeculationController
from .step_plan import StepRecord, hold_first_blocks, observe, plan_draft_lengths, warm_rows
from .messages import OpenSeq
from .outputs import CannotResume, Committed, SpecMetrics, StepDelta
from .pool import DraftPool
from .rng import random_seed
from .sampling_params import SamplingParams
from .target import Admission, TargetSide

logger = logging.getLogger(__name__)

Sink = Callable[[object], None]  # receives StepDelta objects, or one Exception that ends the request


class RequestFailed(RuntimeError):
    """A request failed inside the engine (its own fault or a bug); other requests are unaffected."""


@dataclass
class StepResult:
    deltas: list[StepDelta] = field(default_factory=list)
    failed: dict[str, Exception] = field(default_factory=dict)


TIMING_KEYS = ("wall_s", "target_forward_s", "prefill_s", "draft_wait_s", "draft_queue_s", "draft_compute_s",
               "draft_forward_s", "draft_hidden_s")


class Waiting(NamedTuple):
    """A request not admitted yet; ``committed``: the output it resumes from (another replica's)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    committed: Committed | None = None


class RequestQueue:
    """What every engine core shares: requests wait in ``waiting`` until a step admits them into
    ``target.seqs`` (specserve's ``EngineCore`` and the vLLM one, ``vllm/target.py``)."""

    waiting: deque
    target: object  # has .seqs (request id -> state) and .num_seqs

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    committed: Committed | None = None) -> None:
        if request_id in self.target.seqs or any(w[0] == request_id for w in self.waiting):
            raise ValueError(f"request_id {request_id!r} is already running")
        self.waiting.append(Waiting(request_id, list(prompt_token_ids), params, committed))

    def _drop_waiting(self, request_id: str) -> bool:
        for i, w in enumerate(self.waiting):
            if w[0] == request_id:
                del self.waiting[i]
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.target.seqs)

    @property
    def num_running(self) -> int:
        return self.target.num_seqs


class EngineCore(RequestQueue):
    def __init__(self, target: TargetSide, pool: DraftPool | None, controller: SpeculationController,
                 max_num_seqs: int = 256):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.target = target
        self.pool = pool
        self.controller = controller
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[tuple[str, list[int], SamplingParams]] = deque()
        self.step_id = 0
        self.first_step_drafts = False  # a new sequence's first step without drafts (config: speculation.first_step_drafts)
        # Where first tokens taken from the prefill go at once (the loop's delivery), so they wait for no
        # verify; None: with the step's other deltas.
        self.on_deltas: Callable[[list[StepDelta]], None] | None = None
        self._last_asked: dict[str, int] = {}  # the previous step's draft lengths (which rows of the next are warm)
        self._last_step_end: float | None = None
        self._fused_tokens = 0  # prompt tokens whose prefill rides in this step's verify forward
        self._last_rows: set[str] = set()  # the sequences the last step verified
        self.totals = SpecMetrics()
        self.timing = {k: 0.0 for k in TIMING_KEYS}
        self.counters = {"num_steps": 0, "num_speculative_steps": 0, "num_cache_only_steps": 0, "num_cache_hits": 0, "num_blocks": 0,
                         "num_requests_failed": 0, "num_requests_aborted": 0, "num_generated_tokens": 0,
                         "num_prefills_apart": 0}  # prompts a forward of their own prefilled, giving their first tokens

    # -- requests -----------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams, committed: Committed | None = None) -> None:
        self.target.validate(prompt_token_ids, params, committed)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; frees its state on both sides. True if it existed."""
        return self._drop_waiting(request_id) or self._close(request_id)

    def _close(self, request_id: str) -> bool:
        if request_id not in self.target.seqs:
            return False
        self.target.close(request_id)
        if self.pool is not None:
            self.pool.close(request_id)
        return True

    def reopen(self, request_id: str) -> OpenSeq | None:
        """The draft-side view of a live sequence: its whole committed tokens (open and resync)."""
        s = self.target.seqs.get(request_id)
        if s is None:
            return None
        p = s.params
        hidden, s.open_hidden = s.open_hidden, None  # the prefill's rows go with the first open only
        if hidden is not None and hidden.shape[0] != len(s.token_ids) - 1:
            hidden = None  # (tokens were committed since: a resync; the head reads zeros for the gap)
        processing = s.processor.for_draft() if s.processor is not None else None
        return OpenSeq(request_id, list(s.token_ids), p.temperature, p.top_k, p.top_p, s.seed, hidden, seeded=p.seed is not None,
                       processing=processing)

    # -- one step -----------------------------------------------------------------------------
    def _admit(self, result: StepResult) -> list[str]:
        """Prefill waiting requests (one batched forward) up to ``max_num_seqs``; their ids. First tokens
        taken from the prefill (``TargetSide.open``) are delivered now, or with the step's deltas."""
        batch = []
        while self.waiting and self.target.num_seqs + len(batch) < self.max_num_seqs:
            rid, prompt, params, committed = self.waiting.popleft()
            batch.append(Admission(rid, prompt, params, params.seed if params.seed is not None else random_seed(), committed))
        if not batch:
            return []
        start = time.perf_counter()
        # With drafting in the first step (speculation.first_step_drafts) every first token is verified.
        first_tokens = not self.first_step_drafts
        admitted = [rid for rid, *_ in batch]
        if first_tokens:  # prefills that ride in this step's verify forward (their first tokens come from it)
            deferred = set(self.target.defer(batch))
            self._fused_tokens = sum(len(b.prompt_token_ids) for b in batch if b.request_id in deferred)
            batch = [b for b in batch if b.request_id not in deferred]
            self.counters["num_prefills_apart"] += len(batch)  # (a forward of their own gives their first tokens)
        deltas: list[StepDelta] = []
        failed: dict[str, Exception] = {}
        try:
            if batch:
                deltas, failed = self.target.open(batch, first_tokens)
        except Exception:  # find the prompt(s) that fail; the others are admitted
            failed = {}
            for one in batch:
                try:
                    more, more_failed = self.target.open([one], first_tokens)
                except Exception as exc:
                    logger.exception("request %s failed at prefill", one[0])
                    result.failed[one[0]] = exc
                    continue
                deltas += more
                failed.update(more_failed)
        for rid, exc in failed.items():
            self.target.close(rid)
            result.failed[rid] = exc
        for d in deltas:
            self.totals.record(d.num_draft_tokens, d.num_accepted_tokens, d.fallback)  # (as the verify's deltas are)
            self.counters["num_generated_tokens"] += len(d.token_ids)
            if d.finished:
                self.target.close(d.request_id)
        self.timing["prefill_s"] += time.perf_counter() - start
        if self.pool is not None:
            for rid in admitted:
                if rid in self.target.seqs:
                    # (with the first token, if the prefill gave it; a deferred prompt's draft prefills while the target does)
                    self.pool.open(rid)
        if deltas:
            if self.on_deltas is not None:
                self.on_deltas(deltas)
            else:
                result.deltas.extend(deltas)
        return admitted

    def _verify(self, blocks, fallback: set[str], only: list[str]):
        try:
            return self.target.verify(blocks, fallback, only)
        except Exception as exc:
            if len(only) == 1:
                logger.exception("request %s failed in a target forward", only[0])
                return [], [], {only[0]: exc}
            half = len(only) // 2
            d1, r1, f1 = self._verify(blocks, fallback, only[:half])
            d2, r2, f2 = self._verify(blocks, fallback, only[half:])
            return d1 + d2, r1 + r2, {**f1, **f2}

    def step(self) -> StepResult:
        start = time.perf_counter()
        result = StepResult()
        if self.pool is not None:
            self.pool.poll()
        admitted = time.perf_counter()
        self._fused_tokens = 0
        admitted_ids = self._admit(result)
        prefill_s = time.perf_counter() - admitted
        seqs = self.target.seqs
        if not seqs:
            return result
        self.step_id += 1
        batch = len(seqs)  # (seqs is live: sequences that finish in this step leave it)
        rows = set(seqs)
        left, self._last_rows = len(self._last_rows - rows), rows  # (their outputs went out in this cycle)
        have_draft = self.pool is not None and self.pool.has_drafts
        wants = plan_draft_lengths(self.controller, len(seqs), have_draft,
                                   ((rid, self.target.room(s), s.params.seed is not None and not s.params.greedy)
                                    for rid, s in seqs.items()), cache=have_draft and self.pool.drafts_ahead)
        # A new sequence's first step goes without drafts (its open still goes out this step: ``fresh``).
        fresh = bool(wants) and not self.first_step_drafts and hold_first_blocks(
            wants, admitted_ids, lambda rid: rid in seqs and not seqs[rid].params.greedy and seqs[rid].params.seed is not None)
        cache_only, arm = self.controller.cache_only, self.controller.arm
        if arm is not None and arm[0] and not wants:
            arm = None  # a speculating arm that asked nothing (no room left) measures nothing
        blocks, fallback, outcome = {}, set(), None
        if wants:
            outcome = self.pool.propose(self.step_id, wants, draft_misses=not cache_only,
                                        budget_s=self.controller.budget(len(seqs), max(wants.values())),
                                        acceptance=self.controller.acceptance)
            blocks, fallback = outcome.blocks, outcome.fallback
        elif self.pool is not None and not have_draft and self.controller.max_k:
            fallback = set(seqs)  # speculation is configured but no draft is up: decoding target-only
        elif have_draft and (fresh or self.controller.push_due(batch)):
            # k = 0: the drafts hear the deltas unawaited and keep up; a new prompt's draft prefills it and
            # drafts its first block ahead (DraftSide._first_blocks) while this step's forward runs.
            self.pool.push(self.step_id)
        forward_before, verify_start = self.target.forward_s, time.perf_counter()
        deltas, results, failed = self._verify(blocks, fallback, list(seqs))
        for rid in failed:
            self._close(rid)
        result.failed.update(failed)
        for d, r in zip(deltas, results):
            if d.finished:
                self._close(d.request_id)
            elif self.pool is not None:
                self.pool.result(r)
            self.totals.record(d.num_draft_tokens, d.num_accepted_tokens, d.fallback)
            self.controller.observe_acceptance(d.num_draft_tokens, d.num_accepted_tokens)
        result.deltas.extend(deltas)
        # The controller learns what the step cost apart from waiting for the drafts (and admitting new
        # requests): the verify and all the bookkeeping around it, which also grows with k.
        cost = (time.perf_counter() - verify_start) + (verify_start - start - prefill_s - (outcome.wait_s if outcome else 0.0))
        record = StepRecord(batch, 1 + max((len(b.draft_token_ids) for b in blocks.values()), default=0), cost, outcome,
                            sum(1 for b in blocks.values() if b.draft_token_ids),
                            sum(1 for b in blocks.values() if b.cache_hit and b.draft_token_ids), wants, cache_only,
                            warm_rows(self._last_asked, wants))
        self._last_asked = wants
        observe(self.controller, record)
        end = time.perf_counter()
        # The whole cycle since the last step ended (delivering its outputs included), unless the engine idled.
        busy = self._last_step_end is not None and start - self._last_step_end < max(0.02, end - start)
        # (less the prompts it prefilled apart; those whose prefill rode in the verify are a term of the model)
        self.controller.observe_cycle(batch, sum(len(d.token_ids) for d in deltas),
                                      end - (self._last_step_end if busy else start) - prefill_s, arm,
                                      prefill_tokens=self._fused_tokens, left=left)
        self._last_step_end = end
        self._account(record, result, deltas, end - start, self.target.forward_s - forward_before)
        return result

    def _account(self, rec: StepRecord, result: StepResult, deltas: list[StepDelta], wall_s: float, forward_s: float) -> None:
        """The step's numbers into the running totals ``metrics`` reads (``deltas``: the verify's; first
        tokens from the prefill are counted at admission)."""
        t, c, o = self.timing, self.counters, rec.outcome
        if o is not None:
            t["draft_wait_s"] += o.wait_s
            t["draft_queue_s"] += o.queue_s
            t["draft_compute_s"] += o.compute_s
            t["draft_forward_s"] += o.forward_s
            t["draft_hidden_s"] += o.hidden_s
            c["num_speculative_steps"] += 1
            c["num_cache_only_steps"] += rec.cache_only
        c["num_cache_hits"] += rec.num_hits
        c["num_blocks"] += rec.num_blocks
        c["num_requests_failed"] += len(result.failed)
        c["num_generated_tokens"] += sum(len(d.token_ids) for d in deltas)
        c["num_steps"] += 1
        t["target_forward_s"] += forward_s
        t["wall_s"] += wall_s

    def idle(self) -> None:
        """Nothing to step: deliver queued deltas (closes) to the drafts."""
        if self.pool is not None:
            self.pool.poll()
            self.pool.flush(self.step_id)

    def metrics(self) -> dict:
        steps = max(1, self.counters["num_steps"])
        spec_steps = max(1, self.counters["num_speculative_steps"])
        t = dict(self.timing)
        per_step = {
            "step_ms": t["wall_s"] / steps * 1e3,
            "target_forward_ms": t["target_forward_s"] / steps * 1e3,
            "draft_wait_ms": t["draft_wait_s"] / spec_steps * 1e3,
            "draft_forward_ms": t["draft_forward_s"] / spec_steps * 1e3,
            "link_ms": (t["draft_wait_s"] - t["draft_compute_s"] - t["draft_queue_s"]) / spec_steps * 1e3,
            "draft_queue_ms": t["draft_queue_s"] / spec_steps * 1e3,  # waiting for the draft's own work (drafting ahead)
            # Wall time not spent in model forwards on the critical path: link, serialization, Python.
            "overhead_ms": (t["wall_s"] - t["target_forward_s"] - t["prefill_s"] - t["draft_forward_s"]) / steps * 1e3,
        }
        out = {**self.totals.to_dict(), **self.counters, "timing": t, "per_step": per_step,
               "num_running": self.num_running, "num_waiting": len(self.waiting),
               "num_prefills_shared": getattr(self.target, "num_prefills_shared", 0),
               "speculation": self.controller.state()}
        if self.pool is not None:
            out["drafts"] = self.pool.status()
        return out


class _LoopSink:
    """``EngineLoop.stream``'s sink: deltas go to a queue on the consumer's event loop. ``_deliver_all``
    batches these, so each loop wakes once per step however many of its requests the step advanced."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue = loop, queue

    def __call__(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _resuming(committed: Committed | None) -> tuple:
    """The extra argument of a resumed request's validation and admission (none for a new one, so a
    core that never resumes keeps the three-argument surface)."""
    return () if committed is None else (committed,)


def _put_all(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class EngineLoop:
    """Runs ``EngineCore.step`` on its own thread; thread-safe ``submit`` / ``abort``."""

    def __init__(self, core: EngineCore, name: str = "specserve-engine"):
        self.core = core
        self._inbox: deque = deque()
        self._wake = threading.Event()
        self._sinks: dict[str, Sink] = {}
        self._stop = threading.Event()
        core.on_deltas = self._deliver_all  # first tokens from the prefill, before the step's verify
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, sink: Sink,
               committed: Committed | None = None) -> None:
        """Validate (``ValueError`` in the caller) and queue a request; deltas go to ``sink``. ``committed``:
        the output it already has (resumed from another replica), which it continues."""
        self.submit_many([(request_id, prompt_token_ids, params, sink, committed)])

    def submit_many(self, requests: list[tuple]) -> None:
        """Validate every request first, then queue them together: one step admits them all. Each is
        (request_id, prompt_token_ids, params, sink), or with a fifth item, its ``committed`` output."""
        queued = [(rid, list(tokens), params, sink, rest[0] if rest else None) for rid, tokens, params, sink, *rest in requests]
        for _, tokens, params, _, committed in queued:
            self.core.validate(tokens, params, *_resuming(committed))
        self._inbox.append(("add_many", queued))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id))
        self._wake.set()

    def submit_window(self, requests: list[tuple[str, list[int], SamplingParams]], window: int,
                      deliver: Callable[[str, object], None],
                      admitted: Callable[[str], None] = lambda rid: None) -> Callable[[], None]:
        """Keep ``window`` of ``requests`` in the engine until they run out; ``deliver(request_id, item)``
        gets every delta and error (on the engine's thread), ``admitted(request_id)`` is called as each
        goes in. A request that finishes is replaced from the engine's thread before its next step
        (replaced from the caller's thread, it often missed that step and left its slot idle for one).
        Returns ``stop()``: no more are started."""
        lock, state = threading.Lock(), {"next": min(window, len(requests)), "stopped": False}

        def refill() -> None:
            with lock:
                i = state["next"]
                if state["stopped"] or i >= len(requests):
                    return
                state["next"] = i + 1
            admitted(requests[i][0])
            try:
                self.submit_many([with_sink(requests[i])])
            except Exception as exc:  # (callers validate first; never lose a request silently)
                deliver(requests[i][0], exc)

        def with_sink(request):
            rid = request[0]

            def sink(item) -> None:
                deliver(rid, item)
                if not isinstance(item, Exception) and item.finished:
                    refill()
            return (*request, sink)

        def stop() -> None:
            with lock:
                state["stopped"] = True

        for r in requests[:window]:
            admitted(r[0])
        self.submit_many([with_sink(r) for r in requests[:window]])
        return stop

    async def stream(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, committed: Committed | None = None):
        """``StepDelta``s of one request in the caller's event loop; leaving early aborts the request."""
        deltas: asyncio.Queue = asyncio.Queue()
        self.submit(request_id, prompt_token_ids, params, _LoopSink(asyncio.get_running_loop(), deltas), committed)
        finished = False
        try:
            while not finished:
                item = await deltas.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # cancelled, or the consumer stopped: free the state on both sides
                self.abort(request_id)

    @property
    def num_requests(self) -> int:
        return len(self._sinks) + sum(len(m[1]) for m in list(self._inbox) if m[0] == "add_many")

    def _deliver(self, rid: str, item) -> None:
        sink = self._sinks.get(rid)
        if sink is None:
            return
        if isinstance(item, Exception) or item.finished:
            del self._sinks[rid]
        try:
            sink(item)
        except Exception:  # a broken consumer must not stop the loop
            logger.exception("delivering to request %s failed", rid)

    def _deliver_all(self, deltas: list[StepDelta]) -> None:
        batches: dict = {}  # event loop -> [(queue, delta)]: one wake-up of each loop per step, not one per delta
        for d in deltas:
            sink = self._sinks.get(d.request_id)
            if type(sink) is not _LoopSink:
                self._deliver(d.request_id, d)
                continue
            if d.finished:
                del self._sinks[d.request_id]
            batches.setdefault(sink.loop, []).append((sink.queue, d))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the consumers' loop has closed: nobody is left to tell
                logger.warning("dropped %d deltas for a closed event loop", len(items))

    def _drain(self) -> None:
        while self._inbox:
            msg = self._inbox.popleft()
            if msg[0] == "add_many":
                for rid, tokens, params, sink, committed in msg[1]:
                    if rid in self._sinks:
                        sink(ValueError(f"request_id {rid!r} is already running"))
                        continue
                    self._sinks[rid] = sink
                    self.core.add_request(rid, tokens, params, *_resuming(committed))
            else:
                rid = msg[1]
                if self.core.abort(rid):
                    self.core.counters["num_requests_aborted"] += 1
                self._sinks.pop(rid, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain()
                if not self.core.has_work():
                    self.core.idle()
                    self._wake.wait(0.25)
                    self._wake.clear()
                    continue
                result = self.core.step()
            except Exception as exc:  # a bug: fail the requests it touched loudly, keep serving
                logger.exception("engine step failed; failing its requests")
                # Every request in flight: those the step finished before it failed have not been told either.
                for rid in set(self.core.target.seqs) | {w[0] for w in self.core.waiting} | set(self._sinks):
                    self.core.abort(rid)
                    self._deliver(rid, RequestFailed(f"engine step failed ({type(exc).__name__})"))
                continue
            for rid, exc in result.failed.items():
                # (a target that cannot resume a request says why, and the router tells the caller)
                self._deliver(rid, exc if isinstance(exc, CannotResume) else RequestFailed(f"request failed ({type(exc).__name__}: {exc})"))
            self._deliver_all(result.deltas)

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        if self.core.pool is not None:
            self.core.pool.shutdown()
