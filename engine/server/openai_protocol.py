"""The OpenAI HTTP API's request bodies -> specmix requests, and specmix results -> response JSON.

Field names and defaults are OpenAI's (``max_tokens`` 16 for completions, ``temperature`` 1); the
sampling controls OpenAI lacks are accepted as the extra fields vLLM and TGI clients send
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``).
Every refusal is an ``ApiError`` carrying the HTTP status and the offending field.
"""

from __future__ import annotations

import re
import reprlib
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.core.chat import check_messages
from engine.core.errors import EngineError, InvalidRequestError
from engine.server.options import RequestLimits
from engine.server.structured_fields import FIELDS as STRUCTURED_FIELDS
from engine.server.structured_fields import FieldError, structured

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
COMMON += STRUCTURED_FIELDS
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
    "response_format",
)
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # torch.Generator.manual_seed's range (SamplingParams.seed)
NUMBER_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlist, _SHOW.maxdict = 3, 60, 60, 6, 4


def show(v: object) -> str:
    """A short repr of a client's value for an error message (bounded in size and depth)."""
    return _SHOW.repr(v)


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
        name = re.split(r"[=\[. ]", msg[len("SamplingParams.") :], maxsplit=1)[0]
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
    structured_field: str | None = None  # the field that set sampling["structured"] (a compile error names it)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    """An optional int field in lo..hi (None when absent or null)."""
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        allowed = f"an int in {lo}..{hi}" if hi is not None else f"an int >= {lo}"
        raise bad(name, f"{name}={show(v)} is invalid: allowed {allowed}")
    return v


def _typed(body: dict[str, Any], name: str, kind: type | tuple[type, ...], allowed: str) -> Any:
    """An optional field of a JSON type (bool is not a number here); None when absent or null."""
    v = body.get(name)
    if v is None:
        return None
    is_bool = isinstance(v, bool)
    if not isinstance(v, kind) or (is_bool and bool not in (kind if isinstance(kind, tuple) else (kind,))):
        raise bad(name, f"{name}={show(v)} is invalid: allowed {allowed}")
    return v


def _prompts(v: object, limits: RequestLimits) -> list[str | list[int]]:
    allowed = (
        f"a string, a list of up to {limits.max_prompts} strings, a list of token ids "
        f"or a list of up to {limits.max_prompts} token-id lists"
    )
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v:
        if all(_is_int(x) for x in v):
            return [list(v)]
        if len(v) > limits.max_prompts:
            raise bad("prompt", f"prompt holds {len(v)} prompts: allowed at most {limits.max_prompts}")
        if all(isinstance(x, str) for x in v):
            return list(v)
        if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in v):
            return [list(x) for x in v]
    raise bad("prompt", f"prompt={show(v)} is invalid: allowed {allowed}")


def _stop(v: object, limits: RequestLimits) -> list[str]:
    allowed = f"a string or a list of up to {limits.max_stop} strings of 1..{limits.max_stop_chars} characters"
    stops = [v] if isinstance(v, str) else v
    if v is None:
        return []
    if not isinstance(stops, list) or len(stops) > limits.max_stop or not all(isinstance(s, str) for s in stops):
        raise bad("stop", f"stop={show(v)} is invalid: allowed {allowed}")
    for s in stops:
        if not 1 <= len(s) <= limits.max_stop_chars:
            raise bad("stop", f"stop holds a string of {len(s)} characters: allowed {allowed}")
    return list(stops)


def _stop_token_ids(v: object, limits: RequestLimits) -> list[int] | None:
    if v is None:
        return None
    most = limits.max_stop_token_ids
    if not isinstance(v, list) or len(v) > most or not all(_is_int(t) and t >= 0 for t in v):
        raise bad("stop_token_ids", f"stop_token_ids={show(v)} is invalid: allowed a list of up to {most} ids >= 0")
    return list(v)


def _sampling(body: dict[str, Any], n: int, defaults: dict[str, Any] | None, limits: RequestLimits) -> dict[str, Any]:
    """SamplingParams keyword arguments, each field checked for its JSON type here (SamplingParams checks the
    values as the round uses them and names the field)."""
    kw: dict[str, Any] = dict(defaults or {})
    kw.setdefault("temperature", 1.0)
    for name in NUMBER_FIELDS:
        v = _typed(body, name, (int, float), "a number")
        if v is not None:
            kw[name] = v
    for name, v in (
        ("top_k", _int(body, "top_k", 0)),
        ("seed", _int(body, "seed", SEED_MIN, SEED_MAX - (n - 1))),  # choice j samples with seed + j
        ("min_tokens", _int(body, "min_tokens", 0)),
        ("ignore_eos", _typed(body, "ignore_eos", bool, "true or false")),
        ("stop_token_ids", _stop_token_ids(body.get("stop_token_ids"), limits)),
    ):
        if v is not None:
            kw[name] = v
    kw["stop"] = _stop(body.get("stop"), limits)
    return kw


