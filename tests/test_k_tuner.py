"""The K tuner on synthetic round times: it finds the best K per batch bucket, turns speculation off where plain
rounds win, and back on when the load drops."""

from __future__ import annotations

from collections import Counter

import pytest

from engine.runtime.k_tuner import PLAIN, Arm, KTuner, RowYield, bucket
from engine.runtime.tuned_rounds import controller
from engine.spec_decode.adaptive import Acceptance, Costs, KPolicy, chain_tokens, expected_tokens
from engine.spec_decode.sampling import SamplingParams

flat = Acceptance.flat


def round_time(batch: int, k: int, fixed: float = 1.0, per_token: float = 0.02, knee: int = 16) -> float:
    """A round's seconds: a fixed cost plus tokens beyond a knee (compute-bound past ``knee`` tokens)."""
    tokens = batch * (k + 1)
    return fixed + per_token * max(0, tokens - knee) + 0.01 * k  # a draft step costs 1% of a round


def true_best(batch: int, a: float, k_max: int, **kw: float) -> int:
    rates = {k: batch * expected_tokens(a, k) / round_time(batch, k, **kw) for k in range(k_max + 1)}
    return max(rates, key=lambda k: (rates[k], -k))


def run(tuner: KTuner, batch: int, a: float, rounds: int, **kw: float) -> Counter[int]:
    """The K chosen in the last half of ``rounds`` rounds at this batch (chains only)."""
    seen: Counter[int] = Counter()
    for i in range(rounds):
        arm = tuner.choose(batch, [flat(a)] * batch)
        assert not arm.tree
        tuner.record(batch, arm, round_time(batch, arm.k, **kw))
        if i >= rounds // 2:
            seen[arm.k] += 1
    return seen


@pytest.mark.parametrize("batch, a", [(1, 0.8), (4, 0.7), (8, 0.6), (32, 0.7), (64, 0.5)])
def test_it_converges_to_the_best_k_of_each_bucket(batch, a):
    tuner = KTuner(k_max=8, k_start=5)
    seen = run(tuner, batch, a, 200)
    want = true_best(batch, a, 8)
    assert seen.most_common(1)[0][0] == want
    assert seen[want] >= 0.8 * sum(seen.values())  # exploration stays bounded


def test_buckets_are_tuned_apart():
    tuner = KTuner(k_max=8, k_start=5)
    for _ in range(3):  # interleaved, as a server's batch changes
        run(tuner, 1, 0.8, 60)
        run(tuner, 64, 0.5, 60)
    assert tuner.choose(1, [flat(0.8)]).k == true_best(1, 0.8, 8) > 0
    assert tuner.choose(64, [flat(0.5)] * 64) == PLAIN and true_best(64, 0.5, 8) == 0
    snap = tuner.snapshot()
    assert snap[str(bucket(64))]["k"] == 0 and snap["1"]["k"] == true_best(1, 0.8, 8)


def test_speculation_turns_off_under_load_and_back_on_when_it_drops():
    tuner = KTuner(k_max=8, k_start=5)
    quiet = dict(fixed=1.0, per_token=0.02, knee=64)  # memory-bound: verifying K+1 tokens is nearly free
    busy = dict(fixed=1.0, per_token=0.5, knee=8)  # compute-bound (other work on the device): every token costs
    assert true_best(8, 0.6, 8, **quiet) > 0 and true_best(8, 0.6, 8, **busy) == 0
    assert run(tuner, 8, 0.6, 120, **quiet).most_common(1)[0][0] == true_best(8, 0.6, 8, **quiet)
    assert run(tuner, 8, 0.6, 200, **busy).most_common(1)[0][0] == 0
    assert run(tuner, 8, 0.6, 300, **quiet).most_common(1)[0][0] == true_best(8, 0.6, 8, **quiet)


