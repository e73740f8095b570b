"""An OpenAI-compatible HTTP server over an Engine (FastAPI; ``pip install 'specmix[serve]'``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus). Errors use OpenAI's JSON
(``{"error": {"message", "type", "param", "code"}}``): 400 for a bad parameter, 404 for an
unknown model or route, 503 with Retry-After when the queue is full, 500 for a failed round.

The engine's worker thread only hands each request its new token ids and wakes the event loop
(``Request.add_listener``); detokenization (the tokenizers library's streaming decoder, so the
cost per update is the new tokens'), stop-string hold-back and JSON happen here, on the event loop.
A client that disconnects cancels its requests; their cache rows are freed at the next round.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from engine.core.errors import EngineError, InvalidRequestError, OverloadedError
from engine.runtime.request import Request, safe_prefix
from engine.runtime.scheduler import RequestFailedError
from engine.server.openai_protocol import (
    ApiError,
    ParsedRequest,
    chat_logprobs,
    completion_logprobs,
    new_id,
    now,
    param_of,
    parse,
    seeds,
    usage,
)
from engine.server.prometheus import ServeMetrics
from engine.server.served_engine import ServedEngine
from engine.spec_decode.sampling import SamplingParams
from engine.spec_decode.seq import TokenLogprob

log = logging.getLogger(__name__)


class Choice:
    """One running request seen from the event loop: its new tokens, its text so far, its end."""

    def __init__(self, engine: ServedEngine, req: Request, index: int, loop: asyncio.AbstractEventLoop) -> None:
        self.req, self.index, self.loop, self.tok = req, index, loop, engine.tokenizer
        self.event = asyncio.Event()
        self.decoder = engine.tokenizer.decode_stream()
        self.seen = 0  # tokens taken from the request
        self.pending = ""  # decoded text held back (a possible start of a stop string)
        self.text = ""  # text handed out
        self.finish_reason: str | None = None
        req.add_listener(self._wake)  # called from the worker thread (and once now)

    def _wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # the loop has closed: nobody listens any more
            pass

    async def updates(self) -> AsyncIterator[tuple[str, list[TokenLogprob]]]:
        """(text piece, logprob entries) as tokens arrive; ends when the request does."""
        stops = self.req.params.stop
        while True:
            await self.event.wait()
            self.event.clear()
            toks, lps, comp, err = self.req.poll(self.seen)
            self.seen += len(toks)
            if err is not None:
                raise err
            if comp is not None:
                piece = comp.text[len(self.text) :] if comp.text.startswith(self.text) else ""
                if not comp.text.startswith(self.text):
                    log.warning("streamed text is not a prefix of the final text; the rest is not sent")
                self.text += piece
                self.finish_reason = comp.finish_reason
                yield piece, lps
                return
            if toks:
                chunk = self.tok.step(self.decoder, toks)
                if chunk:
                    self.pending += chunk
            safe = safe_prefix(self.pending, stops)
            piece, self.pending = self.pending[:safe], self.pending[safe:]
            self.text += piece
            if piece or lps:
                yield piece, lps

    def cancel(self) -> None:
        if not self.req.done():
            self.req.cancel()


def _openai_finish(reason: str | None) -> str:
    if reason == "error":  # NaN/inf logits in this sequence's row
        raise ApiError(500, "generation failed: the model produced non-finite logits for this request", "server_error")
    return reason or "length"


class OpenAIServer:
    """The state behind the routes: the engine, its served name, defaults and metrics."""

    def __init__(
        self,
        engine: ServedEngine,
        model_name: str,
        defaults: dict[str, Any] | None = None,
        metrics: ServeMetrics | None = None,
    ) -> None:
        self.engine, self.model_name, self.defaults = engine, model_name, dict(defaults or {})
        self.metrics = metrics or ServeMetrics(engine, model_name)
        self.created = now()

    # ------------------------------------------------------------ requests -> engine
    def _check_model(self, req: ParsedRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise ApiError(
                404,
                f"model={req.model!r} does not exist: allowed {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _params(self, req: ParsedRequest, prompt_len: int, seed: int | None) -> SamplingParams:
        kw = dict(req.sampling, seed=seed, logprobs=req.logprobs)
        if "max_new_tokens" not in kw:  # chat without max_tokens: the rest of the context
            kw["max_new_tokens"] = max(1, self.engine.max_seq_len - prompt_len)
        return SamplingParams(**kw)

    def submit(self, req: ParsedRequest, chat: bool, loop: asyncio.AbstractEventLoop) -> tuple[list[Choice], int]:
        """Validate and queue every choice (all or none); returns the choices and the prompt tokens."""
        self._check_model(req)
        eng = self.engine
        if chat:
            prompts: list[list[int]] = [eng.chat_prompt(req.messages or [], req.add_generation_prompt)]
        else:
            prompts = [p if isinstance(p, list) else eng.encode_prompt(p) for p in req.prompts]
        jobs = [(p, self._params(req, len(p), s)) for p in prompts for s in seeds(req.sampling.get("seed"), req.n)]
        handles = eng.submit_many([p for p, _ in jobs], [sp for _, sp in jobs])
        return [Choice(eng, h, i, loop) for i, h in enumerate(handles)], sum(len(p) for p in prompts)

    # ------------------------------------------------------------ responses
    def token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprobs_body(self, entries: list[TokenLogprob], chat: bool, offset: int) -> dict[str, Any] | None:
        if chat:
            return chat_logprobs(entries, self.token_text)
        return completion_logprobs(entries, self.token_text, offset)

    async def complete(
        self, req: ParsedRequest, chat: bool, choices: list[Choice], prompt_tokens: int
    ) -> dict[str, Any]:
        """The non-streaming answer: every choice to its end."""
        out, n_out = [], 0
        for c in choices:
            text, lps = "", []
            async for piece, lp in c.updates():
                text += piece
                lps += lp
            self.metrics.observe(c.req)
            n_out += len(c.req.tokens_so_far())
            item: dict[str, Any] = {
                "index": c.index,
                "finish_reason": _openai_finish(c.finish_reason),
                "logprobs": self.logprobs_body(lps, chat, 0) if req.logprobs is not None else None,
            }
            if chat:
                item["message"] = {"role": "assistant", "content": text}
            else:
                item["text"] = text
            out.append(item)
        return {
            "id": new_id("chatcmpl" if chat else "cmpl"),
            "object": "chat.completion" if chat else "text_completion",
            "created": now(),
            "model": self.model_name,
            "choices": out,
            "usage": usage(prompt_tokens, n_out),
        }

    def stream(self, req: ParsedRequest, chat: bool, choices: list[Choice], prompt_tokens: int) -> AsyncIterator[str]:
        """Server-sent events: one chunk per update of a choice, then usage (when asked), then [DONE]."""
        return EventStream(self, req, chat, choices, prompt_tokens).events()


Update = tuple[Choice, str, list[TokenLogprob], bool]  # a choice, its text piece, its logprob entries, whether it ended


class EventStream:
    """The server-sent events of one streamed request (its chunks share one id and creation time)."""

    def __init__(
        self, server: OpenAIServer, req: ParsedRequest, chat: bool, choices: list[Choice], prompt_tokens: int
    ) -> None:
        self.server, self.req, self.chat, self.choices, self.prompt_tokens = server, req, chat, choices, prompt_tokens
        self.id, self.created = new_id("chatcmpl" if chat else "cmpl"), now()
        self.object = "chat.completion.chunk" if chat else "text_completion"

    async def events(self) -> AsyncIterator[str]:
        """Every choice's chunks as they come, then [DONE]; a client that goes away cancels what still runs."""
        queue: asyncio.Queue[Update | BaseException] = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(c, queue)) for c in self.choices]
        try:
            async with aclosing(self._relay(queue)) as relay:
                async for event in relay:
                    yield event
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or an error ended the stream): free what still runs
            for c in self.choices:
                c.cancel()
            for t in tasks:
                t.cancel()

    async def _pump(self, c: Choice, queue: asyncio.Queue[Update | BaseException]) -> None:
        try:
            async for piece, lps in c.updates():
                await queue.put((c, piece, lps, False))
            self.server.metrics.observe(c.req)
            await queue.put((c, "", [], True))
        except (EngineError, ApiError) as e:
            await queue.put(e)

    async def _relay(self, queue: asyncio.Queue[Update | BaseException]) -> AsyncIterator[str]:
        """Chunks until every choice ended, then the usage chunk (when asked); an error event ends it early."""
        started: set[int] = set()
        left = len(self.choices)
        while left:
            item = await queue.get()
            if isinstance(item, BaseException):
                err = item if isinstance(item, ApiError) else ApiError(500, str(item), "server_error")
                yield f"data: {json.dumps(err.body())}\n\n"
                return
            c, piece, lps, end = item
            first = self.chat and c.index not in started
            started.add(c.index)
            if end:
                left -= 1
                try:
                    fin = _openai_finish(c.finish_reason)
                except ApiError as e:
                    yield f"data: {json.dumps(e.body())}\n\n"
                    return
                yield self._chunk(c, "", [], fin, first)
            elif piece or lps or first:
                yield self._chunk(c, piece, lps, None, first)
        if self.req.include_usage:
            yield self._usage()

    def _body(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.server.model_name,
            "choices": choices,
        }

    def _chunk(self, c: Choice, piece: str, lps: list[TokenLogprob], finish: str | None, first: bool) -> str:
        lp = None
        if self.req.logprobs is not None and lps:
            lp = self.server.logprobs_body(lps, self.chat, len(c.text) - len(piece))
        if self.chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": piece}
                if first
                else ({"content": piece} if piece or not finish else {})
            )
            ch: dict[str, Any] = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            ch = {"index": c.index, "text": piece, "logprobs": lp, "finish_reason": finish}
        body = self._body([ch])
        if self.req.include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _usage(self) -> str:
        n_out = sum(len(c.req.tokens_so_far()) for c in self.choices)
        body = self._body([])
        body["usage"] = usage(self.prompt_tokens, n_out)
        return f"data: {json.dumps(body)}\n\n"


