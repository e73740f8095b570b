"""The K tuner's side of a scheduler round: a new row's K controller (its prior the tuner's acceptance), the arm
a round runs, and what the tuner learns from the round.

The tuner (engine/runtime/k_tuner.py) knows arms, round times and acceptances, not sequences; this module reads
those from the round's sequences. A row is tuned when its K is the tuner's (``k_caps.tunable``): greedy rows,
sampled rows without a seed, and seeded ones where sampled rows draw one uniform per position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from engine.runtime.draft_cost import DraftCost
from engine.runtime.k_tuner import Arm, KTuner, RowYield
from engine.spec_decode.adaptive import Acceptance, Costs, KController, KPolicy
from engine.spec_decode.k_caps import KCaps, tunable, tunable_params
from engine.spec_decode.sampling import SamplingParams
from engine.spec_decode.seq import Seq


def round_arm(tuner: KTuner | None, seqs: Sequence[Seq], position_noise: bool) -> Arm | None:
    """The round's arm from the tuner for the rows it may set (None: no tuner, or no such row; ``position_noise``:
    ``k_caps.tunable``'s). A row it may not set drafts as configured (its draws depend on its draft's shape): with
    one in the batch, a tree-capable drafter drafts trees for every row this round (``KTuner.record`` files it
    under the arm that ran)."""
    rows = [s for s in seqs if s.k_ctl is not None and tunable(s, position_noise)]
    if tuner is None or not rows:
        return None
    arm = tuner.choose(len(seqs), [s.k_ctl.split for s in rows])
    return Arm(arm.k, True) if len(rows) < len(seqs) else arm


def round_caps(arm: Arm | None, cost: DraftCost | None, batch: int, k_cap: int) -> KCaps:
    """The round's caps: the load window's K cap, and where the tuner chose ``arm``, its K and shape and the
    acceptance a draft token needs at this batch (engine/runtime/draft_cost.py; ``cost`` None: no cut)."""
    if arm is None:
        return KCaps(all=k_cap)
    return KCaps(all=k_cap, tuned=arm.k, tree=arm.tree, min_accept=0.0 if cost is None else cost.min_accept(batch))


def controller(
    policy: KPolicy | None,
    tuner: KTuner | None,
    params: SamplingParams,
    position_noise: bool,
    costs: Callable[[], Costs | None],
) -> KController | None:
    """A new sequence's K controller (None: plain decoding). A row whose K is the tuner's starts from the tuner's
    acceptance as its prior; ``costs`` is called only for the cost-model policy (it may measure them, once)."""
    if policy is None:
        return None
    if tuner is not None and tunable_params(params, position_noise):
        prior = tuner.acceptance()
        policy = policy if prior is None else replace(policy, prior_a=prior.rest, prior_first=prior.first)
    return KController(policy, costs() if policy.name == "cost-model" else None)


@dataclass(frozen=True)
class TunedRows:
    """The tuned rows of a round at ``arm`` that may draft its full K (not cut short by what remains to generate),
    by id, with their acceptance and drafts so far before the round: the tokens they commit (those that do not end
    this round) and whether they drafted are what the tuner learns its acceptance, its share of rows that draft,
    and a tree's yield, from."""

    arm: Arm
    before: dict[int, tuple[Acceptance, int]]
    drafted: int  # every row's drafts verified so far, before the round

    @classmethod
    def of(cls, seqs: Sequence[Seq], arm: Arm, position_noise: bool) -> TunedRows:
        """Read before the round runs (``position_noise``: ``k_caps.tunable``'s)."""
        return cls(
            arm,
            {
                id(s): (s.k_ctl.split, s.stats.drafted)
                for s in seqs
                if s.k_ctl is not None
                and tunable(s, position_noise)
                and s.generated
                and s.params.max_new_tokens - len(s.generated) > arm.k
            },
            drafted(seqs),
        )

    def yields(self, events: Sequence[tuple[Seq, list[int]]]) -> list[RowYield]:
        """After the round: each such row that did not end, its tokens committed, whether it drafted and how many."""
        out = []
        for s, new in events:
            if id(s) in self.before and not s.finished:
                acc, before = self.before[id(s)]
                out.append(RowYield(acc, len(new), s.stats.drafted > before, s.stats.drafted - before))
        return out

    def teach(
        self, tuner: KTuner, cost: DraftCost, seqs: Sequence[Seq], events: Sequence[tuple[Seq, list[int]]], secs: float
    ) -> None:
        """After a measured round over ``seqs``: the tuner its time and the rows' yields, the draft cost its
        verified tokens (a token per row plus the drafts), committed tokens and time."""
        tuner.record(len(seqs), self.arm, secs, self.yields(events))
        verified = len(seqs) + drafted(seqs) - self.drafted
        cost.record(verified, sum(len(t) for _, t in events), secs, len(seqs))


def drafted(seqs: Sequence[Seq]) -> int:
    """The draft tokens the sequences have had verified so far (a round's: the difference across it)."""
    return sum(s.stats.drafted for s in seqs)
