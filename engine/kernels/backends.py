"""The one place that decides hardware-dependent choices.

Each choice has an ``available()`` probe returning (ok, reason) and is picked by
an explicit name (from a plan or profile) or by ``auto``. Asking for something
the machine lacks raises KernelUnavailableError naming it and the fix; there is
no silent fallback. Quantized-matmul kernels live in ``quant.matmul_kernels`` (same
probe style); this module owns attention and execution choices.

Every probe reads a ``HardwareFacts`` (what the machine has). ``probe_hardware``
asks the machine; tests build the facts themselves (``facts_for_gpu`` turns a
catalog entry into the facts of that GPU), so no import is monkeypatched.

Attention backends are ``AttentionBackend``s (engine/core/attention.py). All
align ``causal=True`` bottom-right when there are fewer queries than keys (query
i of T sees keys <= S - T + i), as flash-attn does. flash-attn's
``with_cache(q, k_cache, v_cache, ctx, window)`` reads the whole static cache in place
with per-row lengths (``cache_seqlens`` from the forward's positions, ``cache_batch_idx`` from its rows), so a ragged
batch needs no gather and no mask; it returns None when the block does not fit
that form and the model then uses the masked call.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from engine.core.attention import AttentionBackend, AttentionContext, math_attention, sdpa_attention
from engine.core.errors import KernelUnavailableError

log = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("sdpa", "math", "flash-attn-2")
ATTENTION_CHOICES = ATTENTION_BACKENDS + ("auto",)
FLASH_MIN_CC = (8, 0)
FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class HardwareFacts:
    """What a machine offers the choices below (probed, or stated by a test)."""

    device_type: str  # "cpu" | "cuda"
    capability: tuple[int, int] | None = None  # CUDA compute capability
    flash_attn_installed: bool = False
    cuda_graphs: bool = False  # torch can capture CUDA graphs on this device
    nvml: bool = False  # nvidia-ml-py importable

    @property
    def sm(self) -> str:
        return "no GPU" if self.capability is None else f"sm_{self.capability[0]}{self.capability[1]}"


def probe_hardware(device: torch.device | str) -> HardwareFacts:
    """The facts of ``device`` on this machine (imports nothing heavy: find_spec only)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return HardwareFacts(device_type=dev.type, nvml=importlib.util.find_spec("pynvml") is not None)
    cc = torch.cuda.get_device_capability(dev)
    return HardwareFacts(
        device_type="cuda",
        capability=(int(cc[0]), int(cc[1])),
        flash_attn_installed=importlib.util.find_spec("flash_attn") is not None,
        cuda_graphs=torch.cuda.is_available() and hasattr(torch.cuda, "CUDAGraph"),
        nvml=importlib.util.find_spec("pynvml") is not None,
    )


def facts_for_gpu(entry: dict[str, Any], flash_attn_installed: bool, nvml: bool = True) -> HardwareFacts:
    """The facts of a catalog GPU (quant/gpus.json entry) with flash-attn installed or not."""
    from quant.catalog import compute_capability

    return HardwareFacts(
        device_type="cuda",
        capability=compute_capability(entry, entry.get("name", "gpu")),
        flash_attn_installed=flash_attn_installed,
        cuda_graphs=True,
        nvml=nvml,
    )


# ---------------------------------------------------------------- attention


def attention_available(name: str, device: torch.device | str, facts: HardwareFacts | None = None) -> tuple[bool, str]:
    f = facts or probe_hardware(device)
    if name == "sdpa":
        return True, "PyTorch scaled_dot_product_attention"
    if name == "math":
        return True, "two matmuls around an fp32 softmax (row-exact verify with bf16 on the CPU)"
    if name == "flash-attn-2":
        if f.device_type != "cuda":
            return False, "needs a CUDA device (this is the CPU); the plan's CPU variant uses 'sdpa'"
        if f.capability is not None and f.capability < FLASH_MIN_CC:
            return False, f"needs compute capability >= 8.0 (this GPU is {f.sm}); use 'sdpa'"
        if not f.flash_attn_installed:
            return False, "needs the flash-attn package: pip install 'specmix[gpu]' (or choose 'sdpa')"
        return True, f"flash-attn 2 (flash_attn_with_kvcache) on {f.sm}"
    return False, f"unknown attention backend {name!r}; allowed: {', '.join(ATTENTION_CHOICES)}"


def choose_attention(facts: HardwareFacts) -> str:
    """``auto``: flash-attn 2 where it can run (CUDA, cc >= 8.0, package installed), else SDPA."""
    ok, _ = attention_available("flash-attn-2", facts.device_type, facts)
    return "flash-attn-2" if ok else "sdpa"


