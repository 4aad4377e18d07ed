"""``RayEngine``: the driver's handle on placed target/draft actors (``LLM(..., ray=True)``).

Data flow: join or start Ray, place one bundle per replica (target first, then each draft),
start the draft actors (each serves its model over TCP) and the target actor (which finds
them by asking each for its current address, so a restarted draft is found again), wait
until everything has loaded and connected, and load the tokenizer the target sends (the
driver needs no model files). ``generate`` validates every prompt on the target first, then
submits requests in a bounded window, updates a progress bar and returns outputs in input
order; ``stream`` iterates the target's streaming generator and cancels it (freeing the
request on both sides) when the consumer stops early.
"""

from __future__ import annotations

import itertools
import logging
import tempfile
import time
import uuid
from pathlib import Path

from ..config import SpecserveConfig
from ..outputs import RequestOutput, SpecMetrics, StepDelta
from .placement import connect, create_placement_group

logger = logging.getLogger(__name__)
_ids = itertools.count()


def unwrap(exc: BaseException) -> BaseException:
    """The user-facing cause of a Ray error (e.g. the ValueError an actor's constructor raised)."""
    seen = 0
    while seen < 5:
        cause = getattr(exc, "cause", None) or getattr(exc, "__cause__", None)
        if isinstance(cause, (ValueError, TypeError, OSError, ImportError)):
            return cause
        if cause is None or cause is exc:
            return exc
        exc, seen = cause, seen + 1
    return exc


def load_tokenizer_from_files(files: dict[str, bytes]):
    """A tokenizer rebuilt from the files a target sent (the real ``from_pretrained`` path)."""
    if not files:
        return None
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp)


class RayEngine:
    def __init__(self, config: SpecserveConfig):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .workers import DraftWorker, TargetWorker

        self.config = cfg = config.with_draft_token()  # both sides get it: the draft's port is authenticated
        self._started_ray = connect(cfg.cluster)
        self.pg = None
        self.target = None
        self.drafts: list = []
        try:
            bundles = [("target", cfg.target)]
            if cfg.speculative:
                bundles += [("draft", cfg.draft)] * cfg.draft.num_replicas
            self.pg = create_placement_group(bundles, cfg.cluster)
            data = cfg.model_dump()
            env = {"runtime_env": cfg.cluster.runtime_env} if cfg.cluster.runtime_env else {}
            for i in range(1, len(bundles)):
                d = cfg.draft
                self.drafts.append(ray.remote(DraftWorker).options(
                    num_cpus=d.num_cpus, num_gpus=d.num_gpus, resources=d.resources or None, max_restarts=-1,
                    max_task_retries=0, scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
                    **env,
                ).remote(data, None, f"draft-{i - 1}"))
            t = cfg.target
            self.target = ray.remote(TargetWorker).options(
                num_cpus=t.num_cpus, num_gpus=t.num_gpus, resources=t.resources or None, max_concurrency=100_000,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=0), **env,
            ).remote(data, self.drafts)
            started = time.perf_counter()
            logger.info("loading the target and %d draft replica(s) ...", len(self.drafts))
            try:
                self.draft_info = ray.get([d.ready.remote() for d in self.drafts])
                self.target_info = ray.get(self.target.ready.remote(wait_for_drafts_s=60.0 if self.drafts else 0.0))
            except ray.exceptions.RayError as exc:
                raise unwrap(exc) from None
            drafts = self.target_info["drafts"]
            if drafts is not None and drafts["refused"]:
                raise ValueError(f"the draft cannot serve this target: {next(iter(drafts['refused'].values()))}")
            logger.info("sides ready in %.1fs", time.perf_counter() - started)
            self.tokenizer = load_tokenizer_from_files(ray.get(self.target.tokenizer_files.remote()))
        except BaseException:
            self.shutdown()
            raise

    # -- batch ----------------------------------------------------------------------------------
    def generate(self, texts, token_ids, params, use_tqdm=True, max_in_flight: int | None = None) -> list[RequestOutput]:
        import ray
        from tqdm.auto import tqdm

        param_dicts = [p.to_dict() for p in params]
        window = max_in_flight or 2 * self.config.engine.max_num_seqs
        rids = [f"batch-{next(_ids)}-{uuid.uuid4().hex[:6]}" for _ in token_ids]
        index = {rid: i for i, rid in enumerate(rids)}
        outputs: list[RequestOutput | None] = [None] * len(token_ids)
        # One streaming call: the target checks every request before it starts any, keeps the window full
        # itself (a finished request is replaced before its engine's next step, not a round trip later from
        # here) and sends the outputs finished since its last message together.
        stream = self.target.generate_many.options(num_returns="streaming").remote(
            [list(r) for r in zip(rids, token_ids, param_dicts)], window, True)
        with tqdm(total=len(token_ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            try:
                for ref in stream:
                    try:
                        finished = ray.get(ref)
                    except ray.exceptions.RayTaskError as exc:
                        raise unwrap(exc) from None
                    for d in finished:
                        i = index[d["request_id"]]
                        outputs[i] = _output(d, texts[i], token_ids[i])
                    bar.update(len(finished))
            except BaseException:
                ray.cancel(stream)  # (the target aborts what is left)
                raise
        return outputs

    async def generate_async(self, text, token_ids, params, request_id) -> RequestOutput:
        """One request's whole output from the target actor (one Ray call, no per-step messages)."""
        import ray

        try:
            d = await self.target.generate.remote(request_id, list(token_ids), params.to_dict())
        except ray.exceptions.RayTaskError as exc:
            raise unwrap(exc) from None
        return _output(d, text, token_ids)

    # -- streaming ------------------------------------------------------------------------------
    async def stream(self, token_ids, params, request_id):
        import ray

        gen = self.target.stream.options(num_returns="streaming").remote(request_id, list(token_ids), params.to_dict())
        finished = False
        try:
            async for ref in gen:
                try:
                    d = await ref
                except Exception as exc:
                    raise unwrap(exc) from None
                finished = d["finished"]
                yield StepDelta.from_dict(d)
        finally:
            if not finished:
                ray.cancel(gen)
                self.target.abort.remote(request_id)

    def metrics(self) -> dict:
        import ray

        return ray.get(self.target.metrics.remote())

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if ray.is_initialized():  # (else Ray was shut down first, e.g. by the caller before exit: its actors went with it)
            for actor in [self.target, *self.drafts]:
                if actor is not None:
                    ray.kill(actor)
            if self.pg is not None:
                remove_placement_group(self.pg)
            if self._started_ray:
                ray.shutdown()
        self.target, self.drafts, self.pg, self._started_ray = None, [], None, False


def _output(d: dict, text, token_ids) -> RequestOutput:
    """The target actor's output dict (``TargetWorker.generate`` / ``generate_many``) as a ``RequestOutput``."""
    return RequestOutput(d["request_id"], text, list(token_ids), d["token_ids"], d["text"], d["finish_reason"], d["stop_reason"],
                         SpecMetrics.from_dict(d["metrics"]), d.get("logprobs"), d.get("prompt_logprobs"),
                         d.get("arrival_time", time.time()), d.get("first_token_time"), d.get("finished_time"))
