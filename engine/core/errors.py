"""Typed errors of the public surface.

Every refusal the engine makes is an ``EngineError``. Errors caused by a bad
argument are also ``ValueError``s, so callers that already catch ValueError keep
working. Messages name the field (or file) and the allowed values.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error specmix raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A prompt or a sampling parameter is out of range."""


class InvalidConfigError(EngineError, ValueError):
    """An engine option (drafter, k, device, plan, ...) is out of range."""


class CheckpointError(EngineError):
    """A checkpoint directory, config or weight file cannot be used."""


class UnsupportedArchitectureError(CheckpointError, ValueError):
    """config.json names an architecture specmix does not implement."""


class VocabMismatchError(EngineError, ValueError):
    """Draft and target tokenizers do not share a vocabulary."""


class DraftMismatchError(CheckpointError, ValueError):
    """A draft head's checkpoint does not fit the target (shape, vocabulary, another target) or the drafter."""


class KernelUnavailableError(EngineError, RuntimeError):
    """A plan or profile asks for a kernel this machine lacks."""


class ProfileError(EngineError, ValueError):
    """A profile file is missing, malformed or does not match its models."""


class OverloadedError(EngineError, RuntimeError):
    """The engine's wait queue is full; retry later."""


class UnhealthyError(EngineError, RuntimeError):
    """The engine cannot make progress (a stalled round, failing rounds, pending work without a worker)."""
