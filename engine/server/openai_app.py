"""An OpenAI-compatible HTTP server over an Engine (FastAPI; ``pip install 'specmix[serve]'``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /openapi.json`` (the request
bodies' schema). Errors use OpenAI's JSON (``{"error": {"message", "type", "param", "code"}}``): 400 for a
bad parameter, 401 without the API key, 404 for an unknown model or route, 413 for a body beyond the
limit, 503 with Retry-After when the queue is full, 500 for a failed round.

A request is read within ``RequestLimits`` and checked (edge.py, openai_protocol.py) before anything
else; its prompts are tokenized (and chat messages rendered) in a worker thread, off the event loop,
then queued all or none; the answer is streamed or whole (streaming.py). A client that disconnects
cancels its requests; their cache rows are freed at the next round.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from engine.core.errors import EngineError
from engine.runtime.request import Request
from engine.server.access import add_access
from engine.server.edge import LastResort, decode_body, engine_error, error_response, read_body
from engine.server.openai_protocol import ApiError, ParsedRequest, now, parse, seeds
from engine.server.openai_schema import chat_schema, completion_schema, request_body
from engine.server.options import AccessOptions, RequestLimits
from engine.server.prometheus import ServeMetrics
from engine.server.served_engine import ServedEngine
from engine.server.streaming import Choice, EventStream, EventStreamResponse, Reply, complete
from engine.spec_decode.sampling import SamplingParams


class OpenAIServer:
    """The state behind the routes: the engine, its served name, defaults, limits and metrics."""

    def __init__(
        self,
        engine: ServedEngine,
        model_name: str,
        defaults: dict[str, Any] | None = None,
        metrics: ServeMetrics | None = None,
        limits: RequestLimits | None = None,
    ) -> None:
        self.engine, self.model_name, self.defaults = engine, model_name, dict(defaults or {})
        self.metrics = metrics or ServeMetrics(engine, model_name)
        self.limits = limits or RequestLimits()
        self.created = now()

    def _check_model(self, req: ParsedRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise ApiError(
                404,
                f"model={req.model!r:.80} does not exist: allowed {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _base_params(self, req: ParsedRequest) -> SamplingParams:
        """The request's sampling values checked before any tokenization (chat without max_tokens: the rest of
        the context, set per prompt)."""
        kw = dict(req.sampling, logprobs=req.logprobs)
        kw.setdefault("max_new_tokens", self.engine.max_seq_len)
        return SamplingParams(**kw)

    def _params(self, base: SamplingParams, prompt_len: int, seed: int | None, default_max: bool) -> SamplingParams:
        if default_max:  # chat without max_tokens: the rest of the context
            return dataclasses.replace(base, seed=seed, max_new_tokens=max(1, self.engine.max_seq_len - prompt_len))
        return dataclasses.replace(base, seed=seed)

    def _queue(self, req: ParsedRequest, chat: bool, base: SamplingParams) -> tuple[list[Request], int]:
        """Tokenize (or render the chat) and queue every choice, all or none; runs in a worker thread."""
        eng = self.engine
        if chat:
            prompts = [eng.chat_prompt(req.messages or [], req.add_generation_prompt)]
        else:
            prompts = [p if isinstance(p, list) else eng.encode_prompt(p) for p in req.prompts]
        default_max = "max_new_tokens" not in req.sampling
        seeded = seeds(req.sampling.get("seed"), req.n)
        jobs = [(p, self._params(base, len(p), s, default_max)) for p in prompts for s in seeded]
        handles = eng.submit_many([p for p, _ in jobs], [sp for _, sp in jobs])
        return handles, sum(len(p) for p in prompts)

    async def submit(self, req: ParsedRequest, chat: bool) -> tuple[list[Choice], int]:
        """Validate and queue every choice (all or none); returns the choices and the prompt tokens. A caller
        cancelled while the worker thread runs leaves nothing running: what it queued is cancelled."""
        self._check_model(req)
        base = self._base_params(req)
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(None, self._queue, req, chat, base)
        try:
            handles, prompt_tokens = await asyncio.shield(work)
        except asyncio.CancelledError:
            work.add_done_callback(_cancel_queued)
            raise
        try:
            return [Choice(self.engine.tokenizer, h, i, loop) for i, h in enumerate(handles)], prompt_tokens
        except BaseException:
            for h in handles:
                h.cancel()
            raise

    def reply(self, req: ParsedRequest, chat: bool, choices: list[Choice], prompt_tokens: int) -> Reply:
        return Reply(req, chat, choices, prompt_tokens, self.model_name, self.engine.tokenizer, self.metrics)


def _cancel_queued(work: asyncio.Future[tuple[list[Request], int]]) -> None:
    if not work.cancelled() and work.exception() is None:
        for h in work.result()[0]:
            h.cancel()


async def _complete_unless_gone(http: HttpRequest, r: Reply) -> Any:
    """The non-streaming answer, or 499 when the client goes away first (its requests are cancelled)."""
    task = asyncio.ensure_future(complete(r))
    try:
        while not task.done():  # a client that goes away cancels its requests
            await asyncio.wait([task], timeout=0.5)
            if not task.done() and await http.is_disconnected():
                task.cancel()
                return error_response(ApiError(499, "the client closed the connection", code="client_closed"))
        return task.result()
    except EngineError as e:
        raise engine_error(e, r.chat) from None
    finally:
        task.cancel()
        r.cancel()


async def _handle(server: OpenAIServer, http: HttpRequest, chat: bool) -> Any:
    """One completion or chat completion request: read, parsed, queued, answered (streamed or whole)."""
    try:
        raw = await read_body(http, server.limits.max_body_bytes)
        req = parse(await decode_body(raw), chat, server.defaults, server.limits)
        try:
            choices, prompt_tokens = await server.submit(req, chat)
        except EngineError as e:
            raise engine_error(e, chat, req.structured_field) from None
        r = server.reply(req, chat, choices, prompt_tokens)
        if req.stream:
            return EventStreamResponse(EventStream(r))
        return await _complete_unless_gone(http, r)
    except ApiError as e:
        return error_response(e)


def _add_info_routes(app: FastAPI, server: OpenAIServer) -> None:
    """``/health``, ``/v1/models``, ``/metrics``."""

    @app.get("/health")
    async def health() -> Any:
        try:
            server.engine.check_health()
        except EngineError as e:
            return JSONResponse({"status": "unhealthy", "error": str(e)}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {
            "id": server.model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "specmix",
            "max_model_len": server.engine.max_seq_len,
        }
        return {"object": "list", "data": [model]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        body, ctype = server.metrics.exposition()
        return PlainTextResponse(body, media_type=ctype)


def create_app(server: OpenAIServer, access: AccessOptions | None = None) -> FastAPI:
    """The FastAPI application serving ``server``, with ``access`` (API key, CORS; default: open, no CORS)."""
    app = FastAPI(title="specmix", docs_url=None, redoc_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(_: HttpRequest, exc: HTTPException) -> Response:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(exc.status_code, str(exc.detail), type_, headers=dict(exc.headers or {})))

    _add_info_routes(app, server)

    @app.post("/v1/completions", openapi_extra=request_body(completion_schema(server.limits)))
    async def completions(http: HttpRequest) -> Any:
        return await _handle(server, http, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=request_body(chat_schema(server.limits)))
    async def chat_completions(http: HttpRequest) -> Any:
        return await _handle(server, http, chat=True)

    add_access(app, access or AccessOptions())
    app.add_middleware(LastResort)
    return app
