"""A Linear and an embedding table stored in a narrower float dtype than the model computes in (engine/core/model.py
fuses groups of StoredLinears as it fuses plain Linears; quant/apply.py makes both for a CPU precision plan's fp16
attention and verifier)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _frozen(weight: Tensor) -> nn.Parameter:
    """``weight`` as a parameter without gradient; a parameter as it is (a tied table stays one object)."""
    return weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)


class KeepsStorage(nn.Module):
    """A module whose ``weight`` keeps its storage dtype under ``.to(dtype)`` (a device move still applies) while
    ``keeps_storage`` holds (a kernel wrapper sets it for the stored weights it runs)."""

    weight: nn.Parameter
    keeps_storage = True

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> KeepsStorage:
        if not self.keeps_storage:
            return super()._apply(fn, recurse)
        stored = self.weight.data
        super()._apply(fn, recurse)
        if self.weight.dtype != stored.dtype:  # a dtype cast: the storage stays
            self.weight.data = stored.to(self.weight.device)
        return self


class StoredLinear(KeepsStorage):
    """A Linear whose weight is stored in a narrower float dtype than the model computes in (a precision plan's
    fp16 attention in a fp32 CPU model) and widened to the input's dtype per call. The weight keeps its dtype
    under ``.to(dtype)`` (the bias follows it); the C++ decode step reads the 16-bit weight as it is."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = _frozen(weight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype) -> StoredLinear:
        """``linear``'s weight rounded to ``dtype`` (round to nearest), its bias as it is."""
        return cls(linear.weight.detach().to(dtype), None if linear.bias is None else linear.bias.detach())

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, storage={self.weight.dtype}"


class StoredEmbedding(KeepsStorage):
    """An embedding table stored in a narrower float dtype than the model computes in (a CPU plan's fp16 verifier
    table, shared with a tied StoredLinear LM head); the looked-up rows are widened to the compute dtype, which a
    zero-size buffer tracks through ``.to(dtype)`` while the table keeps its storage."""

    def __init__(self, weight: Tensor, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.weight = _frozen(weight)
        self.register_buffer("compute", torch.empty(0, dtype=compute_dtype, device=weight.device), persistent=False)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, dtype: torch.dtype) -> StoredEmbedding:
        """``embedding``'s table rounded to ``dtype`` (round to nearest); rows widened to its current dtype."""
        w = embedding.weight
        return cls(w.detach().to(dtype), w.dtype)

    def forward(self, tokens: Tensor) -> Tensor:
        return F.embedding(tokens, self.weight).to(self.compute.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, storage={self.weight.dtype}, compute={self.compute.dtype}"
