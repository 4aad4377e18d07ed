"""The HTTP router (Serve ingress): OpenAI's API over the Target deployment, owning no model.

Data flow: HTTP -> ``EdgeMiddleware`` (key, size, admission: before the body is read) ->
pydantic validation (400 in OpenAI's envelope) -> a ``Job`` (``jobs.py``: tokens, template,
parameters) -> its choices on the target replicas (``resume.py``: the least-loaded replica over a
direct stream, else the Serve handle; a replica that dies, stalls, fails the request or stops
hands it to another, which resumes it from the output already sent) -> SSE chunks or one JSON body
(``responses.py``). Replicas announce themselves to the ``Registry``; the router reads liveness,
progress, health and aggregated metrics there (``targets.py``; no live target: 503 at once). The
same router is the app's Python API: ``completions`` / ``chat`` (async generators, called through
a ``DeploymentHandle`` with ``stream=True``, which is how Ray Data's
``ServeDeploymentProcessorConfig`` calls them) take the HTTP request models or dicts and yield the
HTTP response body (or, for ``stream: true``, the chunks), with the same validation, admission
limit, resumes and metrics; a bad request raises ``ValueError`` naming the field.
"""
# No `from __future__ import annotations` here: Serve's ingress reads the endpoints' real annotations.

import asyncio
import json
import logging
import time
from pathlib import Path

from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve

from ..config import SpecserveConfig
from ..distributed.workers import normal_priority
from .edge import EdgeLimits
from .http import ERROR_RESPONSES, APIError, fastapi_app, validation_message
from .ingress import serving_direct, wait_for_ports
from .jobs import JobMaker
from .metrics import ResumeStats, prometheus_text
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import Responses
from .resume import Resumes
from .targets import TargetDirectory

logger = logging.getLogger("specserve.serve")


def _parse(model, request):
    """A request model from a model or a dict (Ray Data adds its own request_id / idx_in_batch keys)."""
    if isinstance(request, model):
        return request
    if not isinstance(request, dict):
        raise TypeError(f"request must be a {model.__name__} or a dict of its fields, got {type(request).__name__}")
    from pydantic import ValidationError

    try:
        return model.model_validate(request)
    except ValidationError as exc:
        raise ValueError(validation_message(exc.errors())) from None


