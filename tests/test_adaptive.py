"""K policies on scripted acceptance sequences, and the cost model's arithmetic."""

from __future__ import annotations

import pytest
import torch

from engine.core.errors import InvalidConfigError
from engine.spec_decode.adaptive import (
    Acceptance,
    Costs,
    KController,
    KPolicy,
    best_k,
    chain_tokens,
    expected_speedup,
    expected_tokens,
)

COSTS = Costs(c=0.05, v={1: 1.0, 2: 1.02, 4: 1.05, 8: 1.2})


def test_expected_tokens_closed_form():
    for a in (0.0, 0.3, 0.8, 0.99):
        for k in (1, 3, 8):
            assert expected_tokens(a, k) == pytest.approx(sum(a**i for i in range(k + 1)))
    assert expected_tokens(1.0, 5) == 6


def test_chain_tokens_by_enumeration():
    """1 + a1 + a1 a2 + ... + a1 a2^(K-1); the flat split is expected_tokens."""
    for first, rest in ((0.0, 0.9), (0.4, 0.9), (0.6, 0.3), (0.5, 1.0)):
        for k in (0, 1, 4):
            want = 1 + sum(first * rest**i for i in range(k))
            assert chain_tokens(Acceptance(first, rest), k) == pytest.approx(want)
    assert chain_tokens(Acceptance.flat(0.7), 5) == pytest.approx(expected_tokens(0.7, 5))


def test_the_split_acceptance_learns_a_copy_drafters_first_and_later_drafts():
    """Rounds of K = 4 whose first draft is right 40% of the time and each later one 90% after a right one (a copy
    drafter's): the controller's split converges to (0.4, 0.9) and predicts what a round of K = 1 commits (1.4);
    the pooled per-token acceptance (about 0.66) would predict 1.66."""
    ctl = KController(KPolicy("measured", k=4, decay=0.995))
    gen = torch.Generator().manual_seed(0)
    for _ in range(4000):
        u = torch.rand(4, generator=gen)
        ok = torch.cat([u[:1] < 0.4, u[1:] < 0.9]).int().cumprod(0)
        ctl.update(4, int(ok.sum()))
    first, rest = ctl.split
    assert first == pytest.approx(0.4, abs=0.05) and rest == pytest.approx(0.9, abs=0.03)
    assert chain_tokens(ctl.split, 1) == pytest.approx(1.4, abs=0.05)
    assert expected_tokens(ctl.acceptance, 1) > 1.6


def test_speedup_formula_and_best_k_by_brute_force():
    for a in (0.2, 0.5, 0.8, 0.95):
        for k in range(1, 9):
            want = (1 - a ** (k + 1)) / ((1 - a) * (k * COSTS.c + COSTS.verify(k)))
            assert expected_speedup(a, k, COSTS) == pytest.approx(want)
        brute = max(range(1, 9), key=lambda k: expected_speedup(a, k, COSTS))
        assert best_k(a, COSTS, 1, 8) == brute
    assert best_k(0.2, COSTS, 1, 8) < best_k(0.95, COSTS, 1, 8)


def test_verify_cost_interpolates_and_extrapolates():
    assert COSTS.verify(3) == pytest.approx((1.02 + 1.05) / 2)
    assert COSTS.verify(6) == pytest.approx(1.05 + (1.2 - 1.05) / 2)
    assert COSTS.verify(10) == pytest.approx(1.2 + (1.2 - 1.05) / 4 * 2)


def test_constant_policy_never_moves():
    ctl = KController(KPolicy("constant", k=4, k_min=1, k_max=8))
    for drafted, acc in [(4, 4), (4, 0), (4, 2), (4, 4)]:
        assert ctl.update(drafted, acc) == 4


def test_heuristic_policy_follows_the_rule():
    ctl = KController(KPolicy("heuristic", k=3, k_min=2, k_max=8))
    script = [
        (3, 3, 5),
        (5, 5, 7),
        (7, 7, 8),
        (8, 8, 8),
        (8, 2, 7),
        (7, 0, 6),
        (6, 1, 5),
        (5, 0, 4),
        (4, 0, 3),
        (3, 0, 2),
        (2, 0, 2),
        (2, 2, 4),
    ]
    for drafted, acc, want in script:
        assert ctl.update(drafted, acc) == want


