"""INT8 weight-only (W8A16) Linears, per output channel and per group, against FP32 references."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import quant.matmul_kernels as kernels
from engine.core.errors import InvalidConfigError
from quant.int8 import dequantize_int8, dequantize_int8_groupwise, quantize_int8_groupwise
from quant.linear import Int8Linear

K_SPEC = 5  # default draft length: a verify pass has 1..K+1 rows
ROWS = list(range(1, K_SPEC + 2)) + [16, 17, 33, 512]
GROUPS = [None, 32, 64, 128]


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def make_linear(seed: int, k: int = 200, n: int = 72, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n, bias=bias)


def stored_weight(m: Int8Linear) -> torch.Tensor:
    """The fp32 weight the module's int8 data and scales stand for (independent of the kernel)."""
    if m.group_size is None:
        return m.weight.float() * m.weight_scale[:, None]
    cols = torch.arange(m.in_features) // m.group_size
    return m.weight.float() * m.weight_scale[:, cols]


@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("rows", ROWS)
def test_w8a16_every_row_count_against_fp32(group_size, rows):
    lin = make_linear(40)  # in = 200: groups of 32, 64 and 128 leave a short last group
    m = Int8Linear.from_float(lin, "w8a16", group_size=group_size)
    x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(41 + rows))
    y = m(x)
    assert y.shape == (rows, 72) and y.dtype == torch.float32
    # exactly the stored data's product ...
    torch.testing.assert_close(y, x @ stored_weight(m).t() + lin.bias.detach(), rtol=1e-5, atol=1e-5)
    # ... and within INT8 rounding of the original weights (half a step per element: ~0.4% rms)
    err = rel_fro(y, lin(x))
    assert 1e-5 < err <= 0.01


@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w8a16_half_precision_inputs(group_size, dtype):
    lin = make_linear(42, k=128, n=64)
    ref_x = torch.randn(3, 7, 128, generator=torch.Generator().manual_seed(43))
    m = Int8Linear.from_float(lin.to(dtype), "w8a16", group_size=group_size)
    y = m(ref_x.to(dtype))
    assert y.dtype == dtype and y.shape == (3, 7, 64)
    assert rel_fro(y, lin.float()(ref_x)) <= 0.02


def test_groupwise_primitives_round_trip_within_half_a_step():
    w = torch.randn(24, 100, generator=torch.Generator().manual_seed(44))
    q, s = quantize_int8_groupwise(w, 32)
    assert q.dtype == torch.int8 and q.shape == (24, 100) and s.shape == (24, 4)
    back = dequantize_int8_groupwise(q, s, 32)
    cols = torch.arange(100) // 32
    assert ((back - w).abs() <= s[:, cols] / 2 * (1 + 1e-6)).all()
    # each group's absmax maps to +-127 exactly (symmetric, per group)
    for g in range(4):
        blk = q[:, g * 32 : (g + 1) * 32].abs().amax(dim=1)
        assert (blk == 127).all()
    # one group spanning the whole row is the per-channel quantization
    q1, s1 = quantize_int8_groupwise(w, 100)
    from quant.int8 import quantize_int8_rowwise

    q2, s2 = quantize_int8_rowwise(w)
    assert torch.equal(q1, q2) and torch.equal(s1[:, 0], s2)
    torch.testing.assert_close(dequantize_int8(q2, s2), dequantize_int8_groupwise(q1, s1, 100), rtol=0, atol=0)


def test_groups_beat_per_channel_on_outlier_columns():
    lin = make_linear(45, k=256, n=64, bias=False)
    with torch.no_grad():
        lin.weight[:, 5] *= 40.0  # one outlier input channel, as real checkpoints have
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(46))
    per_channel = rel_fro(Int8Linear.from_float(lin, "w8a16")(x), lin(x))
    grouped = rel_fro(Int8Linear.from_float(lin, "w8a16", group_size=64)(x), lin(x))
    assert grouped < per_channel / 2


def test_per_channel_w8a16_shares_data_with_the_activation_kernels():
    lin = make_linear(47, k=128, n=48)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(48)).clamp(-5.5, 5.5)
    m = Int8Linear.from_float(lin, "w8a8")
    a = m(x)
    m.set_kernel("w8a16")  # same stored weight, activations no longer quantized
    b = m(x)
    torch.testing.assert_close(b, x @ stored_weight(m).t() + lin.bias.detach(), rtol=1e-5, atol=1e-5)
    assert rel_fro(b, lin(x)) < rel_fro(a, lin(x))


