"""fp32 linears on the CPU with MKL-packed weights for the verify shapes.

PyTorch's default CPU linear changes kernels with the number of rows: on a
2-core x86 machine a 5-row matmul (a verify pass at K = 4) costs ~1.8x a 1-row
one (a decode step), which eats most of what speculation saves. MKL's packed
GEMM (``torch.ops.mkl._mkl_linear``, the path torch.compile's CPU freezing
takes) with the weight reordered for a fixed row count M costs ~1.1x a decode
step for every M up to 8. A ``PackedLinear`` keeps the weight (used as is for
small and very large inputs) plus one packed copy per row bucket; an input of
M rows is zero-padded up to the smallest bucket >= M. Rows never mix in a GEMM,
so padding does not change the real rows' values.

This is a swap of ``nn.Linear`` modules (``pack_linears``), like quantization;
each bucket costs one more copy of the weights (reported by ``packed_bytes``).
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (8, 16, 32)
MIN_ROWS = 4  # below this the default kernel is as fast (measured: 1-3 rows ~ 1 decode step)


def packing_available() -> bool:
    """MKL is in this PyTorch build and exposes the packed linear ops."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        torch.ops.mkl._mkl_reorder_linear_weight  # noqa: B018 (resolves the op or raises)
        torch.ops.mkl._mkl_linear  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


class PackedLinear(nn.Module):
    """Same API and parameters as the ``nn.Linear`` it replaces; packed buffers are not saved."""

    def __init__(self, linear: nn.Linear, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 min_rows: int = MIN_ROWS) -> None:
        super().__init__()
        w = linear.weight
        if w.device.type != "cpu" or w.dtype != torch.float32:
            raise ValueError(f"PackedLinear needs an fp32 CPU weight, got {w.dtype} on {w.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # shared (a tied LM head stays tied to the embedding)
        self.bias = linear.bias
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        self.min_rows = min_rows
        for b in self.buckets:
            self.register_buffer(f"packed_{b}", torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), b),
                                 persistent=False)

    def _bucket(self, m: int) -> int | None:
        if m < self.min_rows:
            return None
        for b in self.buckets:
            if m <= b:
                return b
        return None

    def forward(self, x: Tensor) -> Tensor:
        m = x.numel() // self.in_features
        b = self._bucket(m)
        if b is None:
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(m, self.in_features)
        if m < b:
            x2 = F.pad(x2, (0, 0, 0, b - m))
        y = torch.ops.mkl._mkl_linear(x2, getattr(self, f"packed_{b}"), self.weight, self.bias, b)
        return y[:m].view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, buckets={self.buckets}, min_rows={self.min_rows}"


def pack_linears(model: nn.Module, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """Swap every fp32 CPU ``nn.Linear`` (exactly that class: quantized layers stay) for a
    ``PackedLinear``; returns the number swapped."""
    n = 0
    for mod in list(model.modules()):
        for cname, child in list(mod.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
                setattr(mod, cname, PackedLinear(child, buckets))
                n += 1
    log.debug("packed %d linears for row buckets %s", n, tuple(buckets))
    return n


def packed_bytes(model: nn.Module) -> int:
    """Bytes held by packed weight copies (on top of the weights themselves)."""
    return sum(b.numel() * b.element_size() for n, b in model.named_buffers()
               if n.rsplit(".", 1)[-1].startswith("packed_"))
