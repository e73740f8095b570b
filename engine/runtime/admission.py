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
    """Prompt tokens prefilled while other requests decode, per token a decoding row gets in a round
    (``PrefillPace``, which checks it; engine/spec_decode/chunked_prefill.py); None: a joining prompt prefills
    whole."""


@dataclass
class PrefillPace:
    """The prompt tokens a round may prefill while other requests decode: ``chunk`` per token each decoding row
    was given in recent rounds (a decayed mean of the tokens committed per row and round: 1 without drafts).

    A joining prompt then stalls the running streams, on average over recent rounds, by at most ``chunk`` tokens'
    forward per token they receive, with speculation as without it; a round that commits several tokens per row
    prefills as many times more (each round's stall grows with it). With a budget per round, the prompts' share of
    the work would fall as speculation speeds the decoding up, and their first tokens wait longer than without it."""

    chunk: int | None
    """Prompt tokens per decoded token of a row (``SchedulerLimits.prefill_chunk``); None: no budget."""
    decay: float = 0.8
    """Weight of the past in the mean, per decode round (in [0, 1))."""
    _tokens: float = field(default=0.0, init=False, repr=False)
    """Decayed sum of the tokens committed per decoding row, per decode round."""
    _rounds: float = field(default=0.0, init=False, repr=False)
    """Decayed count of the decode rounds recorded."""

    def __post_init__(self) -> None:
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"chunk={self.chunk} is invalid: allowed an int >= 1 or None")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay={self.decay} is invalid: allowed a float in [0, 1)")

    def budget(self, k_cap: int) -> int | None:
        """This round's prompt tokens (None: no budget); ``k_cap``, the round's K cap (the load window's), caps the
        mean at ``k_cap + 1`` tokens per row."""
        if self.chunk is None:
            return None
        per_row = self._tokens / self._rounds if self._rounds > 0 else 1.0
        return round(self.chunk * min(max(1.0, per_row), k_cap + 1.0))

    def record(self, rows: int, committed: int) -> None:
        """A decode round over ``rows`` decoding rows committed ``committed`` tokens."""
        if rows > 0:
            self._tokens = self.decay * self._tokens + committed / rows
            self._rounds = self.decay * self._rounds + 1.0


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
