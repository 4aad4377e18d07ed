"""The Ray Serve application: a FastAPI router speaking OpenAI's HTTP API.

Data flow: HTTP request -> pydantic validation (400 in OpenAI's error envelope) ->
prompt tokens (chat template for chat) -> ``RayEngine.stream`` on the placed target
actor, which drives the draft actor -> SSE chunks or one JSON body. A client that
disconnects cancels the handler, whose stream cancellation frees the request on both
sides. Speculation stats travel in the vendor field ``specserve``.
"""


import asyncio
import json
import logging
import os
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..outputs import RequestOutput
from .metrics import prometheus_text
from .protocol import ChatCompletionRequest, CompletionRequest, ServeArgs

logger = logging.getLogger("specserve.serve")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type_, param, code, headers


def error_body(message: str, type_: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status, headers=exc.headers)


fastapi_app = FastAPI(title="specserve", description="OpenAI-compatible speculative decoding, draft and target disaggregated.")


@fastapi_app.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError):
    return _error_response(exc)


@fastapi_app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", []) if x != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        msg = f"request body is not valid JSON: {first.get('msg')}"
    elif first.get("type") == "extra_forbidden":
        msg = f"unsupported field: {param}"
    else:
        msg = f"{param + ': ' if param else ''}{first.get('msg', 'invalid request')}"
        msg = msg.replace("Value error, ", "")
    return _error_response(APIError(400, msg, param=param))


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error_response(APIError(exc.status_code, str(exc.detail), type_))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