def select_attention(name: str, device: torch.device | str, facts: HardwareFacts | None = None) -> AttentionBackend:
    """The attention function for ``name`` (or ``auto``) on ``device``; KernelUnavailableError if it cannot run."""
    f = facts or probe_hardware(device)
    if name == "auto":
        name = choose_attention(f)
    ok, why = attention_available(name, device, f)
    if not ok:
        raise KernelUnavailableError(f"attention backend {name!r} is unavailable: {why}")
    log.debug("attention backend %s: %s", name, why)
    return {"sdpa": sdpa_attention, "math": math_attention}.get(name) or FlashAttention()


FlashKernel = Callable[..., Tensor]


class FlashAttention:
    """flash-attn 2 as an ``AttentionBackend`` (flash_attn is imported on first use).

    ``kernels`` maps ``"func"`` / ``"with_kvcache"`` to callables with flash-attn's signatures;
    None imports flash_attn. Tests pass a pure-PyTorch reference to check the layout logic.
    """

    name = "FlashAttention"  # the name engines have reported for it

    def __init__(self, kernels: dict[str, FlashKernel] | None = None) -> None:
        self._kernels = kernels

    def _kernel(self, name: str) -> FlashKernel:
        if self._kernels is None:
            mod = importlib.import_module("flash_attn")
            self._kernels = {"func": mod.flash_attn_func, "with_kvcache": mod.flash_attn_with_kvcache}
        return self._kernels[name]

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        if mask is not None or q.dtype not in FLASH_DTYPES:  # flash has no mask argument and no fp32
            return sdpa_attention(q, k, v, mask, causal)
        out = self._kernel("func")(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
        return out.transpose(1, 2)

    def with_cache(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, ctx: AttentionContext, window: int | None
    ) -> Tensor | None:
        """Attention of q [B,H,T,D] over the cache rows [max_batch,Hkv,S,D] (new keys already written).

        Row b's real positions are pos[b,0] .. pos[b,0]+n_b-1 (n_b <= T; padding queries are
        discarded by the caller), so cache_seqlens = pos[:,0] + T with bottom-right causal
        alignment gives every real query exactly the keys <= its position. None (use the
        masked path) when that length could pass the cache's end or the dtype is not fp16/bf16, and for a draft
        tree (its mask goes to SDPA).
        """
        T, S = q.shape[2], k_cache.shape[2]
        if ctx.slots is not None:  # a draft tree: its mask is no causal window; SDPA runs it (``__call__``)
            return None
        if ctx.kv_len + T > S or q.dtype != k_cache.dtype or (q.is_cuda and q.dtype not in FLASH_DTYPES):
            return None
        seqlens = (ctx.pos[:, 0] + T).clamp(max=S).to(torch.int32)  # padding rows (pos = scratch) clamp
        batch_idx = None if ctx.rows_are_prefix or ctx.rows is None else ctx.rows.to(torch.int32)
        win = (window - 1, 0) if window is not None else (-1, -1)
        out = self._kernel("with_kvcache")(
            q.transpose(1, 2),
            k_cache.transpose(1, 2),
            v_cache.transpose(1, 2),
            cache_seqlens=seqlens,
            cache_batch_idx=batch_idx,
            causal=True,
            window_size=win,
        )
        return out.transpose(1, 2)


# ---------------------------------------------------------------- CUDA graphs


def cuda_graphs_available(facts: HardwareFacts) -> tuple[bool, str]:
    if facts.device_type != "cuda":
        return False, "CUDA graphs need a CUDA device (this is the CPU)"
    if not facts.cuda_graphs:
        return False, "this torch build cannot capture CUDA graphs (torch.cuda.CUDAGraph missing)"
    return True, f"CUDA graphs on {facts.sm}"


def require_cuda_graphs(facts: HardwareFacts, where: str = "runtime.cuda_graphs") -> None:
    ok, why = cuda_graphs_available(facts)
    if not ok:
        raise KernelUnavailableError(
            f"{where}: CUDA graphs are unavailable: {why}; set {where}.enabled to false or run on a CUDA GPU"
        )


# ---------------------------------------------------------------- NVML


def detect_gpu_name(index: int = 0) -> str:
    """The name NVML reports for GPU ``index`` (for ``--gpu auto``); KernelUnavailableError when none."""
    try:
        import pynvml  # nvidia-ml-py, optional
    except ImportError:
        raise KernelUnavailableError(
            "--gpu auto needs NVML: pip install 'specmix[nvml]' (nvidia-ml-py) "
            "on a machine with an NVIDIA GPU; or name the GPU with --gpu NAME"
        ) from None
    try:
        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index))
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as e:
        raise KernelUnavailableError(
            f"--gpu auto: NVML found no NVIDIA GPU ({e}); name the GPU with --gpu NAME"
        ) from None
    return name.decode() if isinstance(name, bytes) else str(name)
