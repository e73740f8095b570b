"""The planner's candidates for one FFN Linear and their cost: measured, or on a GPU on paper.

Per Linear: ``w8a8`` (SmoothQuant, int8 tensor cores; only where the GPU has them), ``w8a16`` per
output channel, ``w8a16`` per group of 128, 64, 32 input channels, then ``fp16``. On paper
(``paper_cost``, for a GPU the profile is not built on): max(the bytes the kernel that runs moves /
(bandwidth x the rate that kernel reaches), 2 * rows * N * K / throughput of its math), from the
catalog's memory bandwidth and tensor throughput. The bytes (``kernel_bytes``) are those of the kernels
quant.matmul_kernels runs on CUDA: the dense fp16 weight; w8a8's int8 weight; w8a16's int8 weight through
the Triton GEMM (quant/triton_w8a16.py). The rate (``read_rate``) is the fraction
of fp16 ``F.linear``'s bytes per second each int8 kernel reached on an H200 (tools/gpu_kernels.py and
tools/gpu_w8a16_tune.py, profiles/gpu-results.md): reading half the bytes wins only where the rate
stays above one half, as for a single row. Measured (a
``CostFn`` from the build where the profile is built on the device it runs on: engine/kernels/cpu_int8.py
``CpuCostMeter`` on the CPU, engine/kernels/cost_meter.py ``ModuleCostMeter`` on CUDA): the kernel itself
timed on the device. quant/search.py orders each module's
candidates by the cost and says in a module's "why" when its choice is slower than the dense Linear.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.core.errors import InvalidConfigError

from .catalog import validate_gpu

DEFAULT_ROWS = 64  # a verify pass of a batch of sequences: (K + 1) rows each
MEASURED_TIE = 1.1  # measured costs within this ratio of each other count as equal (timing noise)
# (up to rows, fraction of fp16 F.linear's bytes per second): an H200, Llama-2-7B Linear shapes, medians
# over the shapes and the per-channel and per-group forms (profiles/gpu-results.md, 2026-12-04)
READ_RATES = {
    "w8a16": ((1, 0.63), (16, 0.5), (32, 0.39), (64, 0.3)),
    "w8a8": ((1, 0.2), (8, 0.2), (32, 0.19), (128, 0.16)),
}


@dataclass(frozen=True)
class Choice:
    label: str
    kernel: str  # "w8a8" | "w8a16" | "dense"
    group_size: int | None = None


CHOICES = (
    Choice("w8a8", "w8a8"),
    Choice("w8a16", "w8a16"),
    Choice("w8a16/g128", "w8a16", 128),
    Choice("w8a16/g64", "w8a16", 64),
    Choice("w8a16/g32", "w8a16", 32),
    Choice("fp16", "dense"),
)
DENSE = CHOICES[-1]

CostFn = Callable[[Choice, int, int, int], float]
"""(choice, n_out, n_in, rows) -> seconds for one call of the Linear's kernel."""


def kernel_bytes(choice: Choice, n_out: int, n_in: int) -> int:
    """Weight bytes one call of the kernel that runs ``choice`` on CUDA moves (quant.matmul_kernels)."""
    if choice.kernel == "dense":
        return 2 * n_out * n_in
    groups = 1 if choice.group_size is None else -(-n_in // choice.group_size)
    stored = n_out * n_in + 4 * n_out * groups
    return stored


def read_rate(choice: Choice, rows: int) -> float:
    """The fraction of fp16 ``F.linear``'s bytes per second the kernel of ``choice`` reaches at ``rows`` rows."""
    if choice.kernel == "dense":
        return 1.0
    rates = READ_RATES[choice.kernel]
    return next((r for up_to, r in rates if rows <= up_to), rates[-1][1])


def paper_cost(gpu: dict[str, Any], n_out: int, n_in: int, choice: Choice, rows: int = DEFAULT_ROWS) -> float:
    """Seconds for one Linear [n_out, n_in] at ``rows`` rows on ``gpu``, from the catalog (on paper)."""
    tflops = gpu.get("tensor_tflops") or {}
    if "fp16" not in tflops:
        raise InvalidConfigError(
            f"gpu {gpu.get('name')!r} has no tensor_tflops.fp16 in the catalog: the planner "
            "needs it to order candidates"
        )
    act_bytes = 2 * rows * (n_in + n_out)
    math_tput = tflops["int8"] if choice.kernel == "w8a8" else tflops["fp16"]
    moved = kernel_bytes(choice, n_out, n_in) / read_rate(choice, rows) + act_bytes
    return max(moved / (gpu["memory_bandwidth_gbps"] * 1e9), 2.0 * rows * n_out * n_in / (math_tput * 1e12))


def ordered_choices(
    gpu: dict[str, Any], n_out: int, n_in: int, rows: int = DEFAULT_ROWS, cost: CostFn | None = None
) -> list[Choice]:
    """The INT8 candidates for one Linear, fastest first by ``cost`` (None: on paper on ``gpu``; ties: the order
    of CHOICES, measured costs binned by MEASURED_TIE so that timing noise does not reorder them), then the
    dense Linear; w8a8 only with int8 tensor cores."""
    validate_gpu(gpu)
    ok = [c for c in CHOICES if c.kernel != "w8a8" or gpu["tensor_cores"]["int8"]]
    order = {c.label: i for i, c in enumerate(CHOICES)}
    costs = choice_costs(gpu, n_out, n_in, ok, rows, cost)
    if cost is not None:
        costs = {k: float(round(math.log(max(v, 1e-12)) / math.log(MEASURED_TIE))) for k, v in costs.items()}
    int8 = sorted((c for c in ok if c.kernel != "dense"), key=lambda c: (costs[c.label], order[c.label]))
    return int8 + [DENSE]  # the dense Linear last: the search's last resort, whatever its cost


def choice_costs(
    gpu: dict[str, Any], n_out: int, n_in: int, choices: list[Choice], rows: int, cost: CostFn | None
) -> dict[str, float]:
    """Seconds per call of each choice: ``cost`` (measured) or on paper on ``gpu``."""
    if cost is None:
        return {c.label: paper_cost(gpu, n_out, n_in, c, rows) for c in choices}
    return {c.label: cost(c, n_out, n_in, rows) for c in choices}
