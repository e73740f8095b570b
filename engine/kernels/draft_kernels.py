"""The one place that chooses the kernels a drafter's steps run on (``DraftKernels`` of
engine/spec_decode/drafter.py, which this satisfies without importing it): a trained head's step as one C++ call
on the CPU (engine/kernels/cpu_head.py), its scorer on the few-row GEMM, or CUDA graphs of its PyTorch step
(engine/kernels/head_graphs.py). Where a kernel cannot run, the drafter keeps PyTorch's ops and the log says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from engine.kernels.cpu_head import (
    AttnHeadKernel,
    AttnHeadLayers,
    Eagle3HeadKernel,
    Eagle3Layers,
    EagleKernel,
    MedusaKernel,
    head_gemm_weight,
    head_kernel_reason,
    head_store_dtype,
    scorer_on_kernel,
)
from engine.kernels.cudagraphs import GraphPool
from engine.kernels.head_graphs import GraphedStep

log = logging.getLogger(__name__)


class KernelHead(Protocol):
    """A trained head as the kernels read it (engine/spec_decode/heads/modules.py)."""

    def kernel_weights(self, gemm: Callable[[nn.Module], Tensor | None]) -> list[Tensor | None]:
        """The tensors of its C++ step, in the kernel's order, each Linear's weight as ``gemm`` reads it (None:
        one the step cannot read)."""
        ...


@dataclass
class DraftKernelChooser:
    """Chooses per drafter step; ``chosen`` records what was picked (for ``Engine.info``)."""

    device: torch.device
    cpu_kernels: bool
    """The fp32 target runs on the few-row CPU kernel (the heads' C++ steps run beside it)."""
    store: str | None = None
    """``KernelOptions.draft_step_weights``: the C++ steps' GEMM weight storage (None: lossless 16-bit, else fp16)."""
    cuda_graphs: bool = False
    batch_buckets: tuple[int, ...] = (1,)
    emulate: bool = False
    pool: GraphPool | None = None
    graphs: list[GraphedStep] = field(default_factory=list)
    """The step graphs made (their counters go into the engine's stats)."""
    chosen: dict[str, Any] = field(default_factory=lambda: {"draft_head_step_weights": None})

    def scorer(self, scorer: nn.Linear) -> nn.Module:
        """The LM head rows on the few-row GEMM where the CPU kernels run and graphs are off."""
        return scorer_on_kernel(scorer) if self.cpu_kernels and not self.cuda_graphs else scorer

    def graph_step(self, fn: Callable[..., Any], name: str, n_static: int = 0) -> GraphedStep | None:
        if not self.cuda_graphs:
            return None
        kw = {"emulate": self.emulate, "pool": self.pool, "name": name, "n_static": n_static}
        g = GraphedStep(fn, self.device, self.batch_buckets, **kw)
        self.graphs.append(g)
        return g

    def eagle_step(
        self, head: KernelHead, embed: Tensor, scorer: nn.Linear, vocab_ids: Tensor | None, eps: float
    ) -> EagleKernel | None:
        weights = head.kernel_weights(head_gemm_weight)
        store = self._store("eagle", weights, [scorer.weight, embed])
        if store is None:
            return None
        return EagleKernel([w for w in weights if w is not None], embed, scorer.weight, vocab_ids, eps, store)

    def medusa_step(
        self, head: KernelHead, scorer: nn.Linear, vocab_ids: Tensor | None, vocab: int
    ) -> MedusaKernel | None:
        weights = head.kernel_weights(head_gemm_weight)
        store = self._store("medusa", weights, [scorer.weight])
        if store is None:
            return None
        w, b = weights
        assert w is not None and b is not None
        return MedusaKernel(w, b, scorer.weight, vocab_ids, vocab, store)

    def attn_head_step(self, head: AttnHeadLayers, scorer: nn.Linear) -> AttnHeadKernel | None:
        why = None if self.cpu_kernels else "the target is not on the CPU kernels"
        mlps = [layer.mlp for layer in head.layers]
        if any(m.bias is not None for mlp in mlps for m in (mlp.gate_proj, mlp.up_proj)):
            why = why or "the kernel has no gate/up bias (mlp_bias)"
        ws = head.kernel_weights(head_gemm_weight)
        why = why or head_kernel_reason(ws, [scorer.weight])
        if why is not None:
            log.info("the eagle head's layers stay on PyTorch: %s", why)
            return None
        store = head_store_dtype([w for w in ws if w is not None], self.store)
        self.chosen["draft_head_step_weights"] = str(store).replace("torch.", "")
        return AttnHeadKernel(head, scorer.weight, store)

    def eagle3_step(self, head: Eagle3Layers) -> Eagle3HeadKernel | None:
        """EAGLE-3's layer, norm and its own scores as one C++ call, or None (the log says why)."""
        weights = head.kernel_weights(head_gemm_weight)
        store = self._store("eagle3", weights, [])
        if store is None:
            return None
        return Eagle3HeadKernel(head, [w for w in weights if w is not None], store)

    def _store(self, kind: str, weights: list[Tensor | None], shared: list[Tensor]) -> torch.dtype | None:
        """The C++ step's storage for a head's GEMM weights (it also reads the target's ``shared`` tensors), or
        None: PyTorch's step (the log says why)."""
        if not self.cpu_kernels or self.cuda_graphs:  # (graphs capture the PyTorch step)
            return None
        why = head_kernel_reason(weights, shared)
        if why is not None:
            log.info("the %s head's step stays on PyTorch: %s", kind, why)
            return None
        store = head_store_dtype([w for w in weights if w is not None and w.dim() >= 2], self.store)
        self.chosen["draft_head_step_weights"] = str(store).replace("torch.", "")
        return store
