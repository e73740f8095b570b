"""A Linear stored in a narrower float dtype than the model computes in (engine/core/model.py fuses groups of
them as it fuses plain Linears; quant/apply.py makes them for a precision plan's fp16 attention on the CPU)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class StoredLinear(nn.Module):
    """A Linear whose weight is stored in a narrower float dtype than the model computes in (a precision plan's
    fp16 attention in a fp32 CPU model) and widened to the input's dtype per call. The weight keeps its dtype
    under ``.to(dtype)`` (the bias follows it); the C++ decode step reads the 16-bit weight as it is."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype) -> StoredLinear:
        """``linear``'s weight rounded to ``dtype`` (round to nearest), its bias as it is."""
        return cls(linear.weight.detach().to(dtype), None if linear.bias is None else linear.bias.detach())

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> StoredLinear:
        stored = self.weight.data
        super()._apply(fn, recurse)
        if self.weight.dtype != stored.dtype:  # a dtype cast: the storage stays (a device move still applies)
            self.weight.data = stored.to(self.weight.device)
        return self

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, storage={self.weight.dtype}"
