"""What one HTTP request may ask of the server (``specmix-serve`` flags; docs/design.md, section 12).

Every limit refuses with OpenAI's error JSON naming the field and the bound: 413 for the body, 400 for
the rest. Prompt tokens + ``max_tokens`` beyond the engine's ``max_seq_len`` is the engine's own check
(``Limits.max_seq_len``, a 400 naming ``prompt`` or ``messages``); a full wait queue is a 503 with Retry-After.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.core.errors import InvalidConfigError

MAX_DEPTH = 16
"""JSON nesting a body may have (a chat body needs 4: messages, a message, its content parts, a part)."""


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one request, checked before any tokenization (all ints >= 1)."""

    max_body_bytes: int = 8 * 2**20
    """Bytes of a request body: a larger Content-Length is refused before reading, and a body sent without one
    is refused (413) once it passes this many bytes."""
    max_prompts: int = 64
    """Prompts in one completions request (``prompt`` as a list of strings or of token-id lists)."""
    max_n: int = 16
    """Choices per prompt (``n``); every choice is one sequence of the batch."""
    max_stop: int = 4
    """Stop strings (``stop``; OpenAI allows 4)."""
    max_stop_chars: int = 256
    """Characters of one stop string (text that could begin one is held back while streaming)."""
    max_stop_token_ids: int = 64
    """Token ids in ``stop_token_ids``."""

    def __post_init__(self) -> None:
        for name, v in dataclasses.asdict(self).items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidConfigError(f"RequestLimits.{name}={v!r} is invalid: allowed an int >= 1")
