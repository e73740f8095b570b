"""What a trained head's drafter needs from a kernel of its step (the kernels layer satisfies these without
importing them: engine/kernels/cpu_head.py ``EagleKernel``, ``MedusaKernel``, ``AttnHeadKernel``,
``Eagle3HeadKernel``)."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from engine.core.forward import KVCache, TreeMask


class EagleStepKernel(Protocol):
    """The head's step on a kernel (engine/kernels/cpu_head.py ``EagleKernel``)."""

    def __call__(self, f: Tensor, tok: Tensor) -> tuple[Tensor, Tensor]:
        """(features [B, H], the tokens they precede [B]) -> (the next features, their logits [B, V'])."""
        ...

    def greedy(self, f: Tensor, tok: Tensor, k: int) -> Tensor:
        """k greedy drafts from (features [B, H], tokens [B]) -> [B, k] ids of the full vocabulary."""
        ...


class MedusaStepKernel(Protocol):
    """Medusa's step on a kernel (engine/kernels/cpu_head.py ``MedusaKernel``)."""

    def __call__(self, f: Tensor, n: int) -> Tensor:
        """Features [B, H] -> the first n heads' logits over the draft vocabulary [B, n, V']."""
        ...

    def greedy(self, f: Tensor, n: int) -> Tensor:
        """Features [B, H] -> the first n heads' greedy drafts [B, n], ids of the full vocabulary."""
        ...


class AttnStepKernel(Protocol):
    """A head's layers over its own KV cache and its scores on a kernel (engine/kernels/cpu_head.py
    ``AttnHeadKernel``, ``Eagle3HeadKernel``)."""

    def __call__(
        self,
        f: Tensor,
        e: Tensor,
        pos: Tensor,
        rows: Tensor | None,
        cache: KVCache,
        kv_len: int,
        last: Tensor,
        tree: TreeMask | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Entries (features f, next tokens' embeddings e [B, T, H]) at positions pos [B, T] in cache rows ``rows``
        -> (scores [B, V'], the next features [B, H]) of each row's entry ``last`` [B] (or [B, J], [B, J, ..] of
        J entries each); ``tree``: a draft tree's entries, in its slots under its mask (None: by position)."""
        ...
