"""The planner's measured cost on a GPU (``quant.candidates.CostFn``): each candidate timed as the Linear it
becomes, on the device the profile is built on.

A candidate is the module quant.matmul_kernels runs for it (``Int8Linear`` with its kernel: the Triton W8A16
GEMM, W8A8 ``torch._int_mm``) or the dense Linear, in the compute dtype, at ``rows`` rows (a verify pass of
K + 1 rows at batch 1). The weights are cycled through enough copies to exceed ``stream_bytes``, so they come
from memory as a model's do rather than from the L2 cache. A figure is the median over ``repeats`` passes
(device events around each pass on CUDA), cached per shape. The CPU's planner uses ``CpuCostMeter``
(engine/kernels/cpu_int8.py): there the decode step's C++ kernels are what runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from quant.candidates import Choice
from quant.linear import Int8Linear


@dataclass
class ModuleCostMeter:
    """Seconds for one call of a candidate's Linear on ``device`` (see the module doc)."""

    device: torch.device
    """Where the candidates run."""
    dtype: torch.dtype = torch.float16
    """The compute dtype (the activations' and the dense weight's)."""
    rows: int = 8
    """Input rows per call (capped at the rows asked for)."""
    stream_bytes: int = 256 << 20
    """Weight bytes one timed pass reads at least (more than a GPU's L2 cache)."""
    repeats: int = 5
    """Timed passes (after one warm-up pass)."""
    cache: dict[tuple[str, int, int, int], float] = field(default_factory=dict)
    """Figures measured so far, by (candidate, n_out, n_in, rows)."""

    def __call__(self, choice: Choice, n_out: int, n_in: int, rows: int) -> float:
        key = (choice.label, n_out, n_in, min(rows, self.rows))
        if key not in self.cache:
            with torch.no_grad():
                self.cache[key] = self._measure(choice, n_out, n_in, key[3])
        return self.cache[key]

    def _modules(self, choice: Choice, n_out: int, n_in: int) -> list[nn.Module]:
        g = torch.Generator(device=self.device).manual_seed(0)
        per = n_out * n_in * (torch.finfo(self.dtype).bits // 8 if choice.kernel == "dense" else 1)
        dense = choice.kernel == "dense"
        mods: list[nn.Module] = []
        for _ in range(max(1, min(64, self.stream_bytes // max(1, per)))):
            lin = nn.Linear(n_in, n_out, bias=False, device=self.device, dtype=self.dtype)
            lin.weight.normal_(0, 0.05, generator=g)
            mods.append(lin if dense else Int8Linear.from_float(lin, choice.kernel, group_size=choice.group_size))
        return mods

    def _measure(self, choice: Choice, n_out: int, n_in: int, rows: int) -> float:
        mods = self._modules(choice, n_out, n_in)
        x = torch.randn(rows, n_in, device=self.device, dtype=self.dtype)

        def one_pass() -> None:
            for m in mods:
                m(x)

        timer = self._cuda_pass if self.device.type == "cuda" else self._host_pass
        times = [timer(one_pass) for _ in range(self.repeats + 1)][1:]  # the first pass warms up
        return statistics.median(times) / len(mods)

    @staticmethod
    def _host_pass(fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    @staticmethod
    def _cuda_pass(fn: Callable[[], None]) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3
