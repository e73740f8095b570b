"""specmix engine: Llama-family models, static KV cache, speculative decoding.

Public surface (docs/design.md)::

    from engine import Engine, SamplingParams, EngineError

The names below load on first use, so importing a low layer (``engine.core``) does not
pull in the whole engine (the import order of the layers is in docs/design.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "engine.api.engine",
    "Completion": "engine.api.engine",
    "EngineError": "engine.core.errors",
    "SamplingParams": "engine.spec_decode.sampling",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from engine.api.engine import Completion, Engine  # noqa: F401
    from engine.core.errors import EngineError  # noqa: F401
    from engine.spec_decode.sampling import SamplingParams  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
