"""A trained draft head's step (engine/spec/heads.py) on the few-row CPU kernel (engine/kernels/cpu_gemm.py).

Why: a head's step is a few GEMMs on one row per sequence (EAGLE: the fc over [feature; embedding],
each MLP block's gate/up and down; every kind: the shared LM head's scores). PyTorch's fp32 linear
(MKL) streams such weights at about half the kernel's rate, so the step, not the head's size, set
its cost (docs/performance.md has the figures).

``head_linears_on_kernel`` swaps the head's own fp32 Linears for ``SmallGemmLinear`` reading 16-bit
copies: the head is the draft, so rounding its weights moves only the acceptance, as for a draft
model's C++ step. ``scorer_on_kernel`` puts the shared LM head's scorer on the kernel reading the
target's fp32 weight itself: it stays at the verifier's precision. Medusa's heads (one einsum over
their stacked weights, engine/spec/heads.py) stay on PyTorch; their scorer moves.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.core.checkpoint import DTYPES
from engine.kernels.cpu_decode import exact_dtype
from engine.kernels.cpu_gemm import STORE_DTYPES, SmallGemmLinear

log = logging.getLogger(__name__)


def _plain(mod: nn.Module) -> bool:
    w = getattr(mod, "weight", None)
    return type(mod) is nn.Linear and w is not None and w.dtype == torch.float32 and w.device.type == "cpu"


def head_store_dtype(head: nn.Module, store: str | torch.dtype | None) -> torch.dtype:
    """The dtype of the head's kernel weight copies: ``store`` by name or dtype; None or "auto": bfloat16 or
    float16 where every weight of the head's Linears has that value (lossless), else float16."""
    if store is None or store == "auto":
        weights = [m.weight for m in head.modules() if _plain(m)]
        exact = exact_dtype(weights) if weights else torch.float32
        return torch.float16 if exact == torch.float32 else exact
    dtype = DTYPES.get(store, store) if isinstance(store, str) else store
    if dtype not in STORE_DTYPES:
        raise ValueError(f"store={store!r} is invalid: allowed auto, {', '.join(map(str, STORE_DTYPES))}")
    return dtype  # type: ignore[return-value]


def head_linears_on_kernel(head: nn.Module, store: torch.dtype) -> int:
    """Swap every plain fp32 CPU ``nn.Linear`` inside ``head`` for a ``SmallGemmLinear`` reading a ``store``
    copy; returns how many. Quantized Linears (the precision plan's FP8) stay as they are."""
    n = 0
    for mod in list(head.modules()):
        for name, child in list(mod.named_children()):
            if _plain(child):
                setattr(mod, name, SmallGemmLinear(child, store=store))  # type: ignore[arg-type]
                n += 1
    log.debug("%d head Linears on the small-GEMM kernel (%s copies)", n, store)
    return n


def scorer_on_kernel(scorer: nn.Linear) -> nn.Module:
    """The LM head's scorer (engine/spec/heads.py ``draft_lm_head``) on the kernel, on the same fp32 weight."""
    return SmallGemmLinear(scorer) if _plain(scorer) else scorer
