"""The acceptance a draft token needs at the running batch (engine/runtime/draft_cost.py) and the n-gram drafter's
chains cut by what its matches have been worth (engine/spec_decode/drafters/ngram.py). Oracles: least squares on
synthetic round times with known coefficients, counts written out by hand, and plain decoding's tokens (greedy, and
seeded sampling) with the cut under concurrent load."""

from __future__ import annotations

import random

import pytest
import torch
from util import PROMPTS

from engine import Engine, SamplingParams
from engine.api.options import SpeculationConfig
from engine.runtime.draft_cost import DraftCost
from engine.runtime.k_tuner import Arm, KTuner, RowYield
from engine.spec_decode.adaptive import Acceptance
from engine.spec_decode.drafter import Committed, DraftBatch
from engine.spec_decode.drafters.ngram import MATCH_CAP, MatchAcceptance, NGramDrafter
from engine.spec_decode.sampling import RowProcessing
from engine.spec_decode.seq import Seq


@pytest.mark.parametrize("rows_vary", [True, False])
def test_it_reads_a_tokens_cost_and_asks_it_times_the_rate(rows_vary: bool) -> None:
    """Round times a + c N (+-2% noise) over N verified tokens (a token per row plus the drafts) at buckets 8 and
    64: c to within 5%, per bucket, whether the rows or only the drafts vary; the threshold is c times the committed
    tokens per second."""
    rng = random.Random(0)
    cost = DraftCost(decay=0.995)
    truth = {8: (0.028, 0.0015), 64: (0.03, 0.0021)}  # a, c
    tokens = {8: 0.0, 64: 0.0}
    seconds = {8: 0.0, 64: 0.0}
    for _ in range(600):
        for top, (a, c) in truth.items():
            b = rng.randint(top // 2 + 1, top) if rows_vary else top
            d = rng.randint(0, 4 * b) if rng.random() < 0.8 else 0
            t = (a + c * (b + d)) * rng.uniform(0.98, 1.02)
            n = b + rng.randint(0, d)
            cost.record(b + d, n, t, b)
            tokens[top] += n
            seconds[top] += t
    for top, (_, c) in truth.items():
        got = cost.marginal(top)
        assert got is not None and got == pytest.approx(c, rel=0.05)
        rate = cost.rate(top)
        assert rate is not None and rate == pytest.approx(tokens[top] / seconds[top], rel=0.1)
        assert cost.min_accept(top) == pytest.approx(min(cost.cap, got * rate))
    assert 0.1 < cost.min_accept(8) < cost.min_accept(64) <= cost.cap
    assert set(cost.snapshot()) == {"8", "64"}


def test_it_asks_nothing_until_it_can_read_a_slope() -> None:
    """Too few rounds, verified tokens that never varied, or a slope that is not positive: no threshold (0)."""
    cost = DraftCost()
    for i in range(6):
        cost.record(4 + 2 * i, 6, 0.02 + 0.001 * i, 4)  # a clean slope of 0.5 ms a token
    assert cost.min_accept(4) == 0.0 and cost.marginal(4) is None  # 6 rounds < min_rounds
    for i in range(6, 12):
        cost.record(4 + 2 * (i % 6), 6, 0.02 + 0.001 * (i % 6), 4)
    assert cost.marginal(4) == pytest.approx(0.0005) and cost.min_accept(4) > 0.0
    flat = DraftCost()
    for _ in range(20):
        flat.record(12, 6, 0.02, 4)
    assert flat.marginal(4) is None and flat.min_accept(4) == 0.0  # the verified tokens never varied
    falling = DraftCost()
    for i in range(40):
        falling.record(4 + i % 5, 6, 0.03 - 0.001 * (i % 5), 4)  # more tokens, shorter rounds: noise, not a cost
    assert falling.min_accept(4) == 0.0
    assert DraftCost().min_accept(1) == 0.0  # a bucket never seen


def test_match_acceptance_counts_chains_by_match_length_and_position() -> None:
    est = MatchAcceptance(positions=4, prior=2.0)
    assert est.estimate(3, 1) == 1.0 and est.length(3, 4, 0.9) == 4  # optimistic before any chain
    est.record(3, drafted=4, accepted=1)
    est.record(3, drafted=4, accepted=3)
    est.record(3, drafted=2, accepted=2)
    est.record(3, drafted=0, accepted=0)  # nothing drafted: nothing learnt
    # position i: (chains whose first i were accepted + prior) / (chains that drafted i + prior)
    assert [est.estimate(3, i) for i in (1, 2, 3, 4)] == pytest.approx([5 / 5, 4 / 5, 3 / 4, 2 / 4])
    assert est.estimate(2, 1) == 1.0  # other match lengths untouched
    assert est.length(3, 4, 0.7) == 3 and est.length(3, 4, 0.78) == 2 and est.length(3, 2, 0.0) == 2
    assert est.length(3, 4, 0.0) == 4  # no threshold: the whole chain
    est.record(MATCH_CAP + 9, drafted=1, accepted=0)  # longer matches share the last cell
    assert est.estimate(MATCH_CAP, 1) == pytest.approx(2 / 3)
    off = MatchAcceptance(prior=4.0, window=500.0)
    for _ in range(40):
        off.record(2, drafted=1, accepted=0)
    assert off.length(2, 4, 0.5) == 0 and off.chains(2, 1) == 40.0
    for _ in range(2000):  # rounds in which the cut kept it off: its evidence fades back toward the prior
        off.age()
    assert off.chains(2, 1) == pytest.approx(40 * (1 - 1 / 500) ** 2000) and off.length(2, 4, 0.5) == 4


def test_the_match_reaches_back_past_the_n_gram() -> None:
    d = NGramDrafter(n_max=3)
    toks = [9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6]  # 1..6 occurred before: a match of 6 through [4, 5, 6]
    assert d.match(toks, 3) == (6, [7, 8, 1])
    assert d.lookup(toks, 3) == [7, 8, 1]
    assert d.match([5, 1, 2, 7, 1, 2], 2) == (2, [7, 1])
    assert d.match([1, 2, 3], 2) == (0, [])
    long = [4] * 40
    assert d.match(long, 2)[0] == MATCH_CAP


def _batch(seqs: list[Seq], k: int, min_accept: float) -> DraftBatch:
    params = [s.params for s in seqs]
    proc = RowProcessing.of(params, torch.device("cpu"), vocab=32)
    return DraftBatch(
        seqs=seqs, rows=None, processing=proc, k=k, ks=[k] * len(seqs), noise=None, vocab=32, scratch_pos=63,
        target_cache=None, device=torch.device("cpu"), min_accept=min_accept,  # type: ignore[arg-type]
    )  # fmt: skip


def test_the_n_gram_drafter_cuts_each_chain_where_its_match_has_not_paid() -> None:
    """Short matches whose chains were rejected draft nothing at a threshold of 0.5, a long one drafts its whole
    chain; at 0 every chain is whole; a verified chain teaches the estimate, a tree's round does not; a sampled row
    is not cut and teaches nothing."""
    d = NGramDrafter()
    for _ in range(20):
        d.acceptance.record(1, drafted=4, accepted=0)
        d.acceptance.record(MATCH_CAP, drafted=4, accepted=4)
    sp = SamplingParams(max_new_tokens=50)
    short = Seq([20, 7, 21, 22, 7], sp, torch.Generator())  # [7] occurred once before: a match of 1
    long = Seq([*range(1, 18), 0, *range(1, 17)], sp, torch.Generator())  # 1..16 occurred before: a match of 16
    cut = d.propose(_batch([short, long], 4, 0.5))
    assert cut.row_counts() == [0, 4] and cut.tokens[1].tolist() == [17, 0, 1, 2]
    assert d.propose(_batch([short, long], 4, 0.0)).row_counts() == [3, 4]
    before = d.acceptance.estimate(1, 1)
    d.commit(short, Committed(len(short.tokens), 0, 4, True, verified=3))
    assert d.acceptance.estimate(1, 1) < before  # its chain of 3, rejected at the first
    both = NGramDrafter(branches=2)
    chain_round = _batch([short], 4, 0.0)
    chain_round.tree = False
    both.propose(chain_round)  # a chain round proposed (and, say, failed before its commit) ...
    both.propose(_batch([short], 4, 0.0))  # ... then a tree round
    both.commit(short, Committed(len(short.tokens), 0, 4, True, verified=3))
    assert both.acceptance.chains(1, 1) == 0.0  # a tree's round: not a chain of this match
    d.propose(_batch([short], 4, 0.0))
    d.commit(short, Committed(len(short.tokens), 1, 4, True, verified=1))  # a grammar cut its chain of 3 to 1
    assert d.acceptance.chains(1, 2) == d.acceptance.chains(1, 1) - 1  # only the verified draft counted
    hot = Seq(short.tokens, SamplingParams(max_new_tokens=50, temperature=0.8), torch.Generator())
    assert d.propose(_batch([short, hot], 4, 0.5)).row_counts() == [0, 3]  # a sampled row drafts its whole copy
    before = d.acceptance.chains(1, 1)
    d.commit(hot, Committed(len(hot.tokens), 0, 4, True, verified=3))
    assert d.acceptance.chains(1, 1) == before  # and teaches the greedy rows' table nothing


def test_the_tuner_learns_a_cut_chain_as_the_drafts_it_verified() -> None:
    """A row that drafted 2 of the arm's 6 and had both accepted is no rejection: the later drafts' successes
    without a failure."""
    tuner = KTuner(k_max=6, k_start=6)
    tuner.record(8, Arm(6), 0.01, [RowYield(Acceptance(0.5, 0.5), 3.0, True, 2)] * 4)
    acc = tuner.acceptance()
    assert acc is not None and acc.first == 1.0 and acc.rest == 1.0


def test_the_tuner_prices_each_bucket_by_its_own_share_of_rows_that_draft() -> None:
    """The cut drafts fewer rows at a large batch than at a small one: a bucket that recorded 8 rows or more is
    priced by its own share, one that recorded fewer by the share over every bucket."""
    tuner = KTuner(k_max=4, k_start=4)
    for _ in range(3):
        tuner.record(16, Arm(4), 0.03, [RowYield(Acceptance(0.9, 0.9), 5.0, True, 4)] * 2
                     + [RowYield(Acceptance(0.9, 0.9), 1.0, False, 0)] * 14)  # fmt: skip
        tuner.record(4, Arm(4), 0.02, [RowYield(Acceptance(0.9, 0.9), 5.0, True, 4)] * 4)
    tuner.record(2, Arm(4), 0.02, [RowYield(Acceptance(0.9, 0.9), 5.0, True, 4)] * 2)
    assert tuner.drafting(16) == pytest.approx(2 / 16, abs=0.01)
    assert tuner.drafting(4) == pytest.approx(1.0)
    pooled = tuner.drafting()
    assert 2 / 16 < pooled < 1.0 and tuner.drafting(2) == pooled  # 2 rows at bucket 2: the pooled share


class _Strict(DraftCost):
    """A threshold fixed high, so that the cut runs in every tuned round."""

    def min_accept(self, batch: int) -> float:
        return 0.6


class _Drafting(KTuner):
    """Chains of 4 every round (a random model's drafts may measure slower than plain rounds)."""

    def choose(self, batch: int, acceptance: object) -> Arm:
        return Arm(4)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_outputs_stay_plain_decodings_with_chains_cut_under_load(ckpt_dir, sampled: bool) -> None:
    """With the cut in every round, beside other requests: greedy rows give plain decoding's tokens, seeded sampled
    rows (beside greedy rows that are cut) plain sampling's for their seeds; the cut ran (some matched rows drafted
    less than their copy)."""
    params = [
        SamplingParams(max_new_tokens=40, temperature=0.9 if sampled else 0.0, seed=i if sampled else None)
        for i in range(4)
    ]
    prompts = [[5 + i, 6, 7, 8, 9] * 5 + [5 + i] for i in range(4)]  # copies to draft, of every match length
    ref = [o.token_ids for o in Engine.from_pretrained(ckpt_dir).generate(prompts, params)]
    eng = Engine.from_pretrained(ckpt_dir, speculation=SpeculationConfig(drafter="ngram", k=4))
    eng.scheduler.draft_cost, eng.scheduler.tuner = _Strict(), _Drafting(k_max=4, k_start=4)
    drafter = eng.drafter
    assert isinstance(drafter, NGramDrafter)
    est = drafter.acceptance
    for m in (1, 2):  # short matches that have not paid: cut
        for _ in range(10):
            est.record(m, drafted=4, accepted=0)
    asked: list[tuple[float, int, int]] = []  # (threshold, drafts kept, copy length) per row and round
    length = est.length

    def spy(m: int, k: int, need: float) -> int:
        n = length(m, k, need)
        asked.append((need, n, k))
        return n

    est.length = spy  # type: ignore[method-assign]
    cut_rows = [[9 + i, 6, 7, 8, 5] * 5 + [9 + i] for i in range(4)] if sampled else []  # greedy, beside
    others = [SamplingParams(max_new_tokens=n, temperature=t) for n, t in ((12, 0.0), (30, 1.0), (7, 0.5))]
    others += [SamplingParams(max_new_tokens=40)] * len(cut_rows)
    reqs = eng.submit_many([*prompts, PROMPTS[1], PROMPTS[2], PROMPTS[3], *cut_rows], [*params, *others])
    assert [r.result(timeout=120).token_ids for r in reqs][:4] == ref
    held = [(n, k) for need, n, k in asked if need > 0 and k > 0]  # greedy rows' copies under the threshold
    assert any(n < k for n, k in held) and any(n == k for n, k in held)  # chains were cut, others drafted whole
    assert eng.stats()["drafted"] > 0


def test_the_switch_is_checked_and_kept_in_profiles() -> None:
    """``draft_cut`` is a bool (a profile's too, refused by name otherwise), off only where it cuts (the n-gram
    drafter, the measured policy); a profile keeps it only when off."""
    from engine.api.profile_sections import Speculation
    from engine.core.errors import InvalidConfigError, ProfileError

    with pytest.raises(InvalidConfigError, match=r"speculation.draft_cut=1 is invalid: allowed True or False"):
        SpeculationConfig(drafter="ngram", draft_cut=1)  # type: ignore[arg-type]
    for drafter, policy in (("model", "measured"), ("ngram", "constant"), (None, "measured")):
        with pytest.raises(InvalidConfigError, match=r"draft_cut=False needs drafter='ngram' and k_policy='measur"):
            SpeculationConfig(drafter=drafter, k_policy=policy, draft_cut=False)
    cfg = SpeculationConfig(drafter="ngram", k_max=8, draft_cut=False)
    assert SpeculationConfig.from_profile(cfg.to_profile()) == cfg
    assert "draft_cut" not in SpeculationConfig(drafter="ngram").to_profile()
    assert Speculation.from_dict(cfg.to_profile(), "p.json").config.draft_cut is False
    assert Speculation.from_dict({**cfg.to_profile(), "draft_cut": None}, "p.json").config.draft_cut is True
    with pytest.raises(ProfileError, match=r"p.json: field speculation.draft_cut='no' is invalid: allowed true or"):
        Speculation.from_dict({**cfg.to_profile(), "draft_cut": "no"}, "p.json")


def test_without_the_cut_no_round_asks_an_acceptance_and_the_figures_are_gauges(ckpt_dir, monkeypatch) -> None:
    """With a threshold of 0.6 at every batch: the default engine asks it of its drafts, ``draft_cut=False`` never
    does (the same tokens). Both keep the per-bucket figures of ``stats()["draft_cost"]``, which are the /metrics
    gauges."""
    monkeypatch.setattr(DraftCost, "min_accept", lambda self, batch: 0.6)
    prompts = [[5 + i, 6, 7, 8, 9] * 5 + [5 + i] for i in range(4)]
    sp = SamplingParams(max_new_tokens=40)
    engines = {
        cut: Engine.from_pretrained(ckpt_dir, speculation=SpeculationConfig(drafter="ngram", k=4, draft_cut=cut))
        for cut in (True, False)
    }
    asked: dict[bool, set[float]] = {True: set(), False: set()}
    for cut, eng in engines.items():
        table = eng.drafter.acceptance  # type: ignore[union-attr]
        length = table.length
        table.length = lambda m, k, need, length=length, seen=asked[cut]: (seen.add(need), length(m, k, need))[1]
    on, off = (engines[c].generate(prompts, sp) for c in (True, False))
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert 0.6 in asked[True] and asked[False] == {0.0}
    for eng in engines.values():
        cost, text = eng.stats()["draft_cost"], eng.metrics_text()
        assert cost
        for b, v in cost.items():
            assert f'specmix:spec_decode_draft_min_accept{{batch_bucket="{b}"}} 0.6' in text
            series = f'specmix:spec_decode_verified_token_seconds{{batch_bucket="{b}"}} '
            assert series + repr(float(v["token_s"] or 0.0)) in text  # 0 until a slope is read
        assert "# TYPE specmix:spec_decode_committed_tokens_per_second gauge" in text
