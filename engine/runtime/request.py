"""A submitted request as its caller sees it: new tokens, text pieces, the Completion, cancel.

The worker (engine/runtime/scheduler.py) delivers token ids (and logprobs) and wakes the request's
waiters and listeners; everything else (detokenization, the Completion) runs in the reader's thread.
Also here: ``Completion``, the engine-wide ``Totals`` and ``RequestFailedError``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.core.errors import EngineError
from engine.core.tokenizer import Tokenizer
from engine.spec_decode.sampling import SamplingParams
from engine.spec_decode.seq import Seq, TokenLogprob


@dataclass
class Completion:
    """One prompt's output."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (eos, a stop string or a stop token), "length", "cancelled", "error"
    prompt_token_ids: list[int]
    stats: dict[str, Any] = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # per emitted token, when SamplingParams.logprobs asked

    @classmethod
    def of(cls, s: Seq, text: str) -> Completion:
        """A finished sequence's output (``text``: its final text)."""
        logprobs = None if s.logprobs is None else list(s.logprobs)
        return cls(text, s.generated, s.finish_reason or "length", s.prompt, s.stats.to_dict(), logprobs)

    @classmethod
    def unstarted(cls, prompt: list[int]) -> Completion:
        """A request cancelled before it was admitted."""
        return cls(text="", token_ids=[], finish_reason="cancelled", prompt_token_ids=prompt)


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
    prefill_tokens: int = 0  # prompt tokens the target computed (a prompt shared by sequences admitted together: once)
    prefill_shared: int = 0  # prompt tokens copied from a sequence of the same prompt instead of computed
    plain_rounds: int = 0  # rounds the K tuner ran plainly (K = 0: plain rounds measured faster at that batch)
    tree_rounds: int = 0  # sequence-rounds that verified a draft tree (the rest of those with drafts: chains)
    seconds: float = 0.0  # worker time spent in rounds
    pos_tried: list[int] = field(default_factory=list)
    pos_accepted: list[int] = field(default_factory=list)
    accepted_hist: list[int] = field(default_factory=list)  # rounds with drafts, by drafts accepted (0, 1, ...)
    finished: dict[str, int] = field(default_factory=lambda: {r: 0 for r in FINISH_REASONS})
    nonfinite: int = 0  # sequences ended by NaN/inf logits
    round_failures: int = 0  # rounds that raised
    failed: int = 0  # requests ended by a failed round (RequestFailedError)
    rejected_overload: int = 0  # submissions refused with OverloadedError
    constrained: int = 0  # finished requests with a structured output
    forced: int = 0  # their drafts that were tokens the grammar forced
    forced_accepted: int = 0
    mask_seconds: float = 0.0  # time computing their grammars' masks

    def copy(self) -> Totals:
        """A copy whose lists and dicts are its own."""
        return Totals(
            **{
                k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
                for k, v in vars(self).items()
            }
        )

    def count(self, s: Seq) -> None:
        """Add a finished sequence's figures (the caller holds the scheduler's lock)."""
        t, st = self, s.stats
        reason = s.finish_reason or "length"
        t.requests += 1
        t.prefill_tokens += st.prefill_tokens
        t.prefill_shared += st.prefill_shared
        t.finished[reason] = t.finished.get(reason, 0) + 1
        if reason == "error":
            t.nonfinite += 1
        t.generated += len(s.generated)
        t.drafted += st.drafted
        t.accepted += st.accepted
        t.iterations += st.target_passes
        t.tree_rounds += st.tree_rounds
        if len(t.pos_tried) < len(st.pos_tried):
            t.pos_tried += [0] * (len(st.pos_tried) - len(t.pos_tried))
            t.pos_accepted += [0] * (len(st.pos_tried) - len(t.pos_accepted))
        for i, (a, n) in enumerate(zip(st.pos_accepted, st.pos_tried)):
            t.pos_tried[i] += n
            t.pos_accepted[i] += a
        t.accepted_hist += [0] * (len(st.accepted_hist) - len(t.accepted_hist))
        for i, n in enumerate(st.accepted_hist):
            t.accepted_hist[i] += n
        if s.params.structured is not None:
            t.constrained += 1
            t.forced, t.forced_accepted, t.mask_seconds = (
                t.forced + st.forced, t.forced_accepted + st.forced_accepted, t.mask_seconds + st.mask_seconds
            )  # fmt: skip

    def summary(self) -> dict[str, Any]:
        """The rates and counts of Engine.stats()."""
        tried = sum(self.pos_tried)
        return {
            "requests": self.requests,
            "generated_tokens": self.generated,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "token_acceptance": sum(self.pos_accepted) / tried if tried else None,
            "mean_accepted_length": 1 + self.accepted / self.iterations if self.iterations else None,
            "tokens_per_s": self.generated / self.seconds if self.seconds else None,
            "target_passes_per_token": self.iterations / self.generated if self.generated else None,
            "tree_rounds": self.tree_rounds,
            "target_forwards": self.target_forwards,
            "prefill_tokens": self.prefill_tokens,
            "prefill_shared": self.prefill_shared,
            "plain_rounds": self.plain_rounds,
            "sequence_rounds": self.iterations,
            "busy_seconds": self.seconds,
            "structured": {
                "requests": self.constrained,
                "forced_drafts": self.forced,
                "forced_accepted": self.forced_accepted,
                "mask_seconds": self.mask_seconds,
            },
        }


