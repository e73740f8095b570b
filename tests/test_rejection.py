"""The speculative acceptance rule: exact enumeration, chi-square, greedy reduction, ragged rows.

Exactness is checked on the function itself: for every draft sequence d the
acceptance probability each position implies is found by bisection over the
uniform it is given, and the distribution the new token is drawn from is read
from ``acceptance`` with uniforms that force each rejection position. Summing
over d ~ p gives the exact law of the emitted tokens, which must equal the
target's (the tokens a call does not emit are completed from the target, as the
next iteration would). ``sample_from_probs`` (the exponential race that turns
that distribution into a token) is checked by chi-square in test_sampling.py,
and the whole of ``rejection_sample`` by chi-square here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from engine.spec_decode.rejection import acceptance, greedy_accept, rejection_sample
from engine.spec_decode.sampling import process_logits

ALPHA = 1e-4


@dataclass
class Scenario:
    """Context-dependent target and draft: q[L][prefix] and p[L][prefix] are [V] rows."""

    V: int
    K: int
    q: list[np.ndarray]  # q[L] has shape [V]*L + [V], L = 0..K
    p: list[np.ndarray] | None  # p[L], L = 0..K-1; None = deterministic drafter
    det: tuple[int, ...] = ()  # the deterministic drafter's proposal (when p is None)


def random_dists(rng: np.random.Generator, shape: tuple[int, ...], V: int, zero_frac: float = 0.25) -> np.ndarray:
    r = rng.random(shape + (V,)) ** 2 + 0.02
    r[rng.random(shape + (V,)) < zero_frac] = 0.0
    empty = r.sum(-1) == 0
    r[empty, 0] = 1.0
    return r / r.sum(-1, keepdims=True)


def random_scenario(seed: int, V: int, K: int, draft: bool = True, equal: bool = False) -> Scenario:
    rng = np.random.default_rng(seed)
    q = [random_dists(rng, (V,) * L, V) for L in range(K + 1)]
    if not draft:  # propose each position's second most likely target token
        det: tuple[int, ...] = ()
        for i in range(K):
            order = np.argsort(q[i][det])
            det += (int(order[-2] if q[i][det][order[-2]] > 0 else order[-1]),)
        return Scenario(V, K, q, None, det)
    p = [q[L].copy() if equal else random_dists(rng, (V,) * L, V) for L in range(K)]
    return Scenario(V, K, q, p)


def hand_scenario() -> Scenario:
    # root: token 0 has p=0<q, token 1 and 4 have q=0<p, token 2 has p==q, token 3 q>p
    V = 5
    q0 = np.array([0.3, 0.0, 0.2, 0.5, 0.0])
    p0 = np.array([0.0, 0.4, 0.2, 0.1, 0.3])
    q1 = random_dists(np.random.default_rng(7), (V,), V)
    return Scenario(V, 1, [q0, q1], [p0])


SCENARIOS = {
    "K1-hand": hand_scenario(),
    "K1-random": random_scenario(1, V=7, K=1),
    "K2-random": random_scenario(2, V=6, K=2),
    "K3-random": random_scenario(3, V=5, K=3),
    "K2-p-equals-q": random_scenario(4, V=5, K=2, equal=True),
    "K2-deterministic": random_scenario(5, V=6, K=2, draft=False),
    "K3-deterministic": random_scenario(6, V=5, K=3, draft=False),
}


def target_suffix(sc: Scenario, prefix: tuple[int, ...]) -> np.ndarray:
    """The target's joint law of the tokens after ``prefix`` up to length K+1."""
    if len(prefix) == sc.K + 1:
        return np.array(1.0)
    row = sc.q[len(prefix)][prefix]
    return np.stack([row[t] * target_suffix(sc, prefix + (t,)) for t in range(sc.V)])


