"""The HTTP router (Serve ingress): OpenAI's API over the Target deployment, owning no model.

Data flow: HTTP -> ``EdgeMiddleware`` (key, size, admission: before the body is read) ->
pydantic validation (400 in OpenAI's envelope) -> tokens (a thread, off the event loop;
chat template for chat; the tokenizer comes from a target replica, so the router needs no
model files) -> the least-loaded ``Target`` replica (Serve's handle) -> SSE chunks or one
JSON body. Replicas announce themselves to the ``Registry``; the router reads liveness
there (no live target: 503 at once), health and aggregated metrics. A stream's first chunk
is awaited before the 200 is sent, so streaming and non-streaming requests fail the same
way; later failures travel in-band, without internals. The same router is the app's Python
API: ``completions`` / ``chat`` (async generators, called through a ``DeploymentHandle`` with
``stream=True``, which is how Ray Data's ``ServeDeploymentProcessorConfig`` calls them) take the
HTTP request models or dicts and yield the HTTP response body (or, for ``stream: true``, the
chunks), with the same validation, admission limit and metrics; a bad request raises
``ValueError`` naming the field.
"""
# No `from __future__ import annotations` here: Serve's ingress reads the endpoints' real annotations.

import asyncio
import dataclasses
import json
import logging
import random
import time
import uuid
from pathlib import Path

from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve

from ..config import SpecserveConfig
from ..distributed.workers import normal_priority
from ..outputs import RequestOutput, SpecMetrics, StepDelta
from ..rng import MAX_SEED
from .edge import EdgeLimits, error_body
from .http import (ERROR_RESPONSES, APIError, DeadTarget, LogprobsFormatter, fastapi_app, is_dead_replica, next_chunk, unavailable,
                   usage_body, validation_message)
from .ingress import serving_direct, wait_for_ports
from .metrics import prometheus_text
from .protocol import ChatCompletionRequest, CompletionRequest
from .streams import SparePool, StreamRefused, TargetGone, open_stream

logger = logging.getLogger("specserve.serve")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
REGISTRY_POLL_S = 0.5  # the Registry's snapshot: liveness, drafts' state, metrics (replicas announce every 0.5 s)
AVOID_S = 5.0  # a target whose direct stream failed is reached through the Serve handle for this long


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
def _echo_entries(token_ids: list[int], prompt_logprobs: list | None) -> list:
    """The prompt's logprob entries for an echoed completion: the first token's logprob is null."""
    entries = list(prompt_logprobs or ())
    if len(entries) != len(token_ids):
        entries = [None] * len(token_ids)
    return [[[t, None]] if e is None else e for t, e in zip(token_ids, entries)]