def _max_tokens(body: dict[str, Any], chat: bool, kw: dict[str, Any]) -> None:
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    mt = _int(body, name, 1)
    if mt is not None:
        kw["max_new_tokens"] = mt
    elif not chat:
        kw.setdefault("max_new_tokens", 16)


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    """include_usage of stream_options (allowed with stream: true only)."""
    so = body.get("stream_options")
    if so is None:
        return False
    keys = ("include_usage", "continuous_usage_stats")
    if not isinstance(so, dict) or set(so) - set(keys) or not all(isinstance(so[k], bool) for k in so):
        raise bad("stream_options", f'stream_options={show(so)} is invalid: allowed {{"include_usage": bool}}')
    if not stream:
        raise bad("stream_options", "stream_options is only allowed with stream: true")
    return so.get("include_usage", False)


def _ignored(body: dict[str, Any]) -> None:
    """Fields accepted for compatibility and not used, still of their type."""
    _typed(body, "user", str, "a string")
    _typed(body, "metadata", dict, "an object")
    _typed(body, "store", bool, "true or false")
    _typed(body, "service_tier", str, "a string")
    _typed(body, "parallel_tool_calls", bool, "true or false")
    if _typed(body, "logit_bias", dict, "an object"):
        raise bad("logit_bias", "logit_bias is not supported: allowed null or {}")


def parse(
    body: object, chat: bool, defaults: dict[str, Any] | None = None, limits: RequestLimits | None = None
) -> ParsedRequest:
    """Check a request body's fields, their JSON types and the server's limits (SamplingParams checks the
    sampling values later)."""
    lim = limits or RequestLimits()
    if not isinstance(body, dict):
        raise bad(None, f"the request body is a JSON {type(body).__name__}: allowed a JSON object")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise bad(unknown[0], f"unknown or unsupported field(s) {', '.join(unknown)}: allowed {', '.join(allowed)}")
    model = _typed(body, "model", str, "a string")
    n = _int(body, "n", 1, lim.max_n) or 1
    stream = _typed(body, "stream", bool, "true or false") or False
    _ignored(body)
    kw = _sampling(body, n, defaults, lim)
    _max_tokens(body, chat, kw)
    req = ParsedRequest(model=model, sampling=kw, n=n, stream=stream, include_usage=_stream_options(body, stream))
    try:
        kw["structured"], req.structured_field = structured(body, chat)
    except FieldError as e:
        raise bad(e.field, str(e)) from None
    if chat:
        _chat_fields(body, req)
    else:
        _completion_fields(body, req, lim)
    return req


def _chat_fields(body: dict[str, Any], req: ParsedRequest) -> None:
    lp = _typed(body, "logprobs", bool, "true or false")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not lp:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    req.logprobs = (top or 0) if lp else None
    if body.get("messages") is None:
        raise bad("messages", "messages is missing: allowed a non-empty list of {role, content}")
    try:
        req.messages = check_messages(body["messages"])
    except InvalidRequestError as e:
        raise bad("messages", str(e)) from None
    agp = _typed(body, "add_generation_prompt", bool, "true or false")
    req.add_generation_prompt = True if agp is None else agp


def _completion_fields(body: dict[str, Any], req: ParsedRequest, limits: RequestLimits) -> None:
    req.logprobs = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    if _typed(body, "echo", bool, "true or false"):
        raise bad("echo", "echo is not supported: allowed false")
    if body.get("suffix") is not None:
        raise bad("suffix", "suffix is not supported: allowed null")
    bo = body.get("best_of")
    if bo is not None and (not _is_int(bo) or bo != req.n):
        raise bad("best_of", f"best_of={show(bo)} is invalid: allowed null or equal to n ({req.n})")
    if body.get("prompt") is None:
        raise bad("prompt", "prompt is missing: allowed a string, a list of strings or token ids")
    req.prompts = _prompts(body["prompt"], limits)


def seeds(seed: int | None, n: int) -> list[int | None]:
    """Choice j of a seeded request samples with seed + j (choice 0 equals a lone request's output)."""
    return [None if seed is None else seed + j for j in range(n)]


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, stats: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """OpenAI's usage; with the finished choices' ``Completion.stats``, a ``speculation`` extension: draft tokens
    verified, accepted, and the rounds (target passes) the choices took part in, summed."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if stats:
        out["speculation"] = {
            "drafted": sum(s.get("drafted", 0) for s in stats),
            "accepted": sum(s.get("accepted", 0) for s in stats),
            "rounds": sum(s.get("target_passes", 0) for s in stats),
        }
    return out


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