def copy_round(tuner: KTuner, batch: int, a: float, matched: float, **kw: float) -> Arm:
    """A round of a copy drafter: a share ``matched`` of the rows finds a match (and drafts K with per-token
    acceptance a, committing its expectation), the rest draft nothing and commit one token; the rows'
    acceptance (what their controllers learn: rounds they drafted) is a. The round runs padded: its time
    follows the arm's K for every row."""
    arm = tuner.choose(batch, [flat(a)] * batch)
    drafting = round(batch * matched)
    rows = [RowYield(flat(a), expected_tokens(a, arm.k))] * drafting + [RowYield(flat(a), 1.0, False)] * (
        batch - drafting
    )
    tuner.record(batch, arm, round_time(batch, arm.k, **kw), rows)
    return arm


def test_rows_without_a_draft_count_one_token():
    """Rows whose acceptance is high when they draft but that find a match in one round of four: K from their
    acceptance alone would win over plain rounds, what the rounds commit loses; the tuner, counting the share of
    rows that draft, runs plain rounds. Where every row finds its match, the same acceptance makes speculation
    win. The acceptance it starts new rows at counts only the rows that drafted."""
    kw = dict(fixed=1.0, per_token=0.05, knee=8)

    def rate(k: int, matched: float) -> float:
        return (8 * matched * expected_tokens(0.8, k) + 8 * (1 - matched)) / round_time(8, k, **kw)

    assert max(range(9), key=lambda k: rate(k, 0.25)) == 0 < max(range(9), key=lambda k: rate(k, 1.0))
    assert true_best(8, 0.8, 8, **kw) > 0  # what the acceptance alone predicts
    for matched, spec in ((0.25, False), (1.0, True)):
        tuner = KTuner(k_max=8, k_start=4)
        arms = Counter(copy_round(tuner, 8, 0.8, matched, **kw).k for _ in range(200))
        assert (max(arms, key=arms.__getitem__) > 0) == spec, arms
        if not spec:
            assert arms[0] >= 0.8 * 200, arms  # exploration stays bounded
        assert tuner.drafting() == pytest.approx(matched, abs=0.01)
    tuner = KTuner(k_max=4, k_start=2, trees=True)  # two rows accept both drafts, six draft nothing
    tuner.record(8, Arm(2), 1.0, [RowYield(flat(0.8), 3)] * 2 + [RowYield(flat(0.8), 1, False)] * 6)
    assert tuner.acceptance() == (1.0, 1.0) and tuner.drafting() == 0.25
    for _ in range(tuner.warmup):  # a tree committing what its rows' acceptance predicts: calibration 1
        tuner.record(8, Arm(3, True), 2.0, [RowYield(flat(0.8), expected_tokens(0.8, 3))] * 8)
    # the share of rows that draft prices chains; a tree's calibration counts its rows without a draft itself
    assert tuner.rate(8, [flat(0.8)] * 8, Arm(3, True)) == pytest.approx(8 * expected_tokens(0.8, 3) / 2.0)


def test_a_chain_is_priced_by_the_drafts_its_rows_verify():
    """Rows cut to two drafts whatever the arm's K (a copy drafter's cut, engine/runtime/draft_cost.py): a round's
    time grows by a draft step per K, its tokens stop at two drafts. Priced at the arm's K, a long K would look
    best; priced by the drafts verified (``reach``), K = 2 is, and the rate at K equals what its rows commit."""
    a, cut = 0.8, 2

    def secs(k: int) -> float:
        return 1.0 + 0.02 * k

    tuner = KTuner(k_max=8, k_start=6)
    seen: Counter[int] = Counter()
    for i in range(300):
        arm = tuner.choose(4, [flat(a)] * 4)
        drafts = min(arm.k, cut)
        tuner.record(4, arm, secs(arm.k), [RowYield(flat(a), expected_tokens(a, drafts), arm.k > 0, drafts)] * 4)
        seen[arm.k] += i >= 150
    assert seen.most_common(1)[0][0] == cut and seen[cut] >= 0.8 * 150, seen
    assert tuner.reach(4, Arm(3)) == pytest.approx((expected_tokens(a, 2) - 1) / (expected_tokens(a, 3) - 1))
    assert tuner.rate(4, [flat(a)] * 4, Arm(3)) == pytest.approx(4 * expected_tokens(a, 2) / secs(3))
    assert tuner.reach(4, Arm(2)) == pytest.approx(1.0)


