"""What one scheduler takes on, and its wait queue and cache rows: who waits, which rows are free, what fits.

Requests wait first come, first served; each running request holds one row of the KV cache, the lowest free one
(so the running batch stays a prefix of the rows). The scheduler (engine/runtime/scheduler.py) changes them only
under its lock.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from engine.core.errors import OverloadedError
from engine.runtime.request import Request


@dataclass(frozen=True)
class SchedulerLimits:
    """How much one scheduler takes on."""

    max_batch: int
    """Sequences decoded at once (rows of the KV cache)."""
    max_waiting: int
    """Requests queued beyond the running batch; more get OverloadedError."""
    max_seq_len: int
    """Longest request (prompt + max_new_tokens) the cache may grow to."""
    idle_exit_s: float = 0.5
    """The worker exits after this long without work (the next submission restarts it)."""
    prefill_chunk: int | None = None
    """Prompt tokens prefilled per round while other requests decode, per token each decoding row is given in a
    round (``PrefillPace``; engine/spec_decode/chunked_prefill.py); None: a joining prompt prefills whole."""

    def __post_init__(self) -> None:
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={self.prefill_chunk} is invalid: allowed an int >= 1 or None")


@dataclass
class PrefillPace:
    """The prompt tokens a round may prefill while other requests decode: ``chunk`` per token each decoding row
    was given in recent rounds (a decayed mean of the tokens committed per row and round: 1 without drafts).

    A joining prompt then stalls the running streams by at most ``chunk`` tokens' forward per token they receive,
    with speculation as without it. A round that commits several tokens per row prefills as many times more: with
    a budget per round, the prompts' share of the work would fall as speculation speeds the decoding up, and under
    load (the rows of finished requests refilled at once) the rows waiting for their prefill would pile up."""

    chunk: int | None
    """Prompt tokens per decoded token of a row (``SchedulerLimits.prefill_chunk``); None: no budget."""
    decay: float = 0.8
    """Weight of the past in the mean, per decode round."""
    _given: list[float] = field(default_factory=lambda: [0.0, 0.0])  # decayed [tokens per row, rounds]

    def budget(self) -> int | None:
        """This round's prompt tokens (None: no budget)."""
        if self.chunk is None:
            return None
        tokens, rounds = self._given
        return round(self.chunk * max(1.0, tokens / rounds)) if rounds > 0 else self.chunk

    def record(self, rows: int, committed: int) -> None:
        """A decode round over ``rows`` decoding rows committed ``committed`` tokens."""
        if rows > 0:
            t, n = self._given
            self._given = [self.decay * t + committed / rows, self.decay * n + 1.0]


class Admission:
    """The requests waiting for a row, in order, and the rows of the cache free or held."""

    def __init__(self, max_batch: int, max_waiting: int) -> None:
        self.max_batch, self.max_waiting = max_batch, max_waiting
        self.waiting: deque[Request] = deque()
        self.held = 0  # rows held by running requests
        self._free = list(range(max_batch))  # a heap: low rows first

    def room(self) -> int:
        """How many more requests may queue: the queue's free places and the free rows."""
        return self.max_waiting + (self.max_batch - self.held) - len(self.waiting)

    def overloaded(self, n: int) -> OverloadedError:
        """The error refusing ``n`` requests that do not fit."""
        return OverloadedError(
            f"overloaded: {len(self.waiting)} requests waiting and {self.held} running "
            f"(max_waiting={self.max_waiting}, max_batch={self.max_batch}); {n} more do not fit, retry later"
        )

    def admit(self, cap: int) -> list[tuple[Request, int]]:
        """Pop waiting requests into free rows while fewer than ``cap`` rows are held."""
        admitted: list[tuple[Request, int]] = []
        while self.waiting and self._free and self.held < cap:
            self.held += 1
            admitted.append((self.waiting.popleft(), heapq.heappop(self._free)))
        return admitted

    def release(self, row: int) -> None:
        """A running request left ``row``."""
        heapq.heappush(self._free, row)
        self.held -= 1

    def drop_cancelled(self) -> list[Request]:
        """The cancelled waiting requests, taken out of the queue."""
        gone = [r for r in self.waiting if r.cancelled]
        for r in gone:
            self.waiting.remove(r)
        return gone
