"""The INT8 GEMM on AMX-INT8 tiles (engine/kernels/csrc/int8_amx.cpp) against float64 references: within a bound
of the exact product (per channel and per group of 32, 64, 128, odd shapes, 1 to 64 rows, an outlier input),
row-independent bit for bit, an infinity or NaN in one row kept to that row as the AVX-512 kernel computes it,
groups that are not whole tiles refused; the decode step runs a model's INT8 Linears on it (a verify block equal
to its one-token steps), and a model with a Linear it does not run keeps every one on the AVX-512 kernel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.core.checkpoint import load_model
from engine.core.model import fuse_projections
from engine.kernels.cpu_decode import install_decode_step
from engine.kernels.cpu_gemm import cpu_kernels, small_gemm_status
from engine.kernels.cpu_int8 import int8_amx_reason, uses_int8_amx
from engine.kernels.cpu_linear import fast_cpu_linears
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


@pytest.mark.parametrize("group, k", [(0, 300), (32, 300), (0, 2100), (128, 2100)])  # 2100: 3 conversions per row
def test_each_row_is_computed_alone(group, k):
    q, s, _ = _weight(70, k, group, seed=1)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 3, 64)[:, None]
    kern = cpu_kernels()
    alone = torch.cat([kern.int8_amx_gemm(x[i : i + 1].contiguous(), q, s, group) for i in range(64)])
    for m in ROWS:  # any block of rows gives each row the bits it has alone (a verify pass == its steps)
        assert torch.equal(kern.int8_amx_gemm(x[:m].contiguous(), q, s, group), alone[:m])


def test_stacked_weights_give_each_its_own_bits_only_when_alike_grouped():
    k = cpu_kernels()
    (qa, sa, _), (qb, sb, _) = _weight(48, 256, 64, seed=5), _weight(40, 256, 64, seed=6)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(7))
    stacked = k.int8_amx_gemm(x, torch.cat([qa, qb]), torch.cat([sa, sb]), 64)  # gate/up as the step stacks them
    assert torch.equal(stacked, torch.cat([k.int8_amx_gemm(x, qa, sa, 64), k.int8_amx_gemm(x, qb, sb, 64)], 1))
    # a per-channel weight's scale repeated at groups of 64 (a stack with a grouped one): other bits than alone, so
    # uses_int8_amx keeps such models on the AVX-512 kernel
    qc, sc, _ = _weight(48, 256, 0, seed=8)
    alone, repeated = k.int8_amx_gemm(x, qc, sc, 0), k.int8_amx_gemm(x, qc, sc[:, None].repeat(1, 4).contiguous(), 64)
    assert not torch.equal(alone, repeated) and torch.allclose(alone, repeated, rtol=1e-5, atol=1e-6)


def test_a_non_finite_input_stays_in_its_row():
    q, s, _ = _weight(40, 96, 32, seed=2)
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(4))
    want = cpu_kernels().int8_amx_gemm(x, q, s, 32)
    x[2, 5], x[4, 7] = float("nan"), float("inf")
    y = cpu_kernels().int8_amx_gemm(x, q, s, 32)
    for r in (2, 4):  # the AVX-512 kernel's IEEE arithmetic on that row alone
        want_r = cpu_kernels().int8_gemm(x[r : r + 1].contiguous(), q, s, 32)[0]
        torch.testing.assert_close(y[r], want_r, rtol=0, atol=0, equal_nan=True)
    assert y[2].isnan().all()
    assert torch.equal(y[[0, 1, 3, 5]], want[[0, 1, 3, 5]])


def test_groups_that_are_not_whole_tiles_are_refused():
    q, s, _ = _weight(16, 64, 16)
    with pytest.raises(RuntimeError, match="multiple of 32, got 16"):
        cpu_kernels().int8_amx_gemm(torch.randn(2, 64), q, s, 16)
    lin = nn.Linear(128, 16, bias=False)
    mods = [Int8Linear.from_float(lin, "w8a16", group_size=g) for g in (None, 64, 128, 32, 16)]
    assert all(int8_amx_reason(m) is None for m in mods[:3])
    assert "slower than the AVX-512 int8 GEMM" in int8_amx_reason(mods[3])  # groups of 32: the kernel's, not chosen
    assert "not a multiple of 32" in int8_amx_reason(mods[4])
    # one kernel per model: a Linear the tiles do not run keeps the model's others on the AVX-512 kernel
    assert uses_int8_amx(nn.Sequential(*mods[:3]))
    assert not uses_int8_amx(nn.Sequential(*mods[:4]))


def _int8_ffn(model: nn.Module, mixed: bool = False) -> None:
    """INT8 FFNs per channel and in groups of 64 and 128 (gate and up alike, as the step stacks them; ``mixed``: not
    alike in the first layer), one W8A8."""
    for i, layer in enumerate(model.layers):
        m = layer.mlp
        gs = [(None if mixed else 64, 64, 128), (None, None, 64), (128, 128, None)][i % 3]
        m.gate_proj = Int8Linear.from_float(m.gate_proj, "w8a16", group_size=gs[0])
        m.up_proj = Int8Linear.from_float(m.up_proj, "w8a16", group_size=gs[1])
        if i == 1:
            m.down_proj = Int8Linear.from_float(m.down_proj, "w8a8", act_absmax=m.down_proj.weight.abs().amax(0) + 0.5)
        else:
            m.down_proj = Int8Linear.from_float(m.down_proj, "w8a16", group_size=gs[2])


def test_the_decode_step_runs_int8_linears_on_the_tiles(tmp_path):
    from util import assert_step_like_pytorch, make_checkpoint

    path = make_checkpoint(tmp_path, "llama", num_hidden_layers=3, intermediate_size=256)
    m, ref = load_model(path, torch.float32), load_model(path, torch.float32)
    with torch.no_grad():
        _int8_ffn(m)
        _int8_ffn(ref)
    fuse_projections(m)
    assert fast_cpu_linears(m, torch.device("cpu"), True)[0] > 0
    assert install_decode_step(m) is None and m.layer_step.int8_amx
    assert_step_like_pytorch(m, ref)  # a verify block equals its one-token steps bit for bit


def test_a_stack_of_unlike_groupings_keeps_the_avx512_kernel(tmp_path):
    from util import make_checkpoint

    m = load_model(make_checkpoint(tmp_path, "llama", num_hidden_layers=3, intermediate_size=256), torch.float32)
    with torch.no_grad():
        _int8_ffn(m, mixed=True)
    assert all(
        int8_amx_reason(mod) is None for mod in m.modules() if isinstance(mod, Int8Linear) and mod.kernel == "w8a16"
    )
    fuse_projections(m)
    assert not uses_int8_amx(m)
    assert install_decode_step(m) is None and not m.layer_step.int8_amx