# Everything the router uses is imported or defined above it: serve.ingress snapshots the
# module's names when the class is decorated, so a function defined further down is missing
# in the replica.
@serve.ingress(fastapi_app)
class Router:
    def __init__(self, config: dict, target, registry):
        self.cfg = SpecserveConfig.load(config)
        if self.cfg.cluster.normal_priority:  # at Ray's niceness 15 a target step on the same cores starved the
            normal_priority()  # front door: 456 ms to a first token at 8 clients, two-device emulation, vs 78 ms for vLLM's
        server = self.cfg.server
        if serving_direct():
            wait_for_ports(server.host)  # Serve binds our port once this returns
        key = server.api_key
        if key is None and server.api_key_file:
            key = Path(server.api_key_file).read_text().strip()
        self.edge = EdgeLimits(key, server.open_metrics, server.max_pending_requests, server.max_request_bytes)
        fastapi_app.state.edge_limits = self.edge
        self.model_name = self.cfg.model_name
        self.targets = TargetDirectory(self.cfg, target, registry, self.model_name)
        self.jobs = JobMaker(self.targets, self.model_name)
        self.resume_stats = ResumeStats()
        self.resumes = Resumes(self.targets, target, server, self.resume_stats)
        self.responses = Responses(self.resumes, self.targets, self.model_name, server.request_timeout_s)
        self.created = int(time.time())
        # transformers' tokenizer classes take seconds to import (measured: 4.4 s of a 4.8 s first request,
        # demo pair): import them while the models load, not on the first request.
        from transformers import AutoTokenizer  # noqa: F401
        asyncio.get_running_loop().call_soon(self.targets.ensure_poller)  # Serve builds replicas on their loop: watch (and say "ready") at once

    async def check_health(self) -> None:
        """Serve's replica health check: the router is healthy when its event loop runs."""

    # -- endpoints --------------------------------------------------------------------------------
    @fastapi_app.get("/v1/models", responses={401: ERROR_RESPONSES[401]})
    async def models(self):
        self.targets.ensure_poller()
        info = self.targets.info
        limit = info["max_model_len"] if info else None
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "specserve", "max_model_len": limit}]}

    @fastapi_app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def http_completions(self, body: CompletionRequest):
        return await self._respond(await self.jobs.completion(body))

    @fastapi_app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def http_chat(self, body: ChatCompletionRequest):
        return await self._respond(await self.jobs.chat(body))

    async def _respond(self, job):
        choices = await self.responses.start(job)
        if job.body.stream:
            async def sse():
                async for chunk in self.responses.chunks(job, choices):
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self.responses.body(job, choices)

    # -- the Python API (DeploymentHandle) ----------------------------------------------------------
    async def completions(self, request):
        """One completion through a ``DeploymentHandle`` (``.options(stream=True)``): ``request`` is a
        ``CompletionRequest`` or a dict of its fields; yields the response body of ``POST
        /v1/completions`` (for ``stream: true``, its chunks). A bad request raises ``ValueError``."""
        body = _parse(CompletionRequest, request)
        async for item in self._handle_call(body, self.jobs.completion):
            yield item

    async def chat(self, request):
        """One chat completion through a ``DeploymentHandle``; see ``completions``."""
        body = _parse(ChatCompletionRequest, request)
        async for item in self._handle_call(body, self.jobs.chat):
            yield item

    async def _handle_call(self, body, prepare):
        """HTTP's path without HTTP: the same admission limit (a handle call waits for a slot
        instead of answering 429), validation, resumes, metrics and errors, as Python exceptions."""
        limits, deadline = self.edge, time.monotonic() + self.cfg.server.request_timeout_s
        while limits.in_flight >= limits.max_pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no room within request_timeout_s ({limits.in_flight} requests in flight)")
            await asyncio.sleep(0.01)
        limits.in_flight += 1
        limits.max_in_flight = max(limits.max_in_flight, limits.in_flight)
        try:
            job = await prepare(body)
            choices = await self.responses.start(job)
            if body.stream:
                async for chunk in self.responses.chunks(job, choices):
                    yield chunk
            else:
                yield await self.responses.body(job, choices)
        except APIError as exc:
            raise exc.as_exception() from None
        finally:
            limits.in_flight -= 1

    @fastapi_app.get("/health")
    async def health(self):
        t = self.targets
        t.ensure_poller()
        if time.monotonic() - t.snapshot_at > 1.0:  # stale or never fetched: one quick refresh (else: from what we have)
            await t.refresh(timeout_s=1.0)
        age = time.monotonic() - t.snapshot_at if t.snapshot_at else None
        targets, drafts = t.snapshot["target"], t.snapshot["draft"]
        body = {"targets": len(targets), "drafts": len(drafts), "registry_age_s": None if age is None else round(age, 2),
                "router": "ready" if t.info is not None else "warming",  # (warming: the target's tokenizer not fetched yet)
                "ingress": "direct" if serving_direct() else "proxy"}
        if not targets:
            return JSONResponse({"status": "unavailable", **body, "detail": "no target replica is alive"}, status_code=503)
        speculative = self.cfg.speculative
        degraded = speculative and (not drafts or any(not x.get("draft_up") for x in targets.values()))
        return {"status": "degraded" if degraded else "ok", **body,
                "draft": "none" if not speculative else ("up" if not degraded else "down"),
                "num_running": sum(x.get("num_running", 0) for x in targets.values())}

    @fastapi_app.get("/metrics")
    async def metrics(self):
        t = self.targets
        t.ensure_poller()
        age = time.monotonic() - t.snapshot_at if t.snapshot_at else -1.0
        return PlainTextResponse(prometheus_text(t.snapshot, self.model_name, self.edge, age, self.resume_stats),
                                 media_type="text/plain; version=0.0.4")
