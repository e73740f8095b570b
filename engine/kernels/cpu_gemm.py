"""fp32 CPU linears for the few rows of a decode step or a verify pass (engine/kernels/csrc/small_gemm.cpp).

Why: PyTorch's fp32 linear (MKL) streams the weights at memory speed for one row,
but from 4 rows on it switches to a GEMM kernel that can cost about twice a row. A
speculative verify pass is such a GEMM, so the verify of K+1 tokens would cost about
two decode steps and only a small K would pay. The small kernel here (AVX-512 or AVX2) streams
each block of weight rows once and reuses it from L1 for every input row, so a verify
pass of a few tokens costs little more than a step (docs/performance.md has the figures).

Every output is one dot product accumulated in the same order for any row count,
so row m of a verify pass equals the one-row step bit for bit (tested); with MKL
they differ in the last bits. Above MAX_ROWS rows (a prefill) ``F.linear`` runs.

fp16 and bf16 weights are widened to fp32 in registers (exact; half the bytes to stream): the draft's
decode step (engine/kernels/cpu_decode.py, built into the same extension) stores its weights so, and a target
whose weights are bf16 values (a bf16 checkpoint) runs on Intel AMX tiles where the CPU has them
(engine/kernels/csrc/amx_gemm.cpp).

The kernel is compiled on first use with torch's extension builder (a C++ compiler
and ninja; once, then cached in ``build_directory``: under $TORCH_EXTENSIONS_DIR or torch's cache
root, one directory per Python, torch and source version). A build killed half way leaves torch's
lock file there and torch would wait on it forever: a lock older than ``STALE_LOCK_S`` is removed,
with a warning, before the build (``clear_stale_lock``).
``small_gemm_status()`` says whether this machine can run it and, if not, why;
``SmallGemmLinear`` has the same API and parameters as the ``nn.Linear`` it replaces,
and ``F.linear`` is its fallback with the same API (tests compare the two).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core.errors import KernelUnavailableError
from engine.core.model import FusedLinear, StoredLinear
from engine.core.stored_linear import KeepsStorage

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in (
        "small_gemm.cpp",
        "int8_gemm.cpp",
        "int8_amx.cpp",
        "amx_gemm.cpp",
        "attention.cpp",
        "decode_layers.cpp",
        "decode_model.cpp",
        "head_step.cpp",
        "bindings.cpp",
    )
]
SMALL_GEMM_DTYPES = (torch.float32, torch.float16)  # the weights the kernel reads (activations fp32)
MAX_ROWS = 32  # up to here the kernel beats MKL on the demo target's shapes (docs/performance.md)
KERNEL_NAME = "small-gemm-fp32"


# the compiler flags of each instruction set the kernels are built for (engine/kernels/csrc/simd.h), by
# PyTorch's name for the CPU's capability; AMX tiles come only with AVX-512 (an AVX2 build leaves them out)
ISA_FLAGS = {"AVX512": ["-mavx512f"], "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DSPECMIX_NO_AMX"]}


def cpu_isa() -> str:
    """PyTorch's name for this CPU's vector capability (``AVX512``, ``AVX2``, ``DEFAULT``, ...)."""
    return str(torch.backends.cpu.get_cpu_capability())


def _unsupported_reason() -> str | None:
    """Why this machine cannot build or run the kernel, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"needs an x86-64 CPU (this is {platform.machine()})"
    if cpu_isa() not in ISA_FLAGS:
        return f"needs AVX-512 or AVX2 (PyTorch reports CPU capability {cpu_isa()})"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"needs a C++ compiler ({cxx!r} not found)"
    if shutil.which("ninja") is None:
        return "needs ninja (pip install ninja)"
    return None


@functools.cache
def source_tag() -> str:
    """A hash of the C++ sources and headers: each version builds in a directory of its own, so checkouts or
    installs of different versions on one machine never rebuild, or wait on, one another's binary."""
    h = hashlib.sha256()
    for f in sorted(CSRC.iterdir()):
        if f.suffix in (".cpp", ".h"):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