def test_w8a16_with_smoothing_divides_its_input():
    lin = make_linear(49, k=128, n=32)
    calib = torch.rand(128) * 10 + 0.1
    m = Int8Linear.from_float(lin, "w8a16", act_absmax=calib)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(50))
    assert m.smooth is not None and rel_fro(m(x), lin(x)) <= 0.01


def test_grouped_weights_refuse_activation_kernels_and_bad_group_sizes():
    lin = make_linear(51, k=64, n=16)
    with pytest.raises(InvalidConfigError, match="group_size=32 is invalid with kernel='w8a8'"):
        Int8Linear.from_float(lin, "w8a8", group_size=32)
    m = Int8Linear.from_float(lin, "w8a16", group_size=32)
    with pytest.raises(InvalidConfigError, match="allowed w8a16"):
        m.set_kernel("llm-int8")
    for bad in (0, -4, 2.5, True):
        with pytest.raises(InvalidConfigError, match="group_size"):
            Int8Linear.from_float(lin, "w8a16", group_size=bad)


def test_w8a16_weight_bytes_and_casts():
    lin = make_linear(52, k=200, n=48)
    assert Int8Linear.from_float(lin, "w8a16").weight_bytes() == 48 * 200 + 4 * 48 + 4 * 48
    g = Int8Linear.from_float(lin, "w8a16", group_size=64)
    assert g.weight_bytes() == 48 * 200 + 4 * 48 * 4 + 4 * 48  # 4 groups (64, 64, 64, 8) per row
    x = torch.randn(4, 200, generator=torch.Generator().manual_seed(53))
    y32 = g(x)
    g.half()
    assert g.weight.dtype == torch.int8 and g.weight_scale.dtype == torch.float32 and g.group_size == 64
    y16 = g(x.half())
    assert y16.dtype == torch.float16 and rel_fro(y16, y32) <= 2e-3
    assert g(torch.zeros(0, 200).half()).shape == (0, 48)


def test_w8a16_registered_and_available_everywhere():
    assert "w8a16" in kernels.INT8_KERNELS
    for dev in ("cpu", "meta"):
        ok, reason = kernels.kernel_available("int8", "w8a16", dev)
        assert ok, reason


# ------------------------------------------------------------------ CUDA (run with -m gpu on a GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("rows", ROWS)
def test_gpu_w8a16_every_row_count(group_size, rows):
    lin = make_linear(60).cuda().half()  # in = 200: not a multiple of 16 or of the group size
    m = Int8Linear.from_float(lin, "w8a16", group_size=group_size)
    x = torch.randn(rows, 200, device="cuda", dtype=torch.float16)
    y = m(x)
    assert y.dtype == torch.float16 and y.shape == (rows, 72)
    ref = x.float() @ stored_weight(m).t() + lin.bias.float()
    assert rel_fro(y, ref) <= 2e-3  # fp16 rounding of the product only
    assert rel_fro(y, F.linear(x.float(), lin.weight.float(), lin.bias.float())) <= 0.01


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size", GROUPS)
def test_gpu_triton_w8a16_matches_the_dequantized_product(dtype, group_size):
    """The Triton GEMM (odd N and K, 1 to 300 rows, fresh random data each size) against the fp64 product of
    the stored weight; the module runs it for 16-bit inputs (the probe names it)."""
    pytest.importorskip("triton")
    from quant.matmul_kernels import kernel_available
    from quant.triton_w8a16 import w8a16_matmul

    assert "Triton" in kernel_available("int8", "w8a16", "cuda")[1]
    for rows in (1, 5, 16, 17, 33, 300):
        lin = torch.nn.Linear(1000, 4100, device="cuda", dtype=dtype)
        m = Int8Linear.from_float(lin, "w8a16", group_size=group_size)
        x = torch.randn(rows, 1000, device="cuda", dtype=dtype)
        y = w8a16_matmul(x, m.weight, m.weight_scale, group_size)
        ref = x.double() @ stored_weight(m).double().t()
        assert y.dtype == dtype and y.shape == (rows, 4100) and torch.isfinite(y).all()
        assert rel_fro(y, ref) <= (2e-3 if dtype == torch.float16 else 1e-2), rows
        assert torch.equal(m(x), y + m.bias.to(dtype))  # the module runs this kernel


