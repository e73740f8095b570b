"""The batch window: whether a round's greedy rows speculate, chosen from measured round throughput.

The K controller's costs are measured at one sequence. At a batch of B sequences a verify pass of
B (K+1) tokens can cost far more than a plain step of B tokens (compute-bound hardware: a CPU, or a
GPU at a large batch), and ragged rows, masks and per-row work add to it, so no cost table measured
apart from the real rounds predicts it well. The window measures the rounds themselves: per batch
bucket (the running batch rounded up to a power of two), the committed tokens per second of round
time for rounds that speculated and for rounds that ran plainly (exponentially decayed sums; a round
that prefills a new sequence is not measured: its prefill costs the same either way). After
``warmup`` rounds each way it runs the faster way and tries the other every ``explore``-th round, so
a change of load or acceptance is seen again.

It applies when two or more sequences run and every one is greedy: a sampled row's K decides which
random draws it makes, and a seed's output must not depend on the rest of the batch. Greedy output
is the same whatever K, plain rounds included.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def bucket(batch: int) -> int:
    """The power of two >= batch."""
    return 1 << max(0, batch - 1).bit_length()


@dataclass
class BatchWindow:
    warmup: int = 3  # rounds measured each way before choosing
    explore: int = 16  # every explore-th round at a bucket runs the way not chosen
    decay: float = 0.9  # weight of the past in the decayed token and time sums
    # (bucket, speculated) -> [decayed tokens, decayed seconds] of the measured rounds
    _seen: dict[tuple[int, bool], list[float]] = field(default_factory=dict)
    _chosen: dict[tuple[int, bool], int] = field(default_factory=dict)  # rounds run each way per bucket

    def rate(self, batch: int, speculate: bool) -> float | None:
        """Measured committed tokens per second at this batch's bucket, one way (None: not measured yet)."""
        s = self._seen.get((bucket(batch), speculate))
        return None if s is None or s[1] <= 0 else s[0] / s[1]

    def choose(self, batch: int) -> bool:
        """Whether this round's greedy rows speculate."""
        b = bucket(batch)
        on_n, off_n = self._chosen.get((b, True), 0), self._chosen.get((b, False), 0)
        if on_n < self.warmup:
            way = True
        elif off_n < self.warmup:
            way = False
        else:
            on, off = self.rate(batch, True), self.rate(batch, False)
            best = on is None or off is None or on >= off  # unmeasured (every round prefilled): speculate
            way = (not best) if (on_n + off_n) % self.explore == self.explore - 1 else best
        self._chosen[(b, way)] = self._chosen.get((b, way), 0) + 1
        return way

    def record(self, batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        """One round's committed tokens and its time."""
        s = self._seen.setdefault((bucket(batch), speculated), [0.0, 0.0])
        s[0] = self.decay * s[0] + tokens
        s[1] = self.decay * s[1] + seconds

    def snapshot(self) -> dict[str, dict[str, float | None]]:
        """Per bucket: the measured tokens/s with and without speculation."""
        out: dict[str, dict[str, float | None]] = {}
        for (b, way), (tokens, seconds) in sorted(dict(self._seen).items()):  # a copy: the worker records
            out.setdefault(str(b), {})["speculative" if way else "plain"] = tokens / seconds if seconds > 0 else None
        return out
