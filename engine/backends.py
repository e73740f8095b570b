"""The one place that decides hardware-dependent choices.

Each choice has an ``available()`` probe returning (ok, reason) and is picked by
an explicit name (from a plan or profile) or by ``auto``. Asking for something
the machine lacks raises KernelUnavailableError naming it and the fix; there is
no silent fallback. Quantized-matmul kernels live in ``quant.kernels`` (same
probe style); this module owns attention and execution choices.
"""
from __future__ import annotations

import importlib.util

import torch

from .errors import KernelUnavailableError
from .model import AttentionFn, sdpa_attention

ATTENTION_BACKENDS = ("sdpa", "flash-attn-2")


def _cc(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def attention_available(name: str, device: torch.device) -> tuple[bool, str]:
    if name == "sdpa":
        return True, "PyTorch scaled_dot_product_attention"
    if name == "flash-attn-2":
        if device.type != "cuda":
            return False, "needs a CUDA device (this is the CPU); the plan's CPU variant uses 'sdpa'"
        cc = _cc(device)
        if cc is not None and cc < (8, 0):
            return False, f"needs compute capability >= 8.0 (this GPU is sm_{cc[0]}{cc[1]}); use 'sdpa'"
        if importlib.util.find_spec("flash_attn") is None:
            return False, "needs the flash-attn package: pip install 'specmix[gpu]' (or choose 'sdpa')"
        return True, "flash-attn 2"
    return False, f"unknown attention backend; allowed: {', '.join(ATTENTION_BACKENDS)}"


def select_attention(name: str, device: torch.device) -> AttentionFn:
    """The attention function for ``name`` on ``device``; KernelUnavailableError if it cannot run here."""
    ok, why = attention_available(name, device)
    if not ok:
        raise KernelUnavailableError(f"attention backend {name!r} is unavailable: {why}")
    if name == "sdpa":
        return sdpa_attention
    return _flash_attention


def _flash_attention(q, k, v, mask, causal):  # pragma: no cover - needs flash-attn on a GPU
    from flash_attn import flash_attn_func

    if mask is not None:  # a verify block at a cache offset: keys beyond each query are masked by position
        return sdpa_attention(q, k, v, mask, causal)
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
    return out.transpose(1, 2)


def detect_gpu_name(index: int = 0) -> str:
    """The name NVML reports for GPU ``index`` (for ``--gpu auto``); KernelUnavailableError when none."""
    try:
        import pynvml  # nvidia-ml-py, optional
    except ImportError:
        raise KernelUnavailableError("--gpu auto needs NVML: pip install 'specmix[nvml]' (nvidia-ml-py) "
                                     "on a machine with an NVIDIA GPU; or name the GPU with --gpu NAME") from None
    try:
        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index))
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as e:
        raise KernelUnavailableError(f"--gpu auto: NVML found no NVIDIA GPU ({e}); name the GPU with --gpu NAME") \
            from None
    return name.decode() if isinstance(name, bytes) else str(name)
