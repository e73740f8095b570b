"""A request body's structured-output fields -> one ``StructuredOutput``, refusals naming the field.

OpenAI's ``response_format`` (chat: ``text``, ``json_object``, ``json_schema`` with ``schema`` and ``strict``),
vLLM's ``structured_outputs`` (``json``, ``json_object``, ``regex``, ``choice``, ``grammar``) and its older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``. A request sets at most one. Whether a
schema or grammar compiles is checked by the engine when the request is queued (a 400 naming this same field).
"""

from __future__ import annotations

from typing import Any

from engine.core.errors import InvalidRequestError
from engine.spec_decode.structured.spec import StructuredOutput

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
FIELDS = ("structured_outputs",) + GUIDED  # both endpoints; chat also takes response_format
SO_KEYS = ("json", "json_object", "regex", "choice", "grammar")
SO_IGNORED = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


class FieldError(InvalidRequestError):
    """A refused structured-output field (``field``: its name in the request body)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def show(v: object) -> str:
    return f"{v!r:.80}"


def structured(body: dict[str, Any], chat: bool) -> tuple[StructuredOutput | None, str | None]:
    """The request's constraint and the field that set it (None, None: unconstrained)."""
    names = [f for f in (("response_format",) if chat else ()) + FIELDS if body.get(f) is not None]
    if names == ["response_format"] and _is_text(body["response_format"]):
        return None, None
    if len(names) > 1:
        raise FieldError(names[1], f"{' and '.join(names)} are both set: allowed at most one structured-output field")
    if not names:
        return None, None
    name = names[0]
    try:
        if name == "response_format":
            return _response_format(body[name]), name
        if name == "structured_outputs":
            return _structured_outputs(body[name]), name
        return _guided(name[len("guided_") :], body[name], name), name
    except FieldError:
        raise
    except InvalidRequestError as e:  # StructuredOutput's refusal, with this field's name
        raise FieldError(name, f"{name}: {e}") from None


def _is_text(v: object) -> bool:
    return isinstance(v, dict) and v.get("type") == "text" and set(v) <= {"type"}


def _response_format(v: object) -> StructuredOutput:
    allowed = '{"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}'
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise FieldError("response_format", f"response_format={show(v)} is invalid: allowed {allowed}")
    if v["type"] == "json_object":
        if set(v) != {"type"}:
            raise FieldError("response_format", f"response_format={show(v)} is invalid: allowed {allowed}")
        return StructuredOutput.json_object()
    js = v.get("json_schema")
    keys = {"name", "schema", "strict", "description"}
    if set(v) != {"type", "json_schema"} or not isinstance(js, dict) or set(js) - keys or "schema" not in js:
        raise FieldError("response_format", f"response_format={show(v)} is invalid: allowed {allowed}")
    if not isinstance(js.get("name", ""), str) or not isinstance(js.get("strict", True), (bool, type(None))):
        raise FieldError("response_format", f"response_format={show(v)} is invalid: allowed {allowed} (name a string)")
    return StructuredOutput.json(js["schema"])


def _structured_outputs(v: object) -> StructuredOutput:
    allowed = f"an object with exactly one of {', '.join(SO_KEYS)}"
    if not isinstance(v, dict) or set(v) - set(SO_KEYS) - set(SO_IGNORED):
        raise FieldError("structured_outputs", f"structured_outputs={show(v)} is invalid: allowed {allowed}")
    given = [k for k in SO_KEYS if v.get(k) not in (None, False)]
    if len(given) != 1:
        raise FieldError("structured_outputs", f"structured_outputs={show(v)} is invalid: allowed {allowed}")
    key = given[0]
    if key == "json_object":
        if v[key] is not True:
            raise FieldError("structured_outputs", f"structured_outputs.json_object={show(v[key])}: allowed true")
        return StructuredOutput.json_object()
    return _guided(key, v[key], f"structured_outputs.{key}")


def _guided(kind: str, v: object, name: str) -> StructuredOutput:
    """``kind`` (json, regex, choice, grammar) from field ``name``'s value."""
    if kind == "json":
        if not isinstance(v, (dict, str, bool)):
            raise FieldError(name, f"{name}={show(v)} is invalid: allowed a JSON schema (an object or its text)")
        return StructuredOutput.json(v)
    if kind == "choice":
        if not isinstance(v, list):
            raise FieldError(name, f"{name}={show(v)} is invalid: allowed a list of non-empty strings")
        return StructuredOutput.choice(v)
    if not isinstance(v, str) or not v:
        raise FieldError(name, f"{name}={show(v)} is invalid: allowed a non-empty string")
    return StructuredOutput.regex(v) if kind == "regex" else StructuredOutput.grammar(v)
