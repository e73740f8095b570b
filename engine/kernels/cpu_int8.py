"""INT8 weight-only Linears on the CPU's few-row C++ GEMM (engine/kernels/csrc/int8_gemm.cpp), no fp32 copy.

Why: a decode step or a verify pass streams every weight once per call, so its time is the bytes read. The
kernel reads the int8 weight (a quarter of fp32's bytes, half of bf16's) and dequantizes it in registers
(q * s in fp32, the very product ``quant.int8`` dequantizes to), then accumulates as the fp32 kernel does:
its outputs equal ``small_gemm`` on the dequantized weight bit for bit, for any row count (tested), so a
verify pass equals the one-token steps and every path that reads an INT8 weight computes the same numbers.

Where it runs, by the paths of kernel ``w8a16`` on the CPU (``CPU_INT8_PATHS``, each with its probe):

- ``int8-amx``: on a CPU with AMX-INT8, for a model whose every such Linear it runs (per channel or in groups
  of a multiple of 64, ``AMX_MIN_GROUP``; ``uses_int8_amx``), the tile GEMM (engine/kernels/csrc/int8_amx.cpp) in
  place of ``int8-gemm``, on the same calls: the int8 weight read as it is held, each fp32 input row split into
  four int8 parts (each input kept to 2^-27 of its row's largest), exact integer tile sums scaled in fp32.
  Row-independent too, but not the fp32 kernel's bits: one kernel per model, so its step, row kernel and verify
  passes agree.
- ``int8-gemm``: the C++ GEMM, per output channel or per group of a multiple of the vector width (32, 64 and
  128 on AVX2 and AVX-512): inside the decode step (engine/kernels/cpu_decode.py: decode, verify, prefill and
  a draft model's steps) and, through ``Int8Linear.use_row_kernel``, for any fp32 input of at most
  ``MAX_ROWS`` rows outside it.
- ``dequant-tile``: more rows outside the step (a no-cache forward, the quality gate): ``quant.int8.dequant_linear``
  dequantizes a tile of output rows at a time into one buffer and runs a float GEMM per tile.

``torch._int_mm`` (W8A8) is faster than both at many rows on this CPU but quantizes the activations, which is
another model than the one the gate measured for ``w8a16``; it runs the plan's ``w8a8`` kernel
(``quant.int8.int_mm``). docs/performance.md has the measurements.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from engine.core.errors import KernelUnavailableError
from engine.core.model import MLP, Attention
from engine.kernels.cpu_gemm import MAX_ROWS, amx_status, cpu_kernels, small_gemm_status
from quant.candidates import Choice
from quant.int8 import group_count
from quant.linear import Int8Linear

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuInt8Path:
    name: str
    probe: Callable[[Int8Linear], str | None]  # None: it runs this module here, else why not
    what: str


def step_int8_reason(mod: Int8Linear) -> str | None:
    """None when the decode step's C++ kernels compute this module here (w8a16 on the int8 GEMM; w8a8, whose
    per-row int8 activations and exact integer sums the C++ W8A8 kernel reproduces), else why not."""
    if mod.kernel == "w8a8":
        return _cpu_reason(mod)
    return int8_gemm_reason(mod)


def _cpu_reason(mod: Int8Linear) -> str | None:
    if mod.weight.device.type != "cpu" or not mod.weight.is_contiguous():
        return "needs a contiguous CPU weight"
    return small_gemm_status()


def int8_gemm_reason(mod: Int8Linear) -> str | None:
    """None when the C++ int8 GEMM can read this module's weight with fp32 inputs here (w8a16), else why not."""
    if mod.kernel != "w8a16":
        return f"kernel {mod.kernel!r} is not w8a16 (the weight-only kernel)"
    if mod.smooth is not None:
        return "SmoothQuant factors divide the input (w8a16 without smoothing only)"
    why = _cpu_reason(mod)
    if why is not None:
        return why
    mult = cpu_kernels().int8_group_multiple()
    if mod.group_size is not None and mod.group_size % mult:
        return f"group size {mod.group_size} is not a multiple of {mult} (the vector width)"
    return None


# the AMX-INT8 tiles run a model's INT8 Linears per channel or in groups of a multiple of this: groups of 32 (a
# conversion of the tile sums per 32 k) stay on the AVX-512 kernel, faster at a few rows (docs/performance.md)
AMX_MIN_GROUP = 64


def int8_amx_reason(mod: Int8Linear) -> str | None:
    """None when the AMX-INT8 tile GEMM can read this module's weight with fp32 inputs here, else why not."""
    why = int8_gemm_reason(mod)
    if why is not None:
        return why
    k = cpu_kernels()
    if k.int8_amx_status():
        return k.int8_amx_status()
    mult = k.int8_amx_group_multiple()
    if mod.group_size is not None and mod.group_size % mult:
        return f"group size {mod.group_size} is not a multiple of {mult} (a weight tile's k)"
    if mod.group_size is not None and mod.group_size % AMX_MIN_GROUP:
        return (
            f"group size {mod.group_size}: the tiles convert and scale each group's sums, slower than the AVX-512 "
            f"int8 GEMM at a few rows for groups below {AMX_MIN_GROUP} (docs/performance.md)"
        )
    return None