def batch_for(sc: Scenario, seqs: list[tuple[int, ...]]):
    d = torch.tensor(seqs, dtype=torch.int64).reshape(len(seqs), sc.K)
    target = torch.tensor(np.array([[sc.q[i][s[:i]] for i in range(sc.K + 1)] for s in seqs]), dtype=torch.float32)
    draft = None
    if sc.p is not None:
        draft = torch.tensor(np.array([[sc.p[i][s[:i]] for i in range(sc.K)] for s in seqs]), dtype=torch.float32)
    return d, draft, target


def implied_acceptance(d, draft, target, num) -> np.ndarray:
    """P(accept) of every (row, position) as the function decides it, by bisection on u."""
    lo = np.zeros(d.shape)
    hi = np.ones(d.shape)
    for _ in range(40):
        mid = (lo + hi) / 2
        acc = acceptance(d, draft, target, num, torch.tensor(mid, dtype=torch.float32))[0].numpy()
        lo = np.where(acc, mid, lo)
        hi = np.where(acc, hi, mid)
    return hi


def exact_law(sc: Scenario, residual_is_q: bool = False) -> tuple[np.ndarray, dict]:
    """Exact joint law of the (completed) K+1 tokens produced by one call."""
    V, K = sc.V, sc.K
    seqs = [sc.det] if sc.p is None else list(itertools.product(range(V), repeat=K))
    weights = [1.0] if sc.p is None else [np.prod([sc.p[i][s[:i]][s[i]] for i in range(K)]) for s in seqs]
    d, draft, target = batch_for(sc, seqs)
    num = torch.full((len(seqs),), K, dtype=torch.int64)
    acc_prob = implied_acceptance(d, draft, target, num)

    u_below_one = np.nextafter(np.float32(1), np.float32(0))
    dists = []
    for j in range(K + 1):  # uniforms that accept before j and reject at j
        u = torch.zeros(len(seqs), K)
        if j < K:
            u[:, j] = float(u_below_one)
        _, n_acc, dist = acceptance(d, draft, target, num, u)
        dists.append((n_acc.numpy(), dist.double().numpy()))

    law = np.zeros((V,) * (K + 1))
    for s_i, s in enumerate(seqs):
        for j in range(K + 1):
            w = weights[s_i] * np.prod(acc_prob[s_i, :j]) * (1 - acc_prob[s_i, j] if j < K else 1.0)
            n_acc, dist = dists[j][0][s_i], dists[j][1][s_i]
            if n_acc != j:  # this branch could not be forced: it must carry (almost) no mass
                assert w < 1e-6, (s, j, w)
                continue
            r = sc.q[j][s[:j]] if residual_is_q else dist / dist.sum()
            for t in range(V):
                prefix = tuple(s[:j]) + (t,)
                law[prefix] += w * r[t] * target_suffix(sc, prefix)
    return law, {"acc_prob": acc_prob, "seqs": seqs, "draft": draft, "target": target, "d": d}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_exact_law_equals_target(name: str) -> None:
    sc = SCENARIOS[name]
    law, info = exact_law(sc)
    ref = target_suffix(sc, ())
    assert law.sum() == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_allclose(law, ref, atol=1e-6, rtol=0)
    # first-token marginal
    np.testing.assert_allclose(law.reshape(sc.V, -1).sum(-1), sc.q[0], atol=1e-6, rtol=0)

    # the acceptance probability the function implies is min(1, q/p)
    d = info["d"].numpy()
    q_d = np.take_along_axis(info["target"][:, : sc.K].double().numpy(), d[..., None], -1)[..., 0]
    p_d = (
        np.ones_like(q_d)
        if sc.p is None
        else np.take_along_axis(info["draft"].double().numpy(), d[..., None], -1)[..., 0]
    )
    with np.errstate(divide="ignore", invalid="ignore"):
        expect = np.where(p_d > 0, np.minimum(1.0, q_d / p_d), (q_d > 0).astype(float))
    np.testing.assert_allclose(info["acc_prob"], expect, atol=1e-6)

    if name != "K2-p-equals-q":  # the test has power: sampling q instead of the residual breaks losslessness
        broken, _ = exact_law(sc, residual_is_q=True)
        assert np.abs(broken - ref).max() > 1e-3


