"""``LLM``: the offline batch API, shaped like vLLM's (``LLM(...).generate(prompts, params)``).

In-process by default: the target and the draft run in this process, on the same engine loop
and the same messages as the distributed path (the draft behind an in-process endpoint,
drafting ahead on its own thread). With ``ray=True`` the sides run as Ray actors on the
nodes the configuration selects (``specserve.distributed``). Outputs come back in input
order; ``stream`` yields deltas and any number of streams may run at once. ``shutdown`` (or
``with LLM(...)``) stops everything in order; an ``LLM`` that is garbage-collected or still
alive at interpreter exit is shut down the same way, so a script may simply end.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import logging
import queue
import time
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path

from .config import SpecserveConfig
from .outputs import RequestOutput, StepDelta
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_ids = itertools.count()
_UNSET = object()


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{next(_ids)}-{uuid.uuid4().hex[:8]}"


def normalize_prompts(prompts, sampling_params, tokenizer) -> tuple[list[str | None], list[list[int]], list[SamplingParams]]:
    """Validate ``generate`` inputs into (texts, token ids, params), one per prompt."""
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, dict)):
        raise TypeError(f"prompts must be a list of strings or a list of token-id lists, got {type(prompts).__name__}")
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        params = [sampling_params] * len(prompts)
    else:
        params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries but there are {len(prompts)} prompts")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params entries must be SamplingParams, got {type(p).__name__}")
    texts, token_ids = [], []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"prompts[{i}] is a string but the target has no tokenizer: pass token-id lists")
            texts.append(p)
            token_ids.append(tokenizer.encode(p))
        elif isinstance(p, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            texts.append(None)
            token_ids.append(list(p))
        else:
            raise TypeError(f"prompts[{i}] must be a string or a list of ints, got {type(p).__name__}")
    return texts, token_ids, params


class LLM:
    """Speculative decoding with a draft proposing and a target verifying, lossless.

    ``LLM("demo:target", draft="demo:draft", num_speculative_tokens=4)``: ``draft`` is a model
    directory/id, ``"ngram"`` (prompt lookup) or ``None`` (target-only). Any configuration
    field can be given by its flat name (``dtype=``, ``draft_device=``, ``max_num_seqs=``,
    ``adaptive=``; see ``specserve serve --help``), on top of ``config`` (a
    ``SpecserveConfig``, a dict, or a YAML/JSON path). ``ray=True`` runs the sides as Ray
    actors placed by label.
    """

    def __init__(self, target: str | None = None, draft=_UNSET, *, config=None, ray: bool = False, **overrides):
        if target is not None:
            overrides["target"] = target
        if draft is not _UNSET:
            overrides["draft"] = draft
        self.config = SpecserveConfig.load(config, **overrides)
        self._engine = None
        if ray:
            from .distributed.client import RayEngine

            self._engine = RayEngine(self.config)
        else:
            self._engine = LocalEngine(self.config)
        self.tokenizer = self._engine.tokenizer
        # Stop the engine's threads and actors when this object is collected, or at exit if it is
        # still alive: the exit hook is registered after Ray's (hooks run last-in, first-out), so it
        # runs while Ray and torch are intact, instead of daemon threads dying inside a forward.
        self._finalizer = weakref.finalize(self, _shutdown_engine, self._engine)
        self._finalizer.atexit = False
        atexit.register(self._finalizer)

    @classmethod
    def from_config(cls, config: "SpecserveConfig | dict | str | Path", ray: bool = False, **overrides) -> "LLM":
        return cls(config=config, ray=ray, **overrides)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True, max_in_flight: int | None = None) -> list[RequestOutput]:
        """Outputs in input order. ``max_in_flight``: at most this many requests in the engine at once, a
        new one starting as each finishes (default: all of them; with ``ray=True``, twice max_num_seqs)."""
        if max_in_flight is not None and (isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1):
            raise ValueError(f"max_in_flight must be a positive integer, got {max_in_flight!r}")
        texts, token_ids, params = normalize_prompts(prompts, sampling_params, self.tokenizer)
        return self._engine.generate(texts, token_ids, params, use_tqdm, max_in_flight)

    async def generate_async(self, prompt, sampling_params: SamplingParams | None = None,
                             request_id: str | None = None) -> RequestOutput:
        """One prompt's whole output, awaited (any number may run at once); cancelling frees it on both sides."""
        texts, token_ids, params = normalize_prompts([prompt], sampling_params, self.tokenizer)
        return await self._engine.generate_async(texts[0], token_ids[0], params[0], request_id or new_request_id("async"))

    def stream(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None):
        """Async iterator of ``StepDelta`` for one prompt; cancelling it frees the request on both sides."""
        _, token_ids, params = normalize_prompts([prompt], sampling_params, self.tokenizer)
        return self._engine.stream(token_ids[0], params[0], request_id or new_request_id("stream"))

    def metrics(self) -> dict:
        return self._engine.metrics()

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine = None
            atexit.unregister(self._finalizer)
            self._finalizer()  # runs the engine's shutdown once, whoever calls first

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _shutdown_engine(engine) -> None:
    try:
        engine.shutdown()
    except Exception:  # at exit or in a collector: say what failed, never raise
        logger.exception("shutting down the engine failed")