def engine_error(e: EngineError) -> ApiError:
    if isinstance(e, OverloadedError):
        return ApiError(503, str(e), "overloaded_error", headers={"Retry-After": "1"})
    if isinstance(e, RequestFailedError):
        return ApiError(500, str(e), "server_error")
    if isinstance(e, (InvalidRequestError, ValueError)):
        return ApiError(400, str(e), param=param_of(e))
    return ApiError(500, str(e), "server_error")


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _parse(server: OpenAIServer, http: HttpRequest, chat: bool) -> ParsedRequest:
    raw = await http.body()
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    return parse(body, chat, server.defaults)


async def _complete_unless_gone(
    server: OpenAIServer, http: HttpRequest, req: ParsedRequest, chat: bool, choices: list[Choice], prompt_tokens: int
) -> Any:
    """The non-streaming answer, or 499 when the client goes away first (its requests are cancelled)."""
    task = asyncio.ensure_future(server.complete(req, chat, choices, prompt_tokens))
    try:
        while not task.done():  # a client that goes away cancels its requests
            await asyncio.wait([task], timeout=0.5)
            if not task.done() and await http.is_disconnected():
                task.cancel()
                for c in choices:
                    c.cancel()
                return JSONResponse({}, status_code=499)
        return task.result()
    except EngineError as e:
        raise engine_error(e) from None
    finally:
        for c in choices:
            c.cancel()


async def _handle(server: OpenAIServer, http: HttpRequest, chat: bool) -> Any:
    """One completion or chat completion request: parsed, queued, answered (streamed or whole)."""
    try:
        req = await _parse(server, http, chat)
        try:
            choices, prompt_tokens = server.submit(req, chat, asyncio.get_running_loop())
        except EngineError as e:
            raise engine_error(e) from None
        if req.stream:
            return StreamingResponse(
                server.stream(req, chat, choices, prompt_tokens),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await _complete_unless_gone(server, http, req, chat, choices, prompt_tokens)
    except ApiError as e:
        return _error_response(e)


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


def create_app(server: OpenAIServer) -> FastAPI:
    """The FastAPI application serving ``server``."""
    app = FastAPI(title="specmix", docs_url=None, redoc_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(_: HttpRequest, exc: HTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(ApiError(exc.status_code, str(exc.detail), type_))

    _add_info_routes(app, server)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest) -> Any:
        return await _handle(server, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest) -> Any:
        return await _handle(server, http, chat=True)

    return app
