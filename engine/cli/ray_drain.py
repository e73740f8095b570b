"""The timeouts of specmix on Ray Serve, derived from the longest request a replica may hold
(engine/cli/ray_serve.py sets them), and each replica's check of the round time they assume.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

from engine.core.errors import InvalidConfigError

log = logging.getLogger("ray.serve.specmix")  # under ray.serve: Serve writes it to the replica's log


@dataclass(frozen=True)
class Timeouts:
    """Serve's timeouts for the deployment, derived from the longest request a replica may hold.

    Once in a replica's batch a request runs at most ``max_seq_len`` rounds (its prefill's, then at least one
    token per round until prompt + completion reach max_seq_len), each at most ``round_s``:
    ``request_s = max_seq_len * round_s``. A replica holds at most ``2 * max_batch`` requests (Serve's
    ``max_ongoing_requests``: a running batch and as many waiting in the engine); those waiting all start
    before the running ones all end, so whatever a replica holds ends within ``drain_s = 2 * request_s``:
    Serve's ``graceful_shutdown_timeout_s`` for scale-down and restarts. A request at a proxy waits behind at
    most ``proxies * max_queued`` others, and a live replica takes ``max_batch`` more per ``request_s`` (its
    running batch ends), so a request reaches a replica within ``ceil(proxies * max_queued / max_batch) *
    request_s`` and ends ``drain_s`` later: ``proxy_s``, the least ``request_timeout_s`` of the proxy's
    ``http_options`` (and of a client's timeout). The bounds count one sequence per request (one asking
    for n samples counts n) and at least one live replica (a replica's start comes on top: min_replicas 0).
    """

    request_s: float
    """The longest a request runs once a replica's engine has it in its batch."""
    drain_s: float
    """The longest a replica takes to finish what it holds: Serve's ``graceful_shutdown_timeout_s``."""
    proxy_s: float
    """The longest a request takes from a proxy's queue to its end: the proxy's ``request_timeout_s``."""

    @classmethod
    def of(cls, *, max_seq_len: int, round_s: float, max_batch: int, max_queued: int, proxies: int) -> Timeouts:
        """The timeouts for requests of at most ``max_seq_len`` tokens (the other arguments: RayServeOptions')."""
        request = max_seq_len * round_s
        waves = math.ceil(proxies * max_queued / max_batch)
        return cls(request_s=request, drain_s=2 * request, proxy_s=(waves + 2) * request)


def sequence_bound(max_seq_len: int | None, context: int | None) -> int:
    """The longest sequence a replica accepts: ``max_seq_len``, else the target's ``context``."""
    if max_seq_len is None:
        if context is None:
            raise InvalidConfigError("max_seq_len=None is invalid without the target's context: allowed an int >= 2")
        return context
    if context is not None and max_seq_len > context:
        raise InvalidConfigError(f"max_seq_len={max_seq_len} is invalid: allowed 2..{context} (the target's context)")
    return max_seq_len


class SlowRounds:
    """A replica's check of ``round_s`` against its measured rounds (the engine's busy seconds per round over
    each metrics period): a slower mean logs a warning, at most once per ``every_s``."""

    def __init__(self, round_s: float, replica: str, every_s: float = 60.0) -> None:
        self.round_s, self.replica, self.every_s = round_s, replica, every_s
        self.busy = self.rounds = 0.0
        self.warned_at = -math.inf

    def check(self, values: Mapping[str, float]) -> float | None:
        """The mean seconds per round since the last check (None: no round ran); warns when above round_s."""
        busy, rounds = values.get("specmix_busy_seconds", 0.0), values.get("specmix_rounds", 0.0)
        d_busy, d_rounds = busy - self.busy, rounds - self.rounds
        self.busy, self.rounds = busy, rounds
        if d_rounds <= 0:
            return None
        mean = d_busy / d_rounds
        now = time.monotonic()
        if mean > self.round_s and now - self.warned_at >= self.every_s:
            self.warned_at = now
            log.warning(
                "replica %s: its rounds took %.3f s on average, above round_s=%g: the drain and request "
                "timeouts, derived from round_s, may cut requests; raise round_s",
                self.replica,
                mean,
                self.round_s,
            )
        return mean
