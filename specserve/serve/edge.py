"""The HTTP edge, before any body is read: authentication, size limit, admission.

A pure ASGI middleware, so it wraps the whole exchange (streaming responses included) and
releases a request's admission slot exactly once, however the request ends (finished,
failed, client gone). Order: ``/health`` is always open; the API key is checked before the
body is parsed (constant-time comparison, ``Bearer`` in any case; ``/metrics`` and the docs
are behind it unless configured open); a body larger than the limit gets 413 without being
read; a generation request beyond the pending limit gets 429 with ``Retry-After`` at once.
Every answer uses OpenAI's error envelope. Knows nothing of the engine.
"""

from __future__ import annotations

import hmac
import json

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
DOC_PATHS = ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class EdgeLimits:
    """What the middleware enforces; the router owns one and counts requests in flight."""

    def __init__(self, api_key: str | None, open_metrics: bool, max_pending: int, max_body_bytes: int):
        self.api_key = api_key.encode() if api_key else None
        self.open_metrics = open_metrics
        self.max_pending = max_pending
        self.max_body_bytes = max_body_bytes
        self.in_flight = 0
        self.max_in_flight = 0  # high-water mark: never above max_pending
        self.num_rejected = 0

    def needs_key(self, path: str) -> bool:
        if self.api_key is None or path == "/health":
            return False
        if path == "/metrics" or path.startswith(DOC_PATHS):
            return not self.open_metrics
        return True

    def authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)


async def send_error(send, status: int, message: str, type_: str, code: str | None = None, headers: dict | None = None) -> None:
    body = json.dumps(error_body(message, type_, None, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class BodyTooLarge(Exception):
    pass


class EdgeMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limits: EdgeLimits | None = getattr(scope["app"].state, "edge_limits", None) if "app" in scope else None
        if limits is None:  # the router has not started yet
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = dict(scope["headers"])
        if limits.needs_key(path) and not limits.authorized(headers):
            return await send_error(send, 401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                    "authentication_error", "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limits.max_body_bytes):
            return await send_error(send, 413, f"request body exceeds {limits.max_body_bytes} bytes", "invalid_request_error",
                                    "request_too_large")
        admit = path in GENERATION_PATHS
        if admit and limits.in_flight >= limits.max_pending:
            limits.num_rejected += 1
            return await send_error(send, 429, f"server is at capacity ({limits.in_flight} requests in flight); retry shortly",
                                    "rate_limit_error", "too_many_requests", {"Retry-After": "1"})
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limits.max_body_bytes:
                    raise BodyTooLarge()
            return message

        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        if admit:
            limits.in_flight += 1
            limits.max_in_flight = max(limits.max_in_flight, limits.in_flight)
        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await send_error(send, 413, f"request body exceeds {limits.max_body_bytes} bytes", "invalid_request_error",
                                 "request_too_large")
        finally:
            if admit:
                limits.in_flight -= 1
