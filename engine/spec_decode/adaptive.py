"""Choosing K, the number of drafted tokens per round, per sequence.

Policies:
- ``measured`` (default): the serving layer sets each round's K from measured round times
  (engine/runtime/k_tuner.py); a row it does not set (a seeded sampled row of a drafter that samples) moves its K
  as ``heuristic``.
- ``constant``: K never changes.
- ``heuristic``: K + 2 after a full acceptance, K - 1 otherwise, within [k_min, k_max].
- ``cost-model``: K maximising the expected speedup
      (1 - a^(K+1)) / ((1 - a) (K c + v(K)))
  from the running acceptance rate a and the measured cost ratios c (draft step /
  target step) and v(K) (verify pass of K+1 tokens / target step).

The costs are measured at one sequence with bare forward passes; they give a profile's calibration and
predicted speedup, while ``measured`` times the rounds themselves.

The acceptance rate is estimated per sequence from censored geometric
observations: a round that drafted K_b and accepted n saw n successes and, if
n < K_b, one failure. Successes and trials are exponentially decayed, so a is
an EMA of the per-token acceptance probability.

The same observations split at the first draft give ``Acceptance``: the first draft's acceptance and a later
draft's given the drafts before it were accepted. A copy drafter's drafts are not i.i.d.: its first token is
right about half the time, but once one is right the copy usually goes on (SmolLM2 with n-gram lookup: 0.55-0.65
at the first position, 0.75-0.95 at the next ones), so one pooled a overprices short chains and underprices long
ones; ``chain_tokens`` predicts a chain's committed tokens from both. The serving layer's K tuner uses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from engine.core.errors import InvalidConfigError

POLICIES = ("measured", "constant", "heuristic", "cost-model")


@dataclass(frozen=True)
class Costs:
    """Measured cost ratios, relative to one target decode step."""

    c: float  # draft step / target step (a warm step: engine/spec_decode/costs.py)
    # K -> verify(K+1 tokens) / target step, plus any other per-round cost (the round's first, cold draft step)
    v: dict[int, float] = field(default_factory=dict)

    def verify(self, k: int) -> float:
        if k in self.v:
            return self.v[k]
        if not self.v:
            return 1.0
        ks = sorted(self.v)
        if k < ks[0]:
            return self.v[ks[0]]
        if k > ks[-1]:  # extrapolate linearly from the last two points
            if len(ks) == 1:
                return self.v[ks[-1]]
            k1, k2 = ks[-2], ks[-1]
            slope = (self.v[k2] - self.v[k1]) / (k2 - k1)
            return self.v[k2] + slope * (k - k2)
        lo = max(x for x in ks if x <= k)
        hi = min(x for x in ks if x >= k)
        t = (k - lo) / (hi - lo)
        return self.v[lo] * (1 - t) + self.v[hi] * t

    def to_dict(self) -> dict:
        return {"c": self.c, "v": {str(k): x for k, x in sorted(self.v.items())}}

    @classmethod
    def from_dict(cls, d: dict) -> Costs:
        return cls(c=float(d["c"]), v={int(k): float(x) for k, x in d.get("v", {}).items()})


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens per target pass: (1 - a^(K+1)) / (1 - a) (``chain_tokens`` of i.i.d. drafts)."""
    return chain_tokens(Acceptance.flat(a), k)


class Acceptance(NamedTuple):
    """A row's draft acceptance split at the first draft (a chain's drafts are not i.i.d.)."""

    first: float
    """P(the first draft is accepted)."""
    rest: float
    """P(a later draft is accepted | the drafts before it were)."""

    @classmethod
    def flat(cls, a: float) -> Acceptance:
        """i.i.d. drafts accepted with probability a each."""
        return cls(a, a)


def chain_tokens(acc: Acceptance, k: int) -> float:
    """Expected tokens per target pass of a chain of ``k`` drafts: 1 + first (1 - rest^k) / (1 - rest)
    (``expected_tokens`` where first == rest)."""
    if k <= 0:
        return 1.0
    rest = min(max(acc.rest, 0.0), 1.0)
    tail = float(k) if rest >= 1.0 else (1.0 - rest**k) / (1.0 - rest)
    return 1.0 + min(max(acc.first, 0.0), 1.0) * tail


def split_observation(k: int, accepted: float) -> tuple[float, float, float]:
    """A chain round of ``k`` drafts that accepted ``accepted``, split at the first draft: (the first draft's success,
    the later drafts' successes, their trials: those after an accepted first, a failure where one was rejected)."""
    if accepted < 1.0:
        return max(accepted, 0.0), 0.0, 0.0
    return 1.0, accepted - 1.0, accepted - 1.0 + (accepted < k)


