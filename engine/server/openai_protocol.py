"""The OpenAI HTTP API's request bodies -> specmix requests, and specmix results -> response JSON.

Field names and defaults are OpenAI's (``max_tokens`` 16 for completions, ``temperature`` 1); the
sampling controls OpenAI lacks are accepted as the extra fields vLLM and TGI clients send
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``).
Every refusal is an ``ApiError`` carrying the HTTP status and the offending field.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.core.errors import EngineError

# sampling fields shared by both endpoints (value checks happen in SamplingParams, which names the field)
SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
)
COMMON = ("model", "max_tokens", "n", "stream", "stream_options", "stop", "logprobs", "user") + SAMPLING
COMPLETION_FIELDS = COMMON + ("prompt", "echo", "best_of", "suffix", "logit_bias")
CHAT_FIELDS = COMMON + (
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "logit_bias",
    "add_generation_prompt",
    "parallel_tool_calls",
    "metadata",
    "store",
    "service_tier",
)
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
MAX_N = 16
MAX_TOP_LOGPROBS = 20


class ApiError(Exception):
    """An HTTP error in OpenAI's JSON shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(field_: str | None, message: str) -> ApiError:
    return ApiError(400, message, param=field_)


def param_of(err: EngineError) -> str | None:
    """The request field an EngineError's message names (``SamplingParams.top_p=...`` -> top_p)."""
    msg = str(err)
    if msg.startswith("SamplingParams."):
        name = msg[len("SamplingParams.") :].split("=", 1)[0].split("[", 1)[0]
        return {"max_new_tokens": "max_tokens"}.get(name, name)
    if msg.startswith("prompt"):
        return "prompt"
    if msg.startswith("messages"):
        return "messages"
    return None


@dataclass
class ParsedRequest:
    """One validated request: prompts (completions) or messages (chat), how to sample, how to answer."""

    model: str | None
    sampling: dict[str, Any]  # SamplingParams keyword arguments (max_new_tokens may be missing: chat default)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top logprobs per token; None: no logprobs
    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _prompts(v: object) -> list[str | list[int]]:
    allowed = "a string, a list of strings, a list of token ids or a list of token-id lists"
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v:
        if all(isinstance(x, str) for x in v):
            return list(v)
        if all(_is_int(x) for x in v):
            return [list(v)]
        if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in v):
            return [list(x) for x in v]
    raise bad("prompt", f"prompt={v!r:.80} is invalid: allowed {allowed}")


def _stop(v: object) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and len(v) <= 4 and all(isinstance(s, str) for s in v):
        return list(v)
    raise bad("stop", f"stop={v!r:.80} is invalid: allowed a string or a list of up to 4 strings")


def parse(body: object, chat: bool, defaults: dict[str, Any] | None = None) -> ParsedRequest:
    """Check a request body's fields and types; the values are checked by SamplingParams later."""
    if not isinstance(body, dict):
        raise bad(None, "the request body is invalid: allowed a JSON object")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise bad(unknown[0], f"unknown or unsupported field(s) {', '.join(unknown)}: allowed {', '.join(allowed)}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"model={model!r:.80} is invalid: allowed a string")
    kw: dict[str, Any] = dict(defaults or {})
    kw.setdefault("temperature", 1.0)
    for name in SAMPLING:
        if body.get(name) is not None:
            kw[name] = body[name]
    kw["stop"] = _stop(body.get("stop"))
    mt_field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    mt = body.get(mt_field)
    if mt is not None:
        kw["max_new_tokens"] = mt
    elif not chat:
        kw.setdefault("max_new_tokens", 16)
    n = body.get("n", 1) if body.get("n") is not None else 1
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise bad("n", f"n={n!r} is invalid: allowed an int in 1..{MAX_N}")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad("stream", f"stream={stream!r} is invalid: allowed true or false")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict) or set(so) - {"include_usage", "continuous_usage_stats"}:
            raise bad("stream_options", f'stream_options={so!r:.80} is invalid: allowed {{"include_usage": bool}}')
        if not stream:
            raise bad("stream_options", "stream_options is only allowed with stream: true")
        include_usage = bool(so.get("include_usage", False))
    if body.get("logit_bias"):
        raise bad("logit_bias", "logit_bias is not supported: allowed null or {}")
    req = ParsedRequest(model=model, sampling=kw, n=n, stream=stream, include_usage=include_usage)
    if chat:
        lp, top = body.get("logprobs"), body.get("top_logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise bad("logprobs", f"logprobs={lp!r} is invalid: allowed true or false")
        if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise bad("top_logprobs", f"top_logprobs={top!r} is invalid: allowed an int in 0..{MAX_TOP_LOGPROBS}")
        if top is not None and not lp:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        req.logprobs = (top or 0) if lp else None
        if "messages" not in body:
            raise bad("messages", "messages is missing: allowed a non-empty list of {role, content}")
        req.messages = body["messages"]
        agp = body.get("add_generation_prompt", True)
        if not isinstance(agp, bool):
            raise bad("add_generation_prompt", f"add_generation_prompt={agp!r} is invalid: allowed true or false")
        req.add_generation_prompt = agp
    else:
        lp = body.get("logprobs")
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= 5):
            raise bad("logprobs", f"logprobs={lp!r} is invalid: allowed null or an int in 0..5")
        req.logprobs = lp
        if body.get("echo"):
            raise bad("echo", "echo is not supported: allowed false")
        if body.get("suffix") is not None:
            raise bad("suffix", "suffix is not supported: allowed null")
        bo = body.get("best_of")
        if bo is not None and bo != n:
            raise bad("best_of", f"best_of={bo!r} is invalid: allowed null or equal to n ({n})")
        if "prompt" not in body:
            raise bad("prompt", "prompt is missing: allowed a string, a list of strings or token ids")
        req.prompts = _prompts(body["prompt"])
    return req


def seeds(seed: int | None, n: int) -> list[int | None]:
    """Choice j of a seeded request samples with seed + j (choice 0 equals a lone request's output)."""
    return [None if seed is None else seed + j for j in range(n)]


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(entries: Sequence[Any], token_text: Any, offset: int) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, lps, tops, offs = [], [], [], []
    for e in entries:
        s = token_text(e.token_id)
        tokens.append(s)
        lps.append(e.logprob)
        top: dict[str, float] = {}
        for t, lp in e.top:  # two tokens may share a text: the likelier one stays
            top.setdefault(token_text(t), lp)
        tops.append(top)
        offs.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def chat_logprobs(entries: Sequence[Any], token_text: Any) -> dict[str, Any]:
    """The chat shape: content = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""

    def one(t: int, lp: float) -> dict[str, Any]:
        s = token_text(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {
        "content": [dict(one(e.token_id, e.logprob), top_logprobs=[one(t, lp) for t, lp in e.top]) for e in entries]
    }