STALE_LOCK_S = 900.0  # a build takes 1-3 minutes on 2 cores: a lock older than this is a killed build's


def build_directory(name: str) -> Path:
    """Where the extension ``name`` builds: $TORCH_EXTENSIONS_DIR (else torch's cache root), then this Python's and
    torch's versions (the binary is theirs), then the name (created if missing)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    py = f"py{sys.version_info[0]}{sys.version_info[1]}{sys.abiflags}"
    versions = f"{py}_torch{torch.__version__.replace('+', '_')}"
    d = Path(root) / versions / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def clear_stale_lock(directory: Path, stale_s: float = STALE_LOCK_S) -> bool:
    """Remove torch's build lock in ``directory`` when it is older than ``stale_s`` seconds (left by a build killed
    half way, on which every later build would wait forever): True when one was removed. A younger lock is another
    process's build in progress, which torch waits for (logged)."""
    lock = directory / "lock"
    try:
        seen = lock.stat()
    except FileNotFoundError:
        return False
    age = time.time() - seen.st_mtime
    if age < stale_s:
        log.info("waiting for another process's build of the CPU kernels (lock %s, %.0f s old)", lock, age)
        return False
    try:  # still the same file: another process that cleared it may have taken a fresh lock meanwhile
        now = lock.stat()
    except FileNotFoundError:
        return False
    if (now.st_ino, now.st_mtime) != (seen.st_ino, seen.st_mtime):
        return False
    log.warning("removing a stale build lock of the CPU kernels, %s (%.0f s old: a killed build's)", lock, age)
    lock.unlink(missing_ok=True)
    return True


def _load(name: str, cflags: list[str]) -> tuple[Any, str | None]:
    """torch's extension build of SOURCES: (the module, None) or (None, the compiler's first error line)."""
    from torch.utils.cpp_extension import load

    full = f"{name}_{source_tag()}"
    try:
        directory = build_directory(full)
        clear_stale_lock(directory)
        return load(
            name=full,
            build_directory=str(directory),
            sources=[str(s) for s in SOURCES],
            extra_cflags=["-O3", "-fopenmp", *cflags],
            extra_ldflags=["-fopenmp"],
        ), None
    except (RuntimeError, OSError, ImportError) as e:  # a compiler or linker failure: say so, never hide it
        lines = str(e).strip().splitlines()
        # torch's message starts with the compile command; the compiler's first "error:" line says what broke
        first = next((ln.strip() for ln in lines if "error:" in ln), lines[0] if lines else type(e).__name__)
        log.debug("full build output:\n%s", e)
        return None, first


@functools.cache
def _build() -> tuple[Any, str | None, str | None]:
    """(the compiled module, None, why AMX is off or None) or (None, why not, why not). Built once per process
    for this CPU's instruction set; torch caches the binary. When only the AMX code fails to build (an old
    assembler), the rest is rebuilt without it, so the AVX-512 kernels still run."""
    reason = _unsupported_reason()
    if reason is not None:
        return None, reason, reason
    isa = cpu_isa()
    no_amx = "-DSPECMIX_NO_AMX" in ISA_FLAGS[isa]
    mod, error = _load("specmix_small_gemm" + ("_avx2" if isa == "AVX2" else ""), ISA_FLAGS[isa])
    if mod is not None:
        amx = f"AMX tiles need an AVX-512 CPU with AMX-BF16 (this one has {isa})" if no_amx else mod.amx_status()
        return mod, None, amx or None
    amx_error = error
    if not no_amx:  # only the AMX code may have failed (an old assembler): rebuild without it
        mod, error = _load("specmix_small_gemm_noamx", [*ISA_FLAGS[isa], "-DSPECMIX_NO_AMX"])
    if mod is None:
        log.warning("the fp32 small-GEMM CPU kernel did not build (PyTorch's linear runs instead): %s", error)
        return None, f"the build failed: {error}", f"the build failed: {error}"
    log.warning("the AMX kernel did not build (the AVX-512 kernels run without it): %s", amx_error)
    return mod, None, f"the AMX code did not build: {amx_error}"