def _tool_call_message(body, text: str, finish: str | None) -> tuple[dict, str | None]:
    """The assistant's message for tool_choice required (the output is a JSON array of {name,
    parameters}) or a named function (the output is its arguments), and the finish reason vLLM
    gives (tool_calls for required, stop for a named one). An output cut short (max_tokens) is no
    call: it stays the content."""
    def call(name: str, arguments: str) -> dict:
        return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function", "function": {"name": name, "arguments": arguments}}

    if isinstance(body.tool_choice, str):  # required
        try:
            calls = [call(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return {"role": "assistant", "content": text, "tool_calls": []}, finish
        return {"role": "assistant", "content": "", "tool_calls": calls}, "tool_calls" if finish == "stop" else finish
    return {"role": "assistant", "content": "", "tool_calls": [call(body.tool_choice.function.name, text)]}, finish


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
        self.target = target
        self.registry = registry
        self._grammar_cache = None  # structured.Grammars: constraints compiled at the edge
        self.snapshot: dict = {"draft": {}, "target": {}}
        self.snapshot_at = 0.0
        self.last_target_ok = 0.0
        self.info: dict | None = None
        self.tokenizer = None
        self._info_lock = asyncio.Lock()
        self._poller: asyncio.Task | None = None
        self._warming: asyncio.Task | None = None  # fetching the target's info and tokenizer ahead of the first request
        self._streams_open: dict[str, int] = {}  # direct streams open per target replica (the router's load balance)
        self._avoid: dict[str, float] = {}  # target replica -> until when not to open direct streams to it
        self._spares = SparePool(server.stream_token, server.stream_spares) if server.direct_streams and server.stream_token else None
        self.created = int(time.time())
        # transformers' tokenizer classes take seconds to import (measured: 4.4 s of a 4.8 s first request,
        # demo pair): import them while the models load, not on the first request.
        from transformers import AutoTokenizer  # noqa: F401
        asyncio.get_running_loop().call_soon(self._ensure_poller)  # Serve builds replicas on their loop: watch (and say "ready") at once

    # -- the registry ---------------------------------------------------------------------------
    async def _poll_registry(self) -> None:
        announced = False
        while True:
            try:
                self.snapshot = await asyncio.wait_for(self.registry.snapshot.remote(), timeout=2)
                self.snapshot_at = time.monotonic()
            except Exception as exc:  # the registry restarts: keep the last snapshot, say it is stale
                logger.debug("registry poll failed: %s", exc)
            targets, drafts = len(self.snapshot["target"]), len(self.snapshot["draft"])
            connected = all(t.get("draft_up") for t in self.snapshot["target"].values())
            if self._spares is not None:
                now = time.monotonic()
                self._spares.keep({t["stream_address"] for name, t in self.snapshot["target"].items()
                                   if t.get("stream_address") and self._avoid.get(name, 0.0) <= now})
            if targets and self.info is None and (self._warming is None or self._warming.done()):
                # The target's info and tokenizer before the first request needs them (a task of its own:
                # the snapshot the fast 503 reads keeps its pace meanwhile).
                self._warming = asyncio.get_running_loop().create_task(self._warm())
            if not announced and targets and self.info is not None and (not self.cfg.speculative or (drafts and connected)):
                announced = True  # `serve run` forwards this line: it says when to connect
                logger.warning("ready: model id %r, %d target and %d draft replica(s) up", self.model_name, targets, drafts)
            await asyncio.sleep(REGISTRY_POLL_S)

    async def _warm(self) -> None:
        try:
            await self._ready()
        except Exception as exc:  # not ready yet: the next poll tries again (a request would, too)
            logger.debug("router warm-up: %s", exc)

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_registry())

    def targets_alive(self) -> bool:
        fresh = time.monotonic() - self.snapshot_at < 3.0
        return bool(self.snapshot["target"]) or not fresh or time.monotonic() - self.last_target_ok < 1.0

    async def _ready(self) -> None:
        """Target info and tokenizer, fetched once from a target replica (no model files here)."""
        self._ensure_poller()
        if self.info is not None:
            if not self.targets_alive():
                raise unavailable("no target replica is available (it is restarting); retry shortly")
            return
        async with self._info_lock:
            if self.info is not None:
                return
            try:
                info = await asyncio.wait_for(self.target.ready.remote(), timeout=10)
                files = await asyncio.wait_for(self.target.tokenizer_files.remote(), timeout=30)
            except Exception as exc:
                logger.warning("target not ready: %s", exc)
                raise unavailable("the target is not ready yet; retry shortly") from None
            from ..distributed.client import load_tokenizer_from_files

            self.tokenizer = await asyncio.to_thread(load_tokenizer_from_files, files)
            self.info = info
            self.last_target_ok = time.monotonic()

    async def check_health(self) -> None:
        """Serve's replica health check: the router is healthy when its event loop runs."""

    # -- helpers ----------------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:  # (vLLM: no model means the served one)
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", "model", "model_not_found")

    async def _tokens(self, prompt, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
            return await asyncio.to_thread(self.tokenizer.encode, prompt, add_special_tokens=add_special_tokens)
        vocab = self.info["vocab"]["vocab_size"]
        bad = [t for t in prompt if t >= vocab]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {vocab}), got {bad[:3]}", param="prompt")
        return list(prompt)

    def _check_lengths(self, token_ids: list[int], max_tokens: int) -> None:
        limit = self.info["max_model_len"]
        if len(token_ids) >= limit or len(token_ids) + max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(token_ids) + max_tokens} tokens ({len(token_ids)} in the prompt, {max_tokens} for the completion).",
                param="max_tokens" if len(token_ids) < limit else "prompt", code="context_length_exceeded",
            )

    async def _params(self, body, default_max_tokens: int, token_ids: list[int]):
        try:
            params = body.sampling_params(default_max_tokens)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        self._check_lengths(token_ids, params.max_tokens)
        if params.stop and self.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer; this model has none", param="stop")
        if params.structured_outputs is not None:  # compiled here once, so a grammar that cannot be is a 400 at the edge
            try:
                await asyncio.to_thread(self._grammars().compile, *params.structured_outputs)
            except (ValueError, ImportError) as exc:
                raise APIError(400, str(exc), param=body.constraint_field) from None
        return params

    def _grammars(self):
        if self._grammar_cache is None:
            from ..structured import Grammars

            try:
                self._grammar_cache = Grammars(self.tokenizer, self.info["vocab"]["vocab_size"])
            except ValueError as exc:  # no tokenizer
                raise ValueError(f"structured_outputs: {exc}") from None
        return self._grammar_cache

    # -- endpoints --------------------------------------------------------------------------------
    @fastapi_app.get("/v1/models", responses={401: ERROR_RESPONSES[401]})
    async def models(self):
        self._ensure_poller()
        limit = self.info["max_model_len"] if self.info else None
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "specserve", "max_model_len": limit}]}

    @fastapi_app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def http_completions(self, body: CompletionRequest):
        job = await self._completion(body)
        return await self._respond(job, body)

    @fastapi_app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def http_chat(self, body: ChatCompletionRequest):
        job = await self._chat(body)
        return await self._respond(job, body)

    async def _completion(self, body: CompletionRequest) -> tuple:
        self._check_model(body.model)
        await self._ready()
        token_ids = await self._tokens(body.prompt, body.add_special_tokens is not False)
        token_ids = body.truncate(token_ids, self.info["max_model_len"])
        params = await self._params(body, COMPLETIONS_DEFAULT_MAX_TOKENS, token_ids)
        return "cmpl", False, token_ids, params

    async def _chat(self, body: ChatCompletionRequest) -> tuple:
        self._check_model(body.model)
        await self._ready()
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, f"model {self.model_name!r} has no chat template: use /v1/completions", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None

        def render():
            # The template's text, then tokens (with special tokens only if asked: the template has them),
            # as vLLM renders chat prompts; tools go to the template, as vLLM passes them.
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                continue_final_message=body.continue_final_message, tokenize=False, tools=tools, **(body.chat_template_kwargs or {}))
            return list(self.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens)))

        try:
            token_ids = await asyncio.to_thread(render)
        except Exception as exc:  # a template that cannot render these messages is the request's fault
            raise APIError(400, f"the chat template cannot render these messages: {type(exc).__name__}", param="messages") from None
        token_ids = body.truncate(token_ids, self.info["max_model_len"])
        params = await self._params(body, max(1, self.info["max_model_len"] - len(token_ids)), token_ids)
        return "chatcmpl", True, token_ids, params

    # -- the Python API (DeploymentHandle) ----------------------------------------------------------
    async def completions(self, request):
        """One completion through a ``DeploymentHandle`` (``.options(stream=True)``): ``request`` is a
        ``CompletionRequest`` or a dict of its fields; yields the response body of ``POST
        /v1/completions`` (for ``stream: true``, its chunks). A bad request raises ``ValueError``."""
        body = _parse(CompletionRequest, request)
        async for item in self._handle_call(body, self._completion):
            yield item

    async def chat(self, request):
        """One chat completion through a ``DeploymentHandle``; see ``completions``."""
        body = _parse(ChatCompletionRequest, request)
        async for item in self._handle_call(body, self._chat):
            yield item

    async def _handle_call(self, body, prepare):
        """HTTP's path without HTTP: the same admission limit (a handle call waits for a slot
        instead of answering 429), validation, metrics and errors, as Python exceptions."""
        limits, deadline = self.edge, time.monotonic() + self.cfg.server.request_timeout_s
        while limits.in_flight >= limits.max_pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no room within request_timeout_s ({limits.in_flight} requests in flight)")
            await asyncio.sleep(0.01)
        limits.in_flight += 1
        limits.max_in_flight = max(limits.max_in_flight, limits.in_flight)
        try:
            job = await prepare(body)
            started = await self._start_all(job, body)
            if body.stream:
                async for chunk in self._merged_chunks(started, body):
                    yield chunk
            else:
                yield await self._collect_all(started, body)
        except APIError as exc:
            raise exc.as_exception() from None
        finally:
            limits.in_flight -= 1

    @fastapi_app.get("/health")
    async def health(self):
        self._ensure_poller()
        if time.monotonic() - self.snapshot_at > 1.0:  # stale or never fetched: one quick refresh
            try:
                self.snapshot = await asyncio.wait_for(self.registry.snapshot.remote(), timeout=1.0)
                self.snapshot_at = time.monotonic()
            except Exception:  # answer from what we have, and say how old it is
                pass
        age = time.monotonic() - self.snapshot_at if self.snapshot_at else None
        targets, drafts = self.snapshot["target"], self.snapshot["draft"]
        body = {"targets": len(targets), "drafts": len(drafts), "registry_age_s": None if age is None else round(age, 2),
                "router": "ready" if self.info is not None else "warming",  # (warming: the target's tokenizer not fetched yet)
                "ingress": "direct" if serving_direct() else "proxy"}
        if not targets:
            return JSONResponse({"status": "unavailable", **body, "detail": "no target replica is alive"}, status_code=503)
        speculative = self.cfg.speculative
        degraded = speculative and (not drafts or any(not t.get("draft_up") for t in targets.values()))
        return {"status": "degraded" if degraded else "ok", **body,
                "draft": "none" if not speculative else ("up" if not degraded else "down"),
                "num_running": sum(t.get("num_running", 0) for t in targets.values())}

    @fastapi_app.get("/metrics")
    async def metrics(self):
        self._ensure_poller()
        age = time.monotonic() - self.snapshot_at if self.snapshot_at else -1.0
        return PlainTextResponse(prometheus_text(self.snapshot, self.model_name, self.edge, age),
                                 media_type="text/plain; version=0.0.4")

    # -- generation -------------------------------------------------------------------------------
    def _direct_target(self) -> tuple[str, str] | None:
        """(name, address) of the target replica with the fewest direct streams open from this router,
        among those that offer them; None when none does (the Serve handle serves the request)."""
        server = self.cfg.server
        if not server.direct_streams or not server.stream_token:
            return None
        now, best = time.monotonic(), None
        for name, t in self.snapshot["target"].items():
            address = t.get("stream_address")
            if address and self._avoid.get(name, 0.0) <= now:
                rank = (self._streams_open.get(name, 0), random.random())
                if best is None or rank < best[0]:
                    best = (rank, name, address)
        return None if best is None else best[1:]

    async def _open_direct(self, rid: str, token_ids, params):
        """A direct stream for the request, or None (no target offers one, or it could not be reached);
        on a spare connection (``SparePool``) when there is one."""
        picked = self._direct_target()
        if picked is None:
            return None
        name, address = picked

        def closed() -> None:
            self._streams_open[name] -= 1

        try:
            gen = None if self._spares is None else await self._spares.open(address, rid, list(token_ids), params.to_dict(), closed)
            if gen is None:  # no spare connection: connect now
                gen = await open_stream(address, self.cfg.server.stream_token, rid, list(token_ids), params.to_dict(),
                                        on_close=closed)
        except (OSError, asyncio.TimeoutError, ValueError) as exc:
            logger.warning("direct stream to %s failed (%s); using the Serve handle", name, exc)
            self._avoid[name] = time.monotonic() + AVOID_S
            return None
        self._streams_open[name] = self._streams_open.get(name, 0) + 1
        gen.target_name = name
        return gen

    async def _start(self, rid: str, token_ids, params, deadline: float, direct: bool = True):
        """Open the target stream and wait for its first chunk: errors before any output are HTTP errors."""
        gen = await self._open_direct(rid, token_ids, params) if direct else None
        if gen is None:
            gen = self.target.options(stream=True).stream.remote(rid, list(token_ids), params.to_dict())
        first = asyncio.ensure_future(gen.__anext__())
        while True:
            done, _ = await asyncio.wait({first}, timeout=0.1)
            if done:
                break
            if not self.targets_alive() or time.monotonic() > deadline:
                first.cancel()
                gen.cancel()
                if time.monotonic() > deadline:
                    raise unavailable(f"request {rid} got no output within {self.cfg.server.request_timeout_s:g}s; retry later")
                raise unavailable("no target replica is available (it is restarting); retry shortly")
        try:
            chunk = first.result()
        except StopAsyncIteration:
            raise APIError(500, f"the target ended request {rid} without output", "server_error") from None
        except ValueError as exc:  # the target's own validation: the request's fault
            raise APIError(400, str(exc).split("\n")[-1][:500]) from None
        except StreamRefused as exc:  # busy, or a secret from another app: the Serve handle serves it (for a while)
            logger.warning("target %s refused a direct stream (%s); using the Serve handle", gen.target_name, exc)
            self._avoid[gen.target_name] = time.monotonic() + AVOID_S
            return await self._start(rid, token_ids, params, deadline, direct=False)
        except Exception as exc:
            if isinstance(exc, TargetGone):
                self._avoid[gen.target_name] = time.monotonic() + AVOID_S
            if is_dead_replica(exc):
                raise DeadTarget() from None
            logger.exception("request %s failed before its first token", rid)
            raise APIError(500, f"generation failed (request {rid}); the server logs have the details", "server_error") from None
        self.last_target_ok = time.monotonic()
        return gen, StepDelta.from_dict(chunk), chunk.get("source")

    async def _started(self, job: tuple, body) -> tuple:
        """Start a job on a target replica (retried on another if one died before any output)."""
        prefix, chat, token_ids, params = job
        rid = f"{prefix}-{body.request_id or ''}{'-' if body.request_id else ''}{uuid.uuid4().hex}"
        deadline = time.monotonic() + self.cfg.server.request_timeout_s
        for attempt in range(3):  # a target replica that died before any output: safe to ask another
            try:
                gen, first, source = await self._start(f"{rid}-{attempt}" if attempt else rid, token_ids, params, deadline)
                break
            except DeadTarget:
                if attempt == 2 or not self.targets_alive():
                    raise unavailable("the target replica failed; retry shortly") from None
                await asyncio.sleep(0.2)
        return rid, chat, gen, first, source, token_ids, body, deadline

    async def _start_all(self, job: tuple, body) -> list[tuple]:
        """Start the request's ``n`` choices (choice i's seed is seed + i, as vLLM seeds them); all of
        them have started, or none (an error before any output is the request's HTTP error)."""
        n = body.n or 1
        if n == 1:
            return [await self._started(job, body)]
        prefix, chat, token_ids, params = job
        seeds = [None if params.seed is None else (params.seed + i) % (MAX_SEED + 1) for i in range(n)]
        results = await asyncio.gather(*[self._started((prefix, chat, token_ids, dataclasses.replace(params, seed=seed)), body)
                                         for seed in seeds], return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for r in results:
                if not isinstance(r, BaseException):
                    r[2].cancel()
            raise failed[0]
        return results

    async def _respond(self, job: tuple, body):
        started = await self._start_all(job, body)
        if body.stream:
            async def sse():
                async for chunk in self._merged_chunks(started, body):
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._collect_all(started, body)

    async def _collect_all(self, started: list[tuple], body) -> dict:
        """One response body with a choice per started stream (index i: the i-th)."""
        tasks = [asyncio.ensure_future(self._collect(*s)) for s in started]
        try:
            bodies = await asyncio.gather(*tasks)
        finally:  # one choice failed (or the caller left): the others stop too
            for t in tasks:
                t.cancel()
        if len(bodies) == 1:
            return bodies[0]
        merged, metrics = bodies[0], SpecMetrics()
        merged["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
        merged["usage"] = usage_body(merged["usage"]["prompt_tokens"], sum(b["usage"]["completion_tokens"] for b in bodies))
        for b in bodies:
            metrics.merge(SpecMetrics.from_dict(b["specserve"]))
        merged["specserve"] = {**metrics.to_dict(), "target": [b["specserve"]["target"] for b in bodies]}
        return merged

    async def _merged_chunks(self, started: list[tuple], body):
        """The streams of the ``n`` choices as one stream: chunks as they come, each with its choice's
        index and the first stream's id; one usage chunk at the end, over all of them."""
        if len(started) == 1:
            async for chunk in self._chunks(*started[0]):
                yield chunk
            return
        queue: asyncio.Queue = asyncio.Queue()
        counts = [0] * len(started)

        async def pump(i: int, s: tuple) -> None:
            try:
                async for chunk in self._chunks(*s, index=i, counts=counts, response_id=started[0][0]):
                    await queue.put(chunk)
            finally:
                await queue.put(None)

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(started)]
        try:
            ended = 0
            while ended < len(tasks):
                chunk = await queue.get()
                if chunk is None:
                    ended += 1
                else:
                    yield chunk
            if body.include_usage:
                rid, chat, token_ids = started[0][0], started[0][1], started[0][5]
                yield {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
                       "model": self.model_name, "choices": [], "usage": usage_body(len(token_ids), sum(counts))}
        finally:
            for t in tasks:
                t.cancel()

    async def _collect(self, rid, chat, gen, first, source, token_ids, body, deadline) -> dict:
        """The whole output as one response body."""
        out = RequestOutput(rid, None, token_ids)
        out.add(first)
        try:
            while not out.finished:
                out.add(StepDelta.from_dict(await next_chunk(gen, deadline)))
        except Exception as exc:
            logger.exception("request %s failed", rid)
            if is_dead_replica(exc):
                raise unavailable(f"the target replica serving request {rid} failed; retry") from None
            raise APIError(500, f"generation failed (request {rid}); the server logs have the details", "server_error") from None
        finally:
            gen.cancel()
        prompt_only = not chat and body.max_tokens == 0  # echo of the prompt alone (one token was made to get there)
        text, entries = ("", []) if prompt_only else (out.text, out.logprobs)
        finish = "length" if prompt_only else out.finish_reason
        if body.echo:
            text = self._echo_text(chat, body, token_ids) + text
            if not chat and out.logprobs is not None:
                entries = _echo_entries(token_ids, out.prompt_logprobs) + entries
        choice = {"index": 0, "finish_reason": finish}
        if chat and body.calls_tools:
            choice["message"], choice["finish_reason"] = _tool_call_message(body, text, finish)
        elif chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if out.logprobs is not None or not chat:
            choice["logprobs"] = self._logprob_formatter(chat, body)(entries) if out.logprobs is not None else None
        if body.return_token_ids:
            choice.update(prompt_token_ids=list(token_ids), token_ids=[] if prompt_only else list(out.token_ids))
        response = {
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": [choice],
            "usage": usage_body(len(token_ids), 0 if prompt_only else len(out.token_ids)),
            "specserve": {**out.metrics.to_dict(), "target": source},
        }
        if body.prompt_logprobs is not None:  # vLLM's place for them: the choice's (completions), the response's (chat)
            (response if chat else choice)["prompt_logprobs"] = self._prompt_logprobs(out.prompt_logprobs or [None])
        return response

    def _echo_text(self, chat: bool, body, token_ids: list[int]) -> str:
        """What echo prepends: the prompt (completions; its text as sent unless truncated) or the last
        message's content when it is the assistant's (chat, as vLLM)."""
        if chat:
            last = body.messages[-1]
            return last.text() if last.role == "assistant" else ""
        if isinstance(body.prompt, str) and body.truncate_prompt_tokens is None:
            return body.prompt
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def _prompt_logprobs(self, entries: list) -> list:
        """Prompt logprobs as vLLM's JSON: per token None (the first) or {id: {logprob, rank, decoded_token}}."""
        decode = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else str  # noqa: E731
        out = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            (tok, lp, *rank), tops = e[0], e[1:]
            d = {str(t): {"logprob": max(v, -9999.0), "rank": r + 1, "decoded_token": decode(t)} for r, (t, v) in enumerate(tops)}
            d.setdefault(str(tok), {"logprob": max(lp, -9999.0), "rank": rank[0] if rank else None, "decoded_token": decode(tok)})
            out.append(d)
        return out

    def _logprob_formatter(self, chat: bool, body) -> LogprobsFormatter:
        return LogprobsFormatter(self.tokenizer, chat, bool(body.return_tokens_as_token_ids))

    async def _chunks(self, rid, chat, gen, first: StepDelta, source, token_ids, body, deadline, index: int = 0,
                      counts: list | None = None, response_id: str | None = None):
        """The output as streaming chunks (dicts); a failure after the first is one in-band error chunk.
        One of ``n`` choices: ``index``, the response's id, and its token count left in ``counts``
        (the caller sends the usage)."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        created, out = int(time.time()), RequestOutput(rid, None, token_ids)
        response_id = response_id or rid
        logprobs = self._logprob_formatter(chat, body) if body.num_logprobs is not None else None

        prompt_only = not chat and body.max_tokens == 0
        echo = [body.echo]  # the first chunk with output carries the echoed prompt

        def chunk(d: StepDelta | None, first_chunk=False) -> dict:
            text, finish = (d.text if d else ""), (d.finish_reason if d is not None and d.finished else None)
            entries = d.logprobs if d is not None else None
            if prompt_only and d is not None:
                text, entries, finish = "", ([] if entries is not None else None), ("length" if d.finished else None)
            if echo[0] and d is not None:
                echo[0] = False
                text = self._echo_text(chat, body, token_ids) + text
                if not chat and entries is not None:
                    entries = _echo_entries(token_ids, d.prompt_logprobs) + entries
            if chat:
                delta = {"role": "assistant", "content": text or ""} if first_chunk else ({"content": text} if text else {})
                choice = {"index": index, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
            if body.return_token_ids and d is not None:
                choice["token_ids"] = [] if prompt_only else list(d.token_ids)
            if logprobs is not None and entries is not None:
                choice["logprobs"] = logprobs(entries)
            body_ = {"id": response_id, "object": kind, "created": created, "model": self.model_name, "choices": [choice]}
            if finish is not None:
                body_["specserve"] = out.metrics.to_dict()
            if body.continuous_usage:  # this choice's tokens so far, as vLLM counts them
                body_["usage"] = usage_body(len(token_ids), 0 if prompt_only else len(out.token_ids))
            return body_

        try:
            if chat:
                yield chunk(None, first_chunk=True)
            d = first
            while True:
                out.add(d)
                if d.text or d.finished or echo[0] or ((body.return_token_ids or logprobs is not None) and d.token_ids):
                    yield chunk(d)
                if d.finished:
                    break
                d = StepDelta.from_dict(await next_chunk(gen, deadline))
            made = 0 if prompt_only else len(out.token_ids)
            if counts is not None:
                counts[index] = made
            elif body.include_usage:
                yield {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [],
                       "usage": usage_body(len(token_ids), made)}
        except Exception as exc:  # after the stream started, errors travel in-band, without internals
            logger.exception("stream %s failed", rid)
            message = (f"the target replica serving request {rid} failed; retry" if is_dead_replica(exc)
                       else f"generation failed (request {rid}); the server logs have the details")
            yield error_body(message, "server_error")
        finally:
            gen.cancel()
