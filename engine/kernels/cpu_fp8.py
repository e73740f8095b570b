"""A precision plan's FP8 modules (a draft's) as the C++ decode step reads them: dequantized once, held in the
step's weight dtype.

The CPU has no FP8 arithmetic: ``fp8/weight-only`` computes x @ (q * s)^T from the e4m3 bytes q and per-row
float32 scales s, and an ``FP8Embedding`` looks up q * s. The step holds q * s, formed in float32 as
``quant.fp8.dequantize_fp8`` forms it: in float32 it computes exactly what weight-only computes; a 16-bit
copy (a draft's ``"auto"`` step) rounds it, which moves only the acceptance. ``fp8/native`` also quantizes
each activation row to e4m3, which the step does not do: such a model stays on PyTorch's ops, so that what
runs (and the acceptance a build measures) is the plan's function. Nothing else is kept: the e4m3 bytes
stay the module's, and the weight-only kernel's dequantized float32 copy is never made, since every
cached forward of the model goes through the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from quant.fp8 import dequantize_fp8
from quant.linear import FP8Embedding, FP8Linear


def fp8_reason(mod: FP8Linear) -> str | None:
    """None when the step computes what this FP8 Linear computes, else why not."""
    if mod.kernel == "weight-only":
        return None
    return f"is FP8 with kernel {mod.kernel!r}, which quantizes activations (the step reads weight-only FP8)"


def fp8_weight(parts: Sequence[nn.Module]) -> Tensor:
    """The FP8 Linears' weights dequantized in float32, stacked as the slot fuses them (q/k/v, gate/up)."""
    ws = [dequantize_fp8(p.weight, p.weight_scale) for p in parts]  # type: ignore[arg-type]
    return ws[0] if len(ws) == 1 else torch.cat(ws)


def fp8_table(emb: FP8Embedding) -> Tensor:
    """The embedding table as its lookups return it, in float32."""
    return dequantize_fp8(emb.weight, emb.weight_scale)
