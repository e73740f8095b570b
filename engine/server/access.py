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
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.core.errors import InvalidConfigError

OPEN_PATHS = ("/health", "/metrics")


@dataclass(frozen=True)
class AccessOptions:
    """Access control of the app (``create_app(server, access)``; ``specmix-serve`` and the Ray Serve app)."""

    api_key: str | None = None
    """The key clients send as ``Authorization: Bearer <key>``; None: no key needed."""
    protect_health_metrics: bool = False
    """With an api_key, ``/health`` and ``/metrics`` need it too (default: open, for probes and scrapers)."""
    allowed_origins: tuple[str, ...] = ()
    """Origins browsers may call from (CORS; ``"*"`` for any); empty: CORS off."""

    def __post_init__(self) -> None:
        key = self.api_key
        if key is not None and not (isinstance(key, str) and key and key.isascii() and key.isprintable()):
            raise InvalidConfigError("api_key is invalid: allowed None or a non-empty string of printable ASCII")
        if key is not None and " " in key:
            raise InvalidConfigError("api_key is invalid: allowed a key without spaces")
        if not isinstance(self.allowed_origins, tuple) or not all(
            isinstance(o, str) and o for o in self.allowed_origins
        ):
            raise InvalidConfigError(
                f"allowed_origins={self.allowed_origins!r:.80} is invalid: allowed a tuple of origins"
            )

    def needs_key(self, path: str) -> bool:
        """Whether a request to ``path`` must carry the key."""
        if self.api_key is None:
            return False
        return self.protect_health_metrics or path not in OPEN_PATHS


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


def add_access(app: FastAPI, options: AccessOptions) -> None:
    """The key check, then CORS around it when origins are allowed (so a 401 carries CORS headers too)."""
    if options.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, options=options)
    if options.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(options.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