@pytest.mark.parametrize("gain, spec", [(1.02, False), (1.2, True)])
def test_a_drafting_arm_within_the_margin_of_plain_runs_plain_rounds(gain, spec):
    """K = 1 commits ``gain`` times plain's tokens per second (every other K far less): within the 5% margin plain
    rounds run (K = 1 measured again every ``explore`` rounds), beyond it K = 1 runs."""
    a = 0.5
    times = {0: 1.0, 1: expected_tokens(a, 1) / gain}
    tuner = KTuner(k_max=4, k_start=1)
    seen: Counter[int] = Counter()
    for i in range(300):
        arm = tuner.choose(4, [flat(a)] * 4)
        tuner.record(4, arm, times.get(arm.k, 10.0))
        seen[arm.k] += i >= 150
    assert (seen[1] > seen[0]) == spec, seen
    assert seen[0 if not spec else 1] >= 0.8 * 150, seen


def test_rows_are_priced_by_their_first_and_later_drafts():
    """A copy drafter's rows: the first draft right 40% of the time, each later one 90% after a right one. A round
    costs 1 + 0.45 K: every K loses to plain rounds (K = 1: 1.4 tokens for 1.45). Given the rows' split acceptance
    the tuner runs plain rounds; given the pooled per-token acceptance of the same drafts (0.66: what one EMA learns
    from rounds of K = 4) it would take K = 1, predicting 1.66 tokens."""
    split = Acceptance(0.4, 0.9)
    assert max(range(5), key=lambda k: chain_tokens(split, k) / (1 + 0.45 * k)) == 0
    for acc, plain in ((split, True), (flat(0.66), False)):
        tuner = KTuner(k_max=4, k_start=4)
        seen: Counter[int] = Counter()
        for i in range(300):
            arm = tuner.choose(4, [acc] * 4)
            tuner.record(4, arm, 1 + 0.45 * arm.k, [RowYield(acc, chain_tokens(split, arm.k))] * 4)
            seen[arm.k] += i >= 150
        assert (seen.most_common(1)[0][0] == 0) == plain, seen


def test_the_choice_depends_only_on_the_past():
    """Two tuners fed the same history choose the same K (no randomness, nothing of the round itself)."""
    a, b = KTuner(k_max=6, k_start=3), KTuner(k_max=6, k_start=3)
    for i in range(50):
        acc = [flat(0.5 + 0.01 * (i % 7))] * 4
        ka, kb = a.choose(4, acc), b.choose(4, acc)
        assert ka == kb
        a.record(4, ka, round_time(4, ka.k))
        b.record(4, kb, round_time(4, kb.k))


def test_its_acceptance_is_what_the_rows_of_chain_rounds_accepted():
    """Per row of a chain round of K = 2: one accepts 1 draft, one none, one both: the first draft accepted by 2
    of 3 rows; after an accepted first, the second accepted by 1 of 2 (a success and a failure). Plain and tree
    rounds tell it nothing."""
    tuner = KTuner(k_max=4, k_start=2, trees=True)
    assert tuner.acceptance() is None
    tuner.record(3, PLAIN, 1.0, [RowYield(flat(0.9), 1)] * 3)
    tuner.record(3, Arm(3, True), 1.0, [RowYield(flat(0.9), 4)] * 3)
    assert tuner.acceptance() is None
    for _ in range(20):
        tuner.record(3, Arm(2), 1.0, [RowYield(flat(0.9), 2), RowYield(flat(0.9), 1), RowYield(flat(0.9), 3)])
    assert tuner.acceptance() == pytest.approx((2 / 3, 1 / 2))


