"""A request's handle and its result: ``Request`` (iterate text pieces, ``result()``, ``cancel()``),
``Completion``, the engine-wide ``Totals`` and ``RequestFailedError``."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from engine.core.errors import EngineError
from engine.core.tokenizer import Tokenizer
from engine.spec.sampling import SamplingParams
from engine.spec.seq import Seq


@dataclass
class Completion:
    """One prompt's output."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (eos or a stop string), "length", "cancelled", "error"
    prompt_token_ids: list[int]
    stats: dict[str, Any] = field(default_factory=dict)


FINISH_REASONS = ("stop", "length", "cancelled", "error")


class RequestFailedError(EngineError, RuntimeError):
    """The round that ran this request failed (the engine logged why and keeps serving)."""


@dataclass
class Totals:
    """Engine-wide counters (what ``stats()`` and ``metrics_text()`` report)."""

    requests: int = 0  # finished requests (any reason)
    generated: int = 0
    drafted: int = 0
    accepted: int = 0
    iterations: int = 0  # sequence-rounds (one per sequence per target pass it took part in)
    target_forwards: int = 0  # batched target passes (rounds)
    seconds: float = 0.0  # worker time spent in rounds
    pos_tried: list[int] = field(default_factory=list)
    pos_accepted: list[int] = field(default_factory=list)
    finished: dict[str, int] = field(default_factory=lambda: {r: 0 for r in FINISH_REASONS})
    nonfinite: int = 0  # sequences ended by NaN/inf logits
    round_failures: int = 0  # rounds that raised
    failed: int = 0  # requests ended by a failed round (RequestFailedError)
    rejected_overload: int = 0  # submissions refused with OverloadedError


class Request:
    """One submitted prompt. Iterate it for text pieces as tokens are accepted (never a partial
    character or a possible stop-string prefix), ``result()`` for the Completion, ``cancel()`` to stop.

    Closing the iterator early (``break`` in a for loop, GeneratorExit) cancels the request.
    """

    def __init__(self, prompt: list[int], params: SamplingParams, tokenizer: Tokenizer,
                 wake: Callable[[], None]) -> None:
        self.prompt, self.params = prompt, params
        self._tokenizer, self._wake = tokenizer, wake
        self._cv = threading.Condition()
        self._tokens: list[int] = []
        self._completion: Completion | None = None
        self._error: EngineError | None = None
        self._cancelled = False
        self.seq: Seq | None = None  # the worker's sequence while running

    # ------------------------------------------------------------ caller side
    def cancel(self) -> None:
        """Stop generating; the request's cache row is freed at the next round."""
        self._cancelled = True
        self._wake()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        with self._cv:
            return self._completion is not None or self._error is not None

    def result(self, timeout: float | None = None) -> Completion:
        """The Completion (finish_reason stop, length, cancelled or error); raises RequestFailedError
        when its round failed, TimeoutError when ``timeout`` seconds pass first."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._completion is not None or self._error is not None, timeout):
                raise TimeoutError(f"request not finished within timeout={timeout} s")
            if self._error is not None:
                raise self._error
            assert self._completion is not None
            return self._completion

    def __iter__(self) -> Iterator[str]:
        return self.text_pieces()

    def text_pieces(self) -> Iterator[str]:
        tok, stops = self._tokenizer, self.params.stop
        sent = seen = 0
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: len(self._tokens) > seen or self._completion is not None
                                      or self._error is not None)
                    if self._error is not None:
                        raise self._error
                    comp, toks = self._completion, list(self._tokens)
                if comp is not None:
                    if len(comp.text) > sent:
                        yield comp.text[sent:]
                    return
                seen = len(toks)
                text = tok.decode(toks)
                safe = safe_prefix(text, stops)
                if safe > sent:
                    yield text[sent:safe]
                    sent = safe
        finally:
            if not self.done():
                self.cancel()

    # ------------------------------------------------------------ worker side
    def _deliver(self, tokens: list[int], completion: Completion | None = None,
                 error: EngineError | None = None) -> None:
        with self._cv:
            self._tokens.extend(tokens)
            self._completion, self._error = completion, error
            self._cv.notify_all()


def safe_prefix(text: str, stops: Sequence[str]) -> int:
    """Length of text safe to emit: no trailing partial character, no possible start of a stop string."""
    n = len(text)
    while n and text[n - 1] == "\ufffd":
        n -= 1
    for s in stops:
        for j in range(min(len(s) - 1, n), 0, -1):
            if text[:n].endswith(s[:j]):
                n -= j
                break
    return n
