"""``RayEngine``: the driver's handle on a placed draft/target pair (used by ``LLM`` and Serve).

Data flow: ``generate`` validates every prompt on the target actor first, then submits
requests in a bounded window (``ray.wait``), updating a tqdm bar, and returns outputs in
input order; ``stream`` is an async iterator over the target actor's streaming generator,
cancelled (freeing state on both sides) when the consumer stops early.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from dataclasses import asdict

from ..config import EngineConfig
from ..models import check_vocab_compatible, load_tokenizer
from ..outputs import RequestOutput, SpecMetrics, StepDelta
from .placement import DRAFT_BUNDLE, TARGET_BUNDLE, Placement, connect, create_placement_group

logger = logging.getLogger(__name__)
_ids = itertools.count()


def _unwrap(exc: BaseException) -> BaseException:
    """The user-facing cause of a Ray task error (e.g. the ValueError a constructor raised)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, (ValueError, TypeError)) else exc


class RayEngine:
    def __init__(self, config: EngineConfig, placement: Placement | dict | None = None):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .workers import DraftWorker, TargetWorker

        if isinstance(placement, dict):
            placement = Placement(**placement)
        self.placement = placement = placement or Placement()
        self.config = config
        self._started_ray = connect(placement)
        self.pg = create_placement_group(config, placement, local=self._started_ray)
        self.draft = self.target = None
        try:
            cfg = config.to_dict()
            if config.speculative:
                d = config.draft
                self.draft = ray.remote(DraftWorker).options(
                    num_cpus=d.num_cpus, num_gpus=d.num_gpus, resources=d.resources or None,
                    max_restarts=placement.draft_max_restarts, max_task_retries=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=DRAFT_BUNDLE),
                ).remote(cfg)
            t = config.target
            self.target = ray.remote(TargetWorker).options(
                num_cpus=t.num_cpus, num_gpus=t.num_gpus, resources=t.resources or None, max_concurrency=100_000,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=TARGET_BUNDLE),
            ).remote(cfg, asdict(placement), self.draft)
            try:
                self.target_info = ray.get(self.target.ready.remote())
                self.draft_info = ray.get(self.draft.ready.remote()) if self.draft is not None else None
            except ray.exceptions.RayError as exc:
                raise _unwrap(exc) from None
            self._check_vocab()
            if self.draft is not None and placement.channel == "collective":
                group = f"specserve-{uuid.uuid4().hex[:8]}"
                ray.get([self.target.init_collective.remote(placement.collective_backend, group),
                         self.draft.init_collective.remote(placement.collective_backend, group)])
            ray.get(self.target.start.remote())
        except BaseException:
            self.shutdown()
            raise
        self.tokenizer = load_tokenizer(config.target.model, config.target.trust_remote_code)

    def _check_vocab(self) -> None:
        if self.draft_info is not None and self.draft_info["vocab"] is not None:
            check_vocab_compatible(self.target_info["vocab"], self.draft_info["vocab"])

    # -- batch ----------------------------------------------------------------------------
    def generate(self, texts, token_ids, params, use_tqdm=True, max_in_flight: int | None = None) -> list[RequestOutput]:
        import ray
        from tqdm.auto import tqdm

        param_dicts = [p.to_dict() for p in params]
        try:
            ray.get(self.target.validate.remote(list(zip(token_ids, param_dicts))))
        except ray.exceptions.RayTaskError as exc:
            raise _unwrap(exc) from None
        window = max_in_flight or 2 * self.config.max_num_seqs
        outputs: list[RequestOutput | None] = [None] * len(token_ids)
        pending: dict = {}
        todo = iter(range(len(token_ids)))
        with tqdm(total=len(token_ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            try:
                while True:
                    while len(pending) < window:
                        i = next(todo, None)
                        if i is None:
                            break
                        rid = f"batch-{next(_ids)}-{uuid.uuid4().hex[:6]}"
                        pending[self.target.generate.remote(rid, token_ids[i], param_dicts[i])] = (i, rid)
                    if not pending:
                        break
                    done, _ = ray.wait(list(pending), num_returns=1)
                    for ref in done:
                        i, rid = pending.pop(ref)
                        d = ray.get(ref)
                        outputs[i] = RequestOutput(rid, texts[i], token_ids[i], d["token_ids"], d["text"],
                                                   d["finish_reason"], d["stop_reason"], SpecMetrics.from_dict(d["metrics"]))
                        bar.update(1)
            except BaseException:
                for ref in pending:
                    ray.cancel(ref)
                raise
        return outputs

    # -- streaming ------------------------------------------------------------------------
    async def stream(self, token_ids, params, request_id=None):
        rid = request_id or f"stream-{next(_ids)}-{uuid.uuid4().hex[:6]}"
        gen = self.target.stream.options(num_returns="streaming").remote(rid, list(token_ids), params.to_dict())
        finished = False
        try:
            async for ref in gen:
                try:
                    d = await ref
                except Exception as exc:
                    raise _unwrap(exc) from None
                finished = d["finished"]
                yield StepDelta(**d)
        finally:
            if not finished:
                import ray

                ray.cancel(gen)
                self.target.abort.remote(rid)

    def metrics(self) -> dict:
        import ray

        return ray.get(self.target.metrics.remote())

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in (self.target, self.draft):
            if actor is not None:
                ray.kill(actor)
        self.target = self.draft = None
        if getattr(self, "pg", None) is not None:
            remove_placement_group(self.pg)
            self.pg = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
