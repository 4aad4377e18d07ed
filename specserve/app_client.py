"""``specserve.connect``: a running specserve Serve app from any Ray driver, task or actor, shaped like ``LLM``.

Data flow: ``generate`` / ``generate_async`` / ``stream`` turn each prompt and ``SamplingParams``
into the body of a completion request and call the app's router through its
``DeploymentHandle`` (``Router.completions``, the handle API), with ``return_token_ids`` so the
outputs carry token ids; the answers come back as ``RequestOutput`` / ``StepDelta``, as from
``LLM``. The app does the tokenizing, validation, admission and routing to its targets and
drafts, so many drivers share one set of replicas. Knows nothing of models.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from .outputs import RequestOutput, SpecMetrics, StepDelta
from .sampling_params import SamplingParams


def connect(app: str = "specserve", address: str | None = None) -> "AppClient":
    """A client for the Serve app named ``app`` on the Ray cluster at ``address`` (default:
    ``RAY_ADDRESS``, else the local cluster); joins the cluster unless this process already has."""
    return AppClient(app, address)


def request_body(model: str, prompt, params: SamplingParams, stream: bool = False) -> dict:
    """``SamplingParams`` as the fields of a completion request (the HTTP body)."""
    p = params
    body = {"model": model, "prompt": prompt, "max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
            "top_k": p.top_k, "ignore_eos": p.ignore_eos, "skip_special_tokens": p.skip_special_tokens,
            "return_token_ids": True, "stream": stream}
    if p.stop:
        body["stop"] = list(p.stop)
    if p.stop_token_ids:
        body["stop_token_ids"] = list(p.stop_token_ids)
    if p.seed is not None:
        body["seed"] = p.seed
    return body


def _prompts(prompts) -> list:
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, dict)):
        raise TypeError(f"prompts must be a list of strings or a list of token-id lists, got {type(prompts).__name__}")
    return list(prompts)


def _output(body: dict, prompt) -> RequestOutput:
    choice = body["choices"][0]
    metrics = {k: v for k, v in body.get("specserve", {}).items() if k in SpecMetrics.__dataclass_fields__}
    return RequestOutput(body["id"], prompt if isinstance(prompt, str) else None, choice.get("prompt_token_ids", []),
                         choice.get("token_ids", []), choice.get("text", ""), choice.get("finish_reason"), None,
                         SpecMetrics.from_dict(metrics))


class AppClient:
    def __init__(self, app: str = "specserve", address: str | None = None):
        import ray
        from ray import serve

        if not ray.is_initialized():
            ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False)
        try:
            self._handle = serve.get_app_handle(app)
        except Exception as exc:  # no such app: say which exist
            names = sorted(serve.status().applications)
            raise ValueError(f"no Serve app named {app!r} on this cluster (apps: {', '.join(names) or 'none'})") from exc
        self.app = app
        self.model = self._handle.models.remote().result(timeout_s=60)["data"][0]["id"]
        self._stream = self._handle.options(stream=True)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, max_in_flight: int = 64) -> list[RequestOutput]:
        """Outputs in input order, at most ``max_in_flight`` requests at once; the first bad request
        raises ``ValueError`` naming it (the app validates exactly as over HTTP)."""
        from tqdm.auto import tqdm

        prompts = _prompts(prompts)
        params = [sampling_params or SamplingParams()] * len(prompts) if not isinstance(sampling_params, Sequence) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries but there are {len(prompts)} prompts")
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        pending: list[tuple[int, object]] = []
        with tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm) as bar:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                pending.append((i, self._stream.completions.remote(request_body(self.model, prompt, p))))
                if len(pending) >= max_in_flight:
                    self._take(pending.pop(0), prompts, outputs)
                    bar.update(1)
            while pending:
                self._take(pending.pop(0), prompts, outputs)
                bar.update(1)
        return outputs  # type: ignore[return-value]

    def _take(self, item, prompts, outputs) -> None:
        i, gen = item
        try:
            body = next(iter(gen))
        except ValueError as exc:
            raise ValueError(f"request {i}: {exc}") from None
        outputs[i] = _output(body, prompts[i])

    async def generate_async(self, prompt, params: SamplingParams | None = None) -> RequestOutput:
        """One request, awaited (for asyncio callers such as ``specserve generate --app``)."""
        gen = self._stream.completions.remote(request_body(self.model, prompt, params or SamplingParams()))
        async for body in gen:
            return _output(body, prompt)
        raise RuntimeError("the app answered nothing")

    async def stream(self, prompt, params: SamplingParams | None = None):
        """``StepDelta``s of one request as they are generated."""
        gen = self._stream.completions.remote(request_body(self.model, prompt, params or SamplingParams(), stream=True))
        async for chunk in gen:
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for choice in chunk["choices"]:
                finish = choice.get("finish_reason")
                yield StepDelta(chunk["id"], list(choice.get("token_ids", [])), choice.get("text", ""), finish is not None, finish)
