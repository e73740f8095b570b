"""How far the KV cache grows before a round: to what the running sequences use, at least doubling what grows.

The scheduler (engine/runtime/scheduler.py) asks before each round: the cache grows, keeping every row (the
drafter's cache with it; ``KVCache.grow``, engine/core/forward.py), to the highest row in use and the longest
sequence's tokens + k_max + 2 positions. A request longer than the cache joins the running batch at once;
growing by doubling bounds a request's growths by log2 of its length, and sizing by use keeps a request that
may run to the end of the context (a chat without ``max_tokens``) to the positions it reached; the cache never
shrinks. A request beyond ``max_seq_len`` (default: the model's context) is refused at submission; when the
memory to grow is not there, the requests that needed it end with ``RequestFailedError``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from engine.spec_decode.loop import DecodeLoop
from engine.spec_decode.seq import Seq

log = logging.getLogger(__name__)

POSITION_STEP = 128  # positions grow in multiples of this


@dataclass(frozen=True)
class CacheUse:
    """What the running sequences need of the cache this round."""

    rows: int
    """The highest row in use + 1."""
    positions: int
    """The longest sequence's tokens + K headroom + the scratch slot."""
    reach: int
    """The positions the longest running request may reach (its prompt + max_new_tokens + the same headroom)."""

    @classmethod
    def of(cls, seqs: Sequence[Seq], k_max: int) -> CacheUse:
        """The running ``seqs``' use, with ``k_max`` drafts of headroom and the scratch slot."""
        extra = k_max + 2
        return cls(
            rows=max(s.row for s in seqs) + 1,
            positions=max(len(s.tokens) for s in seqs) + extra,
            reach=max(len(s.prompt) + s.params.max_new_tokens for s in seqs) + extra,
        )

    def fits(self, size: tuple[int, int]) -> bool:
        """Whether a cache of ``size`` (rows, positions) holds this use."""
        return self.rows <= size[0] and self.positions <= size[1]


def grown_size(have: tuple[int, int], use: CacheUse, max_batch: int) -> tuple[int, int] | None:
    """(rows, positions) the cache of ``have`` (rows, positions; (0, 0) when there is none) grows to, or None when
    it holds ``use`` already. Rows at least double, to a power of two within ``max_batch``; positions at least
    double, within ``use.reach`` rounded up to POSITION_STEP."""
    if use.fits(have):
        return None
    rows, positions = have
    if use.rows > rows:  # a power of two: a batch's CUDA-graph bucket fits (engine/kernels/cudagraphs.py)
        rows = min(max_batch, 1 << (max(use.rows, 2 * rows) - 1).bit_length())
    if use.positions > positions:
        positions = _steps(min(use.reach, max(use.positions, 2 * positions)))
    return rows, positions


def exact_size(have: tuple[int, int], use: CacheUse) -> tuple[int, int]:
    """The least the cache of ``have`` grows to for ``use``: what to try when ``grown_size``'s is not there."""
    return max(have[0], use.rows), max(have[1], _steps(use.positions))


def _steps(positions: int) -> int:
    return -(-positions // POSITION_STEP) * POSITION_STEP


def fit(loop: DecodeLoop, use: CacheUse, max_batch: int) -> tuple[tuple[int, int], str | None]:
    """Grow ``loop``'s caches (``DecodeLoop.ensure_cache``: the drafter's first) for ``use``: to the grown size, else,
    when the memory for it is not there, to the exact size. Returns the (rows, positions) they had, and why neither
    size could be had (None: they hold ``use``)."""
    c = loop.cache
    have = (0, 0) if c is None else (c.max_batch, c.max_seq_len)
    size = grown_size(have, use, max_batch)
    if size is None:
        return have, None
    why = None
    for want in dict.fromkeys([size, exact_size(have, use)]):
        try:
            loop.ensure_cache(*want)
            return have, None
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: the exact size, else the caller fails requests
            log.error("the KV cache could not grow to %d rows x %d positions: %s", *want, e)
            why = f"the KV cache could not grow to {want[0]} rows x {want[1]} positions: {e}"
    return have, why