def small_gemm_status() -> str | None:
    """None when the kernel runs here (building it on first call), else the reason it does not."""
    return _build()[1]


def amx_status() -> str | None:
    """None when the AMX tile kernel (bf16-valued weights, engine/kernels/csrc/amx_gemm.cpp) runs here, else why not."""
    return _build()[2]


def cpu_kernels() -> Any:
    """The compiled extension (``small_gemm``, ``DecodeModel``); ``KernelUnavailableError`` saying why not."""
    mod, reason, _ = _build()
    if mod is None:
        raise KernelUnavailableError(f"the fp32 small-GEMM CPU kernel is unavailable: {reason}")
    return mod


def small_gemm_kernel() -> Callable[[Tensor, Tensor], Tensor]:
    """The compiled ``small_gemm(x [M, K] fp32 contiguous, w [N, K] fp32 or fp16 contiguous) -> [M, N]`` (fp32)."""
    return cpu_kernels().small_gemm


def _small_gemm_linear(
    kernel: Callable[[Tensor, Tensor], Tensor], x: Tensor, weight: Tensor, bias: Tensor | None
) -> Tensor:
    """``F.linear(x, weight, bias)`` through the kernel when x has at most MAX_ROWS rows."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or rows > MAX_ROWS or x.dtype != torch.float32 or _needs_torch(x, weight, bias):
        return F.linear(x, weight.to(x.dtype), bias)  # (a 16-bit weight widened)
    y = kernel(x.reshape(rows, x.shape[-1]).contiguous(), weight).view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y.add_(bias)


def _needs_torch(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Autograd or CPU autocast: the kernel has neither (inference never needs them), F.linear has both."""
    if torch.is_autocast_enabled("cpu"):
        return True
    return torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )


def small_gemm_reads(weight: Tensor) -> bool:
    """Whether the kernel reads this weight as it is: contiguous, on the CPU, fp32 or fp16."""
    return weight.device.type == "cpu" and weight.dtype in SMALL_GEMM_DTYPES and weight.is_contiguous()


def _check_weight(weight: Tensor) -> None:
    if not small_gemm_reads(weight):
        raise ValueError(
            f"the small-GEMM kernel needs a contiguous fp32 or fp16 CPU weight, got {weight.dtype} on "
            f"{weight.device} (contiguous={weight.is_contiguous()})"
        )


class SmallGemmLinear(KeepsStorage):
    """Same API and parameters as the fp32 ``nn.Linear`` or fp16 ``StoredLinear`` it replaces (the weight is shared,
    not copied; the kernel widens a 16-bit one in registers, which keeps its storage under ``.to(dtype)``)."""

    def __init__(self, linear: nn.Linear | StoredLinear) -> None:
        super().__init__()
        self.keeps_storage = type(linear) is StoredLinear
        _check_weight(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # shared (a tied LM head stays tied to the embedding)
        self.bias = linear.bias
        self.kernel = small_gemm_kernel()

    def forward(self, x: Tensor) -> Tensor:
        return _small_gemm_linear(self.kernel, x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp32 small-GEMM kernel up to {MAX_ROWS} rows"


class SmallGemmFused(FusedLinear):
    """A fused projection (``model.FusedLinear``) whose GEMM runs on the small-GEMM kernel."""

    def __init__(self, fused: FusedLinear) -> None:
        _check_weight(fused.weight)
        super().__init__(fused.weight, fused.bias)
        self.kernel = small_gemm_kernel()

    def __call__(self, x: Tensor) -> Tensor:
        return _small_gemm_linear(self.kernel, x, self.weight, self.bias)
