"""SamplingParams validation, process_logits against transformers' warpers, and sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.core.errors import EngineError, InvalidConfigError, InvalidRequestError
from engine.spec_decode.randomness import RoundNoise
from engine.spec_decode.sampling import (
    SamplingParams,
    params_to_tensors,
    process_logits,
    sample_from_probs,
)

ALPHA = 1e-4

# ---------------------------------------------------------------- SamplingParams

REFUSED = [
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "hot"),
    ("temperature", None),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("top_p", float("nan")),
    ("top_p", "0.9"),
    ("top_k", -1),
    ("top_k", 2.5),
    ("top_k", "5"),
    ("top_k", False),
    ("max_new_tokens", 0),
    ("max_new_tokens", -3),
    ("max_new_tokens", 10.0),
    ("max_new_tokens", "64"),
    ("seed", 1.5),
    ("seed", "0"),
    ("seed", True),
    ("seed", 2**64),
    ("stop", "###"),
    ("stop", None),
    ("stop", [1, 2]),
    ("stop", ["ok", ""]),
    ("stop", {"a"}),
]


@pytest.mark.parametrize("field,value", REFUSED, ids=[f"{f}={v!r}" for f, v in REFUSED])
def test_sampling_params_refuses(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    err = info.value
    assert isinstance(err, EngineError) and isinstance(err, ValueError)
    msg = str(err)
    assert field in msg and "allowed" in msg, msg


def test_sampling_params_accepts_and_normalises() -> None:
    d = SamplingParams()
    assert (d.max_new_tokens, d.temperature, d.top_k, d.top_p, d.seed, d.stop) == (64, 0.0, 0, 1.0, None, ())
    assert d.greedy
    p = SamplingParams(max_new_tokens=5, temperature=1, top_k=3, top_p=0.5, seed=-7, stop=["a", "bc"])
    assert p.stop == ("a", "bc") and isinstance(p.temperature, float) and not p.greedy
    assert SamplingParams(temperature=np.float32(0.5), top_k=np.int64(4)).top_k == 4
    assert hash(p) == hash(
        SamplingParams(max_new_tokens=5, temperature=1.0, top_k=3, top_p=0.5, seed=-7, stop=("a", "bc"))
    )
    with pytest.raises(AttributeError):
        p.temperature = 2.0  # type: ignore[misc]


def test_params_to_tensors() -> None:
    ps = [SamplingParams(), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)]
    t, k, p = params_to_tensors(ps, "cpu")
    assert (t.dtype, k.dtype, p.dtype) == (torch.float32, torch.int64, torch.float32)
    assert t.tolist() == pytest.approx([0.0, 0.7]) and k.tolist() == [0, 5]
    assert p.tolist() == pytest.approx([1.0, 0.9])


# ---------------------------------------------------------------- process_logits


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """One row's distribution the way transformers' generate builds it ([1, V] in)."""
    x = logits.float().clone()
    if temperature == 0.0:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).float()
    ids = torch.zeros(1, 1, dtype=torch.long)
    x = TemperatureLogitsWarper(temperature)(ids, x)
    if top_k > 0:
        x = TopKLogitsWarper(top_k)(ids, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(ids, x)
    return x.softmax(-1)


def check_against_hf(logits: torch.Tensor, params: list[tuple[float, int, float]]) -> None:
    temp = torch.tensor([p[0] for p in params], dtype=torch.float32)
    top_k = torch.tensor([p[1] for p in params], dtype=torch.int64)
    top_p = torch.tensor([p[2] for p in params], dtype=torch.float32)
    ours = process_logits(logits, temp, top_k, top_p)
    assert ours.dtype == torch.float32 and ours.shape == logits.shape
    ref = torch.cat([hf_probs(logits[i : i + 1], *params[i]) for i in range(len(params))])
    # identical support, identical probabilities
    assert torch.equal(ours > 0, ref > 0)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)


COMBOS = [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.5, 5, 1.0),
    (1.0, 1, 1.0),
    (0.8, 0, 0.9),
    (1.0, 0, 0.3),
    (2.0, 0, 1e-3),
    (1.0, 0, 1e-8),  # 1 - top_p rounds to 1 in fp32: only the kept-at-least-one token survives
    (0.6, 10, 0.8),
    (1.0, 40, 0.95),
    (1.3, 1000, 0.5),  # top_k larger than V
    (0.0, 0, 1.0),
    (0.0, 7, 0.5),  # temperature 0 ignores the filters
]


@pytest.mark.parametrize("temperature,top_k,top_p", COMBOS)
def test_process_logits_matches_transformers(temperature: float, top_k: int, top_p: float) -> None:
    g = torch.Generator().manual_seed(hash((temperature, top_k, top_p)) % 2**31)
    logits = torch.randn(6, 50, generator=g) * 3
    check_against_hf(logits, [(temperature, top_k, top_p)] * 6)


def test_process_logits_per_row_mixed() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(len(COMBOS) * 3, 64, generator=g) * 2.5
    check_against_hf(logits, COMBOS * 3)


def test_process_logits_low_precision_input() -> None:
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(len(COMBOS), 40, generator=g) * 4).to(torch.bfloat16)
    # ties are likely in bf16; the oracle sees the same bf16 values cast to fp32
    params = [c for c in COMBOS if c[2] == 1.0 or c[1] == 0]
    check_against_hf(logits[: len(params)], params)


def test_top_k_keeps_ties_and_greedy_takes_first_max() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0], [5.0, 1.0, 5.0, 0.0, 5.0]])
    probs = process_logits(logits, torch.tensor([1.0, 0.0]), torch.tensor([2, 0]), torch.tensor([1.0, 1.0]))
    assert probs[0].tolist() == pytest.approx([0, 0.5, 0, 0.5, 0])
    assert probs[1].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    ref = hf_probs(logits[:1], 1.0, 2, 1.0)
    torch.testing.assert_close(probs[:1], ref)


def test_top_p_reaches_mass() -> None:
    # probs 0.5, 0.3, 0.15, 0.05: top_p 0.8 keeps {0.5, 0.3}; 0.81 keeps three; 0.4 keeps one
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(3, 1)
    probs = process_logits(logits, torch.ones(3), torch.zeros(3, dtype=torch.long), torch.tensor([0.79, 0.81, 0.4]))
    assert (probs > 0).sum(-1).tolist() == [2, 3, 1]
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_top_p_boundary_mass_exactly_reached() -> None:
    # four equal logits: each token has probability exactly 0.25; top_p 0.5 keeps exactly two
    logits = torch.zeros(1, 4)
    probs = process_logits(logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.tensor([0.5]))
    ref = hf_probs(logits, 1.0, 0, 0.5)
    assert int((ref > 0).sum()) == 2 and int((probs > 0).sum()) == 2
    assert sorted(probs[0].tolist()) == [0.0, 0.0, 0.5, 0.5]


def test_tiny_temperature_stays_finite() -> None:
    logits = torch.tensor([[10.0, 9.0, -20.0], [1.0, 1.0 - 1e-3, 0.0]])
    probs = process_logits(logits, torch.tensor([1e-30, 1e-6]), torch.zeros(2, dtype=torch.long), torch.ones(2))
    assert torch.isfinite(probs).all()
    assert probs[:, 0].tolist() == [1.0, 1.0]


# ---------------------------------------------------------------- sampling


def test_sample_from_probs_chi_square() -> None:
    g = torch.Generator().manual_seed(3)
    probs = torch.tensor([0.05, 0.0, 0.4, 0.25, 0.0, 0.1, 0.2])
    n = 100_000
    # unnormalised input: the race is scale invariant
    noise = torch.empty(n, 7).exponential_(generator=g)
    draws = sample_from_probs((probs * 3.0).expand(n, 7), noise)
    assert draws.dtype == torch.int64
    counts = np.bincount(draws.numpy(), minlength=7)
    assert counts[1] == 0 and counts[4] == 0
    keep = probs.numpy() > 0
    assert chisquare(counts[keep], probs.numpy()[keep] * n).pvalue > ALPHA
    # the test has power: the same counts are far from a slightly different distribution
    other = np.array([0.07, 0.4, 0.23, 0.1, 0.2])
    assert chisquare(counts[keep], other * n).pvalue < ALPHA


def test_sample_never_picks_zero_probability_even_with_zero_noise() -> None:
    probs = torch.tensor([[0.0, 0.0, 1e-30, 0.0], [0.0, 0.5, 0.5, 0.0]])
    noise = torch.zeros(2, 4)
    assert sample_from_probs(probs, noise).tolist()[0] == 2
    assert sample_from_probs(probs, noise).tolist()[1] in (1, 2)


def _gen(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def test_round_noise_follows_each_rows_generator_in_draw_order() -> None:
    # row 0 seeded, K=2; row 1 greedy (draws nothing); row 2 seeded, K=1
    noise = RoundNoise.draw([_gen(11), None, _gen(12)], [2, 2, 1], [True, False, True], 9, "cpu")
    assert noise.draft.shape == (3, 2, 9) and noise.uniforms.shape == (3, 2) and noise.final.shape == (3, 9)
    assert noise.draft.dtype == torch.float32
    ref = _gen(11)  # the documented order: K draft vectors, K uniforms, then the final vector
    d0 = torch.empty(2, 9).exponential_(generator=ref)
    u0 = torch.empty(2).uniform_(generator=ref)
    f0 = torch.empty(9).exponential_(generator=ref)
    assert torch.equal(noise.draft[0], d0) and torch.equal(noise.uniforms[0], u0) and torch.equal(noise.final[0], f0)
    # a greedy row draws nothing and keeps the neutral values
    assert (noise.draft[1] == 1).all() and (noise.uniforms[1] == 0.5).all() and (noise.final[1] == 1).all()
    # a row's draws do not depend on its neighbours or on the batch's widest K
    alone = RoundNoise.draw([_gen(12)], [1], [True], 9, "cpu")
    assert torch.equal(alone.draft[0, :1], noise.draft[2, :1]) and torch.equal(alone.final[0], noise.final[2])
    assert (noise.draft[2, 1:] == 1).all() and (noise.uniforms[2, 1:] == 0.5).all()
    assert ((noise.uniforms[0] >= 0) & (noise.uniforms[0] < 1)).all()
    empty = RoundNoise.draw([], [], [], 5, "cpu")
    assert empty.final.shape == (0, 5) and empty.draft.shape == (0, 0, 5)
    cut = noise.cut(1)
    assert cut.draft.shape == (3, 1, 9) and torch.equal(cut.final, noise.final)


def test_round_noise_refuses_a_generator_on_another_device() -> None:
    with pytest.raises(InvalidConfigError, match="generators\\[0\\]"):
        RoundNoise.draw([_FakeDeviceGen()], [1], [True], 4, "cpu")  # type: ignore[list-item]


class _FakeDeviceGen:
    """Stands for a CUDA generator on a CPU-only machine: only its device is read before the refusal."""

    device = torch.device("cuda")


def test_exp_noise_is_exponential() -> None:
    noise = RoundNoise.draw([_gen(0)], [0], [True], 50_000, "cpu").final[0].double().numpy()
    # Exp(1): P(E > x) = exp(-x); compare bin counts
    edges = np.array([0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, math.inf])
    counts = np.histogram(noise, edges)[0]
    expected = np.diff(-np.exp(-edges)) * noise.size
    assert chisquare(counts, expected).pvalue > ALPHA


@pytest.mark.gpu
def test_process_logits_cuda_matches_cpu_without_sync() -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(len(COMBOS), 300, generator=g) * 3
    t, k, p = params_to_tensors([SamplingParams(temperature=c[0], top_k=c[1], top_p=c[2]) for c in COMBOS], "cpu")
    ref = process_logits(logits, t, k, p)
    args = [x.cuda() for x in (logits, t, k, p)]
    n = len(COMBOS)
    noise = RoundNoise.draw([_gen(1, "cuda")] + [None] * (n - 1), [0] * n, [True] * n, 300, "cuda").final
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = process_logits(*args)
        tok = sample_from_probs(out, noise)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out.cpu(), ref, atol=1e-6, rtol=1e-5)
    assert (ref.gather(-1, tok.cpu()[:, None]) > 0).all()


def test_row_processing_fast_paths_equal_process_logits():
    from engine.spec_decode.sampling import RowProcessing

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    cases = {
        "greedy": [SamplingParams()] * 6,
        "softmax": [SamplingParams(temperature=t) for t in (0.5, 1.0, 1.5, 0.7, 2.0, 1.0)],
        "general": [
            SamplingParams(temperature=1.0, top_k=5),
            SamplingParams(),
            SamplingParams(top_p=0.5, temperature=0.9),
            SamplingParams(temperature=1.0),
            SamplingParams(),
            SamplingParams(),
        ],
    }
    for mode, params in cases.items():
        rp = RowProcessing.of(params, "cpu")
        assert rp.mode == mode
        t, k, p = params_to_tensors(params, "cpu")
        assert torch.allclose(rp.probs(logits), process_logits(logits, t, k, p), atol=1e-6)
        rep = rp.repeat(3)
        assert torch.allclose(
            rep.probs(logits.repeat_interleave(3, 0)),
            process_logits(logits, t, k, p).repeat_interleave(3, 0),
            atol=1e-6,
        )
