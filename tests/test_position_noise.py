"""Sampled rows of drafters of fixed tokens: one uniform per position, the target's inverse-CDF sample there, the
drafts accepted while they equal it. Oracles: exact enumeration of the inverse CDF over a grid of uniforms, plain
sampling's tokens for the same seed, and the chi-square of two sampled tokens against the target's joint."""

from __future__ import annotations

import pytest
import torch
from test_speculative import sampled_joint
from util import PROMPTS

from engine import Engine, SamplingParams
from engine.api.options import SpeculationConfig
from engine.core.errors import InvalidConfigError
from engine.runtime.k_tuner import Arm
from engine.spec_decode.randomness import PositionNoise
from engine.spec_decode.sampling import inverse_cdf


@pytest.mark.parametrize(("V", "block"), [(5, 2), (37, 8), (37, 512), (1000, 64)])
def test_inverse_cdf_gives_each_token_its_mass(V: int, block: int) -> None:
    """Over M uniforms evenly spread in [0, 1), token t is drawn for p_t * M of them (to within one), a token of
    zero probability never, whatever the rows' scale."""
    g = torch.Generator().manual_seed(V)
    probs = torch.rand(3, V, generator=g) * torch.tensor([[1.0], [1e-3], [50.0]])
    probs[:, 1::4] = 0
    M = 8192
    u = (torch.arange(M, dtype=torch.float64) + 0.5) / M
    for row in probs:
        drawn = inverse_cdf(row.expand(M, V), u, block)
        counts = torch.bincount(drawn, minlength=V).double()
        want = row.double() / row.double().sum() * M
        assert (counts - want).abs().max() <= 1.0 + 1e-6
        assert counts[1::4].sum() == 0