def test_cost_model_policy_tracks_acceptance():
    ctl = KController(KPolicy("cost-model", k=4, k_min=1, k_max=8, decay=0.8), COSTS)
    for _ in range(30):  # every draft accepted -> acceptance estimate near 1 -> K = k_max
        k = ctl.update(ctl.k, ctl.k)
    assert ctl.acceptance > 0.95 and k == best_k(min(ctl.acceptance, 0.999), COSTS, 1, 8) == 8
    for _ in range(30):  # every first draft rejected -> acceptance near 0 -> K = k_min
        k = ctl.update(ctl.k, 0)
    assert ctl.acceptance < 0.05 and k == 1
    # censored-geometric estimate: successes / (successes + failures), exponentially decayed
    ctl = KController(KPolicy("cost-model", k=4, decay=0.5, prior_a=0.5, prior_weight=2.0), COSTS)
    ctl.update(4, 2)  # 2 successes, 1 failure
    assert ctl.acceptance == pytest.approx((0.5 * 1.0 + 2) / (0.5 * 2.0 + 3))


def test_policy_validation():
    with pytest.raises(InvalidConfigError, match="policy='greedy'"):
        KPolicy("greedy")
    with pytest.raises(InvalidConfigError, match="k_min"):
        KPolicy("heuristic", k=2, k_min=3, k_max=8)
    with pytest.raises(InvalidConfigError, match="needs measured costs"):
        KController(KPolicy("cost-model"))
    with pytest.raises(InvalidConfigError, match="prior_first=1.5"):
        KPolicy(prior_first=1.5)


def test_token_acceptance_counts_tested_positions_only():
    """accepted / trials is the MLE of the per-token acceptance of a geometric run: a round of K drafts
    that accepts n tests min(n + 1, K) positions. accepted / drafted would be biased low."""
    from engine.spec_decode.seq import SeqStats

    st = SeqStats()
    for k, n in [(4, 2), (4, 4), (2, 0), (3, 1)]:
        st.record(k, n)
    d = st.to_dict()
    assert d["draft_trials"] == 3 + 4 + 1 + 2
    assert d["accepted"] == 7 and d["drafted"] == 13
    assert d["draft_trials"] == sum(1 for k, n in [(4, 2), (4, 4), (2, 0), (3, 1)] for _ in range(min(n + 1, k)))
    # with i.i.d. acceptance a, accepted / trials converges to a whatever K is; accepted / drafted does not
    gen = torch.Generator().manual_seed(0)
    st, a = SeqStats(), 0.7
    for _ in range(20000):
        u = torch.rand(6, generator=gen)
        n = int((u < a).int().cumprod(0).sum())
        st.record(6, n)
    d = st.to_dict()
    assert abs(d["accepted"] / d["draft_trials"] - a) < 0.01
    assert d["acceptance_rate"] < a - 0.1


def test_measured_verify_costs_never_fall_with_k(ckpt_dir, draft_dir):
    from engine.core.checkpoint import load_model
    from engine.spec_decode.costs import measure_costs
    from engine.spec_decode.drafters.draft_model import ModelDrafter

    target, draft = (load_model(d, torch.float32, "cpu") for d in (ckpt_dir, draft_dir))
    costs = measure_costs(target, ModelDrafter(draft, draft).cost_step(1), k_max=6, reps=2)
    v = [costs.v[k] for k in range(1, 7)]
    assert all(b >= a for a, b in zip(v, v[1:])), v
    assert costs.c > 0 and v[0] > 0


def test_plain_rounds_of_the_tuner_keep_greedy_and_seeded_output(ckpt_dir, draft_dir):
    """Plain rounds where the K tuner measured them faster (buckets 2 and 4 here): the draft catches up after
    them when the tuner speculates again (alone, at bucket 1), greedy output is the plain target's, and a seeded
    sampled row keeps its own K, so its tokens are those of an engine without the tuner."""
    from engine import Engine, SamplingParams
    from engine.api.options import SpeculationConfig
    from engine.runtime.k_tuner import Arm

    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
    params = [SamplingParams(max_new_tokens=n) for n in (8, 12, 40)]
    params.append(SamplingParams(max_new_tokens=20, temperature=0.9, seed=7))
    ref = [o.token_ids for o in Engine.from_pretrained(ckpt_dir).generate(prompts[:3], params[:3])]
    heur = Engine.from_pretrained(ckpt_dir, draft_dir, speculation=SpeculationConfig(k_policy="heuristic"))
    seeded = heur.generate([prompts[3]], params[3])[0].token_ids
    eng = Engine.from_pretrained(ckpt_dir, draft_dir)
    tuner = eng.scheduler.tuner
    assert eng.policy.name == "measured" and tuner is not None
    for b in (2, 3, 4):  # as if plain rounds had measured 10x faster at buckets 2 and 4
        for k in range(tuner.k_max + 1):
            for _ in range(tuner.warmup):
                tuner.record(b, Arm(k), 1.0 if k == 0 else 10.0)
    out = eng.generate(prompts, params)
    assert [o.token_ids for o in out[:3]] == ref and out[3].token_ids == seeded
    st = eng.stats()
    assert st["plain_rounds"] >= 8 and st["k_tuner"]["4"]["k"] == 0
    assert out[2].stats["drafted"] > 0  # alone, the last one speculated again
