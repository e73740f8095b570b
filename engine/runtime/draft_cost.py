"""What a draft token must be worth at the running batch: the acceptance below which verifying it costs more than
it commits.

A round verifies N tokens, a token per row plus the rows' drafts, and costs about T = a + u N seconds: each verified
token, a row's or a draft's, is taken to cost about the same (each is a query over its row's cache; on the CPU's
packed verify pass each is a row of the GEMMs). The batch commits R tokens per second. A draft token accepted with
chance q adds q tokens for u seconds: it pays where q / u >= R, so the round's drafts need q >= u R
(``DraftCost.min_accept``).
At batch 1 a round's cost is mostly its fixed part a (the weights read once) and nearly every draft pays; at a
large batch on a CPU the tokens' part dominates and only drafts that are almost surely accepted pay.

Per batch bucket (the running batch rounded up to a power of two, as the K tuner's) the scheduler feeds each
measured round's verified tokens, committed tokens and wall time; u is the least-squares slope of the round time on
the verified tokens and R the committed tokens per second, both from sums decayed by ``decay`` per round. Until a
bucket has ``min_rounds`` (decayed) rounds whose verified tokens varied (``min_spread``), or where the slope is not
positive, it asks nothing of the drafts (0). A drafter that estimates its drafts' acceptance (n-gram: by the length
of its match, engine/spec_decode/drafters/ngram.py) drafts only the tokens that reach it, in its greedy rows. The
threshold depends only on rounds already run, so sampling stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.runtime.k_tuner import bucket


@dataclass
class DraftCost:
    """Per batch bucket: the seconds a verified token adds to a round and the committed tokens per second."""

    decay: float = 0.995
    """Weight of the past per recorded round at the bucket."""
    min_rounds: float = 8.0
    """Decayed rounds a bucket needs before its threshold counts."""
    cap: float = 0.95
    """The threshold at most (a draft that is accepted this surely always pays)."""
    min_spread: float = 0.5
    """The standard deviation of the rounds' verified tokens below which no slope is read (one odd round among
    rounds of the same size would set it)."""
    _sums: dict[int, list[float]] = field(default_factory=dict)  # bucket -> [w, n, t, nn, nt, committed]

    def record(self, verified: int, committed: int, seconds: float, batch: int) -> None:
        """One measured round of ``batch`` rows that verified ``verified`` tokens (a token per row plus the drafts)
        and committed ``committed``."""
        s = self._sums.setdefault(bucket(batch), [0.0] * 6)
        d, n = self.decay, float(verified)
        for i, x in enumerate((1.0, n, seconds, n * n, n * seconds, float(committed))):
            s[i] = d * s[i] + x

    def marginal(self, batch: int) -> float | None:
        """Seconds a verified token adds to a round at this batch's bucket (None: not known yet)."""
        s = self._sums.get(bucket(batch))
        if s is None or s[0] < self.min_rounds:
            return None
        w = s[0]
        var = s[3] / w - (s[1] / w) ** 2
        if var < self.min_spread**2:
            return None  # the verified tokens hardly varied: no slope to read
        slope = (s[4] / w - (s[1] / w) * (s[2] / w)) / var
        return slope if slope > 0 else None

    def rate(self, batch: int) -> float | None:
        """Committed tokens per second of the recent rounds at this batch's bucket."""
        s = self._sums.get(bucket(batch))
        return None if s is None or s[0] < self.min_rounds or s[2] <= 0 else s[5] / s[2]

    def min_accept(self, batch: int) -> float:
        """The chance of acceptance a draft token needs at this batch to pay for its verification (0: not known)."""
        u, rate = self.marginal(batch), self.rate(batch)
        if u is None or rate is None:
            return 0.0
        return min(self.cap, u * rate)

    def snapshot(self) -> dict[str, dict[str, float | None]]:
        """Per bucket: the seconds a verified token adds, the committed tokens per second and the threshold."""
        return {
            str(b): {"token_s": self.marginal(b), "tokens_per_s": self.rate(b), "min_accept": self.min_accept(b)}
            for b in sorted(dict(self._sums))
        }
