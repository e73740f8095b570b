"""FP8 / INT8 primitives, LLM.int8 outliers and SmoothQuant against fp32 references."""

from __future__ import annotations

import pytest
import torch
from util import int8_linear_reference

from engine.core.errors import InvalidConfigError
from quant.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_MIN_NORMAL,
    FP8_REL_ERROR,
    dequantize_fp8,
    quantize_fp8,
    quantize_fp8_rowwise,
)
from quant.int8 import (
    dequantize_int8,
    int_mm,
    quantize_int8,
    quantize_int8_rowwise,
)
from quant.linear import Int8Linear
from quant.smooth import smooth_scales


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


# ------------------------------------------------------------------ FP8


def test_fp8_round_trip_normal_values_within_2_pow_minus_4():
    # magnitudes spread over many binades, per row
    g = gen(0)
    t = torch.randn(64, 512, generator=g) * torch.exp2(torch.randint(-12, 12, (64, 1), generator=g).float())
    q, s = quantize_fp8_rowwise(t)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and s.shape == (64,)
    back = dequantize_fp8(q, s)
    normal = (t.abs() / s[:, None]) >= FP8_MIN_NORMAL
    assert normal.float().mean() > 0.95  # the test covers most elements
    rel = ((back - t).abs() / t.abs())[normal]
    assert rel.max() <= FP8_REL_ERROR * (1 + 1e-6)
    # subnormal codes: absolute error at most half the subnormal step (2^-9 of the scale)
    sub = ~normal
    assert ((back - t).abs()[sub] <= (s[:, None] * 2.0**-10).expand_as(t)[sub] * (1 + 1e-6)).all()


def test_fp8_round_trip_is_not_trivially_exact():
    t = torch.randn(8, 256, generator=gen(1))
    q, s = quantize_fp8_rowwise(t)
    err = (dequantize_fp8(q, s) - t).abs() / t.abs()
    assert err.max() > 2.0**-6  # e4m3 really rounds: a 3-mantissa-bit format cannot be exact here
    assert (q.float().abs().amax(dim=1) == FP8_MAX).all()  # each row's absmax maps onto 448