def test_a_new_tuned_row_starts_from_the_tuners_acceptance():
    """A row whose K is the tuner's (greedy; seeded sampling only with position noise) starts from the acceptance
    the tuner measured; another keeps the policy's prior. Costs are asked for by the cost-model policy alone."""
    tuner, policy, asked = KTuner(k_max=4, k_start=2), KPolicy(prior_a=0.7), []
    for _ in range(20):
        tuner.record(2, Arm(2), 1.0, [RowYield(flat(0.9), 3), RowYield(flat(0.9), 1)])
    costs = lambda: asked.append(1) or Costs(c=0.1, v={1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4})
    greedy, seeded = SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3)
    assert controller(policy, tuner, greedy, False, costs).split == pytest.approx((0.5, 1.0))
    assert controller(policy, tuner, seeded, True, costs).split == pytest.approx((0.5, 1.0))
    assert controller(policy, tuner, seeded, False, costs).split == pytest.approx((0.7, 0.7))
    assert controller(policy, None, greedy, False, costs).split == pytest.approx((0.7, 0.7))
    assert controller(None, tuner, greedy, False, costs) is None and not asked
    assert controller(KPolicy(name="cost-model"), None, greedy, False, costs).k >= 1 and asked == [1]


# ---------------------------------------------------------------- trees beside chains
def tree_tokens(a: float, k: int) -> float:
    """Tokens a row commits per round with a tree of k nodes: two candidates per depth (a depth is accepted with
    probability 1 - (1 - a)^2), k / 2 deep (smoothly: the search is a neighbour search, for unimodal curves)."""
    return expected_tokens(1 - (1 - a) ** 2, k / 2)


def tree_time(batch: int, k: int, mask: float, **kw: float) -> float:
    return round_time(batch, k, **kw) + mask  # a tree's verify also builds and reads its attention mask


def arm_rates(batch: int, a: float, k_max: int, mask: float, **kw: float) -> dict[Arm, float]:
    rates = {Arm(k): batch * expected_tokens(a, k) / round_time(batch, k, **kw) for k in range(k_max + 1)}
    for k in range(2, k_max + 1):
        rates[Arm(k, True)] = batch * tree_tokens(a, k) / tree_time(batch, k, mask, **kw)
    return rates


def best_arm(batch: int, a: float, k_max: int, mask: float, **kw: float) -> Arm:
    rates = arm_rates(batch, a, k_max, mask, **kw)
    return max(rates, key=lambda x: rates[x])


def run_arms(tuner: KTuner, batch: int, a: float, rounds: int, mask: float, **kw: float) -> Counter[Arm]:
    """The arms chosen in the last half of ``rounds`` rounds; a tree round reports its rows' committed tokens."""
    seen: Counter[Arm] = Counter()
    for i in range(rounds):
        arm = tuner.choose(batch, [flat(a)] * batch)
        if arm.tree:
            tuner.record(
                batch, arm, tree_time(batch, arm.k, mask, **kw), [RowYield(flat(a), tree_tokens(a, arm.k))] * batch
            )
        else:
            tuner.record(
                batch, arm, round_time(batch, arm.k, **kw), [RowYield(flat(a), expected_tokens(a, arm.k))] * batch
            )
        if i >= rounds // 2:
            seen[arm] += 1
    return seen


@pytest.mark.parametrize(
    "batch, a, mask, want_tree",
    [
        (1, 0.45, 0.02, True),  # a weak drafter: its second candidates pay for the tree
        (4, 0.5, 0.02, True),
        (1, 0.9, 0.02, False),  # a strong drafter goes deeper as a chain than a tree of the same nodes
        (1, 0.45, 2.0, False),  # trees whose verify costs more than they gain
        (32, 0.5, 0.02, False),  # compute-bound: plain rounds win
    ],
)
def test_it_takes_a_tree_only_where_trees_commit_more_per_second(batch, a, mask, want_tree):
    tuner = KTuner(k_max=8, k_start=4, trees=True)
    want = best_arm(batch, a, 8, mask)
    assert want.tree == want_tree
    seen = run_arms(tuner, batch, a, 300, mask)
    rates = arm_rates(batch, a, 8, mask)
    top = seen.most_common(1)[0][0]
    assert top.tree == want_tree and rates[top] >= 0.97 * rates[want]  # the best, or one as good within 3%
    assert tuner.snapshot()[str(bucket(batch))]["tree"] == want_tree
    # the rounds commit at least 96% of the best arm's rate: exploration costs a few percent
    assert sum(rates[arm] * n for arm, n in seen.items()) >= 0.96 * rates[want] * sum(seen.values())


