"""The caps the serving layer puts on a round's K, and which rows it may tune."""

from __future__ import annotations

from dataclasses import dataclass

from engine.spec_decode.sampling import SamplingParams
from engine.spec_decode.seq import Seq

NO_CAP = 1 << 30  # a K cap that caps nothing


@dataclass(frozen=True)
class KCaps:
    """Caps on this round's K and its draft shape, set by the serving layer."""

    all: int = NO_CAP
    """The K of every row but seeded sampled ones whose draws depend on their K (``tunable``; the load window lowers
    it under GPU memory pressure): capping those would make their tokens depend on the load."""
    tuned: int | None = None
    """The round's K from measured rounds (engine/runtime/k_tuner.py; 0: a plain round) for every ``tunable`` row, in
    place of each row's own controller K; None: each row's own."""
    tree: bool = True
    """Whether a drafter configured for trees (``tree_branches`` > 1) drafts trees this round; False: chains (the
    tuner measured chains faster at this batch). The serving layer keeps it True while a row that is not ``tunable``
    runs: its draws depend on its draft's shape."""
    min_accept: float = 0.0
    """The chance of acceptance a draft token must have to be drafted (``DraftBatch.min_accept``; 0: no cut), from
    the running batch's measured rounds (engine/runtime/draft_cost.py)."""


def tunable(s: Seq, position_noise: bool) -> bool:
    """Whether the serving layer may set this row's K and draft shape: any but a seeded sampled row whose K decides
    its draws (its tokens must not depend on the batch or the load). ``position_noise``: the round's sampled rows
    draw one uniform per position (engine/spec_decode/randomness.py), so no row's tokens depend on its K."""
    return tunable_params(s.params, position_noise)


def tunable_params(p: SamplingParams, position_noise: bool) -> bool:
    """``tunable`` of a row with these sampling parameters."""
    return p.greedy or p.seed is None or position_noise
