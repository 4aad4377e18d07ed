"""The FastAPI app under the router: OpenAI's error envelope everywhere, and what OpenAPI says.

Every error this server sends is ``{"error": {"message", "type", "param", "code"}}``:
validation errors become 400 (not FastAPI's 422), unknown paths 404, anything unexpected a
500 without internals. The OpenAPI document lists exactly the statuses the routes return.
Also the small helpers the router needs (usage, logprobs' shape, dead-replica detection).
"""
# No `from __future__ import annotations` here or in router.py: Serve's ingress reads the
# endpoints' real annotations.

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .edge import EdgeMiddleware, error_body
from .protocol import ErrorResponse
from .streams import TargetGone

logger = logging.getLogger("specserve.serve")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type_, param, code, headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), status_code=self.status,
                            headers=self.headers)

    def as_exception(self) -> Exception:
        """The Python API's form: the request's fault is a ``ValueError``; no target to serve it now (503)
        a ``TimeoutError`` (retry later; Ray Data's processor makes both a row error, not a failed job);
        another server fault a ``RuntimeError``."""
        if self.status < 500:
            return ValueError(self.message if not self.param or self.param in self.message else f"{self.param}: {self.message}")
        return TimeoutError(self.message) if self.status == 503 else RuntimeError(self.message)


def unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", code="service_unavailable", headers={"Retry-After": "2"})


_ERRORS = {
    400: "Invalid request: malformed JSON, a field of the wrong type or out of range, an unsupported field.",
    401: "Missing or invalid API key.",
    404: "Unknown model or path.",
    413: "Request body too large.",
    429: "Too many requests in flight; retry after the Retry-After seconds.",
    503: "No target replica is available (starting or restarting); retry after the Retry-After seconds.",
}
ERROR_RESPONSES = {code: {"model": ErrorResponse, "description": text} for code, text in _ERRORS.items()}

fastapi_app = FastAPI(title="specserve",
                      description="OpenAI-compatible speculative decoding; the draft and the target run on different machines.")
fastapi_app.add_middleware(EdgeMiddleware)


def _openapi():
    """FastAPI documents 422 for bodies; this server answers 400 in OpenAI's envelope instead."""
    if fastapi_app.openapi_schema:
        return fastapi_app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=fastapi_app.title, version="1", description=fastapi_app.description, routes=fastapi_app.routes)
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            op.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    fastapi_app.openapi_schema = schema
    return schema


fastapi_app.openapi = _openapi


@fastapi_app.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError):
    return exc.response()


def validation_message(errors: list[dict]) -> str:
    """A pydantic validation error in one line that names the field (HTTP 400s and the Python API alike)."""
    return _validation(errors)[0]


def _validation(errors: list[dict]) -> tuple[str, str | None]:
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", []) if x != "body"]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        msg = "request body is not valid JSON"
    elif kind == "extra_forbidden":
        msg = f"unsupported field: {param}"
    elif kind == "model_attributes_type" or (kind.endswith("_type") and not loc):
        msg = "request body must be a JSON object"
    else:
        msg = f"{param + ': ' if param else ''}{first.get('msg', 'invalid request')}".replace("Value error, ", "")
    return msg[:500], param


@fastapi_app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    msg, param = _validation(exc.errors())
    return APIError(400, msg, param=param).response()


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), type_).response()


@fastapi_app.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception):
    logger.exception("unexpected error serving %s", request.url.path)
    return APIError(500, "internal error; the server logs have the details", "server_error").response()


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


class LogprobsFormatter:
    """``StepDelta.logprobs`` entries as OpenAI's ``logprobs`` objects (completions: tokens,
    token_logprobs, top_logprobs, text_offset; chat: content[] with bytes and top_logprobs), token
    texts decoded one token at a time (or ``token_id:<id>``); -inf as -9999.0, as vLLM sends it."""

    def __init__(self, tokenizer, chat: bool, as_ids: bool):
        self.tokenizer, self.chat, self.as_ids = tokenizer, chat, as_ids or tokenizer is None
        self.offset = 0  # completions' text_offset: where the next token's text starts

    def token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.tokenizer.decode([token_id])

    def __call__(self, entries: list) -> dict:
        lp = lambda v: max(float(v), -9999.0)  # noqa: E731  (JSON has no -inf)
        if self.chat:
            def item(token_id, value) -> dict:
                text = self.token(token_id)
                return {"token": text, "logprob": lp(value), "bytes": list(text.encode("utf-8"))}
            return {"content": [{**item(*e[0]), "top_logprobs": [item(*t) for t in e[1:]]} for e in entries]}
        tokens, offsets = [], []
        for e in entries:
            tokens.append(self.token(e[0][0]))
            offsets.append(self.offset)
            self.offset += len(tokens[-1])
        # (an echoed prompt's first token has no logprob: null, as vLLM sends it)
        return {"tokens": tokens, "token_logprobs": [None if e[0][1] is None else lp(e[0][1]) for e in entries],
                "top_logprobs": [None if e[0][1] is None else {self.token(t): lp(v) for t, v in e[1:]} for e in entries],
                "text_offset": offsets}


def is_dead_replica(exc: BaseException) -> bool:
    import ray

    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, TargetGone)) or \
        type(exc).__name__ in ("DeploymentUnavailableError", "ActorDiedError")
