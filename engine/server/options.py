"""The typed options of the OpenAI app (``specmix-serve`` flags, the Ray Serve app's arguments; docs/design.md,
section 12), importable without FastAPI.

``RequestLimits``: what one HTTP request may ask of the server. Every limit refuses with OpenAI's error JSON
naming the field and the bound: 413 for the body, 400 for the rest. Prompt tokens + ``max_tokens`` beyond
the engine's ``max_seq_len`` is the engine's own check (``Limits.max_seq_len``, a 400 naming ``prompt`` or
``messages``); a full wait queue is a 503 with Retry-After.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.core.errors import InvalidConfigError

OPEN_PATHS = ("/health", "/metrics")  # open without the API key unless AccessOptions.protect_health_metrics
MAX_DEPTH = 16
"""JSON nesting a body may have (a chat body needs 5: the body, messages, a message, its content parts, a part)."""


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


@dataclass(frozen=True)
class AccessOptions:
    """Access control of the app (``create_app(server, access)``; ``specmix-serve`` and the Ray Serve app)."""

    api_key: str | None = None
    """The key clients send as ``Authorization: Bearer <key>``; None: no key needed."""
    protect_health_metrics: bool = False
    """With an api_key, ``/health`` and ``/metrics`` need it too (default: open, for probes and scrapers)."""
    allowed_origins: tuple[str, ...] = ()
    """Origins browsers may call from (CORS; ``"*"`` for any); empty: CORS off."""

    def __post_init__(self) -> None:
        key = self.api_key
        if key is not None and not (isinstance(key, str) and key and key.isascii() and key.isprintable()):
            raise InvalidConfigError("api_key is invalid: allowed None or a non-empty string of printable ASCII")
        if key is not None and " " in key:
            raise InvalidConfigError("api_key is invalid: allowed a key without spaces")
        if not isinstance(self.allowed_origins, tuple) or not all(
            isinstance(o, str) and o for o in self.allowed_origins
        ):
            raise InvalidConfigError(
                f"allowed_origins={self.allowed_origins!r:.80} is invalid: allowed a tuple of origins"
            )

    def needs_key(self, path: str) -> bool:
        """Whether a request to ``path`` must carry the key."""
        if self.api_key is None:
            return False
        return self.protect_health_metrics or path not in OPEN_PATHS
