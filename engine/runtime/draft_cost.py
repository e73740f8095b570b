"""What a draft token must be worth at the running batch: the acceptance below which verifying it costs more than
it commits.

A round that verifies D draft tokens over B rows costs about T = a + g B + beta D seconds, and the batch commits
R tokens per second. A draft token accepted with chance q adds q tokens for beta seconds: it pays where
q / beta >= R, so the round's drafts need q >= beta R (``DraftCost.min_accept``). On a CPU's packed verify pass
beta is nearly the cost of a row's token, and at a large batch only drafts that are almost surely accepted pay;
at batch 1 a draft token costs a small share of the round and nearly every draft pays.

Per batch bucket (the running batch rounded up to a power of two, as the K tuner's) the tuner feeds each measured
round's rows, drafted tokens, committed tokens and wall time; beta is the least-squares slope of the round time on
the drafted tokens with the rows held apart (decayed sums, ``decay`` per round), and R the decayed committed tokens
per second. Until a bucket has ``min_rounds`` (decayed) rounds with drafted tokens that vary apart from the rows,
or where the slope is not positive, it asks nothing of the drafts (0). A drafter that estimates its drafts'
acceptance (n-gram: by the length of its match, engine/spec_decode/drafters/ngram.py) drafts only the tokens that
reach it. The threshold depends only on rounds already run, so sampling stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.runtime.k_tuner import bucket

_ROWS, _DRAFTED, _SECONDS = 0, 1, 2  # the regression's variables


@dataclass
class DraftCost:
    """Per batch bucket: the marginal seconds of a verified draft token and the committed tokens per second."""

    decay: float = 0.98
    """Weight of the past per recorded round at the bucket."""
    min_rounds: float = 8.0
    """Decayed rounds a bucket needs before its threshold counts."""
    cap: float = 0.95
    """The threshold at most (a draft that is accepted this surely always pays)."""
    _sums: dict[int, list[float]] = field(default_factory=dict)  # bucket -> [w, tokens, s_x (3), s_xy (3 x 3)]

    def record(self, batch: int, drafted: int, committed: int, seconds: float) -> None:
        """One measured round of ``batch`` rows that verified ``drafted`` draft tokens and committed ``committed``."""
        s = self._sums.setdefault(bucket(batch), [0.0] * 14)
        x = (float(batch), float(drafted), seconds)
        d = self.decay
        s[0], s[1] = d * s[0] + 1.0, d * s[1] + committed
        for i in range(3):
            s[2 + i] = d * s[2 + i] + x[i]
            for j in range(i, 3):
                k = 5 + 3 * i + j
                s[k] = d * s[k] + x[i] * x[j]

    def _cov(self, s: list[float], i: int, j: int) -> float:
        i, j = min(i, j), max(i, j)
        w = s[0]
        return s[5 + 3 * i + j] / w - (s[2 + i] / w) * (s[2 + j] / w)

    def marginal(self, batch: int) -> float | None:
        """Seconds a verified draft token adds to a round at this batch's bucket (None: not known yet)."""
        s = self._sums.get(bucket(batch))
        if s is None or s[0] < self.min_rounds:
            return None
        rr, dd, rd = self._cov(s, _ROWS, _ROWS), self._cov(s, _DRAFTED, _DRAFTED), self._cov(s, _ROWS, _DRAFTED)
        rt, dt = self._cov(s, _ROWS, _SECONDS), self._cov(s, _DRAFTED, _SECONDS)
        if dd <= 1e-9:
            return None  # the drafted tokens did not vary: no slope to read
        det = rr * dd - rd * rd
        if rr <= 1e-9:  # the rows did not vary: the drafts alone
            beta = dt / dd
        elif det <= 1e-6 * rr * dd:
            return None  # the drafts moved with the rows: their costs cannot be told apart
        else:
            beta = (rr * dt - rd * rt) / det
        return beta if beta > 0 else None

    def rate(self, batch: int) -> float | None:
        """Committed tokens per second of the recent rounds at this batch's bucket."""
        s = self._sums.get(bucket(batch))
        return None if s is None or s[0] < self.min_rounds or s[4] <= 0 else s[1] / s[4]

    def min_accept(self, batch: int) -> float:
        """The chance of acceptance a draft token needs at this batch to pay for its verification (0: not known)."""
        beta, rate = self.marginal(batch), self.rate(batch)
        if beta is None or rate is None:
            return 0.0
        return min(self.cap, beta * rate)

    def snapshot(self) -> dict[str, dict[str, float | None]]:
        """Per bucket: the marginal seconds of a draft token, the committed tokens per second and the threshold."""
        return {
            str(b): {"draft_token_s": self.marginal(b), "tokens_per_s": self.rate(b), "min_accept": self.min_accept(b)}
            for b in sorted(dict(self._sums))
        }
