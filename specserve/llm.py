"""``LLM``: the offline batch API, shaped like vLLM's (``LLM(...).generate(prompts, params)``).

In-process by default (draft and target in this process, still talking through the
engine's messages); with ``placement=`` the two sides run as Ray actors on the nodes the
placement selects (see ``specserve.distributed``). Outputs come back in input order.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

from .build import build_draft, build_target, check_draft_compatible
from .config import EngineConfig, SideConfig
from .engine import SpecEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_ids = itertools.count()


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

    ``draft`` is a model directory/id, ``"ngram"`` (prompt lookup) or ``None``;
    ``draft=None`` or ``num_speculative_tokens=0`` is plain target-only decoding.
    """

    def __init__(
        self,
        target: str,
        draft: str | None = None,
        num_speculative_tokens: int = 4,
        dtype: str = "float32",
        device: str = "cpu",
        draft_dtype: str | None = None,
        draft_device: str | None = None,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        trust_remote_code: bool = False,
        draft_probs: bool = True,
        placement=None,
        **kwargs,
    ):
        if kwargs:
            raise TypeError(f"unexpected arguments to LLM: {sorted(kwargs)}")
        draft_cfg = None
        if draft is not None:
            draft_cfg = SideConfig(draft, dtype=draft_dtype or dtype, device=draft_device or device, trust_remote_code=trust_remote_code)
        self.config = EngineConfig(
            target=SideConfig(target, dtype=dtype, device=device, trust_remote_code=trust_remote_code),
            draft=draft_cfg,
            num_speculative_tokens=num_speculative_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            draft_probs=draft_probs,
        )
        self._start(placement)

    @classmethod
    def from_config(cls, config: EngineConfig, placement=None) -> "LLM":
        """Build from an ``EngineConfig`` (per-side resources, labels, devices); ``placement``
        (a ``specserve.distributed.Placement``) runs the sides as Ray actors."""
        self = cls.__new__(cls)
        self.config = config
        self._start(placement)
        return self

    def _start(self, placement) -> None:
        if placement is not None:
            from .distributed.client import RayEngine

            self._engine = RayEngine(self.config, placement)
        else:
            self._engine = LocalEngine(self.config)
        self.tokenizer = self._engine.tokenizer

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        texts, token_ids, params = normalize_prompts(prompts, sampling_params, self.tokenizer)
        return self._engine.generate(texts, token_ids, params, use_tqdm)

    def stream(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None):
        """Async iterator of ``StepDelta`` for one prompt (what the HTTP router uses)."""
        texts, token_ids, params = normalize_prompts([prompt], sampling_params, self.tokenizer)
        return self._engine.stream(token_ids[0], params[0], request_id)

    def metrics(self) -> dict:
        return self._engine.metrics()

    def shutdown(self) -> None:
        close = getattr(self._engine, "shutdown", None)
        if close:
            close()


class LocalEngine:
    """Both sides in this process: the reference deployment and the CPU default."""

    def __init__(self, config: EngineConfig):
        check_draft_compatible(config)
        self.config = config
        self.target = build_target(config)
        self.tokenizer = self.target.tokenizer
        self.draft = build_draft(config) if config.speculative else None
        self.engine = SpecEngine(self.target, config.num_speculative_tokens, config.max_num_seqs, self.draft is not None)
        from .outputs import SpecMetrics

        self.totals = SpecMetrics()

    def generate(self, texts, token_ids, params, use_tqdm=True) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        outputs: dict[str, RequestOutput] = {}
        order = []
        for text, ids, p in zip(texts, token_ids, params):
            rid = f"req-{next(_ids)}"
            self.engine.add_request(rid, ids, p)  # validates every prompt before any compute
            outputs[rid] = RequestOutput(rid, text, ids)
            order.append(rid)
        propose = self.draft.handle if self.draft is not None else None
        with tqdm(total=len(order), desc="generate", unit="req", disable=not use_tqdm) as bar:
            try:
                while self.engine.has_work():
                    for delta in self.engine.step(propose):
                        outputs[delta.request_id].add(delta)
                        if delta.finished:
                            bar.update(1)
            except BaseException:
                for rid in order:
                    self._abort(rid)
                raise
        self._flush_closes()
        for out in outputs.values():
            self.totals.merge(out.metrics)
        return [outputs[rid] for rid in order]

    def _flush_closes(self) -> None:
        closes = self.engine.take_closes()
        if self.draft is not None:
            for c in closes:
                self.draft.close(c.request_id)

    def _abort(self, rid: str) -> None:
        self.engine.abort(rid)
        if self.draft is not None:
            self.draft.close(rid)

    async def stream(self, token_ids, params, request_id=None):
        rid = request_id or f"req-{next(_ids)}"
        self.engine.add_request(rid, token_ids, params)
        propose = self.draft.handle if self.draft is not None else None
        import asyncio

        try:
            while True:
                finished = False
                for delta in self.engine.step(propose):
                    if delta.request_id == rid:
                        yield delta
                        finished = delta.finished
                if finished or not self.engine.has_work():
                    return
                await asyncio.sleep(0)
        finally:
            self._abort(rid)
            self._flush_closes()

    def metrics(self) -> dict:
        return self.totals.to_dict()