def expected_speedup(a: float, k: int, costs: Costs) -> float:
    """Expected speedup over plain decoding with acceptance a, K drafts and the given costs."""
    if k == 0:
        return 1.0 / costs.verify(0) if 0 in costs.v else 1.0
    return expected_tokens(a, k) / (k * costs.c + costs.verify(k))


def best_k(a: float, costs: Costs, k_min: int, k_max: int) -> int:
    """The K in [k_min, k_max] maximising the expected speedup (smallest K on ties)."""
    return max(range(k_min, k_max + 1), key=lambda k: (round(expected_speedup(a, k, costs), 12), -k))


@dataclass(frozen=True)
class KPolicy:
    name: str = "measured"
    k: int = 5  # initial K (and the fixed K of `constant`)
    k_min: int = 1
    k_max: int = 8
    decay: float = 0.8  # weight of the past in the acceptance EMA
    prior_a: float = 0.7  # acceptance assumed before any observation
    prior_weight: float = 2.0  # pseudo-trials behind the prior
    prior_first: float | None = None  # the first draft's acceptance assumed before any observation (None: prior_a)
    trees: bool = False  # the drafter drafts trees (tree_branches > 1): ``measured`` chooses trees or chains per batch
    draft_cut: bool = True  # ``measured``: chains cut per row where a draft token does not pay (SpeculationConfig's)

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise InvalidConfigError(f"k policy={self.name!r} is invalid: allowed {', '.join(POLICIES)}")
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise InvalidConfigError(f"k={self.k!r} is invalid: allowed an int >= 1")
        if not (1 <= self.k_min <= self.k <= self.k_max):
            raise InvalidConfigError(
                f"k bounds are invalid: need 1 <= k_min ({self.k_min}) <= k ({self.k}) <= k_max ({self.k_max})"
            )
        for name, v in (("prior_a", self.prior_a), ("prior_first", self.prior_first)):
            if v is not None and not 0.0 <= v <= 1.0:
                raise InvalidConfigError(f"{name}={v!r} is invalid: allowed 0.0 .. 1.0")
        if not 0.0 <= self.decay < 1.0:
            raise InvalidConfigError(f"decay={self.decay!r} is invalid: allowed 0 <= decay < 1")


class KController:
    """Per-sequence K state; ``update`` after each verified round."""

    def __init__(self, policy: KPolicy, costs: Costs | None = None) -> None:
        if policy.name == "cost-model" and costs is None:
            raise InvalidConfigError("k policy 'cost-model' needs measured costs (c and v)")
        self.policy, self.costs = policy, costs
        self.successes = policy.prior_a * policy.prior_weight
        self.trials = policy.prior_weight
        first = policy.prior_a if policy.prior_first is None else policy.prior_first
        self._first = [first * policy.prior_weight, policy.prior_weight]  # [accepted, rounds] decayed
        self._rest = [policy.prior_a * policy.prior_weight, policy.prior_weight]  # [successes, trials] decayed
        self.k = policy.k
        if policy.name == "cost-model":
            self.k = best_k(self.acceptance, costs, policy.k_min, policy.k_max)  # type: ignore[arg-type]

    @property
    def acceptance(self) -> float:
        return self.successes / self.trials if self.trials > 0 else self.policy.prior_a

    @property
    def split(self) -> Acceptance:
        """The running acceptance split at the first draft (``Acceptance``)."""
        (f, n1), (r, n2) = self._first, self._rest
        return Acceptance(f / n1 if n1 > 0 else self.policy.prior_a, r / n2 if n2 > 0 else self.policy.prior_a)

    def update(self, drafted: int, accepted: int) -> int:
        """Record a round (drafted K_b, accepted n <= K_b) and return the next K."""
        if drafted <= 0:
            return self.k
        p = self.policy
        rejected = 1 if accepted < drafted else 0
        self.successes = p.decay * self.successes + accepted
        self.trials = p.decay * self.trials + accepted + rejected
        first, later, tried = split_observation(drafted, accepted)
        f, r = self._first, self._rest
        f[0], f[1] = p.decay * f[0] + first, p.decay * f[1] + 1
        if tried > 0:
            r[0], r[1] = p.decay * r[0] + later, p.decay * r[1] + tried
        if p.name in ("heuristic", "measured"):
            self.k = min(self.k + 2, p.k_max) if accepted == drafted else max(self.k - 1, p.k_min)
        elif p.name == "cost-model":
            self.k = best_k(min(self.acceptance, 0.999), self.costs, p.k_min, p.k_max)  # type: ignore[arg-type]
        return self.k