def test_without_trees_it_never_tries_one():
    tuner = KTuner(k_max=6, k_start=3)
    assert all(not arm.tree for arm in tuner.arms()) and all(not a.tree for a in run_arms(tuner, 1, 0.45, 80, 0.0))


# ---------------------------------------------------------------- in the engine
def test_sampling_stays_exact_with_the_tuner_under_concurrent_load(pair8):
    """Unseeded sampled rows take the tuner's K while greedy requests from another thread change the batch: the
    3-token joint is the target's exact one (chi-square), with no zero-probability sequence."""
    import threading

    import numpy as np
    from scipy.stats import chisquare
    from test_sampling_controls import _exact_joint3

    from engine import Engine, SamplingParams
    from engine.api.options import Limits

    eng = Engine.from_pretrained(*pair8, limits=Limits(max_batch=48, max_waiting=10_000))
    assert eng.policy.name == "measured"
    prompt, sp = [1, 2, 3], SamplingParams(max_new_tokens=3, temperature=1.0)
    exact = _exact_joint3(eng, prompt, sp)
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            eng.submit([1 + i % 7, 2], SamplingParams(max_new_tokens=4 + i % 9)).result(timeout=60)
            i += 1

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    counts, V = np.zeros(8**3), 8
    try:
        for _ in range(8):
            for r in eng.submit_many([prompt] * 1500, [sp] * 1500):
                a, b, c = r.result(timeout=300).token_ids
                counts[(a * V + b) * V + c] += 1
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert counts[exact == 0].sum() == 0
    e = exact * counts.sum()
    keep = e >= 5
    obs, exp = np.append(counts[keep], counts[~keep].sum()), np.append(e[keep], e[~keep].sum())
    ok = exp > 0
    assert chisquare(obs[ok], exp[ok] * obs[ok].sum() / exp[ok].sum()).pvalue > 1e-4
    st = eng.stats()
    assert st["drafted"] > 0 and len(st["k_tuner"]) >= 2  # it ran at several batch buckets


def test_the_tuner_and_the_accepted_length_histogram_in_the_metrics(ckpt_dir, draft_dir):
    from engine import Engine, SamplingParams

    eng = Engine.from_pretrained(ckpt_dir, draft_dir)
    eng.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]], SamplingParams(max_new_tokens=30))
    text = eng.metrics_text()
    bins = {
        line.split('accepted="')[1].split('"')[0]: int(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("specmix:spec_decode_rounds_by_accepted_length_total{")
    }
    name = "specmix:spec_decode_num_drafts_total "
    drafts = int(next(ln for ln in text.splitlines() if ln.startswith(name)).split()[1])
    assert bins and sum(bins.values()) == drafts  # every round with drafts, binned by what it accepted
    assert sum(int(a) * n for a, n in bins.items()) == eng.stats()["accepted"]
    assert "specmix:spec_decode_tuned_k{" in text
    trees = [ln for ln in text.splitlines() if ln.startswith("specmix:spec_decode_tuned_tree{batch_bucket=")]
    assert trees and all(ln.endswith("} 0") for ln in trees)  # chains (no tree_branches), at every tuned bucket
    tuned = eng.stats()["k_tuner"]
    assert all(0 <= (v["k"] or 0) <= eng.policy.k_max for v in tuned.values())
