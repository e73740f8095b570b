"""The INT8 GEMM on AMX-INT8 tiles (engine/kernels/csrc/int8_amx.cpp) against float64 references: within a bound
of the exact product (per channel and per group of 32, 64, 128, odd shapes, 1 to 64 rows, an outlier input),
row-independent bit for bit, an infinity or NaN in one row kept to that row as the AVX-512 kernel computes it,
groups that are not whole tiles refused; the decode step runs a model's INT8 Linears on it, and a model with
one such Linear keeps every one on the AVX-512 kernel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.kernels.cpu_gemm import cpu_kernels, small_gemm_status
from engine.kernels.cpu_int8 import int8_amx_reason, uses_int8_amx
from quant.linear import Int8Linear

STATUS = small_gemm_status() or cpu_kernels().int8_amx_status()
pytestmark = pytest.mark.skipif(bool(STATUS), reason=f"AMX-INT8 tiles unavailable: {STATUS}")
ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 17, 33, 64)  # 4 rows per tile column block, 2 blocks per pass


def _weight(n: int, k: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 q [n, k], scales (per row for group 0, else per group) and the float64 dequantized weight."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    groups = 1 if group == 0 else -(-k // group)
    s = torch.rand(n, groups, generator=g) * 0.01 + 1e-4
    cols = torch.arange(k) // (group or k)
    w = q.double() * s.double()[:, cols]
    return q, (s[:, 0].contiguous() if group == 0 else s), w


@pytest.mark.parametrize("group", (0, 32, 64, 128))
@pytest.mark.parametrize("shape", [(37, 100), (64, 1000), (96, 576), (17, 130), (48, 2048)])
def test_within_a_bound_of_the_exact_product(group, shape):
    n, k = shape
    q, s, w = _weight(n, k, group)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        x[0, k // 3] = 80.0  # an outlier sets its row's split: the row's small inputs keep 2^-27 of it
        y = cpu_kernels().int8_amx_gemm(x, q, s, group)
        exact = x.double() @ w.T
        # fp32 sums of exact products, plus each input kept to 2^-27 of its row's largest |x|
        amax = x.abs().amax(1, keepdim=True).double()
        bound = 2.0**-21 * (x.double().abs() @ w.abs().T) + 2.0**-26 * amax * w.abs().sum(1)
        assert ((y.double() - exact).abs() <= bound).all(), (m, (y.double() - exact).abs().max().item())


@pytest.mark.parametrize("group", (0, 32))
def test_each_row_is_computed_alone(group):
    q, s, _ = _weight(70, 300, group, seed=1)
    x = torch.randn(64, 300, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 3, 64)[:, None]
    k = cpu_kernels()
    alone = torch.cat([k.int8_amx_gemm(x[i : i + 1].contiguous(), q, s, group) for i in range(64)])
    for m in ROWS:  # any block of rows gives each row the bits it has alone (a verify pass == its steps)
        assert torch.equal(k.int8_amx_gemm(x[:m].contiguous(), q, s, group), alone[:m])


def test_a_non_finite_input_stays_in_its_row():
    q, s, _ = _weight(40, 96, 32, seed=2)
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(4))
    want = cpu_kernels().int8_amx_gemm(x, q, s, 32)
    x[2, 5], x[4, 7] = float("nan"), float("inf")
    y = cpu_kernels().int8_amx_gemm(x, q, s, 32)
    for r in (2, 4):  # the AVX-512 kernel's IEEE arithmetic on that row alone
        assert torch.equal(y[r].isnan(), cpu_kernels().int8_gemm(x[r : r + 1].contiguous(), q, s, 32)[0].isnan())
    assert y[2].isnan().all()
    assert torch.equal(y[[0, 1, 3, 5]], want[[0, 1, 3, 5]])


def test_groups_that_are_not_whole_tiles_are_refused():
    q, s, _ = _weight(16, 64, 16)
    with pytest.raises(RuntimeError, match="multiple of 32, got 16"):
        cpu_kernels().int8_amx_gemm(torch.randn(2, 64), q, s, 16)
    lin = nn.Linear(64, 16, bias=False)
    mods = [Int8Linear.from_float(lin, "w8a16", group_size=g) for g in (32, 16)]
    assert int8_amx_reason(mods[0]) is None
    assert "not a multiple of 32" in int8_amx_reason(mods[1])
    # one kernel per model: a Linear the tiles cannot read keeps the model's others on the AVX-512 kernel
    assert uses_int8_amx(nn.Sequential(mods[0]))
    assert not uses_int8_amx(nn.Sequential(*mods))
