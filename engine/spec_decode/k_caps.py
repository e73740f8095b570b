"""The caps the serving layer puts on a round's K, and which rows it may tune."""

from __future__ import annotations

from dataclasses import dataclass

from engine.spec_decode.seq import Seq

NO_CAP = 1 << 30  # a K cap that caps nothing


@dataclass(frozen=True)
class KCaps:
    """Caps on this round's K, set by the serving layer."""

    all: int = NO_CAP
    """The K of every row but seeded sampled ones (the load window lowers it under GPU memory pressure). A sampled
    row's K decides which random draws it makes: capping a seeded one would make its tokens depend on the load."""
    tuned: int | None = None
    """The round's K from measured rounds (engine/runtime/k_tuner.py; 0: a plain round) for every row but seeded
    sampled ones, in place of each row's own controller K; None: each row's own."""


def tunable(s: Seq) -> bool:
    """Whether the serving layer may set this row's K: any but a seeded sampled row, whose K decides its draws
    (its tokens must not depend on the batch or the load)."""
    return s.params.greedy or s.params.seed is None
