"""The JSON schema of the request bodies, as ``parse`` (openai_protocol.py) accepts them under the limits.

It is the request body of each route in the app's OpenAPI document (``GET /openapi.json``), so clients
and the fuzz test (tests/test_server_fuzz.py) generate requests from what the server says it accepts.
It states the JSON types, the limits and the documented ranges; the sampling values are checked again as
the engine's round uses them (float32, the vocabulary, the context), which may refuse a value the schema
allows (a 400 naming the field).
"""

from __future__ import annotations

from typing import Any

from engine.core.chat import ROLES
from engine.server.openai_protocol import MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS, SEED_MAX, SEED_MIN
from engine.server.options import RequestLimits


def _opt(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` or null (OpenAI clients send null for an unset field)."""
    return {"anyOf": [schema, {"type": "null"}]}


def _common(limits: RequestLimits) -> dict[str, Any]:
    stop = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars}
    number = {"type": "number"}
    return {
        "model": _opt({"type": "string"}),
        "max_tokens": _opt({"type": "integer", "minimum": 1}),
        "n": _opt({"type": "integer", "minimum": 1, "maximum": limits.max_n}),
        "stream": _opt({"type": "boolean"}),
        "stream_options": _opt(
            {
                "type": "object",
                "properties": {"include_usage": {"type": "boolean"}, "continuous_usage_stats": {"type": "boolean"}},
                "additionalProperties": False,
            }
        ),
        "stop": _opt({"anyOf": [stop, {"type": "array", "items": stop, "maxItems": limits.max_stop}]}),
        "user": _opt({"type": "string"}),
        "temperature": _opt(dict(number, minimum=0)),
        "top_p": _opt(dict(number, exclusiveMinimum=0, maximum=1)),
        "top_k": _opt({"type": "integer", "minimum": 0}),
        "min_p": _opt(dict(number, minimum=0, maximum=1)),
        "seed": _opt({"type": "integer", "minimum": SEED_MIN, "maximum": SEED_MAX}),
        "presence_penalty": _opt(dict(number, minimum=-2, maximum=2)),
        "frequency_penalty": _opt(dict(number, minimum=-2, maximum=2)),
        "repetition_penalty": _opt(dict(number, exclusiveMinimum=0)),
        "min_tokens": _opt({"type": "integer", "minimum": 0}),
        "stop_token_ids": _opt(
            {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": limits.max_stop_token_ids}
        ),
        "ignore_eos": _opt({"type": "boolean"}),
        "logit_bias": _opt({"type": "object", "maxProperties": 0}),
        **_structured(),
    }


def _structured() -> dict[str, Any]:
    """vLLM's structured-output fields (engine/server/structured_fields.py), on both routes."""
    text, schema = {"type": "string", "minLength": 1}, {"anyOf": [{"type": "object"}, {"type": "string"}]}
    choice = {"type": "array", "items": text, "minItems": 1}
    outputs = {
        "type": "object",
        "properties": {
            "json": schema, "json_object": {"type": "boolean"}, "regex": text, "choice": choice, "grammar": text,
        },
        "additionalProperties": False,
    }  # fmt: skip
    return {
        "structured_outputs": _opt(outputs),
        "guided_json": _opt(schema),
        "guided_regex": _opt(text),
        "guided_choice": _opt(choice),
        "guided_grammar": _opt(text),
    }


def _response_format() -> dict[str, Any]:
    """OpenAI's response_format (chat)."""
    plain = {
        "type": "object",
        "properties": {"type": {"enum": ["text", "json_object"]}},
        "required": ["type"],
        "additionalProperties": False,
    }
    js = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "schema": {"type": "object"},
            "strict": _opt({"type": "boolean"}),
            "description": {"type": "string"},
        },
        "required": ["schema"],
        "additionalProperties": False,
    }
    schema = {
        "type": "object",
        "properties": {"type": {"const": "json_schema"}, "json_schema": js},
        "required": ["type", "json_schema"],
        "additionalProperties": False,
    }
    return _opt({"anyOf": [plain, schema]})


def completion_schema(limits: RequestLimits) -> dict[str, Any]:
    """The body of ``POST /v1/completions``."""
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    text = {"type": "string", "minLength": 1}
    many = {"minItems": 1, "maxItems": limits.max_prompts}
    prompt = {"anyOf": [text, ids, dict(many, type="array", items=text), dict(many, type="array", items=ids)]}
    props = dict(
        _common(limits),
        prompt=prompt,
        echo=_opt({"type": "boolean", "const": False}),
        best_of=_opt({"type": "integer", "minimum": 1, "maximum": limits.max_n}),
        suffix={"type": "null"},
        logprobs=_opt({"type": "integer", "minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS}),
    )
    return {"type": "object", "properties": props, "required": ["prompt"], "additionalProperties": False}


def chat_schema(limits: RequestLimits) -> dict[str, Any]:
    """The body of ``POST /v1/chat/completions``."""
    part = {
        "type": "object",
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        "required": ["type", "text"],
    }
    content = {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": part}]}
    message = {
        "type": "object",
        "properties": {"role": {"enum": list(ROLES)}, "content": content, "name": {"type": "string"}},
        "required": ["role"],
    }
    props = dict(
        _common(limits),
        messages={"type": "array", "items": message, "minItems": 1},
        max_completion_tokens=_opt({"type": "integer", "minimum": 1}),
        logprobs=_opt({"type": "boolean"}),
        top_logprobs=_opt({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}),
        add_generation_prompt=_opt({"type": "boolean"}),
        parallel_tool_calls=_opt({"type": "boolean"}),
        metadata=_opt({"type": "object"}),
        store=_opt({"type": "boolean"}),
        service_tier=_opt({"type": "string"}),
        response_format=_response_format(),
    )
    return {"type": "object", "properties": props, "required": ["messages"], "additionalProperties": False}


def request_body(schema: dict[str, Any]) -> dict[str, Any]:
    """A route's ``openapi_extra``: its JSON body."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
