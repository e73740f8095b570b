"""The planner's candidates for one FFN Linear and their expected cost on a GPU (on paper).

Per Linear: ``w8a8`` (SmoothQuant, int8 tensor cores; only where the GPU has them), ``w8a16`` per
output channel, ``w8a16`` per group of 128, 64, 32 input channels (int8 bytes, fp16 math), then
``fp16``. Cost of one Linear at ``rows`` rows (``paper_cost``): max(bytes moved / bandwidth,
2 * rows * N * K / throughput of its math), from the catalog's memory bandwidth and tensor
throughput. quant/search.py orders each module's candidates by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core.errors import InvalidConfigError

from .catalog import validate_gpu

DEFAULT_ROWS = 64  # a verify pass of a batch of sequences: (K + 1) rows each


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


def paper_cost(gpu: dict[str, Any], n_out: int, n_in: int, choice: Choice, rows: int = DEFAULT_ROWS) -> float:
    """Seconds for one Linear [n_out, n_in] at ``rows`` rows on ``gpu``, from the catalog (on paper)."""
    tflops = gpu.get("tensor_tflops") or {}
    if "fp16" not in tflops:
        raise InvalidConfigError(
            f"gpu {gpu.get('name')!r} has no tensor_tflops.fp16 in the catalog: the planner "
            "needs it to order candidates"
        )
    if choice.kernel == "dense":
        w_bytes = 2 * n_out * n_in
    else:
        groups = 1 if choice.group_size is None else -(-n_in // choice.group_size)
        w_bytes = n_out * n_in + 4 * n_out * groups
    act_bytes = 2 * rows * (n_in + n_out)
    math_tput = tflops["int8"] if choice.kernel == "w8a8" else tflops["fp16"]
    if choice.kernel == "w8a16" and choice.group_size is not None:
        math_tput = math_tput * 0.9  # the per-group dequantization in the GEMM's prologue (a stated guess)
    return max(
        (w_bytes + act_bytes) / (gpu["memory_bandwidth_gbps"] * 1e9), 2.0 * rows * n_out * n_in / (math_tput * 1e12)
    )


def ordered_choices(gpu: dict[str, Any], n_out: int, n_in: int, rows: int = DEFAULT_ROWS) -> list[Choice]:
    """The candidates for one Linear, fastest first (ties: fewer bytes first); w8a8 only with int8 tensor cores."""
    validate_gpu(gpu)
    ok = [c for c in CHOICES if c.kernel != "w8a8" or gpu["tensor_cores"]["int8"]]
    order = {c.label: i for i, c in enumerate(CHOICES)}
    return sorted(ok, key=lambda c: (paper_cost(gpu, n_out, n_in, c, rows), order[c.label]))
