"""The server's edge: reading and decoding a body within the limits, and every error as OpenAI's error JSON.

A body is read only up to ``RequestLimits.max_body_bytes`` (a larger Content-Length is refused before
reading, a body without one once it passes the limit: 413). It must be UTF-8 JSON (no NaN or Infinity, no
number beyond a float), nested at most ``MAX_DEPTH`` levels, its strings valid Unicode (no unpaired
surrogate): else 400. Engine errors map to their statuses (``engine_error``); anything else that escapes a
route is logged with its traceback and answered 500 (``LastResort``): a client error never gets there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.core.errors import EngineError, InvalidRequestError, OverloadedError
from engine.runtime.request import RequestFailedError
from engine.server.openai_protocol import ApiError, param_of
from engine.server.options import MAX_DEPTH

log = logging.getLogger(__name__)

INLINE_JSON_BYTES = 64 * 1024  # larger bodies are decoded in a worker thread, off the event loop
_SCALARS = frozenset({int, float, bool, type(None)})


def too_large(what: str, limit: int) -> ApiError:
    return ApiError(
        413, f"the request body {what}: allowed at most {limit} bytes (max_body_bytes)", code="request_too_large"
    )


async def read_body(http: HttpRequest, max_bytes: int) -> bytes:
    """The body, never reading more than ``max_bytes`` of it (413 beyond)."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise too_large(f"has {int(declared)} bytes (Content-Length)", max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in http.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large(f"passes {max_bytes} bytes", max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client closed the connection before the request body ended") from None
    return b"".join(chunks)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number: allowed finite numbers")


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"the number {text[:40]} is beyond a float: allowed finite numbers")
    return v


def decode_json(raw: bytes) -> object:
    """The JSON value of a body, checked (400 naming what is wrong)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        msg = f"the request body is not UTF-8 ({e.reason} at byte {e.start}): allowed UTF-8 JSON"
        raise ApiError(400, msg) from None
    try:
        body = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ApiError(400, f"the request body nests too deep: allowed at most {MAX_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, a float beyond float64, an int of > 4300 digits
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    check_tree(body)
    return body


async def decode_body(raw: bytes) -> object:
    """``decode_json``, in a worker thread for a large body."""
    if len(raw) <= INLINE_JSON_BYTES:
        return decode_json(raw)
    return await asyncio.to_thread(decode_json, raw)


def _check_str(s: str, field: str | None) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            where = f"{field} holds" if field else "the request body holds"
            raise ApiError(
                400, f"{where} a string with an unpaired surrogate escape: allowed valid Unicode", param=field
            ) from None


def check_tree(body: object) -> None:
    """At most MAX_DEPTH levels and valid Unicode strings (keys included); errors name the top-level field."""
    if isinstance(body, str):
        _check_str(body, None)
    stack: list[tuple[object, int, str | None]] = [(body, 1, None)] if isinstance(body, (dict, list)) else []
    while stack:
        node, depth, field = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"the request body nests too deep: allowed at most {MAX_DEPTH} levels", param=field)
        if isinstance(node, dict):
            for k, x in node.items():
                _check_str(k, field or k)
                if isinstance(x, str):
                    _check_str(x, field or k)
                elif isinstance(x, (dict, list)):
                    stack.append((x, depth + 1, field or k))
            continue
        assert isinstance(node, list)
        if set(map(type, node)) <= _SCALARS:  # a list of token ids: no loop in Python
            continue
        for x in node:
            if isinstance(x, str):
                _check_str(x, field)
            elif isinstance(x, (dict, list)):
                stack.append((x, depth + 1, field))


def engine_error(e: EngineError, chat: bool, structured_field: str | None = None) -> ApiError:
    """An EngineError as the HTTP error a client sees (``structured_field``: the body field that set the request's
    structured output, which a refused grammar names)."""
    if isinstance(e, OverloadedError):
        return ApiError(503, str(e), "overloaded_error", headers={"Retry-After": "1"})
    if isinstance(e, RequestFailedError):
        return ApiError(500, str(e), "server_error")
    if isinstance(e, (InvalidRequestError, ValueError)):
        param = param_of(e)
        if param == "structured" and structured_field is not None:
            return ApiError(400, f"{structured_field}: {e}", param=structured_field)
        return ApiError(400, str(e), param="messages" if chat and param == "prompt" else param)
    return ApiError(500, str(e), "server_error")


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class LastResort:
    """ASGI middleware: an exception no route handled is logged with its traceback and answered 500 in
    OpenAI's error JSON (when the response has not started; a started one is closed)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as e:  # noqa: BLE001 - the last resort: logged, answered 500, never a traceback to a client
            log.exception("unhandled error serving %s %s", scope.get("method"), scope.get("path"))
            if not started:
                err = ApiError(500, f"internal server error ({type(e).__name__}); the server logged it", "server_error")
                await error_response(err)(scope, receive, send)