def _fused_groups(model: nn.Module) -> list[tuple[nn.Module, ...]]:
    """The Linears the decode step stacks into one GEMM: each attention's q/k/v, each MLP's gate/up."""
    fused: list[tuple[nn.Module, ...]] = []
    for m in model.modules():
        if isinstance(m, Attention):
            fused.append((m.q_proj, m.k_proj, m.v_proj))
        elif isinstance(m, MLP):
            fused.append((m.gate_proj, m.up_proj))
    return fused


def uses_int8_amx(model: nn.Module) -> bool:
    """Whether ``model``'s weight-only INT8 Linears run on AMX-INT8 tiles in the C++ paths (the step and the row
    kernel): where the tiles run every one the int8 GEMMs read, and the Linears the step stacks share one grouping.
    The tiles scale each group's integer sum, so a stack whose scales are repeated at a finer grouping than a
    Linear's own would give that Linear other bits in the step than alone; on the AVX-512 kernel (each weight
    dequantized as q * s) the grouping never changes a bit. One kernel per model, so every path computes the same
    numbers."""
    mods = [m for m in int8_linears(model) if int8_gemm_reason(m) is None]
    if not mods or any(int8_amx_reason(m) is not None for m in mods):
        return False
    return all(len({p.group_size for p in parts if isinstance(p, Int8Linear)}) <= 1 for parts in _fused_groups(model))


CPU_INT8_PATHS = (
    CpuInt8Path(
        "int8-amx",
        int8_amx_reason,
        "AMX-INT8 tiles reading int8, fp32 inputs split into exact int8 parts (a model whose every such Linear "
        "they run, its stacked ones alike grouped: uses_int8_amx; the decode step and <= MAX_ROWS rows)",
    ),
    CpuInt8Path("int8-gemm", int8_gemm_reason, "C++ few-row GEMM reading int8 (the decode step; <= MAX_ROWS rows)"),
    CpuInt8Path("dequant-tile", lambda mod: None, "weight dequantized a tile at a time + float GEMM (many rows)"),
)


def int8_linears(model: nn.Module) -> list[Int8Linear]:
    return [m for m in model.modules() if isinstance(m, Int8Linear)]


def install_int8_row_kernels(model: nn.Module) -> int:
    """Every Int8Linear of ``model`` that the C++ GEMM can read runs its inputs of at most MAX_ROWS rows on it;
    returns their number (the others' reasons are logged once per reason)."""
    n, reasons = 0, set()
    amx = uses_int8_amx(model)
    for mod in int8_linears(model):
        why = int8_gemm_reason(mod)
        if why is None:
            mod.use_row_kernel(cpu_kernels().int8_amx_gemm if amx else cpu_kernels().int8_gemm, MAX_ROWS)
            n += 1
        else:
            mod.use_row_kernel(None)
            reasons.add(why)
    for why in sorted(reasons):
        log.info("INT8 Linears stay on the dequantize-by-tile path: %s", why)
    return n


@dataclass(frozen=True)
class Int8Weight:
    """An int8 GEMM weight as the C++ step reads it: data [N, K], float32 scales, group size (0: per row; -1:
    W8A8, activations quantized per row after the division by ``smooth`` [K], empty for none)."""

    q: Tensor
    scale: Tensor
    group: int
    smooth: Tensor