def test_fp8_saturates_instead_of_nan():
    t = torch.tensor([[1000.0, -1e6, 3.0]])
    q = quantize_fp8(t, torch.ones(1))  # scale 1: 1000 and -1e6 are out of range
    assert q.float().tolist() == [[FP8_MAX, -FP8_MAX, 3.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_zero_and_huge_rows_stay_finite(dtype):
    big = torch.finfo(dtype).max
    t = torch.stack(
        [
            torch.zeros(16),
            torch.full((16,), big),
            torch.linspace(-1, 1, 16) * big,
            torch.full((16,), 1e-40 if dtype == torch.float32 else 1e-7),
        ]
    ).to(dtype)
    q, s = quantize_fp8_rowwise(t)
    back = dequantize_fp8(q, s, dtype)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.isfinite(q.float()).all() and torch.isfinite(back).all()
    assert (back[0] == 0).all()
    assert (((back[1:3].float() - t[1:3].float()) / big).abs() <= FP8_REL_ERROR).all()  # no norm: it overflows


# ------------------------------------------------------------------ INT8


def test_int8_round_trip_error_at_most_half_a_step():
    t = torch.randn(32, 300, generator=gen(2)) * 5
    q, s = quantize_int8_rowwise(t)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert q.min() >= -127 and q.max() <= 127
    assert ((dequantize_int8(q, s) - t).abs() <= s[:, None] / 2 * (1 + 1e-5)).all()
    assert (q.abs().amax(dim=1) == 127).all()


def test_int8_saturates_and_rounds_to_nearest():
    q = quantize_int8(torch.tensor([[300.0, -300.0, 2.4, 2.6, -2.6]]), torch.ones(1))
    assert q.tolist() == [[127, -127, 2, 3, -3]]


def test_int8_matmul_against_fp32_reference():
    g = gen(3)
    x, w = torch.randn(64, 128, generator=g), torch.randn(96, 128, generator=g)
    ref = x @ w.t()
    err = rel_fro(int8_linear_reference(x, w), ref)
    # expected ~ sqrt(2/12) * absmax / 127 ~ 0.0085 for K = 128
    assert err <= 1e-2
    assert err > 1e-4  # it is a real 8-bit product, not the fp32 one


def test_int_mm_matches_integer_reference_on_odd_shapes():
    g = gen(4)
    for m, k, n in [(1, 7, 3), (5, 64, 48), (33, 100, 17)]:
        a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
        b = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        assert torch.equal(int_mm(a, b), a.int() @ b.int().t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int8_zero_and_huge_rows_stay_finite(dtype):
    big = torch.finfo(dtype).max
    t = torch.stack([torch.zeros(8), torch.full((8,), big), torch.full((8,), -big / 3)]).to(dtype)
    q, s = quantize_int8_rowwise(t)
    back = dequantize_int8(q, s, dtype)
    assert torch.isfinite(s).all() and (s > 0).all() and torch.isfinite(back).all()
    assert (q[0] == 0).all() and (back[0] == 0).all()
    assert (((back[1:].float() - t[1:].float()) / big).abs() <= 1 / 254 + 1e-6).all()  # half a step


# ------------------------------------------------------------------ LLM.int8 and SmoothQuant


def _dequantized_weight(m: Int8Linear) -> torch.Tensor:
    return dequantize_int8(m.weight, m.weight_scale)


def test_llm_int8_keeps_outlier_columns_at_fp16_accuracy():
    g = gen(5)
    lin = torch.nn.Linear(64, 32, bias=False)
    lin.weight.data = torch.randn(32, 64, generator=g) * 0.1
    llm = Int8Linear.from_float(lin, kernel="llm-int8")
    w8a8 = Int8Linear.from_float(lin, kernel="w8a8")
    wd = _dequantized_weight(llm)  # both kernels share the same int8 weight
    # only outlier columns (|x| > 6) carry signal, with values int8 cannot represent on one grid
    x = torch.zeros(16, 64)
    x[:, 3] = 6.5 + torch.rand(16, generator=g) * 20
    x[:, 40] = -(6.1 + torch.rand(16, generator=g) * 3)
    ref = x @ wd.t()
    err_llm = rel_fro(llm(x.half()), ref)
    err_w8a8 = rel_fro(w8a8(x.half()), ref)
    assert err_llm <= 2e-3  # fp16 activations: ~1e-3
    assert err_w8a8 > 3 * err_llm  # per-token int8 of the same columns is visibly worse

    # mixed: N(0,1) channels plus one outlier column of magnitude ~60
    x = torch.randn(16, 64, generator=g)
    x[:, 10] = 60.0 + torch.rand(16, generator=g)
    ref = x @ wd.t()
    normal_ref = x.clone()
    normal_ref[:, 10] = 0
    scale = float((normal_ref @ wd.t()).norm())
    e_llm = float((llm(x).float() - ref).norm()) / scale
    e_w8a8 = float((w8a8(x).float() - ref).norm()) / scale
    assert e_llm <= 2e-2  # the normal part still sees ordinary int8 error
    assert e_w8a8 > 5 * e_llm  # the outlier sets the per-token step for everything else


def test_smooth_scales_formula_and_exact_identity():
    g = gen(6)
    w = torch.randn(16, 8, generator=g)
    a = torch.rand(8, generator=g) * 10
    a[2] = 0.0
    s = smooth_scales(a, w, alpha=0.5)
    expect = a.sqrt() / w.abs().amax(0).sqrt()
    expect[2] = 1.0
    torch.testing.assert_close(s, expect)
    x = torch.randn(4, 8, generator=g)
    torch.testing.assert_close((x / s) @ (w * s).t(), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_smooth_scales_rejects_bad_input():
    w = torch.randn(4, 8)
    with pytest.raises(InvalidConfigError, match="alpha"):
        smooth_scales(torch.ones(8), w, alpha=1.5)
    with pytest.raises(InvalidConfigError, match="in_features"):
        smooth_scales(torch.ones(7), w)
    with pytest.raises(InvalidConfigError, match="NaN"):
        smooth_scales(torch.tensor([float("nan")] * 8), w)


def test_smoothquant_reduces_w8a8_error_on_outlier_channels():
    g = gen(7)
    lin = torch.nn.Linear(128, 64, bias=False)
    lin.weight.data = torch.randn(64, 128, generator=g) / 128**0.5
    gain = torch.ones(128)
    gain[[5, 77, 100]] = 40.0  # systematic outlier channels, as in LLM FFN inputs

    def batch(n: int) -> torch.Tensor:
        return torch.randn(n, 128, generator=g) * gain

    calib = batch(256).abs().amax(0)
    x = batch(32)  # fresh tokens, not the calibration ones
    ref = lin(x)
    plain = rel_fro(Int8Linear.from_float(lin, "w8a8")(x), ref)
    smooth = rel_fro(Int8Linear.from_float(lin, "w8a8", act_absmax=calib, alpha=0.5)(x), ref)
    assert smooth < plain / 2
    assert smooth <= 2e-2


def test_int_mm_exact_at_the_largest_sums():
    # every product +-127^2, K = 1536 > 2^24 / 127^2: one float32 GEMM would round, the chunked one does not
    a = torch.full((3, 1536), 127, dtype=torch.int8)
    b = torch.full((5, 1536), 127, dtype=torch.int8)
    b[1] = -127
    b[2, ::2] = -127
    want = a.long() @ b.long().t()
    assert torch.equal(int_mm(a, b).long(), want)
    assert want.abs().max() > 2**24
