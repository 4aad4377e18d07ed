"""The side processes: ``TargetWorker`` and ``DraftWorker``, as Ray actors or Serve replicas.

Both are plain classes: ``ray.remote(cls)`` for the batch API, ``serve.deployment(cls)`` for
HTTP (``specserve.serve``), same code. A ``DraftWorker`` loads only the draft, serves it on
a TCP port (``transport.DraftServer``) and, under Serve, announces that address (and its metrics)
to the ``Registry`` twice a second. A ``TargetWorker`` loads only the target, runs
the engine loop on its own thread and finds its drafts through ``discover`` (the draft
actors' current addresses, or the registry), connecting to each over TCP; under Serve it
announces its metrics too, which is how the router knows it is alive. Requests come in
through ``stream`` (an async generator: Ray streaming or Serve ``stream=True``) and
``generate``; a consumer that goes away aborts its request on both sides.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..config import SpecserveConfig
from ..outputs import Committed, RequestOutput
from ..sampling_params import SamplingParams

logger = logging.getLogger("specserve")

# Each announce (and each router poll) is a Serve handle call. An idle app's four replicas used 21-25% of
# a core at 5 announces/s and 4 polls/s, 15-20% at 2/s and 2/s (`/proc` over 20 s, demo pair, two A/B
# pairs). A dead target mostly fails its requests sooner than it leaves the snapshot (its direct stream
# fails at once, then the Serve handle call); otherwise the 503 comes when it leaves.
ANNOUNCE_EVERY_S = 0.5  # how often each replica tells the registry it is alive (and its metrics)
REGISTRY_TTL_S = 2.0  # a replica not heard from for this long is no longer listed
# How long a stopping target waits for its direct streams to close once it has handed them back to the
# router (which resumes each elsewhere): within Serve's graceful_shutdown_timeout_s (5 s, serve/app.py),
# which also covers the 0.5 s drain before it; past that Serve kills the replica anyway.
DRAIN_S = 4.0


def configure_worker_logging() -> None:
    """specserve's progress lines on the worker's stderr, which Ray forwards to the driver."""
    log = logging.getLogger("specserve")
    if not any(getattr(h, "_specserve", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._specserve = True
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def normal_priority() -> int | None:
    """Bring this worker to niceness 0 (Ray starts its workers at 15, below its own daemons): every
    thread so far, so every thread they start too (Linux keeps a niceness per thread). Returns the
    niceness it had, or None when it was 0 already or may not be lowered (no CAP_SYS_NICE)."""
    try:
        before = os.getpriority(os.PRIO_PROCESS, 0)
    except (OSError, AttributeError):  # no priorities here (Windows)
        return None
    if before <= 0:
        return None
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
        for tid in tids:
            os.setpriority(os.PRIO_PROCESS, tid, 0)
    except (OSError, ValueError) as exc:
        logger.info("keeping Ray's worker niceness %d: %s", before, exc)
        return None
    return before


def node_info() -> dict:
    import ray

    ctx = ray.get_runtime_context()
    try:
        niceness = os.getpriority(os.PRIO_PROCESS, 0)
    except (OSError, AttributeError):
        niceness = None
    return {"node_id": ctx.get_node_id(), "pid": os.getpid(), "actor_id": ctx.get_actor_id() or "",
            "ip": ray.util.get_node_ip_address(), "niceness": niceness}


class Registry:
    """Where Serve replicas announce themselves: drafts their TCP address, every side its metrics.

    Targets find drafts here; the router reads liveness (fast 503 when no target lives),
    health and aggregated metrics here, without calling a model actor on the request path.
    """

    def __init__(self):
        self.entries: dict[tuple[str, str], tuple[dict, float]] = {}

    def announce(self, kind: str, name: str, payload: dict) -> None:
        self.entries[(kind, name)] = (payload, time.monotonic())

    def withdraw(self, kind: str, name: str) -> None:
        self.entries.pop((kind, name), None)

    def snapshot(self) -> dict[str, dict[str, dict]]:
        now = time.monotonic()
        out: dict[str, dict[str, dict]] = {"draft": {}, "target": {}}
        for (kind, name), (payload, seen) in list(self.entries.items()):
            if now - seen < REGISTRY_TTL_S:
                out.setdefault(kind, {})[name] = payload
            elif now - seen > 60:
                del self.entries[(kind, name)]
        return out

    def drafts(self) -> dict[str, str]:
        return {name: p["address"] for name, p in self.snapshot()["draft"].items()}


class _Announcer:
    """Background thread: announce (kind, name, payload()) to the registry until stopped."""

    def __init__(self, registry, kind: str, name: str, payload):
        self.registry, self.kind, self.name, self.payload = registry, kind, name, payload
        self._stop = threading.Event()
        threading.Thread(target=self._run, name=f"specserve-announce-{kind}", daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                self.registry.announce.remote(self.kind, self.name, self.payload()).result(timeout_s=5)
            except Exception as exc:  # the registry restarts or is busy: try again shortly
                logger.debug("%s %s could not announce itself: %s", self.kind, self.name, exc)
            if self._stop.wait(ANNOUNCE_EVERY_S):
                return

    def stop(self) -> None:
        self._stop.set()
        try:
            self.registry.withdraw.remote(self.kind, self.name)
        except Exception:  # shutting down: the registry may be gone
            pass


def _say_why(role: str):
    """Decorator for a side's constructor: its failure, in one line, before Ray's traceback."""
    def wrap(init):
        def init_or_say_why(self, *args, **kwargs):
            try:
                init(self, *args, **kwargs)
            except Exception as exc:
                configure_worker_logging()
                logger.error("specserve: cannot start the %s: %s", role, str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
                raise
        return init_or_say_why
    return wrap


class DraftWorker:
    @_say_why("draft")
    def __init__(self, config: dict, registry=None, name: str | None = None):
        from ..build import build_draft_service, set_cpu_threads
        from ..secret import resolve_token
        from ..transport import DraftServer

        configure_worker_logging()
        self.config = SpecserveConfig.load(config)
        if self.config.cluster.normal_priority:
            normal_priority()
        set_cpu_threads(self.config, in_process=False)
        info = node_info()
        self.name = name or f"draft-{info['actor_id'][:12] or os.getpid()}"
        started = time.perf_counter()
        logger.info("loading draft %s on node %s", self.config.draft.model or self.config.draft.drafter, info["node_id"][:8])
        self.service = build_draft_service(self.config, self.name, info)
        links = None
        if self.config.channel.tensors == "collective":
            from .collective import link_factory

            links = link_factory(self.config.channel.collective_backend, rank=1, device=self.config.draft.device)
        ch = self.config.channel
        self.server = DraftServer(self.service, port=ch.draft_port, link_factory=links,
                                  token=resolve_token(ch.draft_token, ch.draft_token_file), max_frame_bytes=int(ch.max_frame_mb * 2**20))
        self.info = {**info, "name": self.name, "address": self.server.address, "load_s": time.perf_counter() - started}
        logger.info("draft %s serving at %s (loaded in %.1fs)", self.name, self.server.address, self.info["load_s"])
        self._announcer = _Announcer(registry, "draft", self.name, self.metrics) if registry is not None else None

    def address(self) -> str:
        return self.server.address

    def ready(self) -> dict:
        return self.info

    def ping(self) -> bool:
        return True

    def check_health(self) -> None:
        if not self.server._thread.is_alive():
            raise RuntimeError(f"draft {self.name}: its server thread died")

    def metrics(self) -> dict:
        return {**self.service.metrics(), "address": self.server.address, "node_id": self.info["node_id"]}

    def num_seqs(self) -> int:
        return self.service.num_seqs

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve autoscaling: the sequences this draft holds (its load; requests bypass Serve's handles)."""
        return {"num_seqs": float(self.service.num_seqs)}

    def __del__(self):
        announcer = getattr(self, "_announcer", None)
        if announcer is not None:
            announcer.stop()
        server = getattr(self, "server", None)
        if server is not None:
            server.close()