def test_zero_probability_edge_cases_are_decided_for_every_u() -> None:
    # one row per case, vocab 5, K=1; u sweeps [0, 1)
    q = torch.tensor([0.3, 0.0, 0.2, 0.5, 0.0])
    p = torch.tensor([0.0, 0.4, 0.2, 0.1, 0.3])
    cases = {0: True, 1: False, 2: True, 4: False}  # p=0<q accepts, q=0<p rejects, p==q accepts
    for tok, accepted in cases.items():
        u = torch.linspace(0, 1, 1001)[:-1].unsqueeze(-1)
        n = u.shape[0]
        d = torch.full((n, 1), tok)
        target = torch.stack([q, q]).expand(n, 2, 5)
        noise = torch.empty(n, 5).exponential_(generator=torch.Generator().manual_seed(tok))
        toks, n_acc = rejection_sample(d, p.expand(n, 1, 5), target, torch.ones(n, dtype=torch.long), u, noise)
        assert (n_acc == int(accepted)).all(), tok
        if not accepted:  # the residual max(0, q - p) is supported on tokens 0 and 3 only
            assert set(toks[:, 0].tolist()) <= {0, 3}


# ---------------------------------------------------------------- chi-square


def merged_chisquare(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value; cells expected below 5 are merged; 0 when a forbidden cell occurs."""
    n = counts.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    exp = probs * n
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    ex = np.append(exp[big], exp[~big].sum())
    keep = ex > 0
    return chisquare(obs[keep], ex[keep]).pvalue


def sample_calls(sc: Scenario, B: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B independent calls: drafts d ~ p, then rejection_sample; returns tokens, n_acc, drafts."""
    g = torch.Generator().manual_seed(seed)
    V, K = sc.V, sc.K
    d = torch.zeros(B, K, dtype=torch.int64)
    draft_rows, target_rows = [], []
    for i in range(K + 1):
        idx = tuple(d[:, m] for m in range(i))
        target_rows.append(torch.tensor(sc.q[i], dtype=torch.float32)[idx].expand(B, V))
        if i == K:
            break
        if sc.p is None:
            d[:, i] = sc.det[i]
        else:
            p_i = torch.tensor(sc.p[i], dtype=torch.float32)[idx].expand(B, V)
            draft_rows.append(p_i)
            d[:, i] = torch.multinomial(p_i, 1, generator=g)[:, 0]
    draft = torch.stack(draft_rows, 1) if sc.p is not None else None
    target = torch.stack(target_rows, 1)
    u = torch.rand(B, K, generator=g)
    noise = torch.empty(B, V).exponential_(generator=g)
    tokens, n_acc = rejection_sample(d, draft, target, torch.full((B,), K), u, noise)
    return tokens, n_acc, d


@pytest.mark.parametrize("name", ["K1-hand", "K2-random", "K3-random", "K2-deterministic"])
def test_chi_square_first_token(name: str) -> None:
    sc = SCENARIOS[name]
    tokens, n_acc, d = sample_calls(sc, 100_000, seed=10)
    counts = np.bincount(tokens[:, 0].numpy(), minlength=sc.V)
    assert counts[sc.q[0] == 0].sum() == 0, "a token with target probability 0 was emitted"
    assert merged_chisquare(counts, sc.q[0]) > ALPHA
    # power: the drafts themselves (what "accept everything" would emit) fail the same test
    assert merged_chisquare(np.bincount(d[:, 0].numpy(), minlength=sc.V), sc.q[0]) < ALPHA


@pytest.mark.parametrize("name", ["K2-random", "K3-random"])
def test_chi_square_first_two_tokens(name: str) -> None:
    sc = SCENARIOS[name]
    B, V = 100_000, sc.V
    tokens, n_acc, d = sample_calls(sc, B, seed=11)
    first, second = tokens[:, 0], tokens[:, 1].clone()
    # a call that emitted one token is continued by the target, as the next iteration would
    g = torch.Generator().manual_seed(12)
    short = n_acc == 0
    q1 = torch.tensor(sc.q[1], dtype=torch.float32)
    second[short] = torch.multinomial(q1[first[short]], 1, generator=g)[:, 0]
    pair = (first * V + second).numpy()
    counts = np.bincount(pair, minlength=V * V)
    expected = (sc.q[0][:, None] * sc.q[1]).reshape(-1)
    assert counts[expected == 0].sum() == 0, "a pair with target probability 0 was emitted"
    assert merged_chisquare(counts, expected) > ALPHA
    draft_pair = np.bincount((d[:, 0] * V + d[:, 1]).numpy(), minlength=V * V)
    assert merged_chisquare(draft_pair, expected) < ALPHA


# ---------------------------------------------------------------- greedy, ragged, bonus, ids


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_greedy_reduces_to_argmax_matching(with_draft_probs: bool) -> None:
    g = torch.Generator().manual_seed(20)
    B, K, V = 400, 4, 8
    t_logits = torch.randn(B, K + 1, V, generator=g)
    a = t_logits.argmax(-1)  # [B, K+1]
    # drafts agree with the target's argmax 70% of the time
    d = torch.where(torch.rand(B, K, generator=g) < 0.7, a[:, :K], torch.randint(0, V, (B, K), generator=g))
    d_logits = torch.randn(B, K, V, generator=g) + 20 * torch.nn.functional.one_hot(d, V)
    zeros = lambda n: (torch.zeros(n), torch.zeros(n, dtype=torch.long), torch.ones(n))  # noqa: E731
    q = process_logits(t_logits.reshape(-1, V), *zeros(B * (K + 1))).reshape(B, K + 1, V)
    p = process_logits(d_logits.reshape(-1, V), *zeros(B * K)).reshape(B, K, V) if with_draft_probs else None
    u = torch.rand(B, K, generator=g)
    noise = torch.empty(B, V).exponential_(generator=g)
    tokens, n_acc = rejection_sample(d, p, q, torch.full((B,), K), u, noise)

    mismatch = d != a[:, :K]
    expect_n = torch.where(mismatch.any(-1), mismatch.long().argmax(-1), torch.full((B,), K))
    assert torch.equal(n_acc, expect_n)
    assert 0 < (n_acc == K).sum() < B and (n_acc == 0).sum() > 0
    for b in range(B):
        n = int(n_acc[b])
        assert tokens[b, :n].tolist() == d[b, :n].tolist()
        assert int(tokens[b, n]) == int(a[b, n])


def test_greedy_accept_equals_rejection_sample_on_one_hot_rows() -> None:
    g = torch.Generator().manual_seed(21)
    B, K, V = 500, 5, 6
    t_logits = torch.randn(B, K + 1, V, generator=g)
    a = t_logits.argmax(-1)  # [B, K+1]
    d = torch.where(torch.rand(B, K, generator=g) < 0.6, a[:, :K], torch.randint(0, V, (B, K), generator=g))
    num = torch.randint(0, K + 1, (B,), generator=g)  # ragged, including rows with no drafts
    q = torch.nn.functional.one_hot(a, V).float()
    want_t, want_n = rejection_sample(
        d, None, q, num, torch.rand(B, K, generator=g), torch.empty(B, V).exponential_(generator=g)
    )
    got_t, got_n = greedy_accept(d, a, num)
    assert torch.equal(got_n, want_n) and torch.equal(got_t, want_t)
    assert (got_n == num).any() and (got_n < num).any() and (num == 0).any()
    t0, n0 = greedy_accept(d[:, :0], a[:, :1], torch.zeros(B, dtype=torch.long))  # K = 0: a plain step
    assert torch.equal(t0, a[:, :1]) and not n0.any()


def test_ragged_rows_and_bonus() -> None:
    B, K, V = 6, 3, 7
    g = torch.Generator().manual_seed(30)
    num = torch.tensor([0, 1, 2, 3, 2, 1])
    probs = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1)
    d = torch.multinomial(probs[:, :K].reshape(-1, V), 1, generator=g).reshape(B, K)
    d[0] = torch.tensor([-1, V + 5, 3])  # ignored entries may be garbage
    d[1, 1:] = V + 100
    d[4, 2] = -7
    bonus = torch.tensor([6, 5, 4, 3, 2, 1])
    target = probs.clone()
    rows = torch.arange(B)
    target[rows, num] = torch.nn.functional.one_hot(bonus, V).float()  # the bonus position names the row
    draft = target[:, :K].clone()  # p == q at every draft position: always accepted
    u = torch.rand(B, K, generator=g)
    noise = torch.empty(B, V).exponential_(generator=g)
    tokens, n_acc = rejection_sample(d, draft, target, num, u, noise)
    assert n_acc.tolist() == num.tolist()
    for b in range(B):
        k = int(num[b])
        assert tokens[b, :k].tolist() == d[b, :k].tolist()
        assert int(tokens[b, k]) == int(bonus[b])
        assert (tokens[b, k + 1 :] == 0).all()
    # deterministic drafter, ragged: rejecting row 2's first draft samples from q minus that token
    target2 = target.clone()
    target2[2, 0] = torch.full((V,), 1.0 / V)
    tokens2, n_acc2 = rejection_sample(d, None, target2, num, torch.full((B, K), 0.999), noise)
    assert int(n_acc2[2]) == 0 and int(tokens2[2, 0]) != int(d[2, 0])
    for b in range(B):  # p = one-hot(d): accepted while 0.999 < q(d)
        k = int(num[b])
        q_d = [float(target2[b, i, d[b, i]]) for i in range(k)]
        expect = next((i for i, x in enumerate(q_d) if not 0.999 < x), k)
        assert int(n_acc2[b]) == expect
        assert int(tokens2[b, expect]) != (int(d[b, expect]) if expect < k else -1)


