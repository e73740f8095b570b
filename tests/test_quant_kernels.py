"""Every quantized module / kernel against fp32 references on fresh random inputs."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from util import int8_linear_reference

import quant.matmul_kernels as kernels
from engine.core.errors import InvalidConfigError, KernelUnavailableError
from quant.fp8 import FP8_DTYPE, FP8_REL_ERROR, dequantize_fp8
from quant.int8 import dequantize_int8
from quant.linear import FP8Embedding, FP8Linear, Int8Linear

# relative Frobenius error against fp32 F.linear with the original weights.
# FP8 e4m3 rounding is <= 2^-4 per element, ~2.5% rms: weight-only quantizes W (~0.026),
# native quantizes W and x (~0.037); INT8 per-channel/per-token ~0.008 at these sizes.
TOL = {("fp8", "native"): 0.06, ("fp8", "weight-only"): 0.045, ("int8", "w8a8"): 0.02, ("int8", "llm-int8"): 0.02}
CPU_KERNELS = sorted(TOL)


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def make_linear(seed: int, k: int = 96, n: int = 80, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n, bias=bias)


def quantized(family: str, lin: torch.nn.Linear, kernel: str) -> torch.nn.Module:
    return FP8Linear.from_float(lin, kernel) if family == "fp8" else Int8Linear.from_float(lin, kernel)


@pytest.mark.parametrize("family,kernel", CPU_KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_against_fp32_reference(family, kernel, dtype):
    lin = make_linear(10)
    x = torch.randn(3, 7, 96, generator=torch.Generator().manual_seed(11))  # [..., in], 21 tokens
    ref = lin(x)
    mod = quantized(family, lin.to(dtype), kernel)
    y = mod(x.to(dtype))
    assert y.dtype == dtype and y.shape == (3, 7, 80)
    assert torch.isfinite(y).all()
    err = rel_fro(y, ref)
    assert err <= TOL[(family, kernel)]
    assert err > 1e-4  # the kernel really ran on quantized data


def test_fp8_kernels_compute_the_stored_data_exactly():
    lin = make_linear(12)
    m = FP8Linear.from_float(lin, "weight-only")
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(13))
    wd = dequantize_fp8(m.weight, m.weight_scale)
    torch.testing.assert_close(m(x), x @ wd.t() + lin.bias.detach(), rtol=1e-5, atol=1e-5)
    # native = both operands in e4m3 (x per token), products accumulated in fp32
    m.set_kernel("native")
    from quant.fp8 import quantize_fp8_rowwise

    xq, xs = quantize_fp8_rowwise(x)
    expect = dequantize_fp8(xq, xs) @ wd.t() + lin.bias.detach()
    torch.testing.assert_close(m(x), expect, rtol=1e-4, atol=1e-4)


def test_fp8_native_and_weight_only_agree_within_fp8_tolerance():
    lin = make_linear(14, k=256, n=128)
    m = FP8Linear.from_float(lin, "native")
    x = torch.randn(33, 256, generator=torch.Generator().manual_seed(15))
    a = m(x)
    m.set_kernel("weight-only")  # same stored data, other kernel
    b = m(x)
    assert 1e-4 < rel_fro(a, b) <= 0.05  # native adds only the per-token activation rounding


def test_int8_kernels_agree_and_w8a8_matches_integer_reference():
    lin = make_linear(16, k=128, n=64, bias=False)
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(17))  # |x| < 6 almost surely
    x = x.clamp(-5.5, 5.5)
    m = Int8Linear.from_float(lin, "w8a8")
    a = m(x)
    torch.testing.assert_close(a, int8_linear_reference(x, lin.weight.detach()), rtol=1e-5, atol=1e-5)
    m.set_kernel("llm-int8")
    b = m(x)
    # without outliers LLM.int8 is the same per-token int8 product, on fp16 activations
    assert rel_fro(b, a) <= 5e-3


def test_w8a8_with_smoothquant_against_reference():
    lin = make_linear(18, k=128, n=64)
    g = torch.Generator().manual_seed(19)
    gain = torch.ones(128)
    gain[7] = 30.0
    calib = (torch.randn(128, 128, generator=g) * gain).abs().amax(0)
    m = Int8Linear.from_float(lin, "w8a8", act_absmax=calib)
    assert m.smooth is not None and m.smooth.shape == (128,)
    x = torch.randn(4, 5, 128, generator=g) * gain
    ref = lin(x)
    assert rel_fro(m(x), ref) <= 0.02
    # the stored weight is W * s: divided back it is W to within half an int8 step of W * s
    w_back = dequantize_int8(m.weight, m.weight_scale) / m.smooth
    bound = m.weight_scale[:, None] / 2 / m.smooth[None, :]
    assert ((w_back - lin.weight.detach()).abs() <= bound * (1 + 1e-4) + 1e-9).all()
    m.set_kernel("llm-int8")  # same API: the module divides by s for either kernel
    assert rel_fro(m(x), ref) <= 0.02


@pytest.mark.parametrize("family,kernel", CPU_KERNELS)
def test_zero_huge_and_empty_inputs(family, kernel):
    lin = make_linear(20, k=64, n=32)
    m = quantized(family, lin, kernel)
    y = m(torch.zeros(4, 64))
    torch.testing.assert_close(y, lin.bias.detach().expand(4, 32), rtol=0, atol=1e-3)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(21)) * 1e4
    y = m(x)
    assert torch.isfinite(y).all() and rel_fro(y, lin(x)) <= TOL[(family, kernel)]
    assert m(torch.zeros(0, 64)).shape == (0, 32)


def test_weight_bytes_count_what_is_stored():
    lin = make_linear(22, k=64, n=48)
    assert FP8Linear.from_float(lin).weight_bytes() == 48 * 64 + 4 * 48 + 4 * 48  # fp8 + scales + fp32 bias
    assert Int8Linear.from_float(lin.half()).weight_bytes() == 48 * 64 + 4 * 48 + 2 * 48
    calib = torch.ones(64)
    assert Int8Linear.from_float(lin.half(), act_absmax=calib).weight_bytes() == 48 * 64 + 4 * 48 + 4 * 64 + 2 * 48


def test_dtype_casts_keep_quantized_data():
    m = Int8Linear.from_float(make_linear(23, k=32, n=16))
    f = FP8Linear.from_float(make_linear(24, k=32, n=16))
    for mod in (m, f):
        mod.half()
        assert mod.weight.dtype in (torch.int8, FP8_DTYPE) and mod.weight_scale.dtype == torch.float32
        assert mod.bias.dtype == torch.float16 and mod.compute_dtype == torch.float16
        assert mod(torch.randn(2, 32).half()).dtype == torch.float16


def test_fp8_embedding_and_tied_head_share_one_table():
    torch.manual_seed(25)
    emb = torch.nn.Embedding(50, 24)
    fe = FP8Embedding.from_float(emb)
    ids = torch.randint(0, 50, (3, 6))
    out = fe(ids)
    ref = emb(ids)
    assert out.dtype == torch.float32 and out.shape == (3, 6, 24)
    torch.testing.assert_close(out, dequantize_fp8(fe.weight, fe.weight_scale)[ids])
    assert ((out - ref).abs() <= FP8_REL_ERROR * ref.abs() + fe.weight_scale[ids][..., None] * 2**-9).all()
    head = FP8Linear.tied_to(fe, kernel="weight-only")
    assert head.weight is fe.weight and head.weight_scale is fe.weight_scale
    h = torch.randn(2, 24)
    assert rel_fro(head(h), h @ emb.weight.detach().t()) <= TOL[("fp8", "weight-only")]
    both = torch.nn.ModuleList([fe, head]).to(torch.float16)
    assert both[0].weight is both[1].weight and fe.weight.dtype == FP8_DTYPE
    assert fe(ids).dtype == torch.float16
    assert fe.weight_bytes() == 50 * 24 + 4 * 50


def test_unknown_kernel_names_allowed_ones():
    lin = make_linear(26, k=16, n=16)
    with pytest.raises(InvalidConfigError, match="native, te, weight-only"):
        FP8Linear.from_float(lin, kernel="fast")
    with pytest.raises(InvalidConfigError, match="w8a8, llm-int8"):
        Int8Linear.from_float(lin, kernel="int4")


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="transformer_engine installed")
def test_te_without_transformer_engine_is_unavailable():
    lin = make_linear(27, k=16, n=16)
    with pytest.raises(KernelUnavailableError, match=r"'te'.*transformer_engine"):
        FP8Linear.from_float(lin, kernel="te")
    ok, reason = kernels.kernel_available("fp8", "te", "cpu")
    assert not ok and "transformer" in reason


def test_probes_refuse_gpus_without_the_tensor_cores(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(kernels, "_cc", lambda device: (8, 0))
    ok, reason = kernels.kernel_available("fp8", "native", cuda)
    assert not ok and "8.9" in reason and "sm_80" in reason and "weight-only" in reason
    assert kernels.kernel_available("fp8", "weight-only", cuda)[0]
    assert kernels.kernel_available("int8", "w8a8", cuda)[0]
    monkeypatch.setattr(kernels, "_cc", lambda device: (7, 0))
    ok, reason = kernels.kernel_available("int8", "w8a8", cuda)
    assert not ok and "7.5" in reason and "sm_70" in reason
    with pytest.raises(KernelUnavailableError, match="llm-int8"):
        kernels.require_kernel("int8", "llm-int8", cuda)
    monkeypatch.setattr(kernels, "_cc", lambda device: (9, 0))
    assert kernels.kernel_available("fp8", "native", cuda)[0]


def test_every_cpu_kernel_is_available_here():
    for family, kernel in CPU_KERNELS:
        ok, reason = kernels.kernel_available(family, kernel, "cpu")
        assert ok, reason


# ------------------------------------------------------------------ CUDA (run with -m gpu on a GPU)


def _cuda_cc() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


@pytest.mark.gpu
def test_gpu_native_fp8_agrees_with_weight_only():
    if _cuda_cc() < (8, 9):
        pytest.skip("native FP8 needs compute capability >= 8.9")
    lin = make_linear(30, k=200, n=72).cuda().half()  # K, N not multiples of 16: the padding path
    m = FP8Linear.from_float(lin, "native")
    x = torch.randn(5, 200, device="cuda", dtype=torch.float16)
    a = m(x)
    m.set_kernel("weight-only")
    b = m(x)
    assert a.dtype == torch.float16 and 1e-4 < rel_fro(a, b) <= 0.05
    assert rel_fro(a, lin.float()(x.float())) <= TOL[("fp8", "native")]


@pytest.mark.gpu
def test_gpu_w8a8_small_batch_padding():
    if _cuda_cc() < (7, 5):
        pytest.skip("w8a8 needs compute capability >= 7.5")
    lin = make_linear(31, k=100, n=36).cuda().half()  # M < 17, K and N not multiples of 8
    m = Int8Linear.from_float(lin, "w8a8")
    x = torch.randn(3, 100, device="cuda", dtype=torch.float16)
    assert rel_fro(m(x), lin.float()(x.float())) <= TOL[("int8", "w8a8")]


@pytest.mark.gpu
def test_gpu_te_agrees_with_weight_only():
    pytest.importorskip("transformer_engine")
    if _cuda_cc() < (8, 9):
        pytest.skip("te FP8 needs compute capability >= 8.9")
    lin = make_linear(32, k=256, n=128).cuda().half()
    m = FP8Linear.from_float(lin, "te")
    x = torch.randn(16, 256, device="cuda", dtype=torch.float16)
    a = m(x)
    m.set_kernel("weight-only")
    assert rel_fro(a, m(x)) <= 0.08  # te scales per tensor (delayed), not per channel
