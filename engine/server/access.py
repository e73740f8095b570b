"""Who may call the server: an API key (``Authorization: Bearer``, as vLLM and OpenAI) and CORS.

With an ``api_key`` every route but ``/health`` and ``/metrics`` (those too with ``protect_health_metrics``)
needs ``Authorization: Bearer <key>``; a request without it, or with another key, gets 401 and OpenAI's
error JSON (``code: invalid_api_key``) before its body is read. Keys are compared in constant time
(``hmac.compare_digest``). CORS is off unless ``allowed_origins`` names origins (starlette's CORSMiddleware;
a preflight ``OPTIONS`` needs no key, as browsers send none).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.server.options import AccessOptions


def _unauthorized(message: str) -> tuple[dict[str, Any], bytes]:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    start = {
        "type": "http.response.start",
        "status": 401,
        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
    }
    return start, json.dumps(body).encode()


def bearer_ok(headers: Iterable[tuple[bytes, bytes]], key: str) -> bool:
    """Whether the ``Authorization`` header holds ``Bearer <key>`` (scheme case-insensitive, key compared in
    constant time)."""
    want = key.encode()
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), want)
    return False


class ApiKeyMiddleware:
    """ASGI middleware: 401 for a request that needs the key and lacks it (its body is never read)."""

    def __init__(self, app: ASGIApp, options: AccessOptions) -> None:
        self.app, self.options = app, options

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.options.needs_key(scope["path"]):
            await self.app(scope, receive, send)
            return
        assert self.options.api_key is not None
        if bearer_ok(scope["headers"], self.options.api_key):
            await self.app(scope, receive, send)
            return
        has = any(name.lower() == b"authorization" for name, _ in scope["headers"])
        start, body = _unauthorized(
            "incorrect API key provided" if has else "missing API key: send the header Authorization: Bearer <key>"
        )
        start["headers"].append((b"content-length", str(len(body)).encode()))
        await send(start)
        await send({"type": "http.response.body", "body": body})


class JsonCORSMiddleware(CORSMiddleware):
    """starlette's CORS middleware, a refused preflight answered in OpenAI's error JSON (not plain text)."""

    def preflight_response(self, request_headers: Headers) -> Response:
        resp = super().preflight_response(request_headers)
        if resp.status_code != 400:
            return resp
        headers = {k: v for k, v in resp.headers.items() if k not in ("content-length", "content-type")}
        reason = bytes(resp.body).decode()
        allowed = ", ".join(self.allow_origins)
        body = {"error": {"message": f"{reason}: allowed origins {allowed}", "type": "invalid_request_error"}}
        body["error"].update(param=None, code="cors_refused")
        return JSONResponse(body, status_code=400, headers=headers)


def add_access(app: FastAPI, options: AccessOptions) -> None:
    """The key check, then CORS around it when origins are allowed (so a 401 carries CORS headers too)."""
    if options.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, options=options)
    if options.allowed_origins:
        app.add_middleware(
            JsonCORSMiddleware,
            allow_origins=list(options.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )
