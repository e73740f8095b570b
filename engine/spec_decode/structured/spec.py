"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a few strings or a grammar.

``StructuredOutput`` is the validated, hashable request field (``SamplingParams.structured``); the grammar engine
(engine/spec_decode/structured/grammar.py) compiles it. A JSON schema is kept as compact JSON text in its own key
order (the order properties come out in), so the same schema sent twice shares one compiled grammar.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.core.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 16  # a schema, regex or grammar longer than this is refused (compiling is not free)
MAX_CHOICES = 256


def _refuse(kind: str, value: object, allowed: str) -> InvalidRequestError:
    return InvalidRequestError(f"SamplingParams.structured.{kind}={value!r:.80} is invalid: allowed {allowed}")


@dataclass(frozen=True)
class StructuredOutput:
    """One structured-output constraint, built with the class methods (or ``StructuredOutput(kind, spec)``)."""

    kind: str
    """One of ``KINDS``: "json" (a JSON schema), "json_object" (any JSON object), "regex", "choice" (exactly one of
    the strings), "grammar" (a Lark grammar, or GBNF when it holds ``::=``)."""
    spec: str
    """json: the schema as compact JSON text (its key order kept); choice: a JSON list of the strings;
    json_object: ""; regex and grammar: the text."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise _refuse("kind", self.kind, f"one of {', '.join(KINDS)}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise _refuse(self.kind, self.spec, f"a str of at most {MAX_SPEC_CHARS} characters")
        try:
            self.spec.encode("utf-8")
        except UnicodeEncodeError:
            raise _refuse(self.kind, self.spec, "valid Unicode text (no lone surrogates)") from None
        if self.kind in ("regex", "grammar") and not self.spec:
            raise _refuse(self.kind, self.spec, "a non-empty str")
        if self.kind == "json":
            object.__setattr__(self, "spec", StructuredOutput.json(self.spec).spec)
        elif self.kind == "choice":
            try:
                options = json.loads(self.spec)
            except ValueError:
                raise _refuse("choice", self.spec, "a JSON list of non-empty str") from None
            object.__setattr__(self, "spec", StructuredOutput.choice(options).spec)

    @classmethod
    def json(cls, schema: dict[str, Any] | bool | str) -> StructuredOutput:
        """A JSON schema (a dict, true, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise _refuse("json", schema, f"a JSON schema (its text is not JSON: {e})") from None
        if not isinstance(schema, (dict, bool)):
            raise _refuse("json", schema, "a JSON schema: an object (or true)")
        try:
            text = json.dumps(schema, separators=(",", ":"), allow_nan=False)  # key order kept: it is the output's
        except (TypeError, ValueError) as e:
            raise _refuse("json", schema, f"a JSON schema of JSON values ({e})") from None
        return cls.__new__(cls)._set("json", text)

    @classmethod
    def json_object(cls) -> StructuredOutput:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        """Text matching ``pattern`` in full (Rust regex syntax, as llguidance reads it)."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> StructuredOutput:
        """Exactly one of ``options``."""
        if isinstance(options, (str, bytes)) or not isinstance(options, (list, tuple)):
            raise _refuse("choice", options, f"a list of 1 to {MAX_CHOICES} non-empty str")
        if not 1 <= len(options) <= MAX_CHOICES or not all(isinstance(o, str) and o for o in options):
            raise _refuse("choice", options, f"a list of 1 to {MAX_CHOICES} non-empty str")
        return cls.__new__(cls)._set("choice", json.dumps(list(options)))

    @classmethod
    def grammar(cls, text: str) -> StructuredOutput:
        """A context-free grammar: Lark (llguidance's dialect) or GBNF (llama.cpp's, converted)."""
        return cls("grammar", text)

    def _set(self, kind: str, spec: str) -> StructuredOutput:
        if len(spec) > MAX_SPEC_CHARS:
            raise _refuse(kind, spec, f"at most {MAX_SPEC_CHARS} characters as JSON")
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "spec", spec)
        return self
