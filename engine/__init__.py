"""specmix engine: Llama-family models, static KV cache, speculative decoding.

Public surface (DESIGN.md section 6)::

    from engine import Engine, SamplingParams, EngineError
"""
__version__ = "0.1.0"

from .engine import Completion, Engine
from .errors import EngineError
from .sampling import SamplingParams

__all__ = ["Completion", "Engine", "EngineError", "SamplingParams"]
