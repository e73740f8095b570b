"""What the server needs from an engine (``engine.api.engine.Engine`` is one): the contract of the OpenAI app,
its Prometheus metrics and the Ray replica metrics, so that the server imports nothing from ``engine.api``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engine.core.tokenizer import TextStream
    from engine.runtime.metrics import Sample
    from engine.runtime.request import Request
    from engine.spec_decode.sampling import SamplingParams


class ServedTokenizer(Protocol):
    """Token ids -> text, whole or incrementally (engine.core.tokenizer.Tokenizer)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def decode_stream(self, skip_special_tokens: bool = True) -> TextStream:
        """A fresh incremental decoder, fed with ``step``."""
        ...

    def step(self, stream: TextStream, ids: int | list[int]) -> str | None:
        """The text ``ids`` complete after what ``stream`` has seen (None when none yet)."""
        ...


class ServedEngine(Protocol):
    """The engine behind the OpenAI app: prompts in, request handles out, health and metrics."""

    @property
    def tokenizer(self) -> ServedTokenizer: ...

    @property
    def max_seq_len(self) -> int:
        """Prompt + new tokens a request may hold (the app's ``max_model_len``; chat's default budget)."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """A plain prompt's token ids; raises InvalidRequestError for an empty one."""
        ...

    def chat_prompt(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """``messages`` rendered by the model's chat template; raises ChatTemplateMissingError without one."""
        ...

    def submit_many(self, prompts: Sequence[str | Sequence[int]], params: Sequence[SamplingParams]) -> list[Request]:
        """Queue prompts together, all or none (OverloadedError when the queue cannot take them all)."""
        ...

    def check_health(self) -> None:
        """Raise UnhealthyError when the engine cannot make progress."""
        ...

    def metric_samples(self) -> list[Sample]:
        """Every counter and gauge from one snapshot (engine/runtime/metrics.py)."""
        ...