class Request:
    """One submitted prompt. Iterate it for text pieces as tokens are accepted (never a partial
    character or a possible stop-string prefix), ``result()`` for the Completion, ``cancel()`` to stop.

    Closing the iterator early (``break`` in a for loop, GeneratorExit) cancels the request.
    """

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        wake: Callable[[], None],
        complete: Callable[[Seq], Completion],
    ) -> None:
        """``wake`` nudges the worker (a cancel); ``complete`` builds the Completion of a finished sequence."""
        self.prompt, self.params = prompt, params
        self._tokenizer, self._wake, self._complete = tokenizer, wake, complete
        self._cv = threading.Condition()
        self._tokens: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._completion: Completion | None = None
        self._final: Seq | None = None  # the finished sequence; its Completion is built by the reader
        self._error: EngineError | None = None
        self._cancelled = False
        self._listeners: list[Callable[[], None]] = []
        self.submitted_at = time.perf_counter()
        self._times: list[tuple[float, int]] = []  # (when, how many tokens) of each delivery with tokens

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
            return self._ended()

    def _ended(self) -> bool:
        return self._completion is not None or self._final is not None or self._error is not None

    def _built(self) -> Completion | None:
        """The Completion once finished (built here, in the reader's thread, not by the worker); under _cv."""
        if self._completion is None and self._final is not None:
            self._completion = self._complete(self._final)
            self._final = None
        return self._completion

    def add_listener(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` (from the worker thread; keep it short) after each delivery, and once now."""
        with self._cv:
            self._listeners.append(fn)
        fn()

    def poll(self, since: int = 0) -> tuple[list[int], list[TokenLogprob], Completion | None, EngineError | None]:
        """Tokens (and logprobs) from index ``since`` on, the Completion when finished, the error when failed."""
        with self._cv:
            return (
                self._tokens[since:],
                self._logprobs[since:] if self.params.logprobs is not None else [],
                self._built(),
                self._error,
            )

    def completion(self) -> Completion | None:
        """The Completion once finished (None before, or when it failed)."""
        with self._cv:
            return self._built()

    def tokens_so_far(self) -> list[int]:
        with self._cv:
            return list(self._tokens)

    def deliveries(self) -> list[tuple[float, int]]:
        """(time.perf_counter(), tokens) of each delivery that carried tokens (``submitted_at`` is the start)."""
        with self._cv:
            return list(self._times)

    def result(self, timeout: float | None = None) -> Completion:
        """The Completion (finish_reason stop, length, cancelled or error); raises RequestFailedError
        when its round failed, TimeoutError when ``timeout`` seconds pass first."""
        with self._cv:
            if not self._cv.wait_for(self._ended, timeout):
                raise TimeoutError(f"request not finished within timeout={timeout} s")
            if self._error is not None:
                raise self._error
            comp = self._built()
            assert comp is not None
            return comp

    def __iter__(self) -> Iterator[str]:
        return self.text_pieces()

    def text_pieces(self) -> Iterator[str]:
        """Text as tokens arrive, decoded incrementally (tokenizers' DecodeStream: the cost of an update is
        its new tokens'), holding back a possible start of a stop string; the rest of the final text at the end."""
        tok, stops = self._tokenizer, self.params.stop
        stream = tok.decode_stream()
        seen, sent, pending = 0, "", ""
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda n=seen: len(self._tokens) > n or self._ended())
                    if self._error is not None:
                        raise self._error
                    comp, toks = self._built(), self._tokens[seen:]
                if comp is not None:
                    if comp.text.startswith(sent) and len(comp.text) > len(sent):
                        yield comp.text[len(sent) :]
                    return
                seen += len(toks)
                pending += tok.step(stream, toks) or ""
                safe = safe_prefix(pending, stops)
                if safe:
                    piece, pending = pending[:safe], pending[safe:]
                    sent += piece
                    yield piece
        finally:
            if not self.done():
                self.cancel()

    # ------------------------------------------------------------ worker side
    def deliver(
        self,
        tokens: Sequence[int],
        logprobs: Sequence[TokenLogprob] = (),
        final: Seq | None = None,
        completion: Completion | None = None,
        error: EngineError | None = None,
    ) -> None:
        with self._cv:
            if tokens:
                self._times.append((time.perf_counter(), len(tokens)))
            self._tokens.extend(tokens)
            self._logprobs.extend(logprobs)
            self._final, self._completion, self._error = final, completion, error
            self._cv.notify_all()
            listeners = list(self._listeners)
        for fn in listeners:
            fn()


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