def test_sampled_ids_in_vocab_and_supported() -> None:
    g = torch.Generator().manual_seed(40)
    B, K, V = 3000, 3, 50
    logits_t = torch.randn(B * (K + 1), V, generator=g) * 3
    logits_d = torch.randn(B * K, V, generator=g) * 3
    temp = lambda n: (torch.full((n,), 0.9), torch.full((n,), 5), torch.full((n,), 0.8))  # noqa: E731
    q = process_logits(logits_t, *temp(B * (K + 1))).reshape(B, K + 1, V)
    p = process_logits(logits_d, *temp(B * K)).reshape(B, K, V)
    d = torch.multinomial(p.reshape(-1, V), 1, generator=g).reshape(B, K)
    num = torch.randint(0, K + 1, (B,), generator=g)
    u = torch.rand(B, K, generator=g)
    noise = torch.empty(B, V).exponential_(generator=g)
    noise[::7, :10] = 0.0  # zero noise must not pick unsupported tokens either
    tokens, n_acc = rejection_sample(d, p, q, num, u, noise)
    assert tokens.dtype == torch.int64 and n_acc.dtype == torch.int64
    assert ((tokens >= 0) & (tokens < V)).all()
    assert (n_acc <= num).all()
    new = tokens.gather(1, n_acc[:, None])[:, 0]
    q_new = q[torch.arange(B), n_acc, new]
    assert (q_new > 0).all()
    assert 0 < (n_acc == num).sum() < B


@pytest.mark.gpu
def test_rejection_sample_on_cuda_without_host_sync() -> None:
    g = torch.Generator().manual_seed(50)
    B, K, V = 2000, 3, 32
    q = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1)
    p = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    d = torch.multinomial(p.reshape(-1, V), 1, generator=g).reshape(B, K)
    num = torch.randint(0, K + 1, (B,), generator=g)
    u = torch.rand(B, K, generator=g)
    noise = torch.empty(B, V).exponential_(generator=g)
    ref = rejection_sample(d, p, q, num, u, noise)
    args = [x.cuda() for x in (d, p, q, num, u, noise)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = rejection_sample(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out[1].cpu(), ref[1])
    valid = torch.arange(K + 1)[None] <= ref[1][:, None]
    assert torch.equal(out[0].cpu()[valid], ref[0][valid])