@serve.deployment(max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0.1})
@serve.ingress(fastapi_app)
class Router:
    def __init__(self, args: dict):
        from ..distributed.client import RayEngine

        self.args = ServeArgs(**args)
        self.api_key = self.args.api_key or os.environ.get("SPECSERVE_API_KEY") or None
        self.model_name = self.args.model_name or Path(self.args.target.rstrip("/")).name
        self.engine = RayEngine(self.args.engine_config(), self.args.placement())
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.target_info["max_model_len"]
        self.created = int(time.time())
        self.in_flight = 0

    async def check_health(self) -> None:
        """Serve's replica health check: an unreachable target makes the replica unhealthy
        (Serve replaces it, and with it the target and draft actors it owns)."""
        await asyncio.wait_for(self.engine.target.metrics.remote(), timeout=30)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # interpreter shutdown: Ray may already be gone
                pass

    # -- helpers --------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {self.api_key}":
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'", "authentication_error",
                           code="invalid_api_key")

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", "model", "model_not_found")

    def _admit(self) -> None:
        if self.in_flight >= self.args.max_pending_requests:
            raise APIError(429, f"server is at capacity ({self.in_flight} requests in flight); retry shortly",
                           "rate_limit_error", code="too_many_requests", headers={"Retry-After": "1"})

    def _tokens(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _check_lengths(self, token_ids: list[int], max_tokens: int) -> None:
        if len(token_ids) + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(token_ids) + max_tokens} tokens ({len(token_ids)} in the prompt, {max_tokens} for the completion).",
                param="max_tokens" if len(token_ids) < self.max_model_len else "prompt", code="context_length_exceeded",
            )

    def _params(self, body, default_max_tokens: int, token_ids: list[int]):
        try:
            params = body.sampling_params(default_max_tokens)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        self._check_lengths(token_ids, params.max_tokens)
        return params

    # -- endpoints ------------------------------------------------------------------------
    @fastapi_app.get("/v1/models")
    async def models(self, request: Request):
        self._authorize(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "specserve", "max_model_len": self.max_model_len}]}

    @fastapi_app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._authorize(request)
        self._check_model(body.model)
        token_ids = self._tokens(body.prompt)
        params = self._params(body, COMPLETIONS_DEFAULT_MAX_TOKENS, token_ids)
        return await self._run("cmpl", "text_completion", token_ids, params, body)

    @fastapi_app.post("/v1/chat/completions")
    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._authorize(request)
        self._check_model(body.model)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, f"model {self.model_name!r} has no chat template: use /v1/completions", param="messages")
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        token_ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(token_ids, dict) or hasattr(token_ids, "input_ids"):
            token_ids = token_ids["input_ids"]
        params = self._params(body, self.max_model_len - len(token_ids), token_ids)
        return await self._run("chatcmpl", "chat.completion", list(token_ids), params, body)

    @fastapi_app.get("/health")
    async def health(self):
        try:
            m = await self.engine.target.metrics.remote()
        except Exception as exc:
            return JSONResponse({"status": "unavailable", "target": "down", "detail": str(exc)}, status_code=503)
        draft = "none" if not m["has_draft"] else ("up" if m["draft_up"] else "down")
        status = "degraded" if draft == "down" else "ok"
        return {"status": status, "target": "up", "draft": draft, "num_running": m["num_running"]}

    @fastapi_app.get("/metrics")
    async def metrics(self):
        m = await self.engine.target.metrics.remote()
        draft_seqs = None
        if self.engine.draft is not None and m["draft_up"]:
            try:
                draft_seqs = await self.engine.draft.num_seqs.remote()
            except Exception:
                draft_seqs = None
        return PlainTextResponse(prometheus_text(m, self.model_name, self.in_flight, draft_seqs),
                                 media_type="text/plain; version=0.0.4")

    # -- generation -----------------------------------------------------------------------
    async def _run(self, prefix: str, kind: str, token_ids, params, body):
        self._admit()
        rid = f"{prefix}-{uuid.uuid4().hex}"
        chat = kind == "chat.completion"
        if body.stream:
            return StreamingResponse(self._sse(rid, chat, token_ids, params, body.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.in_flight += 1
        out = RequestOutput(rid, None, token_ids)
        try:
            try:
                async for d in self.engine.stream(token_ids, params, rid):
                    out.add(d)
            except ValueError as exc:
                raise APIError(400, str(exc)) from None
        finally:
            self.in_flight -= 1
        text, tokens, finish = out.text, len(out.token_ids), out.finish_reason
        choice = {"index": 0, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        return {
            "id": rid, "object": kind, "created": int(time.time()), "model": self.model_name, "choices": [choice],
            "usage": _usage(len(token_ids), tokens), "specserve": out.metrics.to_dict(),
        }

    async def _sse(self, rid, chat, token_ids, params, include_usage):
        kind = "chat.completion.chunk" if chat else "text_completion"
        created, out = int(time.time()), RequestOutput(rid, None, token_ids)

        def chunk(text: str | None, finish, first=False) -> str:
            if chat:
                delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            body = {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [choice]}
            if finish is not None:
                body["specserve"] = out.metrics.to_dict()
            return f"data: {json.dumps(body)}\n\n"

        self.in_flight += 1
        try:
            if chat:
                yield chunk("", None, first=True)
            async for d in self.engine.stream(token_ids, params, rid):
                out.add(d)
                if d.text or d.finished:
                    yield chunk(d.text, d.finish_reason if d.finished else None)
            if include_usage:
                usage = {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [],
                         "usage": _usage(len(token_ids), len(out.token_ids))}
                yield f"data: {json.dumps(usage)}\n\n"
        except ValueError as exc:
            yield f"data: {json.dumps(error_body(str(exc), 'invalid_request_error'))}\n\n"
        except Exception as exc:  # after the stream started, errors must travel in-band
            logger.exception("stream %s failed", rid)
            yield f"data: {json.dumps(error_body(f'generation failed: {exc}', 'server_error'))}\n\n"
        finally:
            self.in_flight -= 1
        yield "data: [DONE]\n\n"


def build_app(args: dict) -> serve.Application:
    """Serve builder referenced from YAML as ``specserve.serve:build_app``; ``args`` follow ``ServeArgs``."""
    validated = ServeArgs(**(args or {}))  # fail at deploy time with a clear pydantic error
    return Router.bind(validated.model_dump())