class LocalEngine:
    """Both sides in this process: the reference deployment and the CPU default."""

    def __init__(self, config: SpecserveConfig):
        from .build import DraftLink, build_draft_service, build_engine_loop, set_cpu_threads
        from .devices import placement
        from .transport import LocalEndpoint

        set_cpu_threads(config, in_process=True)
        self.config = config
        link = None
        if config.speculative:
            service = build_draft_service(config, "draft-local", own_process=False)
            link = DraftLink(lambda: {"local": service}, lambda name, svc: LocalEndpoint(svc, name, config.channel.delay_ms), "local",
                             background=False, hello_info={"in_process": True, "placement": placement(config.target.device)})
        self.loop = build_engine_loop(config, link)  # specserve's engine, or the backend's (vllm)
        pool = self.loop.core.pool
        if pool is not None and pool.refused:
            self.loop.shutdown()
            raise ValueError(f"the draft cannot serve this target: {next(iter(pool.refused.values()))}")
        self.tokenizer = self.loop.core.target.tokenizer
        self.draft_service = service if config.speculative else None

    @property
    def target(self):
        return self.loop.core.target

    def generate(self, texts, token_ids, params, use_tqdm=True, max_in_flight: int | None = None) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        for i, (ids, p) in enumerate(zip(token_ids, params)):
            try:
                self.loop.core.validate(ids, p)  # every prompt before any compute
            except ValueError as exc:
                raise ValueError(f"request {i}: {exc}") from None
        done: queue.SimpleQueue = queue.SimpleQueue()
        outputs, order = {}, []
        for text, ids in zip(texts, token_ids):
            rid = new_request_id("batch")
            outputs[rid] = RequestOutput(rid, text, ids)
            order.append(rid)

        def deliver(rid, item):
            if isinstance(item, Exception):
                done.put((rid, item))
                return
            outputs[rid].add(item)
            if item.finished:
                done.put((rid, None))

        stop = None
        try:
            stop = self.loop.submit_window(list(zip(order, token_ids, params)), max_in_flight or len(order), deliver,
                                           lambda rid: setattr(outputs[rid], "arrival_time", time.time()))
            with tqdm(total=len(order), desc="generate", unit="req", disable=not use_tqdm) as bar:
                for _ in order:
                    rid, err = done.get()
                    if err is not None:
                        raise err
                    bar.update(1)
        except BaseException:
            if stop is not None:
                stop()
            for rid in order:
                if not outputs[rid].finished:
                    self.loop.abort(rid)
            raise
        return [outputs[rid] for rid in order]

    def stream(self, token_ids, params, request_id):
        return self.loop.stream(request_id, token_ids, params)

    async def generate_async(self, text, token_ids, params, request_id) -> RequestOutput:
        out = RequestOutput(request_id, text, list(token_ids))
        async for delta in self.loop.stream(request_id, token_ids, params):
            out.add(delta)
        return out

    def metrics(self) -> dict:
        return self.loop.core.metrics()

    def shutdown(self) -> None:
        self.loop.shutdown()
        gc.unfreeze()  # (build froze the heap: the sides' objects may go now)


__all__ = ["LLM", "LocalEngine", "normalize_prompts", "StepDelta"]