def test_triton_w8a16_kernel_in_the_interpreter():
    """The Triton GEMM's indexing and scaling, run by Triton's CPU interpreter (fp16: the interpreter computes
    bf16 through numpy, which lacks it) on odd shapes, group sizes that tile a step or not, 1 to 70 rows, each
    form with its chosen tiles and with small ones (several steps, several groups a step), against fp64."""
    pytest.importorskip("triton")
    code = """
import torch
from quant.int8 import dequantize_int8, dequantize_int8_groupwise, quantize_int8_groupwise, quantize_int8_rowwise
from quant.triton_w8a16 import Config, w8a16_matmul

torch.manual_seed(0)
for g in (None, 32, 64, 128, 48, 100):  # 48 and 100 tile no step: each weight's scale is gathered
    for m, n, k in ((1, 72, 200), (1, 130, 1000), (5, 130, 1000), (17, 64, 257), (40, 100, 300), (70, 33, 128)):
        w = torch.randn(n, k) * 0.02
        q, s = quantize_int8_rowwise(w) if g is None else quantize_int8_groupwise(w, g)
        wd = dequantize_int8(q, s, torch.float32) if g is None else dequantize_int8_groupwise(q, s, g, torch.float32)
        x = torch.randn(m, k).half()
        ref = x.double() @ wd.double().t()
        forms = [None, Config("dot", 16, 64)] + ([Config("gemv", 8, 64)] if m == 1 else [])  # None: config_for's
        for cfg in forms:
            y = w8a16_matmul(x, q, s, g, cfg)
            assert y.dtype == torch.float16 and torch.isfinite(y).all(), (g, m, cfg)
            assert float((y.double() - ref).norm() / ref.norm()) <= 2e-3, (g, m, n, k, cfg)
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_triton_fp8_weight_kernel_in_the_interpreter():
    """The e4m3 decode of the Triton GEMM's FP8 weight-only path on every byte value (NaN where e4m3fn has NaN,
    each finite value exact), and the GEMM on odd shapes and 1 to 40 rows against fp64, in Triton's interpreter."""
    pytest.importorskip("triton")
    code = """
import torch
from quant.fp8 import dequantize_fp8, quantize_fp8_rowwise
from quant.triton_w8a16 import Config, fp8_weight_matmul

K = 16  # row b holds byte b K times; x = ones: y[b] = K * value(b)
q = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, K).contiguous().view(torch.float8_e4m3fn)
want = q.float()[:, 0] * K
for cfg in (None, Config("dot", 16, 16)):
    y = fp8_weight_matmul(torch.ones(1, K, dtype=torch.float16), q, torch.ones(256), cfg)[0].float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(y), nan) and int(nan.sum()) == 2, cfg
    assert torch.equal(y[~nan], want[~nan].half().float()), cfg
torch.manual_seed(0)
for m, n, k in ((1, 72, 200), (1, 130, 1000), (5, 130, 1000), (17, 64, 257), (40, 100, 300)):
    q, s = quantize_fp8_rowwise(torch.randn(n, k) * 0.02)
    x = torch.randn(m, k).half()
    ref = x.double() @ dequantize_fp8(q, s).double().t()
    for cfg in [None, Config("dot", 16, 64)] + ([Config("gemv", 8, 64)] if m == 1 else []):
        y = fp8_weight_matmul(x, q, s, cfg)
        assert y.dtype == torch.float16 and torch.isfinite(y).all(), (m, cfg)
        assert float((y.double() - ref).norm() / ref.norm()) <= 2e-3, (m, n, k, cfg)
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_fp8_weight_only_reads_the_e4m3_bytes(dtype):
    """An FP8 weight-only Linear on CUDA runs the Triton GEMM (the probe names it) and matches the fp64 product of
    its dequantized weight, 1 to 40 rows; no dequantized copy is kept."""
    pytest.importorskip("triton")
    from quant.linear import FP8Linear
    from quant.matmul_kernels import kernel_available

    assert "Triton" in kernel_available("fp8", "weight-only", "cuda")[1]
    for rows in (1, 5, 40):
        lin = torch.nn.Linear(1000, 4100, device="cuda", dtype=dtype)
        m = FP8Linear.from_float(lin, "weight-only")
        x = torch.randn(rows, 1000, device="cuda", dtype=dtype)
        ref = x.double() @ (m.weight.float().double() * m.weight_scale.double()[:, None]).t() + m.bias.double()
        y = m(x)
        assert y.dtype == dtype and rel_fro(y, ref) <= (2e-3 if dtype == torch.float16 else 1e-2), rows
        assert not m.kernel_state