def _scales_at(mod: Int8Linear, group: int | None) -> Tensor:
    """The module's scales, one per ``group`` input channels (None: per row): its own tensor when that is its
    grouping, else each scale repeated over the finer groups it covers (the same products q * s)."""
    if group == mod.group_size:
        return mod.weight_scale.detach()
    assert group is not None
    cols = torch.arange(group_count(mod.in_features, group)) * group
    if mod.group_size is None:
        return mod.weight_scale.detach()[:, None].expand(-1, cols.numel()).contiguous()
    return mod.weight_scale.detach()[:, cols // mod.group_size].contiguous()


def fused_int8(mods: tuple[nn.Module, ...]) -> Int8Weight | None:
    """One int8 weight stacking the modules' outputs (q/k/v or gate/up), for the C++ step; None unless all are
    Int8Linears it can read (a W8A8 one only alone). Their weights become views of the stacked one (no bytes added, as
    ``fuse_projections`` does for float Linears); scales stay shared where the modules scale alike, else they
    are repeated at the finest grouping, whose groups each coarser one divides exactly."""
    if len(mods) == 1 and isinstance(mods[0], Int8Linear) and step_int8_reason(mods[0]) is None:
        p = mods[0]
        w8a8 = p.kernel == "w8a8"
        smooth = p.smooth.detach() if w8a8 and p.smooth is not None else torch.empty(0)
        return Int8Weight(p.weight.detach(), p.weight_scale.detach(), -1 if w8a8 else p.group_size or 0, smooth)
    if not all(isinstance(m, Int8Linear) and int8_gemm_reason(m) is None for m in mods):
        return None
    parts: list[Int8Linear] = list(mods)  # type: ignore[arg-type]
    groups = {p.group_size for p in parts}
    finest = min((g for g in groups if g is not None), default=None)
    if any(g is not None and finest is not None and g % finest for g in groups):
        return None
    q = torch.cat([p.weight.detach() for p in parts])
    for p, view in zip(parts, q.split([p.out_features for p in parts])):
        p.weight = nn.Parameter(view, requires_grad=False)
    if len(groups) == 1:  # the same grouping: the modules' scales become views of the stacked ones too
        scale = torch.cat([p.weight_scale.detach() for p in parts])
        for p, view in zip(parts, scale.split([p.out_features for p in parts])):
            p.weight_scale = nn.Parameter(view, requires_grad=False)
    else:
        scale = torch.cat([_scales_at(p, finest) for p in parts])
    return Int8Weight(q, scale, finest or 0, torch.empty(0))


# how the decode step can hold a dense Linear's weight: on the few-row GEMM in fp32 or a lossless 16-bit copy,
# or bf16 on AMX tiles (engine/kernels/step_weights.py ``dense_step_storage`` says which a model gets)
DENSE_STORAGES = MappingProxyType(
    {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "bf16-amx": torch.bfloat16}
)


@dataclass
class CpuCostMeter:
    """The planner's measured cost on this CPU (``quant.candidates.CostFn``): one call of the kernel the decode
    step runs for a candidate (the int8 GEMM on AMX-INT8 tiles where the tiles run the candidate's grouping, else
    on AVX-512: a model mixing groupings the tiles do not run keeps all on AVX-512, so there the cost is optimistic;
    W8A8; or for the dense Linear the kernel and storage the step gives the model's dense weights) at ``rows`` rows
    (default: a verify pass of K + 1 <= 8 rows at batch 1), on weights cycled through ``stream_bytes`` so they come
    from memory as a model's do, not from cache; the median of ``repeats`` timings, cached per shape."""

    rows: int = 8
    stream_bytes: int = 64 << 20
    repeats: int = 5
    dense: str = "fp32"
    """How the step runs the dense Linear: a key of ``DENSE_STORAGES`` (a bf16-valued checkpoint on a CPU with
    AMX: "bf16-amx", whose verify rows come almost free)."""
    cache: dict[tuple[str, int, int, int], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dense not in DENSE_STORAGES:
            raise ValueError(f"dense={self.dense!r} is invalid: allowed {', '.join(DENSE_STORAGES)}")
        if self.dense == "bf16-amx" and amx_status() is not None:
            raise KernelUnavailableError(f"dense='bf16-amx' needs AMX tiles: {amx_status()}")

    def __call__(self, choice: Choice, n_out: int, n_in: int, rows: int) -> float:
        key = (choice.label, n_out, n_in, min(rows, self.rows))
        if key not in self.cache:
            self.cache[key] = self._measure(choice, n_out, n_in, key[3])
        return self.cache[key]

    def _measure(self, choice: Choice, n_out: int, n_in: int, rows: int) -> float:
        k = cpu_kernels()
        g = torch.Generator().manual_seed(0)
        lin = nn.Linear(n_in, n_out, bias=False)
        with torch.no_grad():
            lin.weight.normal_(0, 0.05, generator=g)
        x = torch.randn(rows, n_in, generator=g)
        if choice.kernel == "dense":
            copies, run = self._dense(k, lin.weight.detach(), x)
        else:
            mod = Int8Linear.from_float(lin, choice.kernel, group_size=choice.group_size)
            s, grp = mod.weight_scale.detach(), mod.group_size or 0
            copies = [mod.weight.detach().clone() for _ in range(self._copies(mod.weight))]
            if choice.kernel == "w8a8":
                run = lambda t: k.w8a8_gemm(x, t, s, torch.empty(0))  # noqa: E731
            else:
                gemm = k.int8_amx_gemm if int8_amx_reason(mod) is None else k.int8_gemm
                run = lambda t: gemm(x, t, s, grp)  # noqa: E731
        times = []
        for _ in range(self.repeats + 1):  # the first round warms up
            t0 = time.perf_counter()
            for t in copies:
                run(t)
            times.append((time.perf_counter() - t0) / len(copies))
        return statistics.median(times[1:])

    def _dense(self, k: Any, w: Tensor, x: Tensor) -> tuple[list[Tensor], Callable[[Tensor], Tensor]]:
        """Copies of the dense weight as the step holds it, and the kernel that reads one."""
        held = w.to(DENSE_STORAGES[self.dense])
        if self.dense == "bf16-amx":
            n = w.shape[0]
            return [k.amx_pack(held) for _ in range(self._copies(held))], lambda t: k.amx_gemm(x, t, n)
        return [held.clone() for _ in range(self._copies(held))], lambda t: k.small_gemm(x, t)

    def _copies(self, w: Tensor) -> int:
        return max(1, min(64, self.stream_bytes // max(1, w.numel() * w.element_size())))
