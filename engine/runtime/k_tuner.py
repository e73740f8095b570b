"""K from measured rounds: per batch bucket, the K whose rounds commit the most tokens per second.

A cost table measured apart from the serving rounds (one sequence, bare forward passes) misprices them: a real
round also pays per-round costs that plain rounds pay too, and at a batch of B sequences a verify pass of
B (K+1) tokens can cost far more than B times one token (a CPU, or a GPU at a large batch). The tuner measures
the rounds themselves. Per batch bucket (the running batch rounded up to a power of two) and per K (0: plain
decoding) it keeps a decayed mean of the round's wall time. With each row's running acceptance a (the K
controller's EMA) a round at K is expected to commit sum_rows (1 - a^(K+1)) / (1 - a) tokens, so the round
takes the measured K with the most expected tokens per second.

Exploration is bounded: a K is measured ``warmup`` times before its estimate counts; the start K and K = 0 are
measured first, then the neighbours of the best, and every ``explore``-th round at a bucket runs a neighbour of
the best again so that a change of load or acceptance is seen. An estimate not refreshed for ``stale`` rounds is
dropped, so a K far from today's best is measured afresh when the search reaches it again. Speculation turns
off for a bucket where plain rounds commit more per second, and back on when speculating wins again.

The choice depends only on rounds already run (their times, the rows' past acceptance), never on this round's
draws, so sampling stays exact. It sets the K of greedy rows and of sampled rows without a seed; a seeded
sampled row keeps its own controller's K, which depends on its own history only, so its tokens do not depend
on the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.spec_decode.adaptive import expected_tokens


def bucket(batch: int) -> int:
    """The power of two >= batch."""
    return 1 << max(0, batch - 1).bit_length()


@dataclass
class KTuner:
    """The round's K per batch bucket from measured round times (see the module doc)."""

    k_max: int
    """The largest K tried."""
    k_start: int
    """The K measured first at each bucket (the configured K)."""
    k_min: int = 1
    """The smallest K tried besides 0 (plain rounds)."""
    warmup: int = 2
    """Rounds measured at a K before its estimate counts."""
    explore: int = 12
    """Every explore-th round at a bucket runs a neighbour of the best K."""
    decay: float = 0.85
    """Weight of the past in the decayed round-time means."""
    stale: int = 36
    """A K's estimate not refreshed in this many rounds at its bucket is dropped (measured afresh when needed)."""
    _times: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # (bucket, K) -> [seconds, rounds]
    _at: dict[tuple[int, int], int] = field(default_factory=dict)  # (bucket, K) -> the bucket's round of its last
    _rounds: dict[int, int] = field(default_factory=dict)  # rounds chosen per bucket
    _best: dict[int, int] = field(default_factory=dict)  # the last best K per bucket

    def round_time(self, batch: int, k: int) -> float | None:
        """The decayed mean round time at this batch's bucket and K (None: not measured ``warmup`` times)."""
        s = self._times.get((bucket(batch), k))
        return None if s is None or s[1] < self.warmup * self.decay ** (self.warmup - 1) else s[0] / s[1]

    def rate(self, batch: int, acceptance: Sequence[float], k: int) -> float | None:
        """Expected committed tokens per second of a round of ``batch`` rows at K for the rows it tunes (their
        running acceptances)."""
        t = self.round_time(batch, k)
        if t is None or t <= 0:
            return None
        return sum(expected_tokens(min(a, 0.999), k) for a in acceptance) / t

    def choose(self, batch: int, acceptance: Sequence[float]) -> int:
        """This round's K: ``batch`` rows run, those it tunes have these running acceptances."""
        b = bucket(batch)
        n = self._rounds[b] = self._rounds.get(b, 0) + 1
        for key in [key for key, at in self._at.items() if key[0] == b and n - at > self.stale]:
            del self._times[key], self._at[key]  # the load may have changed since: measure it again when needed
        for k in (self.k_start, 0):
            if self.round_time(batch, k) is None:
                return k
        ks = [0, *range(self.k_min, self.k_max + 1)]
        rates = {k: r for k in ks if (r := self.rate(batch, acceptance, k)) is not None}
        best = max(rates, key=lambda k: (rates[k], -k))
        self._best[b] = best
        i = ks.index(best)
        neighbours = [ks[j] for j in (i + 1, i - 1) if 0 <= j < len(ks)]
        for k in neighbours:
            if k not in rates:
                return k
        if n % self.explore == 0 and neighbours:
            return neighbours[(n // self.explore) % len(neighbours)]
        return best

    def record(self, batch: int, k: int, seconds: float) -> None:
        """One round's wall time at K (a round that prefilled is not recorded: its prefill dominates)."""
        b = bucket(batch)
        s = self._times.setdefault((b, k), [0.0, 0.0])
        s[0] = self.decay * s[0] + seconds
        s[1] = self.decay * s[1] + 1.0
        self._at[(b, k)] = self._rounds.get(b, 0)

    def best_k(self) -> dict[str, int | None]:
        """The best K so far per batch bucket (a copy)."""
        return {str(b): k for b, k in dict(self._best).items()}

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Per bucket: the best K so far and the measured mean round time per K (seconds)."""
        out: dict[str, dict[str, object]] = {}
        for (b, k), (sec, n) in sorted(dict(self._times).items()):  # a copy: the worker records
            entry = out.setdefault(str(b), {"k": self._best.get(b), "round_s": {}})
            times = entry["round_s"]
            assert isinstance(times, dict)
            times[str(k)] = sec / n if n else None
        return out
