"""Chat templates: a checkpoint's ``chat_template`` rendered in a sandboxed jinja2 environment.

The template comes from ``chat_template.jinja`` beside the tokenizer, else from the
``chat_template`` entry of ``tokenizer_config.json`` (a string, or a list of named templates of
which "default" is used). The rendered prompt already holds the special tokens the template
writes (BOS and the role markers), so it is encoded without adding special tokens again.

Templates are untrusted code (they come with downloaded checkpoints): they run in jinja2's
``ImmutableSandboxedEnvironment``, with the few helpers templates of the field expect
(``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII characters).
"""

from __future__ import annotations

import json
import logging
import reprlib
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from engine.core.errors import CheckpointError, InvalidRequestError

log = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")
# the errors a template's expressions raise on values of the wrong type (None + str, a dict where it wants a list)
RENDER_ERRORS = (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError)
_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlist, _SHOW.maxdict = 3, 60, 60, 6, 4
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateMissingError(InvalidRequestError):
    """The checkpoint has no chat template; only plain completions can be served."""


def _token_text(v: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(v, str):
        return v
    if isinstance(v, Mapping) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _read_config(model_dir: Path) -> dict[str, Any]:
    f = model_dir / "tokenizer_config.json"
    if not f.is_file():
        return {}
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: invalid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{f}: allowed a JSON object")
    return cfg


def _pick_template(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise CheckpointError(
            f"{where}: chat_template is a list without a 'default' template (names: {', '.join(map(str, named))})"
        )
    raise CheckpointError(
        f"{where}: chat_template={value!r:.60} is invalid: allowed a string or a list of {{name, template}}"
    )


def _show(v: object) -> str:
    """A short repr of a caller's value for an error message (bounded in size and nesting)."""
    return _SHOW.repr(v)


def _flatten_content(content: object, i: int) -> str | None:
    """OpenAI message content: a string, None, or a list of text parts (joined)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"messages[{i}].content[{j}]={_show(part)} is invalid: allowed a text part "
                    '{"type": "text", "text": str} (this server serves text models)'
                )
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequestError(
        f"messages[{i}].content={_show(content)} is invalid: allowed a string or a list of text parts"
    )


def check_messages(messages: object) -> list[dict[str, Any]]:
    """Validate OpenAI-style messages; returns copies with text content as plain strings."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError(
            f"messages={_show(messages)} is invalid: allowed a non-empty list of {{role, content}} objects"
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}]={_show(m)} is invalid: allowed an object with role and content")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidRequestError(f"messages[{i}].role={_show(role)} is invalid: allowed {', '.join(ROLES)}")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise InvalidRequestError(f"messages[{i}].name={_show(m['name'])} is invalid: allowed a string")
        msg = dict(m)
        msg["content"] = _flatten_content(m.get("content"), i)
        out.append(msg)
    return out


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None, origin: str = "") -> None:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source, self.origin = source, origin
        self.special_tokens = dict(special_tokens or {})
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise CheckpointError(f"{origin or 'chat template'}: does not compile: {e}") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The template of a checkpoint directory, or None when it has none."""
        d = Path(model_dir)
        if d.is_file():
            d = d.parent
        cfg = _read_config(d)
        special = {k: t for k in SPECIAL_KEYS if (t := _token_text(cfg.get(k))) is not None}
        jinja_file = d / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), special, str(jinja_file))
        if "chat_template" in cfg:
            where = str(d / "tokenizer_config.json")
            return cls(_pick_template(cfg["chat_template"], where), special, where)
        return None

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text of ``messages`` (validated), ending with the assistant's turn header."""
        from jinja2 import TemplateError

        msgs = check_messages(messages)
        try:
            return self._template.render(
                messages=msgs, add_generation_prompt=add_generation_prompt, **self.special_tokens, **extra
            )
        except TemplateError as e:  # raise_exception() in the template: the messages break its rules
            raise InvalidRequestError(f"messages are invalid for this model's chat template: {e}") from None
        except RENDER_ERRORS as e:  # the template's expressions fail on these values (e.g. content null)
            raise InvalidRequestError(
                f"messages do not render with this model's chat template ({type(e).__name__}: {_show(str(e))}): "
                "allowed messages whose fields have the types the template expects (content a string)"
            ) from None


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)
