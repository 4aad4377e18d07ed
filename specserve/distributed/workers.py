"""The two Ray actors: ``DraftWorker`` (answers draft messages) and ``TargetWorker``.

``TargetWorker`` is an async actor that owns the ``SpecEngine`` and runs the continuous-
batching loop: requests arriving through ``stream``/``generate`` join at the next step;
each step plans (prefill + message), asks the draft through the channel with a timeout,
and verifies every live sequence in one forward. If the draft dies or times out, live and
new requests continue target-only (still lossless); when Ray has restarted the draft and a
probe succeeds, live sequences are re-opened on it and speculation resumes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import asdict

import ray

from ..build import build_draft, build_target
from ..config import EngineConfig
from ..engine import SpecEngine
from ..messages import decode, encode
from ..outputs import RequestOutput, SpecMetrics, StepDelta
from ..sampling_params import SamplingParams
from ..models import load_tokenizer, vocab_fingerprint
from .channel import DRAFT_RANK, TARGET_RANK, CollectiveChannel, RayChannel, pack_probs
from .placement import Placement

logger = logging.getLogger("specserve")


def _node_info() -> dict:
    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "pid": os.getpid(), "actor_id": ctx.get_actor_id()}


class DraftWorker:
    def __init__(self, config: dict):
        self.config = EngineConfig.from_dict(config)
        self.side = build_draft(self.config)
        self.backend = None
        self._send_thread: threading.Thread | None = None

    def ready(self) -> dict:
        drafter = self.side.drafter
        backend = getattr(drafter, "backend", None)
        fp = None
        if backend is not None:
            d = self.config.draft
            fp = vocab_fingerprint(load_tokenizer(d.model, d.trust_remote_code), backend.vocab_size)
        return {**_node_info(), "vocab": fp}

    def ping(self) -> bool:
        return True

    def init_collective(self, backend: str, group_name: str) -> None:
        self.backend = backend
        CollectiveChannel.init_group(backend, group_name, DRAFT_RANK)
        self.group_name = group_name

    def handle(self, data: bytes, tensor_path: bool = False) -> bytes:
        req = decode(data)  # ProtocolError on bad bytes: raised to the caller, the actor lives on
        reply = self.side.handle(req)
        if tensor_path:
            reply, packed = pack_probs(reply, self.backend)
            if packed is not None:
                import ray.util.collective as col

                if self._send_thread is not None:
                    self._send_thread.join()
                self._send_thread = threading.Thread(target=col.send, args=(packed, TARGET_RANK, self.group_name), daemon=True)
                self._send_thread.start()
        return encode(reply)

    def num_seqs(self) -> int:
        return self.side.num_seqs


class TargetWorker:
    def __init__(self, config: dict, placement: dict, draft=None):
        self.config = EngineConfig.from_dict(config)
        self.placement = Placement(**placement)
        self.target = build_target(self.config)
        self.engine = SpecEngine(self.target, self.config.num_speculative_tokens, self.config.max_num_seqs, draft is not None)
        self.draft = draft
        self.channel = RayChannel(draft, self.placement.channel_delay_ms) if draft is not None else None
        self.draft_up = draft is not None
        self.queues: dict[str, asyncio.Queue] = {}
        self.pending_adds: list = []
        self.pending_aborts: list[str] = []
        self.totals = SpecMetrics()
        self.counters = {"num_requests_finished": 0, "num_requests_aborted": 0, "num_generated_tokens": 0,
                         "num_draft_failures": 0, "num_draft_recoveries": 0}
        self._loop_task = None
        self._probe_task = None
        self._last_probe = 0.0
        self._wake = None

    # -- setup ----------------------------------------------------------------------------
    def ready(self) -> dict:
        return {**_node_info(), "vocab": self.target.vocab_fingerprint(), "max_model_len": self.target.max_model_len}

    def init_collective(self, backend: str, group_name: str) -> None:
        CollectiveChannel.init_group(backend, group_name, TARGET_RANK)
        self.channel = CollectiveChannel(self.draft, self.placement.channel_delay_ms, backend, group_name,
                                         self.target.backend.vocab_size, self.target.backend.device)

    async def start(self) -> None:
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._loop())

    # -- requests -------------------------------------------------------------------------
    def validate(self, requests: list) -> None:
        """Raise ``ValueError`` for the first bad (token_ids, params) pair, naming its index."""
        for i, (token_ids, params) in enumerate(requests):
            try:
                self.target.validate(token_ids, SamplingParams(**params))
            except ValueError as exc:
                raise ValueError(f"request {i}: {exc}") from None

    def _submit(self, request_id: str, token_ids: list[int], params: dict) -> asyncio.Queue:
        sp = SamplingParams(**params)
        self.target.validate(token_ids, sp)
        if request_id in self.queues:
            raise ValueError(f"request_id {request_id!r} is already running")
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        self.pending_adds.append((request_id, list(token_ids), sp))
        self._wake.set()
        return queue

    async def stream(self, request_id: str, token_ids: list[int], params: dict):
        """Ray streaming generator: one dict (``StepDelta``) per step that added tokens."""
        await self.start()
        queue = self._submit(request_id, token_ids, params)
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                if isinstance(delta, BaseException):
                    raise delta
                finished = delta.finished
                yield asdict(delta)
        finally:
            self.queues.pop(request_id, None)
            if not finished:  # cancelled or disconnected: free the state on both sides
                self.pending_aborts.append(request_id)
                self._wake.set()

    async def generate(self, request_id: str, token_ids: list[int], params: dict) -> dict:
        out = RequestOutput(request_id, None, list(token_ids))
        async for d in self.stream(request_id, token_ids, params):
            out.add(StepDelta(**d))
        return {"request_id": request_id, "token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason, "metrics": out.metrics.to_dict()}

    async def abort(self, request_id: str) -> None:
        self.pending_aborts.append(request_id)
        self._wake.set()

    # -- the loop -------------------------------------------------------------------------
    def _apply_pending(self) -> None:
        adds, self.pending_adds = self.pending_adds, []
        for rid, ids, sp in adds:
            if rid in self.queues:  # not cancelled while waiting
                self.engine.add_request(rid, ids, sp)
        aborts, self.pending_aborts = self.pending_aborts, []
        for rid in aborts:
            if self.engine.abort(rid):
                self.counters["num_requests_aborted"] += 1

    async def _loop(self) -> None:
        while True:
            try:
                self._apply_pending()
                if not self.engine.has_work():
                    await self._flush_closes()
                    if not (self.pending_adds or self.pending_aborts):
                        self._wake.clear()
                        await self._wake.wait()
                    continue
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must fail its requests loudly, not hang them
                logger.exception("step failed; failing requests %s", list(self.engine.target.seqs))
                for rid in list(self.engine.target.seqs) + [w[0] for w in self.engine.waiting]:
                    self.engine.abort(rid)
                    if rid in self.queues:
                        self.queues[rid].put_nowait(RuntimeError(f"specserve step failed: {exc}"))

    async def _step(self) -> None:
        req = await asyncio.to_thread(self.engine.plan)
        if req is None:
            return
        reply, fallback = None, False
        if self.engine.k > 0:
            if self.draft_up:
                try:
                    reply = await asyncio.wait_for(self.channel.propose(req), self.placement.draft_timeout_s)
                except Exception as exc:
                    self._draft_failed(exc, req)
                    fallback = True
            else:
                fallback = True
                self.engine.draft_lost(req)
                self._maybe_probe()
        deltas = await asyncio.to_thread(self.engine.finish, reply, fallback)
        for d in deltas:
            self.totals.record(d.num_draft_tokens, d.num_accepted_tokens, d.fallback)
            self.counters["num_generated_tokens"] += len(d.token_ids)
            if d.finished:
                self.counters["num_requests_finished"] += 1
            queue = self.queues.get(d.request_id)
            if queue is not None:
                queue.put_nowait(d)
            elif not d.finished:  # nobody listens any more
                self.pending_aborts.append(d.request_id)

    async def _flush_closes(self) -> None:
        if self.draft_up and self.engine.has_pending_closes and self.engine.k > 0:
            from ..messages import ProposeRequest

            req = ProposeRequest(self.engine.step_id, 0, closes=self.engine.take_closes())
            try:
                await asyncio.wait_for(self.channel.propose(req), self.placement.draft_timeout_s)
            except Exception as exc:
                self._draft_failed(exc, req)

    def _draft_failed(self, exc: BaseException, req) -> None:
        self.engine.draft_lost(req)
        self.channel.degrade()
        if self.draft_up:
            logger.warning("draft unavailable (%s: %s): %d live requests continue target-only until it returns",
                           type(exc).__name__, exc, self.engine.num_running)
            self.counters["num_draft_failures"] += 1
        self.draft_up = False
        self._last_probe = time.monotonic()

    def _maybe_probe(self) -> None:
        due = time.monotonic() - self._last_probe >= self.placement.draft_probe_interval_s
        if due and (self._probe_task is None or self._probe_task.done()):
            self._last_probe = time.monotonic()
            self._probe_task = asyncio.get_running_loop().create_task(self._probe())

    async def _probe(self) -> None:
        try:
            await asyncio.wait_for(self.draft.ping.remote(), self.placement.draft_timeout_s)
        except Exception:
            return
        logger.warning("draft is back: resyncing %d live requests and resuming speculation", self.engine.num_running)
        self.counters["num_draft_recoveries"] += 1
        self.engine.resync_draft()
        self.draft_up = True

    # -- introspection --------------------------------------------------------------------
    def metrics(self) -> dict:
        return {
            **self.totals.to_dict(), **self.counters,
            "num_engine_steps": self.engine.step_id,  # batched target forwards (one per step, all sequences)
            "num_running": self.engine.num_running, "num_waiting": len(self.engine.waiting),
            "draft_up": bool(self.draft_up), "has_draft": self.draft is not None,
            "num_speculative_tokens": self.engine.k, "channel": getattr(self.channel, "name", None),
            "channel_tensor_bytes": getattr(self.channel, "num_tensor_bytes", 0),
        }

    def num_seqs(self) -> int:
        return self.engine.num_running + len(self.engine.waiting)