def test_inverse_cdf_at_the_ends_and_one_hot_rows() -> None:
    probs = torch.tensor([[0.0, 0.2, 0.3, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    top = 1 - 2.0**-53
    for u, want in ((0.0, [1, 4]), (0.3, [2, 4]), (top, [3, 4])):
        for block in (1, 2, 4, 512):
            got = inverse_cdf(probs, torch.tensor([u, u], dtype=torch.float64), block)
            assert got.tolist() == want, (u, block)
    empty = torch.tensor([[0.0] * 6, [float("nan")] * 6])  # no mass: token 0, never one past the vocabulary
    for block in (4, 512):
        assert inverse_cdf(empty, torch.tensor([0.5, 0.999], dtype=torch.float64), block).tolist() == [0, 0]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_position_noise_draws_one_uniform_per_position_and_rewinds() -> None:
    """Row b draws ks[b] + 1 uniforms, each the next of its generator's stream (a greedy row none); after a row
    commits n tokens its generator continues at its (n + 1)-th draw, as if it had sampled n positions alone."""
    noise = PositionNoise.draw([_gen(11), None, _gen(12)], [2, 2, 0], [True, False, True], "cpu")
    assert noise.uniforms.shape == (3, 3) and noise.uniforms.dtype == torch.float64
    stream = torch.empty(4, dtype=torch.float64).uniform_(generator=_gen(11))
    assert torch.equal(noise.uniforms[0], stream[:3])
    assert (noise.uniforms[1] == 0.5).all() and noise.marks[1] == []
    assert noise.uniforms[2, 0] == torch.empty(1, dtype=torch.float64).uniform_(generator=_gen(12))[0]
    assert (noise.uniforms[2, 1:] == 0.5).all()
    g = _gen(11)
    again = PositionNoise.draw([g], [2], [True], "cpu")
    again.rewind(0, g, 1)  # one token committed: the next draw is the stream's second
    assert torch.empty(1, dtype=torch.float64).uniform_(generator=g)[0] == stream[1]
    g = _gen(11)
    PositionNoise.draw([g], [2], [True], "cpu").rewind(0, g, 3)  # all three: nothing to rewind
    assert torch.empty(1, dtype=torch.float64).uniform_(generator=g)[0] == stream[3]
    assert noise.cut(1).uniforms.shape == (3, 2)


def test_position_noise_refuses_a_generator_on_another_device() -> None:
    class CudaGen:  # only its device is read before the refusal
        device = torch.device("cuda")

    with pytest.raises(InvalidConfigError, match="generators\\[0\\]"):
        PositionNoise.draw([CudaGen()], [1], [True], "cpu")  # type: ignore[list-item]


@pytest.mark.gpu
def test_position_noise_rewinds_a_cuda_generator() -> None:
    """On CUDA too a row's draws are its generator's stream of single draws, and a rewind continues it."""

    def one(g: torch.Generator) -> float:
        return torch.empty(1, dtype=torch.float64, device="cuda").uniform_(generator=g).item()

    g = torch.Generator(device="cuda").manual_seed(3)
    stream = [one(g) for _ in range(4)]
    g = torch.Generator(device="cuda").manual_seed(3)
    noise = PositionNoise.draw([g], [3], [True], "cuda")
    assert noise.uniforms[0].tolist() == stream
    noise.rewind(0, g, 1)
    assert one(g) == stream[1]


SEEDED = [
    SamplingParams(max_new_tokens=30, temperature=0.8, seed=3),
    SamplingParams(max_new_tokens=30, temperature=1.2, top_p=0.9, top_k=40, seed=4),
    SamplingParams(max_new_tokens=30, temperature=0.7, repetition_penalty=1.3, min_p=0.05, seed=5),
]


@pytest.mark.parametrize(
    "spec",
    [
        SpeculationConfig(drafter="ngram", k=1, k_policy="constant"),
        SpeculationConfig(drafter="ngram", k=5, k_policy="constant"),
        SpeculationConfig(drafter="ngram", k=3),
        SpeculationConfig(drafter="ngram", k=4, tree_branches=3, k_policy="constant"),
    ],
    ids=["k1", "k5", "measured", "tree"],
)
def test_seeded_sampling_with_fixed_token_drafts_equals_plain_sampling(ckpt_dir, spec: SpeculationConfig) -> None:
    """A seeded sampled request gives plain sampling's tokens for its seed, alone and beside other requests, at
    any K and draft shape, with penalties, top-k/top-p and min_p."""
    prompts = [PROMPTS[5], PROMPTS[6], PROMPTS[0]]
    ref = [o.token_ids for o in Engine.from_pretrained(ckpt_dir).generate(prompts, SEEDED)]
    eng = Engine.from_pretrained(ckpt_dir, speculation=spec)
    assert [eng.generate([p], sp)[0].token_ids for p, sp in zip(prompts, SEEDED)] == ref
    crowd = [*prompts, PROMPTS[1], PROMPTS[2]]
    others = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=50, temperature=1.0)]
    assert [o.token_ids for o in eng.generate(crowd, [*SEEDED, *others])][:3] == ref
    st = eng.stats()
    if spec.k_policy == "constant":  # (the tuner may measure plain rounds faster on this random model)
        assert st["accepted"] > 0 and st["drafted"] > st["accepted"]  # drafts were accepted and rejected


def test_two_sampled_tokens_with_n_gram_drafts_follow_the_target(tiny_pair) -> None:
    """Every token of the vocabulary occurs in the prompt, so the n-gram drafter drafts the second token after
    any first: the two tokens' joint is the target's (chi-square), with drafts both accepted and rejected."""
    spec = SpeculationConfig(drafter="ngram", k=2, k_policy="constant")
    eng = Engine.from_pretrained(tiny_pair[0], speculation=spec)
    prompt = [*range(16), 3, 7]
    sp = SamplingParams(max_new_tokens=3, temperature=0.6)
    counts, exact, pvalue = sampled_joint(eng, prompt, sp, 24_000, 4_000)
    assert counts[exact == 0].sum() == 0
    st = eng.stats()
    assert st["drafted"] > 0 and 0.02 < st["acceptance_rate"] < 0.98
    assert pvalue > 1e-4


def test_the_tuner_sets_seeded_rows_with_fixed_token_drafts(ckpt_dir) -> None:
    """Where the K tuner measured plain rounds faster, seeded sampled rows of the n-gram drafter decode without
    drafts too (their tokens do not depend on K), and they keep plain sampling's tokens."""
    prompts = [PROMPTS[5], PROMPTS[6], PROMPTS[5], PROMPTS[3]]
    params = [SamplingParams(max_new_tokens=24, temperature=0.9, seed=s) for s in range(4)]
    ref = [o.token_ids for o in Engine.from_pretrained(ckpt_dir).generate(prompts, params)]
    eng = Engine.from_pretrained(ckpt_dir, speculation=SpeculationConfig(drafter="ngram", k=3))
    tuner = eng.scheduler.tuner
    assert tuner is not None
    for b in range(1, 5):  # as if plain rounds had measured 10x faster at every batch size
        for k in range(tuner.k_max + 1):
            for _ in range(tuner.warmup):
                tuner.record(b, Arm(k), 1.0 if k == 0 else 10.0)
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref
    st = eng.stats()
    assert st["drafted"] == 0 and st["plain_rounds"] >= 20


def test_a_row_with_non_finite_logits_ends_alone(ckpt_dir) -> None:
    """A sampled row whose target logits turn NaN mid-stream ends with finish_reason "error" (its logprobs asked
    for), and the row beside it keeps plain sampling's tokens."""
    eng = Engine.from_pretrained(ckpt_dir, speculation=SpeculationConfig(drafter="ngram", k=3, k_policy="constant"))
    params = [SamplingParams(max_new_tokens=16, temperature=0.9, seed=s, logprobs=2) for s in (99, 5)]
    ref = Engine.from_pretrained(ckpt_dir).generate([PROMPTS[6]], params[1])[0].token_ids
    eng.loop.inject_nan = lambda s: s.params.seed == 99 and len(s.generated) >= 2
    out = eng.generate([PROMPTS[5], PROMPTS[6]], params)
    assert out[0].finish_reason == "error" and len(out[0].token_ids) == 2
    assert out[1].finish_reason == "length" and out[1].token_ids == ref
