"""The planner's costs: on paper from the bytes the CUDA kernel that runs moves, measured on this CPU by the
kernels the decode step runs; a module whose choice is slower than the dense Linear says so in its reason."""

from __future__ import annotations

import pytest
import torch
from test_plan_search import tiny, windows

from engine.build.planner import measured_costs
from engine.core.model import fuse_projections
from engine.core.stored_linear import StoredLinear
from engine.kernels.cost_meter import ModuleCostMeter
from engine.kernels.cpu_decode import install_decode_step, step_info
from engine.kernels.cpu_gemm import amx_status, small_gemm_status
from engine.kernels.cpu_int8 import CpuCostMeter
from engine.kernels.step_weights import dense_step_storage
from quant.calibration import collect_calibration
from quant.candidates import CHOICES, DENSE, kernel_bytes, ordered_choices, paper_cost, read_rate
from quant.catalog import lookup_gpu
from quant.search import search_ffn


def test_paper_bytes_are_the_running_kernels():
    n, k = 1536, 576
    by = {c.label: kernel_bytes(c, n, k) for c in CHOICES}
    assert by["fp16"] == 2 * n * k and by["w8a8"] == n * k + 4 * n
    assert by["w8a16/g32"] == n * k + 4 * n * (k // 32) < by["fp16"]  # the Triton GEMM reads the int8 bytes
    a100 = lookup_gpu("a100")
    # at the rates measured on an H200: one row reads half the bytes at more than half the rate, 64 rows do not
    assert paper_cost(a100, n, k, CHOICES[1], 1) < paper_cost(a100, n, k, DENSE, 1)
    assert paper_cost(a100, n, k, CHOICES[4], 64) > paper_cost(a100, n, k, DENSE, 64)
    assert read_rate(CHOICES[1], 1) > 0.5 > read_rate(CHOICES[1], 64) and read_rate(DENSE, 64) == 1.0
    assert ordered_choices(a100, n, k)[-1] == DENSE  # the dense Linear stays the last resort


def test_search_says_when_a_choice_is_slower_than_dense():
    _, m = tiny(4, layers=2)
    calib = collect_calibration(m, windows(5), sample=96)
    res = search_ffn(m, calib, lookup_gpu("v100"), kld_budget=1e9)  # no INT8 tensor cores: W8A16
    slow = [p.reason for p in res.modules.values() if "slower than the unquantized Linear" in p.reason]
    assert slow and all("on paper on" in r for r in slow)


@pytest.mark.skipif(small_gemm_status() is not None, reason=f"CPU kernels unavailable: {small_gemm_status()}")
def test_cpu_cost_meter_measures_the_step_kernels():
    meter = CpuCostMeter(rows=4, stream_bytes=4 << 20, repeats=2)
    costs = {c.label: meter(c, 256, 192, 64) for c in CHOICES}
    assert all(v > 0 for v in costs.values()) and len(meter.cache) == len(CHOICES)
    assert meter(CHOICES[1], 256, 192, 64) == costs["w8a16"]  # cached per shape and rows
    order = ordered_choices(lookup_gpu("a100"), 256, 192, 64, meter)
    assert order[-1] == DENSE and {c.label for c in order} == {c.label for c in CHOICES}
    _, m = tiny(4, layers=1)
    calib = collect_calibration(m, windows(5, n=2), sample=32)
    res = search_ffn(m, calib, lookup_gpu("a100"), kld_budget=1e9, cost=meter, cost_source="measured here")
    assert set(res.modules) == {f"layers.0.mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")}
    assert torch.is_grad_enabled()


def _valued(values: str) -> torch.nn.Module:
    """A tiny model whose weights are fp32, bf16- or fp16-valued, or (``"mixed"``, as the planner's ``store_narrow``
    leaves a bf16 checkpoint) bf16-valued with its attention stored in fp16, neither dtype holding both."""
    _, m = tiny(4, layers=1)
    with torch.no_grad():
        for lin in m.modules():
            if isinstance(lin, torch.nn.Linear) and values != "fp32":
                lin.weight.copy_(lin.weight.to(torch.float16 if values == "fp16" else torch.bfloat16))
        if values == "mixed":
            attn, mlp = m.layers[0].self_attn, m.layers[0].mlp
            attn.q_proj.weight[0, 0], mlp.gate_proj.weight[0, 0] = 1 + 2**-10, 2.0**20  # fp16 only; bf16 only
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(attn, name, StoredLinear.from_linear(getattr(attn, name), torch.float16))
    return m


@pytest.mark.skipif(small_gemm_status() is not None, reason=f"CPU kernels unavailable: {small_gemm_status()}")
@pytest.mark.parametrize("values", ["fp32", "bf16", "fp16", "mixed"])
def test_the_dense_baseline_is_what_the_decode_step_runs(values):
    """The planner prices the dense Linear in the storage and on the kernel the step gives the model's weights:
    a bf16-valued checkpoint on AMX tiles where this CPU has them (where int8 weights can lose to it)."""
    m = _valued(values)
    dense = dense_step_storage(m)  # as the planner asks, before the engine fuses q/k/v and gate/up
    fuse_projections(m)
    assert install_decode_step(m) is None
    info = step_info({"target": m})
    label = info["target_step_weights"]  # a storage per weight: their dtypes joined by "+" (the FFN's bf16 here)
    held = "bf16" if "+" in label else {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[label]
    assert dense.removesuffix("-amx") == held == values.replace("mixed", "bf16")
    assert ("+" in label) == (values == "mixed")
    assert (dense == "bf16-amx") == info["target_step_amx"] == (values == "bf16" and amx_status() is None)
    meter = CpuCostMeter(rows=4, stream_bytes=2 << 20, repeats=2, dense=dense)
    assert meter(DENSE, 256, 192, 64) > 0 and measured_costs("cpu", m)[0].dense == dense
    with pytest.raises(ValueError, match="dense='int4' is invalid: allowed fp32, fp16, bf16, bf16-amx"):
        CpuCostMeter(dense="int4")


def test_module_cost_meter_times_each_candidates_linear():
    """The GPU build's meter, run here on the CPU's registry kernels: every candidate timed, cached per shape."""
    meter = ModuleCostMeter(torch.device("cpu"), torch.float32, rows=4, stream_bytes=2 << 20, repeats=2)
    costs = {c.label: meter(c, 128, 96, 64) for c in CHOICES}
    assert all(v > 0 for v in costs.values()) and len(meter.cache) == len(CHOICES)
    assert meter(CHOICES[2], 128, 96, 16) == costs["w8a16/g128"]  # rows capped at the meter's: the same entry
    order = ordered_choices(lookup_gpu("a100"), 128, 96, 64, meter)
    assert order[-1] == DENSE and {c.label for c in order} == {c.label for c in CHOICES}


@pytest.mark.gpu
def test_a_cuda_build_measures_its_candidates_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cost, source = measured_costs("cuda")
    assert isinstance(cost, ModuleCostMeter) and torch.cuda.get_device_name() in source
    assert all(cost(c, 1024, 512, 64) > 0 for c in CHOICES)
