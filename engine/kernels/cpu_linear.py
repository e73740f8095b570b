"""Fast CPU linears by module swap: bf16 on oneDNN-prepacked weights (AMX / AVX512-BF16 kernels), fp32 on
the small-GEMM kernel (engine/kernels/cpu_gemm.py) and a plan's INT8 Linears on the int8 GEMM
(engine/kernels/cpu_int8.py); ``fast_cpu_linears`` picks one for the model's dtype.

Why: on an x86 CPU a speculative verify pass is a GEMM of K+1 rows where a decode
step is a GEMV. PyTorch's default fp32 linear switches kernels between 1 and 2+
rows, and a 5-row pass can cost nearly twice a 1-row step, which eats most of
what speculation saves (measured per row count in docs/performance.md). oneDNN's bf16 matmul with the weight reordered
once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the
packing torch.compile's CPU freezing does) streams the weights at the same rate
for 1 to 16 rows, and reads half the bytes of fp32.

A ``OneDNNLinear`` computes every output row independently of the others (one
packed weight serves every row count); with the ``math`` attention backend
(engine/core/model.py) a verify pass then produces bit for bit the logits the one-token
steps of the same bf16 model would, which ``tests/test_cpu_linear.py`` checks on the
whole model. The fp32 model is a different model numerically; ``tools/bench.py
--dtype bfloat16`` reports how often the bf16 greedy output matches the fp32 one.

Both are a swap of ``nn.Linear`` modules (``pack_linears``, ``small_gemm_linears``), like
quantization. The fused q/k/v and gate/up GEMMs (``model.fuse_projections``) are swapped too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor, nn

from engine.core.errors import InvalidConfigError
from engine.core.model import FusedLinear, StoredLinear, Transformer
from engine.kernels.cpu_gemm import (
    KERNEL_NAME,
    SMALL_GEMM_DTYPES,
    SmallGemmFused,
    SmallGemmLinear,
    small_gemm_status,
)
from engine.kernels.cpu_int8 import install_int8_row_kernels

log = logging.getLogger(__name__)


def onednn_bf16_available() -> bool:
    """This PyTorch build has oneDNN and it runs bf16 on this CPU (AMX / AVX512-BF16, or AVX512 emulating
    bf16, which is slower: docs/performance.md names the machine of each figure)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _pack(weight: Tensor) -> Tensor:
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        raise ValueError(f"oneDNN packing needs a bf16 CPU weight, got {weight.dtype} on {weight.device}")
    # the row count is only a hint for the blocked layout; the packed weight serves every row count
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def _packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class OneDNNLinear(nn.Module):
    """Same API and parameters as the bf16 ``nn.Linear`` it replaces; the packed copy is not saved."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # shared (a tied LM head stays tied to the embedding)
        self.bias = linear.bias
        # a plain attribute, not a buffer: the packed tensor is opaque (no storage for buffers() walkers)
        self.packed = _pack(linear.weight)

    def forward(self, x: Tensor) -> Tensor:
        return _packed_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, oneDNN-packed bf16"


class PackedFused(FusedLinear):
    """A fused projection (``model.FusedLinear``) whose GEMM runs on a packed copy of its weight."""

    def __init__(self, fused: FusedLinear) -> None:
        super().__init__(fused.weight, fused.bias)
        self.packed = _pack(fused.weight)

    def __call__(self, x: Tensor) -> Tensor:
        return _packed_linear(x, self.packed, self.bias)


def _swap_linears(
    model: Transformer,
    dtypes: tuple[torch.dtype, ...],
    make_linear: Callable[[nn.Linear], nn.Module],
    make_fused: Callable[[FusedLinear], FusedLinear],
    types: tuple[type[nn.Module], ...] = (nn.Linear,),
) -> int:
    """Swap every CPU Linear of exactly one of ``types`` (quantized layers stay) whose weight has one of
    ``dtypes``, and every such plain fused projection; returns the number of GEMMs swapped. Linears inside a
    fused group are left alone (the group's GEMM is the fused one: no second copy)."""
    n = 0
    in_fused: set[int] = set()
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        for fused, parts, attr, owner in (
            (a.qkv, (a.q_proj, a.k_proj, a.v_proj), "qkv", a),
            (m.gate_up, (m.gate_proj, m.up_proj), "gate_up", m),
        ):
            if not isinstance(fused, FusedLinear):
                continue
            in_fused.update(id(p) for p in parts)  # swapped or not, the group's GEMM is the fused one
            w = fused.weight
            if type(fused) is FusedLinear and w.dtype in dtypes and w.device.type == "cpu":
                setattr(owner, attr, make_fused(fused))
                n += 1
    for mod in list(model.modules()):
        for cname, child in list(mod.named_children()):
            if (
                type(child) in types
                and id(child) not in in_fused
                and child.weight.dtype in dtypes
                and child.weight.device.type == "cpu"
            ):
                setattr(mod, cname, make_linear(child))
                n += 1
    return n


def pack_linears(model: Transformer) -> int:
    """Swap every bf16 CPU ``nn.Linear`` for a ``OneDNNLinear`` and pack the fused projections; returns the
    number of GEMMs packed."""
    n = _swap_linears(model, (torch.bfloat16,), OneDNNLinear, PackedFused)
    log.debug("oneDNN-packed %d bf16 GEMMs", n)
    return n


def small_gemm_linears(model: Transformer) -> int:
    """Swap every fp32 CPU ``nn.Linear``, every fp16 ``StoredLinear`` (a CPU plan's) and their fused projections
    for the small-GEMM kernel (engine/kernels/cpu_gemm.py); returns the number of GEMMs swapped. Needs
    ``small_gemm_status() is None``."""
    n = _swap_linears(model, SMALL_GEMM_DTYPES, SmallGemmLinear, SmallGemmFused, types=(nn.Linear, StoredLinear))
    log.debug("%d fp32 GEMMs on the small-GEMM kernel", n)
    return n


def fast_cpu_linears(model: Transformer, device: torch.device, request: bool | None) -> tuple[int, str | None]:
    """The target's CPU linears on this dtype's fast kernel: bf16 -> oneDNN-packed weights, fp32 -> the
    small-GEMM kernel. ``request``: None uses it where it runs (saying why not in the log), True requires it
    (an ``InvalidConfigError`` naming what is missing), False keeps PyTorch's. -> (GEMMs swapped, kernel name
    or None)."""
    if request is not None and not isinstance(request, bool):
        raise InvalidConfigError(f"cpu_pack={request!r} is invalid: allowed None (where it runs), True, False")
    if request is False:
        return 0, None
    dt = model.norm.weight.dtype
    kernel: str | None = None
    if device.type != "cpu":
        why: str | None = f"device is {device.type!r}"
    elif dt == torch.bfloat16:
        kernel, why = "onednn-bf16", None if onednn_bf16_available() else "this CPU/PyTorch has no oneDNN bf16 kernels"
    elif dt == torch.float32:
        kernel, why = KERNEL_NAME, small_gemm_status()  # builds the kernel on first use
    else:
        why = f"no fast CPU kernel for dtype {str(dt).replace('torch.', '')}"
    if why is not None:
        if request:
            raise InvalidConfigError(
                f"cpu_pack=True is invalid here: {why} (allowed: device 'cpu' with dtype "
                f"bfloat16 and oneDNN bf16 kernels, or float32 and the small-GEMM kernel; "
                f"dtype={str(dt).replace('torch.', '')})"
            )
        if device.type == "cpu":
            log.info("CPU linears stay on PyTorch's kernels: %s", why)
        return 0, None
    if kernel == "onednn-bf16":
        return pack_linears(model), kernel
    # fp32: the float Linears on the small GEMM, a plan's INT8 ones (w8a16) on the int8 GEMM (cpu_int8.py)
    return small_gemm_linears(model) + install_int8_row_kernels(model), kernel


def packed_bytes(model: Transformer) -> int:
    """Bytes held by packed weight copies (on top of the weights themselves)."""
    total = sum(m.packed.numel() * m.packed.element_size() for m in model.modules() if isinstance(m, OneDNNLinear))
    for layer in model.layers:
        for f in (layer.self_attn.qkv, layer.mlp.gate_up):
            if isinstance(f, PackedFused):
                total += f.packed.numel() * f.packed.element_size()
    return total
