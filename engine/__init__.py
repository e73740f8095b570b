"""specmix engine: Llama-family models, static KV cache, speculative decoding."""
from .errors import EngineError

__all__ = ["EngineError"]