class TargetWorker:
    @_say_why("target")
    def __init__(self, config: dict, drafts: list | None = None, registry=None, draft_deployment=None, name: str | None = None):
        from ..build import DraftLink, build_engine_loop, set_cpu_threads
        from ..devices import placement
        from ..secret import resolve_token
        from ..transport import SocketEndpoint

        configure_worker_logging()
        self.config = cfg = SpecserveConfig.load(config)
        if cfg.cluster.normal_priority:
            normal_priority()
        set_cpu_threads(cfg, in_process=False)
        info = node_info()
        self.name = name or f"target-{info['actor_id'][:12] or os.getpid()}"
        started = time.perf_counter()
        logger.info("loading target %s on node %s", cfg.target.model, info["node_id"][:8])
        self.draft_actors = list(drafts or [])
        self.registry = registry  # Serve: drafts are found here (draft_deployment only ties the app graph together)
        link = None
        if cfg.speculative:
            delay = cfg.channel.delay_ms
            links = None
            if cfg.channel.tensors == "collective":
                from .collective import link_factory

                links = link_factory(cfg.channel.collective_backend, rank=0, device=cfg.target.device)
            token = resolve_token(cfg.channel.draft_token, cfg.channel.draft_token_file)
            link = DraftLink(self._discover, lambda name, address: SocketEndpoint(address, delay, link_factory=links, token=token),
                             self.name,
                             hello_info={"ip": info["ip"], "device": cfg.target.device, "placement": placement(cfg.target.device)})
        self.loop = build_engine_loop(cfg, link, name=f"specserve-engine-{self.name}")  # specserve's engine, or the backend's (vllm)
        target = self.loop.core.target
        self.tokenizer = target.tokenizer
        self.info = {**info, "name": self.name, "max_model_len": target.max_model_len, "model": cfg.target.model,
                     "vocab": target.vocab_fingerprint(), "load_s": time.perf_counter() - started,
                     "has_tokenizer": target.tokenizer is not None,
                     "has_chat_template": bool(getattr(target.tokenizer, "chat_template", None))}
        self.streams = None
        if registry is not None and cfg.server.direct_streams and cfg.server.stream_token:  # Serve: the router streams directly
            from ..serve.streams import StreamServer

            try:
                self.streams = StreamServer(self.loop, cfg.server.stream_token, info["ip"], self.name,
                                            max_streams=cfg.engine.max_num_seqs * 4, max_request_bytes=cfg.server.max_request_bytes)
            except RuntimeError as exc:  # the router then streams through the Serve handle
                logger.warning("no direct streams from %s: %s", self.name, exc)
        self._announcer = _Announcer(registry, "target", self.name, self.metrics) if registry is not None else None
        logger.info("target %s ready (loaded in %.1fs)", self.name, self.info["load_s"])

    def _discover(self) -> dict[str, str]:
        import ray

        if self.registry is not None:
            return self.registry.drafts.remote().result(timeout_s=5)
        found = {}
        refs = {i: h.address.remote() for i, h in enumerate(self.draft_actors)}
        for i, ref in refs.items():
            try:
                found[f"draft-{i}"] = ray.get(ref, timeout=5)
            except Exception:  # restarting: it will answer on a later round
                pass
        return found

    # -- setup ----------------------------------------------------------------------------------
    def ready(self, wait_for_drafts_s: float = 0.0) -> dict:
        pool = self.loop.core.pool
        if pool is not None and wait_for_drafts_s:
            deadline = time.monotonic() + wait_for_drafts_s
            while not pool.drafts and not pool.refused and time.monotonic() < deadline:
                time.sleep(0.05)  # the engine thread adopts drafts as they connect
        return {**self.info, "drafts": pool.status() if pool is not None else None}

    def tokenizer_files(self) -> dict[str, bytes]:
        """The target's tokenizer as files, so a router or driver needs no copy of the model."""
        if self.tokenizer is None:
            return {}
        with tempfile.TemporaryDirectory() as tmp:
            self.tokenizer.save_pretrained(tmp)
            return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}

    # -- requests -------------------------------------------------------------------------------
    def validate(self, requests: list) -> list[SamplingParams]:
        """Each (token_ids, params dict) pair's ``SamplingParams``; ``ValueError`` for the first bad pair,
        naming its index."""
        out = []
        for i, (token_ids, params) in enumerate(requests):
            try:
                out.append(SamplingParams(**params))
                self.loop.core.validate(token_ids, out[-1])
            except ValueError as exc:
                raise ValueError(f"request {i}: {exc}") from None
        return out

    async def stream(self, request_id: str, token_ids: list[int], params: dict, committed: dict | None = None):
        """One dict (``StepDelta`` fields) per step that added tokens; the last has finished=True.
        ``committed``: the output a resumed request already has (``Committed.to_dict``), which it continues."""
        resume = Committed.from_dict(committed)
        async with contextlib.aclosing(self.loop.stream(request_id, list(token_ids), SamplingParams(**params), resume)) as deltas:
            async for item in deltas:
                yield {**vars(item), "source": self.name}  # (shallow: asdict deep-copies, 10 us a delta)

    async def generate(self, request_id: str, token_ids: list[int], params: dict) -> dict:
        """One request's whole output (its deltas add up on the engine's thread, as ``generate_many``'s)."""
        async with contextlib.aclosing(self.generate_many([(request_id, token_ids, params)], 1)) as outs:
            async for batch in outs:
                return batch[0]

    async def generate_many(self, requests: list, max_in_flight: int, validate: bool = False):
        """Whole outputs (``generate``'s dicts) of (request_id, token_ids, params) requests as they finish, in
        lists (those finished since the last one: one Ray object per request cost the target's cores ~0.5 ms
        a request), at most ``max_in_flight`` in the engine: a finished request is replaced before the
        engine's next step, here, not a round trip later by the caller. ``validate``: check every request
        first (``ValueError`` naming the first bad one, nothing started). Stopping the stream aborts the rest."""
        import asyncio

        params = self.validate([(ids, p) for _, ids, p in requests]) if validate else [SamplingParams(**p) for _, _, p in requests]
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        outs = {rid: RequestOutput(rid, None, list(ids)) for rid, ids, _ in requests}

        def deliver(rid, item) -> None:  # (engine thread) deltas add up here; this loop wakes once per request
            if not isinstance(item, Exception):
                outs[rid].add(item)
                if not item.finished:
                    return
            loop.call_soon_threadsafe(events.put_nowait, (rid, item))

        stop = self.loop.submit_window([(rid, list(ids), sp) for (rid, ids, _), sp in zip(requests, params)], max_in_flight, deliver,
                                       lambda rid: setattr(outs[rid], "arrival_time", time.time()))
        try:
            while outs:
                ready = [await events.get()]
                while not events.empty():
                    ready.append(events.get_nowait())
                for _, item in ready:
                    if isinstance(item, Exception):
                        raise item
                yield [_output_dict(outs.pop(rid)) for rid, _ in ready]
        finally:
            stop()
            for rid in list(outs):
                self.loop.abort(rid)

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    # -- introspection -----------------------------------------------------------------------
    def check_health(self) -> None:
        if not self.loop._thread.is_alive():
            raise RuntimeError(f"target {self.name}: its engine thread died")

    def metrics(self) -> dict:
        m = self.loop.core.metrics()
        m["num_requests"] = self.loop.num_requests
        m["name"] = self.name
        m["has_draft"] = self.loop.core.pool is not None
        m["draft_up"] = bool(self.loop.core.pool is not None and self.loop.core.pool.has_drafts)
        if self.streams is not None:
            m["stream_address"] = self.streams.address
            m["direct_streams"] = self.streams.stats()
        return m

    def num_seqs(self) -> int:
        return self.loop.core.num_running + len(self.loop.core.waiting)

    def __del__(self):
        """Serve's graceful stop (scale-down, rolling update, app deleted) ends here, after its drain, which
        sees only requests that came through the Serve handle. Routers stream from a target they pick in
        the Registry: withdraw from it, refuse new streams (the router then takes the handle, which Serve
        no longer routes here), and hand the open ones back (the router resumes each on another replica
        from the output it has), waiting up to ``DRAIN_S`` for them to close, before stopping."""
        announcer = getattr(self, "_announcer", None)
        if announcer is not None:
            announcer.stop()
        streams = getattr(self, "streams", None)
        if streams is not None:
            if not streams.drain(DRAIN_S):
                logger.warning("target %s stopping with %d direct streams still open %.0f s after handing them back",
                               getattr(self, "name", "?"), streams.streaming, DRAIN_S)
            streams.close()
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.shutdown()


def _output_dict(out: RequestOutput) -> dict:
    """A finished request's output as the target actor returns it (the caller rebuilds a ``RequestOutput``)."""
    return {"request_id": out.request_id, "token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason, "metrics": out.metrics.to_dict(), "logprobs": out.logprobs,
            "prompt_logprobs": out.prompt_logprobs, "arrival_time": out.arrival_time, "first_token_time": out.first_token_time,
            "finished_time": out.finished_time}
