"""Kernel registry: *how* a quantized Linear computes (the *what* is in the module / plan).

Each kernel has a family (``fp8`` or ``int8``), a name, an ``available(device)``
probe returning ``(ok, reason)`` and an implementation ``impl(module, x2d) ->
y2d`` that reads the module's stored data (``weight``, ``weight_scale``,
optional ``smooth``, ``bias``) and returns the compute dtype of ``x2d``. All
kernels of a family take the very same module and input, so a test can run
each of them on the same data and compare.

    fp8/native       torch._scaled_mm, per-token x scales x per-channel w scales
                     (CPU; CUDA compute capability >= 8.9)
    fp8/te           transformer-engine te.Linear under fp8_autocast (CUDA >= 8.9)
    fp8/weight-only  FP8 storage dequantized to the compute dtype, then F.linear (anywhere); on CUDA with
                     Triton, fp16/bf16 inputs run the Triton GEMM that reads the e4m3 bytes (quant/triton_w8a16.py)
    int8/w8a8        int8 x int8 -> int32 GEMM, per-token dynamic x scales (torch._int_mm: CUDA >= 7.5, and
                     the CPU, where oneDNN runs it faster than a float GEMM; the decode step's C++
                     kernel computes the same numbers: engine/kernels/csrc/int8_gemm.cpp)
    int8/llm-int8    bitsandbytes LLM.int8 (int8 matmul + fp16 outlier columns, threshold 6.0)
    int8/w8a16       INT8 weight-only: int8 weights with a float32 scale per output channel or per
                     group of input channels, activations unquantized (anywhere). CPU: a fp32 input of at
                     most ``row_kernel_rows`` rows goes to the module's row kernel where the kernels layer
                     installed one (``Int8Linear.use_row_kernel``: engine/kernels/cpu_int8.py, the C++
                     few-row GEMM reading the int8 bytes); every other input to ``quant.int8.dequant_linear``
                     (the weight dequantized a tile at a time into one buffer, a float GEMM per tile). No
                     dense copy is kept (torch's _weight_int8pack_mm and W8A8 torch._int_mm are slower on
                     the CPU: docs/performance.md). CUDA: fp16/bf16 inputs run the Triton GEMM that reads
                     the int8 weight (quant/triton_w8a16.py) where Triton is installed; fp32 inputs (and a
                     machine without Triton) torch._weight_int8pack_mm for <= 16 rows of a per-channel
                     weight where torch has its CUDA kernel, otherwise dequantized on the fly, then F.linear.

engine/kernels/backends.py chooses among them; a kernel the machine lacks is a
KernelUnavailableError naming it and what would provide it, never a fallback.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.core.errors import InvalidConfigError, KernelUnavailableError

from .fp8 import dequantize_fp8, quantize_fp8_rowwise
from .int8 import dequant_linear, dequantize_int8, dequantize_int8_groupwise, int_mm, quantize_int8_rowwise

log = logging.getLogger(__name__)

LLM_INT8_THRESHOLD = 6.0
W8A16_PACKED_ROWS = 16  # CUDA: up to this many rows use torch._weight_int8pack_mm (per-channel weights)
MIN_BITSANDBYTES = (0, 45)
_FP16_MAX = float(torch.finfo(torch.float16).max)

Probe = Callable[[torch.device], "tuple[bool, str]"]
Impl = Callable[[Any, Tensor], Tensor]


@dataclass(frozen=True)
class Kernel:
    family: str
    name: str
    provider: str  # what provides it (named in errors)
    probe: Probe
    impl: Impl

    def available(self, device: torch.device | str = "cpu") -> tuple[bool, str]:
        return self.probe(torch.device(device))


# ---------------------------------------------------------------- probes


def _cc(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _sm(cc: tuple[int, int]) -> str:
    return f"sm_{cc[0]}{cc[1]}"


def _probe_fp8_native(device: torch.device) -> tuple[bool, str]:
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return (
            False,
            f"fp8 kernel 'native' needs torch._scaled_mm (torch >= 2.5); torch {torch.__version__} lacks it — "
            "use 'weight-only'",
        )
    if device.type == "cpu":
        return True, "torch._scaled_mm on the CPU"
    if device.type == "cuda":
        cc = _cc(device)
        if cc >= (8, 9):
            return True, f"torch._scaled_mm on {_sm(cc)}"
        return False, (
            f"fp8 kernel 'native' needs compute capability >= 8.9 or the CPU; this device is "
            f"{_sm(cc)} — use 'weight-only'"
        )
    return False, f"fp8 kernel 'native' runs on the CPU or CUDA, not {device.type} — use 'weight-only'"


def _probe_fp8_te(device: torch.device) -> tuple[bool, str]:
    if importlib.util.find_spec("transformer_engine") is None:
        return False, (
            "fp8 kernel 'te' needs transformer_engine (pip install 'specmix[gpu]' or "
            "transformer-engine[pytorch]) on a CUDA GPU with compute capability >= 8.9; it is not "
            "installed — use 'native' or 'weight-only'"
        )
    if device.type != "cuda":
        return False, f"fp8 kernel 'te' (transformer_engine) runs on CUDA only, not {device.type} — use 'native'"
    cc = _cc(device)
    if cc < (8, 9):
        return False, (
            f"fp8 kernel 'te' (transformer_engine) needs compute capability >= 8.9; this device is "
            f"{_sm(cc)} — use 'weight-only'"
        )
    return True, f"transformer_engine on {_sm(cc)}"


def _probe_weight_only(device: torch.device) -> tuple[bool, str]:
    if device.type == "cuda" and _has_triton():
        return True, (
            f"the Triton GEMM reading the e4m3 bytes (quant/triton_w8a16.py) for fp16/bf16 inputs on "
            f"{_sm(_cc(device))}; fp32 inputs dequantize + F.linear"
        )
    return True, f"dequantize + F.linear on {device.type}"


def _probe_w8a8(device: torch.device) -> tuple[bool, str]:
    if not hasattr(torch, "_int_mm"):
        return False, f"int8 kernel 'w8a8' needs torch._int_mm; torch {torch.__version__} lacks it — use 'llm-int8'"
    if device.type == "cpu":
        return True, "torch._int_mm (oneDNN) on the CPU; the decode step's C++ W8A8 kernel, same numbers"
    if device.type == "cuda":
        cc = _cc(device)
        if cc >= (7, 5):
            return True, f"torch._int_mm on {_sm(cc)}"
        return False, (
            f"int8 kernel 'w8a8' needs INT8 tensor cores (compute capability >= 7.5) or the CPU; "
            f"this device is {_sm(cc)} — plan the FFN in fp16"
        )
    return False, f"int8 kernel 'w8a8' runs on the CPU or CUDA, not {device.type}"


def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _has_cuda_int8pack() -> bool:
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", "CUDA"))


def _probe_w8a16(device: torch.device) -> tuple[bool, str]:
    if device.type == "cpu":
        return True, (
            "the few-row C++ int8 GEMM where installed (engine/kernels/cpu_int8.py), else int8 weights "
            "dequantized a tile at a time + GEMM, on the CPU (no dense copy kept)"
        )
    if device.type == "cuda":
        if _has_triton():
            return True, (
                f"the Triton int8 GEMM (quant/triton_w8a16.py) for fp16/bf16 inputs on {_sm(_cc(device))}; "
                "fp32 inputs dequantize on the fly + F.linear"
            )
        packed = (
            f"torch._weight_int8pack_mm for <= {W8A16_PACKED_ROWS} rows of per-channel weights, "
            if _has_cuda_int8pack()
            else ""
        )
        return True, f"{packed}dequantize on the fly + F.linear on {_sm(_cc(device))} (no Triton)"
    return True, f"dequantize on the fly + F.linear on {device.type}"


def _bnb_version() -> tuple[int, ...] | None:
    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    try:
        v = importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(p) for p in v.split(".")[:2] if p.isdigit())


def _probe_llm_int8(device: torch.device) -> tuple[bool, str]:
    v = _bnb_version()
    if v is None or v < MIN_BITSANDBYTES:
        have = "not installed" if v is None else "version " + ".".join(map(str, v))
        return False, (
            f"int8 kernel 'llm-int8' needs bitsandbytes >= 0.45 (pip install 'bitsandbytes>=0.45'); "
            f"it is {have} — use 'w8a8'"
        )
    if device.type == "cpu":
        return True, "bitsandbytes LLM.int8 on the CPU"
    if device.type == "cuda":
        cc = _cc(device)
        if cc >= (7, 5):
            return True, f"bitsandbytes LLM.int8 on {_sm(cc)}"
        return False, (
            f"int8 kernel 'llm-int8' needs INT8 tensor cores (compute capability >= 7.5); this device "
            f"is {_sm(cc)} — plan the FFN in fp16"
        )
    return False, f"int8 kernel 'llm-int8' runs on the CPU or CUDA, not {device.type}"


# ---------------------------------------------------------------- implementations


def _add_bias(y: Tensor, bias: Tensor | None) -> Tensor:
    return y if bias is None else y + bias.to(y.dtype)


def _pad2(t: Tensor, rows: int, cols: int, value: float = 0.0) -> Tensor:
    r, c = t.shape
    if (r, c) == (rows, cols):
        return t
    if t.dtype == torch.float8_e4m3fn:  # F.pad has no fp8 kernel
        out = torch.zeros(rows, cols, dtype=t.dtype, device=t.device)
        out[:r, :c] = t
        return out
    return F.pad(t, (0, cols - c, 0, rows - r), value=value)


def _fp8_native(mod: Any, x: Tensor) -> Tensor:
    xq, xs = quantize_fp8_rowwise(x)
    w, ws = mod.weight, mod.weight_scale
    M, K = xq.shape
    N = w.shape[0]
    xs, ws = xs[:, None], ws[None, :]
    if x.device.type == "cuda":
        # cuBLASLt FP8 wants K and N multiples of 16; rowwise scaling wants a bf16 output
        Kp, Np = -(-K // 16) * 16, -(-N // 16) * 16
        xq, w = _pad2(xq, M, Kp), _pad2(w, Np, Kp)
        ws = _pad2(ws, 1, Np, 1.0)
        y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)[:, :N]
    else:
        y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws, out_dtype=x.dtype)
    return _add_bias(y.to(x.dtype), mod.bias)


def _fp8_weight_only(mod: Any, x: Tensor) -> Tensor:
    if x.device.type == "cpu":
        # The CPU has no FP8 memory to save and converts e4m3 far slower than it multiplies, so
        # the dequantized weight (bit-identical to a fresh dequantization) is kept; GPUs never keep it.
        key = ("dequant", x.dtype, mod.weight.data_ptr())
        w = mod.kernel_state.get(key)
        if w is None:
            w = dequantize_fp8(mod.weight, mod.weight_scale, x.dtype)
            mod.kernel_state.clear()
            mod.kernel_state[key] = w
    elif x.dtype in (torch.float16, torch.bfloat16) and x.device.type == "cuda" and _has_triton() and not _grad(x):
        from quant.triton_w8a16 import fp8_weight_matmul

        return _add_bias(fp8_weight_matmul(x, mod.weight, mod.weight_scale), mod.bias)
    else:
        w = dequantize_fp8(mod.weight, mod.weight_scale, x.dtype)
    return F.linear(x, w, None if mod.bias is None else mod.bias.to(x.dtype))


def _fp8_te(mod: Any, x: Tensor) -> Tensor:
    te = importlib.import_module("transformer_engine.pytorch")
    recipe = importlib.import_module("transformer_engine.common.recipe")
    state = mod.kernel_state
    lin = state.get("te")
    if lin is None or lin.weight.device != x.device or lin.weight.dtype != x.dtype:
        # te.Linear keeps its own high-precision copy and FP8 casts (delayed scaling)
        lin = te.Linear(
            mod.in_features, mod.out_features, bias=mod.bias is not None, params_dtype=x.dtype, device=x.device
        )
        with torch.no_grad():
            lin.weight.copy_(dequantize_fp8(mod.weight, mod.weight_scale, x.dtype))
            if mod.bias is not None:
                lin.bias.copy_(mod.bias.to(x.dtype))
        state["te"] = lin
    M = x.shape[0]
    xp = _pad2(x, -(-M // 16) * 16, x.shape[1])  # FP8 GEMMs want the token dim padded too
    with (
        torch.no_grad(),
        te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID)),
    ):
        y = lin(xp)
    return y[:M].to(x.dtype)


def _smoothed(mod: Any, x: Tensor) -> Tensor:
    return x if mod.smooth is None else x / mod.smooth.to(x.dtype)


def _w8a8(mod: Any, x: Tensor) -> Tensor:
    xf = x.float() if mod.smooth is None else x.float() / mod.smooth
    xq, xs = quantize_int8_rowwise(xf)
    acc = int_mm(xq, mod.weight)
    y = acc.float() * xs[:, None] * mod.weight_scale[None, :]
    return _add_bias(y.to(x.dtype), mod.bias)


def _llm_int8(mod: Any, x: Tensor) -> Tensor:
    bnb = importlib.import_module("bitsandbytes")
    functions = importlib.import_module("bitsandbytes.autograd._functions")
    state = functions.MatmulLtState()
    state.threshold = mod.outlier_threshold
    state.has_fp16_weights = False
    state.is_training = False  # the training path dequantizes instead of LLM.int8
    state.CB = mod.weight
    state.SCB = mod.weight_scale * 127.0  # bitsandbytes stores the row absmax
    # LLM.int8 takes fp16 activations: saturate at the fp16 range rather than overflow to inf
    x16 = _smoothed(mod, x.float()).clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)
    bias = None if mod.bias is None else mod.bias.to(torch.float16)
    y = bnb.matmul(x16, mod.weight, bias=bias, state=state)
    return y.to(x.dtype)


def _w8a16_weight(mod: Any, dtype: torch.dtype) -> Tensor:
    if mod.group_size is None:
        return dequantize_int8(mod.weight, mod.weight_scale, dtype)
    return dequantize_int8_groupwise(mod.weight, mod.weight_scale, mod.group_size, dtype)


def _grad(x: Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


def _w8a16(mod: Any, x: Tensor) -> Tensor:
    x = _smoothed(mod, x)
    bias = None if mod.bias is None else mod.bias.to(x.dtype)
    if x.device.type == "cpu":
        rk = mod.row_kernel
        if rk is not None and x.dtype == torch.float32 and x.shape[0] <= mod.row_kernel_rows and not _grad(x):
            y = rk(x.contiguous(), mod.weight, mod.weight_scale, mod.group_size or 0)
            return y if bias is None else y.add_(bias)
        return dequant_linear(x, mod.weight, mod.weight_scale, mod.group_size, bias)
    if x.device.type == "cuda" and x.dtype in (torch.float16, torch.bfloat16) and _has_triton() and not _grad(x):
        from quant.triton_w8a16 import w8a16_matmul

        return _add_bias(w8a16_matmul(x, mod.weight, mod.weight_scale, mod.group_size), bias)
    if x.device.type == "cuda" and mod.group_size is None and x.shape[0] <= W8A16_PACKED_ROWS and _has_cuda_int8pack():
        y = torch._weight_int8pack_mm(x.float().contiguous(), mod.weight, mod.weight_scale)
        return _add_bias(y.to(x.dtype), mod.bias)
    return F.linear(x, _w8a16_weight(mod, x.dtype), bias)


def _build() -> Mapping[tuple[str, str], Kernel]:
    ks = [
        Kernel(
            "fp8", "native", "torch._scaled_mm (CPU, or CUDA compute capability >= 8.9)", _probe_fp8_native, _fp8_native
        ),
        Kernel(
            "fp8",
            "te",
            "transformer-engine (pip install transformer-engine[pytorch]; CUDA >= 8.9)",
            _probe_fp8_te,
            _fp8_te,
        ),
        Kernel("fp8", "weight-only", "torch (dequantize + F.linear)", _probe_weight_only, _fp8_weight_only),
        Kernel("int8", "w8a8", "torch._int_mm (CPU, or CUDA compute capability >= 7.5)", _probe_w8a8, _w8a8),
        Kernel("int8", "llm-int8", "bitsandbytes >= 0.45 (pip install bitsandbytes)", _probe_llm_int8, _llm_int8),
        Kernel(
            "int8",
            "w8a16",
            "Triton int8 GEMM on CUDA (fp16/bf16); torch elsewhere (dequantize + F.linear; the CPU's C++ GEMM)",
            _probe_w8a16,
            _w8a16,
        ),
    ]
    return MappingProxyType({(k.family, k.name): k for k in ks})


KERNELS: Mapping[tuple[str, str], Kernel] = _build()
FP8_KERNELS = tuple(n for f, n in KERNELS if f == "fp8")
INT8_KERNELS = tuple(n for f, n in KERNELS if f == "int8")
ACTIVATION_INT8_KERNELS = ("w8a8", "llm-int8")  # quantize activations too: per-output-channel weights only


def kernel_names(family: str) -> tuple[str, ...]:
    return tuple(n for f, n in KERNELS if f == family)


def get_kernel(family: str, name: str) -> Kernel:
    """The registered kernel; an unknown name is an InvalidConfigError listing the allowed ones."""
    k = KERNELS.get((family, name))
    if k is None:
        allowed = kernel_names(family)
        if not allowed:
            raise InvalidConfigError(f"kernel family {family!r} is unknown; allowed: fp8, int8")
        raise InvalidConfigError(f"{family} kernel={name!r} is unknown; allowed: {', '.join(allowed)}")
    return k


def kernel_available(family: str, name: str, device: torch.device | str = "cpu") -> tuple[bool, str]:
    return get_kernel(family, name).available(device)


def require_kernel(family: str, name: str, device: torch.device | str = "cpu") -> Kernel:
    """The kernel, or KernelUnavailableError naming it and what would provide it."""
    k = get_kernel(family, name)
    ok, reason = k.available(device)
    if not ok:
        raise KernelUnavailableError(reason)
    log.debug("%s kernel %r: %s", family, name, reason)
    return k
