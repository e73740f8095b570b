"""K from measured rounds: per batch bucket, the K (and draft shape) whose rounds commit the most tokens per second.

A cost table measured apart from the serving rounds (one sequence, bare forward passes) misprices them: a real round
also pays per-round costs that plain rounds pay too, and at a batch of B sequences a verify pass of B (K+1) tokens
can cost far more than B times one token (a CPU, or a GPU at a large batch). The tuner measures the rounds
themselves. An arm is a K (0: plain decoding) and, where the drafter is configured for trees (``tree_branches`` >
1), whether the round drafts trees of K nodes or chains of K drafts. Per batch bucket (the running batch rounded up
to a power of two) and per arm it keeps a decayed mean of the round's wall time.

Expected tokens per round: for a chain of K, each tuned row's running acceptance (the K controller's EMAs over the
rounds it drafted, split at the first draft: ``Acceptance``, first a1 and later a2) predicts
1 + a1 (1 - a2^K) / (1 - a2) committed tokens where it drafts (``chain_tokens``; a copy drafter's first draft is right
far less often than the ones after a right one, and one pooled a would overprice K = 1), and one where it does not: a
copy drafter's row without a match drafts nothing. The share of tuned rows that draft (``drafting``) is a decayed
estimate over the rows of recent chain rounds, pooled across K, per bucket once the bucket has recorded a few rows (a
copy drafter's matches depend on the text, but the cut of drafts that do not pay, engine/runtime/draft_cost.py,
depends on the batch; 1 for a drafter that always drafts). A drafting row may draft fewer than K (a copy shorter than
K, or cut where its drafts do not pay): per bucket and chain arm, the share of the drafts' expected gain its rows
reached (``reach``: decayed sums of each row's prediction at the drafts it verified and at the arm's K, less the token
every row commits) scales the gain predicted at K, so a long K is priced by the drafts its rows actually verify. For a
tree of K nodes no such closed form holds (it depends on how the drafter spends its nodes): the chain's prediction at
its K is calibrated by what the tree's rounds committed, the ratio of decayed sums of the tokens its tuned rows
committed (rows that could draft the arm's full K and did not end) and of what their acceptances predicted. The ratio
starts at the nearest measured tree's (the chain's prediction as its rows reach it where none is; worth
``yield_prior`` measured rounds, fading by ``decay`` per measurement). The round takes the arm with the most expected
tokens per second; a tree is taken only where its measured rate beats every chain's, so a drafter whose trees do not
pay runs chains.

A new row's acceptance starts from the tuner's: a decayed estimate over the tuned rows of recent chain rounds
(``acceptance``), not from a fixed prior, so that rows admitted while plain rounds run (they learn nothing) do not
predict the drafts an optimistic prior would.

Exploration is bounded: an arm is measured ``warmup`` times before its estimate counts; a new bucket measures the
best arm of the nearest bucket tuned so far (the start K at the first) and K = 0 first (and the other shape at that
K where trees are on), then the neighbours of the best (K +- 1 in the same shape, the other shape at the same K). A
neighbour is measured again so that a change of load or acceptance is seen: at most every ``explore`` rounds at its
bucket, and the worse it measured the more seldom (``explore_cost``: each neighbour costs about 1% of the
throughput). A measurement after a gap weighs more (the past decays per ``explore`` rounds), so a rarely measured
arm follows the load. Other estimates not refreshed for ``stale`` rounds are dropped, and an arm far from today's
best is measured afresh when the search reaches it again. Speculation turns off for a bucket where plain rounds
commit more per second, or less than ``margin`` less, and back on when speculating wins again.

The choice depends only on rounds already run (their times, the rows' past acceptance and commits), never on this
round's draws, so sampling stays exact. It sets the K of greedy rows, of sampled rows without a seed and, with a
drafter of fixed tokens (whose sampled rows draw position noise), of seeded ones; a seeded sampled row of a drafter
that samples keeps its own controller's K, which depends on its own history only, so its tokens do not depend on the
batch (``k_caps.tunable``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.spec_decode.adaptive import Acceptance, chain_tokens, split_observation


def bucket(batch: int) -> int:
    """The power of two >= batch."""
    return 1 << max(0, batch - 1).bit_length()


class Arm(NamedTuple):
    """What a round runs: K drafts per row (tree nodes where ``tree``; 0: a plain round) and the draft shape."""

    k: int
    tree: bool = False


PLAIN = Arm(0)


class RowYield(NamedTuple):
    """A tuned row's share of a round: its running acceptance before the round, the tokens it committed, whether
    it drafted (a copy drafter's row without a match drafts nothing) and how many drafts it verified (None: the
    arm's K; a copy drafter drafts fewer where its match is short, engine/runtime/draft_cost.py)."""

    acceptance: Acceptance
    committed: float
    drafted: bool = True
    drafts: int | None = None


@dataclass
class KTuner:
    """The round's K and draft shape per batch bucket from measured round times (see the module doc)."""

    k_max: int
    """The largest K tried."""
    k_start: int
    """The K measured first at each bucket (the configured K)."""
    k_min: int = 1
    """The smallest K tried besides 0 (plain rounds)."""
    trees: bool = False
    """Whether the drafter can draft trees (``tree_branches`` > 1): tree arms are tried beside chains."""
    yield_prior: float = 8.0
    """A tree's calibration (committed / predicted tokens) starts at its nearest measured tree's, worth this many
    measured rounds and fading by ``decay`` per measurement: a few lucky rounds (accepted lengths vary from 1 to
    K + 1) do not make a tree the best."""
    population_decay: float = 0.95
    """Weight of the past in the tuner's acceptance estimate (``acceptance``) and in its share of rows that draft
    (``drafting``), per recorded chain round."""
    bucket_rows: float = 8.0
    """The (decayed) rows a bucket records before its own share of rows that draft prices it (``drafting``)."""
    warmup: int = 2
    """Rounds measured at an arm before its estimate counts."""
    explore: int = 12
    """A neighbour of the best arm is measured again at most every ``explore`` rounds at its bucket."""
    explore_cost: float = 0.01
    """And at most once in (1 - its rate / the best's) / explore_cost rounds: exploring a neighbour costs about this
    share of the bucket's throughput, so an arm that measured far worse (a tree that does not pay) is seldom rerun."""
    decay: float = 0.85
    """Weight of the past in the decayed means (round times, a tree's tokens per row), per ``explore`` rounds
    since the arm's last measurement (at least once per measurement)."""
    margin: float = 0.05
    """A best arm that drafts runs only where its rate beats plain rounds' by this share; within it plain rounds run
    in its place (and it is measured again every ``explore`` rounds): the two estimates are decayed means of noisy
    rounds, and near a tie the drafting rounds that noise picks cost more than they commit."""
    stale: int = 96
    """An estimate of an arm other than the best and its neighbours not refreshed in this many rounds at its
    bucket is dropped (measured afresh when the search reaches it again)."""
    _times: dict[tuple[int, Arm], list[float]] = field(default_factory=dict)  # -> [seconds, weight, measurements]
    _yield: dict[tuple[int, Arm], list[float]] = field(default_factory=dict)  # trees: [committed, predicted] decayed
    _reach: dict[tuple[int, Arm], list[float]] = field(default_factory=dict)  # chains: [gain at drafts, at K] decayed
    _first: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [accepted, rows] decayed, all buckets
    _rest: list[float] = field(default_factory=lambda: [0.0, 0.0])  # later drafts: [successes, trials] decayed
    _drafting: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [drafted, rows] decayed, all buckets
    _drafting_at: dict[int, list[float]] = field(default_factory=dict)  # the same per bucket
    _at: dict[tuple[int, Arm], int] = field(default_factory=dict)  # (bucket, arm) -> the bucket's round of its last
    _rounds: dict[int, int] = field(default_factory=dict)  # rounds chosen per bucket
    _best: dict[int, Arm] = field(default_factory=dict)  # the last best arm per bucket
    _shapes: dict[tuple[int, bool], tuple[int, float]] = field(default_factory=dict)  # (bucket, tree) -> the
    # bucket's round of the shape's last measurement, its best rate then / the bucket's best

    def round_time(self, batch: int, arm: Arm) -> float | None:
        """The decayed mean round time at this batch's bucket and arm (None: not measured ``warmup`` times)."""
        s = self._times.get((bucket(batch), arm))
        return None if s is None or s[2] < self.warmup else s[0] / s[1]

    def rate(self, batch: int, acceptance: Sequence[Acceptance], arm: Arm) -> float | None:
        """Expected committed tokens per second of a round of ``batch`` rows at ``arm`` for the rows it tunes
        (their running acceptances)."""
        t = self.round_time(batch, arm)
        if t is None or t <= 0:
            return None
        rows = max(1, len(acceptance))
        chain = sum(chain_tokens(a, arm.k) for a in acceptance) / rows  # per row that drafts
        b = bucket(batch)
        if not arm.tree:  # rows without a draft commit one token (a tree's calibration counts them already)
            m = self.drafting(batch)
            return rows * (m * (1.0 + (chain - 1.0) * self.reach(b, arm)) + 1.0 - m) / t
        prior = self._ratio(b, arm)
        if prior is None:  # no tree measured at the bucket: the chain's prediction at its K, as its rows reach it
            prior = (1.0 + (chain - 1.0) * self.reach(b, Arm(arm.k))) / chain
        got = self._yield.get((b, arm), [0.0, 0.0])
        w = self.yield_prior * rows * chain * self.decay ** self._times[(b, arm)][2]  # fades as it is measured
        return rows * chain * (got[0] + w * prior) / (got[1] + w) / t

    def _ratio(self, b: int, arm: Arm) -> float | None:
        """A tree's calibration before its own measurements: that of the nearest tree measured at the bucket (None:
        none is)."""
        near = [(abs(a.k - arm.k), y) for (bb, a), y in self._yield.items() if bb == b and a != arm]
        if not near:
            return None
        y = min(near, key=lambda x: x[0])[1]
        return y[0] / y[1] if y[1] > 0 else 1.0

    def reach(self, b: int, arm: Arm) -> float:
        """The share of a chain arm's expected gain over one token that its drafting rows reached at bucket ``b``
        by the drafts they verified (1 where none is recorded)."""
        got = self._reach.get((b, arm))
        return got[0] / got[1] if got is not None and got[1] > 0 else 1.0

    def acceptance(self) -> Acceptance | None:
        """The acceptance of the tuned rows of recent chain rounds that drafted, split at the first draft (None: none
        recorded yet; a later draft's: the first's until one is recorded)."""
        (f, n1), (r, n2) = self._first, self._rest
        if n1 < 1.0:
            return None
        return Acceptance(f / n1, r / n2 if n2 >= 1.0 else f / n1)

    def drafting(self, batch: int | None = None) -> float:
        """The share of tuned rows of recent chain rounds that drafted (1 before any is recorded): at this batch's
        bucket once it has recorded ``bucket_rows`` rows (a cut that depends on the batch, engine/runtime/
        draft_cost.py, drafts fewer rows at larger ones), else over all buckets."""
        at = self._drafting_at.get(bucket(batch)) if batch is not None else None
        d, n = at if at is not None and at[1] >= self.bucket_rows else self._drafting
        return d / n if n >= 1.0 else 1.0

    def arms(self) -> list[Arm]:
        """Every arm tried: plain, chains of k_min..k_max and, with trees, trees of 2..k_max nodes."""
        chains = [Arm(k) for k in range(self.k_min, self.k_max + 1)]
        return [PLAIN, *chains, *(Arm(k, True) for k in range(max(2, self.k_min), self.k_max + 1) if self.trees)]

    def _neighbours(self, best: Arm) -> list[Arm]:
        """K +- 1 in the same shape, then the other shape at the same K (plain's: the smallest chain)."""
        known = set(self.arms())
        near = [Arm(best.k + 1, best.tree), Arm(best.k - 1, best.tree), Arm(best.k, not best.tree)]
        if best == PLAIN:
            near = [Arm(self.k_min)]
        return [a if a.k > 0 else PLAIN for a in near if a in known or a.k == 0]

    def choose(self, batch: int, acceptance: Sequence[Acceptance]) -> Arm:
        """This round's arm: ``batch`` rows run, those it tunes have these running acceptances."""
        b = bucket(batch)
        n = self._rounds[b] = self._rounds.get(b, 0) + 1
        last = self._best.get(b)
        keep = set() if last is None else {last, *self._neighbours(last)}
        for key in [key for key, at in self._at.items() if key[0] == b and n - at > self.stale and key[1] not in keep]:
            del self._times[key], self._at[key]  # the load may have changed since: measure it again when needed
            self._yield.pop(key, None)
            self._reach.pop(key, None)
        rates = {a: r for a in self.arms() if (r := self.rate(batch, acceptance, a)) is not None}
        if last is None or not rates:  # a new bucket (or one whose estimates all went stale)
            start = self._start(b)
            other = [Arm(start.k, not start.tree)] if self.trees and start.k > 1 else []
            for arm in [start, PLAIN, *other]:
                if arm not in rates:
                    return arm
        best = max(rates, key=lambda a: (rates[a], not a.tree, -a.k))  # ties: chains, then the smaller K
        self._best[b] = best
        self._note_shapes(b, rates, best)
        neighbours = list(dict.fromkeys(self._neighbours(best)))
        for arm in neighbours:  # the other shape at the best's K: when that shape is due (see _shape_due)
            if arm not in rates and (arm.tree == best.tree or arm == PLAIN or self._shape_due(b, n, arm.tree)):
                return arm
        overdue = [(self._lateness(b, n, a, rates, best), a) for a in neighbours if a in rates]
        late, arm = max(overdue, default=(-1.0, best))
        return arm if late >= 0 else self._settle(b, n, best, rates)

    def _settle(self, b: int, n: int, best: Arm, rates: dict[Arm, float]) -> Arm:
        """The best arm, or plain rounds in place of a drafting best within ``margin`` of plain's rate (the best
        measured again every ``explore`` rounds)."""
        plain = rates.get(PLAIN)
        if best == PLAIN or plain is None or rates[best] >= (1.0 + self.margin) * plain:
            return best
        return best if n - self._at[(b, best)] >= self.explore else PLAIN

    def _start(self, b: int) -> Arm:
        """The arm a new bucket measures first: the best of the nearest bucket tuned so far, else the start K."""
        near = sorted(self._best, key=lambda x: (abs(x.bit_length() - b.bit_length()), x))
        return self._best[near[0]] if near else Arm(self.k_start)

    def _lateness(self, b: int, n: int, arm: Arm, rates: dict[Arm, float], best: Arm) -> float:
        """Rounds past a measured neighbour's next measurement (< 0: not due); one of the other shape waits for its
        shape too (``_shape_due``), so neighbouring K of a shape that does not pay share its exploration."""
        late = n - self._at[(b, arm)] - self._interval(rates[arm], rates[best])
        seen = self._shapes.get((b, arm.tree))
        if arm.tree != best.tree and arm != PLAIN and seen is not None:
            late = min(late, n - seen[0] - self._interval(seen[1], 1.0))
        return late

    def _note_shapes(self, b: int, rates: dict[Arm, float], best: Arm) -> None:
        """Per shape: when an arm of it was last measured and how its best rate compared with the best arm's."""
        for tree in (False, True):
            measured = [a for a in rates if a.tree == tree and a != PLAIN]
            if measured and rates[best] > 0:
                at = max(self._at[(b, a)] for a in measured)
                self._shapes[(b, tree)] = (at, max(rates[a] for a in measured) / rates[best])

    def _shape_due(self, b: int, n: int, tree: bool) -> bool:
        """Whether the shape is due another measurement at a K not measured in it: a shape that measured far
        worse at its best K waits as its arms would (``explore_cost``), not once per new K."""
        seen = self._shapes.get((b, tree))
        return seen is None or n - seen[0] >= self._interval(seen[1], 1.0)

    def _interval(self, rate: float, best: float) -> float:
        """Rounds between measurements of a neighbour with this rate (see ``explore_cost``)."""
        return max(self.explore, (1.0 - min(1.0, rate / best)) / self.explore_cost) if best > 0 else self.explore

    def record(self, batch: int, arm: Arm, seconds: float, rows: Sequence[RowYield] = ()) -> None:
        """One round's wall time at ``arm`` and, per tuned row that could draft the arm's full K and did not end, its
        acceptance before the round, the tokens it committed, whether it drafted and how many drafts it verified (a
        chain's observation is censored at those; a round that prefilled is not recorded: its prefill dominates). A
        tree where the drafter drafts none, or of one node or none, is filed under the chain arm of its K: that is
        what ran."""
        arm = Arm(arm.k, arm.tree and self.trees and arm.k > 1)
        b, now = bucket(batch), self._rounds.get(bucket(batch), 0)
        w = self.decay ** max(1.0, (now - self._at.get((b, arm), now)) / self.explore)  # the past's weight
        s = self._times.setdefault((b, arm), [0.0, 0.0, 0])
        s[0], s[1], s[2] = w * s[0] + seconds, w * s[1] + 1.0, s[2] + 1
        self._at[(b, arm)] = now
        if arm == PLAIN or not rows:
            return
        if arm.tree:
            y = self._yield.setdefault((b, arm), [0.0, 0.0])
            y[0] = w * y[0] + sum(r.committed for r in rows)
            y[1] = w * y[1] + sum(chain_tokens(r.acceptance, arm.k) for r in rows)
        else:  # a chain's row that drafted accepted committed - 1 of K: a censored geometric observation
            d = self.population_decay
            for share in (self._drafting, self._drafting_at.setdefault(b, [0.0, 0.0])):
                share[0] = d * share[0] + sum(r.drafted for r in rows)
                share[1] = d * share[1] + len(rows)
            ks = [(r, arm.k if r.drafts is None else max(1, min(r.drafts, arm.k))) for r in rows if r.drafted]
            obs = [split_observation(k, min(max(r.committed - 1.0, 0.0), k)) for r, k in ks]
            reach = self._reach.setdefault((b, arm), [0.0, 0.0])
            reach[0] = w * reach[0] + sum(chain_tokens(r.acceptance, k) - 1.0 for r, k in ks)
            reach[1] = w * reach[1] + sum(chain_tokens(r.acceptance, arm.k) - 1.0 for r, _ in ks)
            first, rest = self._first, self._rest
            first[0], first[1] = d * first[0] + sum(o[0] for o in obs), d * first[1] + len(obs)
            rest[0], rest[1] = d * rest[0] + sum(o[1] for o in obs), d * rest[1] + sum(o[2] for o in obs)

    def best(self) -> dict[str, Arm]:
        """The best arm so far per batch bucket (a copy)."""
        return {str(b): a for b, a in dict(self._best).items()}

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Per bucket: the best K so far, whether it drafts trees, and the measured mean round time per arm
        (seconds; a tree's key is its K with a "t": "4t")."""
        out: dict[str, dict[str, object]] = {}
        for (b, arm), (sec, n, _) in sorted(dict(self._times).items()):  # a copy: the worker records
            best = self._best.get(b)
            entry = out.setdefault(str(b), {"k": best and best.k, "tree": bool(best and best.tree), "round_s": {}})
            times = entry["round_s"]
            assert isinstance(times, dict)
            times[f"{arm.k}t" if arm.tree else str(arm.k)] = sec / n if n else None
        return out
