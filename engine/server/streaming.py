"""Answers as they are generated: each choice's text and logprobs, whole (``complete``) or as server-sent events.

The engine's worker thread only hands each request its new token ids and wakes the event loop
(``Request.add_listener``); detokenization (the tokenizer's incremental decoder, so the cost per update is
the new tokens'), stop-string hold-back and JSON happen here, on the event loop. A streamed answer ends
however its client goes: ``EventStreamResponse`` cancels every choice when the stream ends, fails, or the
client disconnects at any moment (before the first byte included); the rows are freed at the next round.
An exception while relaying a choice reaches the client as an error event, then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.core.errors import EngineError
from engine.runtime.request import Request, safe_prefix
from engine.server.openai_protocol import (
    ApiError,
    ParsedRequest,
    chat_logprobs,
    completion_logprobs,
    new_id,
    now,
    usage,
)
from engine.server.prometheus import ServeMetrics
from engine.server.served_engine import ServedTokenizer
from engine.spec_decode.seq import TokenLogprob

log = logging.getLogger(__name__)


class Choice:
    """One running request seen from the event loop: its new tokens, its text so far, its end."""

    def __init__(self, tok: ServedTokenizer, req: Request, index: int, loop: asyncio.AbstractEventLoop) -> None:
        self.req, self.index, self.loop, self.tok = req, index, loop, tok
        self.event = asyncio.Event()
        self.decoder = tok.decode_stream()
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


def openai_finish(reason: str | None) -> str:
    if reason == "error":  # NaN/inf logits in this sequence's row
        raise ApiError(500, "generation failed: the model produced non-finite logits for this request", "server_error")
    return reason or "length"


@dataclass
class Reply:
    """What one request's answer is made of: the request, its choices and how to write them."""

    req: ParsedRequest
    chat: bool
    choices: list[Choice]
    prompt_tokens: int
    model_name: str
    tokenizer: ServedTokenizer
    metrics: ServeMetrics

    def logprobs_body(self, entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
        text = lambda t: self.tokenizer.decode([t], skip_special_tokens=False)
        return chat_logprobs(entries, text) if self.chat else completion_logprobs(entries, text, offset)

    def cancel(self) -> None:
        for c in self.choices:
            c.cancel()


async def complete(r: Reply) -> dict[str, Any]:
    """The non-streaming answer: every choice to its end."""
    out, n_out = [], 0
    for c in r.choices:
        text, lps = "", []
        async for piece, lp in c.updates():
            text += piece
            lps += lp
        r.metrics.observe(c.req)
        n_out += len(c.req.tokens_so_far())
        item: dict[str, Any] = {
            "index": c.index,
            "finish_reason": openai_finish(c.finish_reason),
            "logprobs": r.logprobs_body(lps, 0) if r.req.logprobs is not None else None,
        }
        if r.chat:
            item["message"] = {"role": "assistant", "content": text}
        else:
            item["text"] = text
        out.append(item)
    return {
        "id": new_id("chatcmpl" if r.chat else "cmpl"),
        "object": "chat.completion" if r.chat else "text_completion",
        "created": now(),
        "model": r.model_name,
        "choices": out,
        "usage": usage(r.prompt_tokens, n_out, _stats(r.choices)),
    }


def _stats(choices: list[Choice]) -> list[dict[str, Any]]:
    """The finished choices' per-request figures (``Completion.stats``)."""
    return [comp.stats for c in choices if (comp := c.req.completion()) is not None]


Update = tuple[Choice, str, list[TokenLogprob], bool]  # a choice, its text piece, its logprob entries, whether it ended


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class EventStream:
    """The server-sent events of one streamed request (its chunks share one id and creation time)."""

    def __init__(self, reply: Reply) -> None:
        self.r = reply
        self.id, self.created = new_id("chatcmpl" if reply.chat else "cmpl"), now()
        self.object = "chat.completion.chunk" if reply.chat else "text_completion"
        self.tasks: list[asyncio.Task[None]] = []

    def close(self) -> None:
        """Cancel every choice that still runs and its relay task (idempotent)."""
        self.r.cancel()
        for t in self.tasks:
            t.cancel()

    async def events(self) -> AsyncIterator[str]:
        """Every choice's chunks as they come, then [DONE]; an error ends the stream with an error event."""
        queue: asyncio.Queue[Update | ApiError] = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._pump(c, queue)) for c in self.r.choices]
        try:
            async with aclosing(self._relay(queue)) as relay:
                async for event in relay:
                    yield event
        except Exception:  # noqa: BLE001 - the last resort of a started stream: logged, ended by an error event
            log.exception("streaming a response failed")
            yield _event(ApiError(500, "streaming the response failed; the server logged it", "server_error").body())
        finally:
            self.close()
        yield "data: [DONE]\n\n"

    async def _pump(self, c: Choice, queue: asyncio.Queue[Update | ApiError]) -> None:
        try:
            async for piece, lps in c.updates():
                await queue.put((c, piece, lps, False))
            self.r.metrics.observe(c.req)
            await queue.put((c, "", [], True))
        except ApiError as e:
            await queue.put(e)
        except EngineError as e:
            await queue.put(ApiError(500, str(e), "server_error"))
        except Exception as e:  # noqa: BLE001 - the last resort of a relay: logged, the client gets an error event
            log.exception("relaying choice %d failed", c.index)
            await queue.put(ApiError(500, f"relaying choice {c.index} failed ({type(e).__name__})", "server_error"))

    async def _relay(self, queue: asyncio.Queue[Update | ApiError]) -> AsyncIterator[str]:
        """Chunks until every choice ended, then the usage chunk (when asked); an error event ends it early."""
        started: set[int] = set()
        left = len(self.r.choices)
        while left:
            item = await queue.get()
            if isinstance(item, ApiError):
                yield _event(item.body())
                return
            c, piece, lps, end = item
            first = self.r.chat and c.index not in started
            started.add(c.index)
            if end:
                left -= 1
                try:
                    fin = openai_finish(c.finish_reason)
                except ApiError as e:
                    yield _event(e.body())
                    return
                yield self._chunk(c, "", [], fin, first)
            elif piece or lps or first:
                yield self._chunk(c, piece, lps, None, first)
        if self.r.req.include_usage:
            yield self._usage()

    def _body(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        head = {"id": self.id, "object": self.object, "created": self.created, "model": self.r.model_name}
        return dict(head, choices=choices)

    def _chunk(self, c: Choice, piece: str, lps: list[TokenLogprob], finish: str | None, first: bool) -> str:
        lp = None
        if self.r.req.logprobs is not None and lps:
            lp = self.r.logprobs_body(lps, len(c.text) - len(piece))
        if self.r.chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": piece}
                if first
                else ({"content": piece} if piece or not finish else {})
            )
            ch: dict[str, Any] = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            ch = {"index": c.index, "text": piece, "logprobs": lp, "finish_reason": finish}
        body = self._body([ch])
        if self.r.req.include_usage:
            body["usage"] = None
        return _event(body)

    def _usage(self) -> str:
        n_out = sum(len(c.req.tokens_so_far()) for c in self.r.choices)
        body = self._body([])
        body["usage"] = usage(self.r.prompt_tokens, n_out, _stats(self.r.choices))
        return _event(body)


class EventStreamResponse(StreamingResponse):
    """The events of one streamed request. Whatever the ASGI server (uvicorn, Ray Serve's proxy), it listens
    for the client's disconnect from the start and cancels every choice when the response ends in any way:
    the last event sent, an error, or the client gone before the first byte."""

    def __init__(self, stream: EventStream) -> None:
        super().__init__(stream.events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait([sending, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (sending, gone):
                t.cancel()
            self.stream.close()
            await asyncio.gather(sending, gone, return_exceptions=True)
            await self.body_iterator.aclose()
        err = sending.exception() if sending.done() and not sending.cancelled() else None
        if err is not None and not isinstance(err, OSError):  # OSError: the client went away while we sent
            raise err  # LastResort logs it (the response has started)
